"""The torch backend: PyTorch's fused attention kernels, called through their aten ops
because those return the log-sum-exp that ring attention merges.

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (GQA native; float64 too).
- CUDA, the fastest kernel that returns the lse for the call, chosen by rule
  (:func:`cuda_kernel`), never by trying: cuDNN's attention on Hopper and newer for
  float16/bfloat16 and head dims of 64, 128, 192 or 256 (what SDPA picks there: 3.51 ms
  against 7.00 ms for the flash kernel, causal fwd+bwd, 8K tokens, 32/8 heads, d 128, one
  H200; GQA native, lse float32, a backward that takes a given out and lse); else torch's
  own flash kernel for float16/bfloat16 with a head dim <= 256 on sm80 or newer (GQA
  without expanding k/v); else the memory-efficient kernel (float32; k/v expanded to the
  query heads); float64 goes to the math backend. Head dims that are not a multiple of 8
  are zero-padded (no score changes) and the result sliced.

Layout as in :mod:`ulysses_cp.kernels`.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import math_backend
from .math_backend import expand_kv, lse_dtype, reduce_kv
from .spec import Band, Scores

__all__ = [
    "backward",
    "cuda_kernel",
    "forward",
]

CudaKernel = Literal["cudnn", "flash", "efficient"]

_LOW = (torch.float16, torch.bfloat16)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    # the fused CUDA kernels want head dims that are a multiple of 8; zeros change no score
    pad = -x.shape[-1] % 8
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def cuda_kernel(
    dtype: torch.dtype, d: int, capability: tuple[int, int], cudnn: int | None
) -> CudaKernel:
    """The CUDA kernel for a call: ``d`` the head dim (q, k and v at one width),
    ``capability`` the GPU's, ``cudnn`` the cuDNN version (``torch.backends.cudnn.version()``,
    None without it). cuDNN: fp16/bf16, d in 64, 128, 192, 256, sm90 or newer, cuDNN 9
    (where it was measured); torch's flash: fp16/bf16, d <= 256, sm80 or newer; else the
    memory-efficient kernel."""
    if dtype not in _LOW:
        return "efficient"
    if d % 64 == 0 and d <= 256 and capability >= (9, 0) and (cudnn or 0) >= 90000:
        return "cudnn"
    if d <= 256 and capability >= (8, 0):
        return "flash"
    return "efficient"


def _kernel(q: torch.Tensor) -> CudaKernel:
    """:func:`cuda_kernel` for ``q``'s device; meta tensors (the CPU tests of the aten
    schemas) stand for a Hopper GPU with cuDNN 9."""
    version: int | None
    if q.device.type != "cuda":
        capability, version = (9, 0), 90000
    else:
        capability = torch.cuda.get_device_capability(q.device)
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        version = None
    return cuda_kernel(q.dtype, q.shape[-1], capability, version)


def _cuda_forward(q, k, v, causal, scale):
    """CUDA: torch's flash kernel where it runs (fp16/bf16: GQA without expanding k/v),
    else the memory-efficient kernel (float32, or older GPUs: k/v expanded to hq heads).
    Takes any device with these kernels' meta functions too (the CPU tests use "meta")."""
    d, sq = q.shape[-1], q.shape[1]
    kernel = _kernel(q)
    if kernel == "cudnn":  # d a multiple of 64: no padding; lse (b, h, s, 1)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale
        )[:2]
        return _bhsd(out), lse[..., 0].float()
    if kernel == "flash":
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
    kernel = _kernel(q)
    if kernel == "cudnn":
        # out and dout in the same layout as q ((b, s, h, d) storage); dropout 0: the rng
        # state is never read, placeholders of the forward's types
        qp, kp, vp, op, dop = (_bhsd(t.contiguous()) for t in (q, k, v, out, dout.to(q.dtype)))
        seed = torch.zeros((), dtype=torch.long, device=dev)
        offset = torch.zeros((), dtype=torch.long, device=dev)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dop,
            qp,
            kp,
            vp,
            op,
            lse[..., None],  # (b, h, s, 1), as the forward gives it
            seed,
            offset,
            None,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            scale=scale,
        )
        return (_bhsd(t) for t in grads[:3])
    if kernel == "flash":
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
