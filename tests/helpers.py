"""Shared test helpers: deterministic inputs, the float64 reference, a tiny model,
process groups and configs, and runs of train.py under the deepspeed launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import ulysses_cp as ucp
from tests.distributed import COLLECTIVE_TIMEOUT_S
from ulysses_cp.models.decoder import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
# the tiny Hugging Face configs of the HF tests (4 heads, 2 kv heads, vocabulary 96)
HF_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_dropout=0.0,
)


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


def reference(q, k, v, dout, causal: bool, softmax_scale=None, bounds=None, window=(-1, -1)):
    """Full attention in float64, written here independently of ulysses_cp's kernels: an
    explicit (causal, and block-diagonal for packed ``bounds``) mask, ``torch.softmax``,
    and autograd for the gradients. Returns ``[out, dq, dk, dv]``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    hq, hkv, n = q.shape[2], k.shape[2], q.shape[1]
    kk, vv = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))  # head i uses kv i // g
    mask = torch.ones(n, n, dtype=torch.bool)
    if bounds is not None:
        doc = torch.zeros(n, dtype=torch.long)
        for i, (a, b) in enumerate(zip(list(bounds)[:-1], list(bounds)[1:])):
            doc[a:b] = i
        mask &= doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(n, n, dtype=torch.bool).tril()
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if window[0] >= 0:  # flash-attn's sliding window
        mask &= j >= i - window[0]
    if window[1] >= 0:
        mask &= j <= i + window[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double())]


def sdpa_attention(q, k, v, causal: bool = True):
    """Single-process attention through PyTorch's SDPA (an independent reference for model
    tests): ``(b, s, h, d)`` in and out, GQA by head counts."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2)


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


def topology(u: int, r: int, layout: str = "zigzag", **options):
    """One set of process groups per degrees per process (group creation is collective and
    slow), with the run's ``layout`` and other ``options`` (``ucp.RunOptions`` fields)."""
    if (u, r) not in _TOPOS:
        _TOPOS[(u, r)] = ucp.init_topology(u, r, timeout_s=COLLECTIVE_TIMEOUT_S)
    return _TOPOS[(u, r)].with_options(layout=layout, **options)


def topology_for(config: dict):
    """The cached groups of :func:`topology` with the run's choices of ``config`` (what
    ``ucp.topology_from_config`` gives, without creating new groups per engine)."""
    sp = config["sequence_parallel"]
    options = ucp.run_options(config)
    return topology(
        sp.get("ulysses_degree", 1),
        sp.get("ring_degree", 1),
        **asdict(options),
    )


def ds_config(
    u: int, r: int, stage: int, *, micro_batch: int = 1, backend: str = "torch", **sp
) -> dict:
    """A DeepSpeed config for one-step tests: no gradient clipping (clipping at a norm below
    the gradient's would hide a gradient off by a constant factor), a client optimizer, ZeRO
    ``stage``, our block with degrees, backend and ``sp`` extras."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "sequence_parallel": {
            "ulysses_degree": u,
            "ring_degree": r,
            "attention_backend": backend,
            **sp,
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    cfg_path: Path, out: Path, *extra: str, num_gpus: int = 2, script: Path = ROOT / "train.py"
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(free_port()),
        str(script),
        "--deepspeed_config",
        str(cfg_path),
        "--output_dir",
        str(out),
        *extra,
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# DeepSpeed refuses fp16 where its accelerator cannot run it: on a CPU, one without fp16
# support in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported(), e.g. no AVX512-FP16)
needs_fp16 = pytest.mark.skipif(
    not _fp16_supported(),
    reason="DeepSpeed refuses fp16 on this device (a CPU without oneDNN fp16 support)",
)


def hf_pair(cfg, topo, backend="math"):
    """(model through ``ucp.attention``, single-process sdpa reference): the same Hugging
    Face config, the same float64 weights."""
    import copy

    import transformers

    from ulysses_cp.models import hf

    hf.register_attention(topo, backend=backend)
    torch.manual_seed(0)
    sp = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="ulysses_cp", dtype=torch.float64
    )
    ref = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float64
    )
    ref.load_state_dict(sp.state_dict())
    return sp, ref
