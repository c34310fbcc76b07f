"""End to end: train.py under the deepspeed launcher writes metrics, a wandb offline run
and checkpoints; --resume continues with the same losses as an uninterrupted run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.helpers import LAUNCH, ROOT, launch, metrics, run_config, write_config
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import plan
from ulysses_cp.plan.search import Hardware
from ulysses_cp.training.data import global_batch, make_dataset

pytestmark = pytest.mark.launcher


def _matmul_params(m: dict) -> int:
    """The reference decoder's parameters a token runs through, from its config: per layer
    q/k/v, output, SwiGLU and two norms, then the LM head (vocabulary 256)."""
    d = m["dim"] // m["n_heads"]
    layer = m["dim"] * (m["n_heads"] + 2 * m["n_kv_heads"]) * d + m["n_heads"] * d * m["dim"]
    return m["n_layers"] * (layer + 3 * m["dim"] * m["ffn_dim"] + 2 * m["dim"]) + 256 * m["dim"]


def _span_flops(n: int, m: dict, sp: int) -> float:
    """One causal span's model FLOPs per rank, written out: 6 x params x tokens, causal
    attention 6 N^2 hq d per layer."""
    attention = 6 * n**2 * m["dim"] * m["n_layers"]  # hq * d = dim
    return (6 * _matmul_params(m) * n + attention) / sp


WARMUP = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3},
}
CONFIG = run_config(
    **LAUNCH,
    gradient_accumulation_steps=2,
    scheduler=WARMUP,
    wandb={"enabled": True, "project": "ulysses_cp_test"},
    training={"max_steps": 4, "log_interval": 1, "save_interval": 2},
)


@pytest.mark.slow
def test_train_metrics_wandb_checkpoint_and_resume(tmp_path):
    cfg = write_config(tmp_path, CONFIG)
    full = tmp_path / "full"
    res = launch(cfg, full)
    rows = metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(r) >= {
            "step",
            "loss",
            "lr",
            "tokens_per_s",
            "tokens_per_s_per_gpu",
            "peak_mem_mb",
            "comm_bytes_per_step",
            "attention_comm_bytes_per_step",
        }
        assert r["tokens_per_s_per_gpu"] == r["tokens_per_s"] / 2 and r["peak_mem_mb"] > 0
    # one name per quantity: the logged bytes are the plan's, attention measured (the
    # all-to-all counters) and ZeRO-2's all-reduce + all-gather of 2 ranks by formula,
    # micro batches (2) included
    got = plan(RunConfig.load(cfg), world=2, hw=Hardware())["config"]
    zero = sum(got["zero_comm_bytes_per_step"].values())
    assert got["attention_comm_bytes_per_step"] > 0 and zero > 0
    for r in rows:
        assert r["attention_comm_bytes_per_step"] == got["attention_comm_bytes_per_step"]
        assert r["comm_bytes_per_step"] == got["comm_bytes_per_step_per_rank"]
    assert "step     4  loss" in res  # the progress line
    # model FLOPs per rank and step: 2 micro batches of 2 rows of 64 tokens over 2 SP ranks;
    # no MFU on a CPU without --peak-tflops
    flops = 2 * 2 * _span_flops(64, LAUNCH["model"], sp=2)
    for r in rows:
        assert r["model_flops_per_step"] == flops and r["model_tflops"] > 0 and "mfu" not in r
    assert re.search(r"tok/s \d+  TFLOP/s [\d.e-]+  peak", res) and not re.search(
        r"MFU [\d.]+%", res
    )
    assert (full / "latest").read_text().strip() == "step4"
    assert (full / "step2").is_dir() and (full / "step4").is_dir()
    runs = list((full / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))

    part = tmp_path / "part"
    launch(cfg, part, "--max_steps", "2")
    assert [r["step"] for r in metrics(part)] == [1, 2]
    res = launch(cfg, part, "--resume")
    assert "resumed from" in res
    resumed = metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), (a, b)
        assert a["lr"] == pytest.approx(b["lr"])
    # the resume continued the wandb run whose id the checkpoint's meta.json keeps
    ids = [r.name.rsplit("-", 1)[-1] for r in sorted((part / "wandb").glob("offline-run-*"))]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert json.loads((part / "step2" / "meta.json").read_text())["wandb_run_id"] == ids[0]


@pytest.mark.slow
def test_train_packed_rows(tmp_path):
    data = dict(seq_len=128, packing=True, min_doc_len=16, max_doc_len=48, pack_multiple=4)
    short = dict(wandb=None, training={"max_steps": 2, "log_interval": 1})
    path = write_config(tmp_path, run_config(**{**LAUNCH, "data": LAUNCH["data"] | data}, **short))
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer*")) if shm.is_dir() else set()
    out = launch(path, tmp_path / "run", "--peak-tflops", "0.5")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["loss"] < 10 for r in rows)
    # model FLOPs per document of the packed row (the rows' documents, end padding in)
    dataset = make_dataset(RunConfig.load(path).data)
    for step, r in enumerate(rows):
        row = global_batch(
            dataset, step=step, micro_step=0, grad_accum=1, micro_batch=2, dp_rank=0, dp_degree=1
        )
        docs = row["cu_seqlens"].diff().tolist()
        assert len(docs) > 2 and sum(docs) == 2 * 128
        assert r["model_flops_per_step"] == sum(_span_flops(n, LAUNCH["model"], 2) for n in docs)
        assert r["mfu"] == r["model_tflops"] / 0.5
    assert "0.5 TFLOP/s peak, --peak-tflops" in out and re.search(r"TFLOP/s \S+  MFU [\d.]+%", out)
    # none of DeepSpeed's start-up noise that is ours to avoid: the shared-memory op built
    # and loaded, the warmup scheduler's warning, torch's deprecation of its collective
    for noise in ("shm_comm_op built", "before it has started", "is deprecated"):
        assert noise not in out, noise
    if shm.is_dir():  # DeepSpeed's CPU shm allreduce leaks 69 MB per rank and run: off
        assert set(shm.glob("deepspeed_allreduce_buffer*")) <= before
    assert (tmp_path / "run" / "latest").read_text().strip() == "step2"
    # a pack_multiple the layout cannot split is refused before training starts
    data["pack_multiple"] = 2
    path = write_config(tmp_path, run_config(**{**LAUNCH, "data": LAUNCH["data"] | data}, **short))
    out = launch(path, tmp_path / "bad", ok=False)
    assert "pack_multiple 2 must be a multiple of 4" in out


@pytest.mark.slow
def test_train_hugging_face_model(tmp_path):
    pytest.importorskip("transformers")
    model = {
        "hf_config": str(ROOT / "configs" / "hf" / "tiny_qwen3.json"),
        "tiled_mlp": 2,
        "tiled_loss": 2,
        "activation_checkpointing": True,
    }
    short = dict(training={"max_steps": 2, "log_interval": 1})
    path = write_config(tmp_path, run_config(**{**LAUNCH, "model": model}, **short))
    res = launch(path, tmp_path / "run")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows)
    assert (tmp_path / "run" / "latest").read_text().strip() == "step2"
    assert "training 0." in res  # the parameter count line
    assert all(r["model_flops_per_step"] > 0 and r["model_tflops"] > 0 for r in rows)
