"""``python -m ulysses_cp.plan ... --write-config OUT.json``: the config as written with
the chosen plan's settings; planned again, the written config is the plan it was chosen
as (the same longest sequence); ``train.py`` trains with it as it is; when no plan fits,
nothing is written and the error says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.helpers import ROOT, small_bucket_config
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import main, plan
from ulysses_cp.plan.search import Hardware
from ulysses_cp.plan.written import SETTINGS, row_key
from ulysses_cp.schema import PATH_FIELDS

CFG = str(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json")
# 20 MiB per GPU: the config as written is not the longest plan (test_plan_goal.py)
SMALL = ["--world", "4", "--gpus-per-node", "2", "--gpu-mem-gb", "0.02", "--seq-step", "16"]


def _write(tmp_path, capsys) -> tuple[dict, dict]:
    out = tmp_path / "planned.json"
    cfg = small_bucket_config(CFG, tmp_path / "in", bucket=100_000)
    result = main(["--deepspeed_config", cfg, *SMALL, "--write-config", str(out)])
    assert f"config: {out}: the chosen plan" in capsys.readouterr().out
    return result, json.loads(out.read_text())


def test_the_written_config_holds_the_chosen_plan(tmp_path, capsys):
    result, written = _write(tmp_path, capsys)
    chosen = result["chosen"]
    assert not result["chosen_is_config"]  # something to write
    for name, (block, key, _) in SETTINGS.items():
        assert written[block][key] == chosen[row_key(name)], key
    assert written["zero_optimization"]["stage"] == chosen["zero_stage"]
    assert "engine" not in written  # planned under the config's own engine
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


@pytest.mark.parametrize(
    ("name", "out"),
    [
        ("tiny_cpu_hf_llama_u2r2.json", "configs/planned.json"),  # beside the original
        ("tiny_cpu_hf_llama_u2r2.json", "runs/a/b/planned.json"),  # a new nested folder
        ("tiny_cpu_hf_dataset_u2r2.json", "runs/a/b/planned.json"),  # data, eval, tokenizer
    ],
)
def test_the_written_config_names_the_same_files(tmp_path, monkeypatch, capsys, name, out):
    """``ulysses-cp-plan --deepspeed_config configs/X.json --write-config OUT`` from the
    repository's folder: the written file loads from any folder and names the files the
    original names (``hf_config``, data and eval files, tokenizer), written relative to
    its own folder as the loader reads them (it wrote them relative to the current
    folder: ``configs/configs/hf/tiny_llama.json`` not found)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "configs", repo / "configs")
    monkeypatch.chdir(repo)
    source = Path("configs") / name
    main(["--deepspeed_config", str(source), "--world", "4", "--write-config", out])
    assert f"config: {out}: the chosen plan" in capsys.readouterr().out
    original = RunConfig.load(repo / source).raw
    monkeypatch.chdir(tmp_path)  # elsewhere: the paths are the file's, not the folder's
    loaded = RunConfig.load(repo / out).raw
    as_written = json.loads((repo / out).read_text())
    compared = 0
    for block, key in PATH_FIELDS:
        want = original.get(block, {}).get(key)
        if not isinstance(want, (str, list)):
            continue
        got, text = loaded[block][key], as_written[block][key]
        want, got, text = ([v] if isinstance(v, str) else v for v in (want, got, text))
        assert [Path(v).resolve() for v in got] == [Path(v).resolve() for v in want], key
        assert not any(Path(v).is_absolute() for v in text), (key, text)  # still relative
        compared += 1
    named = json.loads((repo / source).read_text())
    paths = [named.get(block, {}).get(key) for block, key in PATH_FIELDS]
    assert compared == sum(isinstance(p, (str, list)) for p in paths) > 0


def test_absolute_paths_stay_absolute(tmp_path, capsys):
    cfg = json.loads((ROOT / "configs" / "tiny_cpu_hf_llama_u2r2.json").read_text())
    hf = str(ROOT / "configs" / "hf" / "tiny_llama.json")
    cfg["model"]["hf_config"] = hf
    (tmp_path / "src").mkdir()
    source = tmp_path / "src" / "abs.json"
    source.write_text(json.dumps(cfg))
    out = tmp_path / "elsewhere" / "planned.json"
    main(["--deepspeed_config", str(source), "--world", "4", "--write-config", str(out)])
    capsys.readouterr()
    assert json.loads(out.read_text())["model"]["hf_config"] == hf
    assert RunConfig.load(out).raw["model"]["hf_config"] == hf
