"""Which local kernel runs a call: the backends by name, ``"auto"``, and kernels of your own.

Backends: ``"math"`` (:mod:`.math_backend`, pure PyTorch, any dtype), ``"torch"``
(:mod:`.torch_backend`, torch's fused kernels), ``"flash_attn"`` (:mod:`.flash_backend`,
flash-attn 2.6-2.8), ``"flash_attn3"`` (:mod:`.flash3_backend`, FlashAttention-3),
``"flash_attn4"`` (:mod:`.flash4_backend`, FlashAttention-4; the last three imported
lazily), ``"auto"`` (:func:`resolve_backend`: the first of :data:`AUTO_ORDER` for the GPU
found that imports and runs the inputs, else torch). Every backend has the same two functions,
``forward(q, k, v, scores) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, scores)
-> (dq, dk, dv)`` (``scores``: :class:`~ulysses_cp.kernels.spec.Scores`), and so does a
:class:`Kernel` of your own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..core.log import get_logger
from ..core.options import BACKENDS
from . import flash3_backend, flash4_backend, flash_backend, math_backend, torch_backend, widths

__all__ = [
    "AUTO_ORDER",
    "NATIVE_WIDTHS",
    "Kernel",
    "auto_choice",
    "backend_unusable",
    "backward_of",
    "flash_attn_unusable",
    "forward_of",
    "resolve_backend",
    "tier",
]

_LOW = (torch.float16, torch.bfloat16)
_said: set[str] = set()


@dataclass(frozen=True)
class Kernel:
    """A local attention kernel of your own, passed as ``backend=`` wherever a backend name
    goes: ``forward(q, k, v, scores) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse,
    scores) -> (dq, dk, dv)`` on ``(b, s, h, d)`` blocks (k/v may have fewer heads; lse
    ``(b, hq, s)``), the contract of the built-in backends; ``scores`` says how the block's
    scores are formed (:class:`~ulysses_cp.kernels.spec.Scores`: scale, causal mask,
    softcap, band). For experiments and tests (counting work, injecting a fault) without
    patching modules."""

    name: str
    forward: Callable
    backward: Callable


_FORWARD = {
    "math": math_backend.forward,
    "torch": torch_backend.forward,
    "flash_attn": flash_backend.forward,
    "flash_attn3": flash3_backend.forward,
    "flash_attn4": flash4_backend.forward,
}
_BACKWARD = {
    "math": math_backend.backward,
    "torch": torch_backend.backward,
    "flash_attn": flash_backend.backward,
    "flash_attn3": flash3_backend.backward,
    "flash_attn4": flash4_backend.backward,
}
NATIVE_WIDTHS = ("math", "flash_attn4")  # take values of their own width (MLA) as they are

# "auto": the backends tried on each GPU generation, fastest first; the first one that
# imports and runs the inputs (backend_unusable) is taken, and "torch" runs anything.
# Where each place comes from:
# - sm90: cuDNN attention, through our "torch" backend, runs causal bf16 fwd+bwd (hq 32,
#   hkv 8, d 128) in 3.51 ms at 8K and 55.1 ms at 32K, against 7.00 / 95.1 ms for
#   flash-attn 2's kernel: measured on one H200, torch 2.11, cuDNN 9.19. So flash-attn 2
#   is not tried on Hopper. FlashAttention-3 is the Hopper kernel: 1.5-2.0x flash-attn 2
#   on H100 (Shah et al. 2024, arXiv:2407.08608), published, not measured here.
#   FlashAttention-4 targets Blackwell and runs Hopper (its interface's arch checks).
# - sm100 and newer: FlashAttention-4 is written for Blackwell (Dao-AILab/flash-attention,
#   flash_attn/cute); FlashAttention-3 is sm90 only; then cuDNN through "torch".
# - sm80-sm89: flash-attn 2 (FlashAttention-3 and -4's backward need sm90+), then torch.
# None of flash_attn3 / flash_attn4 has run on a GPU here: the places of those two rest
# on their authors' numbers, and their adapters are pinned on CPU by stand-ins only.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "sm100+": ("flash_attn4", "torch"),
    "sm90": ("flash_attn3", "flash_attn4", "torch"),
    "sm80-89": ("flash_attn", "torch"),
    "older or not CUDA": ("torch",),
}


def forward_of(backend: str | Kernel) -> Callable:
    """The forward function of a resolved backend (a name other than ``"auto"``, or a
    :class:`Kernel`). Values of another width than q and k (MLA) reach every backend but
    the math one and FlashAttention-4 padded to one width (:mod:`.widths`)."""
    if backend in NATIVE_WIDTHS:
        return _FORWARD[backend]
    fn = backend.forward if isinstance(backend, Kernel) else _FORWARD[backend]
    return partial(widths.forward, fn)


def backward_of(backend: str | Kernel) -> Callable:
    """The backward function of a resolved backend, as :func:`forward_of`."""
    if backend in NATIVE_WIDTHS:
        return _BACKWARD[backend]
    fn = backend.backward if isinstance(backend, Kernel) else _BACKWARD[backend]
    return partial(widths.backward, fn)


def tier(device_type: str, capability: tuple[int, int]) -> str:
    """The row of :data:`AUTO_ORDER` for a device."""
    if device_type != "cuda" or tuple(capability) < (8, 0):
        return "older or not CUDA"
    return "sm100+" if capability[0] >= 10 else "sm90" if capability[0] == 9 else "sm80-89"


def _fa4_dims(d: int, dv: int, major: int) -> str | None:
    """FlashAttention-4's head dims (its ``_validate_head_dims``), after padding to 8."""
    d, dv = -(-d // 8) * 8, -(-dv // 8) * 8
    if major == 9:
        return None if max(d, dv) <= 256 else f"head dims ({d}, {dv}) > 256"
    if (d <= 128 and dv <= 128) or (d, dv) in ((192, 128), (256, 256)):
        return None
    return f"head dims ({d}, {dv}): sm100 takes <= 128, (192, 128) or (256, 256)"


# (lowest, first not run) compute capability of each library, and the same in words
_RUNS = {
    "flash_attn": ((8, 0), (99, 0), "sm80 and newer"),
    "flash_attn3": ((9, 0), (10, 0), "sm90 only"),
    "flash_attn4": ((9, 0), (12, 0), "sm90, sm100 and sm110 here"),
}
_IMPORTS = {
    "flash_attn": flash_backend.import_problem,
    "flash_attn3": flash3_backend.import_problem,
    "flash_attn4": flash4_backend.import_problem,
}


def backend_unusable(
    name: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] = (9, 0),
    head_dim_v: int | None = None,
) -> str | None:
    """Why ``"auto"`` does not pick backend ``name`` for such inputs, or None when it can
    run them, by rule (never by trying): "torch" and "math" run anything; flash-attn 2 on
    sm80+, FlashAttention-3 on sm90, FlashAttention-4 on sm90-sm110; all three take
    float16/bfloat16, head dims <= 256 (FlashAttention-4 on sm100: <= 128, (192, 128) or
    (256, 256)), and must import."""
    if name not in _IMPORTS:
        return None
    dv = head_dim if head_dim_v is None else head_dim_v
    if device_type != "cuda":
        return f"the tensors are on {device_type}"
    cc = tuple(capability)
    lo, hi, says = _RUNS[name]
    if not lo <= cc < hi:
        return f"GPU compute capability {cc[0]}.{cc[1]} ({name} runs {says})"
    if dtype not in _LOW:
        return f"dtype {dtype} ({name} takes float16/bfloat16)"
    if name == "flash_attn4":
        why = _fa4_dims(head_dim, dv, cc[0])
        if why:
            return why
    elif max(head_dim, dv) > 256:
        return f"head dim {max(head_dim, dv)} > 256"
    return _IMPORTS[name]()


def flash_attn_unusable(
    device_type: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] = (9, 0)
) -> str | None:
    """Why ``"auto"`` does not pick flash-attn 2 for such inputs (:func:`backend_unusable`)."""
    return backend_unusable("flash_attn", device_type, dtype, head_dim, capability)


def auto_choice(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int],
    head_dim_v: int | None = None,
) -> tuple[str, list[str]]:
    """What ``"auto"`` picks for such inputs: the first of :data:`AUTO_ORDER`'s row for
    the device that :func:`backend_unusable` accepts, and why each one before it was not."""
    skipped: list[str] = []
    for choice in AUTO_ORDER[tier(device_type, capability)]:
        why = backend_unusable(choice, device_type, dtype, head_dim, capability, head_dim_v)
        if why is None:
            return choice, skipped
        skipped.append(f"not {choice}: {why}")
    raise AssertionError(f"no backend in {AUTO_ORDER} runs anything")  # "torch" always does


def resolve_backend(
    backend: str | Kernel, q: torch.Tensor, v: torch.Tensor | None = None
) -> str | Kernel:
    """Map ``"auto"`` to a backend that can run ``q``'s device, dtype and head dim (and v's
    width; say why, once, in the log); raise ``ValueError`` for an unknown or unusable
    choice.

    ``"auto"``: the first backend of :data:`AUTO_ORDER`'s row for the device that
    :func:`backend_unusable` accepts ("torch" on a CPU). ``"flash_attn"``,
    ``"flash_attn3"`` and ``"flash_attn4"`` hand the tensors over as they are (the
    libraries themselves reject CPU tensors and float32), once their module imports."""
    if isinstance(backend, Kernel):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "auto":
        cc = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (0, 0)
        dv = q.shape[-1] if v is None else v.shape[-1]
        choice, skipped = auto_choice(q.device.type, q.dtype, q.shape[-1], cc, dv)
        note = f"attention backend 'auto' -> {choice!r}" + "".join(f"; {w}" for w in skipped)
        if note not in _said:
            _said.add(note)
            get_logger().info(note)
        return choice
    if backend == "flash_attn":
        flash_backend.interface()  # ValueError: not installed, broken, or unsupported
    elif backend == "flash_attn3":
        flash3_backend.library()
    elif backend == "flash_attn4":
        flash4_backend.library()
    return backend
