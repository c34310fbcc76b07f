"""FlashAttention-3 adapter (backend ``"flash_attn3"``, imported lazily on first use).

FlashAttention-3 is the Hopper (sm90) kernel of Dao-AILab/flash-attention's ``hopper/``
folder, installed as the distribution ``flash_attn_3`` with the top-level module
``flash_attn_interface`` (built from source: ``cd hopper && python setup.py install``).
We call its internal ``_flash_attn_forward`` / ``_flash_attn_backward``, which return and
take the log-sum-exp ring attention merges; one function serves dense rows ``(b, s, h, d)``
and packed rows ``(total, h, d)`` with ``cu_seqlens_q/k``. What differs between releases
(read from ``hopper/flash_attn_interface.py`` and pinned by ``tests/unit/test_flash34_contract.py``
against stand-ins that copy each interface):

==============  ====================================  =====================================
                3.0.0b1 (2025)                        3.0.0 (2026-02)
==============  ====================================  =====================================
wrapping        plain functions, no defaults          ``torch.library.custom_op``
window          ``window_size=(left, right)``         ``window_size_left``, ``_right``
backward        ``causal``; returns dq, dk, dv,       ``is_causal``; returns softmax_d and
                softmax_d                             writes the dq/dk/dv given
==============  ====================================  =====================================

Both forwards return ``(out, softmax_lse, out_accum, softmax_lse_accum)``; lse float32
``(b, h, s)`` dense, ``(h, total_q)`` packed; a row that sees no key gets lse -inf. Window
bottom-right aligned with -1 unbounded, as flash-attn 2. Head dims: a multiple of 8 up to
256 (we pad with zeros); values of another width (MLA) are padded to q's width
(:mod:`.widths`). float16/bfloat16 (fp8 forward only: not used). Every argument is passed
by name; one that changes the result and is not taken is refused naming the release.
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

_MODULE = "flash_attn_interface"
_INSTALL = (
    "FlashAttention-3 (Dao-AILab/flash-attention's hopper/ folder: `cd hopper && python "
    "setup.py install`, a Hopper GPU and CUDA 12.3+)"
)
_NEUTRAL = {  # 3.0.0b1's parameters have no defaults: every one we do not use, neutral
    **dict.fromkeys(
        [
            "k_new",
            "v_new",
            "qv",
            "out",
            "out_",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "cu_seqlens_k_new",
            "seqused_q",
            "seqused_k",
            "max_seqlen_q",
            "max_seqlen_k",
            "page_table",
            "kv_batch_idx",
            "leftpad_k",
            "rotary_cos",
            "rotary_sin",
            "seqlens_rotary",
            "q_descale",
            "k_descale",
            "v_descale",
            "scheduler_metadata",
            "pack_gqa",
            "sequed_q",
            "sequed_k",
        ]
    ),
    "attention_chunk": 0,
    "rotary_interleaved": True,
    "num_splits": 1,
    "sm_margin": 0,
    "deterministic": False,
}


def import_problem() -> str | None:
    """Why FlashAttention-3 cannot be used here, or None when it imports."""
    return _FOUND.problem()


def library() -> Library:
    """The installed FlashAttention-3's two internal functions; ``ValueError`` if unusable."""
    return _FOUND.get()


def reset() -> None:
    """Forget what was found (after installing or swapping FlashAttention-3)."""
    _FOUND.reset()


def _load() -> Library:
    if importlib.util.find_spec(_MODULE) is None:
        raise ValueError(
            f"backend 'flash_attn3' needs {_INSTALL}; its module {_MODULE!r} is not "
            f"installed; use backend='torch' (cuDNN attention on Hopper) otherwise"
        )
    try:
        fai = importlib.import_module(_MODULE)
    except Exception as exc:  # built for another torch/CUDA, ABI...
        raise ValueError(
            f"FlashAttention-3 is installed but {_MODULE} does not import "
            f"({type(exc).__name__}: {str(exc).strip()[:300]}); rebuild it for this torch "
            f"and CUDA, or use backend='torch'"
        ) from exc
    version = dist_version("flash_attn_3", "flash-attn-3") or "unknown"
    if version != "unknown" and not version.startswith("3."):
        raise ValueError(
            f"{_MODULE} belongs to flash_attn_3 {version}; backend 'flash_attn3' knows "
            f"FlashAttention-3 (3.0.0b1 and 3.0.0)"
        )
    label = f"FlashAttention-3 {version}"
    fns = {}
    for key, name in (("forward", "_flash_attn_forward"), ("backward", "_flash_attn_backward")):
        fn = getattr(fai, name, None)
        params = None if fn is None else parameters(fn)
        if fn is None or params is None:
            raise ValueError(
                f"{label}: {_MODULE}.{name} is missing or its parameters cannot be read"
            )
        fns[key] = Fn(name, fn, params)
    hint = "; backend 'flash_attn3' knows FlashAttention-3 3.0.0b1 and 3.0.0"
    return Library(label, fns["forward"], fns["backward"], {4: 1}, -1, {}, _NEUTRAL, hint)


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
