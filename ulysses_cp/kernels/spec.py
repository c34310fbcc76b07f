"""What one attention call computes, as one frozen value handed down through every layer.

:class:`AttentionSpec` is the call's math (flash-attn's meanings): ``causal``, the softmax
``scale``, a logit ``softcap``, a sliding ``window`` and whether attention ``sinks`` join
the softmax. ``ucp.attention`` builds it from its keywords; modes, ring steps and kernels
take it as it is instead of a list of keywords. :class:`Scores` is what one backend call
on one block needs of it: the scale, the causal mask of a square block, the softcap and a
:data:`Band` of visible diagonals (a window seen from that block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FULL_WINDOW",
    "AttentionSpec",
    "Band",
    "Scores",
]

FULL_WINDOW = (-1, -1)  # flash-attn's "no window"

# Which keys each query sees, as a band of diagonals: key j is visible to query i when
# lo <= j - i <= hi (None: unbounded). Causal aligned blocks are (None, 0); a sliding window
# (left, right) over blocks whose first query is ``offset`` tokens after their first key is
# (offset - left, offset + right), capped at offset when causal.
Band = tuple[int | None, int | None]


@dataclass(frozen=True)
class AttentionSpec:
    """``causal``; ``scale`` of the scores (None: ``1 / sqrt(head_dim)``); ``softcap`` (0:
    off): scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2);
    ``window=(left, right)``: query i sees keys ``i - left .. i + right`` (-1: unbounded;
    ``(-1, -1)`` is full attention); ``sinks``: one logit per query head joins every softmax
    denominator (GPT-OSS; the logits themselves are a tensor passed beside the spec).

    Built without checks, so that every rank can compare its spec with the others' first
    (``modes/checks.py``); :meth:`check` then raises ``ValueError`` with the values."""

    causal: bool = True
    scale: float | None = None
    softcap: float = 0.0
    window: tuple[int, int] = FULL_WINDOW
    sinks: bool = False

    @property
    def windowed(self) -> bool:
        return tuple(self.window) != FULL_WINDOW

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)

    def check(self) -> None:
        """``window`` two integers >= -1, ``softcap`` a finite number >= 0."""
        window = self.window
        ok = isinstance(window, (tuple, list)) and len(window) == 2
        if not ok or not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
            raise ValueError(
                f"window must be (left, right), two integers (-1: unbounded); got {window!r}"
            )
        if min(window) < -1:
            raise ValueError(f"window sizes must be >= 0 or -1 (unbounded), got {tuple(window)}")
        softcap = self.softcap
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise ValueError(f"softcap must be a number (0 = off), got {softcap!r}")
        if not (0.0 <= float(softcap) < float("inf")):
            raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")


@dataclass(frozen=True)
class Scores:
    """How a backend forms the scores of one ``sq x sk`` block: ``scale``, ``causal`` (the
    aligned causal mask of a square block), ``softcap`` (0: off) and ``band`` (the visible
    diagonals, :data:`Band`; None: every key). The last argument of every backend's
    ``forward(q, k, v, scores)`` and ``backward(dout, q, k, v, out, lse, scores)``."""

    causal: bool
    scale: float
    softcap: float = 0.0
    band: Band | None = None
