"""Task "dataset": local files tokenized by a local tokenizer into a cached memory map;
windows and packed rows; held-out evaluation under sequence parallelism.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_dataset.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.support.helpers import HF_TINY
from tests.unit import test_dataset as unit_tier

data = unit_tier.data  # the corpus fixture, shared with the unit tier


@pytest.mark.slow
@pytest.mark.launcher
def test_train_py_on_a_corpus_evaluates_and_resumes_at_the_same_sample(data, tmp_path):
    from tests.support.helpers import launch, metrics

    hf_config = {"model_type": "llama", **HF_TINY}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "sequence_parallel": {"ulysses_degree": 2, "attention_backend": "torch"},
        "model": {"hf_config": hf_config},
        "data": {
            "task": "dataset",
            "files": [str(data["jsonl"])],
            "tokenizer": str(data["tok"]),
            "cache_dir": str(tmp_path / "cache"),
            "seq_len": 64,
            "packing": True,
            "pack_multiple": 4,
        },
        "eval": {"fraction": 0.2, "interval": 2, "batches": 2},
        "training": {"max_steps": 4, "log_interval": 1, "save_interval": 2},
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    res = launch(path, tmp_path / "full")
    assert "tokenized 80 documents" in res and "step     4  eval_loss" in res
    rows = metrics(tmp_path / "full")
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 < r["eval_loss"] < 10 and r["eval_tokens"] > 0 for r in evals)
    assert evals[1]["eval_ppl"] == pytest.approx(math.exp(evals[1]["eval_loss"]))
    # every step moves the same attention bytes (packed rows of one length): the
    # evaluations' traffic after steps 2 and 4 is not in steps 3's (or 5's) numbers
    steps = [r["attention_comm_bytes_per_step"] for r in rows if "loss" in r]
    assert len(steps) == 4 and steps[0] > 0 and len(set(steps)) == 1, steps
    launch(path, tmp_path / "part", "--max_steps", "2")
    res = launch(path, tmp_path / "part", "--resume")
    assert "resumed from" in res and "tokenized" not in res  # the cache, reused
    assert len(list((tmp_path / "cache").iterdir())) == 1
    resumed = metrics(tmp_path / "part")
    assert [(r["step"], "loss" in r) for r in resumed] == [(r["step"], "loss" in r) for r in rows]
    for a, b in zip(rows, resumed):  # same samples after the resume: same losses
        key = "loss" if "loss" in a else "eval_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-6), (a, b)
