"""Samples of a tokenized corpus (task ``"dataset"``, the cache of ``corpus.py``).

Windows (``packing: false``): the split's token stream (documents back to back, each
ending with EOS) cut into consecutive windows of ``seq_len + 1`` tokens; token t's target
is token t + 1, except after an EOS (the next document's first token is not predicted
from the previous document).

Packed rows (``packing: true``): every document cut into pieces of at most ``seq_len``
tokens (only documents longer than a row are cut); the pieces, in corpus order, fill rows
greedily, each padded to ``pack_multiple``; a piece that does not fit starts the next row
and the rest of the row is padding without targets. Rows are laid out by
``core.varlen.pack_row`` like the other packed tasks: ``cu_seqlens``, position ids restarting
per piece, no target across a border.

Windows and rows are visited in a shuffled order that changes every epoch: sample ``i`` is
unit ``perm(epoch)[i % n]`` with ``perm`` a function of ``(seed, epoch)``, so a sample is a
pure function of its index and the data position after a resume follows from the step.
"""

from __future__ import annotations

from array import array
from itertools import pairwise

import numpy as np
import torch

from ..core.varlen import IGNORE, pack_row
from ..run_blocks import DataConfig, EvalConfig
from .corpus import TokenizedCorpus, check_files, load_corpus
from .tokenizer import load_tokenizer

__all__ = [
    "TokenDataset",
    "make_token_datasets",
    "plan_rows",
]


def plan_rows(offsets: np.ndarray, seq_len: int, multiple: int) -> tuple[np.ndarray, ...]:
    """``(piece_start, piece_len, row_first)``: documents ``offsets`` cut into pieces of at
    most ``seq_len`` tokens, packed in order; row r holds pieces
    ``row_first[r]:row_first[r + 1]``. Pure Python over the documents (~1 s per million)."""
    starts, lens, rows = array("q"), array("q"), array("q", [0])
    used = 0
    bounds = offsets.tolist()
    for a, b in pairwise(bounds):
        while a < b:
            n = min(seq_len, b - a)
            need = n + (-n % multiple)
            if used + need > seq_len:
                rows.append(len(starts))
                used = 0
            starts.append(a)
            lens.append(n)
            used += need
            a += n
    rows.append(len(starts))
    return tuple(np.frombuffer(x, dtype=np.int64) for x in (starts, lens, rows))


class TokenDataset:
    """Documents ``first:end`` of a tokenized corpus as samples (see the module docstring);
    ``sample`` / ``packed_sample`` like the other tasks, read from the memory map."""

    def __init__(
        self, cfg: DataConfig, corpus: TokenizedCorpus, first: int, end: int, name: str
    ) -> None:
        self.cfg, self.name = cfg, name
        self.vocab_size = int(corpus.meta["vocab_size"])
        self.eos_id = int(corpus.meta["eos_id"])
        self.tokens = corpus.tokens
        offsets = np.asarray(corpus.offsets[first : end + 1])
        self.lo, self.hi = int(offsets[0]), int(offsets[-1])
        self.n_docs = end - first
        if cfg.packing:
            self.piece_start, self.piece_len, self.row_first = plan_rows(
                offsets, cfg.seq_len, cfg.pack_multiple
            )
            self.n = len(self.row_first) - 1
        else:
            self.n = (self.hi - self.lo - 1) // cfg.seq_len
            if self.n < 1:
                raise ValueError(
                    f"{name} holds {self.hi - self.lo} tokens, fewer than data.seq_len + 1 = "
                    f"{cfg.seq_len + 1}: add documents or lower data.seq_len"
                )
        self._perm: tuple[int, torch.Tensor | None] = (-1, None)

    def __len__(self) -> int:
        """Windows or packed rows per epoch."""
        return self.n

    def unit(self, index: int) -> int:
        """The window or row that sample ``index`` reads."""
        epoch, j = divmod(index, self.n)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        perm = self._perm[1]
        assert perm is not None
        return int(perm[j])

    def _read(self, start: int, n: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[start : start + n], dtype=np.int64))

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.cfg.seq_len
        window = self._read(self.lo + self.unit(index) * s, s + 1)
        tokens, labels = window[:-1].clone(), window[1:].clone()
        labels[tokens == self.eos_id] = IGNORE  # no target across a document border
        return tokens, labels

    def pieces(self, index: int) -> list[tuple[int, int]]:
        """(start, length) in the token file of the pieces packed in sample ``index``."""
        r = self.unit(index)
        ks = range(int(self.row_first[r]), int(self.row_first[r + 1]))
        return [(int(self.piece_start[k]), int(self.piece_len[k])) for k in ks]

    def packed_sample(self, index: int) -> dict[str, torch.Tensor]:
        todo = iter(self.pieces(index))

        def draw(room: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            nxt = next(todo, None)
            if nxt is None:
                return None
            t = self._read(*nxt)
            return t, torch.cat([t[1:], t.new_full((1,), IGNORE)])

        def fill(room: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.full((room,), self.eos_id), torch.full((room,), IGNORE)

        return pack_row(self.cfg.seq_len, self.cfg.pack_multiple, draw, fill)


def make_token_datasets(dc: DataConfig, ev: EvalConfig) -> tuple[TokenDataset, TokenDataset | None]:
    """The training samples and, when ``ev`` is enabled, the held-out ones: ``eval.files``
    tokenized alike, or the last ``eval.fraction`` of the documents of ``data.files``."""
    tok = load_tokenizer(dc.tokenizer, dc.eos_token)
    if ev.enabled and ev.files:
        check_files(ev.files, "eval.files")  # on every rank, before any collective

    def corpus_of(files: list[str], what: str) -> TokenizedCorpus:
        return load_corpus(
            files,
            tok,
            text_field=dc.text_field,
            cache_dir=dc.cache_dir,
            workers=dc.tokenize_workers,
            what=what,
        )

    corpus = corpus_of(dc.files, "data.files")
    n = corpus.n_docs
    if not ev.enabled:
        return TokenDataset(dc, corpus, 0, n, "data.files"), None
    if ev.files:
        held = corpus_of(ev.files, "eval.files")
        return (
            TokenDataset(dc, corpus, 0, n, "data.files"),
            TokenDataset(dc, held, 0, held.n_docs, "eval.files"),
        )
    n_eval = max(1, round(ev.fraction * n))
    if n_eval >= n:
        raise ValueError(
            f"eval.fraction {ev.fraction} of data.files' {n} documents leaves none to train "
            f"on: lower eval.fraction or add documents"
        )
    return (
        TokenDataset(dc, corpus, 0, n - n_eval, f"the training split ({n - n_eval} documents)"),
        TokenDataset(dc, corpus, n - n_eval, n, f"the eval split ({n_eval} documents)"),
    )
