"""The torch backend: PyTorch's fused attention kernels, called through their aten ops
because those return the log-sum-exp that ring attention merges.

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (GQA native; float64 too).
- CUDA: torch's own flash kernel for float16/bfloat16 with a head dim <= 256 on sm80 or
  newer (GQA without expanding k/v), else the memory-efficient kernel (float32; k/v
  expanded to the query heads); float64 goes to the math backend. Head dims that are not a
  multiple of 8 are zero-padded (no score changes) and the result sliced.

Layout as in :mod:`ulysses_cp.kernels`.
"""

from __future__ import annotations

import torch

from . import math_backend
from .math_backend import expand_kv, lse_dtype, reduce_kv
from .spec import Band, Scores

__all__ = [
    "backward",
    "forward",
]

_LOW = (torch.float16, torch.bfloat16)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    # the fused CUDA kernels want head dims that are a multiple of 8; zeros change no score
    pad = -x.shape[-1] % 8
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _cuda_flash_ok(q: torch.Tensor) -> bool:
    """torch's own flash kernel (GQA native): fp16/bf16, head dim <= 256, sm80 or newer."""
    if q.dtype not in _LOW or q.shape[-1] > 256:
        return False
    return q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 0)


def _cuda_forward(q, k, v, causal, scale):
    """CUDA: torch's flash kernel where it runs (fp16/bf16: GQA without expanding k/v),
    else the memory-efficient kernel (float32, or older GPUs: k/v expanded to hq heads).
    Takes any device with these kernels' meta functions too (the CPU tests use "meta")."""
    d, sq = q.shape[-1], q.shape[1]
    if _cuda_flash_ok(q):
        qp, kp, vp = (_bhsd(_pad8(t)) for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qp, kp, vp, 0.0, causal, False, scale=scale
        )[:2]
    else:
        hq = q.shape[2]
        qp, kp, vp = (_bhsd(_pad8(t)) for t in (q, expand_kv(k, hq), expand_kv(v, hq)))
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            qp, kp, vp, None, True, 0.0, causal, scale=scale
        )[:2]
    # the efficient kernel pads the lse to a multiple of 32 rows
    return _bhsd(out)[..., :d], lse[..., :sq].float()


def _cuda_backward(dout, q, k, v, out, lse, how: Scores):
    causal, scale = how.causal, how.scale
    d, dev = q.shape[-1], q.device
    hq, hkv = q.shape[2], k.shape[2]
    lse = lse.float().contiguous()
    if _cuda_flash_ok(q):
        qp, kp, vp, op, dop = (_bhsd(_pad8(t)) for t in (q, k, v, out, dout.to(q.dtype)))
        # dropout 0: the rng state is never read; placeholders of the forward's types
        seed = torch.empty(2, dtype=torch.uint64, device=dev)
        offset = torch.empty((), dtype=torch.uint64, device=dev)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dop,
            qp,
            kp,
            vp,
            op,
            lse,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return (_bhsd(t)[..., :d] for t in (dq, dk, dv))
    kq, vq = expand_kv(k, hq), expand_kv(v, hq)
    qp, kp, vp, op, dop = (_bhsd(_pad8(t)) for t in (q, kq, vq, out, dout.to(q.dtype)))
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dop.contiguous(),
        qp,
        kp,
        vp,
        None,
        op,
        lse,
        zero,
        zero,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    dk, dv = (reduce_kv(_bhsd(t)[..., :d], hkv) for t in (dk, dv))
    return _bhsd(dq)[..., :d], dk, dv


def _math_path(how: Scores, q: torch.Tensor) -> bool:
    """What the fused kernels cannot take: a softcap, a band on CUDA, float64 on CUDA."""
    cpu = q.device.type == "cpu"
    return bool(how.softcap) or (not cpu and (how.band is not None or q.dtype == torch.float64))


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    if _math_path(how, q):
        return math_backend.forward(q, k, v, how)
    if q.device.type != "cpu":
        return _cuda_forward(q, k, v, how.causal, how.scale)
    # CPU flash kernel: (b, h, s, d), GQA native, lse (b, hq, sq) fp32 (fp64 for fp64); a
    # band goes in as an additive mask
    mask, empty = _band_mask(how.band, q, k)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, how.causal, attn_mask=mask, scale=how.scale
    )
    if empty is not None:  # the kernel gives rows that see no key lse 0: make them empty
        lse = lse.masked_fill(empty, float("-inf"))
    return _bhsd(out), lse


def _band_mask(
    band: Band | None, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(additive mask (sq, sk) in q's dtype, rows that see no key (sq,))`` or Nones."""
    if band is None:
        return None, None
    visible = math_backend.band_mask(q.shape[1], k.shape[1], band, q.device)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    return mask.masked_fill(~visible, float("-inf")), ~visible.any(-1)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    how: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = out.to(q.dtype)
    if _math_path(how, q):
        return math_backend.backward(dout, q, k, v, out, lse, how)
    if q.device.type != "cpu":
        return tuple(_cuda_backward(dout, q, k, v, out, lse, how))
    mask, _ = _band_mask(how.band, q, k)
    if mask is not None:  # rows with lse -inf see nothing anywhere: any finite lse gives p = 0
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    # the kernel takes dO in any layout with unit stride in d: no head-major copy
    dout = _bhsd(dout)
    if dout.stride(-1) != 1 or 0 in dout.stride():
        dout = dout.contiguous()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout,
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        _bhsd(out),
        lse.to(lse_dtype(q.dtype)).contiguous(),
        0.0,
        how.causal,
        attn_mask=mask,
        scale=how.scale,
    )
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)
