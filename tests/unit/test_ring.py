"""Ring and hybrid attention equal full float64 attention; balance, memory and bytes.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_ring.py.
"""

from __future__ import annotations

import torch

from ulysses_cp.modes.ring import merge


def test_merge_is_exact_and_guards_empty_rows():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=g)  # scores (b, h, q, k)
    v = torch.randn(1, 8, 2, 3, dtype=torch.float64, generator=g)

    def part(cols):
        p = torch.softmax(s[..., cols], -1)
        return torch.einsum("bhqk,bkhd->bqhd", p, v[:, cols]), torch.logsumexp(s[..., cols], -1)

    full_o, full_l = part(slice(0, 8))
    out, lse = torch.zeros_like(full_o), torch.full_like(full_l, float("-inf"))
    for cols in (slice(0, 3), slice(3, 8)):
        out, lse = merge(out, lse, *part(cols))
    torch.testing.assert_close(out, full_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_l, rtol=1e-12, atol=1e-12)
    # an empty partial result (-inf lse) changes nothing; two empties stay empty, no NaN
    o2, l2 = merge(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    e_o, e_l = merge(
        torch.zeros_like(out),
        torch.full_like(lse, float("-inf")),
        torch.zeros_like(out),
        torch.full_like(lse, float("-inf")),
    )
    assert torch.equal(e_o, torch.zeros_like(out)) and torch.isneginf(e_l).all()
    # large lse gaps do not overflow
    big_o, big_l = merge(out, lse + 1000.0, out * 2, lse - 1000.0)
    assert torch.isfinite(big_o).all() and torch.isfinite(big_l).all()
