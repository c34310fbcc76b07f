"""Pure-PyTorch kernels behind the flash-attn stand-ins (what ``flash_api.cpp`` and its CUDA
kernels compute, at the level of one ``mha_*`` call).

Conventions copied from flash-attn 2: q ``(b, sq, hq, d)``, k/v ``(b, sk, hkv, d)`` (varlen:
``(total, h, d)`` with int32 ``cu_seqlens``); query head i uses kv head ``i // (hq // hkv)``;
causal and ``window_size (left, right)`` (-1: unbounded) are aligned bottom-right, per document:
query row i sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right``; a window side
``>= seqlen_k`` (varlen: ``>= max_seqlen_k``) counts as -1, as in the C++; ``softcap > 0``
turns scores into ``softcap * tanh(scores / softcap)``. Math in float32; out in the input
dtype; lse float32 ``(b, h, sq)`` dense, ``(h, total_q)`` varlen. A row that sees no key gets
out 0 and lse **+inf** (the kernel's ``sum == 0 ? INFINITY`` and its ``seqlen_k == 0`` branch),
so the backward's ``exp(s - lse)`` is 0 for it.

The backward reads ``softmax_lse`` as the kernel does, through its data pointer: contiguous
values from its storage offset, ignoring strides (a non-contiguous lse gives wrong gradients,
as on the GPU); ``softmax_d`` is ``rowsum(dout * out)`` with the given ``out``. Gradients are
written into the given dq/dk/dv (allocated when None); GQA dk/dv are summed over query heads.
Varlen rows outside every document are left unwritten (fresh outputs hold NaN there, or
0 / -inf with ``zero_tensors``).

Not modelled: the ``is_cuda`` checks (``CHECK_DEVICE``: we run on CPU), dropout, ALiBi, paged
KV / ``seqused_k`` / ``leftpad_k``, the GPU-capability checks.

This module also keeps the stand-ins' import state (it is imported once per process, unlike
the ``flash_attn`` packages): the wrap mode and the custom-op namespace counter.
"""

from __future__ import annotations

import inspect
import itertools
import math

import torch

WRAP = "custom_op"  # "custom_op" (flash-attn 2.7/2.8 on torch 2.4-2.9) or "plain" (torch >= 2.10)
_namespaces = itertools.count()


def next_namespace() -> str:
    """A fresh ``torch.library`` namespace, so the stand-ins can be imported many times."""
    return f"flash_attn_standin_{next(_namespaces)}"


def bind(fn, args, kwargs) -> dict:
    """The arguments of a call to ``fn`` (or to the custom op wrapping it), by name."""
    bound = inspect.signature(getattr(fn, "_init_fn", fn)).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def check_unsupported(dropout_p, alibi_slopes, return_softmax=False, **paged) -> None:
    if dropout_p != 0:
        raise NotImplementedError("stand-in: dropout not supported")
    _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("stand-in: alibi_slopes not supported")
    for name, value in paged.items():
        if value is not None:
            raise NotImplementedError(f"stand-in: {name} not supported")


def check_inputs(q, k, v, *, fwd: bool, pads: bool, out=None, dout=None, cu=()) -> None:
    """flash_api.cpp's checks, in its order and with its messages (not ``CHECK_DEVICE``).

    ``pads``: 2.6's C++ pads a head dim that is not a multiple of 8 itself (forward; in the
    backward, dout may keep the unpadded size); 2.7+ refuses it.
    """
    _check(
        q.dtype in (torch.float16, torch.bfloat16),
        "FlashAttention only support fp16 and bf16 data type",
    )
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    if not fwd:
        _check(out.dtype == q.dtype, "query and out must have the same dtype")
        _check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    for name, c in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
        _check(c.dtype == torch.int32, f"{name} must have dtype int32")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    if not fwd:
        _check(out.stride(-1) == 1, "out tensor must have contiguous last dimension")
        _check(dout.stride(-1) == 1, "dout tensor must have contiguous last dimension")
    for name, c in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
        _check(c.is_contiguous(), f"{name} must be contiguous")
    d, hq, hkv = q.shape[-1], q.shape[-2], k.shape[-2]
    if fwd:
        _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        msg = "query, key, value, and out_ must have a head_size that is a multiple of 8"
        _check(pads or d % 8 == 0, msg)
    else:
        _check(d % 8 == 0, "head_size should be a multiple of 8")
        _check(d <= 256, "FlashAttention backward only supports head dimension at most 256")
    _check(hq % hkv == 0, "Number of heads in key/value must divide number of heads in query")
    dense = q.dim() == 4
    rows_q, rows_k = (
        ("batch_size, seqlen_q", "batch_size, seqlen_k") if dense else ("total_q", "total_k")
    )
    k_shape = (q.shape[0], *k.shape[1:-1], d) if dense else (*k.shape[:-1], d)
    shapes = [("k", k, k_shape, rows_k + ", num_heads_k, head_size")]
    shapes.append(("v", v, k_shape, rows_k + ", num_heads_k, head_size"))
    if not fwd:
        d_og = dout.shape[-1] if pads else d
        if pads:
            msg = "head_size must be head_size_og rounded to a multiple of 8"
            _check(d == round_multiple(d_og, 8), msg)
        shapes.append(("out", out, q.shape, rows_q + ", num_heads, head_size"))
        og = "_og" if pads else ""
        shapes.append(("dout", dout, (*q.shape[:-1], d_og), f"{rows_q}, num_heads, head_size{og}"))
    for name, t, want, dims in shapes:
        _check(tuple(t.shape) == tuple(want), f"{name} must have shape ({dims})")


def check_grad(name: str, g, like) -> None:
    _check(g.dtype == like.dtype, f"{name} must have the same dtype as q")
    _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _check(g.shape == like.shape, f"{name} must have shape {tuple(like.shape)}")


def _window(causal: bool, left: int, right: int, seqlen_k: int) -> tuple[int, int]:
    if causal:
        right = 0
    return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_k else right)


def _visible(sq: int, sk: int, left: int, right: int, device) -> torch.Tensor:
    """``(sq, sk)`` bool: which keys each query row sees (bottom-right aligned)."""
    diag = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def _scores(q, k, scale, softcap, window):
    """Masked scores ``(b, hq, sq, sk)`` in float32 and ``tanh`` (for softcap's backward)."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    mask = _visible(q.shape[1], k.shape[1], *window, q.device)
    return s.masked_fill(~mask, -math.inf), t


def _fwd(q, k, v, scale, softcap, window):
    """One batch of documents: out ``(b, sq, hq, d)`` float32, lse ``(b, hq, sq)``."""
    s, _ = _scores(q, k, scale, softcap, window)
    lse = torch.logsumexp(s, dim=-1)
    lse = lse.masked_fill(lse == -math.inf, math.inf)  # no visible key: +inf, out 0
    p = torch.exp(s - lse[..., None])
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2).float()
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _bwd(dout, q, k, v, out, lse, scale, softcap, window):
    """One batch of documents: float32 dq, dk, dv (kv heads) and D = rowsum(dout * out)."""
    g = q.shape[2] // k.shape[2]
    s, t = _scores(q, k, scale, softcap, window)
    lse = lse.masked_fill(lse == -math.inf, 0.0)  # the kernel's "max == -inf ? 0" guard
    p = torch.exp(s - lse[..., None])
    do, ke, ve = dout.float(), k.repeat_interleave(g, 2).float(), v.repeat_interleave(g, 2).float()
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # (b, hq, sq)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, ve) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    dk, dv = (x.unflatten(2, (-1, g)).sum(3) for x in (dk, dv))
    return dq, dk, dv, delta


def read_raw_f32(t: torch.Tensor, shape) -> torch.Tensor:
    """The float32 values a kernel reads through ``t.data_ptr()``, contiguous in ``shape``."""
    byte_offset = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    _check(
        byte_offset % 4 == 0 and byte_offset + 4 * math.prod(shape) <= storage.nbytes(),
        f"stand-in: softmax_lse storage too small for {tuple(shape)} (out-of-bounds read)",
    )
    raw = torch.empty(0, dtype=torch.float32, device=t.device)
    return raw.set_(storage, byte_offset // 4, tuple(shape)).clone()


def rng_state(q: torch.Tensor) -> torch.Tensor:
    """The ``(2,)`` int64 philox seed/offset the C++ returns (unused without dropout)."""
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _write(dst, src, like):
    """Write ``src`` into ``dst`` in place, or into a fresh ``empty_like(like)`` as the C++."""
    return (torch.empty_like(like) if dst is None else dst).copy_(src)


# ------------------------------------------------------------------------------- mha_* calls


def mha_fwd(q, k, v, softmax_scale, is_causal, window_size_left, window_size_right, softcap):
    window = _window(is_causal, window_size_left, window_size_right, k.shape[1])
    out, lse = _fwd(q, k, v, softmax_scale, softcap, window)
    return _write(None, out, q), lse.contiguous()


def mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, is_causal, wl, wr, cap):
    b, sq, hq, _ = q.shape
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is not None:
            check_grad(name, g, like)
    lse = read_raw_f32(softmax_lse, (b, hq, sq))
    window = _window(is_causal, wl, wr, k.shape[1])
    gq, gk, gv, delta = _bwd(dout, q, k, v, out, lse, softmax_scale, cap, window)
    softmax_d = q.new_zeros((b, hq, round_multiple(sq, 128)), dtype=torch.float32)
    softmax_d[..., :sq] = delta
    gq, gk, gv = (_write(t, x, y) for t, x, y in ((dq, gq, q), (dk, gk, k), (dv, gv, v)))
    return gq, gk, gv, softmax_d


def _docs(cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    """Document bounds; a document longer than the max_seqlen given is refused: the CUDA grid
    is sized by max_seqlen_q/k, so the real kernel would silently skip its tail."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    docs = list(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))
    for q0, q1, k0, k1 in docs:
        _check(
            q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k,
            f"stand-in: a document ({q1 - q0} q, {k1 - k0} k rows) is longer than "
            f"max_seqlen_q/k ({max_seqlen_q}, {max_seqlen_k}); the kernel would skip rows",
        )
    return docs


def mha_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, zero_tensors, causal, wl, wr, cap):
    window = _window(causal, wl, wr, max_k)
    out = torch.full_like(q, 0.0 if zero_tensors else math.nan)
    lse = q.new_full((q.shape[1], q.shape[0]), -math.inf if zero_tensors else math.nan)
    lse = lse.float()
    for q0, q1, k0, k1 in _docs(cu_q, cu_k, max_q, max_k):
        o, l = _fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, cap, window)
        out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l[0]
    return out, lse


def mha_varlen_bwd(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_q,
    cu_k,
    max_q,
    max_k,
    scale,
    zero_tensors,
    causal,
    wl,
    wr,
    cap,
):
    total_q, hq, _ = q.shape
    grads = []
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is not None:
            check_grad(name, g, like)
        grads.append(torch.full_like(like, math.nan) if g is None else g)
        if zero_tensors:
            grads[-1].zero_()
    lse = read_raw_f32(softmax_lse, (hq, total_q))
    window = _window(causal, wl, wr, max_k)
    softmax_d = q.new_zeros((hq, total_q + 128 * (cu_q.numel() - 1)), dtype=torch.float32)
    for i, (q0, q1, k0, k1) in enumerate(_docs(cu_q, cu_k, max_q, max_k)):
        rows_q = [t[None, q0:q1] for t in (dout, q)]
        rows_k = [t[None, k0:k1] for t in (k, v)]
        g_q, g_k, g_v, delta = _bwd(
            *rows_q, *rows_k, out[None, q0:q1], lse[None, :, q0:q1], scale, cap, window
        )
        grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = g_q[0], g_k[0], g_v[0]
        softmax_d[:, q0 + 128 * i : q1 + 128 * i] = delta[0]
    return (*grads, softmax_d)


# ----------------------------------------------------------- fakes (torch.library.register_fake)


def fake_fwd(a: dict):
    q, k = a["q"], a["k"]
    b, sq, h, _ = q.shape
    p = q.new_empty((0,))
    if a["return_softmax"]:
        p = q.new_empty((b, h, round_multiple(sq, 128), round_multiple(k.shape[1], 128)))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return torch.empty_like(q), lse, p, q.new_empty((2,), dtype=torch.int64)


def fake_varlen_fwd(a: dict):
    q = a["q"]
    total_q, h, _ = q.shape
    p = q.new_empty((0,))
    if a["return_softmax"]:
        rq, rk = round_multiple(a["max_seqlen_q"], 128), round_multiple(a["max_seqlen_k"], 128)
        p = q.new_empty((a["cu_seqlens_q"].numel() - 1, h, rq, rk))
    lse = q.new_empty((h, total_q), dtype=torch.float32)
    return torch.empty_like(q), lse, p, q.new_empty((2,), dtype=torch.int64)


def fake_bwd(a: dict):
    b, sq, h, _ = a["q"].shape
    return a["q"].new_empty((b, h, round_multiple(sq, 128)), dtype=torch.float32)


def fake_varlen_bwd(a: dict):
    total_q, h, _ = a["q"].shape
    nb = a["cu_seqlens_q"].numel() - 1
    return a["q"].new_empty((h, total_q + 128 * nb), dtype=torch.float32)
