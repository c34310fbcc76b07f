"""wandb trouble never stops training; metrics.jsonl survives resumes."""

from __future__ import annotations

import json
import sys
import types

from ulysses_cp.training.tracking import Tracker

WANDB_ON = {"wandb": {"enabled": True, "project": "p"}}


class FakeRun:
    def __init__(self, fail_log=False, id="run1"):
        self.logged, self.fail_log, self.summary, self.id = [], fail_log, {}, id

    def log(self, metrics, step):
        if self.fail_log:
            raise ConnectionError("network unreachable")
        self.logged.append((step, metrics))

    def finish(self):
        pass


def fake_wandb(monkeypatch, init):
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))


def tracker(tmp_path, **kw):
    args = dict(output_dir=tmp_path, config=WANDB_ON, topo_info={}, is_main=True, resume=False)
    return Tracker(**{**args, **kw})


def test_wandb_not_installed_means_tracking_off(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    t = tracker(tmp_path)
    assert t.run is None
    t.log(1, {"loss": 1.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_unreachable_server_falls_back_to_offline(tmp_path, monkeypatch):
    modes = []

    def init(**kw):
        modes.append(kw.get("mode"))
        if kw.get("mode") != "offline":
            raise ConnectionError("cannot reach api.wandb.ai")
        return FakeRun()

    fake_wandb(monkeypatch, init)
    t = tracker(tmp_path)
    assert modes == [None, "offline"] and isinstance(t.run, FakeRun)
    t.log(3, {"loss": 2.0})
    assert t.run.logged == [(3, {"loss": 2.0})]


def test_offline_failing_too_means_tracking_off(tmp_path, monkeypatch):
    def init(**kw):
        raise RuntimeError("no disk")

    fake_wandb(monkeypatch, init)
    assert tracker(tmp_path).run is None


def test_log_failure_mid_run_turns_tracking_off(tmp_path, monkeypatch):
    fake_wandb(monkeypatch, lambda **kw: FakeRun(fail_log=True))
    t = tracker(tmp_path)
    t.log(1, {"loss": 1.0})  # must not raise
    assert t.run is None
    t.log(2, {"loss": 0.5})
    t.finish({})
    steps = [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    t = tracker(tmp_path, config={})
    for step in (1, 2, 3):
        t.log(step, {"loss": float(step)})
    t2 = tracker(tmp_path, config={}, resume=True, start_step=2)
    t2.log(3, {"loss": 9.0})
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 9.0)]


def test_resume_continues_the_checkpoints_wandb_run(tmp_path, monkeypatch):
    """The run's id goes into checkpoint meta; run_id= opens that run again."""
    calls = []

    def init(**kw):
        calls.append(kw)
        return FakeRun(id=kw.get("id") or "fresh")

    fake_wandb(monkeypatch, init)
    assert tracker(tmp_path).checkpoint_meta() == {"wandb_run_id": "fresh"}
    again = tracker(tmp_path, resume=True, run_id="fresh")
    assert calls[-1]["id"] == "fresh" and calls[-1]["resume"] == "allow"
    assert again.checkpoint_meta() == {"wandb_run_id": "fresh"}
    assert tracker(tmp_path, config={}).checkpoint_meta() == {}  # wandb off: nothing kept
