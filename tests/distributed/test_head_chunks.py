"""Head-chunked Ulysses: exact in every mode for every chunk count that works, the same
bytes as one chunk, the next chunk's all-to-all posted before the current chunk computes
(forward), one output gradient at a time (backward), less staging memory, and checks.

Reference: float64 attention on the full tensors (``tests.support.helpers.reference``)."""

from __future__ import annotations

import sys

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import (
    ROOT,
    assert_refused_on_every_rank,
    attend_and_check,
    make_qkv,
    topology,
)
from ulysses_cp.kernels import math_backend
from ulysses_cp.kernels.backends import Kernel

# (u, r, hq, hkv, c): MHA, GQA with kv chunks = c, GQA with fewer kv chunks than c, kv
# replication (hkv < u), hybrid
CASES = [
    (2, 1, 8, 8, 4),
    (2, 1, 16, 4, 4),
    (2, 1, 16, 4, 8),
    (4, 1, 8, 4, 2),
    (4, 1, 8, 2, 2),
    (2, 2, 8, 4, 2),
    (2, 2, 16, 8, 4),
]


@pytest.mark.parametrize("u,r,hq,hkv,c", CASES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_ulysses_matches_float64(pools, u, r, hq, hkv, c, layout, causal):
    attend_and_check(
        pools, u, r, layout, seed=5, hq=hq, hkv=hkv, backend="math", head_chunks=c, causal=causal
    )


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)])
def test_chunked_packed_rows_with_sinks_and_windows(pools, u, r):
    bounds = [0, 8, 32, 40, 64]
    for extra in (dict(sinks=True), dict(window=(5, -1)), dict(kv_exchange="allgather")):
        if "kv_exchange" in extra and r == 1:
            continue
        case = dict(seed=5, hq=8, hkv=4, bounds=bounds, backend="math", head_chunks=2)
        attend_and_check(pools, u, r, **case, **extra)


def _bytes_and_order(rank, c, hq=8, hkv=4):
    """Bytes per op for chunk count c, and how many all-to-alls had been posted when each
    kernel call started (an injected kernel counts them)."""
    topo = topology(4, 1, "zigzag", check_inputs=False)
    seen = []

    def forward(q, k, v, how):
        seen.append(ucp.comm_stats.calls[("all_to_all", "forward")])
        return math_backend.forward(q, k, v, how)

    def backward(*args):
        seen.append(-ucp.comm_stats.calls[("all_to_all", "backward")])
        return math_backend.backward(*args)

    kernel = Kernel("counting", forward, backward)
    q, k, v, dout = make_qkv(seed=1, b=1, s=64, hq=hq, hkv=hkv, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo).detach().requires_grad_() for t in (q, k, v))
    ucp.comm_stats.reset()
    out = ucp.attention(ql, kl, vl, topo, backend=kernel, head_chunks=c)
    out.backward(ucp.shard_sequence(dout, topo))
    return ucp.comm_stats.snapshot(), dict(ucp.comm_stats.calls), seen


def test_chunks_move_the_same_bytes_and_overlap(pools):
    one = pools(4).run(_bytes_and_order, 1)
    two = pools(4).run(_bytes_and_order, 2)
    for a, b in zip(one, two):
        assert a[0] == b[0] and a[0]["all_to_all/forward"] > 0  # bytes: identical
        # forward: c inbound + c outbound all-to-alls; backward: c output gradients in,
        # c query gradients back, and the kv gradients (dk, dv) once per kv chunk
        assert a[1][("all_to_all", "forward")] == 2 and b[1][("all_to_all", "forward")] == 4
        assert a[1][("all_to_all", "backward")] == 4 and b[1][("all_to_all", "backward")] == 6
    # c=2: chunk 1's all-to-all was posted before chunk 0's kernel ran (2 posted), and the
    # output all-to-all of chunk 0 before chunk 1's (3)
    assert two[0][2][:2] == [2, 3]
    assert one[0][2][:1] == [1]


def test_backward_stages_one_output_gradient_at_a_time(pools):
    """c=4 (2 kv chunks): the backward runs the chunks in order, and when chunk i's kernel
    runs, only its own output gradient has been fetched beyond what is done: chunk 0 sees
    1 all-to-all posted (its dO), chunk 1 3 (dq 0 back, dO 1), chunk 2 7 (dq 1, dk and dv of
    kv chunk 0, dO 2), chunk 3 9. Two chunks of dO were staged at once before (2, 4, 6, 7)."""
    for _, _, seen in pools(4).run(_bytes_and_order, 4, 16, 8):
        forward, backward = seen[:4], [-x for x in seen[4:]]
        assert forward == [2, 4, 6, 7]  # chunk i+1 in (and i-1 out) before chunk i computes
        assert backward == [1, 3, 7, 9], backward


def _peak(rank, c, n):
    sys.path.insert(0, str(ROOT / "scripts"))
    from profiling import peak_memory

    topo = topology(4, 1, "zigzag")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n // 4, 16, 32, generator=g, requires_grad=True)
    k = torch.randn(1, n // 4, 16, 32, generator=g, requires_grad=True)
    v = torch.randn(1, n // 4, 16, 32, generator=g, requires_grad=True)
    dout = torch.randn(1, n // 4, 16, 32, generator=g)

    def step():
        ucp.attention(q, k, v, topo, backend="torch", head_chunks=c).backward(dout)

    return peak_memory(step, scratch=False)


def test_more_chunks_stage_less(pools):
    peaks = {c: max(pools(4).run(_peak, c, 1024)) for c in (1, 4)}
    local = 1024 // 4 * 16 * 32 * 4  # one local (b, s_l, h, d) float32 tensor
    # c=1 stages the packed q/k/v (send, receive, reorder): at least ~1.5 local tensors
    # more than c=4 at the peak
    assert peaks[4] <= peaks[1] - 1.5 * local, peaks


def _peak_keep_or_redo(rank, redo):
    sys.path.insert(0, str(ROOT / "scripts"))
    from profiling import peak_memory

    topo = topology(4, 1, "contiguous", redo_all_to_all=redo)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 256, 16, 32, generator=g, requires_grad=True)
    k = torch.randn(1, 256, 8, 32, generator=g, requires_grad=True)
    v = torch.randn(1, 256, 8, 32, generator=g, requires_grad=True)
    dout = torch.randn(1, 256, 16, 32, generator=g)

    def step():
        ucp.attention(q, k, v, topo, backend="torch", head_chunks=4).backward(dout)

    return peak_memory(step, scratch=False)


def test_backward_frees_each_chunks_copies(pools):
    """The kept head-sharded copies go as the backward uses them: the peak is within a
    quarter of a local tensor of redo_all_to_all's, which keeps none (kept until the end,
    they were 0.74 local tensors more at this size)."""
    keep, redo = (max(pools(4).run(_peak_keep_or_redo, flag)) for flag in (False, True))
    local = 256 * 16 * 32 * 4  # one local (b, s_l, hq, d) float32 tensor
    assert keep <= redo + local // 4, (keep, redo)


def _twice(rank):
    topo = topology(4, 1, "zigzag")
    q, k, v, _ = make_qkv(seed=1, b=1, s=32, hq=8, hkv=4, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo).detach().requires_grad_() for t in (q, k, v))
    out = ucp.attention(ql, kl, vl, topo, backend="math", head_chunks=2)
    out.sum().backward(retain_graph=True)
    out.sum().backward()


def test_a_second_backward_is_refused_on_every_rank(pools):
    assert_refused_on_every_rank(pools, 4, _twice, "a second backward through head-chunked")


def _mismatch(rank):
    topo = topology(2, 1, "zigzag")
    q = torch.randn(1, 8, 4, 8)
    ucp.attention(q, q, q, topo, head_chunks=1 + rank)


def test_chunk_counts_that_differ_across_ranks_are_refused_on_every_rank(pools):
    assert_refused_on_every_rank(pools, 2, _mismatch, "head chunks: rank 0 1, rank 1 2")


def _bad(rank):
    topo = topology(4, 1, "zigzag", head_chunks=4)
    q = torch.randn(1, 8, 8, 8)
    k = torch.randn(1, 8, 4, 8)
    ucp.attention(q, k, k, topo)


def test_a_chunk_count_that_does_not_split_the_heads_is_refused(pools):
    assert_refused_on_every_rank(pools, 4, _bad, "head_chunks=4 does not split 8 query heads")


def _hybrid_bytes(rank, c, exchange):
    topo = topology(2, 2, "zigzag", kv_exchange=exchange, check_inputs=False)
    q, k, v, dout = make_qkv(seed=1, b=1, s=32, hq=8, hkv=4, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo).detach().requires_grad_() for t in (q, k, v))
    ucp.comm_stats.reset()
    ucp.attention(ql, kl, vl, topo, backend="math", head_chunks=c).backward(
        ucp.shard_sequence(dout, topo)
    )
    return ucp.comm_stats.snapshot()


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_hybrid_chunks_move_the_same_bytes(pools, exchange):
    one = pools(4).run(_hybrid_bytes, 1, exchange)
    two = pools(4).run(_hybrid_bytes, 2, exchange)
    assert one == two and any(k.startswith(("ring/", "kv_allgather/")) for k in one[0])
