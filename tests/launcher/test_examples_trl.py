"""The TRL examples (examples/dpo_long.py, examples/grpo_long.py) as docs/huggingface/quickstart.md
("Quick start") starts them: DPO under the ``deepspeed`` launcher, GRPO under ``accelerate
launch`` (2 CPU ranks, Ulysses 2, ZeRO-2; the SFT example's test runs both launchers),
against the same example in one process without DeepSpeed, side by side; SGD with a
constant learning rate, so a wrong gradient scale changes the losses of steps 2 and 3.
GRPO's completions are sampled by the model, so its equal losses also say that the
sequence-parallel run drew the one-process completions. Bad input stops each example with
a message naming the line and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.test_examples_hf import (
    assert_bad_data_refused,
    assert_same_losses,
    three_ways,
    tiny_assets,
)
from tests.launcher.test_examples_hf import example_args as sft_example_args
from tests.support.helpers import ROOT

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("accelerate")

# each example: its file, the quick start's settings (a short run that shows a wrong gradient
# scale), the line it prints first, and a data line it refuses with its message
EXAMPLES = {
    "dpo": (
        "dpo_long.py",
        "--max_length 48 --max_steps 3 --batch_size 2 --beta 0.5"
        " --optim sgd --learning_rate 1.0 --max_grad_norm 0",
        "DPO on 32 pairs",
        ('{"prompt": "w7", "chosen": "w8"}', 'line 2: every line is {"prompt"'),
    ),
    "grpo": (
        "grpo_long.py",
        "--max_steps 3 --beta 0.1 --optim sgd --learning_rate 0.5 --max_grad_norm 0",
        "GRPO on 32 prompts",
        ('{"chosen": "w8"}', 'line 2: every line is {"prompt"'),
    ),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny Qwen3, tokenizer and preference pairs (their prompts: GRPO's) of the quick
    start."""
    return tiny_assets(tmp_path_factory.mktemp("trl_example_assets"))


def example(name: str, assets: Path):
    """The example's path and its arguments for an output folder."""
    file, settings, _, _ = EXAMPLES[name]
    path = ROOT / "examples" / file
    return path, lambda out: sft_example_args(assets, out, data="pairs.jsonl", settings=settings)


# each example under one launcher: what differs between the launchers (their environment,
# the DeepSpeed config's route) is the same for every example, and the SFT example's test
# runs it under both
LAUNCHED_BY = {"dpo": "deepspeed", "grpo": "accelerate"}


# what the quick start once printed: TRL's warning for our tiny assets' pairs (the prompt's
# last word merged with the answer's first), and the third-party notices that
# ulysses_cp.core.log.quiet_third_party hides
NOISE = (
    "is not a prefix",
    "all_gather_into_tensor",
    "gradient_checkpointing",
    "OMP_NUM_THREADS/MKL_NUM_THREADS",
    "untested optimizer",
)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_under_a_launcher_equals_one_process(assets, tmp_path, name):
    """Also: no run prints a line of :data:`NOISE`."""
    path, args_of = example(name, assets)
    outs, texts = three_ways(path, args_of, tmp_path, launchers=(LAUNCHED_BY[name],))
    assert EXAMPLES[name][2] in texts[0]
    assert_same_losses(outs)
    noisy = [line for text in texts for line in text.splitlines() if any(n in line for n in NOISE)]
    assert noisy == [], noisy[:4]


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("case", ["missing", "bad line", "not json"])
def test_example_bad_data_is_refused(assets, tmp_path, name, case):
    line, message = {
        "missing": (None, "no such file"),
        "bad line": EXAMPLES[name][3],
        "not json": ("{not json", "line 2: not JSON"),
    }[case]
    path, args_of = example(name, assets)
    assert_bad_data_refused(path, args_of(tmp_path / "out"), line, message)
