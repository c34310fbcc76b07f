"""The contract with flash-attn 2.6, 2.7 and 2.8, pinned on CPU.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_flash_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_flash_contract import TOL, _host_staged, _modes


@pytest.mark.parametrize(
    "version,wrap", [("2.6.0", "plain"), ("2.7.4", "custom_op"), ("2.8.3", "custom_op")]
)
def test_every_mode_on_four_ranks_matches_float64(pools, version, wrap):
    rows = pools(4).run(_modes, version, wrap)[0]
    assert len(rows) == 12
    for u, r, layout, packed, errs in rows:
        assert max(errs) < TOL[torch.bfloat16], (version, u, r, layout, packed, errs)


def test_gloo_stages_cuda_point_to_point_through_the_host(pools):
    assert pools(2).run(_host_staged) == [(True, False), (True, False)]
