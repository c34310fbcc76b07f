"""plan.phases.step_phases against the live bytes of bf16 training steps on CPU: the
phase that holds the peak (the loss for a shallow model at a long length, the end of the
backward for a deep one at a short length) and the peak within 5% above, 2% below.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan_phases.py (the plain step, measured in process).
"""

import json
import sys

import pytest

from tests.support.helpers import ROOT, run


@pytest.mark.launcher
def test_deepspeed_step_within_two_percent_and_reduce_bucket_counted(tmp_path):
    """DeepSpeed ZeRO-1 and ZeRO-2 steps (bf16, one rank, torch's AdamW): the forward, the
    backward with the gradients and ZeRO's copy of them, and the optimizer step's fp32
    gradient partition with Adam's temporaries, against ``deepspeed_peak``. The first three
    shapes: a peak in each of the loss, the backward (tiled) and the backward's end. Then,
    in the same launch, the first shape at DeepSpeed's default reduce bucket (5e8
    elements, 1 GB in bf16), made in the backward: it holds these small models' peak."""
    script = ROOT / "scripts" / "plan_phases.py"
    cmd = [sys.executable, str(script), "--shapes", "3", "--no-plain", "--default-bucket", "1"]
    run([*cmd, "--out", str(tmp_path)], timeout=600)
    rows = json.loads((tmp_path / "plan_phases.json").read_text())
    assert [(row["phase"], row["bucket"]) for row in rows] == [
        ("loss", 100_000),
        ("backward", 100_000),
        ("backward_end", 100_000),
        ("loss", 500_000_000),
    ], rows
    for row in rows:
        assert "plain" not in row, row  # measured in the unit tier
        for stage in ("zero1", "zero2"):
            assert 0.98 <= row[f"{stage}_predicted"] / row[stage] <= 1.05, row
    for stage in ("zero1", "zero2"):
        assert rows[-1][stage] > 2**30 * 0.9  # the bucket is there
        assert rows[0][stage] < 2**30 * 0.5  # and not with the small one
