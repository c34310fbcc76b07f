"""The math backend: plain PyTorch attention, any dtype (the float64 reference).

Legend and layout as in :mod:`ulysses_cp.kernels`: q ``(b, sq, hq, d)``, k/v
``(b, sk, hkv, d)``, lse ``(b, hq, sq)`` in float32 (float64 for float64 inputs). Rows with
no visible key give ``lse = -inf`` and zero probabilities, never NaN.
"""

from __future__ import annotations

import torch

from .spec import Band, Scores

__all__ = [
    "backward",
    "band_mask",
    "expand_kv",
    "forward",
    "lse_dtype",
    "reduce_kv",
]


def band_mask(sq: int, sk: int, band: Band, device: torch.device) -> torch.Tensor:
    """``(sq, sk)`` bool, True where key j is visible to query i."""
    lo, hi = band
    d = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if lo is not None:
        visible &= d >= lo
    if hi is not None:
        visible &= d <= hi
    return visible


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    # (b, sk, hkv, d) -> (b, sk, hq, d): kv head j serves query heads [j*g, (j+1)*g)
    return x.repeat_interleave(hq // x.shape[2], dim=2)


def reduce_kv(grad: torch.Tensor, hkv: int) -> torch.Tensor:
    # (b, sk, hq, d) -> (b, sk, hkv, g, d) -> sum over the g query heads of each kv head
    b, s, hq, d = grad.shape
    return grad.reshape(b, s, hkv, hq // hkv, d).sum(3)


def _math_probs(q, k, lse, how: Scores, cdt):
    """Scores ``(b, hq, sq, sk)`` in the compute dtype and the probabilities given the row
    lse (computed when None); with a softcap also ``tanh(scores / softcap)`` (for the
    backward), else None."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(cdt), expand_kv(k, q.shape[2]).to(cdt)) * how.scale
    t = None
    if how.softcap:
        t = torch.tanh(s / how.softcap)
        s = how.softcap * t
    if how.causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if how.band is not None:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~band_mask(sq, sk, how.band, s.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)  # (b, hq, sq)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # empty rows -> p = 0
    return torch.exp(s - safe.unsqueeze(-1)), lse, t


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """A softcap (> 0): scores become ``softcap * tanh(scores / softcap)`` (flash-attn's
    logit softcapping, Gemma 2) before the mask and the softmax. A band: only keys with
    ``lo <= j - i <= hi`` are visible (sliding windows; see ``spec.Band``)."""
    cdt = lse_dtype(q.dtype)
    p, lse, _ = _math_probs(q, k, None, how, cdt)
    out = torch.einsum("bhqk,bkhd->bqhd", p, expand_kv(v, q.shape[2]).to(cdt))
    return out.to(q.dtype), lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    how: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cdt = lse_dtype(q.dtype)
    hq, hkv = q.shape[2], k.shape[2]
    p, _, t = _math_probs(q, k, lse.to(cdt), how, cdt)  # (b, hq, sq, sk)
    do = dout.to(cdt)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)  # (b, sk, hq, d)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, expand_kv(v, hq).to(cdt))
    delta = (do * out.to(cdt)).sum(-1).transpose(1, 2)  # (b, hq, sq)
    ds = p * (dp - delta.unsqueeze(-1)) * how.scale
    if t is not None:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, expand_kv(k, hq).to(cdt))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(cdt))
    return dq.to(q.dtype), reduce_kv(dk, hkv).to(k.dtype), reduce_kv(dv, hkv).to(v.dtype)
