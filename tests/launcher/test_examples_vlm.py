"""examples/vlm_sft.py as docs/huggingface/quickstart.md starts it: a tiny Qwen2.5-VL trained on
four local images of different sizes (examples/make_tiny_assets.py --vlm) under the ``deepspeed``
launcher with TRL's SFTTrainer subclass, 2 CPU ranks, Ulysses 2, ZeRO-2, against the same
example in one process without DeepSpeed (the plain Trainer). ``accelerate launch`` and the
Trainer subclass run the text example (test_examples_hf.py); the Trainer's image batches
under SP are pinned in tests/distributed/test_hf_vlm_images.py. SGD with a constant learning
rate and
no clipping, so a wrong gradient (the vision tower's included) changes the losses of steps
2 and 3. Also: bad rows are refused naming the line and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launcher.test_examples_hf import assert_same_losses, three_ways
from tests.support.helpers import ROOT, run

pytestmark = pytest.mark.launcher
pytest.importorskip("accelerate")
pytest.importorskip("PIL")

EXAMPLE = ROOT / "examples" / "vlm_sft.py"
SETTINGS = "--max_steps 3 --batch_size 2 --optim sgd --learning_rate 1.0 --max_grad_norm 0"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vlm_example_assets")
    run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), str(folder), "--vlm"])
    return folder


def example_args(assets: Path, out: Path, data: Path | None = None) -> list[str]:
    model = ("--model_path", str(assets / "vlm"), "--tokenizer_path", str(assets / "tokenizer"))
    data = data or assets / "captions.jsonl"
    return [*model, "--data", str(data), "--output_dir", str(out), *SETTINGS.split()]


def test_vlm_example_under_the_launcher_equals_one_process(assets, tmp_path):
    """The deepspeed launcher runs TRL's SequenceParallelSFTTrainer; the one-process run is
    the plain Trainer."""

    def args_of(out: Path) -> list[str]:
        sft = ["--trainer", "sft"] if out.name == "deepspeed" else []
        return [*example_args(assets, out), *sft]

    outs, texts = three_ways(EXAMPLE, args_of, tmp_path, launchers=("deepspeed",))
    assert "training on 8 images" in texts[0]
    assert_same_losses(outs)
    # the tiny model's token ids lie in its vocabulary: transformers once warned, per rank
    noisy = [line for text in texts for line in text.splitlines() if "within the vocab" in line]
    assert noisy == [], noisy[:2]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"image": "images/none.png", "answer": "w7"}', "line 2: image"),
        ('{"image": "images/img0.png", "prompt": "w7"}', 'line 2: every line is {"image"'),
    ],
)
def test_vlm_example_bad_rows_are_refused(assets, tmp_path, line, message):
    data = assets / f"bad_{len(line)}.jsonl"
    first = (assets / "captions.jsonl").read_text().splitlines()[0]
    data.write_text(f"{first}\n{line}\n")
    out = run([sys.executable, str(EXAMPLE), *example_args(assets, tmp_path, data)], ok=False)
    assert message in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
