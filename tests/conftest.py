import os

import pytest

from tests.distributed import DistPool

os.environ.setdefault("WANDB_MODE", "disabled")


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
