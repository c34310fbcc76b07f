"""KV inside a ring group by all-gather (``kv_exchange="allgather"``): exact in every ring
mode, both layouts, packed rows and windows, and its bytes equal their formulas.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_kv_exchange.py.
"""

from __future__ import annotations

import pytest

import ulysses_cp as ucp
from ulysses_cp.core.options import RunOptions
from ulysses_cp.training.engine import run_options


def test_unknown_exchange_is_refused():
    with pytest.raises(ValueError, match="kv_exchange 'broadcast' is not one of"):
        RunOptions(kv_exchange="broadcast")
    cfg = {"sequence_parallel": {"kv_exchange": "allgather"}, "train_batch_size": 1}
    assert run_options(ucp.RunConfig.load(cfg)).kv_exchange == "allgather"
