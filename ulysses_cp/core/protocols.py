"""Names for the types the package passes around, so signatures say what they take.

``Group``: a ``torch.distributed`` process group, or None for the default group (or a
local run). ``Engine``: a DeepSpeed engine (``ucp.initialize``'s result; DeepSpeed ships no
type stubs). ``AttentionFn``: what a model's attention is (``ucp.Attention(topo)``).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import torch
from torch.distributed import ProcessGroup

__all__ = ["AttentionFn", "Engine", "Group"]

Group: TypeAlias = ProcessGroup | None
Engine: TypeAlias = Any  # deepspeed.DeepSpeedEngine


class AttentionFn(Protocol):
    """``(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d) -> (b, s, hq, d)``; ``cu_seqlens``:
    a packed row's document boundaries."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
