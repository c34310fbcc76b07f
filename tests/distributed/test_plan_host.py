"""The planner's host memory (``ulysses_cp/plan/host.py``) against what is really there:
DeepSpeed's offloaded optimizer state, counted tensor by tensor after a step, and the
layer inputs an offloaded checkpoint keeps on CPU.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan_host.py.
"""

from __future__ import annotations

import pytest

from tests.support.helpers import TINY
from tests.unit.test_plan_host import _offloaded_optimizer
from ulysses_cp.plan.host import host_bytes
from ulysses_cp.plan.shapes import model_shape


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_bytes_equal_deepspeeds(pools, stage):
    shape = model_shape(TINY)
    want = host_bytes(shape, zero_stage=stage, world=2, tokens=16, offload_optimizer=True)
    for got in pools(2).run(_offloaded_optimizer, stage):
        assert got == want["optimizer"], (got, want)
        assert want["training"] == got  # nothing else is offloaded in this run
