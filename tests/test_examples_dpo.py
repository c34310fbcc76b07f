"""examples/dpo_long.py as the README starts it: under ``accelerate launch`` and under the
``deepspeed`` launcher (2 CPU ranks, Ulysses 2, ZeRO-2), against the same example in one
process without DeepSpeed, all three side by side; SGD with a constant learning rate, so a
wrong gradient scale changes the losses of steps 2 and 3. Bad input stops the example with
a message naming the line and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.test_examples_hf import (
    assert_bad_data_refused,
    assert_same_losses,
    three_ways,
    tiny_assets,
)
from tests.test_examples_hf import example_args as sft_example_args

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("accelerate")

EXAMPLE = ROOT / "examples" / "dpo_long.py"
# the README's settings (a short run that shows a wrong gradient scale)
SETTINGS = ("--max_length", "48", "--max_steps", "3", "--batch_size", "2", "--beta", "0.5",
            "--optim", "sgd", "--learning_rate", "1.0", "--max_grad_norm", "0")  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny Qwen3, tokenizer and preference pairs of the README."""
    return tiny_assets(tmp_path_factory.mktemp("dpo_example_assets"))


def example_args(assets: Path, out: Path) -> list[str]:
    return sft_example_args(assets, out, data="pairs.jsonl", settings=SETTINGS)


def test_dpo_example_under_both_launchers_equals_one_process(assets, tmp_path):
    outs, texts = three_ways(EXAMPLE, lambda out: example_args(assets, out), tmp_path)
    assert "DPO on 32 pairs" in texts[0]
    assert_same_losses(outs)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (None, "no such file"),
        ('{"prompt": "w7", "chosen": "w8"}', 'line 2: every line is {"prompt"'),
        ("{not json", "line 2: not JSON"),
    ],
)
def test_dpo_example_bad_data_is_refused(assets, tmp_path, line, message):
    assert_bad_data_refused(EXAMPLE, example_args(assets, tmp_path / "out"), line, message)
