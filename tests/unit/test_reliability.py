"""Bad input is reported on every rank before it can hang; collective failures are named.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_reliability.py.
"""

from __future__ import annotations

import pytest

import ulysses_cp as ucp


def test_sequence_parallel_block_types():
    with pytest.raises(ValueError, match="check_inputs must be true or false"):
        ucp.SequenceParallelConfig.from_dict({"check_inputs": "yes"})
    with pytest.raises(ValueError, match="collective_timeout_s must be a positive"):
        ucp.SequenceParallelConfig.from_dict({"collective_timeout_s": 0})
