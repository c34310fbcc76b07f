"""The contract with FlashAttention-3 (backend "flash_attn3") and FlashAttention-4
("flash_attn4"), pinned on CPU, and the order "auto" tries the backends in.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_flash34_contract.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_flash34_contract import TOL, _modes


@pytest.mark.parametrize("version,name", [("3.0.0", "flash_attn3"), ("4.0.0b27", "flash_attn4")])
def test_every_mode_on_four_ranks_matches_float64(pools, version, name):
    rows = pools(4).run(_modes, version, name)[0]
    assert len(rows) == 12
    for u, r, layout, packed, errs in rows:
        assert max(errs) < TOL, (version, u, r, layout, packed, errs)
