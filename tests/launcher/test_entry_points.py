"""The package's entry points as a user starts them: ``deepspeed --module
ulysses_cp.train`` trains as ``train.py`` does (the repository's shim), and the
console scripts (``ulysses-cp-train``, ``ulysses-cp-plan``, ``ulysses-cp-check``) and
``python -m ulysses_cp.train`` run the package's code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support import zygote
from tests.support.helpers import (
    LAUNCH,
    ROOT,
    TRAIN,
    deepspeed_cmd,
    finish,
    free_port,
    metrics,
    run,
    run_config,
    start,
    write_config,
)
from ulysses_cp.core.process import cpu_threads

pytestmark = pytest.mark.launcher

CONFIG = ROOT / "configs" / "tiny_cpu_zero3_u2r1.json"
BIN = Path(sys.executable).parent

# what a launcher leaves in its ranks' environment, and a user's hand-made rendezvous:
# none of it in the one-process runs below
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)
ENTRY_POINTS = pytest.mark.parametrize(
    "command",
    [[str(BIN / "ulysses-cp-train")], [sys.executable, "-m", "ulysses_cp.train"]],
    ids=["console-script", "python-m"],
)


def test_deepspeed_module_launch_trains_as_the_shim(tmp_path):
    """``deepspeed --module ulysses_cp.train`` and ``train.py`` (its ranks as the launcher
    starts them, forked by tests/support/zygote.py), side by side on 2 CPU ranks: the same losses,
    step for step."""
    outs = {name: tmp_path / name for name in ("module", "shim")}
    module = ("--num_gpus", "2", "--master_port", str(free_port()), "--module")
    as_module = deepspeed_cmd(
        CONFIG, outs["module"], "--max_steps", "3", launcher=module, script=Path("ulysses_cp.train")
    )
    procs = [start(as_module)]
    shim_args = ("--deepspeed_config", str(CONFIG), "--output_dir", str(outs["shim"]))
    shim = zygote.start_ranks(
        TRAIN, *shim_args, "--max_steps", "3", nproc=2, logs=tmp_path / "logs", launcher="deepspeed"
    )
    # each CPU rank's threads: this machine's cores over the 2 local ranks, logged once
    threads = cpu_threads({**os.environ, "LOCAL_WORLD_SIZE": "2"})
    line = "(OMP_NUM_THREADS)" if threads is None else f"CPU threads: {threads} per rank ("
    results = finish(procs, timeout=600)
    zygote.wait_ranks([shim], timeout=600)
    results += [(max(shim.codes, key=abs), shim.output())]
    for code, text in results:
        assert code == 0, text[-4000:]
        assert text.count(line) == 1, text[-4000:]
    # the config logs every 10 steps: here, at the run's end (step 3)
    got = {
        name: [(m["step"], m["loss"]) for m in metrics(out) if "loss" in m]
        for name, out in outs.items()
    }
    assert got["shim"] and got["shim"][-1][0] == 3
    assert got["module"] == got["shim"]


def typo_config(tmp_path: Path) -> Path:
    cfg = json.loads(CONFIG.read_text())
    cfg["trainng"] = cfg.pop("training", {})
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(cfg))
    return path


@ENTRY_POINTS
def test_train_entry_points_report_a_config_typo(tmp_path, command):
    """A misspelt top-level key: one line naming the key and the right spelling, exit 2."""
    config = str(typo_config(tmp_path))
    cmd = [*command, "--deepspeed_config", config, "--output_dir", str(tmp_path / "out")]
    out = run(cmd, ok=False)
    assert "unknown top-level key(s)" in out and "did you mean 'training'" in out, out[-2000:]
    assert "Traceback" not in out


def test_one_process_trains_without_a_launcher(tmp_path, monkeypatch):
    """``ulysses-cp-train`` with a 1 x 1 config and no launcher in the environment: the
    process makes itself a world of one and trains (it stopped on DeepSpeed's MPI search,
    ``No module named 'mpi4py'``). ``python -m ulysses_cp.train`` runs the same
    ``run_main`` (the typo and launcher tests run both entry points): one training run."""
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    training = {"max_steps": 5, "log_interval": 1}
    config = write_config(tmp_path, run_config(1, 1, **LAUNCH, training=training))
    out = tmp_path / "out"
    cmd = [str(BIN / "ulysses-cp-train"), "--deepspeed_config", str(config), "--output_dir"]
    text = run([*cmd, str(out), "--max_steps", "2"])
    assert "world_size': 1" in text, text[-3000:]
    steps = [m["step"] for m in metrics(out) if "loss" in m]
    assert steps == [1, 2], text[-3000:]


@ENTRY_POINTS
def test_one_process_asks_for_a_launcher(tmp_path, monkeypatch, command):
    """A u2 x r2 config in one process without a launcher: one line naming the 4 ranks it
    needs, the world of 1 and the launch commands, exit code 2, no traceback (a DeepSpeed
    traceback hid the sizes)."""
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    config = ROOT / "configs" / "tiny_cpu_zero2_u2r2.json"
    cmd = [*command, "--deepspeed_config", str(config), "--output_dir", str(tmp_path / "out")]
    code, text = finish([start(cmd)], timeout=600)[0]
    assert code == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = text.strip().splitlines()
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith("error: ulysses_degree(2) x ring_degree(2) = 4 ranks")
    assert "WORLD_SIZE(1)" in lines[0]
    assert "deepspeed --num_gpus 4 --module ulysses_cp.train" in lines[0]
    assert "torchrun --nproc-per-node 4 -m ulysses_cp.train" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("script", "usage"),
    [
        ("ulysses-cp-plan", "--deepspeed_config"),
        ("ulysses-cp-check", "--world"),
        ("ulysses-cp-train", "--deepspeed_config"),
    ],
)
def test_console_scripts_are_installed(script, usage):
    """Each script's help names it as typed (the planner's said ``python -m
    ulysses_cp.plan``)."""
    text = run([str(BIN / script), "--help"])
    assert text.startswith(f"usage: {script} ") and usage in text, text[:300]


def test_python_m_help_names_the_module():
    """``python -m ulysses_cp.train --help`` (argparse alone would say ``train.py``; the
    unit tier checks every entry point's name, tests/unit/test_commands.py)."""
    text = run([sys.executable, "-m", "ulysses_cp.train", "--help"])
    assert text.startswith("usage: python -m ulysses_cp.train "), text[:300]


def test_a_config_typo_under_the_launcher_stops_every_rank(tmp_path):
    """``deepspeed --num_gpus 4 train.py`` with a misspelt key: the line naming it and the
    right spelling, and the launcher's non-zero exit (every rank exits 2 before importing
    torch: see the next test)."""
    cmd = deepspeed_cmd(typo_config(tmp_path), tmp_path / "out", num_gpus=4)
    out = run(cmd, ok=False)
    assert "unknown top-level key(s)" in out and "did you mean 'training'" in out, out[-2000:]
    assert "exits with return code = 2" in out, out[-2000:]
    assert "Traceback" not in out


def test_the_config_check_imports_no_torch(tmp_path):
    """The entry point checks the JSON before importing torch or DeepSpeed (a typo costs
    the time Python takes to start): ``python -X importtime`` lists every module imported
    before the error."""
    cmd = [sys.executable, "-X", "importtime", "-m", "ulysses_cp.train"]
    out = run([*cmd, "--deepspeed_config", str(typo_config(tmp_path))], ok=False)
    assert "did you mean 'training'" in out, out[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.splitlines() if "|" in line}
    assert "ulysses_cp.config" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "deepspeed", "numpy"))
    assert heavy == [], heavy[:10]
