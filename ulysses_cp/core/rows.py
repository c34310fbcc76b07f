"""Row-wise layout of packed rows: the row is split like an unpacked sequence, documents of
any length cross rank borders, attention follows the global ``cu_seqlens``.

Legend: a row of N tokens with document boundaries ``bounds = [0, ..., N]``; P ranks of
one level (the ring); r this rank; the row is cut into chunks of c tokens: contiguous
``c = N / P``, rank r holds chunk r; zigzag ``c = N / (2P)``, rank r holds chunks r and
2P-1-r (local order: increasing). Only N must split over the ranks
(``sequence_multiple``), never a document.

Ulysses level: after the all-to-all a rank holds the whole row, in natural order, for its
heads, so its kernel takes the global ``cu`` as it is (:attr:`RowDocs.cu`).

Ring level: query chunk i meets key chunk j. A query may see a key only in its own
document (and, causal, at or before it). So:

- ``i == j`` (the diagonal, step 0): the documents clipped to the chunk, each attending
  to itself (causal: aligned), one varlen call, ``cu = clamp(bounds, i*c, (i+1)*c) - i*c``.
- ``i != j``: a document that meets both chunks holds every token between them, so there
  is at most one: the one holding the later chunk's first token, if it starts inside the
  earlier chunk. Its part of the earlier chunk ends at that chunk's end, its part of the
  later chunk starts at that chunk's start, and every such key is before every such query
  (when j < i) or after it (j > i): one dense block, non-causal when j < i, skipped under
  causal when j > i, nothing at all when no document crosses. Under a window the block
  carries its ``offset`` (first query minus first key, global positions).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["RowDocs", "row_chunks"]

# (query selection, key selection, where the block sits: KernelCall fields)
Block = tuple[Any, Any, dict[str, Any]]


def row_chunks(P: int, rank: int, layout: str) -> list[int]:
    """The chunk indices ``rank`` of ``P`` holds, in local order (chunks of N/P or N/2P)."""
    if layout == "contiguous" or P == 1:
        return [rank]
    return [rank, 2 * P - 1 - rank]


class RowDocs:
    """One ring rank's view of a packed row in the row-wise layout: ``bounds`` (global),
    ``P`` ranks, this ``rank``, the ``layout``; tensors on ``device``. ``cu``: the global
    boundaries (what the Ulysses level's kernel takes). :meth:`blocks` gives a ring step's
    blocks, made once per (step, causal, window) and kept (the same for every layer)."""

    def __init__(self, bounds: list[int], P: int, rank: int, layout: str, device) -> None:
        self.bounds, self.P, self.rank, self.layout = bounds, P, rank, layout
        N = bounds[-1]
        self.parts = len(row_chunks(P, rank, layout))
        self.c = N // (P * self.parts)
        self.device = device
        self.cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        self._memo: dict[Hashable, list[Block]] = {}
        self._diag = self._diagonal_cu()

    def _diagonal_cu(self) -> torch.Tensor:
        """The documents clipped to each of this rank's chunks, chunk after chunk in local
        order: one varlen boundary list (a document crossing into a later chunk counts as
        one document per chunk; its cross pairs are a dense block of their own)."""
        c, bounds = self.c, torch.tensor(self.bounds, dtype=torch.long)
        parts = []
        for h, i in enumerate(row_chunks(self.P, self.rank, self.layout)):
            clipped = bounds.clamp(i * c, (i + 1) * c) - i * c + h * c
            parts.append(clipped)
        # chunk h ends where chunk h+1 starts: drop repeated (empty-document) boundaries
        return torch.unique_consecutive(torch.cat(parts)).to(torch.int32).to(self.device)

    def _crossing(self, i: int, j: int) -> tuple[int, int, int, int] | None:
        """Chunks ``i != j``: ``(q start, q end, k start, k end)`` in global positions of the
        one document that meets both, or None."""
        c, bounds = self.c, self.bounds
        early, late = min(i, j), max(i, j)
        d = bisect.bisect_right(bounds, late * c) - 1  # the document holding the late start
        a, b = bounds[d], bounds[d + 1]
        if a >= (early + 1) * c:  # it starts after the early chunk: none crosses
            return None
        lo_early, hi_early = max(a, early * c), (early + 1) * c
        lo_late, hi_late = late * c, min(b, (late + 1) * c)
        if i > j:
            return lo_late, hi_late, lo_early, hi_early
        return lo_early, hi_early, lo_late, hi_late

    def blocks(self, step: int, causal: bool, window: tuple[int, int]) -> list[Block]:
        """The blocks of ring step ``step`` (kv from rank ``(rank - step) mod P``)."""
        key = (step, causal, tuple(window))
        if key not in self._memo:
            self._memo[key] = self._blocks(step, causal)
        return self._memo[key]

    def _blocks(self, step: int, causal: bool) -> list[Block]:
        c, P = self.c, self.P
        src = (self.rank - step) % P
        mine = row_chunks(P, self.rank, self.layout)
        theirs = row_chunks(P, src, self.layout)
        out: list[Block] = []
        if step == 0:  # every diagonal pair in one varlen call
            everything = slice(0, c * self.parts)
            diag = dict(causal=causal, cu_q=self._diag, cu_k=self._diag)
            out.append((everything, everything, diag))
        for hq, i in enumerate(mine):
            for hk, j in enumerate(theirs):
                if i == j or (causal and j > i):
                    continue
                part = self._crossing(i, j)
                if part is None:
                    continue
                q0, q1, k0, k1 = part
                qs = slice(hq * c + q0 - i * c, hq * c + q1 - i * c)
                ks = slice(hk * c + k0 - j * c, hk * c + k1 - j * c)
                out.append((qs, ks, dict(causal=False, offset=q0 - k0)))
        return out
