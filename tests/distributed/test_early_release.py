"""Memory the ring's backward gives back early, measured with live tensor bytes
(``scripts/profiling.py``'s ``LiveBytes``): each step's block gradients are released once
added into the travelling dk/dv accumulator (``modes/ring.py`` ``ring_backward``), before
the next transfer is posted. Bound from the shapes: one full block's dk and dv,
``2 * s_l * hkv * d * 4`` bytes (float32). (Head-chunked Ulysses freeing its kept copies,
``modes/chunked.py`` ``_free``, is ``tests/distributed/test_head_chunks.py``'s
``test_backward_frees_each_chunks_copies``.)"""

from __future__ import annotations

import sys

import pytest
import torch

import ulysses_cp as ucp
import ulysses_cp.modes.ring as ring_mod
from tests.support.helpers import ROOT, make_qkv, topology
from ulysses_cp.core.comm import RingComm

pytestmark = pytest.mark.distributed

S_L, HQ, HKV, D = 256, 2, 2, 32  # per rank: (1, S_L, H, D) float32


def _tracker():
    sys.path.insert(0, str(ROOT / "scripts"))
    from profiling import LiveBytes

    return LiveBytes()


def _live_at_dkv_posts(rank: int, hold: bool) -> tuple[list[int], int]:
    """Ring of 2, not causal (every step computes one full block on every rank): the live
    bytes each time the backward posts its dk/dv accumulator on (once per step, after the
    step's block gradients were added), and the peak. ``hold``: the block gradients of
    every step kept to the end (what the ring did before it released them)."""
    topo = topology(1, 2, "contiguous")
    q, k, v, dout = make_qkv(rank, 1, S_L, HQ, HKV, D, torch.float32)
    for t in (q, k, v):
        t.requires_grad_()
    tracker, live_at, held = _tracker(), [], []
    send_recv, add_blocks = RingComm.send_recv, ring_mod._add_blocks

    def posting(self, x):
        if self.phase == "backward" and self.tag == 2:  # the dk/dv accumulator
            live_at.append(tracker.live)
        send_recv(self, x)

    def adding(dkv, done, dk):
        add_blocks(dkv, done, dk)
        if hold:
            held.extend(done)

    RingComm.send_recv, ring_mod._add_blocks = posting, adding
    try:
        with tracker:
            ucp.attention(q, k, v, topo, backend="torch", causal=False).backward(dout)
    finally:
        RingComm.send_recv, ring_mod._add_blocks = send_recv, add_blocks
    return live_at, tracker.peak


def test_ring_backward_releases_block_gradients_before_the_next_transfer(pools):
    released = pools(2).run(_live_at_dkv_posts, False)
    held = pools(2).run(_live_at_dkv_posts, True)
    block_grads = 2 * S_L * HKV * D * 4  # one full block's dk and dv, float32
    for (mine, peak), (theirs, peak_held) in zip(released, held):
        assert len(mine) == len(theirs) == 2  # one post per step
        # at each post, this step's (and earlier steps') block gradients are gone
        for step, (a, b) in enumerate(zip(mine, theirs)):
            assert a <= b - (step + 1) * block_grads, (step, mine, theirs)
        assert peak <= peak_held - block_grads, (peak, peak_held)
