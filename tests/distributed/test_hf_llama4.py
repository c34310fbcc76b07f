"""Llama 4 under sequence parallelism: the chunked-attention layers (chunks are documents
for them, moved there by ``core.relayout``) and the NoPE layers' temperature from global
positions, against transformers' eager model; and the relayout itself."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import (
    HF_TINY,
    assert_same_loss_and_grads,
    hf_loss_and_grads,
    hf_packed_loss_and_grads,
    hf_pair,
    topology,
)
from ulysses_cp.core.relayout import Relayout, chunk_bounds
from ulysses_cp.core.varlen import doc_layout_indices

transformers = pytest.importorskip("transformers")
from ulysses_cp.models import hf  # noqa: E402


def llama4_config(**extra):
    """Layer 0 chunked (RoPE, chunks of 16), layer 1 NoPE full attention with temperature
    tuning from position 3 on (floor_scale 4): a 64-token row crosses 4 chunks."""
    return transformers.Llama4TextConfig(
        **{
            **HF_TINY,
            "head_dim": 8,
            "attention_chunk_size": 16,
            "floor_scale": 4,
            "attn_scale": 0.5,
            "attn_temperature_tuning": True,
            "no_rope_layers": [1, 0],
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 64,
            "moe_layers": [],
            **extra,
        }
    )


def _models(topo, **extra):
    return hf_pair(llama4_config(**extra), topo, reference_attention="eager")


def _rows(rank, u, r, layout):
    topo = topology(u, r, layout)
    sp, ref = _models(topo)
    ids = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, ref_loss, grads = hf_loss_and_grads(sp, ref, topo, ids)
    assert_same_loss_and_grads(loss, ref_loss, grads)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("u,r", [(4, 1), (1, 4), (2, 2)], ids=str)
def test_llama4_rows_equal_eager(pools, u, r, layout):
    pools(u * r).run(_rows, u, r, layout)


def _packed(rank, u, r, packing="document"):
    """Documents of 24 and 40 tokens in one row: chunks start at each document's start
    (24 = 16 + 8, 40 = 16 + 16 + 8) and the temperature counts each document's positions,
    as when each document runs alone. Row-wise: 21 and 37 tokens, the row padded to 64,
    chunks and documents crossing rank borders, no relayout."""
    topo = topology(u, r, packing=packing)
    sp, ref = _models(topo)
    g = torch.Generator().manual_seed(2)
    lengths = (24, 40) if packing == "document" else (21, 37)
    docs = [torch.randint(96, (n,), generator=g) for n in lengths]
    loss, ref_loss, grads = hf_packed_loss_and_grads(sp, ref, topo, docs)
    assert_same_loss_and_grads(loss, ref_loss, grads)


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)], ids=str)
def test_llama4_packed_documents_equal_documents_alone(pools, u, r):
    pools(u * r).run(_packed, u, r)


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)], ids=str)
def test_llama4_row_packed_documents_equal_documents_alone(pools, u, r):
    pools(u * r).run(_packed, u, r, "row")


def _chunk_not_a_multiple(rank):
    topo = topology(4, 1)
    sp, _ = _models(topo, attention_chunk_size=12)  # 12 is no multiple of 2P = 8
    ids = torch.randint(96, (1, 64))
    local = hf.shard_batch({"input_ids": ids, "labels": ids}, topo)
    with pytest.raises(ValueError) as info:
        hf.HFCausalLM(sp)(local["input_ids"], local["position_ids"])
    return str(info.value)


def test_a_chunk_size_the_layout_cannot_split_is_refused_on_every_rank(pools):
    messages = pools(4).run(_chunk_not_a_multiple)
    assert len(set(messages)) == 1
    assert "attention_chunk_size 12" in messages[0] and "multiples of 8" in messages[0]


def _relayout(rank, layout):
    """A token tensor sharded by the row's documents, moved, is the same tensor sharded by
    the chunks' documents; moved back, the original; the backward is the move back."""
    topo = topology(4, 1, layout)
    bounds = [0, 24, 64]
    inner = chunk_bounds(bounds, 16)
    x = torch.arange(2 * 64, dtype=torch.float64).reshape(2, 64).T[None]  # (1, 64, 2)
    mine = x[:, doc_layout_indices(bounds, 4, topo.sp_rank, layout)]
    want = x[:, doc_layout_indices(inner, 4, topo.sp_rank, layout)]
    move = Relayout(bounds, inner, P=4, rank=topo.sp_rank, layout=layout, group=topo.sp_group)
    mine.requires_grad_()
    moved = move(mine)
    assert torch.equal(moved, want)
    assert torch.equal(move.back(moved), mine)
    weight = torch.randn(moved.shape, generator=torch.Generator().manual_seed(rank))
    (moved * weight).sum().backward()
    assert torch.equal(mine.grad, move.back(weight))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_relayout_moves_tokens_between_document_layouts(pools, layout):
    pools(4).run(_relayout, layout)
