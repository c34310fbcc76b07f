"""Packed rows in the row-wise layout (``packing="row"``): documents of any length, only the
row splits over the ranks; exact in every mode, layout and KV exchange."""

from __future__ import annotations

import itertools

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import attend_and_check, make_qkv, topology
from ulysses_cp.core.rows import RowDocs, row_chunks

ROW = dict(packing="row")
MODES = [(4, 1), (1, 4), (2, 2)]  # u4, r4, hybrid u2r2

# rows of 64 tokens (8 zigzag chunks of 8 over 4 ranks); no document length is a multiple
# of anything the layout needs
DOCS = {
    "primes": [13, 7, 29, 3, 11, 1],
    "crosses_every_border": [2, 59, 3],  # the long one crosses every rank's chunk borders
    "shorter_than_a_chunk": [5, 3, 1, 2, 47, 6],
    "one": [64],
}


def bounds_of(lengths: list[int]) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("docs", list(DOCS))
def test_row_wise_matches_float64(pools, u, r, layout, docs):
    bounds = bounds_of(DOCS[docs])
    attend_and_check(
        pools, u, r, layout, seed=3, hq=4, hkv=2, bounds=bounds, options=ROW, backend="math"
    )


@pytest.mark.parametrize("u,r", [(1, 4), (2, 2), (1, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_row_wise_allgather_and_bidirectional(pools, u, r, layout):
    bounds = bounds_of(DOCS["primes"])
    case = dict(seed=4, hq=4, hkv=1, bounds=bounds, options=ROW | dict(kv_exchange="allgather"))
    for causal in (True, False):
        attend_and_check(pools, u, r, layout, **case, backend="math", causal=causal)


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize(
    "variant",
    [dict(window=(5, -1)), dict(window=(9, 3), causal=False), dict(softcap=2.0)],
    ids=["window", "window_bidirectional", "softcap"],
)
def test_row_wise_windows_softcap_sinks(pools, u, r, variant):
    bounds = bounds_of([*DOCS["crosses_every_border"][:1], 17, 45])
    case = dict(seed=5, hq=4, hkv=2, bounds=bounds, options=ROW, backend="math")
    attend_and_check(pools, u, r, **case, sinks="softcap" in variant, **variant)


@pytest.mark.parametrize("u,r", [(1, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize(
    "more", [dict(head_chunks=2), dict(redo_all_to_all=True)], ids=["chunks", "redo"]
)
def test_row_wise_torch_backend_head_chunks_and_redo(pools, u, r, more):
    bounds = bounds_of(DOCS["shorter_than_a_chunk"])
    attend_and_check(
        pools, u, r, seed=6, hq=8, hkv=4, bounds=bounds, options=ROW | more, backend="torch"
    )


def _shards(rank, u, r):
    """Row-wise shards are the unpacked shards; document-wise ones refuse the same row."""
    topo = topology(u, r, packing="row")
    x = torch.arange(64.0)[None, :, None]
    cu = torch.tensor(bounds_of(DOCS["primes"]), dtype=torch.int32)
    local = ucp.shard_sequence(x, topo, cu_seqlens=cu)
    assert torch.equal(local, ucp.shard_sequence(x, topo))
    assert torch.equal(ucp.gather_sequence(local, topo, cu_seqlens=cu), x)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        ucp.shard_sequence(x, topo, cu_seqlens=cu, packing="document")
    with pytest.raises(ValueError, match="multiple of 8"):  # the row itself must split
        ucp.shard_sequence(x[:, :60], topo, cu_seqlens=torch.tensor([0, 7, 60]))
    # a batch sharded row-wise, attended document-wise: refused, never a wrong answer
    q = make_qkv(seed=1, b=1, s=64, hq=4, hkv=4, d=8)[0]
    plan = ucp.shard_batch(
        {"input_ids": x[..., 0].long(), "cu_seqlens": cu, "shift_labels": x[..., 0].long()}, topo
    )["batch"]
    ql = ucp.shard_sequence(q, topo)
    with pytest.raises(ValueError, match=r"packing 'row' and attention runs .* packing 'document'"):
        ucp.attention(ql, ql, ql, topo, batch=plan, packing="document", backend="math")
    return True


@pytest.mark.parametrize("u,r", [(2, 2)])
def test_row_wise_shards_and_refusals(pools, u, r):
    assert pools(4).run(_shards, u, r) == [True] * 4


# ------------------------------------------------------------------ no processes needed


def covered(bounds: list[int], P: int, layout: str, causal: bool, window=(-1, -1)):
    """How many times the blocks of every rank and step cover each (query, key) pair."""
    N = bounds[-1]
    cover = torch.zeros(N, N, dtype=torch.long)
    held = {}
    for rank in range(P):
        c = N // (P * len(row_chunks(P, rank, layout)))
        chunks = row_chunks(P, rank, layout)
        held[rank] = torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])
    for rank in range(P):
        docs = RowDocs(bounds, P, rank, layout, torch.device("cpu"))
        for step in range(P):
            qpos, kpos = held[rank], held[(rank - step) % P]
            for qs, ks, where in docs.blocks(step, causal, window):
                qg, kg = qpos[qs], kpos[ks]
                if "cu_q" in where:  # varlen: pairs inside each (local) document
                    cu = where["cu_q"].tolist()
                    for a, b in itertools.pairwise(cu):
                        seen = torch.ones(b - a, b - a, dtype=torch.long)
                        seen = seen.tril() if where["causal"] else seen
                        cover[qg[a:b, None], kg[None, a:b]] += seen
                else:
                    assert where["causal"] is False
                    cover[qg[:, None], kg[None, :]] += 1
    return cover
