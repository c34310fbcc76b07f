"""Attention variants: logit softcap, attention sinks and sliding windows, exact in every
mode and layout.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_variants.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_variants import flash_standin
from tests.support.helpers import make_qkv, reference, sinks_for
from ulysses_cp.kernels.blocks import work as work_stats
from ulysses_cp.kernels.dispatch import KernelCall, attn_backward, attn_forward, local_attention
from ulysses_cp.kernels.spec import AttentionSpec


def _flash_matches_float64(q, k, v, dout, flash: KernelCall, math: KernelCall) -> None:
    """flash-attn's call (fp16) against the math path's in float64: the same empty rows,
    output and gradients within fp16's error."""
    out, lse = attn_forward(q, k, v, flash)
    w_out, w_lse = attn_forward(*(t.double() for t in (q, k, v)), math)
    assert torch.equal(torch.isinf(lse), torch.isinf(w_lse))  # the same empty rows
    assert float((out.double() - w_out).abs().max()) < 2e-3
    grads = attn_backward(dout, q, k, v, out, lse, flash)
    want = attn_backward(*(t.double() for t in (dout, q, k, v, w_out)), w_lse, math)
    for g, w in zip(grads, want):
        assert float((g.double() - w).abs().max()) < 5e-3 * max(1.0, float(w.abs().max()))


def test_sinks_and_softcap_are_off_by_default():
    q, k, v, _ = make_qkv(seed=3, b=1, s=16, hq=2, hkv=2, d=8)
    plain = local_attention(q, k, v, backend="math")
    off = local_attention(q, k, v, AttentionSpec(softcap=0.0), backend="math", sinks=None)
    assert torch.equal(plain, off)
    # a very negative sink changes nothing measurable; a large one empties the rows
    low = local_attention(q, k, v, backend="math", sinks=torch.full((2,), -80.0).double())
    torch.testing.assert_close(low, plain, rtol=0, atol=1e-30)
    high = local_attention(q, k, v, backend="math", sinks=torch.full((2,), 80.0).double())
    assert high.abs().max() < 1e-30


@pytest.mark.parametrize("release", ["2.6.0", "2.7.4", "2.8.3"])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_attn_takes_softcap_and_sinks(release, packed):
    with flash_standin(release):
        q, k, v, dout = make_qkv(seed=5, b=1, s=64, hq=4, hkv=2, d=16)
        bounds = [0, 16, 40, 64] if packed else None
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
        sinks = sinks_for(4)
        ref = reference(q, k, v, dout, causal=True, softcap=3.0, sinks=sinks, bounds=bounds)
        leaves = [t.to(torch.float16).requires_grad_() for t in (q, k, v)]
        sk = sinks.float().requires_grad_()
        spec = AttentionSpec(softcap=3.0)
        out = local_attention(*leaves, spec, backend="flash_attn", cu_seqlens=cu, sinks=sk)
        out.backward(dout.to(torch.float16))
        for name, got, want in zip(
            ("out", "dq", "dk", "dv", "dsinks"),
            (out, *(t.grad for t in leaves), sk.grad),
            ref,
        ):
            err = float((got.detach().double() - want).abs().max() / want.abs().max())
            assert err < 5e-3, (release, name, err)


def test_flash_window_translation_sees_the_same_keys():
    """flash-attn's bottom-right aligned window, written here from its documented rule,
    against the band; bands it cannot express come back None (the math path takes them)."""
    from ulysses_cp.kernels.flash_common import flash_window
    from ulysses_cp.kernels.math_backend import band_mask

    seen = {"expressed": 0, "refused": 0}
    for sq, sk in [(4, 4), (4, 6), (6, 4), (1, 5)]:
        for lo in [None, -7, -3, -1, 0, 2, 5]:
            for hi in [None, -4, -1, 0, 1, 3, 8]:
                if lo is not None and hi is not None and lo > hi:
                    continue
                want = band_mask(sq, sk, (lo, hi), torch.device("cpu"))
                window = flash_window((lo, hi), sq, sk)
                if window is None:
                    seen["refused"] += 1
                    assert (lo is not None and lo > sk - sq) or (hi is not None and hi < sk - sq)
                    continue
                seen["expressed"] += 1
                left, right = window
                i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
                got = torch.ones(sq, sk, dtype=torch.bool)
                if left >= 0:
                    got &= j >= i + sk - sq - left
                if right >= 0:
                    got &= j <= i + sk - sq + right
                assert torch.equal(got, want), (sq, sk, lo, hi, window)
    assert seen["expressed"] > 50 and seen["refused"] > 20


@pytest.mark.parametrize("release", ["2.6.0", "2.8.3"])
@pytest.mark.parametrize("offset", [0, 4, 12, -4])
def test_flash_attn_takes_windows(release, offset):
    """Blocks as the ring calls them (a q chunk ``offset`` tokens after the kv chunk):
    flash-attn's window where it can express the band, the math path where not."""
    with flash_standin(release):
        q, k, v, dout = make_qkv(seed=9, b=1, s=16, hq=4, hkv=2, d=16, dtype=torch.float16)
        spec = AttentionSpec(causal=True, window=(10, -1))
        flash, math = (KernelCall(spec, b, offset=offset) for b in ("flash_attn", "math"))
        _flash_matches_float64(q, k, v, dout, flash, math)


def test_window_split_picks_pieces_near_the_window():
    from ulysses_cp.modes.ring import window_split

    assert window_split(1024, (128, -1), 1) == 8  # pieces of 128
    assert window_split(1024, (100, 0), 1) == 16  # pieces of 64 (<= 100, dividing 1024)
    assert window_split(1024, (10, -1), 1) == 16  # never below 64 tokens
    assert window_split(1024, (-1, -1), 1) == 1
    assert window_split(512, (5000, -1), 2) == 1  # chunks already within the window


def test_plain_blocks():
    from ulysses_cp.kernels.blocks import plain_block

    assert plain_block((None, None), 4, 4) is False
    assert plain_block((-10, 10), 4, 4) is False  # the band covers the block
    assert plain_block((-3, 0), 4, 4) is True  # aligned causal
    assert plain_block((None, 0), 4, 6) is None  # causal but not square
    assert plain_block((-2, 0), 4, 4) is None  # a window cuts into the block
    assert plain_block((1, None), 4, 4) is None


@pytest.mark.parametrize("chunk_offset", [0, 1, 3])
def test_flash_attn_takes_windows_in_packed_rows(chunk_offset):
    """Packed halves as the ring calls them: one window for every document (offset 0: the
    varlen call) or a per-group band (documents of other lengths sit other token offsets
    apart: one call per group, flash-attn where it can express the band)."""
    with flash_standin("2.8.3"):
        q, k, v, dout = make_qkv(seed=8, b=1, s=24, hq=4, hkv=2, d=16, dtype=torch.float16)
        cu = torch.tensor([0, 4, 16, 20, 24], dtype=torch.int32)  # groups of 4 and 12
        spec = AttentionSpec(causal=True, window=(6, -1))
        where = dict(cu_q=cu, cu_k=cu, chunk_offset=chunk_offset)
        flash, math = (KernelCall(spec, b, **where) for b in ("flash_attn", "math"))
        _flash_matches_float64(q, k, v, dout, flash, math)


def test_work_counts_only_the_document_groups_computed():
    """Packed halves two chunks apart, window 8: the documents of 4 tokens (chunks 8 apart)
    are within reach, those of 12 (24 apart) are not and are skipped, not counted."""
    q, k, v, _ = make_qkv(seed=3, b=1, s=24, hq=2, hkv=2, d=8)
    cu = torch.tensor([0, 4, 16, 20], dtype=torch.int32)  # documents of 4, 12 and 4 tokens
    spec = AttentionSpec(causal=True, window=(8, -1))
    call = KernelCall(spec, "math", cu_q=cu, cu_k=cu, chunk_offset=2)
    work_stats.reset()
    out, lse = attn_forward(q[:, :20], k[:, :20], v[:, :20], call)
    snap = work_stats.snapshot()
    assert snap["scores/forward"] == 2 * 2 * 4 * 4  # hq x two 4-token documents x 4 x 4
    assert snap["skipped/forward"] == 1  # the 12-token document
    assert torch.isinf(lse[0, :, 4:16]).all() and (out[0, 4:16] == 0).all()
