"""Test programs started from a process that has already imported the heavy packages.

Each rank of a Trainer, DPO or GRPO test run used to be a fresh ``python`` under torchrun:
every one imported torch, transformers, TRL, DeepSpeed and wandb again, 8 s of CPU per
process, about half the CPU of such a test on this 2-core machine. Here the ranks are forked
from multiprocessing's fork server, which imports those packages once per pytest session
(``PRELOAD``), so a rank starts with them loaded and in a clean state (nothing ran yet).

:func:`start_ranks` sets what torchrun sets for its workers (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, one thread) and runs
the script as ``__main__`` with its arguments; each rank's output goes to a log file. As
torchrun does, when one rank fails the others are stopped. The launchers themselves
(torchrun, ``deepspeed``, ``accelerate launch``) keep their own tests
(test_examples_*.py, test_train.py, test_multinode.py).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # as tests.support.helpers has it (no import: a cycle)

PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "transformers",
    "datasets",
    "accelerate",
    "peft",
    "trl",
    "wandb",
    "ulysses_cp",
    "tests.support.zygote_warm",  # the lazy names' modules, DeepSpeed's inductor import, gc
]

# the environment the server (and so every rank) starts from: what torchrun gives its
# workers and what tests.support.helpers.start gives a program
BASE_ENV = {
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
}

_context = None


def context():
    """The fork-server context, its server started with ``PRELOAD`` imported (once)."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.update(BASE_ENV)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = ctx
    return _context


def _rank_main(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked rank: output to ``log``, the rank's environment, ``script`` as
    ``__main__``, then the exit handlers a normal interpreter exit runs (wandb's)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script` has it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


@dataclass
class Ranks:
    """The processes of one run started by :func:`start_ranks`."""

    procs: list
    logs: list[Path]
    name: str = ""
    codes: list = field(default_factory=list)

    def handles(self) -> list[Rank]:
        """Each rank alone, to signal, kill or wait for (:func:`finish_each`)."""
        return [Rank(p, log) for p, log in zip(self.procs, self.logs, strict=True)]

    def output(self) -> str:
        parts = []
        for rank, log in enumerate(self.logs):
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {self.name} rank {rank} ---\n{text}")
        return "\n".join(parts)


@dataclass
class Rank:
    """One rank of :func:`start_ranks`, handled like a ``subprocess.Popen``."""

    proc: Any
    log: Path

    def kill(self) -> None:
        self.proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


def finish_each(ranks: list[Rank], timeout: float = 600) -> list[tuple[int, str]]:
    """``(exit code, output)`` of each rank, in order (a signal's exit code is minus its
    number, as ``Popen``'s); one that outlives ``timeout`` (from this call) is killed and
    raises ``AssertionError``."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for r in ranks:
            r.proc.join(max(1.0, deadline - time.monotonic()))
            text = r.log.read_text(errors="replace") if r.log.exists() else ""
            if r.proc.exitcode is None:
                raise AssertionError(f"{r.log.name}: did not exit within {timeout} s\n{text}")
            results.append((r.proc.exitcode, text))
    finally:
        for r in ranks:
            if r.proc.exitcode is None:
                r.proc.kill()
                r.proc.join(5)
    return results


def start_ranks(
    script: Path,
    *args: str,
    nproc: int,
    logs: Path,
    env: dict | None = None,
    name: str = "",
    launcher: str = "torchrun",
) -> Ranks:
    """``nproc`` ranks of ``script``, each logging to ``logs/<name>_rank<r>.log``, in the
    environment ``launcher`` gives its ranks: ``"torchrun"`` (none for a one-process run)
    or ``"deepspeed"`` (also ``LOCAL_SIZE`` and ``--local_rank=<r>`` before ``args``)."""
    from tests.support.helpers import free_port

    ctx = context()
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, **BASE_ENV, **(env or {})}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    port = str(free_port())
    procs, paths = [], []
    for rank in range(nproc):
        rank_env, argv = dict(base), list(args)
        if nproc > 1 or launcher == "deepspeed":
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        if launcher == "deepspeed":
            rank_env.update(LOCAL_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1")
            argv = [f"--local_rank={rank}", *argv]
        elif nproc > 1:
            rank_env.update(GROUP_RANK="0", LOCAL_WORLD_SIZE=str(nproc))
        path = logs / f"{name or Path(script).stem}_rank{rank}.log"
        proc = ctx.Process(target=_rank_main, args=(str(script), argv, rank_env, str(path)))
        proc.start()
        procs.append(proc)
        paths.append(path)
    return Ranks(procs, paths, name=name)


def wait_ranks(runs: list[Ranks], timeout: float = 900, grace: float = 20) -> None:
    """Waits for every rank of ``runs`` (their exit codes in ``run.codes``); when one
    fails, the others of its run get ``grace`` seconds and are then killed, as torchrun
    and DeepSpeed's launcher stop a run. Raises ``AssertionError`` with every rank's
    output when the runs outlive ``timeout``."""
    deadline = time.monotonic() + timeout
    failed_at: dict[int, float] = {}
    while True:
        alive = False
        for i, run in enumerate(runs):
            codes = [p.exitcode for p in run.procs]
            if any(c not in (None, 0) for c in codes) and i not in failed_at:
                failed_at[i] = time.monotonic()
            if i in failed_at and time.monotonic() - failed_at[i] > grace:
                _kill(run)
            alive = alive or any(c is None for c in codes)
        if not alive:
            break
        if time.monotonic() > deadline:
            for run in runs:
                _kill(run)
            text = "\n".join(r.output()[-4000:] for r in runs)
            raise AssertionError(f"ranks did not exit within {timeout} s:\n{text}")
        time.sleep(0.1)
    for run in runs:
        for p in run.procs:
            p.join()
        run.codes = [p.exitcode for p in run.procs]


def _kill(run: Ranks) -> None:
    for p in run.procs:
        if p.exitcode is None:
            p.kill()
            p.join(5)


def finish_ranks(runs: list[Ranks], timeout: float = 900) -> None:
    """:func:`wait_ranks`, then ``AssertionError`` with the output of each run that had a
    rank exit with a code other than 0."""
    wait_ranks(runs, timeout)
    bad = [r for r in runs if any(c != 0 for c in r.codes)]
    if bad:
        text = "\n".join(f"exit codes {r.codes}\n{r.output()[-6000:]}" for r in bad)
        raise AssertionError(text)
