"""Block planning: how one block of queries and keys becomes kernel calls, and the work
counter.

Legend: sq/sk query/key tokens of a block, hq query heads; a block's first query comes
``offset`` tokens after its first key (ring steps and window pieces; 0: aligned).

- A sliding window seen from a block is a band of visible diagonals (:func:`window_band`);
  a band that leaves the block whole or aligned-causal goes back to a plain (fused) call
  (:func:`plain_block`), one that leaves no key visible skips the call
  (:func:`band_is_empty`): :func:`block_scores` decides.
- A packed block's documents are grouped by (query length, key length), one batched kernel
  call per group (:func:`doc_groups`), once per batch.
- :data:`work` counts the score entries the kernels computed and the blocks skipped.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch

from ..core.derived import once
from .spec import Band, Scores

__all__ = [
    "WorkStats",
    "band_is_empty",
    "block_scores",
    "doc_groups",
    "doc_scores",
    "one_document",
    "plain_block",
    "take",
    "window_band",
    "work",
]


class WorkStats:
    """Attention work per phase (``"forward"``, ``"backward"``).

    One process-wide instance, ``ulysses_cp.kernels.blocks.work``; the caller resets it.

    Attributes:
        scores: Score entries the kernels computed per phase (batch x query heads x
            queries x keys per call, masked entries included).
        skipped: Blocks a mode left out per phase because no query could see them
            (sliding windows).
    """

    def __init__(self) -> None:
        self.scores: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.scores.clear()
        self.skipped.clear()

    def snapshot(self) -> dict[str, int]:
        out = {f"scores/{p}": n for p, n in sorted(self.scores.items())}
        return out | {f"skipped/{p}": n for p, n in sorted(self.skipped.items())}

    def count(self, phase: str, q: torch.Tensor, k: torch.Tensor) -> None:
        """Score entries of one kernel call on ``q (b, sq, hq, d)`` against ``k (b, sk, ...)``.
        Not counted inside ``torch.compile``d layers (a compiled backward cannot change
        Python state; docs/training/compile.md)."""
        if torch.compiler.is_compiling():
            return
        b, sq, hq = q.shape[:3]
        self.scores[phase] += b * hq * sq * k.shape[1]


work = WorkStats()


def window_band(window: tuple[int, int], causal: bool, offset: int = 0) -> Band | None:
    """The visible diagonals (``lo <= j - i <= hi``) of a block whose first query is
    ``offset`` tokens after its first key, for flash-attn's ``window_size=(left, right)``
    (-1: unbounded) and ``causal``; None for full attention (no window)."""
    left, right = window
    if left < 0 and right < 0:
        return None
    lo = None if left < 0 else offset - left
    hi = None if right < 0 else offset + right
    if causal:
        hi = offset if hi is None else min(hi, offset)
    return lo, hi


def plain_block(band: Band, sq: int, sk: int) -> bool | None:
    """For a band that a plain kernel call expresses on an ``sq x sk`` block: False when every
    key is visible (full attention), True when it is the aligned causal mask; None when the
    block needs the band (masked entries off the causal diagonal)."""
    lo, hi = band
    lo_all = lo is None or lo <= -(sq - 1)
    if lo_all and (hi is None or hi >= sk - 1):
        return False
    if lo_all and hi == 0 and sq == sk:
        return True
    return None


def band_is_empty(band: Band, sq: int, sk: int) -> bool:
    """No key visible to any query of an ``sq x sk`` block (``j - i`` spans
    ``[-(sq - 1), sk - 1]``)."""
    lo, hi = band
    lo = -(sq - 1) if lo is None else max(lo, -(sq - 1))
    hi = sk - 1 if hi is None else min(hi, sk - 1)
    return lo > hi


def block_scores(
    spec_scores: Scores, window: tuple[int, int], offset: int, sq: int, sk: int
) -> Scores | None:
    """The :class:`Scores` of the kernel call on an ``sq x sk`` block whose first query
    comes ``offset`` tokens after its first key: the window folded into a band, or back to a
    plain (fused) call when the band leaves the block whole or aligned-causal; None when no
    query of the block sees a key (the call is skipped). ``spec_scores`` carries the scale,
    the softcap and the block's causal mask."""
    band = window_band(window, spec_scores.causal, offset)
    if band is None:
        return spec_scores
    if band_is_empty(band, sq, sk):
        return None
    plain = plain_block(band, sq, sk)
    if plain is None:
        return Scores(False, spec_scores.scale, spec_scores.softcap, band)
    return Scores(plain, spec_scores.scale, spec_scores.softcap)


# ---------------------------------------------------------------- packed blocks

# a group of documents of one (q length, k length): their query and key rows, how many
# documents, the lengths
Group = tuple[torch.Tensor, torch.Tensor, int, int, int]


def doc_groups(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[Group]:
    """Documents of a packed block grouped by (q length, k length), so each group is one
    batched kernel call: ``[(q index, k index, n docs, lq, lk)]``; empty documents dropped.
    Once per batch (the same ``cu`` tensors serve every layer and ring step)."""
    return once((cu_q, cu_k), "doc groups", partial(_group_documents, cu_q, cu_k))


def _group_documents(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[Group]:
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert len(bq) == len(bk), "cu_q and cu_k must list the same documents"
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if b > a and d > c:
            groups.setdefault((b - a, d - c), []).append((a, c))
    device = cu_q.device
    out = []
    for (lq, lk), starts in groups.items():
        sq, sk = (torch.tensor(x, device=device)[:, None] for x in zip(*starts))
        qi = (sq + torch.arange(lq, device=device)).flatten()
        ki = (sk + torch.arange(lk, device=device)).flatten()
        out.append((qi, ki, len(starts), lq, lk))
    return out


def take(x: torch.Tensor, idx: torch.Tensor, n: int, length: int) -> torch.Tensor:
    # (1, t, h, d) rows idx -> (n, length, h, d)
    return x[0].index_select(0, idx).view(n, length, *x.shape[2:])


def one_document(q: torch.Tensor, k: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
    """A block that is one whole document on both sides: the dense call, no gathers."""
    if len(cu_q) != 2:
        return False
    key = ("one document", q.shape[1], k.shape[1])
    whole = [0, q.shape[1]], [0, k.shape[1]]
    return once((cu_q, cu_k), key, lambda: (cu_q.tolist(), cu_k.tolist()) == whole)


def doc_scores(cu_q: torch.Tensor, cu_k: torch.Tensor, hq: int) -> int:
    """Score entries of one varlen call over every document of a packed block."""
    return hq * sum(n * lq * lk for _, _, n, lq, lk in doc_groups(cu_q, cu_k))
