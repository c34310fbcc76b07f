"""Shared test helpers: deterministic inputs and the float64 reference."""

from __future__ import annotations

import torch

import ulysses_cp as ucp
from tests.distributed import COLLECTIVE_TIMEOUT_S


def make_qkv(
    seed: int, b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype = torch.float64
):
    """Full q, k, v, dout, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def reference(q, k, v, dout, causal: bool, softmax_scale=None):
    """Full attention in float64 on the math backend: (out, dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = ucp.local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend="math")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), dq, dk, dv


def sharded_run(q, k, v, dout, topo, *, causal, layout, backend, softmax_scale=None):
    """Shard full tensors, run ucp.attention + backward, gather out and grads."""
    ql, kl, vl = (
        ucp.shard_sequence(t, topo, layout=layout).detach().requires_grad_() for t in (q, k, v)
    )
    dl = ucp.shard_sequence(dout, topo, layout=layout)
    out = ucp.attention(
        ql, kl, vl, topo, causal=causal, layout=layout, backend=backend, softmax_scale=softmax_scale
    )
    out.backward(dl)
    return [
        ucp.gather_sequence(t, topo, layout=layout).detach()
        for t in (out, ql.grad, kl.grad, vl.grad)
    ]


_TOPOS: dict = {}


def topology(u: int, r: int):
    """One topology per degrees per process (group creation is collective and slow)."""
    if (u, r) not in _TOPOS:
        _TOPOS[(u, r)] = ucp.init_topology(u, r, timeout_s=COLLECTIVE_TIMEOUT_S)
    return _TOPOS[(u, r)]


def ds_config(
    u: int, r: int, stage: int, *, micro_batch: int = 1, backend: str = "torch", **sp
) -> dict:
    """A DeepSpeed config for one-step tests: clipping 1.0 (DeepSpeed's default, explicit),
    a client optimizer, ZeRO ``stage``, our block with degrees, backend and ``sp`` extras."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "sequence_parallel": {
            "ulysses_degree": u,
            "ring_degree": r,
            "attention_backend": backend,
            **sp,
        },
    }
