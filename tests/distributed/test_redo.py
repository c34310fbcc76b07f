"""``redo_all_to_all``: Ulysses and hybrid attention that redo the all-to-alls in the
backward instead of keeping head-sharded copies. Exact against float64 in every mode,
layout, chunk count and GQA shape; 1.5x the all-to-all bytes; no head-sharded copies
saved for backward; the option checked where it is set and across ranks. And
the automatic head-chunk rule.

Reference: float64 attention on the full tensors (``tests.support.helpers.reference``)."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import assert_refused_on_every_rank, attend_and_check, topology

REDO = {"redo_all_to_all": True}

# (u, r, hq, hkv, c): GQA one kv chunk for two query chunks, kv replication (hkv < u),
# MHA in 4 chunks, hybrid in 1 and 2 chunks
CASES = [(4, 1, 8, 4, 2), (4, 1, 8, 2, 1), (2, 1, 8, 8, 4), (2, 2, 8, 4, 1), (2, 2, 8, 4, 2)]


@pytest.mark.parametrize("u,r,hq,hkv,c", CASES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_redo_matches_float64(pools, u, r, hq, hkv, c, layout):
    attend_and_check(
        pools, u, r, layout, seed=7, hq=hq, hkv=hkv, backend="math", head_chunks=c, options=REDO
    )


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)])
def test_redo_non_causal_packed_rows_sinks_and_windows(pools, u, r):
    attend_and_check(pools, u, r, seed=3, hq=8, hkv=4, backend="math", causal=False, options=REDO)
    bounds = [0, 8, 32, 40, 64]
    for extra in (dict(sinks=True), dict(window=(5, -1))):
        case = dict(seed=5, hq=8, hkv=4, bounds=bounds, backend="torch", head_chunks=2)
        attend_and_check(pools, u, r, **case, options=REDO, **extra)


def _bytes(rank, u, r, redo):
    topo = topology(u, r, "zigzag", check_inputs=False, redo_all_to_all=redo)
    g = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(1, 16, 8, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 16, 4, 8, generator=g, requires_grad=True) for _ in range(2))
    q.requires_grad_()
    ucp.comm_stats.reset()
    ucp.attention(q, k, v, topo, backend="math", head_chunks=2).backward(dout)
    return ucp.comm_stats.snapshot()


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)])
def test_redo_moves_the_forward_all_to_alls_once_more(pools, u, r):
    keep, redo = (pools(u * r).run(_bytes, u, r, flag) for flag in (False, True))
    for k, x in zip(keep, redo):
        # the forward and the backward's own bytes as without the option; the ring as well
        assert {n: b for n, b in x.items() if n != "all_to_all_redo/backward"} == k
        # the backward moves q, k, v and the output again: the forward's bytes
        assert x["all_to_all_redo/backward"] == k["all_to_all/forward"] > 0


def _saved(rank, redo):
    """Bytes saved for backward beyond the caller's own q, k, v and output (distinct
    storages seen by a saved-tensors hook)."""
    topo = topology(4, 1, "contiguous", redo_all_to_all=redo)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 64, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 64, 8, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 64, 8, 8, generator=g, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ucp.attention(q, k, v, topo, backend="math", head_chunks=4)
    mine = {t.untyped_storage().data_ptr() for t in (q, k, v, out)}
    return sum(n for p, n in seen.items() if p not in mine)


def test_redo_keeps_no_head_sharded_copies(pools):
    keep, redo = (max(pools(4).run(_saved, flag)) for flag in (False, True))
    local = 64 * 16 * 8 * 4  # one local (b, s_l, hq, d) float32 tensor
    # kept without the option: head-sharded q, k, v and output (2 local q-sized tensors:
    # q and out, plus k and v at half the heads); with it only the fp32 lse (1/8 of one)
    assert keep >= 2 * local, keep
    assert redo <= local // 8, redo


def _mismatch(rank):
    topo = topology(2, 1, "zigzag", redo_all_to_all=rank == 1)
    q = torch.randn(1, 8, 4, 8)
    ucp.attention(q, q, q, topo)


def test_a_choice_that_differs_across_ranks_is_refused_on_every_rank(pools):
    assert_refused_on_every_rank(pools, 2, _mismatch, "redo all-to-all: rank 0 0, rank 1 1")
