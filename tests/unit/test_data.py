"""Built-in data: determinism, targets, text files, SP batch sharding."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import ulysses_cp as ucp
from ulysses_cp.core.batch import shard_batch, shift_labels
from ulysses_cp.core.topology import Topology
from ulysses_cp.run_blocks import DataConfig
from ulysses_cp.training.data import ByteText, KVRecall, global_batch


def test_kv_recall_targets_are_the_bound_values():
    cfg = DataConfig(seq_len=128, n_queries=16)
    ds = KVRecall(cfg)
    tokens, labels = ds.sample(3)
    t2, l2 = ds.sample(3)
    assert torch.equal(tokens, t2) and torch.equal(labels, l2)  # deterministic
    assert not torch.equal(tokens, ds.sample(4)[0])
    bindings = {
        int(t - ds.pair0) // cfg.n_values: int(t - ds.pair0) % cfg.n_values
        for t in tokens[1 : 1 + cfg.n_pairs]
    }
    targets = (labels != -100).nonzero().flatten()
    assert len(targets) == cfg.n_queries and targets.min() >= 128 - 2 * cfg.n_queries
    for t in targets:
        key = int(tokens[t]) - ds.key0
        assert int(labels[t]) - ds.val0 == bindings[key]  # answer = value bound to the key
        assert tokens[t + 1] == labels[t]  # and it is the next token


def test_data_config_validation():
    with pytest.raises(ValueError, match="unknown keys"):
        DataConfig.from_dict({"seqlen": 4})
    with pytest.raises(ValueError, match="seq_len >="):
        DataConfig.from_dict({"seq_len": 16})
    with pytest.raises(ValueError, match=r"data\.files"):
        DataConfig.from_dict({"task": "text"})


def test_byte_text_from_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello long context " * 20)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second doc"}) + "\n")
    ds = ByteText(
        DataConfig(
            task="text", seq_len=32, files=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
        )
    )
    assert b"second doc" in bytes(ds.data.to(torch.uint8).tolist())
    tokens, labels = ds.sample(0)
    assert tokens.shape == labels.shape == (32,)
    assert torch.equal(tokens[1:], labels[:-1])  # shifted on the full stream
    with pytest.raises(ValueError, match="not found"):
        ByteText(DataConfig(task="text", seq_len=8, files=[str(tmp_path / "missing.txt")]))


def test_replicas_read_different_samples():
    ds = KVRecall(DataConfig(seq_len=64, n_queries=8))
    a = global_batch(ds, step=5, micro_step=1, grad_accum=2, micro_batch=2, dp_rank=0, dp_degree=2)
    b = global_batch(ds, step=5, micro_step=1, grad_accum=2, micro_batch=2, dp_rank=1, dp_degree=2)
    assert not torch.equal(a["input_ids"], b["input_ids"])


def test_shard_batch_shifts_before_sharding():
    ids = torch.arange(16).view(1, 16)
    parts = []
    for r in range(4):
        t = Topology(rank=r, world_size=4, ulysses_degree=4, ring_degree=1)
        parts.append(shard_batch({"input_ids": ids, "labels": ids}, t, "zigzag"))
    # every rank's targets are the next global token, including at shard borders
    for p in parts:
        assert torch.equal(
            p["shift_labels"][p["position_ids"] < 15],
            (p["position_ids"] + 1)[p["position_ids"] < 15],
        )
        assert torch.equal(p["input_ids"], p["position_ids"])
    assert torch.equal(shift_labels(ids)[0, -1], torch.tensor(-100))
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_batch(
            {"input_ids": torch.zeros(1, 12, dtype=torch.long)},
            Topology(rank=0, world_size=4, ulysses_degree=4, ring_degree=1),
        )
    assert ucp.sequence_multiple(4, "zigzag") == 8


def _check_packed_row(row, seq_len, multiple):
    cu = row["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == seq_len
    pos, ids, tgt = row["position_ids"], row["input_ids"], row["shift_labels"]
    for a, b in itertools.pairwise(cu):
        assert (b - a) % multiple == 0
        assert torch.equal(pos[a:b], torch.arange(b - a))  # positions restart per document
        assert tgt[b - 1] == -100  # no target across the border
    assert torch.equal(ucp.cu_seqlens_from_position_ids(pos), row["cu_seqlens"])
    return ids, tgt


def test_packed_kv_recall_rows(tmp_path):
    cfg = DataConfig(seq_len=256, packing=True, min_doc_len=20, max_doc_len=70, pack_multiple=8)
    ds = KVRecall(cfg)
    row = ds.packed_sample(3)
    ids, _tgt = _check_packed_row(row, 256, 8)
    assert len(row["cu_seqlens"]) > 4  # several documents
    for b in row["cu_seqlens"][1:-1].tolist():
        assert ids[b] == 0  # every document starts with BOS
    assert torch.equal(ds.packed_sample(3)["input_ids"], ids)  # deterministic
    # a micro batch of packed rows is one packed row
    batch = global_batch(
        ds, step=0, micro_step=0, grad_accum=1, micro_batch=2, dp_rank=0, dp_degree=1
    )
    assert batch["input_ids"].shape == (1, 512)
    _check_packed_row({k: (v if k == "cu_seqlens" else v[0]) for k, v in batch.items()}, 512, 8)
    with pytest.raises(ValueError, match="pack_multiple"):
        DataConfig.from_dict({"packing": True, "seq_len": 100})
    with pytest.raises(ValueError, match="min_doc_len"):
        DataConfig.from_dict({"packing": True, "min_doc_len": 4})


def test_packed_text_rows_follow_documents(tmp_path):
    docs = [f"document number {i} " * (i + 1) for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    cfg = DataConfig(
        task="text", seq_len=128, files=[str(tmp_path / "d.jsonl")], packing=True, pack_multiple=4
    )
    row = ByteText(cfg).packed_sample(0)
    ids, tgt = _check_packed_row(row, 128, 4)
    texts = [d.encode() for d in docs]
    cu = row["cu_seqlens"].tolist()
    for a, b in itertools.pairwise(cu):
        real = bytes(ids[a:b].tolist()).rstrip(b"\0")
        assert any(t.startswith(real) for t in texts)  # a (possibly cut) whole document
        n = len(real)
        assert torch.equal(tgt[a : a + n - 1], ids[a + 1 : a + n])  # next byte inside it


def test_shard_batch_packed_row():
    docs = [torch.arange(10, 15), torch.arange(20, 23)]
    packed = ucp.pack_documents(docs, multiple=8)
    full_pos = packed["position_ids"][0]
    seen = []
    for r in range(4):
        t = Topology(rank=r, world_size=4, ulysses_degree=2, ring_degree=2)
        p = shard_batch(packed, t, "zigzag")
        assert torch.equal(p["cu_seqlens"], packed["cu_seqlens"]) and p["input_ids"].shape == (1, 4)
        seen.append(p["input_ids"])
    assert sorted(torch.cat(seen, 1)[0].tolist()) == sorted(packed["input_ids"][0].tolist())
    # labels given unshifted are shifted inside each document only, none on padding
    lab = shard_batch(
        {
            "input_ids": packed["input_ids"],
            "labels": packed["labels"],
            "position_ids": packed["position_ids"],
            "cu_seqlens": packed["cu_seqlens"],
        },
        Topology(rank=0, world_size=1, ulysses_degree=1, ring_degree=1),
        "zigzag",
    )
    assert lab["shift_labels"][0, 7] == -100 and lab["shift_labels"][0, 0] == 11
    assert lab["shift_labels"][0, 3] == 14 and (lab["shift_labels"][0, 4:8] == -100).all()
    assert torch.equal(full_pos, lab["position_ids"][0])


def test_packed_labels_and_shift_labels_give_the_same_targets():
    """Unshifted labels of a packed row are shifted per document: no target across a border
    and none on padding, the same as pack_documents's shift_labels. Labels equal to the
    input ids (padding indistinguishable from tokens) are refused."""
    topo = ucp.init_topology()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 50, (n,), generator=g) for n in (5, 8, 3)]
    row = ucp.pack_documents(docs, multiple=4)
    base = {k: row[k] for k in ("input_ids", "position_ids", "cu_seqlens")}
    shifted = shard_batch({**base, "shift_labels": row["shift_labels"]}, topo)
    unshifted = shard_batch({**base, "labels": row["labels"]}, topo)
    assert torch.equal(shifted["shift_labels"], unshifted["shift_labels"])
    # the targets themselves: each real token but the last of its document, nothing else
    expected = [t for d in docs for t in [*d[1:].tolist(), -100] + [-100] * (-len(d) % 4)]
    assert shifted["shift_labels"][0].tolist() == expected
    with pytest.raises(ValueError, match="labels equal to input_ids"):
        shard_batch({**base, "labels": row["input_ids"]}, topo)


def test_packed_rows_for_the_row_wise_packing_pad_no_document():
    """pack_multiple 1 (sequence_parallel.packing "row"): documents keep their lengths (odd
    ones too), the row is filled exactly."""
    cfg = DataConfig(seq_len=256, packing=True, min_doc_len=20, max_doc_len=70, pack_multiple=1)
    row = KVRecall(cfg).packed_sample(3)
    _check_packed_row(row, 256, 1)
    lens = (row["cu_seqlens"][1:] - row["cu_seqlens"][:-1]).tolist()
    assert any(n % 2 for n in lens), lens  # lengths no layout multiple would allow
