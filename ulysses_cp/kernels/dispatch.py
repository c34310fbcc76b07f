"""Local attention behind one signature that returns ``(out, lse)``.

Legend: b batch, sq/sk query/key tokens, hq/hkv query/key-value heads (``hq % hkv == 0``,
query head i uses kv head ``i // (hq // hkv)``), d head dim.

Layout is flash-attn's: q ``(b, sq, hq, d)``, k ``(b, sk, hkv, d)``, v ``(b, sk, hkv, dv)``,
out ``(b, sq, hq, dv)`` in q's dtype, lse ``(b, hq, sq)`` in float32 (float64 for float64
inputs); ``dv`` is ``d`` except for MLA (:mod:`.widths`).

- :func:`attn_forward` / :func:`attn_backward` are the primitives (no autograd), for one
  :class:`KernelCall` (the spec, the backend, and where the block sits). The backward takes
  the final ``out`` and ``lse``; given those of a larger softmax (ring attention merges
  blocks) it returns that block's exact share of the gradient (FlashAttention-2, Dao 2023,
  Algorithm 2).
- :func:`local_attention` is the differentiable single-device call.

Causal masking needs ``sq == sk`` (the diagonal block); callers slice off-diagonal blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from . import flash3_backend, flash4_backend, flash_backend, widths
from .backends import NATIVE_WIDTHS as _NATIVE_WIDTHS
from .backends import Kernel, backward_of, forward_of, resolve_backend
from .blocks import block_scores, doc_groups, doc_scores, one_document, take, window_band, work
from .math_backend import lse_dtype
from .sinks import SavedAttention
from .spec import AttentionSpec, Scores

__all__ = [
    "KernelCall",
    "attend_local",
    "attn_backward",
    "attn_forward",
    "local_attention",
]


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One local kernel call on one block: what to compute, with which kernel, and where.

    Attributes:
        spec: The attention's spec (causal, scale, softcap, window, sinks).
        backend: A resolved backend name (not ``"auto"``) or a ``Kernel``.
        causal: None takes the spec's; ring blocks off the diagonal are False.
        cu_q: Packed rows (batch 1): the queries' local int32 document boundaries.
        cu_k: The keys' boundaries, as ``cu_q``.
        offset: Tokens from the block's first key to its first query, for a window.
        chunk_offset: Packed rows: the same in chunks of each document's own length.
        accumulate: Block gradients are summed: bf16/fp16 blocks on the CPU are computed
            on float32 copies and return float32 gradients.
    """

    spec: AttentionSpec
    backend: str | Kernel
    causal: bool | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    offset: int = 0
    chunk_offset: int = 0
    accumulate: bool = False

    def at(self, **where: Any) -> KernelCall:
        """The same call on another block (``causal``, ``cu_q``, ``offset``...)."""
        return replace(self, **where)

    def scores(self, head_dim: int) -> Scores:
        """The block's scores before a window is folded in (:func:`block_scores`)."""
        causal = self.spec.causal if self.causal is None else self.causal
        return Scores(causal, self.spec.scale_for(head_dim), float(self.spec.softcap))


def _empty(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # no query sees a key: out 0 (b, sq, hq, dv), lse -inf (b, hq, sq)
    shape = (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(shape, float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    return q.new_zeros(*q.shape[:3], v.shape[-1]), lse


def _dense_scores(q: torch.Tensor, k: torch.Tensor, call: KernelCall) -> Scores | None:
    sq, sk = q.shape[1], k.shape[1]
    how = block_scores(call.scores(q.shape[-1]), call.spec.window, call.offset, sq, sk)
    assert how is None or how.band is not None or not how.causal or sq == sk, (
        "causal blocks must be square"
    )
    return how


def _dense_forward(q, k, v, call: KernelCall):
    how = _dense_scores(q, k, call)
    if how is None:  # no query sees a key: empty rows, no call
        work.skipped["forward"] += 1
        return _empty(q, v)
    work.count("forward", q, k)
    return forward_of(call.backend)(q, k, v, how)


def _dense_backward(dout, q, k, v, out, lse, call: KernelCall):
    how = _dense_scores(q, k, call)
    if how is None:
        work.skipped["backward"] += 1
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    work.count("backward", q, k)
    return backward_of(call.backend)(dout, q, k, v, out, lse, how)


# the backends with a packed-rows call of their own (module: varlen_forward/_backward)
_VARLEN = {
    "flash_attn": flash_backend,
    "flash_attn3": flash3_backend,
    "flash_attn4": flash4_backend,
}


def _flash_varlen(call: KernelCall, head_dim: int) -> Scores | None:
    """flash-attn's own varlen call, one window for every document (aligned blocks only)."""
    if not isinstance(call.backend, str) or call.backend not in _VARLEN or call.chunk_offset:
        return None
    base = call.scores(head_dim)
    band = window_band(call.spec.window, base.causal, 0)
    return base if band is None else Scores(False, base.scale, base.softcap, band)


def _varlen_forward(q, k, v, call: KernelCall):
    cu_q, cu_k = call.cu_q, call.cu_k
    assert cu_q is not None and cu_k is not None
    if one_document(q, k, cu_q, cu_k):
        return _dense_forward(q, k, v, call.at(offset=call.chunk_offset * q.shape[1]))
    hq = q.shape[2]
    flash = _flash_varlen(call, q.shape[-1])
    if flash is not None:
        work.scores["forward"] += doc_scores(cu_q, cu_k, hq)
        fwd = _VARLEN[call.backend].varlen_forward  # type: ignore[index]
        if call.backend in _NATIVE_WIDTHS:
            return fwd(q, k, v, (cu_q, cu_k), flash)
        return widths.forward(fwd, q, k, v, (cu_q, cu_k), flash)
    out, lse = _empty(q, v)  # rows in no document stay (0, -inf)
    base = call.scores(q.shape[-1])
    for qi, ki, n, lq, lk in doc_groups(cu_q, cu_k):
        assert not base.causal or lq == lk, "causal documents must be square"
        how = block_scores(base, call.spec.window, call.chunk_offset * lq, lq, lk)
        if how is None:
            work.skipped["forward"] += 1
            continue
        work.scores["forward"] += n * hq * lq * lk
        o, lg = forward_of(call.backend)(
            take(q, qi, n, lq), take(k, ki, n, lk), take(v, ki, n, lk), how
        )
        out[0].index_copy_(0, qi, o.reshape(n * lq, hq, -1).to(out.dtype))
        lse[0].index_copy_(1, qi, lg.transpose(0, 1).reshape(hq, n * lq).to(lse.dtype))
    return out, lse


def _varlen_backward(dout, q, k, v, out, lse, call: KernelCall):
    cu_q, cu_k = call.cu_q, call.cu_k
    assert cu_q is not None and cu_k is not None
    if one_document(q, k, cu_q, cu_k):
        block = call.at(offset=call.chunk_offset * q.shape[1])
        return _dense_backward(dout, q, k, v, out, lse, block)
    hq = q.shape[2]
    flash = _flash_varlen(call, q.shape[-1])
    if flash is not None:
        work.scores["backward"] += doc_scores(cu_q, cu_k, hq)
        args = (dout, q, k, v, out, lse, (cu_q, cu_k), flash)
        bwd = _VARLEN[call.backend].varlen_backward  # type: ignore[index]
        return bwd(*args) if call.backend in _NATIVE_WIDTHS else widths.backward(bwd, *args)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    base = call.scores(q.shape[-1])
    for qi, ki, n, lq, lk in doc_groups(cu_q, cu_k):
        how = block_scores(base, call.spec.window, call.chunk_offset * lq, lq, lk)
        if how is None:
            work.skipped["backward"] += 1
            continue
        work.scores["backward"] += n * hq * lq * lk
        lg = lse[0].index_select(1, qi).view(hq, n, lq).transpose(0, 1)  # (n, hq, lq)
        rows = (take(dout, qi, n, lq), take(q, qi, n, lq), take(k, ki, n, lk), take(v, ki, n, lk))
        gq, gk, gv = backward_of(call.backend)(*rows, take(out, qi, n, lq), lg.contiguous(), how)
        dq[0].index_copy_(0, qi, gq.reshape(n * lq, *q.shape[2:]).to(dq.dtype))
        dk[0].index_copy_(0, ki, gk.reshape(n * lk, *k.shape[2:]).to(dk.dtype))
        dv[0].index_copy_(0, ki, gv.reshape(n * lk, *v.shape[2:]).to(dv.dtype))
    return dq, dk, dv


def attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local kernel's forward, without autograd.

    Packed rows (``call.cu_q``/``cu_k``, batch 1): document i's queries attend only its
    keys; causal documents must be square. Rows that see no key come back empty (out 0,
    lse -inf).

    Args:
        q: Queries ``(b, sq, hq, d)``.
        k: Keys ``(b, sk, hkv, d)``.
        v: Values ``(b, sk, hkv, dv)``: like ``k``, their head dim may differ (MLA).
        call: The call: spec, backend and where the block sits.

    Returns:
        ``(out, lse)``: ``out (b, sq, hq, dv)`` in q's dtype and ``lse (b, hq, sq)`` in
        float32 (float64 for float64 inputs).
    """
    with torch.no_grad():
        if call.cu_q is not None:
            assert call.offset == 0, "packed rows take chunk_offset, not offset"
            return _varlen_forward(q, k, v, call)
        return _dense_forward(q, k, v, call)


def attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    call: KernelCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local kernel's backward, from the final ``out`` and ``lse``.

    Args:
        dout: The output's gradient, shaped like ``out``.
        q: Queries, as given to `attn_forward`.
        k: Keys, as given to `attn_forward`.
        v: Values, as given to `attn_forward`.
        out: The final output (after any merge of ring blocks).
        lse: The final log-sum-exp.
        call: The call, as given to `attn_forward`.

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtypes (``call.accumulate``: float32 for bf16/fp16
        CPU blocks; flash-attn and the CUDA kernels return the input dtype either way).
    """
    low = q.dtype in (torch.bfloat16, torch.float16)
    if call.accumulate and low and q.device.type == "cpu" and call.backend in ("math", "torch"):
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    with torch.no_grad():
        if call.cu_q is not None:
            return _varlen_backward(dout, q, k, v, out, lse, call)
        return _dense_backward(dout, q, k, v, out, lse, call)


def attend_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: KernelCall,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable :func:`attn_forward` (``sinks``: ``(hq,)`` sink logits, differentiable)."""
    fwd, bwd = partial(attn_forward, call=call), partial(attn_backward, call=call)
    return SavedAttention.apply(q, k, v, sinks, fwd, bwd)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec | None = None,
    *,
    backend: str | Kernel = "auto",
    cu_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable single-device attention.

    Args:
        q: Queries ``(b, s, hq, d)``.
        k: Keys ``(b, s, hkv, d)``.
        v: Values ``(b, s, hkv, dv)``; ``dv`` may differ from ``d`` (MLA).
        spec: Causal (the default), scale, softcap and window; None is causal attention.
        backend: ``"auto"``, ``"torch"``, ``"math"``, ``"flash_attn"``, ``"flash_attn3"``,
            ``"flash_attn4"`` or a ``Kernel``.
        cu_seqlens: Int32 document boundaries of a packed row (batch 1); attention stays
            inside each document.
        sinks: ``(hq,)`` attention-sink logits (GPT-OSS), differentiable.

    Returns:
        The output ``(b, s, hq, dv)`` in q's dtype.
    """
    spec = replace(spec or AttentionSpec(), sinks=sinks is not None)
    call = KernelCall(spec, resolve_backend(backend, q, v), cu_q=cu_seqlens, cu_k=cu_seqlens)
    return attend_local(q, k, v, call, sinks)
