"""SequenceParallelTrainer with report_to="wandb" (offline, nothing on the network): the
training log lines (``log_history`` and the wandb run) carry the sequence-parallel
metrics, the wandb run's config the topology, and a resume from a checkpoint continues
with the uninterrupted run's losses in the same wandb run. Runs tests/support/hf_trainer_worker.py
on 2 ranks forked like torchrun's (tests/support/zygote.py) (Ulysses 2, ZeRO-2, tiny Llama)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.launcher import test_hf_trainer
from tests.support.zygote import finish_ranks, start_ranks
from ulysses_cp.plan.comm import forward_comm_bytes

pytestmark = pytest.mark.launcher
pytest.importorskip("wandb")

WORKER = test_hf_trainer.WORKER
assets = test_hf_trainer.assets  # the tiny models and tokenizer (a module-scoped fixture)
METRICS = (
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "peak_mem_mb",
    "comm_bytes_per_step",
    "attention_comm_bytes_per_step",
)


def torchrun(tmp_path: Path, name: str, spec: dict) -> tuple[dict, Path]:
    """One sequence-parallel run on 2 ranks, its wandb folder apart: (result, wandb dir)."""
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    wandb_dir = tmp_path / f"wandb_{name}"
    wandb_dir.mkdir()
    env = {"DS_ACCELERATOR": "cpu", "WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline"}
    finish_ranks(
        [start_ranks(WORKER, str(path), nproc=2, logs=tmp_path / "logs", env=env, name=name)]
    )
    return json.loads((Path(spec["out"]) / "result.json").read_text()), wandb_dir


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


def attention_bytes_per_step(ga: int) -> int:
    """Ulysses 2, 2 layers, forward + backward all-to-alls, float32, rows of 2 x 32 tokens
    (the tiny Llama: 4 query heads, 2 kv heads of 8), by the plan's formula."""
    a2a, _ = forward_comm_bytes(
        batch=2,
        seq_len=32,
        hq=4,
        hkv=2,
        head_dim=8,
        ulysses_degree=2,
        ring_degree=1,
        bytes_per_element=4,
    )
    return 2 * 2 * a2a * ga


def train_lines(result: dict) -> dict[int, dict]:
    return {h["step"]: h for h in result["history"] if "loss" in h}


def test_trainer_wandb_metrics_and_resume_continue_the_run(assets, tmp_path):
    """4 steps with a checkpoint at step 2 (evaluation after step 3), then a resume from
    that checkpoint: steps 3 and 4 give the same losses, and the wandb run is the same."""
    common = dict(
        steps=4,
        eval_steps=3,
        save_steps=2,
        wandb=True,
        zero=2,
        sp={"ulysses_degree": 2, "ring_degree": 1},
    )
    full_out = tmp_path / "full"
    full_spec = test_hf_trainer.spec("trainer", "llama", assets, full_out, **common)
    full, full_wandb = torchrun(tmp_path, "full", full_spec)
    ckpt = full_out / "checkpoint-2"
    resumed_spec = test_hf_trainer.spec(
        "trainer", "llama", assets, tmp_path / "resumed", resume=str(ckpt), **common
    )
    resumed, resumed_wandb = torchrun(tmp_path, "resumed", resumed_spec)

    # the metrics, on every training log line, with the formula's attention bytes
    lines, again = train_lines(full), train_lines(resumed)
    assert sorted(lines) == sorted(again) == [1, 2, 3, 4]
    expected = attention_bytes_per_step(ga=full_spec["ga"])
    for step in (1, 2, 3, 4):
        for h in (lines[step], again[step]):
            assert set(METRICS) <= set(h), h
            assert h["attention_comm_bytes_per_step"] == expected, (step, h)
            assert h["comm_bytes_per_step"] > h["attention_comm_bytes_per_step"]
            assert h["tokens_per_s"] > 0 and h["peak_mem_mb"] > 0
            assert h["tokens_per_s_per_gpu"] == pytest.approx(h["tokens_per_s"] / 2)

    # the resumed steps: the uninterrupted run's losses
    for step in (3, 4):
        assert again[step]["loss"] == pytest.approx(lines[step]["loss"], rel=1e-6), step
    assert lines[1]["loss"] != lines[4]["loss"]

    # one wandb run: the id kept in the checkpoint, and the offline files of both parts
    run_id = full["wandb_run_id"]
    assert run_id and resumed["wandb_run_id"] == run_id
    assert json.loads((ckpt / "wandb_run.json").read_text()) == {"id": run_id}
    for folder in (full_wandb, resumed_wandb):
        runs = offline_runs(folder)
        assert [r.name.rsplit("-", 1)[-1] for r in runs] == [run_id], runs
        data = b"".join(f.read_bytes() for f in runs[0].glob("*.wandb"))
        for key in (*METRICS, "topology", "sequence_parallel", "ulysses_degree"):
            assert key.encode() in data, key


def test_wandb_run_id_file_is_only_read_from_the_checkpoint(tmp_path, monkeypatch):
    """resumed_wandb_run names the saved run while training and leaves the environment
    as it was; a user's WANDB_RUN_ID wins; no file, nothing set."""
    from ulysses_cp.integrations.hf_trainer.metrics import RUN_ID_FILE, resumed_wandb_run

    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    (tmp_path / RUN_ID_FILE).write_text(json.dumps({"id": "abc123"}))
    with resumed_wandb_run(tmp_path):
        assert os.environ["WANDB_RUN_ID"] == "abc123" and os.environ["WANDB_RESUME"] == "allow"
    assert "WANDB_RUN_ID" not in os.environ and "WANDB_RESUME" not in os.environ
    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    with resumed_wandb_run(tmp_path):
        assert os.environ["WANDB_RUN_ID"] == "mine"
    monkeypatch.delenv("WANDB_RUN_ID")
    with resumed_wandb_run(tmp_path / "missing"):
        assert "WANDB_RUN_ID" not in os.environ
