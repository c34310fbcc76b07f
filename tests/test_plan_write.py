"""``python -m ulysses_cp.plan ... --write-config OUT.json``: the config as written with
the chosen plan's settings; planned again, the written config is the plan it was chosen
as (the same longest sequence); ``train.py`` trains with it as it is; when no plan fits,
nothing is written and the error says why."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, launch, metrics
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import main, plan
from ulysses_cp.plan.search import Hardware
from ulysses_cp.plan.write import MODEL, SEQUENCE_PARALLEL

CFG = str(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json")
# 20 MiB per GPU: the config as written is not the longest plan (test_plan_goal.py)
SMALL = ["--world", "4", "--gpus-per-node", "2", "--gpu-mem-gb", "0.02", "--seq-step", "16"]


def _write(tmp_path, capsys) -> tuple[dict, dict]:
    out = tmp_path / "planned.json"
    result = main(["--deepspeed_config", CFG, *SMALL, "--write-config", str(out)])
    assert f"config: {out}: the chosen plan" in capsys.readouterr().out
    return result, json.loads(out.read_text())


def test_the_written_config_holds_the_chosen_plan(tmp_path, capsys):
    result, written = _write(tmp_path, capsys)
    chosen = result["chosen"]
    assert not result["chosen_is_config"]  # something to write
    for key in SEQUENCE_PARALLEL:
        assert written["sequence_parallel"][key] == chosen[key], key
    for key in MODEL:
        assert written["model"][key] == chosen[key], key
    assert written["zero_optimization"]["stage"] == chosen["zero_stage"]
    raw = json.loads((ROOT / "configs" / "tiny_cpu_zero2_u2r2.json").read_text())
    assert written["data"] == {**raw["data"], **written["data"]}  # the rest as written
    # planned again: the config as written is now the chosen plan
    hw = Hardware(gpu_mem_gb=0.02, gpus_per_node=2)
    again = plan(RunConfig.load(written), world=4, hw=hw, seq_step=16)
    assert again["config"]["max_seq_len"] == chosen["max_seq_len"]
    assert again["chosen_is_config"]


def test_nothing_is_written_when_no_plan_fits(tmp_path, capsys):
    out = tmp_path / "planned.json"
    tiny = [*SMALL[:-3], "0.0001", *SMALL[-2:]]  # 100 KiB per GPU
    with pytest.raises(SystemExit) as stop:
        main(["--deepspeed_config", CFG, *tiny, "--write-config", str(out)])
    assert stop.value.code == 2
    assert "no plan fits" in capsys.readouterr().err and not out.exists()


@pytest.mark.launcher
def test_train_py_trains_with_the_written_config(tmp_path, capsys):
    """The written file as it is (``--max_steps 2``): it trains on 4 ranks."""
    _write(tmp_path, capsys)
    launch(tmp_path / "planned.json", tmp_path / "run", "--max_steps", "2", num_gpus=4)
    steps = [m["step"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps and steps[-1] == 2, steps
