"""plan.phases.step_phases against the live bytes of bf16 training steps on CPU: the
phase that holds the peak (the loss for a shallow model at a long length, the end of the
backward for a deep one at a short length) and the peak within 5% above, 2% below."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import plan
from ulysses_cp.plan.search import GiB, Hardware, usable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from plan_phases import measure_plain, predicted


@pytest.mark.unit
@pytest.mark.parametrize(
    ("layers", "n", "budget", "phase", "over"),
    [
        (2, 2048, None, "loss", 1.05),
        (16, 512, None, "backward_end", 1.05),
        # MLP and loss both in many pieces: the layers' backward is over by 5.3% (the
        # tiled MLP piece's share of activation_bytes' in_layers, calibrated in float32)
        (2, 4096, 0.05, "backward", 1.06),
    ],
)
def test_step_peak_within_five_percent_and_never_two_under(layers, n, budget, phase, over):
    pred = predicted(layers, n, budget)
    measured = measure_plain(layers, n, budget)
    assert pred["phase"] == phase
    assert 0.98 <= pred["peak"] / measured <= over, (pred, measured)


@pytest.mark.launcher
def test_deepspeed_step_within_two_percent(tmp_path):
    """DeepSpeed ZeRO-1 and ZeRO-2 steps (bf16, one rank, torch's AdamW): the forward, the
    backward with the gradients and ZeRO's copy of them, and the optimizer step's fp32
    gradient partition with Adam's temporaries, against ``deepspeed_peak``."""
    script = ROOT / "scripts" / "plan_phases.py"
    run([sys.executable, str(script), "--out", str(tmp_path)], timeout=600)
    rows = json.loads((tmp_path / "plan_phases.json").read_text())
    assert len(rows) == 5
    for row in rows:
        for stage in ("zero1", "zero2"):
            assert 0.98 <= row[f"{stage}_predicted"] / row[stage] <= 1.05, row


@pytest.mark.launcher
def test_deepspeed_reduce_bucket_counted(tmp_path):
    """ZeRO-1/2's reduce bucket at DeepSpeed's default size (5e8 elements, 1 GB in bf16),
    made in the backward: it holds these small models' peak."""
    script = ROOT / "scripts" / "plan_phases.py"
    cmd = [sys.executable, str(script), "--shapes", "2", "--bucket", "500000000"]
    run([*cmd, "--out", str(tmp_path)], timeout=600)
    rows = json.loads((tmp_path / "plan_phases.json").read_text())
    assert len(rows) == 2
    for row in rows:
        for stage in ("zero1", "zero2"):
            assert row[stage] > 2**30 * 0.9  # the bucket is there
            assert 0.98 <= row[f"{stage}_predicted"] / row[stage] <= 1.05, row


@pytest.mark.unit
def test_fits_keeps_the_runs_headroom():
    """A plan fits into what the run itself would use (10% or 2 GiB left free), on the
    GPU and on the host: Llama-3-8B on 8 x 80 GiB with 2 TiB of host memory per node."""
    assert usable(80 * GiB) == 72 * GiB and usable(16 * GiB) == 14 * GiB
    cfg = RunConfig.load(ROOT / "configs" / "llama3_8b_8gpu_zero3_u8r1.json")
    got = plan(cfg, world=8, hw=Hardware())
    longest = got["config_at_max_seq_len"]
    assert longest["peak_bytes_per_rank"] <= 72 * GiB
    assert longest["host_bytes_per_rank"] <= 0.9 * 256 * GiB
    assert longest["peak_bytes_per_rank"] > 70 * GiB or longest["host_bytes_per_rank"] > 225 * GiB
