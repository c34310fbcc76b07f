"""Packed variable-length rows: attention stays inside documents in every mode.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_varlen.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import TOL64, make_qkv
from ulysses_cp.core.varlen import doc_layout_indices, ulysses_permutation
from ulysses_cp.kernels.dispatch import KernelCall, attn_forward
from ulysses_cp.kernels.spec import AttentionSpec


def test_doc_layout_partitions_every_document():
    bounds = [0, 16, 24, 56]
    for P, layout in ((4, "contiguous"), (4, "zigzag"), (2, "zigzag"), (1, "zigzag")):
        held = [doc_layout_indices(bounds, P, p, layout) for p in range(P)]
        assert sorted(torch.cat(held).tolist()) == list(range(56))
        for h in held:  # every rank holds len/P of every document, in increasing order
            assert torch.all(h[1:] > h[:-1])
            for a, b in itertools.pairwise(bounds):
                assert ((h >= a) & (h < b)).sum() == (b - a) // P


def test_ulysses_permutation_yields_ring_layout():
    bounds = [0, 16, 48, 64]
    cases = ((2, 2, "zigzag"), (4, 1, "zigzag"), (2, 2, "contiguous"), (4, 2, "zigzag"))
    for u, r, layout in cases:
        for j in range(r):
            pieces = [doc_layout_indices(bounds, u * r, j * u + i, layout) for i in range(u)]
            held = torch.cat(pieces)
            perm = ulysses_permutation(bounds, u, r, j, layout)
            assert torch.equal(held[perm], doc_layout_indices(bounds, r, j, layout))


def test_pack_documents_and_cu_from_position_ids():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]
    b = ucp.pack_documents(docs, multiple=4, pad_token_id=0)
    assert b["cu_seqlens"].tolist() == [0, 4, 8, 16]
    assert b["cu_seqlens"].dtype == torch.int32
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 8, 0, 0, 0, 9, 10, 11, 12, 13, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    I = -100
    assert b["shift_labels"].tolist() == [[6, 7, I, I, I, I, I, I, 10, 11, 12, 13, I, I, I, I]]
    assert torch.equal(ucp.cu_seqlens_from_position_ids(b["position_ids"]), b["cu_seqlens"])
    with pytest.raises(ValueError, match="start at 0"):
        ucp.cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))
    with pytest.raises(ValueError, match="non-empty"):
        ucp.pack_documents([torch.tensor([], dtype=torch.long)])


def test_local_packed_kernel_gives_empty_rows_outside_documents():
    q, k, v, _ = make_qkv(seed=3, b=1, s=12, hq=2, hkv=1, d=4)
    cu_q = torch.tensor([0, 4, 8], dtype=torch.int32)  # rows 8..11 belong to no document
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
    spec = AttentionSpec(causal=False)
    for backend in ("math", "torch"):
        out, lse = attn_forward(q, k, v, KernelCall(spec, backend, cu_q=cu_q, cu_k=cu_k))
        assert torch.equal(out[:, 8:], torch.zeros_like(out[:, 8:]))
        assert torch.isneginf(lse[:, :, 8:]).all()
        ref, ref_lse = attn_forward(q[:, 4:8], k[:, 6:], v[:, 6:], KernelCall(spec, "math"))
        torch.testing.assert_close(out[:, 4:8], ref, **TOL64)
        torch.testing.assert_close(lse[:, :, 4:8], ref_lse, **TOL64)


def test_derived_values_follow_in_place_changes():
    from ulysses_cp.core import derived

    cu = torch.tensor([0, 4, 8])
    calls = []

    def build():
        calls.append(1)
        return cu.tolist()

    assert derived.once((cu,), "t", build) == [0, 4, 8]
    assert derived.once((cu,), "t", build) == [0, 4, 8] and len(calls) == 1
    cu[1] = 2  # in place: the version moves, the value is rebuilt
    assert derived.once((cu,), "t", build) == [0, 2, 8] and len(calls) == 2
    assert derived.once((cu,), "other key", build) and len(calls) == 3
