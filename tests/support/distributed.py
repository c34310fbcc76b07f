"""Multi-process test harness: a pool of N gloo ranks that runs test functions.

Starting processes and gloo costs seconds, so each world size gets one pool per pytest
session (see ``conftest.py``). Each rank: a process forked from the session's fork
server (``tests/support/zygote.py``: torch, transformers and this package already imported),
gloo initialised through a ``file://`` store in a temp dir (no port races), a collective
timeout so a hang fails in seconds, exceptions sent back to pytest with the rank's
traceback, and the process group destroyed in ``finally``. A pool whose ranks failed or
timed out is replaced.

Functions sent to the pool must be importable (module level) and take ``rank`` first.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import traceback
from datetime import timedelta

from tests.support.zygote import BASE_ENV, context

COLLECTIVE_TIMEOUT_S = 60
RESULT_TIMEOUT_S = 300


class WorkerError(RuntimeError):
    """A rank raised; carries every failing rank's traceback."""


def _worker(rank: int, world_size: int, init_file: str, tasks, results, env: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)  # the test session's, not the fork server's
    # one thread per rank, as the zygote's ranks (torchrun's workers): the code under test
    # (the Trainer's run, train.py) then leaves the count alone, as for a user's choice;
    # each task starts on it (below)
    os.environ["OMP_NUM_THREADS"] = BASE_ENV["OMP_NUM_THREADS"]
    os.environ.setdefault("WANDB_MODE", "disabled")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            # a task that set more threads must not slow the next ones: 4 ranks x 2
            # threads on 2 cores made a later test 6x slower
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            try:
                results.put((rank, True, fn(rank, *args, **kwargs)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistPool:
    """``pool.run(fn, *args)`` runs ``fn(rank, *args)`` on every rank, returns per-rank
    results (index = rank) or raises :class:`WorkerError`."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = context()
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world_size, init_file, self._tasks[r], self._results, dict(os.environ)),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.healthy = True

    def run(self, fn, *args, timeout: float = RESULT_TIMEOUT_S, **kwargs) -> list:
        if not self.healthy:
            raise RuntimeError("pool is broken; get a new one from the fixture")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: list = [None] * self.world_size
        errors: dict[int, str] = {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.healthy = False
                self.close()
                raise WorkerError(
                    f"{fn.__name__}: no result within {timeout}s (hang?) ; errors so far: {errors}"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors:
            self.healthy = False  # ranks may be out of step in their collectives
            self.close()
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorkerError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{text}")
        return out

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(ValueError, OSError):
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()
