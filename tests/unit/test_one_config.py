"""One door for a run's config: the DeepSpeed settings a run acts on are parsed once, in
:meth:`RunConfig.load` (``ulysses_cp.deepspeed_block``), and read from there; the raw
dict is read only by the parser and handed whole to DeepSpeed, the tracker and the
planner's writer. The Hugging Face Trainer subclasses read their DeepSpeed JSON through
the same function, with train.py's messages (file, line, key, did-you-mean)."""

from __future__ import annotations

import ast
import json

import pytest

from tests.support.helpers import ROOT
from ulysses_cp.config import RunConfig
from ulysses_cp.deepspeed_block import DeepSpeedSettings

pytestmark = pytest.mark.unit

PKG = ROOT / "ulysses_cp"
# the DeepSpeed keys DeepSpeedSettings types: top level, and inside zero_optimization
DEEPSPEED_KEYS = {
    "zero_optimization",
    "bf16",
    "fp16",
    "optimizer",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "stage",
    "reduce_scatter",
    "offload_optimizer",
    "offload_param",
    "reduce_bucket_size",
    "stage3_max_live_parameters",
    "stage3_param_persistence_threshold",
    "zero_hpz_partition_size",
}
# where the raw dict may be read, and how often: the parser, the hand-offs of the whole
# dict (DeepSpeed, the tracker's copy of the file, the planner's writer)
ALLOWED = {
    ("config.py", "RunConfig.block"): 1,  # our block as written, for the run's log
    ("config.py", "RunConfig.without_optimizer"): 1,
    ("training/engine.py", "deepspeed_part"): 1,  # what deepspeed.initialize gets
    ("train.py", "train"): 1,  # the tracker's copy of the file
    # the planner's writer copies the file to set keys in it (run.raw), and its rows and
    # phase dicts share DeepSpeed's key names ("offload_optimizer", "stage")
    ("plan/write.py", "planned_config"): 2,
    ("plan/cli.py", "breakdown"): 1,
    ("plan/phases.py", "deepspeed_peak"): 2,
}
PARSERS = ("deepspeed_block.py",)


def raw_reads(pkg=PKG) -> dict[tuple[str, str], list[int]]:
    """(module, enclosing function) -> lines that read ``X.raw`` or one of
    :data:`DEEPSPEED_KEYS` from a dict (``d.get("key")``, ``d["key"]``)."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        tree = ast.parse(path.read_text())
        owners = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                owners[child] = node

        for node in ast.walk(tree):
            hit = isinstance(node, ast.Attribute) and node.attr == "raw"
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "get" and node.args:
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            if isinstance(key, ast.Constant) and key.value in DEEPSPEED_KEYS:
                hit = True
            if hit:
                found.setdefault((rel, _owner(node, owners)), []).append(node.lineno)
    return found


def _owner(node: ast.AST, owners: dict) -> str:
    """The dotted name of the function (and class) around ``node``."""
    names = []
    while node in owners:
        node = owners[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
    return ".".join(reversed(names)) or "<module>"


def test_the_raw_dict_is_read_only_by_the_parser_and_the_hand_offs():
    reads = raw_reads()
    outside = {
        where: lines
        for where, lines in reads.items()
        if where[0] not in PARSERS
        and not (where[0] == "config.py" and where[1] in ("RunConfig.load", "read_config"))
        and len(lines) > ALLOWED.get(where, 0)
    }
    assert outside == {}, f"read the typed block (run.deepspeed), not the raw dict: {outside}"


def test_the_scanner_sees_a_raw_read(tmp_path):
    """The scan above finds each form of a raw read (so its silence means something)."""
    (tmp_path / "m.py").write_text(
        "def f(run, d):\n"
        "    a = run.raw\n"
        '    b = d.get("zero_optimization") or {}\n'
        '    return b["stage"], d.get("bf16"), d["other"]\n'
    )
    assert raw_reads(tmp_path) == {("m.py", "f"): [2, 3, 4, 4]}


def test_the_settings_are_deepspeeds_keys_parsed_once(tmp_path):
    ds = DeepSpeedSettings.from_dict(
        {
            "zero_optimization": {
                "stage": 3,
                "reduce_scatter": False,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "reduce_bucket_size": "auto",
                "some_new_deepspeed_key": 1,  # DeepSpeed's business, not ours
            },
            "bf16": {"enabled": True},
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": "auto",
        }
    )
    assert (ds.zero_stage, ds.reduce_scatter, ds.offload_optimizer) == (3, False, "cpu")
    assert (ds.offload_param, ds.reduce_bucket_size, ds.dtype) == ("none", None, "bfloat16")
    assert (ds.micro_batch, ds.gradient_accumulation_steps, ds.micro_steps) == (2, None, 1)
    assert DeepSpeedSettings.from_dict({"fp16": {"enabled": True}}).dtype == "float16"
    assert DeepSpeedSettings.from_dict({}) == DeepSpeedSettings()
    for bad, message in (
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage must be a number"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "offload_param.device"),
        ({"zero_optimization": 3}, "zero_optimization must be an object, got 3"),
    ):
        with pytest.raises(ValueError, match=message):
            DeepSpeedSettings.from_dict(bad)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}, indent=2))
    run = RunConfig.load(path)
    assert run.deepspeed.zero_stage == 2
    # from a file, the error names the file and the key's line (4: "stage" in its block)
    path.write_text(json.dumps({"bf16": {}, "zero_optimization": {"stage": "2"}}, indent=2))
    with pytest.raises(ValueError, match=rf"^{path}:4: zero_optimization.stage must be"):
        RunConfig.load(path)


BAD_TRAINER_JSON = """{
  "zero_optimization": {"stage": 2},
  "train_micro_batch_size_per_gpu": "auto",
  "bf16": {"enabled": "auto"},
  "sequence_parallel": {
    "ulysses_degree": 2,
    "rign_degree": 1
  }
}
"""


def test_the_trainer_reports_a_typo_as_train_py_does(tmp_path):
    """A misspelt key in the Trainer's DeepSpeed JSON: the same message as train.py's,
    naming the file, the key's line (7) and the closest valid key."""
    from ulysses_cp.integrations.hf_trainer.run import trainer_config

    path = tmp_path / "ds_config.json"
    path.write_text(BAD_TRAINER_JSON)
    with pytest.raises(ValueError) as trainer:
        trainer_config(str(path))
    with pytest.raises(ValueError) as train_py:
        RunConfig.load(path)
    message = str(trainer.value)
    assert message == str(train_py.value)
    assert message.startswith(f'{path}:7: unknown keys in the "sequence_parallel" block')
    assert "did you mean 'ring_degree' for 'rign_degree'?" in message


def test_the_trainer_reads_its_json_once(tmp_path, monkeypatch):
    """The Trainer's config: the sequence_parallel block, its model block and the DeepSpeed
    settings (``"auto"`` values left to the Trainer), from one read of the file."""
    from pathlib import Path

    from ulysses_cp.integrations.hf_trainer.run import (
        model_block_options,
        sequence_parallel_block,
        trainer_config,
    )

    path = tmp_path / "ds_config.json"
    cfg = json.loads(BAD_TRAINER_JSON.replace("rign_degree", "ring_degree"))
    cfg["model"] = {"lean_norms": False, "memory_budget_gb": 4}
    path.write_text(json.dumps(cfg))
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self))
    run = trainer_config(str(path))
    assert reads == [path]
    assert run is not None and run.deepspeed.dtype == "auto"
    assert run.deepspeed.zero_stage == 2 and run.deepspeed.train_micro_batch_size_per_gpu is None
    assert sequence_parallel_block(run) == {"ulysses_degree": 2, "ring_degree": 1}
    block = model_block_options(run)
    assert (block.lean_norms, block.memory_budget_gb) == (False, 4.0)
    assert run.sequence_parallel.ulysses_degree == 2
