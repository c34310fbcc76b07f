"""FlashAttention-4 adapter (backend ``"flash_attn4"``, imported lazily on first use).

FlashAttention-4 is the CuTe-DSL kernel of Dao-AILab/flash-attention's ``flash_attn/cute/``
folder, written for Blackwell (sm100/sm110) and running Hopper (sm90) too; the
distribution ``flash-attn-4`` (``pip install flash-attn-4``; CUDA 13 wants the
``[cu13]`` extra) installs the module ``flash_attn.cute``. We call its internal
``flash_attn.cute.interface._flash_attn_fwd`` (with ``return_lse=True``) and
``_flash_attn_bwd``; one function serves dense rows ``(b, s, h, d)`` and packed rows
``(total, h, d)`` with ``cu_seqlens_q/k``. Read at tags fa4-v4.0.0.beta0, beta10, beta18,
beta19, beta20 and beta27 and pinned by ``tests/unit/test_flash34_contract.py`` against
stand-ins that copy beta18's and beta27's interfaces:

- the forward returns ``(out, lse)`` up to beta18, ``(out, lse, p, row_max)`` from beta19;
  lse float32 ``(b, h, s)`` dense, ``(h, total_q)`` packed;
- the backward takes ``(q, k, v, out, dout, lse, ...)`` (an order of its own, passed by
  name here), writes the dq/dk/dv given and returns them;
- window ``window_size_left/right`` bottom-right aligned as flash-attn 2, **None**
  unbounded (not -1); softcap in both passes;
- head dims (``_validate_head_dims``): sm90 8-256, multiples of 8 (we pad with zeros);
  sm100/sm110 8-128, or (192, 128) (DeepSeek MLA), or (256, 256); values of their own
  width are passed as they are (MLA natively); float16/bfloat16 (fp8: forward only).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from .flash_common import (
    Cu,
    Fn,
    Found,
    Library,
    dist_version,
    lib_backward,
    lib_forward,
    parameters,
)
from .spec import Scores

__all__ = [
    "backward",
    "forward",
    "import_problem",
    "library",
    "reset",
    "varlen_backward",
    "varlen_forward",
]

_MODULE = "flash_attn.cute.interface"
_INSTALL = "FlashAttention-4 (`pip install flash-attn-4`; CUDA 13: `flash-attn-4[cu13]`)"


def import_problem() -> str | None:
    """Why FlashAttention-4 cannot be used here, or None when it imports."""
    return _FOUND.problem()


def library() -> Library:
    """The installed FlashAttention-4's two internal functions; ``ValueError`` if unusable."""
    return _FOUND.get()


def reset() -> None:
    """Forget what was found (after installing or swapping FlashAttention-4)."""
    _FOUND.reset()


def _find() -> bool:
    try:  # finding a submodule imports its parent, ``flash_attn`` (flash-attn 2's, if any)
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # a parent that does not import
        return False


def _load() -> Library:
    if not _find():
        raise ValueError(
            f"backend 'flash_attn4' needs {_INSTALL}; its module 'flash_attn.cute' is not "
            f"installed; use backend='torch' otherwise"
        )
    try:
        fai = importlib.import_module(_MODULE)
    except Exception as exc:  # nvidia-cutlass-dsl missing or built for another CUDA...
        raise ValueError(
            f"FlashAttention-4 is installed but {_MODULE} does not import "
            f"({type(exc).__name__}: {str(exc).strip()[:300]}); reinstall flash-attn-4 for "
            f"this torch and CUDA, or use backend='torch'"
        ) from exc
    version = dist_version("flash-attn-4") or "unknown"  # its own __version__ reads "fa4"
    if version != "unknown" and not version.startswith("4."):
        raise ValueError(
            f"flash_attn.cute belongs to flash-attn-4 {version}; backend 'flash_attn4' "
            f"knows FlashAttention-4 4.0.0 betas"
        )
    label = f"FlashAttention-4 {version}"
    fns = {}
    for key, name in (("forward", "_flash_attn_fwd"), ("backward", "_flash_attn_bwd")):
        fn = getattr(fai, name, None)
        params = None if fn is None else parameters(fn)
        if fn is None or params is None:
            raise ValueError(
                f"{label}: {_MODULE}.{name} is missing or its parameters cannot be read"
            )
        fns[key] = Fn(name, fn, params)
    hint = "; backend 'flash_attn4' knows FlashAttention-4 4.0.0b0 to b27"
    lse_at = {2: 1, 4: 1}  # (out, lse) to beta18; (out, lse, p, row_max) from beta19
    extra = {"return_lse": True}  # else no lse without autograd
    return Library(label, fns["forward"], fns["backward"], lse_at, None, extra, {}, hint)


_FOUND: Found[Library] = Found(_load)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    return lib_forward(library(), q, k, v, how)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    how: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lib_backward(library(), (dout, q, k, v, out, lse), how)


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Cu, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``(1, total, h, d)`` (``cu``: their documents): lse ``(1, hq, total)``."""
    return lib_forward(library(), q, k, v, how, cu)


def varlen_backward(dout, q, k, v, out, lse, cu: Cu, how: Scores):
    return lib_backward(library(), (dout, q, k, v, out, lse), how, cu)
