"""Test tiers and the shared process pools.

Every test belongs to exactly one tier, and the tier is its folder (tests/README.md):

- ``tests/unit``: starts no process. A guard fails a unit test that starts one (a
  ``multiprocessing`` process, a subprocess, a fork), naming the tiers to choose from.
- ``tests/distributed``: runs on the process pool (:class:`tests.support.distributed.DistPool`,
  the ``pools`` fixture) or starts worker processes of its own (marked in the file).
- ``tests/launcher``: runs programs as a user would (``deepspeed``/``torchrun`` launches,
  scripts, ``python -m``), marked in the file.

The folder adds the tier's marker (``-m unit`` and the others select by folder). A test whose
own markers say another tier (a ``distributed`` or ``launcher`` marker, or the ``pools``
fixture; none of them means unit) fails collection, naming the folder to move it to.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.distributed import DistPool

os.environ.setdefault("WANDB_MODE", "disabled")
# The tests' tensors are tiny: one thread per process (as in the pool's ranks). OpenMP's
# worker threads only wait on each other there, and with other processes on the machine
# a 48-token einsum took 8 ms on 2 threads against 0.5 ms on one.
torch.set_num_threads(1)

TIERS = ("unit", "distributed", "launcher")
HERE = Path(__file__).resolve().parent


def tier_of(item: pytest.Item) -> str:
    """The tier a test's own markers say: its marker, the pool fixture, else unit."""
    marked = [t for t in ("distributed", "launcher") if item.get_closest_marker(t)]
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid}: marked {marked}; a test has one tier")
    if marked:
        return marked[0]
    return "distributed" if "pools" in getattr(item, "fixturenames", ()) else "unit"


def folder_of(item: pytest.Item) -> str | None:
    """The tier folder a test's file is in (tests/<tier>/...), or None outside them."""
    parts = item.path.relative_to(HERE).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def misplaced(item: pytest.Item) -> str | None:
    """Why a test is in the wrong folder, naming the one to move it to; None when it is not."""
    folder, tier = folder_of(item), tier_of(item)
    if folder == tier:
        return None
    where = f"tests/{folder}/" if folder else "tests/ (no tier folder)"
    return (
        f"{item.nodeid}: its markers say the {tier} tier, but it is in {where}; "
        f"move it to tests/{tier}/ (tests/README.md)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [why for item in items if (why := misplaced(item))]
    if wrong:
        raise pytest.UsageError("tests in the wrong tier folder:\n" + "\n".join(wrong))
    for item in items:
        item.add_marker(tier_of(item))


class ProcessStarted(RuntimeError):
    """A unit-tier test started a process."""


def _refuse(what: str):
    def start(*args, **kwargs):
        raise ProcessStarted(
            f"a unit test started {what}; unit tests start no process: mark the test "
            f"@pytest.mark.distributed (a process pool) or @pytest.mark.launcher (a program "
            f"run as a user would), or take the process out of it"
        )

    return start


_STARTS = [
    (multiprocessing.process.BaseProcess, "start", "a multiprocessing process"),
    (subprocess.Popen, "__init__", "a subprocess"),
    (os, "fork", "a fork"),
    (os, "posix_spawn", "a spawned process"),
    (os, "system", "a shell"),
]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The guard: while a unit test runs (its fixtures' setup and teardown included),
    starting a process raises :class:`ProcessStarted`."""
    torch.set_num_threads(1)  # a test that set more (the Trainer's run) leaves none behind
    if item.get_closest_marker("unit") is None:
        return (yield)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _STARTS]
    for owner, name, what in _STARTS:
        setattr(owner, name, _refuse(what))
    try:
        return (yield)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` returns a healthy pool of n gloo ranks, shared across the session."""
    live: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        pool = live.get(world_size)
        if pool is None or not pool.healthy:
            pool = live[world_size] = DistPool(world_size)
        return pool

    yield get
    for pool in live.values():
        pool.close()
