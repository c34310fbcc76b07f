"""Attention variants: logit softcap, attention sinks and sliding windows, exact in every
mode and layout.

Reference: float64 attention on the full tensors (``tests.support.helpers.reference``), with the
softcap applied to the scores, the sinks as one more column of logits whose value vector is
zero, and the window in the mask."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import ulysses_cp as ucp
from tests.support.distributed import WorkerError
from tests.support.helpers import TOL64, attend_and_check, make_qkv, reference, topology
from ulysses_cp.kernels.blocks import work as work_stats
from ulysses_cp.kernels.dispatch import KernelCall
from ulysses_cp.kernels.spec import AttentionSpec

MODES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
CASE = dict(seed=11, hq=4, hkv=2)


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap,with_sinks", [(5.0, False), (0.0, True), (2.0, True)])
def test_softcap_and_sinks_match_float64(pools, u, r, layout, causal, softcap, with_sinks):
    attend_and_check(
        pools,
        u,
        r,
        layout,
        **CASE,
        backend="math",
        causal=causal,
        softcap=softcap,
        sinks=with_sinks,
    )


@pytest.mark.parametrize("u,r", [(4, 1), (1, 4), (2, 2)])
def test_packed_rows_with_softcap_and_sinks(pools, u, r):
    bounds = [0, 8, 32, 40, 64]  # every document a multiple of 2P = 8
    attend_and_check(
        pools, u, r, seed=11, hq=8, hkv=2, bounds=bounds, backend="math", softcap=3.0, sinks=True
    )


@pytest.mark.parametrize("u,r", [(1, 1), (2, 2)])
def test_torch_backend_takes_the_exact_path(pools, u, r):
    attend_and_check(pools, u, r, seed=11, hq=4, hkv=4, backend="torch", softcap=4.0, sinks=True)


def _refused(rank, what):
    topo = topology(2, 1)
    q, k, v, _ = make_qkv(seed=1, b=1, s=16, hq=4, hkv=4, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo) for t in (q, k, v))
    kw = {
        "negative softcap": dict(softcap=-1.0),
        "softcap not a number": dict(softcap="5"),
        "sinks of the wrong length": dict(sinks=torch.zeros(3, dtype=torch.float64)),
        "integer sinks": dict(sinks=torch.zeros(4, dtype=torch.long)),
        "ranks disagree": dict(softcap=float(rank)),
    }[what]
    ucp.attention(ql, kl, vl, topo, backend="math", **kw)


REFUSALS = {
    "negative softcap": r"softcap must be finite and >= 0 \(0 = off\), got -1.0",
    "softcap not a number": r"softcap must be a number \(0 = off\), got '5'",
    "sinks of the wrong length": r"sinks must be a \(4,\) tensor, one logit per query head",
    "integer sinks": "sinks must be floating point",
    "ranks disagree": r"softcap \(x 1e6\): rank 0 0, rank 1 1000000",
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_bad_variants_are_refused_on_every_rank(pools, what):
    with pytest.raises(WorkerError, match=REFUSALS[what]) as err:
        pools(2).run(_refused, what)
    assert str(err.value).count("Traceback") == 2


# ---------------------------------------------------------------- flash-attn adapter


@contextmanager
def flash_standin(release: str):
    """The CPU stand-in of a flash-attn release (``tests/support/flash_standin``) for a block."""
    from tests.support.flash_standin import unuse, use
    from ulysses_cp.kernels import flash_backend

    use(release, "plain")
    flash_backend.reset()
    try:
        yield
    finally:
        unuse()
        flash_backend.reset()


# softcap reaches flash-attn (stand-ins of each release: tests/support/flash_standin) and sinks
# apply on top of its (out, lse), dense and packed


# ---------------------------------------------------------------- sliding windows

WINDOWS = [(3, -1), (9, -1), (5, 2), (0, 0), (-1, 4)]


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_sliding_window_matches_float64(pools, u, r, layout, causal, window):
    attend_and_check(pools, u, r, layout, **CASE, backend="math", causal=causal, window=window)


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)])
def test_window_with_softcap_and_sinks(pools, u, r):
    attend_and_check(pools, u, r, **CASE, backend="torch", softcap=2.5, sinks=True, window=(6, -1))


@pytest.mark.parametrize("u,r", [(1, 1), (4, 1), (1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window,causal", [((5, -1), True), ((3, 6), False), ((20, -1), True)])
@pytest.mark.parametrize("backend", ["math", "torch"])
def test_window_in_packed_rows_is_per_document(pools, u, r, layout, window, causal, backend):
    """Documents of 8, 24, 8 and 24 tokens (each a multiple of 2P = 8): each cut in its own
    chunks, so the window's offset in tokens differs per document group."""
    bounds = [0, 8, 32, 40, 64]
    attend_and_check(
        pools,
        u,
        r,
        layout,
        seed=11,
        hq=8,
        hkv=2,
        bounds=bounds,
        backend=backend,
        causal=causal,
        sinks=True,
        window=window,
    )


def _work(rank, layout, window):
    topo = topology(1, 4, layout)
    q, k, v, dout = make_qkv(seed=2, b=1, s=64, hq=2, hkv=2, d=8)
    ql, kl, vl = (ucp.shard_sequence(t, topo).detach().requires_grad_() for t in (q, k, v))
    work_stats.reset()
    ucp.comm_stats.reset()
    out = ucp.attention(ql, kl, vl, topo, causal=True, backend="math", window=window)
    out.backward(ucp.shard_sequence(dout, topo))
    return work_stats.snapshot(), ucp.comm_stats.total("ring")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_ring_skips_blocks_outside_every_window(pools, layout):
    """Work per rank: chunk pairs with a visible (query, key), counted here by brute force
    over global positions, times the chunk's scores; the rest are skipped."""
    P, s, window = 4, 64, (5, -1)
    n_chunks = 2 * P if layout == "zigzag" else P
    c = s // n_chunks
    results = pools(P).run(_work, layout, window)
    full = pools(P).run(_work, layout, (-1, -1))

    def chunks(rank):
        return [rank, 2 * P - 1 - rank] if layout == "zigzag" else [rank]

    def visible(qc, kc):
        i = torch.arange(qc * c, (qc + 1) * c)[:, None]
        j = torch.arange(kc * c, (kc + 1) * c)[None, :]
        return bool(((j <= i) & (j >= i - window[0])).any())

    for rank, (snap, ring_bytes) in enumerate(results):
        mine = chunks(rank)
        theirs = [x for src in range(P) for x in chunks(src)]
        pairs = sum(visible(qc, kc) for qc in mine for kc in theirs)
        assert snap["scores/forward"] == snap["scores/backward"] == pairs * 2 * c * c
        assert snap["skipped/forward"] == len(mine) * len(theirs) - pairs
        assert ring_bytes == full[rank][1]  # the ring still passes every block
    total = sum(snap["scores/forward"] for snap, _ in results)
    assert total < sum(snap["scores/forward"] for snap, _ in full)  # causal, no window


def _ring_split(rank, P, layout, split, window, causal):
    from ulysses_cp.modes.ring import Ring, ring_attention

    group = None if P == 1 else topology(1, P, layout).ring_group
    topo = topology(1, P, layout) if P > 1 else None
    q, k, v, dout = make_qkv(seed=4, b=1, s=64, hq=4, hkv=2, d=8)
    if topo is not None:
        q, k, v, dout = (ucp.shard_sequence(t, topo) for t in (q, k, v, dout))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    work_stats.reset()
    call = KernelCall(AttentionSpec(causal=causal, window=window), "math")
    out = ring_attention(q, k, v, ring=Ring(group, layout, split=split), call=call)
    out.backward(dout)
    got = [out.detach(), q.grad, k.grad, v.grad]
    if topo is not None:
        got = [ucp.gather_sequence(t, topo) for t in got]
    return got, work_stats.snapshot()


@pytest.mark.parametrize(
    "P,layout,split",
    [(1, "contiguous", 8), (1, "contiguous", 2), (4, "zigzag", 2), (4, "contiguous", 4)],
)
@pytest.mark.parametrize("window,causal", [((6, -1), True), ((4, 7), False)])
def test_pieces_smaller_than_a_chunk_are_exact(pools, P, layout, split, window, causal):
    """Block-sparse attention: chunks cut in ``split`` pieces, pairs out of reach skipped."""
    results = (
        pools(max(P, 1)).run(_ring_split, P, layout, split, window, causal)
        if P > 1
        else [_ring_split(0, P, layout, split, window, causal)]
    )
    q, k, v, dout = make_qkv(seed=4, b=1, s=64, hq=4, hkv=2, d=8)
    ref = reference(q, k, v, dout, causal=causal, window=window)
    for got, snap in results:
        for name, g, x in zip(("out", "dq", "dk", "dv"), got, ref[:4]):
            torch.testing.assert_close(g, x, **TOL64, msg=lambda m, n=name: f"{n}: {m}")
        if (P, split) != (1, 2):  # two 32-token pieces: both pairs within reach
            assert snap["skipped/forward"] > 0


@pytest.mark.parametrize(
    "u,r,layout",
    [(1, 1, "zigzag"), (4, 1, "zigzag"), (1, 4, "zigzag"), (1, 4, "contiguous"), (2, 2, "zigzag")],
)
@pytest.mark.parametrize("window", [(3, -1), (9, 2)], ids=str)
def test_windowed_blocks_take_the_fused_kernel_where_they_can(pools, u, r, layout, window):
    """torch backend: blocks a window leaves whole (or aligned-causal) run torch's fused
    kernel, the rest the math path; float64 either way."""
    attend_and_check(
        pools, u, r, layout, **CASE, backend="torch", causal=window[1] < 0, window=window
    )
