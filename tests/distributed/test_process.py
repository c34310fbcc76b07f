"""The process a run lives in (ulysses_cp.core.process): each CPU rank's thread count, the
user's OMP_NUM_THREADS winning over it; a process no launcher started is a world of one.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_process.py.
"""

from __future__ import annotations

from tests.unit.test_process import _more_threads, _threads


def test_pool_ranks_run_every_task_on_one_thread(pools):
    """The test harness: a task that raised a rank's thread count leaves the next task on
    one thread (4 ranks x 2 threads on 2 cores made the planner's tests 6x slower)."""
    pools(2).run(_more_threads)
    assert pools(2).run(_threads) == [(1, "1")] * 2
