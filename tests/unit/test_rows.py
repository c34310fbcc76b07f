"""Packed rows in the row-wise layout (``packing="row"``): documents of any length, only the
row splits over the ranks; exact in every mode, layout and KV exchange.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_rows.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ulysses_cp as ucp
from tests.distributed.test_rows import bounds_of, covered


@pytest.mark.parametrize(
    "P,layout", [(4, "zigzag"), (4, "contiguous"), (2, "zigzag"), (3, "zigzag")]
)
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_cover_every_visible_pair_once(P, layout, causal):
    """The intersection rule: every pair of tokens in one document (causal: key not after
    query) is computed exactly once over all ranks and steps, and no other pair."""
    for lengths in ([13, 7, 29, 3, 11, 1], [2, 59, 3], [5, 3, 1, 2, 47, 6], [64], [1] * 64):
        N = 48 if P == 3 else 64
        bounds = [b for b in bounds_of(lengths) if b < N] + [N]
        doc = torch.zeros(N, dtype=torch.long)
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            doc[a:b] = i
        want = (doc[:, None] == doc[None, :]).long()
        if causal:
            want = want.tril()
        assert torch.equal(covered(bounds, P, layout, causal), want), (lengths, P, layout)


def test_pack_documents_pads_only_the_row():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13])]
    b = ucp.pack_documents(docs, row_multiple=4)
    assert b["cu_seqlens"].tolist() == [0, 3, 4, 12]  # the row's 3 pad tokens join the last
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 6, 7]]
    I = -100
    assert b["shift_labels"].tolist() == [[6, 7, I, I, 10, 11, 12, 13, I, I, I, I]]
    assert b["labels"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, I, I, I]]
    assert torch.equal(
        ucp.cu_seqlens_from_position_ids(b["position_ids"]),
        b["cu_seqlens"][:3].new_tensor([0, 3, 4, 12]),
    )
    # per-document padding of the same documents: 16 tokens, not 12
    assert ucp.pack_documents(docs, multiple=4)["input_ids"].shape[1] == 16
