"""``redo_all_to_all``: Ulysses and hybrid attention that redo the all-to-alls in the
backward instead of keeping head-sharded copies. Exact against float64 in every mode,
layout, chunk count and GQA shape; 1.5x the all-to-all bytes; no head-sharded copies
saved for backward; the option checked where it is set and across ranks. And
the automatic head-chunk rule.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_redo.py.
"""

from __future__ import annotations

import pytest

import ulysses_cp as ucp
from ulysses_cp.core.options import RunOptions
from ulysses_cp.modes.ulysses import MIN_CHUNK_BYTES, resolve_head_chunks
from ulysses_cp.training.engine import run_options


def test_the_option_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match=r"redo_all_to_all must be true or false, got 'yes'"):
        RunOptions(redo_all_to_all="yes")
    with pytest.raises(ValueError, match=r"redo_all_to_all must be true or false, got 1"):
        ucp.init_topology(1, 1, redo_all_to_all=1)
    cfg = {"sequence_parallel": {"ulysses_degree": 1, "redo_all_to_all": True}}
    assert run_options(ucp.RunConfig.load(cfg)).redo_all_to_all is True
    with pytest.raises(ValueError, match=r"sequence_parallel.redo_all_to_all must be true or"):
        ucp.RunConfig.load({"sequence_parallel": {"redo_all_to_all": "no"}})


def test_automatic_chunks_weigh_bytes():
    head = MIN_CHUNK_BYTES // 2  # one head-sharded query head: half the smallest chunk
    # 8 q / 4 kv heads at P = 4: 2 q heads per rank; a chunk of 1 head is too small
    assert resolve_head_chunks(0, 8, 4, 4, head_bytes=head) == 1
    assert resolve_head_chunks(0, 8, 4, 4, head_bytes=2 * head) == 2
    # 32 q / 8 kv heads: 8 per rank; the most chunks that keep 2 heads per chunk
    assert resolve_head_chunks(0, 32, 8, 4, head_bytes=head) == 4
    assert resolve_head_chunks(0, 32, 8, 4, head_bytes=64 * head) == 8
    # hybrid: only counts that give every chunk its own kv heads (2 kv heads per rank)
    assert resolve_head_chunks(0, 16, 4, 2, ring=True, head_bytes=64 * head) == 2
    assert resolve_head_chunks(0, 8, 4, 4) == 1  # size unknown: one chunk
    assert resolve_head_chunks(1, 8, 4, 4, head_bytes=64 * head) == 1  # asked for: kept
