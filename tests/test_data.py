"""Built-in data: determinism, targets, text files, SP batch sharding."""

from __future__ import annotations

import json

import pytest
import torch

import ulysses_cp as ucp
from ulysses_cp.data import ByteText, DataConfig, KVRecall, global_batch, shard_batch, shift_labels
from ulysses_cp.topology import Topology


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
