"""Local attention backends behind one signature that returns ``(out, lse)``.

Legend: b batch, sq/sk query/key tokens, hq/hkv query/key-value heads (``hq % hkv == 0``,
query head i uses kv head ``i // (hq // hkv)``), d head dim.

Layout is flash-attn's: q ``(b, sq, hq, d)``, k/v ``(b, sk, hkv, d)``, out ``(b, sq, hq, d)``
in q's dtype, lse ``(b, hq, sq)`` in float32 (float64 for float64 inputs).

- :func:`attn_forward` / :func:`attn_backward` are the primitives (no autograd). The
  backward takes the final ``out`` and ``lse``; given those of a larger softmax (ring
  attention merges blocks) it returns that block's exact share of the gradient
  (FlashAttention-2, Dao 2023, Algorithm 2).
- :func:`local_attention` is the differentiable wrapper used by the Ulysses mode.

Backends: ``"math"`` (pure PyTorch, any dtype), ``"torch"`` (torch's fused kernels: the CPU
flash kernel, or the memory-efficient kernel on CUDA), ``"flash_attn"`` (flash-attn 2 on
CUDA, imported lazily), ``"auto"`` (flash_attn on CUDA when importable, else torch).
Causal masking needs ``sq == sk`` (the diagonal block); callers slice off-diagonal blocks.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Literal, get_args

import torch

from . import flash_backend

Backend = Literal["auto", "flash_attn", "torch", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend; raise ``ValueError`` for unusable choices."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attn"
        return "torch"
    if backend == "flash_attn":
        if device.type != "cuda":
            raise ValueError(
                f"backend 'flash_attn' needs CUDA tensors, got device {device}; "
                "use backend='torch' or 'math' on CPU"
            )
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                "backend 'flash_attn' requested but flash-attn is not installed; "
                "install it with `pip install .[gpu]` or use backend='torch'"
            )
    return backend


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    assert not causal or q.shape[1] == k.shape[1], "causal blocks must be square"


# ---------------------------------------------------------------- math (reference) backend


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    # (b, sk, hkv, d) -> (b, sk, hq, d): kv head j serves query heads [j*g, (j+1)*g)
    return x.repeat_interleave(hq // x.shape[2], dim=2)


def _reduce_kv(grad: torch.Tensor, hkv: int) -> torch.Tensor:
    # (b, sk, hq, d) -> (b, sk, hkv, g, d) -> sum over the g query heads of each kv head
    b, s, hq, d = grad.shape
    return grad.reshape(b, s, hkv, hq // hkv, d).sum(3)


def _math_probs(q, k, lse, causal, scale, cdt):
    # scores (b, hq, sq, sk) in the compute dtype; probabilities given the row lse
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(cdt), _expand_kv(k, q.shape[2]).to(cdt)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)  # (b, hq, sq)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # empty rows -> p = 0
    return torch.exp(s - safe.unsqueeze(-1)), lse


def _math_forward(q, k, v, causal, scale):
    cdt = lse_dtype(q.dtype)
    p, lse = _math_probs(q, k, None, causal, scale, cdt)
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).to(cdt))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    cdt = lse_dtype(q.dtype)
    hq, hkv = q.shape[2], k.shape[2]
    p, _ = _math_probs(q, k, lse.to(cdt), causal, scale, cdt)  # (b, hq, sq, sk)
    do = dout.to(cdt)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)  # (b, sk, hq, d)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, _expand_kv(v, hq).to(cdt))
    delta = (do * out.to(cdt)).sum(-1).transpose(1, 2)  # (b, hq, sq)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, hq).to(cdt))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(cdt))
    return dq.to(q.dtype), _reduce_kv(dk, hkv).to(k.dtype), _reduce_kv(dv, hkv).to(v.dtype)


# ---------------------------------------------------------------- torch fused kernels


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d)


def _torch_forward(q, k, v, causal, scale):
    if q.device.type == "cuda":
        kq, vq = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _bhsd(kq), _bhsd(vq), None, True, 0.0, causal, scale=scale
        )
        return _bhsd(out), lse[..., : q.shape[1]].float()
    # CPU flash kernel: (b, h, s, d), GQA native, lse (b, hq, sq) fp32 (fp64 for fp64)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
    )
    return _bhsd(out), lse


def _torch_backward(dout, q, k, v, out, lse, causal, scale):
    out = out.to(q.dtype)
    if q.device.type == "cuda":
        hq, hkv = q.shape[2], k.shape[2]
        kq, vq = _expand_kv(k, hq), _expand_kv(v, hq)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout).contiguous(),
            _bhsd(q),
            _bhsd(kq),
            _bhsd(vq),
            None,
            _bhsd(out),
            lse.float().contiguous(),
            zero,
            zero,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return _bhsd(dq), _reduce_kv(_bhsd(dk), hkv), _reduce_kv(_bhsd(dv), hkv)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout).contiguous(),
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        _bhsd(out),
        lse.to(lse_dtype(q.dtype)).contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


# ---------------------------------------------------------------- dispatch

_FORWARD = {"math": _math_forward, "torch": _torch_forward, "flash_attn": flash_backend.forward}
_BACKWARD = {"math": _math_backward, "torch": _torch_backward, "flash_attn": flash_backend.backward}


def _doc_groups(cu_q, cu_k):
    """Documents of a packed block grouped by (q length, k length), so each group is one
    batched kernel call: ``[(q index, k index, n docs, lq, lk)]``; empty documents dropped."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert len(bq) == len(bk), "cu_q and cu_k must list the same documents"
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if b > a and d > c:
            groups.setdefault((b - a, d - c), []).append((a, c))
    device = cu_q.device
    out = []
    for (lq, lk), starts in groups.items():
        sq, sk = (torch.tensor(x, device=device)[:, None] for x in zip(*starts))
        qi = (sq + torch.arange(lq, device=device)).flatten()
        ki = (sk + torch.arange(lk, device=device)).flatten()
        out.append((qi, ki, len(starts), lq, lk))
    return out


def _take(x, idx, n, length):
    # (1, t, h, d) rows idx -> (n, length, h, d)
    return x[0].index_select(0, idx).view(n, length, *x.shape[2:])


def _one_document(q, k, cu_q, cu_k) -> bool:
    """A block that is one whole document on both sides: the dense call, no gathers."""
    return len(cu_q) == 2 and cu_q.tolist() == [0, q.shape[1]] and cu_k.tolist() == [0, k.shape[1]]


def _varlen_forward(q, k, v, cu_q, cu_k, causal, scale, backend):
    if _one_document(q, k, cu_q, cu_k):
        return _FORWARD[backend](q, k, v, causal, scale)
    if backend == "flash_attn":
        return flash_backend.varlen_forward(q, k, v, cu_q, cu_k, causal, scale)
    out = torch.zeros_like(q)
    hq = q.shape[2]
    lse = torch.full((1, hq, q.shape[1]), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for qi, ki, n, lq, lk in _doc_groups(cu_q, cu_k):  # rows in no document stay (0, -inf)
        assert not causal or lq == lk, "causal documents must be square"
        o, lg = _FORWARD[backend](
            _take(q, qi, n, lq), _take(k, ki, n, lk), _take(v, ki, n, lk), causal, scale
        )
        out[0].index_copy_(0, qi, o.reshape(n * lq, hq, -1).to(out.dtype))
        lse[0].index_copy_(1, qi, lg.transpose(0, 1).reshape(hq, n * lq).to(lse.dtype))
    return out, lse


def _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, backend):
    if _one_document(q, k, cu_q, cu_k):
        return _BACKWARD[backend](dout, q, k, v, out, lse, causal, scale)
    if backend == "flash_attn":
        return flash_backend.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hq = q.shape[2]
    for qi, ki, n, lq, lk in _doc_groups(cu_q, cu_k):
        lg = lse[0].index_select(1, qi).view(hq, n, lq).transpose(0, 1)  # (n, hq, lq)
        gq, gk, gv = _BACKWARD[backend](
            _take(dout, qi, n, lq),
            _take(q, qi, n, lq),
            _take(k, ki, n, lk),
            _take(v, ki, n, lk),
            _take(out, qi, n, lq),
            lg.contiguous(),
            causal,
            scale,
        )
        dq[0].index_copy_(0, qi, gq.reshape(n * lq, *q.shape[2:]).to(dq.dtype))
        dk[0].index_copy_(0, ki, gk.reshape(n * lk, *k.shape[2:]).to(dk.dtype))
        dv[0].index_copy_(0, ki, gv.reshape(n * lk, *v.shape[2:]).to(dv.dtype))
    return dq, dk, dv


def attn_forward(
    q, k, v, *, causal: bool, softmax_scale: float | None, backend: str, cu_q=None, cu_k=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) fp32/fp64)``; no autograd.

    Packed (``cu_q``/``cu_k`` given, batch 1): document i's queries
    ``q[:, cu_q[i]:cu_q[i+1]]`` attend only its keys ``k[:, cu_k[i]:cu_k[i+1]]``; rows in
    no document come back empty (out 0, lse -inf). Causal documents must be square."""
    scale = default_scale(q, softmax_scale)
    with torch.no_grad():
        if cu_q is not None:
            return _varlen_forward(q, k, v, cu_q, cu_k, causal, scale, backend)
        _check_causal(q, k, causal)
        return _FORWARD[backend](q, k, v, causal, scale)


def attn_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal: bool,
    softmax_scale: float | None,
    backend: str,
    accumulate: bool = False,
    cu_q=None,
    cu_k=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` from the final ``out`` and ``lse``, in the inputs' dtypes.

    ``accumulate=True`` (ring attention, which sums block gradients): for bf16/fp16 inputs
    on the CPU the block is computed on float32 copies and its gradients come back in
    float32, so they are not rounded to 16 bits before they are summed. flash-attn and the
    CUDA kernels return the input dtype either way. ``cu_q``/``cu_k``: as in
    :func:`attn_forward`."""
    scale = default_scale(q, softmax_scale)
    low = q.dtype in (torch.bfloat16, torch.float16)
    if accumulate and low and q.device.type == "cpu" and backend in ("math", "torch"):
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    with torch.no_grad():
        if cu_q is not None:
            return _varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, backend)
        _check_causal(q, k, causal)
        return _BACKWARD[backend](dout, q, k, v, out, lse, causal, scale)


class SavedAttention(torch.autograd.Function):
    """``fwd(q, k, v, **opts) -> (out, lse)`` in forward, saving q, k, v, out (in q's dtype)
    and lse; ``bwd(dout, q, k, v, out, lse, **opts) -> (dq, dk, dv)`` in backward. Serves
    the local kernel and ring attention alike."""

    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd, opts):
        out, lse = fwd(q, k, v, **opts)
        out = out.to(q.dtype)  # as returned: no extra copy when it already is
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd, ctx.opts = bwd, opts
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.bwd(dout, q, k, v, out, lse, **ctx.opts), None, None, None)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable single-device attention, ``(b, s, hq, d)`` in and out.

    ``cu_seqlens``: int32 document boundaries of a packed row (batch 1); attention stays
    inside each document."""
    backend = resolve_backend(backend, q.device)
    opts = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
    if cu_seqlens is not None:
        opts.update(cu_q=cu_seqlens, cu_k=cu_seqlens)
    return SavedAttention.apply(q, k, v, attn_forward, attn_backward, opts)
