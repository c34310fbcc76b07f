"""KV inside a ring group by all-gather (``kv_exchange="allgather"``): exact in every ring
mode, both layouts, packed rows and windows, and its bytes equal their formulas."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.distributed import WorkerError
from tests.helpers import make_qkv, reference, topology

TOL64 = dict(rtol=1e-10, atol=1e-10)


def _run(rank, u, r, layout, *, causal, hq, hkv, bounds=None, exchange="allgather", **kw):
    topo = topology(u, r, layout, kv_exchange=exchange)
    s = 32 if bounds is None else bounds[-1]
    q, k, v, dout = make_qkv(seed=21, b=1 if bounds else 2, s=s, hq=hq, hkv=hkv, d=8)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    sh = dict(layout=layout, cu_seqlens=cu)
    ql, kl, vl = (ucp.shard_sequence(t, topo, **sh).detach().requires_grad_() for t in (q, k, v))
    ucp.comm_stats.reset()
    out = ucp.attention(ql, kl, vl, topo, causal=causal, backend="math", cu_seqlens=cu, **kw)
    out.backward(ucp.shard_sequence(dout, topo, **sh))
    snap = ucp.comm_stats.snapshot()
    got = [ucp.gather_sequence(t, topo, **sh).detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return got, snap


@pytest.mark.parametrize("u,r", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_allgather_matches_float64(pools, u, r, layout, causal, hq, hkv):
    results = pools(u * r).run(_run, u, r, layout, causal=causal, hq=hq, hkv=hkv)
    q, k, v, dout = make_qkv(seed=21, b=2, s=32, hq=hq, hkv=hkv, d=8)
    ref = reference(q, k, v, dout, causal)
    P_ring = r
    for got, snap in results:
        for name, g, x in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, x, **TOL64, msg=lambda m, n=name: f"{n}: {m}")
        # bytes: forward all-gather = the ring's forward formula (this rank's KV block to
        # the r - 1 others); backward: the KV again, and r - 1 float64 dk/dv shares
        _, ring_bytes = ucp.forward_comm_bytes(
            batch=2, seq_len=32, hq=hq, hkv=hkv, head_dim=8, ulysses_degree=u,
            ring_degree=r, bytes_per_element=8,
        )  # fmt: skip
        assert snap["kv_allgather/forward"] == ring_bytes
        assert snap["kv_allgather/backward"] == ring_bytes
        assert snap["kv_reduce_scatter/backward"] == ring_bytes  # float64: same element size
        assert not any(key.startswith("ring/") for key in snap), snap
    assert P_ring > 1


@pytest.mark.parametrize("u,r", [(1, 4), (2, 2)])
@pytest.mark.parametrize("window", [(-1, -1), (5, -1)], ids=str)
def test_allgather_packed_rows_and_windows(pools, u, r, window):
    bounds = [0, 8, 32, 40, 64]
    results = pools(u * r).run(
        _run, u, r, "zigzag", causal=True, hq=4, hkv=2, bounds=bounds, window=window
    )
    q, k, v, dout = make_qkv(seed=21, b=1, s=64, hq=4, hkv=2, d=8)
    ref = reference(q, k, v, dout, True, bounds=bounds, window=window)
    for got, _ in results:
        for name, g, x in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, x, **TOL64, msg=lambda m, n=name: f"{n}: {m}")


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


def test_unknown_exchange_is_refused():
    with pytest.raises(ValueError, match="kv_exchange 'broadcast' is not one of"):
        ucp.RunOptions(kv_exchange="broadcast")
    cfg = {"sequence_parallel": {"kv_exchange": "allgather"}, "train_batch_size": 1}
    assert ucp.run_options(cfg).kv_exchange == "allgather"
