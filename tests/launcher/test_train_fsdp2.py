"""train.py with ``"engine": "fsdp2"`` on 4 CPU ranks in torchrun's environment (gloo): the
loss falls; a rank killed mid-run ends the run, and ``--resume auto`` continues it with
the uninterrupted run's losses; a checkpoint written at dp2 x u2 resumes at u4. Four
launches in one test: the reference, the killed run, its resume, the u4 resume."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from tests.support import zygote
from tests.support.helpers import (
    LAUNCH,
    ROOT,
    TRAIN,
    metrics,
    run_config,
    tiny_llama_weights,
    write_config,
)
from tests.support.zygote import finish_each

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

FAULTY = ROOT / "tests" / "support" / "train_with_faults.py"
STEPS = 6


def _config(tmp: Path, name: str, u: int) -> Path:
    """``u`` of 4 ranks: dp2 x u2 with 2 rows per micro step, or u4 with 4 (the same
    samples in each micro step, ``data.global_batch``)."""
    cfg = run_config(
        u,
        1,
        3,
        **{**LAUNCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}},
        gradient_accumulation_steps=2,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 3}},
        sp={"collective_timeout_s": 20},
        training={"max_steps": STEPS, "log_interval": 1, "save_interval": 2},
        engine="fsdp2",
        train_micro_batch_size_per_gpu=u,  # rows per replica: 8 per step either way
    )
    cfg.pop("zero_allow_untested_optimizer")  # harmless, but not needed: torch builds it
    return write_config(tmp, cfg, name)


def _run(cfg: Path, out: Path, *extra: str) -> str:
    """train.py on 4 ranks in torchrun's environment, to a clean end: the ranks' output."""
    args = ("--deepspeed_config", str(cfg), "--output_dir", str(out), *extra)
    env = {"WANDB_MODE": "disabled"}
    ranks = zygote.start_ranks(TRAIN, *args, nproc=4, logs=out.parent / f"{out.name}_logs", env=env)
    zygote.wait_ranks([ranks], timeout=600)
    text = ranks.output()
    assert all(c == 0 for c in ranks.codes), f"exit codes {ranks.codes}:\n{text[-6000:]}"
    return text


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(out)}


def test_fsdp2_trains_resumes_after_a_kill_and_under_another_layout(tmp_path):
    ref_out = tmp_path / "ref"
    log = _run(_config(tmp_path, "u2", 2), ref_out)
    assert "FSDP2 engine ready: ZeRO-3 as reshard_after_forward=True" in log
    assert "DeepSpeed engine" not in log
    ref = _losses(ref_out)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS] < ref[1] - 0.1, ref  # the loss falls
    meta = json.loads((ref_out / "step6" / "meta.json").read_text())
    assert meta["engine"] == "fsdp2" and meta["world_size"] == 4
    assert not (ref_out / "step6" / "portable.pt").exists()  # DCP reshards itself

    # a rank killed at the start of step 5: the others fail, step4 is the latest
    out = tmp_path / "killed"
    args = ("--deepspeed_config", str(tmp_path / "u2.json"), "--output_dir", str(out))
    env = {"WANDB_MODE": "disabled", "UCP_FAULT": "kill:rank=1,step=5"}
    ranks = zygote.start_ranks(FAULTY, *args, nproc=4, logs=tmp_path / "killed_logs", env=env)
    results = finish_each(ranks.handles(), 240)
    assert results[1][0] == -signal.SIGKILL
    assert all(code != 0 for code, _ in results), results[0][1][-3000:]
    assert "training failed" in results[0][1]
    assert (out / "latest").read_text() == "step4"
    at_u4 = tmp_path / "at_u4"  # the same checkpoint, resumed on the other layout below
    at_u4.mkdir()
    shutil.copytree(out / "step4", at_u4 / "step4")
    (at_u4 / "latest").write_text("step4")

    log = _run(tmp_path / "u2.json", out, "--resume", "auto")
    assert "resumed from" in log and "at step 4" in log
    got = _losses(out)
    for step in range(1, STEPS + 1):  # the same steps: same layout, same arithmetic
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), (step, got, ref)

    log = _run(_config(tmp_path, "u4", 4), at_u4, "--resume")
    assert "resumed from" in log and "at step 4" in log and "'ulysses': 4" in log
    got = _losses(at_u4)
    assert sorted(got) == [5, 6]
    for step in (5, 6):  # u4 sums in another order (float32): the same loss, nearly
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got, ref)


def test_fsdp2_builds_a_hugging_face_model_on_meta_and_loads_its_rows(tmp_path):
    """``model.hf_weights`` under fsdp2: built on meta, sharded, each rank reading its rows
    of the safetensors, probed; the first steps equal DeepSpeed's whole load (ZeRO-2)."""
    pytest.importorskip("transformers")
    model = tiny_llama_weights(tmp_path)
    losses, logs = {}, {}
    for engine, stage in (("fsdp2", 3), ("deepspeed", 2)):
        cfg = run_config(
            2,
            2,
            stage,
            **{**LAUNCH, "model": model},
            training={"max_steps": 2, "log_interval": 1, "save_interval": 0},
            engine=engine,
        )
        out = tmp_path / engine
        logs[engine] = _run(write_config(tmp_path, cfg, engine), out)
        losses[engine] = [r["loss"] for r in metrics(out)]
    assert "tensors read, each rank its own rows" in logs["fsdp2"]
    assert "the Hugging Face probe passed" in logs["fsdp2"]
    assert losses["fsdp2"] == pytest.approx(losses["deepspeed"], rel=1e-6), losses
