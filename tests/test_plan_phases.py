"""plan.phases.step_phases against the live bytes of bf16 training steps on CPU: the
phase that holds the peak (the loss for a shallow model at a long length, the end of the
backward for a deep one at a short length) and the peak within 5% above, 2% below."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from plan_phases import measure_plain, predicted

pytestmark = pytest.mark.unit


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
