"""Faults in real runs of train.py: a dead rank, a crash while saving, non-finite values,
SIGTERM, and resuming under another layout or world size. Each run is 2-4 CPU ranks."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support import zygote
from tests.support.helpers import LAUNCH, ROOT, TRAIN, launch, metrics, run_config, write_config
from tests.support.zygote import finish_each

pytestmark = [pytest.mark.launcher, pytest.mark.slow]

FAULTY = (
    ROOT / "tests" / "support" / "train_with_faults.py"
)  # train.py with tests/support/faults.py hooks
WARMUP = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3},
}


def config(tmp: Path, name: str, **blocks) -> Path:
    """The faults' run: 2 ranks, u2, 4 steps saved every 2, a short collective timeout."""
    cfg = run_config(
        **{**LAUNCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}},
        scheduler=WARMUP,
        sp={"collective_timeout_s": 20},
        training={"max_steps": 4, "log_interval": 1, "save_interval": 2},
    )
    for block, values in blocks.items():
        cfg[block].update(values)
    return write_config(tmp, cfg, name)


def run(cfg: Path, out: Path, *extra, ranks: int = 2, fault: str | None = None, ok=True):
    """train.py (or with a fault) on ``ranks`` ranks as DeepSpeed's launcher starts
    them; their output."""
    env = {"UCP_FAULT": fault} if fault else None
    script = FAULTY if fault else TRAIN
    return launch(cfg, out, *extra, num_gpus=ranks, script=script, env=env, ok=ok)


def losses(out: Path) -> dict[int, float | None]:
    return {r["step"]: r["loss"] for r in metrics(out)}


def start_ranks(cfg: Path, out: Path, world: int, *extra, fault: str | None = None):
    """Start the ranks without a launcher (forked as tests/support/zygote.py does, in torchrun's
    environment), so each one can be signalled or killed; their handles."""
    script = FAULTY if fault else TRAIN
    args = ("--deepspeed_config", str(cfg), "--output_dir", str(out), *extra)
    env = {"WANDB_MODE": "disabled", **({"UCP_FAULT": fault} if fault else {})}
    logs = out.parent / f"{out.name}_logs"
    return zygote.start_ranks(script, *args, nproc=world, logs=logs, env=env).handles()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 4-step run every resumed run is compared with (2 ranks, u2)."""
    tmp = tmp_path_factory.mktemp("reference")
    run(config(tmp, "ref"), tmp / "out")
    return losses(tmp / "out")


def test_dead_rank_stops_the_others_with_a_message_and_the_run_resumes(tmp_path, reference):
    cfg = config(tmp_path, "cfg")
    t0 = time.monotonic()
    procs = start_ranks(cfg, tmp_path / "out", 2, fault="kill:rank=1,step=3")
    (code0, out0), (code1, _) = finish_each(procs, 180)
    assert code1 == -signal.SIGKILL
    assert code0 != 0, out0[-2000:]
    assert "CollectiveError" in out0 and "group (global ranks [0, 1])" in out0, out0[-3000:]
    assert "training failed" in out0 and "--resume" in out0
    assert time.monotonic() - t0 < 120
    assert (tmp_path / "out" / "latest").read_text() == "step2"
    log = run(cfg, tmp_path / "out", "--resume")
    assert "resumed from" in log and "at step 2" in log
    got = losses(tmp_path / "out")
    for step in (3, 4):
        assert got[step] == pytest.approx(reference[step], rel=1e-6), (step, got, reference)


def test_hung_rank_times_out_with_a_message(tmp_path):
    cfg = config(tmp_path, "cfg", sequence_parallel={"collective_timeout_s": 8})
    procs = start_ranks(cfg, tmp_path / "out", 2, fault="hang:rank=1,step=2")
    t0 = time.monotonic()
    code0, out0 = finish_each(procs[:1], timeout=120)[0]
    waited = time.monotonic() - t0
    procs[1].kill()
    finish_each(procs[1:], 180)
    assert code0 != 0 and "CollectiveError" in out0, out0[-3000:]
    assert "sp group (global ranks [0, 1])" in out0 and "collective timeout" in out0
    assert waited < 90, waited


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path, reference):
    cfg = config(tmp_path, "cfg")
    out = tmp_path / "out"
    run(cfg, out, fault="crash_in_save:step=4", ok=False)
    assert (out / "latest").read_text() == "step2"
    assert (out / "step4.tmp").is_dir() and not (out / "step4").exists()
    log = run(cfg, out, "--resume")
    assert "at step 2" in log
    assert (out / "latest").read_text() == "step4" and not (out / "step4.tmp").exists()
    got = losses(out)
    assert [got[s] for s in (3, 4)] == pytest.approx([reference[3], reference[4]], rel=1e-6)


def test_nonfinite_loss_stop_saves_and_exits(tmp_path):
    cfg = config(tmp_path, "cfg", training={"on_nonfinite": "stop", "save_interval": 0})
    results = finish_each(start_ranks(cfg, tmp_path / "out", 2, fault="nan_loss:step=3"), 180)
    log = results[0][1]
    assert [code for code, _ in results] == [3, 3], log[-3000:]
    assert "non-finite loss at step 3" in log and "on_nonfinite is 'stop'" in log, log[-3000:]
    assert (tmp_path / "out" / "latest").read_text() == "step2"  # the state before step 3


def test_nonfinite_gradients_skip_the_step(tmp_path):
    cfg = config(tmp_path, "cfg")
    log = run(cfg, tmp_path / "out", fault="nan_grad:step=3")
    assert "non-finite gradients at step 3: update skipped (1 so far)" in log, log[-3000:]
    rows = metrics(tmp_path / "out")
    assert rows[2]["loss"] is None and rows[2]["skipped_steps"] == 1
    assert all(r["loss"] is not None and r["loss"] < 10 for r in rows if r["step"] != 3)


def test_sigterm_saves_and_exits_cleanly(tmp_path, reference):
    cfg = config(tmp_path, "cfg", training={"max_steps": 2000, "save_interval": 0})
    out = tmp_path / "out"
    procs = start_ranks(cfg, out, 2)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2:
            break
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = finish_each(procs, 180)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    assert "stopped by signal after step" in results[0][1]
    tag = (out / "latest").read_text()
    saved = int(tag.removeprefix("step"))
    assert saved >= 2 and (out / tag / "meta.json").is_file()
    assert [r["step"] for r in metrics(out)] == list(range(1, saved + 1))


@pytest.mark.parametrize(
    "first,then,ranks_then",
    [
        ({"ulysses_degree": 4}, {"ulysses_degree": 2, "ring_degree": 2}, 4),  # u4 -> u2r2
        ({"ulysses_degree": 4}, {"ulysses_degree": 2}, 2),  # 4 ranks -> 2 ranks
        ({"ulysses_degree": 2}, {"ulysses_degree": 1, "ring_degree": 4}, 4),  # 2 -> 4, ring
    ],
)
def test_resume_under_another_layout(tmp_path, reference, first, then, ranks_then):
    """The loss of the resumed steps equals the uninterrupted run's (the modes compute the
    same math; float32 rounding differs between layouts)."""
    ranks_first = 4 if first.get("ulysses_degree") == 4 else 2
    out = tmp_path / "out"
    run(config(tmp_path, "a", sequence_parallel=first), out, "--max_steps", "2", ranks=ranks_first)
    log = run(config(tmp_path, "b", sequence_parallel=then), out, "--resume", ranks=ranks_then)
    assert "resumed from" in log and "at step 2" in log
    if ranks_then != ranks_first:
        assert "loading its portable state" in log
    got = losses(out)
    for step in (3, 4):
        assert got[step] == pytest.approx(reference[step], rel=1e-4), (step, got, reference)


def test_resume_under_another_zero_stage(tmp_path, reference):
    out = tmp_path / "out"
    run(config(tmp_path, "a"), out, "--max_steps", "2")
    cfg = config(tmp_path, "b", zero_optimization={"stage": 3})
    log = run(cfg, out, "--resume")
    assert "loading its portable state on 2 ranks / ZeRO-3" in log
    got = losses(out)
    assert [got[s] for s in (3, 4)] == pytest.approx([reference[3], reference[4]], rel=1e-4)


def test_bad_config_fails_on_every_rank_before_training(tmp_path):
    cfg = config(tmp_path, "cfg", training={"on_nonfinte": "skip"}, data={"seq_len": 66})
    t0 = time.monotonic()
    results = finish_each(start_ranks(cfg, tmp_path / "out", 2), timeout=60)
    assert time.monotonic() - t0 < 60
    # the file and the key's line, then the message (as the config's other errors)
    message = f"error: {cfg}:1: unknown keys in the \"training\" block: ['on_nonfinte']"
    check_one_line(results, message)
    cfg = config(tmp_path, "cfg2", data={"seq_len": 66})
    results = finish_each(start_ranks(cfg, tmp_path / "out", 2), timeout=60)
    check_one_line(results, "error: data.seq_len 66 must be a multiple of 4")
    # a missing data file: reported before the engine (and its ZeRO partitioning) is built
    cfg = config(tmp_path, "cfg3", data={"task": "text", "files": ["absent.txt"]})
    results = finish_each(start_ranks(cfg, tmp_path / "out", 2), timeout=60)
    check_one_line(results, f"error: data file not found: {tmp_path / 'absent.txt'}")
    for _, out in results:
        assert "DeepSpeed engine ready" not in out, out[-2000:]  # ucp.initialize's last line


def check_one_line(results, message: str) -> None:
    """A user error: exit code 2 on every rank, the message once (rank 0), no traceback."""
    assert [code for code, _ in results] == [2] * len(results), results
    assert message in results[0][1], results[0][1][-2000:]
    for _, out in results:
        assert "Traceback" not in out, out[-2000:]
    assert sum(out.count(message) for _, out in results) == 1


def test_checkpoint_without_portable_state_refuses_another_world(tmp_path):
    out = tmp_path / "out"
    cfg = config(tmp_path, "a", training={"portable_checkpoint": False})
    run(cfg, out, "--max_steps", "2")
    assert not (out / "step2" / "portable.pt").exists()
    log = run(
        config(tmp_path, "b", sequence_parallel={"ulysses_degree": 4}),
        out,
        "--resume",
        ranks=4,
        ok=False,
    )
    assert "written on 2 ranks with ZeRO-2; this run has 4 ranks" in log, log[-2000:]
