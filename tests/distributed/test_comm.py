"""The all-to-all puts every element where it belongs, and counts its bytes."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import make_qkv, topology
from ulysses_cp.core.comm import head_to_seq, seq_to_head
from ulysses_cp.core.sharding import layout_indices, natural_to_pairs, pairs_to_natural
from ulysses_cp.modes.ulysses import head_chunk_choices


def encoded(b: int, s: int, h: int, d: int) -> torch.Tensor:
    """x[i, t, j, :] = 1e6*i + 1e3*t + j: every element says where it belongs."""
    i = torch.arange(b).view(b, 1, 1, 1) * 1_000_000
    t = torch.arange(s).view(1, s, 1, 1) * 1_000
    j = torch.arange(h).view(1, 1, h, 1)
    return (i + t + j).double().expand(b, s, h, d).contiguous()


def _placement(rank, P, layout):
    topo = topology(P, 1, layout)
    b, s, h, d = 3, 8 * P, 2 * P, 5
    full = encoded(b, s, h, d)
    local = ucp.shard_sequence(full, topo, layout=layout)
    idx = layout_indices(s, P, topo.sp_rank, layout)
    assert torch.equal(local, full[:, idx])  # shard holds the tokens the layout says
    heads = seq_to_head(local, topo.ulysses_group)  # (b, s, h/P, d), SP-rank order
    if layout == "zigzag":
        heads = pairs_to_natural(heads, P, dim=1)
    mine = slice(topo.ulysses_rank * h // P, (topo.ulysses_rank + 1) * h // P)
    assert torch.equal(heads, full[:, :, mine])  # every (batch, position, head) in place
    if layout == "zigzag":
        heads = natural_to_pairs(heads, P, dim=1)
    back = head_to_seq(heads, topo.ulysses_group)
    assert torch.equal(back, local)  # exact round trip
    assert torch.equal(ucp.gather_sequence(local, topo, layout=layout), full)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_all_to_all_placement_and_round_trip(pools, P, layout):
    pools(P).run(_placement, P, layout)


def _a2a_gradient(rank):
    topo = topology(4, 1)
    x = torch.randn(2, 4, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_()
    y = seq_to_head(x, topo.ulysses_group)
    w = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (y * w).sum().backward()
    # d/dx of <seq_to_head(x), w> is head_to_seq(w): the inverse all-to-all
    assert torch.equal(x.grad, head_to_seq(w, topo.ulysses_group))


def test_all_to_all_backward_is_inverse(pools):
    pools(4).run(_a2a_gradient)


def _bytes(rank, P, hq, hkv, dtype, chunks=1):
    topo = topology(P, 1, head_chunks=chunks)
    b, s, d = 2, 16 * P, 12
    q, k, v, dout = make_qkv(3, b, s, hq, hkv, d, dtype=dtype)
    ql, kl, vl = (ucp.shard_sequence(t, topo).requires_grad_() for t in (q, k, v))
    ucp.comm_stats.reset()
    out = ucp.attention(ql, kl, vl, topo, backend="torch")
    fwd = ucp.comm_stats.total("all_to_all", "forward")
    out.backward(ucp.shard_sequence(dout, topo))
    bwd = ucp.comm_stats.total("all_to_all", "backward")
    return fwd, bwd, ucp.comm_stats.calls[("all_to_all", "forward")]


@pytest.mark.parametrize("P,hq,hkv", [(2, 8, 2), (4, 8, 8), (4, 8, 2), (4, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_bytes_equal_formula(pools, P, hq, hkv, dtype):
    b, s, d = 2, 16 * P, 12
    nbytes = torch.tensor([], dtype=dtype).element_size()
    hkv_sent = max(hkv, P)  # replicated up to P when hkv < P
    # per rank, forward: b * (N/P) * (2*hq + 2*hkv_sent) * d * (P-1)/P * bytes
    formula = b * (s // P) * (2 * hq + 2 * hkv_sent) * d * (P - 1) // P * nbytes
    for fwd, bwd, calls in pools(P).run(_bytes, P, hq, hkv, dtype):
        assert fwd == formula
        assert bwd == formula  # dO out, dq/dk/dv back: the same volume
        assert calls == 2  # q, k, v packed into one all-to-all, output in one
    # head chunks: the same bytes, in 2 calls per chunk
    c = max(head_chunk_choices(hq, hkv, P))
    for fwd, bwd, calls in pools(P).run(_bytes, P, hq, hkv, dtype, c):
        assert (fwd, bwd, calls) == (formula, formula, 2 * c)


def _release(rank):
    from ulysses_cp.core.comm import PendingAllToAll

    topo = topology(2, 1)
    out = []
    for release in (False, True):
        send = torch.arange(8.0).view(2, 4) + 10 * rank  # row j goes to rank j
        pending = PendingAllToAll(topo.ulysses_group)
        pending.post(send, "forward", release=release)
        recv = pending.wait("forward")
        want = torch.stack([torch.arange(4.0) + 4 * rank + 10 * j for j in range(2)])
        assert torch.equal(recv, want)
        out.append(send.untyped_storage().nbytes())
    view = torch.zeros(4, 4)[:2]  # part of a larger storage: never freed by release
    pending = PendingAllToAll(topo.ulysses_group)
    pending.post(view, "forward", release=True)
    pending.wait("forward")
    return [*out, view.untyped_storage().nbytes()]


def test_a_released_send_buffer_is_freed_once_sent(pools):
    """``release=True``: the send buffer's storage is freed when the wait returns (the
    backend's reference can outlive the wait), the received data intact; a send that is
    only part of its storage, or not released, is kept."""
    for kept, freed, view in pools(2).run(_release):
        assert (kept, freed, view) == (32, 0, 64)
