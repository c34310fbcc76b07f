"""Pure-PyTorch kernels behind the FlashAttention-3 and -4 stand-ins (what ``hopper/
flash_api.cpp``'s ``mha_fwd``/``mha_bwd`` and ``flash_attn/cute/interface.py``'s kernels
compute), with each library's conventions and input checks:

- one call for dense rows ``(b, s, h, d)`` and packed rows ``(total, h, d)`` with int32
  ``cu_seqlens_q/k`` and ``max_seqlen_q/k``;
- lse float32 ``(b, h, sq)`` dense, ``(h, total_q)`` packed; a row that sees no key gets
  out 0 and lse **-inf** (FA3's ``sum == 0 ? -INFINITY``; FA4's empty-input branch);
- window bottom-right aligned (key j visible to query i iff ``i + sk - sq - left <= j <=
  i + sk - sq + right``); FA3: -1 unbounded, a side ``>= seqlen - 1`` counts as -1,
  causal sets right to 0; FA4 (``_resolve_causal_local_window``): **None** unbounded,
  causal sets right to 0, both sides given with ``left + right < 0`` means no window, and
  any other int, negative too, is taken literally (so a -1 meant as "unbounded" hides the
  diagonal, as on the GPU);
- values may have their own head dim (FA4 on sm90: 8-256, multiples of 8; FA3: the
  DeepSeek and MLA pairs only);
- the backward reads the lse through its data pointer (contiguous, ``kernels.read_raw_f32``)
  and writes into the dq/dk/dv given (fresh ones when None); GQA dk/dv summed over groups.

Not modelled: the CUDA device checks, fp8, paged KV, kv-cache appends, rotary, splits,
sinks, score/mask mods, block sparsity.
"""

from __future__ import annotations

import math

import torch

from tests.support.flash_standin import kernels as _k


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def check_inputs(q, k, v, cu, fa4: bool) -> None:
    """The dtype, layout, head-dim and head-count checks (FA3's messages; FA4's asserts)."""
    low = (torch.float16, torch.bfloat16)
    check(q.dtype in low, "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    check(k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must have the same dtype")
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    for c in cu:
        check(c is None or c.dtype == torch.int32, "cu_seqlens_q/k must have dtype torch.int32")
    d, dv = q.shape[-1], v.shape[-1]
    check(q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv")
    if fa4:
        ok = min(d, dv) >= 8 and max(d, dv) <= 256 and d % 8 == 0 and dv % 8 == 0
        check(ok, f"(head_dim, head_dim_v)=({d}, {dv}) is not supported on SM90.")
        return
    check(d % 8 == 0, "head_size should be a multiple of 8")
    check(dv % 8 == 0, "head_size_v should be a multiple of 8")
    check(max(d, dv) <= 256, "FlashAttention forward only supports head dimension at most 256")
    pairs = (128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512)
    check(d == dv or pairs, "If V headdim is different from Q/K dim, we only support ...")


def fa3_window(causal: bool, left: int, right: int, sq: int, sk: int):
    """FA3's window resolution, as ``(left, right)`` with None unbounded."""
    left = -1 if left >= sk - 1 else left
    right = -1 if right >= sq - 1 else right
    right = 0 if causal else right
    return (None if left < 0 else left), (None if right < 0 else right)


def fa4_window(causal: bool, left: int | None, right: int | None):
    """FA4's ``_resolve_causal_local_window`` (no mask_mod), as ``(left, right)``."""
    right = 0 if causal else right
    if left is not None and right is not None and left + right < 0:
        return None, None
    return left, right


def _mask(sq: int, sk: int, left, right, device) -> torch.Tensor:
    diag = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left is not None:
        mask &= j >= diag - left
    if right is not None:
        mask &= j <= diag + right
    return mask


def _scores(q, k, scale, softcap, window):
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.repeat_interleave(g, 2).float()) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    return s.masked_fill(~_mask(q.shape[1], k.shape[1], *window, q.device), -math.inf), t


def _fwd(q, k, v, scale, softcap, window):
    s, _ = _scores(q, k, scale, softcap, window)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no key
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2).float()
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _bwd(dout, q, k, v, out, lse, scale, softcap, window):
    g = q.shape[2] // k.shape[2]
    s, t = _scores(q, k, scale, softcap, window)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    do = dout.float()
    ke, ve = k.repeat_interleave(g, 2).float(), v.repeat_interleave(g, 2).float()
    delta = (do * out.float()).sum(-1).transpose(1, 2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, ve) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale
    return dq, *(x.unflatten(2, (-1, g)).sum(3) for x in (dk, dv))


def _docs(cu_q, cu_k, max_q, max_k):
    docs = list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:]))
    for q0, q1, k0, k1 in docs:
        check(q1 - q0 <= max_q and k1 - k0 <= max_k, "stand-in: a document > max_seqlen_q/k")
    return docs


def forward(q, k, v, scale, softcap, window_of, cu=None, max_seqlen=(None, None)):
    """``(out, lse)``; ``window_of(sq, sk)`` gives the resolved window of a block."""
    if cu is None:
        out, lse = _fwd(q, k, v, scale, softcap, window_of(q.shape[1], k.shape[1]))
        return out.to(q.dtype), lse.contiguous()
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    window = window_of(*max_seqlen)
    for q0, q1, k0, k1 in _docs(*cu, *max_seqlen):
        o, l = _fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, softcap, window)
        out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l[0]
    return out, lse


def backward(dout, q, k, v, out, lse, grads, scale, softcap, window_of, cu=None, max_seqlen=()):
    """Write dq, dk, dv into ``grads`` (None entries: fresh tensors) and return them."""
    made = []
    for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if g is not None:
            _k.check_grad(name, g, like)
        made.append(torch.empty_like(like) if g is None else g)
    if cu is None:
        b, sq, hq, _ = q.shape
        raw = _k.read_raw_f32(lse, (b, hq, sq))
        window = window_of(q.shape[1], k.shape[1])
        for dst, src in zip(made, _bwd(dout, q, k, v, out, raw, scale, softcap, window)):
            dst.copy_(src)
        return tuple(made)
    raw = _k.read_raw_f32(lse, (q.shape[1], q.shape[0]))
    window = window_of(*max_seqlen)
    for t in made:
        t.zero_()
    for q0, q1, k0, k1 in _docs(*cu, *max_seqlen):
        rows = [t[None, q0:q1] for t in (dout, q)] + [t[None, k0:k1] for t in (k, v)]
        gq, gk, gv = _bwd(*rows, out[None, q0:q1], raw[None, :, q0:q1], scale, softcap, window)
        made[0][q0:q1], made[1][k0:k1], made[2][k0:k1] = gq[0], gk[0], gv[0]
    return tuple(made)


# ------------------------------------------------------------------ FA4's two functions
_FA4_UNUSED = [
    "qv",
    "seqused_q",
    "seqused_k",
    "min_seqlen_k",
    "page_table",
    "learnable_sink",
    "score_mod",
    "mask_mod",
    "block_sparse_tensors",
    "aux_tensors",
    "aux_scalars",
    "q_descale",
    "k_descale",
    "v_descale",
    "gather_kv_indices",
    "scheduler_metadata",
    "score_mod_bwd",
    "dlse",
]


def fa4_forward(a: dict):
    """``_flash_attn_fwd``'s body for its arguments ``a``: ``(out, lse)``; lse None unless
    ``return_lse`` (or an input requires grad), as in the release."""
    fa34_unused(a, [*_FA4_UNUSED, "out", "lse"])
    q, k, v = a["q"], a["k"], a["v"]
    cu = None if a["cu_seqlens_q"] is None else (a["cu_seqlens_q"], a["cu_seqlens_k"])
    assert all(t.dtype in (torch.float16, torch.bfloat16) for t in (q, k, v)), (
        "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
    )
    check_inputs(q, k, v, cu or (), fa4=True)
    scale = q.shape[-1] ** -0.5 if a["softmax_scale"] is None else a["softmax_scale"]
    softcap = a["softcap"] or 0.0
    window = fa4_window(a["causal"], a["window_size_left"], a["window_size_right"])
    seqlens = (a["max_seqlen_q"], a["max_seqlen_k"])
    out, lse = forward(q, k, v, scale, softcap, lambda sq, sk: window, cu, seqlens)
    wants = a["return_lse"] or any(t.requires_grad for t in (q, k, v))
    return out, (lse if wants else None)


def fa4_backward(a: dict):
    """``_flash_attn_bwd``'s body: writes and returns ``(dq, dk, dv)``."""
    fa34_unused(a, _FA4_UNUSED)
    q, k, v = a["q"], a["k"], a["v"]
    cu = None if a["cu_seqlens_q"] is None else (a["cu_seqlens_q"], a["cu_seqlens_k"])
    lse = a["lse"]
    want = (q.shape[1], q.shape[0]) if cu else (q.shape[0], q.shape[2], q.shape[1])
    assert tuple(lse.shape) == want, f"lse must have shape {want}"
    assert lse.dtype == torch.float32, "lse must be float32"
    check_inputs(q, k, v, cu or (), fa4=True)
    scale = q.shape[-1] ** -0.5 if a["softmax_scale"] is None else a["softmax_scale"]
    window = fa4_window(a["causal"], a["window_size_left"], a["window_size_right"])
    grads = (a["dq"], a["dk"], a["dv"])
    seqlens = (a["max_seqlen_q"], a["max_seqlen_k"])
    args = (a["dout"], q, k, v, a["out"], lse, grads, scale, a["softcap"])
    return backward(*args, lambda sq, sk: window, cu, seqlens)


def fa34_unused(a: dict, names) -> None:
    for name in names:
        if a.get(name) is not None:
            raise NotImplementedError(f"stand-in: {name} not supported")
