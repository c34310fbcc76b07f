"""Training data: a built-in long-range task, byte-level text files, the micro batches.

Every sample is a pure function of ``(seed, index)``, so data position after a resume is
just the step number, and each data-parallel replica reads its own indices.

``kv_recall`` (default, no download): ``n_pairs`` key/value bindings at the start of the
sequence, filler noise in the middle, and at the end queries that repeat a key and must
be answered with its value. Only answers carry a target, so the loss starts near
``ln(n_values)`` and falls below it only if attention reaches from the end of the sequence
back to its start, i.e. across every SP shard.

``text``: bytes of local ``.txt`` files (whole file) and ``.jsonl`` files (the ``"text"``
field of each line), concatenated; vocabulary 256.

``dataset``: tokenized local files and a local tokenizer (``token_data.py``, ``corpus.py``).

``packing``: each row is several documents packed back to back (kv_recall: instances of
random length in ``[min_doc_len, max_doc_len]``; text: consecutive files/records, the last
one cut to fit), each padded at its end to a multiple of ``pack_multiple`` (1 under the
row-wise packing, ``sequence_parallel.packing: "row"``: no padding at all), with position
ids restarting per document, no target across a border, and ``cu_seqlens``
(``core.varlen.pack_row``). The rows of a micro batch are joined into one packed row
(attention over packed rows takes batch 1). ``ucp.shard_batch`` takes a micro batch to
this rank's tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

from ..core.varlen import IGNORE, pack_row
from ..run_blocks import DataConfig, EvalConfig

if TYPE_CHECKING:
    from .token_data import TokenDataset

__all__ = [
    "ByteText",
    "KVRecall",
    "data_vocab_size",
    "global_batch",
    "make_dataset",
    "make_datasets",
]


class KVRecall:
    """Token map: 0 BOS, [2, 18) filler, then keys, then values, then pair tokens.

    A pair token stands for one (key, value) binding, so recalling a value is one content
    lookup: the query key attends to the pair token of that key, wherever it is."""

    vocab_size = 256

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg = DataConfig.from_dict(asdict(cfg))  # validated however it was built
        self.key0 = 18
        self.val0 = self.key0 + cfg.n_keys
        self.pair0 = self.val0 + cfg.n_values

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (s,), shift_labels (s,)): label t is the target of token t."""
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + index)
        return self._document(g, c.seq_len, c.n_queries)

    def _document(self, g: torch.Generator, length: int, n_queries: int):
        c = self.cfg
        keys = torch.randperm(c.n_keys, generator=g)[: c.n_pairs]
        vals = torch.randint(c.n_values, (c.n_pairs,), generator=g)
        tokens = torch.randint(2, 18, (length,), generator=g)  # filler
        labels = torch.full((length,), IGNORE)
        tokens[0] = 0
        tokens[1 : 1 + c.n_pairs] = self.pair0 + keys * c.n_values + vals  # bindings
        pick = torch.randint(c.n_pairs, (n_queries,), generator=g)
        start = length - 2 * n_queries
        tokens[start::2] = self.key0 + keys[pick]  # query: a key ...
        tokens[start + 1 :: 2] = self.val0 + vals[pick]  # ... then its value
        labels[start::2] = self.val0 + vals[pick]  # the target after a queried key
        return tokens, labels

    def packed_sample(self, index: int) -> dict[str, torch.Tensor]:
        """One packed row of instances of random length (see the module docstring)."""
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + index)

        def doc(length: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self._document(g, length, min(c.n_queries, (length - 1 - c.n_pairs) // 2))

        def draw(room: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            length = int(torch.randint(c.min_doc_len, c.max_doc_len + 1, (1,), generator=g))
            return doc(length) if _padded(length, c.pack_multiple) <= room else None

        def last(
            room: int,
        ) -> tuple[
            torch.Tensor, torch.Tensor
        ]:  # fill the row: an instance if it fits one, else no target
            if room >= c.n_pairs + 3:
                return doc(room)
            return torch.randint(2, 18, (room,), generator=g), torch.full((room,), IGNORE)

        return pack_row(c.seq_len, c.pack_multiple, draw, last)


def _padded(n: int, multiple: int) -> int:
    return n + (-n % multiple)


class ByteText:
    vocab_size = 256

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        chunks = []
        for name in cfg.files:
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"data file not found: {name}")
            if path.suffix == ".jsonl":
                for line in path.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        chunks.append(json.loads(line)["text"].encode("utf-8"))
            else:
                chunks.append(path.read_bytes())
        chunks = [c for c in chunks if c]
        self.data = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()
        # document d is data[starts[d] : starts[d] + lengths[d]] (one newline between)
        self.lengths = [len(c) for c in chunks]
        self.starts = [sum(self.lengths[:i]) + i for i in range(len(chunks))]
        if self.data.numel() < cfg.seq_len + 2:
            raise ValueError(
                f"data files hold {self.data.numel()} bytes, fewer than "
                f"seq_len + 2 = {cfg.seq_len + 2}"
            )

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.cfg.seq_len
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
        off = int(torch.randint(self.data.numel() - s - 1, (1,), generator=g))
        window = self.data[off : off + s + 1]
        return window[:-1].clone(), window[1:].clone()  # shifted on the full sequence

    def packed_sample(self, index: int) -> dict[str, torch.Tensor]:
        """Consecutive documents from a random one on; the one that does not fit is cut."""
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + index)
        nxt = [int(torch.randint(len(self.lengths), (1,), generator=g))]

        def take(room: int) -> tuple[torch.Tensor, torch.Tensor]:
            d = nxt[0] % len(self.lengths)
            nxt[0] += 1
            start, n = self.starts[d], min(self.lengths[d], room)
            tokens = self.data[start : start + n].clone()
            return tokens, torch.cat([tokens[1:], tokens.new_full((1,), IGNORE)])

        return pack_row(c.seq_len, c.pack_multiple, take, take)


if TYPE_CHECKING:
    Dataset: TypeAlias = KVRecall | ByteText | TokenDataset


def make_dataset(cfg: DataConfig) -> KVRecall | ByteText:
    """The built-in tasks (``make_datasets`` also builds ``"dataset"``)."""
    if cfg.task == "dataset":
        raise ValueError("data.task 'dataset' is built by make_datasets(data, eval)")
    return KVRecall(cfg) if cfg.task == "kv_recall" else ByteText(cfg)


def make_datasets(cfg: DataConfig, ev: EvalConfig | None = None) -> tuple[Dataset, Dataset | None]:
    """(training samples, held-out samples or None). Task ``"dataset"`` tokenizes its files
    once (global rank 0; the other ranks wait) and reads them from a memory map."""
    if cfg.task != "dataset":
        return make_dataset(cfg), None
    from .token_data import make_token_datasets

    return make_token_datasets(cfg, ev or EvalConfig())


def data_vocab_size(cfg: DataConfig) -> tuple[int, str]:
    """(tokens the data uses, what they are), for the check against the model's vocabulary;
    reads only the tokenizer."""
    if cfg.task != "dataset":
        return 256, "byte/task tokens"
    from .tokenizer import load_tokenizer

    return load_tokenizer(cfg.tokenizer, cfg.eos_token).vocab_size, f"tokenizer {cfg.tokenizer}"


def global_batch(
    dataset: Dataset,
    *,
    step: int,
    micro_step: int,
    grad_accum: int,
    micro_batch: int,
    dp_rank: int,
    dp_degree: int,
) -> dict[str, torch.Tensor]:
    """Full ``(micro_batch, s)`` tensors for one micro step of one data-parallel replica."""
    first = ((step * grad_accum + micro_step) * dp_degree + dp_rank) * micro_batch
    if dataset.cfg.packing:  # the micro batch's rows joined into one packed row
        rows = [dataset.packed_sample(first + i) for i in range(micro_batch)]
        s = dataset.cfg.seq_len
        cu = torch.cat(
            [rows[0]["cu_seqlens"][:1]] + [r["cu_seqlens"][1:] + i * s for i, r in enumerate(rows)]
        )
        return {
            **{
                k: torch.cat([r[k] for r in rows])[None]
                for k in ("input_ids", "shift_labels", "position_ids")
            },
            "cu_seqlens": cu.to(torch.int32),
        }
    tokens, labels = zip(*(dataset.sample(first + i) for i in range(micro_batch)))
    ids = torch.stack(tokens)
    return {
        "input_ids": ids,
        "shift_labels": torch.stack(labels),
        "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone(),
    }
