"""examples/hf_trainer_sft.py as docs/huggingface/quickstart.md starts it: under
``accelerate launch`` (with examples/accelerate_config.yaml) and under the ``deepspeed``
launcher, 2 CPU ranks, Ulysses 2, ZeRO-2, row-wise packing of chats of every length; against
the same example in one process without DeepSpeed (transformers' sdpa attention), all three
side by side. SGD with a constant learning rate and no clipping, so a wrong gradient scale
changes the losses of steps 2 and 3. Also: the saved folder is a plain transformers model,
and bad input stops the example with a message naming the line and the fix."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import ROOT, finish, free_port, run, start
from tests.support.zygote import start_ranks, wait_ranks

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("accelerate")

EXAMPLE = ROOT / "examples" / "hf_trainer_sft.py"
RTOL = 1e-5
# the quick start's settings in docs/huggingface/quickstart.md (a short run that shows a wrong
# gradient scale; tests/unit/test_docs.py checks the page gives these)
SETTINGS = (
    "--max_length 64 --max_steps 3 --batch_size 2 --optim sgd --learning_rate 1.0 --max_grad_norm 0"
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny Qwen3, tokenizer (with a chat template) and chats of the quick start."""
    return tiny_assets(tmp_path_factory.mktemp("hf_example_assets"))


def tiny_assets(folder: Path) -> Path:
    """``examples/make_tiny_assets.py FOLDER`` (also tests/launcher/test_examples_trl.py's)."""
    run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), str(folder)])
    return folder


def example_args(
    assets: Path, out: Path, data: str = "chats.jsonl", settings: str = SETTINGS
) -> list[str]:
    model = ("--model_path", str(assets / "model"), "--tokenizer_path", str(assets / "tokenizer"))
    return [*model, "--data", str(assets / data), "--output_dir", str(out), *settings.split()]


LAUNCHERS = ("accelerate", "deepspeed")


def accelerate_cmd(args: list[str], example: Path = EXAMPLE) -> list[str]:
    """``accelerate launch --config_file examples/accelerate_config.yaml`` (a free port
    added, so that runs side by side do not meet)."""
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    cfg = ["--config_file", "examples/accelerate_config.yaml"]
    return [*launch, *cfg, "--main_process_port", str(free_port()), str(example), *args]


def deepspeed_cmd(args: list[str], example: Path = EXAMPLE) -> list[str]:
    """``deepspeed --num_gpus 2 examples/<example> --deepspeed ...`` (a free port)."""
    launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    ds = ["--deepspeed", "examples/ds_zero2_u2.json"]
    return [*launch, "--master_port", str(free_port()), str(example), *ds, *args]


def losses(out: Path) -> list[float]:
    values = json.loads((out / "train_losses.json").read_text())
    assert len(values) == 3 and all(math.isfinite(x) for x in values), values
    return values


def test_sft_example_under_both_launchers_equals_one_process(assets, tmp_path):
    outs, texts = three_ways(EXAMPLE, lambda out: example_args(assets, out), tmp_path)
    for text in texts[1:]:
        assert "packing row" in text
    ref = losses(outs["ref"])
    assert ref[0] != ref[-1]  # the steps changed the model
    for name in ("accelerate", "deepspeed"):
        got = losses(outs[name])
        torch.testing.assert_close(
            torch.tensor(got),
            torch.tensor(ref),
            rtol=RTOL,
            atol=0,
            msg=lambda m, name=name, got=got: f"{name} {got} != one process {ref}: {m}",
        )
    assert_plain_folder(outs["ref"] / "final", outs["deepspeed"] / "final")


def three_ways(
    example: Path, args_of, tmp_path: Path, launchers: tuple[str, ...] = LAUNCHERS
) -> tuple[dict[str, Path], list[str]]:
    """``example`` (``args_of(output_dir)``: its arguments) in one process (forked from the
    tests' pre-imported process, tests/support/zygote.py, as ``python example ...`` runs it) and
    under each of ``launchers`` (``accelerate launch``, the ``deepspeed`` launcher), side by
    side (also the DPO and GRPO examples' tests): each exits 0 and says which run it is.
    Returns the output folders and outputs, the one-process run's first."""
    outs = {name: tmp_path / name for name in ("ref", *launchers)}
    cmds = {"accelerate": accelerate_cmd, "deepspeed": deepspeed_cmd}
    ref = start_ranks(example, *args_of(outs["ref"]), nproc=1, logs=tmp_path / "logs", name="ref")
    procs = [start(cmds[name](args_of(outs[name]), example)) for name in launchers]
    results = finish(procs, timeout=900)
    wait_ranks([ref], timeout=900)
    results.insert(0, (ref.codes[0], ref.output()))
    for name, (code, text) in zip(outs, results, strict=True):
        assert code == 0, f"{name}: exit {code}\n{text[-6000:]}"
    texts = [text for _, text in results]
    assert "one process (no sequence_parallel block)" in texts[0]
    for text in texts[1:]:  # the block was read: not two data-parallel ranks
        assert "sequence parallel: Ulysses 2 x ring 1, 1 data-parallel replica(s)" in text
    return outs, texts


def assert_same_losses(outs: dict[str, Path]) -> None:
    """The runs of :func:`three_ways` wrote 3 finite training losses each, the launched
    ones equal to the one-process run's within 1e-5 relative, and the steps changed the
    model; the saved folders name no ulysses_cp attention (the DPO and GRPO examples')."""
    got = {name: json.loads((out / "train_losses.json").read_text()) for name, out in outs.items()}
    for name, values in got.items():
        assert len(values) == 3 and all(math.isfinite(x) for x in values), (name, values)
    assert got["ref"][0] != got["ref"][-1]
    for name in set(outs) - {"ref"}:
        torch.testing.assert_close(
            torch.tensor(got[name]), torch.tensor(got["ref"]), rtol=1e-5, atol=1e-6
        )
        assert "ulysses" not in (outs[name] / "final" / "config.json").read_text()


def assert_plain_folder(ref_dir: Path, sp_dir: Path) -> None:
    """The SP run's ``final`` folder loads in plain transformers (model and tokenizer) and
    gives the reference's logits."""
    import transformers

    assert "ulysses" not in (sp_dir / "config.json").read_text()
    tok = transformers.AutoTokenizer.from_pretrained(sp_dir)
    chat = [{"role": "user", "content": "w7 w8 w9"}, {"role": "assistant", "content": "w10"}]
    ids = tok.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        for d in (ref_dir, sp_dir)
    ]
    with torch.no_grad():
        ref_logits, sp_logits = (m(input_ids=ids).logits for m in models)
    torch.testing.assert_close(sp_logits, ref_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (None, "no such file"),
        ('{"text": "w7 w8"}', 'line 2: no "messages" list'),
        ('{"messages": [{"role": "user"}]}', 'line 2: message 0 must have string "role"'),
        ("{not json", "line 2: not JSON"),
    ],
)
def test_sft_example_bad_data_is_refused(assets, tmp_path, line, message):
    assert_bad_data_refused(EXAMPLE, example_args(assets, tmp_path / "out"), line, message)


def assert_bad_data_refused(example: Path, args: list[str], line: str | None, message: str):
    """``example`` with its ``--data`` file cut to its first line and ``line`` after it
    (``line`` None: the file removed) stops with ``message`` and no traceback (also the
    TRL examples' tests)."""
    i = args.index("--data") + 1
    good, data = Path(args[i]), Path(args[args.index("--output_dir") + 1]).with_suffix(".jsonl")
    if line is not None:
        first = good.read_text().splitlines()[0]
        data.write_text(f"{first}\n{line}\n")
    args = [*args[:i], str(data), *args[i + 1 :]]
    out = run([sys.executable, str(example), *args], ok=False)
    assert message in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
