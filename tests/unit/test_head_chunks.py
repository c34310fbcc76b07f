"""Head-chunked Ulysses: exact in every mode for every chunk count that works, the same
bytes as one chunk, the next chunk's all-to-all posted before the current chunk computes
(forward), one output gradient at a time (backward), less staging memory, and checks.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_head_chunks.py.
"""

from __future__ import annotations

import pytest

import ulysses_cp as ucp
from ulysses_cp.core.options import RunOptions
from ulysses_cp.modes.ulysses import head_chunk_choices, resolve_head_chunks
from ulysses_cp.training.engine import run_options


def test_choices_follow_the_heads_per_rank():
    assert head_chunk_choices(8, 8, 2) == [1, 2, 4]  # 4 q and 4 kv heads per rank
    assert head_chunk_choices(8, 4, 4) == [1, 2]  # 2 q heads, 1 kv head per rank
    assert head_chunk_choices(8, 2, 4) == [1, 2]  # kv replicated to 1 per rank
    assert head_chunk_choices(16, 4, 2) == [1, 2, 4, 8]  # 2 kv heads: c | 2 or 2 | c
    assert head_chunk_choices(12, 6, 2) == [1, 3, 6]  # 6 q, 3 kv per rank: not 2
    assert head_chunk_choices(4, 1, 4) == [1]
    # hybrid: every chunk's ring moves its own kv heads (2 per rank here, or 1)
    assert head_chunk_choices(16, 4, 2, ring=True) == [1, 2]
    assert head_chunk_choices(8, 2, 4, ring=True) == [1]


def test_automatic_rule_and_errors():
    assert resolve_head_chunks(0, 8, 4, 4) == 1  # automatic, size unknown: one chunk
    assert resolve_head_chunks(2, 8, 4, 4) == 2
    assert resolve_head_chunks(3, 12, 6, 2) == 3
    with pytest.raises(ValueError, match=r"head_chunks=4 .*use one of \[1, 2\]"):
        resolve_head_chunks(4, 8, 4, 4)
    with pytest.raises(ValueError, match=r"with a ring inside .*use one of \[1\]"):
        resolve_head_chunks(2, 8, 2, 4, ring=True)
    with pytest.raises(ValueError, match="head_chunks must be an integer >= 0"):
        RunOptions(head_chunks=-1)


def test_config_sets_the_runs_chunk_count():
    cfg = {"sequence_parallel": {"ulysses_degree": 1, "head_chunks": 4}}
    assert run_options(ucp.RunConfig.load(cfg)).head_chunks == 4
    with pytest.raises(ValueError, match="head_chunks must be an integer >= 0"):
        ucp.RunConfig.load({"sequence_parallel": {"head_chunks": -2}})
