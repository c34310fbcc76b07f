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

Backends: ``"math"`` (:mod:`.math_backend`, pure PyTorch, any dtype), ``"torch"``
(:mod:`.torch_backend`, torch's fused kernels), ``"flash_attn"`` (:mod:`.flash_backend`,
flash-attn 2.6-2.8, imported lazily), ``"auto"`` (:func:`resolve_backend`: flash-attn for
inputs it can run, else torch).
Causal masking needs ``sq == sk`` (the diagonal block); callers slice off-diagonal blocks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..core.derived import once
from ..core.log import get_logger
from ..core.options import BACKENDS, Backend
from . import flash_backend, math_backend, torch_backend
from .math_backend import Band, lse_dtype

__all__ = [
    "BACKENDS",
    "FULL_WINDOW",
    "Backend",
    "Kernel",
    "SavedAttention",
    "WorkStats",
    "add_sinks",
    "attn_backward",
    "attn_forward",
    "band_is_empty",
    "default_scale",
    "flash_attn_unusable",
    "local_attention",
    "plain_block",
    "resolve_backend",
    "sinks_grad",
    "window_band",
    "work",
]


_LOW = (torch.float16, torch.bfloat16)
_said: set[str] = set()


def flash_attn_unusable(
    device_type: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] = (9, 0)
) -> str | None:
    """Why ``"auto"`` does not pick flash-attn for such inputs, or None when it can run
    them: CUDA on sm80 or newer (flash-attn 2 needs Ampere), float16/bfloat16, head dim
    <= 256, and a flash-attn 2.6-2.8 that imports."""
    if device_type != "cuda":
        return f"the tensors are on {device_type}"
    if tuple(capability) < (8, 0):
        return f"GPU compute capability {capability[0]}.{capability[1]} (flash-attn 2 needs 8.0+)"
    if dtype not in _LOW:
        return f"dtype {dtype} (flash-attn takes float16/bfloat16)"
    if head_dim > 256:
        return f"head dim {head_dim} > 256"
    return flash_backend.import_problem()


@dataclass(frozen=True)
class Kernel:
    """A local attention kernel of your own, passed as ``backend=`` wherever a backend name
    goes: ``forward(q, k, v, causal, scale) -> (out, lse)`` and ``backward(dout, q, k, v,
    out, lse, causal, scale) -> (dq, dk, dv)`` on ``(b, s, h, d)`` blocks (k/v may have
    fewer heads; lse ``(b, hq, s)``), the contract of the built-in backends; a logit
    softcap other than 0 comes as the keyword ``softcap=``, a sliding window's band of
    visible diagonals as ``band=(lo, hi)`` (``math_backend.Band``). For experiments and tests
    (counting work, injecting a fault) without patching modules."""

    name: str
    forward: Callable
    backward: Callable


def _variant(fn: Callable, softcap: float, band: Band | None) -> Callable:
    kw: dict[str, Any] = {}
    if softcap:
        kw["softcap"] = softcap
    if band is not None:
        kw["band"] = band
    return partial(fn, **kw) if kw else fn


def _fwd(backend: str | Kernel, softcap: float = 0.0, band: Band | None = None) -> Callable:
    fn = backend.forward if isinstance(backend, Kernel) else _FORWARD[backend]
    return _variant(fn, softcap, band)


def _bwd(backend: str | Kernel, softcap: float = 0.0, band: Band | None = None) -> Callable:
    fn = backend.backward if isinstance(backend, Kernel) else _BACKWARD[backend]
    return _variant(fn, softcap, band)


FULL_WINDOW = (-1, -1)


class WorkStats:
    """Attention work per phase (``"forward"``, ``"backward"``), process-wide, reset by the
    caller: ``scores`` = score entries the kernels computed (batch x query heads x queries x
    keys per call, masked entries included), ``skipped`` = blocks a mode left out because no
    query could see them (sliding windows)."""

    def __init__(self) -> None:
        self.scores: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.scores.clear()
        self.skipped.clear()

    def snapshot(self) -> dict[str, int]:
        out = {f"scores/{p}": n for p, n in sorted(self.scores.items())}
        return out | {f"skipped/{p}": n for p, n in sorted(self.skipped.items())}


work = WorkStats()


def _count(phase: str, q: torch.Tensor, k: torch.Tensor) -> None:
    """Score entries of one kernel call on ``q (b, sq, hq, d)`` against ``k (b, sk, ...)``."""
    b, sq, hq = q.shape[:3]
    work.scores[phase] += b * hq * sq * k.shape[1]


def window_band(window: tuple[int, int], causal: bool, offset: int = 0) -> Band | None:
    """The visible diagonals (``lo <= j - i <= hi``) of a block whose first query is
    ``offset`` tokens after its first key, for flash-attn's ``window_size=(left, right)``
    (-1: unbounded) and ``causal``; None for full attention (no window)."""
    left, right = window
    if left < 0 and right < 0:
        return None
    lo = None if left < 0 else offset - left
    hi = None if right < 0 else offset + right
    if causal:
        hi = offset if hi is None else min(hi, offset)
    return lo, hi


def plain_block(band: Band, sq: int, sk: int) -> bool | None:
    """For a band that a plain kernel call expresses on an ``sq x sk`` block: False when every
    key is visible (full attention), True when it is the aligned causal mask; None when the
    block needs the band (masked entries off the causal diagonal)."""
    lo, hi = band
    lo_all = lo is None or lo <= -(sq - 1)
    if lo_all and (hi is None or hi >= sk - 1):
        return False
    if lo_all and hi == 0 and sq == sk:
        return True
    return None


def band_is_empty(band: Band, sq: int, sk: int) -> bool:
    """No key visible to any query of an ``sq x sk`` block (``j - i`` spans
    ``[-(sq - 1), sk - 1]``)."""
    lo, hi = band
    lo = -(sq - 1) if lo is None else max(lo, -(sq - 1))
    hi = sk - 1 if hi is None else min(hi, sk - 1)
    return lo > hi


def resolve_backend(backend: str | Kernel, q: torch.Tensor) -> str | Kernel:
    """Map ``"auto"`` to a backend that can run ``q``'s device, dtype and head dim (and say
    why, once, in the log); raise ``ValueError`` for an unknown or unusable choice.

    ``"auto"``: flash-attn for float16/bfloat16 CUDA tensors (sm80+) with a head dim <= 256
    when it imports, else ``"torch"``. ``"flash_attn"`` hands the tensors over as they are
    (flash-attn itself rejects CPU tensors and float32), once the module imports."""
    if isinstance(backend, Kernel):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "auto":
        cc = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (0, 0)
        why = flash_attn_unusable(q.device.type, q.dtype, q.shape[-1], cc)
        choice = "torch" if why else "flash_attn"
        note = f"attention backend 'auto' -> {choice!r}"
        note += f": not flash-attn, {why}" if why else ""
        if note not in _said:
            _said.add(note)
            get_logger().info(note)
        return choice
    if backend == "flash_attn":
        flash_backend.interface()  # ValueError: not installed, broken, or unsupported
    return backend


def default_scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    assert not causal or q.shape[1] == k.shape[1], "causal blocks must be square"


# ---------------------------------------------------------------- dispatch

_FORWARD = {
    "math": math_backend.forward,
    "torch": torch_backend.forward,
    "flash_attn": flash_backend.forward,
}
_BACKWARD = {
    "math": math_backend.backward,
    "torch": torch_backend.backward,
    "flash_attn": flash_backend.backward,
}


def _doc_groups(cu_q, cu_k):
    """Documents of a packed block grouped by (q length, k length), so each group is one
    batched kernel call: ``[(q index, k index, n docs, lq, lk)]``; empty documents dropped.
    Once per batch (the same ``cu`` tensors serve every layer and ring step)."""
    return once((cu_q, cu_k), "doc groups", partial(_group_documents, cu_q, cu_k))


def _group_documents(cu_q, cu_k):
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
    if len(cu_q) != 2:
        return False
    key = ("one document", q.shape[1], k.shape[1])
    whole = [0, q.shape[1]], [0, k.shape[1]]
    return once((cu_q, cu_k), key, lambda: (cu_q.tolist(), cu_k.tolist()) == whole)


def _kernel_args(
    window: tuple[int, int], causal: bool, offset: int, sq: int, sk: int
) -> tuple[bool, Band | None] | None:
    """``(causal, band)`` for the kernel call on an ``sq x sk`` block whose first query
    comes ``offset`` tokens after its first key: the window folded into a band, or back to a
    plain (fused) call when the band leaves the block whole or aligned-causal; None when no
    query of the block sees a key (the call is skipped)."""
    band = window_band(window, causal, offset)
    if band is None:
        return causal, None
    if band_is_empty(band, sq, sk):
        return None
    plain = plain_block(band, sq, sk)
    return (False, band) if plain is None else (plain, None)


def _varlen_forward(q, k, v, cu_q, cu_k, causal, scale, backend, softcap, window, chunk_offset):
    offset = chunk_offset * q.shape[1]
    if _one_document(q, k, cu_q, cu_k):
        return _dense_forward(q, k, v, causal, scale, backend, softcap, window, offset)
    hq = q.shape[2]
    if backend == "flash_attn" and chunk_offset == 0:  # one window for every document
        band = window_band(window, causal, 0)
        work.scores["forward"] += _doc_scores(cu_q, cu_k, hq)
        c = causal if band is None else False
        return flash_backend.varlen_forward(q, k, v, cu_q, cu_k, c, scale, softcap, band)
    lse = torch.full((1, hq, q.shape[1]), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    out = torch.zeros_like(q)
    for qi, ki, n, lq, lk in _doc_groups(cu_q, cu_k):  # rows in no document stay (0, -inf)
        assert not causal or lq == lk, "causal documents must be square"
        args = _kernel_args(window, causal, chunk_offset * lq, lq, lk)
        if args is None:
            work.skipped["forward"] += 1
            continue
        work.scores["forward"] += n * hq * lq * lk
        o, lg = _fwd(backend, softcap, args[1])(
            _take(q, qi, n, lq), _take(k, ki, n, lk), _take(v, ki, n, lk), args[0], scale
        )
        out[0].index_copy_(0, qi, o.reshape(n * lq, hq, -1).to(out.dtype))
        lse[0].index_copy_(1, qi, lg.transpose(0, 1).reshape(hq, n * lq).to(lse.dtype))
    return out, lse


def _varlen_backward(
    dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, backend, softcap, window, chunk_offset
):
    if _one_document(q, k, cu_q, cu_k):
        offset = chunk_offset * q.shape[1]
        dense = (dout, q, k, v, out, lse, causal, scale, backend, softcap, window, offset)
        return _dense_backward(*dense)
    if backend == "flash_attn" and chunk_offset == 0:
        band = window_band(window, causal, 0)
        c = causal if band is None else False
        work.scores["backward"] += _doc_scores(cu_q, cu_k, q.shape[2])
        return flash_backend.varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, c, scale, softcap, band
        )
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hq = q.shape[2]
    for qi, ki, n, lq, lk in _doc_groups(cu_q, cu_k):
        args = _kernel_args(window, causal, chunk_offset * lq, lq, lk)
        if args is None:
            work.skipped["backward"] += 1
            continue
        work.scores["backward"] += n * hq * lq * lk
        lg = lse[0].index_select(1, qi).view(hq, n, lq).transpose(0, 1)  # (n, hq, lq)
        gq, gk, gv = _bwd(backend, softcap, args[1])(
            _take(dout, qi, n, lq),
            _take(q, qi, n, lq),
            _take(k, ki, n, lk),
            _take(v, ki, n, lk),
            _take(out, qi, n, lq),
            lg.contiguous(),
            args[0],
            scale,
        )
        dq[0].index_copy_(0, qi, gq.reshape(n * lq, *q.shape[2:]).to(dq.dtype))
        dk[0].index_copy_(0, ki, gk.reshape(n * lk, *k.shape[2:]).to(dk.dtype))
        dv[0].index_copy_(0, ki, gv.reshape(n * lk, *v.shape[2:]).to(dv.dtype))
    return dq, dk, dv


def _doc_scores(cu_q: torch.Tensor, cu_k: torch.Tensor, hq: int) -> int:
    """Score entries of one varlen call over every document of a packed block."""
    return hq * sum(n * lq * lk for _, _, n, lq, lk in _doc_groups(cu_q, cu_k))


def _dense_forward(q, k, v, causal, scale, backend, softcap, window, offset):
    args = _kernel_args(window, causal, offset, q.shape[1], k.shape[1])
    if args is None:  # no query sees a key: empty rows, no call
        work.skipped["forward"] += 1
        lse = torch.full(
            (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=lse_dtype(q.dtype),
            device=q.device,
        )  # fmt: skip
        return torch.zeros_like(q), lse
    causal, band = args
    if band is None:
        _check_causal(q, k, causal)
    _count("forward", q, k)
    return _fwd(backend, softcap, band)(q, k, v, causal, scale)


def _dense_backward(dout, q, k, v, out, lse, causal, scale, backend, softcap, window, offset):
    args = _kernel_args(window, causal, offset, q.shape[1], k.shape[1])
    if args is None:
        work.skipped["backward"] += 1
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    causal, band = args
    if band is None:
        _check_causal(q, k, causal)
    _count("backward", q, k)
    return _bwd(backend, softcap, band)(dout, q, k, v, out, lse, causal, scale)


def attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    backend: str | Kernel,
    cu_q: torch.Tensor | None = None,
    cu_k: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = FULL_WINDOW,
    offset: int = 0,
    chunk_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) fp32/fp64)``; no autograd.

    Packed (``cu_q``/``cu_k`` given, batch 1): document i's queries
    ``q[:, cu_q[i]:cu_q[i+1]]`` attend only its keys ``k[:, cu_k[i]:cu_k[i+1]]``; rows in
    no document come back empty (out 0, lse -inf). Causal documents must be square.
    ``softcap > 0``: scores ``softcap * tanh(scores / softcap)`` (flash-attn's meaning).
    ``window=(left, right)``: flash-attn's sliding window (-1 unbounded) for a block whose
    first query comes ``offset`` tokens after its first key (0: aligned blocks, the only
    choice for packed rows); rows that see no key come back empty. Packed rows:
    ``chunk_offset`` = how many chunks each document's query chunk comes after its key chunk
    (documents are cut in chunks of their own length, so the offset in tokens is per
    document group)."""
    scale = default_scale(q, softmax_scale)
    with torch.no_grad():
        if cu_q is not None:
            assert offset == 0, "packed rows take chunk_offset, not offset"
            return _varlen_forward(
                q, k, v, cu_q, cu_k, causal, scale, backend, softcap, tuple(window), chunk_offset
            )
        return _dense_forward(q, k, v, causal, scale, backend, softcap, tuple(window), offset)


def attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    backend: str | Kernel,
    accumulate: bool = False,
    cu_q: torch.Tensor | None = None,
    cu_k: torch.Tensor | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = FULL_WINDOW,
    offset: int = 0,
    chunk_offset: int = 0,
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
            return _varlen_backward(
                dout,
                q,
                k,
                v,
                out,
                lse,
                cu_q,
                cu_k,
                causal,
                scale,
                backend,
                softcap,
                tuple(window),
                chunk_offset,
            )
        return _dense_backward(
            dout, q, k, v, out, lse, causal, scale, backend, softcap, tuple(window), offset
        )


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with one more logit per head, ``sinks (hq,)``, whose value vector is 0
    (GPT-OSS): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. The
    backward of attention from ``(out', lse')`` is the exact backward with the sink."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    return out.to(lse.dtype) * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1), new


def sinks_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """``d loss / d sinks`` from the final ``out``/``lse`` (with the sink): the sink's
    probability times ``-rowsum(dout * out)``, summed over batch and tokens."""
    cdt = lse.dtype
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1).transpose(1, 2)  # (b, hq, s)
    p_sink = torch.exp(sinks.to(cdt).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


class SavedAttention(torch.autograd.Function):
    """``fwd(q, k, v, **opts) -> (out, lse)`` in forward, saving q, k, v, out (in q's dtype)
    and lse; ``bwd(dout, q, k, v, out, lse, **opts) -> (dq, dk, dv)`` in backward. Serves
    the local kernel and ring attention alike. ``sinks`` (``(hq,)`` or None): one logit per
    query head joins every softmax (:func:`add_sinks`), differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, fwd, bwd, opts):
        out, lse = fwd(q, k, v, **opts)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # as returned: no extra copy when it already is
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.bwd, ctx.opts = bwd, opts
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = ctx.bwd(dout, q, k, v, out, lse, **ctx.opts)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return (*grads, dsinks, None, None, None)


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | Kernel = "auto",
    cu_seqlens: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] = FULL_WINDOW,
) -> torch.Tensor:
    """Differentiable single-device attention, ``(b, s, hq, d)`` in and out.

    ``cu_seqlens``: int32 document boundaries of a packed row (batch 1); attention stays
    inside each document. ``softcap``: flash-attn's logit softcap (0 = off). ``sinks``:
    ``(hq,)`` attention-sink logits (GPT-OSS), differentiable. ``window=(left, right)``:
    flash-attn's sliding window (-1 unbounded; ``(-1, -1)`` is full attention)."""
    backend = resolve_backend(backend, q)
    opts: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
    if softcap:
        opts.update(softcap=softcap)
    if tuple(window) != FULL_WINDOW:
        opts.update(window=tuple(window))
    if cu_seqlens is not None:
        opts.update(cu_q=cu_seqlens, cu_k=cu_seqlens)
    return SavedAttention.apply(q, k, v, sinks, attn_forward, attn_backward, opts)
