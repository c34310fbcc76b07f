"""KV inside a ring group by all-gather (``kv_exchange="allgather"``): exact in every ring
mode, both layouts, packed rows and windows, and its bytes equal their formulas."""

from __future__ import annotations

import pytest

import ulysses_cp as ucp
from tests.support.distributed import WorkerError
from tests.support.helpers import attend_and_check, make_qkv, topology
from ulysses_cp.plan.comm import forward_comm_bytes

ALLGATHER = dict(kv_exchange="allgather")


@pytest.mark.parametrize("u,r", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_allgather_matches_float64(pools, u, r, layout, causal, hq, hkv):
    results = attend_and_check(
        pools,
        u,
        r,
        layout,
        seed=21,
        hq=hq,
        hkv=hkv,
        options=ALLGATHER,
        backend="math",
        causal=causal,
    )
    P_ring = r
    for _, snap in results:
        # bytes: forward all-gather = the ring's forward formula (this rank's KV block to
        # the r - 1 others); backward: the KV again, and r - 1 float64 dk/dv shares
        _, ring_bytes = forward_comm_bytes(
            batch=2,
            seq_len=32,
            hq=hq,
            hkv=hkv,
            head_dim=8,
            ulysses_degree=u,
            ring_degree=r,
            bytes_per_element=8,
        )
        assert snap["kv_allgather/forward"] == ring_bytes
        assert snap["kv_allgather/backward"] == ring_bytes
        assert snap["kv_reduce_scatter/backward"] == ring_bytes  # float64: same element size
        assert not any(key.startswith("ring/") for key in snap), snap
    assert P_ring > 1


@pytest.mark.parametrize("u,r", [(1, 4), (2, 2)])
@pytest.mark.parametrize("window", [(-1, -1), (5, -1)], ids=str)
def test_allgather_packed_rows_and_windows(pools, u, r, window):
    bounds = [0, 8, 32, 40, 64]
    attend_and_check(
        pools,
        u,
        r,
        seed=21,
        hq=4,
        hkv=2,
        bounds=bounds,
        options=ALLGATHER,
        backend="math",
        window=window,
    )


def _disagree(rank):
    topo = topology(1, 2)
    q, k, v, _ = make_qkv(seed=1, b=1, s=16, hq=2, hkv=2, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo) for t in (q, k, v))
    exchange = "ring" if rank == 0 else "allgather"
    ucp.attention(ql, kl, vl, topo, backend="math", kv_exchange=exchange)


def test_ranks_that_disagree_fail_together(pools):
    with pytest.raises(WorkerError, match="kv exchange: rank 0 0, rank 1 1") as err:
        pools(2).run(_disagree)
    assert str(err.value).count("Traceback") == 2
