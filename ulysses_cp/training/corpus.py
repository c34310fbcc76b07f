"""Tokenized corpora for the ``"dataset"`` task: local files and a local tokenizer,
tokenized once into a memory-mapped token file (``pip install .[data]``).

Inputs: ``.jsonl``/``.json``, ``.parquet`` and ``.arrow`` files (read by ``datasets`` in
streaming mode, so nothing is converted or copied first) and folders written by
``datasets``' ``save_to_disk``. Each record's ``text_field`` is a string, or a list of chat
messages rendered by the tokenizer's chat template (``tokenizer.py``: a local folder or a
``tokenizer.json``); its EOS token ends every document.

The cache, ``<cache_dir>/<key>/``: ``tokens.bin`` (every document's tokens back to back,
uint16 when the vocabulary fits, else uint32), ``docs.npy`` (int64 offsets: document d is
``tokens[docs[d]:docs[d + 1]]``) and ``meta.json``. ``key`` hashes the files (path, size,
modification time), the tokenizer (its serialized form, chat template, EOS) and the text
field, so a changed input builds a new cache and an unchanged one is reused. A build
writes to ``<key>.tmp-*`` and renames it when complete: an interrupted build is never
taken for a cache. Global rank 0 builds (with a progress bar), the other ranks wait, then
every rank maps the files: none loads the corpus.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from ..core.log import get_logger
from .tokenizer import Tokenizer

__all__ = [
    "TokenizedCorpus",
    "cache_key",
    "check_files",
    "default_cache_dir",
    "load_corpus",
]

log = get_logger(__name__)

FORMAT_VERSION = 1
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
BATCH_DOCS = 256  # documents per tokenizing task
SMALL_INPUT = 64 * 2**20  # bytes of input below which data.tokenize_workers 0 means 1


def _datasets():
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            "data.task 'dataset' reads files with the datasets library: `pip install .[data]` "
            "(datasets and pyarrow)"
        )
    import datasets

    return datasets


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ulysses_cp" / "tokens"


# ---------------------------------------------------------------- files


def check_files(files: list[str], what: str) -> list[Path]:
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"{what}: not found: {missing}")
    for p in paths:
        if p.is_file() and p.suffix not in SUFFIXES:
            raise ValueError(
                f"{what}: {p} has an unsupported suffix {p.suffix!r}; use "
                f"{sorted(SUFFIXES)} files or a folder written by datasets' save_to_disk"
            )
    return paths


def _stamp(path: Path) -> list:
    """What identifies a file's content without reading it: path, size, mtime."""
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(paths: list[Path], tok: Tokenizer, text_field: str) -> str:
    spec = {
        "version": FORMAT_VERSION,
        "files": [_stamp(p) for p in paths],
        "tokenizer": tok.digest,
        "text_field": text_field,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def _records(path: Path, field: str) -> Iterator[tuple[Any, str]]:
    """(field value, where) for every record of one file or saved folder, in order."""
    datasets = _datasets()
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split ({list(ds)})")
            ds = ds["train"]
    else:
        ds = datasets.load_dataset(
            SUFFIXES[path.suffix], data_files=[str(path)], split="train", streaming=True
        )
    row = 0
    for batch in ds.iter(batch_size=1000):
        if field not in batch:
            raise ValueError(
                f"{path}: records have no field {field!r} (fields: {sorted(batch)}); set "
                f"data.text_field"
            )
        for value in batch[field]:
            yield value, f"{path} record {row} field {field!r}"
            row += 1


def _count(path: Path) -> int | None:
    """Records in a file when its metadata says so (Parquet, saved folders), for the bar."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(str(path)).metadata.num_rows)
    return None


# ---------------------------------------------------------------- tokenizing

_WORKER: dict[str, Any] = {}


def _init_worker(backend_json: str, process: bool = True) -> None:
    if process:  # a worker process tokenizes on one thread; in-process, tokenizers' threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers

    _WORKER["tok"] = tokenizers.Tokenizer.from_str(backend_json)


def _encode(batch: list[tuple[str, bool]], eos: int) -> list[list[int]]:
    tok = _WORKER["tok"]
    out: list[tuple[int, list[int]]] = []
    for special in (True, False):  # documents keep their order; encoded in two groups
        idx = [i for i, (_, s) in enumerate(batch) if s is special]
        texts = [batch[i][0] for i in idx]
        encs = tok.encode_batch(texts, add_special_tokens=special) if texts else []
        out.extend(zip(idx, (e.ids for e in encs)))
    docs = [ids for _, ids in sorted(out, key=lambda x: x[0])]
    return [ids if ids and ids[-1] == eos else [*ids, eos] for ids in docs]


def _ordered(pool, batches: Iterator, eos: int, ahead: int) -> Iterator[list[list[int]]]:
    """``_encode`` over ``batches`` in order, at most ``ahead`` batches in flight."""
    if pool is None:
        for b in batches:
            yield _encode(b, eos)
        return
    pending: deque = deque()
    for b in batches:
        pending.append(pool.submit(_encode, b, eos))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _batches(paths: list[Path], tok: Tokenizer, field: str) -> Iterator[list]:
    batch: list[tuple[str, bool]] = []
    for p in paths:
        for value, where in _records(p, field):
            batch.append(tok.render(value, where))
            if len(batch) == BATCH_DOCS:
                yield batch
                batch = []
    if batch:
        yield batch


def _build(paths: list[Path], tok: Tokenizer, field: str, final: Path, workers: int, progress):
    """Tokenize ``paths`` into ``final`` (written under a temporary name, then renamed)."""
    from tqdm import tqdm

    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    counts = [_count(p) for p in paths]
    total = None if None in counts else sum(c or 0 for c in counts)
    start = time.perf_counter()
    pool = None
    try:
        if workers > 1:  # a worker that dies raises BrokenProcessPool here, never hangs
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            pool = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tok.backend_json,),
            )
        else:
            _init_worker(tok.backend_json, process=False)
        offsets = [0]
        bar = tqdm(
            total=total,
            unit="doc",
            desc="tokenizing",
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        with bar, (tmp / "tokens.bin").open("wb") as out:
            for docs in _ordered(pool, _batches(paths, tok, field), tok.eos_id, 2 * workers):
                lens = [len(ids) for ids in docs]
                flat = np.fromiter(chain.from_iterable(docs), dtype=dtype, count=sum(lens))
                out.write(flat.tobytes())
                offsets.extend((offsets[-1] + np.cumsum(lens)).tolist())
                bar.update(len(docs))
                bar.set_postfix(tokens=offsets[-1], refresh=False)
        if len(offsets) == 1:
            raise ValueError(f"data.files {[str(p) for p in paths]} hold no records")
        np.save(tmp / "docs.npy", np.asarray(offsets, dtype=np.int64))
        meta = {
            "version": FORMAT_VERSION,
            "files": [str(p) for p in paths],
            "tokenizer": tok.path,
            "text_field": field,
            "eos_id": tok.eos_id,
            "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name,
            "n_docs": len(offsets) - 1,
            "n_tokens": offsets[-1],
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(final)  # atomic: the cache appears complete or not at all
        except OSError:
            if not (final / "meta.json").is_file():
                raise
        if progress:
            log.info(
                f"tokenized {meta['n_docs']} documents, {meta['n_tokens']} tokens into {final} "
                f"in {meta['seconds']:.1f}s"
            )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the cache


@dataclass
class TokenizedCorpus:
    """A built cache, memory-mapped: ``tokens`` (all documents), ``offsets`` (n_docs + 1)."""

    path: Path
    tokens: np.ndarray
    offsets: np.ndarray
    meta: dict
    built: bool = False  # this process built it (False: found in the cache)

    @classmethod
    def open(cls, path: Path, built: bool = False) -> TokenizedCorpus:
        meta = json.loads((path / "meta.json").read_text())
        tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r")
        offsets = np.load(path / "docs.npy", mmap_mode="r")
        return cls(path, tokens, offsets, meta, built)

    @property
    def n_docs(self) -> int:
        return int(self.meta["n_docs"])


def load_corpus(
    files: list[str],
    tok: Tokenizer,
    *,
    text_field: str,
    cache_dir: str = "",
    workers: int = 0,
    what: str = "data.files",
    progress: bool | None = None,
) -> TokenizedCorpus:
    """The cache of ``files`` tokenized by ``tok``: opened, or built first (on global rank 0
    under torch.distributed, the other ranks waiting; then every rank maps it). Bad input
    (missing files, unsupported suffixes, a missing text field in the first records) is
    refused on every rank before any collective. ``progress``: default rank 0 only."""
    paths = check_files(files, what)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / cache_key(paths, tok, text_field)
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if multi else 0
    if progress is None:
        progress = rank == 0
    hit = (final / "meta.json").is_file()
    if not hit:
        for p in paths:  # the first record of each input, checked on every rank
            for value, where in _records(p, text_field):
                tok.render(value, where)
                break
    if not workers:  # worker processes take seconds to start: worth it for large inputs
        size = sum(f[1] for p in paths for f in _stamp(p))
        workers = 1 if size < SMALL_INPUT else min(16, os.cpu_count() or 1)
    built, error = False, None
    if not multi:
        if not hit:
            root.mkdir(parents=True, exist_ok=True)
            _build(paths, tok, text_field, final, workers, progress)
            built = True
        return TokenizedCorpus.open(final, built)
    # rank 0 builds while the others wait in an all-reduce of a group that waits a day
    group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    if rank == 0 and not (final / "meta.json").is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
            _build(paths, tok, text_field, final, workers, progress)
            built = True
        except Exception as exc:
            error = exc
    import torch

    flag = torch.tensor([float(error is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if flag.item():
        raise ValueError(f"rank 0 could not tokenize {what} (its error is above)")
    seen = torch.tensor([float(not (final / "meta.json").is_file())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if seen.item():
        raise ValueError(
            f"some ranks do not see the token cache {final} that rank 0 built: data.cache_dir "
            f"must be a folder every rank can read (a shared filesystem on several nodes)"
        )
    return TokenizedCorpus.open(final, built)
