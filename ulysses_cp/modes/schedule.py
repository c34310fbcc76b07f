"""Which blocks each ring step computes: pure arithmetic on ranks and chunks, no tensors
moved, no kernel called.

Legend: P ring size, r this rank, ``src = (r - step) mod P`` the rank whose kv block
visits at ``step``, s_l local tokens; zigzag: rank r holds chunks r and 2P-1-r of 2P.

Causal, contiguous layout: blocks with ``src > r`` are skipped (the kv still moves);
``src == r`` uses the causal kernel. Zigzag: ``src < r``: all local q against the FIRST half
of kv; ``src > r``: the SECOND half of local q against all kv; so every step but the first
is half a block on every rank. Packed rows (``docs``), document-wise: the same rule per
document, so the halves are every document's halves; row-wise: the documents' intersection
of each pair of chunks (:class:`~ulysses_cp.core.rows.RowDocs`).

Sliding windows: blocks go chunk pair by chunk pair (each layout chunk cut in ``split``
pieces near the window's length, :func:`window_split`), each with its offset in global
positions; pairs that no query's window reaches are skipped. Packed rows with a window:
each document is cut in its own chunks, so the offset is counted in chunks
(``chunk_offset``) and the kernel gives each document group its band.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.rows import RowDocs
from ..core.varlen import Docs
from ..kernels.blocks import band_is_empty, window_band
from ..kernels.spec import FULL_WINDOW

__all__ = [
    "Schedule",
    "window_split",
]

# (query selection, kv selection, where the block sits: KernelCall fields)
Block = tuple[Any, Any, dict[str, Any]]


def window_split(s_l: int, window: tuple[int, int], parts: int) -> int:
    """Into how many pieces to cut each of a rank's ``parts`` layout chunks so that a piece
    is about as long as the window (at least 64 tokens): pairs of pieces that no query's
    window reaches are then skipped. 1 when the window is unbounded on both sides."""
    reach = max(window)
    if reach < 0:
        return 1
    c = s_l // parts
    target = max(reach, 64)
    return next(m for m in range(1, c + 1) if c % m == 0 and c // m <= target)


@dataclass(frozen=True, eq=False)
class Schedule:
    """The ring of ``P`` ranks seen from ``rank``, holding ``s_l`` tokens in ``layout``
    (``docs``: a packed row's documents), for one call's ``causal`` and ``window``."""

    P: int
    rank: int
    s_l: int
    causal: bool
    layout: str
    docs: Docs | RowDocs | None = None
    window: tuple[int, int] = FULL_WINDOW
    split: int = 1

    def blocks(self, step: int) -> tuple[list[Block], int]:
        """``([(q sel, kv sel, where)], blocks skipped)`` of one ring step."""
        if isinstance(self.docs, RowDocs):
            return self.docs.blocks(step, self.causal, self.window), 0
        if tuple(self.window) != FULL_WINDOW and self.docs is not None:
            return self._packed_window_blocks(step), 0
        if tuple(self.window) != FULL_WINDOW:
            pairs = self._window_blocks(step)
            n = (1 if self.layout == "contiguous" else 2) * self.split
            where = [(qs, ks, dict(causal=self.causal, offset=o)) for qs, ks, o in pairs]
            return where, n * n - len(pairs)
        block = self._block(step)
        return ([] if block is None else [block]), 0

    def _block(self, step: int) -> Block | None:
        """The step's one block, or None when it is fully masked."""
        everything = slice(0, self.s_l)
        docs = self.docs
        assert not isinstance(docs, RowDocs), "row-wise blocks are RowDocs.blocks"
        whole: dict[str, Any] = {} if docs is None else dict(cu_q=docs.cu, cu_k=docs.cu)
        if step == 0:
            return everything, everything, dict(causal=self.causal, **whole)
        if not self.causal:
            return everything, everything, dict(causal=False, **whole)
        src = (self.rank - step) % self.P
        if self.layout == "contiguous":
            return (
                (everything, everything, dict(causal=False, **whole)) if src < self.rank else None
            )
        if docs is None:
            half = self.s_l // 2
            if src < self.rank:
                return everything, slice(0, half), dict(causal=False)
            return slice(half, self.s_l), everything, dict(causal=False)
        if src < self.rank:
            return everything, docs.first, dict(causal=False, cu_q=docs.cu, cu_k=docs.cu_half)
        return docs.second, everything, dict(causal=False, cu_q=docs.cu_half, cu_k=docs.cu)

    def _packed_window_blocks(self, step: int) -> list[Block]:
        """Packed rows with a window: every document is cut in its own chunks (zigzag: 2P,
        the rank holding chunks r and 2P-1-r of each; contiguous: P), so a pair of halves is
        one kernel call over all documents whose offset is counted in chunks; the kernel
        skips the document groups out of reach."""
        P, rank, docs = self.P, self.rank, self.docs
        assert isinstance(docs, Docs)
        src = (rank - step) % P
        mine: list[tuple[int, Any]]
        theirs: list[tuple[int, Any]]
        if self.layout == "contiguous":
            mine, theirs = [(rank, slice(None))], [(src, slice(None))]
            cu = dict(cu_q=docs.cu, cu_k=docs.cu)
        else:
            mine = [(rank, docs.first), (2 * P - 1 - rank, docs.second)]
            theirs = [(src, docs.first), (2 * P - 1 - src, docs.second)]
            cu = dict(cu_q=docs.cu_half, cu_k=docs.cu_half)
        return [
            (qs, ks, dict(causal=self.causal, chunk_offset=qi - ki, **cu))
            for qi, qs in mine
            for ki, ks in theirs
            if not self.causal or qi >= ki  # a later chunk never sees an earlier query's keys
        ]

    def _window_blocks(self, step: int) -> list[tuple[slice, slice, int]]:
        """Sliding window: ``[(q sel, kv sel, offset)]`` for this step, one per pair of
        chunks (contiguous: one chunk per rank; zigzag: chunks r and 2P-1-r; each cut in
        ``split`` pieces) that has a visible key; ``offset`` = the q piece's first position
        minus the kv piece's. Pairs wholly outside every query's window are skipped."""
        P, rank, split = self.P, self.rank, self.split
        src = (rank - step) % P
        if self.layout == "contiguous":
            mine, theirs = [rank], [src]
        else:
            mine, theirs = [rank, 2 * P - 1 - rank], [src, 2 * P - 1 - src]
        c = self.s_l // len(mine) // split  # piece length

        def pieces(chunks: list[int]) -> list[tuple[int, slice]]:
            # (global piece index, local slice): piece t of the rank's layout chunk h
            return [
                (chunk * split + t, slice((h * split + t) * c, (h * split + t + 1) * c))
                for h, chunk in enumerate(chunks)
                for t in range(split)
            ]

        pairs: list[tuple[slice, slice, int]] = []
        for qi, qs in pieces(mine):
            for ki, ks in pieces(theirs):
                band = window_band(self.window, self.causal, (qi - ki) * c)
                if band is not None and not band_is_empty(band, c, c):
                    pairs.append((qs, ks, (qi - ki) * c))
        return pairs
