"""Which local kernel runs a call: the backends by name, ``"auto"``, and kernels of your own.

Backends: ``"math"`` (:mod:`.math_backend`, pure PyTorch, any dtype), ``"torch"``
(:mod:`.torch_backend`, torch's fused kernels), ``"flash_attn"`` (:mod:`.flash_backend`,
flash-attn 2.6-2.8, imported lazily), ``"auto"`` (:func:`resolve_backend`: flash-attn for
inputs it can run, else torch). Every backend has the same two functions,
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
from . import flash_backend, math_backend, torch_backend, widths

__all__ = [
    "Kernel",
    "backward_of",
    "flash_attn_unusable",
    "forward_of",
    "resolve_backend",
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
}
_BACKWARD = {
    "math": math_backend.backward,
    "torch": torch_backend.backward,
    "flash_attn": flash_backend.backward,
}


def forward_of(backend: str | Kernel) -> Callable:
    """The forward function of a resolved backend (a name other than ``"auto"``, or a
    :class:`Kernel`). Values of another width than q and k (MLA) reach every backend but
    the math one padded to one width (:mod:`.widths`)."""
    if backend == "math":
        return math_backend.forward
    fn = backend.forward if isinstance(backend, Kernel) else _FORWARD[backend]
    return partial(widths.forward, fn)


def backward_of(backend: str | Kernel) -> Callable:
    """The backward function of a resolved backend, as :func:`forward_of`."""
    if backend == "math":
        return math_backend.backward
    fn = backend.backward if isinstance(backend, Kernel) else _BACKWARD[backend]
    return partial(widths.backward, fn)


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
