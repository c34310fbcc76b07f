"""What the planner ranks by (``--goal longest|fastest``): the order under each goal on
constructed candidates, the two goals choosing different candidates of one config, the
``goal`` key of the JSON, the table's "ranked by" line and its numbers against the config
as written, and the error for an unknown goal."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import ROOT, small_bucket_config
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import main, plan
from ulysses_cp.plan.ranking import SETTINGS, rank, versus
from ulysses_cp.plan.search import Hardware

CFG = str(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json")
# 20 MiB per GPU: some candidates do not fit the config's 512 tokens
SMALL = ["--world", "4", "--gpus-per-node", "2", "--gpu-mem-gb", "0.02", "--seq-step", "16"]


def _cand(name: str, fits: bool, max_seq_len: int, step: float) -> dict:
    return {"name": name, "fits": fits, "max_seq_len": max_seq_len, "predicted_step_s": step}


def test_rank_orders_by_the_goal():
    """Fast but short, slow but long, a tie on length broken by the step, a tie on the step
    broken by length, and one that does not fit (last under both goals, however long)."""
    cands = [
        _cand("fast", True, 1000, 1.0),
        _cand("fast_longer", True, 2000, 1.0),
        _cand("long_slow", True, 9000, 3.0),
        _cand("long_quicker", True, 9000, 2.0),
        _cand("unfit", False, 99999, 0.5),
    ]
    longest = [c["name"] for c in rank(cands, "longest")]
    fastest = [c["name"] for c in rank(cands, "fastest")]
    assert longest == ["long_quicker", "long_slow", "fast_longer", "fast", "unfit"]
    assert fastest == ["fast_longer", "fast", "long_quicker", "long_slow", "unfit"]
    with pytest.raises(ValueError, match="choose one of longest, fastest"):
        rank(cands, "shortest")


def test_the_two_goals_choose_different_candidates(tmp_path, capsys):
    """The tiny config on 4 x 20 MiB: the default goal chooses the candidate that fits the
    longest sequence, ``fastest`` the one with the shortest predicted step, and they differ;
    the JSON says which goal ranked, the table says it and puts the chosen against the
    config as written in numbers."""
    got, printed = {}, {}
    cfg = small_bucket_config(CFG, tmp_path)
    for goal in ("longest", "fastest"):
        out = tmp_path / f"{goal}.json"
        args = ["--deepspeed_config", cfg, *SMALL, "--json", str(out)]
        main(args if goal == "longest" else [*args, "--goal", goal])  # longest: the default
        got[goal], printed[goal] = json.loads(out.read_text()), capsys.readouterr().out
    for goal, result in got.items():
        assert result["goal"] == goal
        assert f"ranked by {result['ranked_by']} (--goal {goal}):" in printed[goal]
        fit = [c for c in result["candidates"] if c["fits"]]
        assert fit and len(fit) < len(result["candidates"])
        assert result["chosen"] == fit[0] and not result["chosen_is_config"]
        c, w = result["chosen"], result["config"]
        assert (
            f"it fits {c['max_seq_len']:,} tokens where the config as written fits "
            f"{w['max_seq_len']:,}; predicted step at seq_len 512: "
            f"{c['predicted_step_s']:.3g} s, as written {w['predicted_step_s']:.3g} s"
        ) in printed[goal]
    longest, fastest = got["longest"]["chosen"], got["fastest"]["chosen"]
    fit = [c for c in got["longest"]["candidates"] if c["fits"]]
    assert longest["max_seq_len"] == max(c["max_seq_len"] for c in fit)
    assert fastest["predicted_step_s"] == min(c["predicted_step_s"] for c in fit)
    assert longest["max_seq_len"] > fastest["max_seq_len"]
    assert longest["predicted_step_s"] > fastest["predicted_step_s"]
    assert [longest[k] for k in SETTINGS] != [fastest[k] for k in SETTINGS]


def test_the_table_says_when_the_config_as_written_is_chosen():
    written = {k: 1 for k in SETTINGS} | {"max_seq_len": 7_836_672, "predicted_step_s": 26.6}
    result = {"config": written, "chosen": dict(written), "goal": "longest"}
    assert versus(result) == ["chosen (--goal longest): the config as written, 7,836,672 tokens"]
    assert versus({**result, "chosen": None}) == []


def test_an_unknown_goal_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--deepspeed_config", CFG, *SMALL, "--goal", "shortest"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--goal: invalid choice: 'shortest'" in err and "'longest', 'fastest'" in err, err
    with pytest.raises(ValueError, match="--goal 'shortest': choose one of longest, fastest"):
        plan(RunConfig.load(CFG), world=4, hw=Hardware(), goal="shortest")
