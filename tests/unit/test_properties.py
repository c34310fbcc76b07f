"""Property tests (hypothesis) for the layout transforms, without processes."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ulysses_cp as ucp
from ulysses_cp.core.sharding import _shard, layout_indices, natural_to_pairs, pairs_to_natural
from ulysses_cp.core.varlen import doc_layout_indices, ulysses_permutation

layouts = st.sampled_from(["zigzag", "contiguous"])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), chunk=st.integers(1, 5), dim=st.integers(0, 2), other=st.integers(1, 3))
def test_pairs_round_trip(n, chunk, dim, other):
    shape = [other, other, other]
    shape[dim] = 2 * n * chunk
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    assert torch.equal(pairs_to_natural(natural_to_pairs(x, n, dim), n, dim), x)
    assert torch.equal(natural_to_pairs(pairs_to_natural(x, n, dim), n, dim), x)


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 8), per=st.integers(1, 6), layout=layouts)
def test_layout_is_a_partition_and_gather_inverts_shard(P, per, layout):
    s = ucp.sequence_multiple(P, layout) * per
    held = [layout_indices(s, P, r, layout) for r in range(P)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))  # every token exactly once
    assert len({len(h) for h in held}) == 1  # equal shares
    x = torch.randn(2, s, 3)
    shards = [_shard(x, P, r, layout, 1) for r in range(P)]
    full = torch.cat(shards, dim=1)  # what the all-gather returns, in rank order
    if layout == "zigzag":
        full = pairs_to_natural(full, P, dim=1)
    assert torch.equal(full, x)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 8), per=st.integers(1, 4))
def test_zigzag_pairs_chunks(P, per):
    c = per
    s = 2 * P * c
    for r in range(P):
        idx = layout_indices(s, P, r, "zigzag").tolist()
        assert idx == list(range(r * c, (r + 1) * c)) + list(
            range((2 * P - 1 - r) * c, (2 * P - r) * c)
        )


@settings(max_examples=40, deadline=None)
@given(u=st.integers(1, 4), r=st.integers(1, 4), per=st.integers(1, 3))
def test_hybrid_reorder_gives_each_ring_rank_its_zigzag_pair(u, r, per):
    """After the head all-to-all inside a ulysses group, pairs_to_natural(n=u) yields the
    ring rank's chunks j and 2r-1-j of 2r, in token order (docs/design/ring.md)."""
    P = u * r
    s = 2 * P * per
    for j in range(r):
        gathered = torch.cat([layout_indices(s, P, j * u + i, "zigzag") for i in range(u)])
        got = pairs_to_natural(gathered.view(1, -1), u, dim=1).flatten().tolist()
        half = s // (2 * r)
        want = list(range(j * half, (j + 1) * half)) + list(
            range((2 * r - 1 - j) * half, (2 * r - j) * half)
        )
        assert got == want


@settings(max_examples=60, deadline=None)
@given(
    u=st.integers(1, 4),
    r=st.integers(1, 3),
    layout=layouts,
    docs=st.lists(st.integers(1, 4), min_size=1, max_size=6),
)
def test_document_wise_layout_and_ulysses_permutation(u, r, layout, docs):
    """Packed rows: each rank holds 1/P of every document in increasing order, the ranks
    partition the row, and the Ulysses permutation yields the ring level's layout."""
    P = u * r
    m = ucp.sequence_multiple(P, layout)
    bounds = [0, *itertools.accumulate(n * m for n in docs)]
    held = [doc_layout_indices(bounds, P, p, layout) for p in range(P)]
    assert sorted(torch.cat(held).tolist()) == list(range(bounds[-1]))
    for h in held:
        assert h.numel() == bounds[-1] // P and bool((h[1:] > h[:-1]).all())
    for j in range(r):
        group = torch.cat(held[j * u : (j + 1) * u])
        perm = ulysses_permutation(bounds, u, r, j, layout)
        assert torch.equal(group[perm], doc_layout_indices(bounds, r, j, layout))
