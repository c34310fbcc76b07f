"""examples/dpo_long.py as the README starts it: under ``accelerate launch`` and under the
``deepspeed`` launcher (2 CPU ranks, Ulysses 2, ZeRO-2), against the same example in one
process without DeepSpeed, all three side by side; SGD with a constant learning rate, so a
wrong gradient scale changes the losses of steps 2 and 3. Bad input stops the example with
a message naming the line and the fix."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, finish, start
from tests.test_examples_hf import (
    accelerate_cmd,
    assert_bad_data_refused,
    deepspeed_cmd,
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
    outs = {name: tmp_path / name for name in ("ref", "accelerate", "deepspeed")}
    procs = [
        start([sys.executable, str(EXAMPLE), *example_args(assets, outs["ref"])]),
        start(accelerate_cmd(example_args(assets, outs["accelerate"]), EXAMPLE)),
        start(deepspeed_cmd(example_args(assets, outs["deepspeed"]), EXAMPLE)),
    ]
    results = finish(procs, timeout=900)
    for name, (code, text) in zip(outs, results):
        assert code == 0, f"{name}: exit {code}\n{text[-6000:]}"
    ref_text, *sp_texts = (text for _, text in results)
    assert "DPO on 32 pairs" in ref_text and "one process (no sequence_parallel block)" in ref_text
    for text in sp_texts:
        assert "sequence parallel: Ulysses 2 x ring 1, 1 data-parallel replica(s)" in text
    losses = {}
    for name, out in outs.items():
        losses[name] = json.loads((out / "train_losses.json").read_text())
        assert len(losses[name]) == 3 and all(math.isfinite(x) for x in losses[name])
    assert losses["ref"][0] != losses["ref"][-1]  # the steps changed the model
    for name in ("accelerate", "deepspeed"):
        torch.testing.assert_close(
            torch.tensor(losses[name]), torch.tensor(losses["ref"]), rtol=1e-5, atol=1e-6
        )
    assert "ulysses" not in (outs["deepspeed"] / "final" / "config.json").read_text()


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
