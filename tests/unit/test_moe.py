"""MoE models under sequence parallelism: the router's load-balancing loss over the whole
sequence, against transformers' own one-process loss (``model(labels=...)`` with
``output_router_logits``: cross-entropy + coefficient x aux) and its gradients, float64;
the loss alone against ``load_balancing_loss_func`` with padding; the terms refused.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_moe.py.
"""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.distributed.test_moe import IDS, _built, moe_config
from tests.support.helpers import shard_loss
from ulysses_cp.models import hf
from ulysses_cp.models.hf_loss_terms import router_aux
from ulysses_cp.models.router_loss import load_balancing_loss


@pytest.mark.unit
def test_load_balancing_loss_equals_transformers_with_padding_and_pieces():
    """One process: the loss of router calls cut in pieces of the sequence (a tiled MLP),
    with a padding mask, equals transformers' function on whole layers; a mask whose
    pieces do not cover whole layers is refused."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    b, s, E, K = 2, 8, 6, 2
    layers = [torch.randn(b, s, E, generator=g, dtype=torch.float64) for _ in range(3)]
    mask = torch.ones(b, s)
    mask[1, 5:] = 0
    want = load_balancing_loss_func(tuple(x.reshape(-1, E) for x in layers), E, K, mask)
    pieces = tuple(p.reshape(-1, E) for x in layers for p in x.chunk(4, dim=1))
    got = load_balancing_loss(pieces, num_experts=E, top_k=K, token_mask=mask)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    unmasked = load_balancing_loss(pieces, num_experts=E, top_k=K)
    assert abs(unmasked - got) > 1e-4  # the mask matters here
    with pytest.raises(ValueError, match="whole layers"):
        load_balancing_loss(pieces[:-1], num_experts=E, top_k=K, token_mask=mask)


@pytest.mark.unit
def test_loss_terms_read_from_the_forward():
    """The coefficient, experts and top-k as each forward reads them (DBRX's coefficient
    lives in ffn_config, JetMoE's is aux_loss_coef); off without output_router_logits; a
    term we do not compute is refused naming it, unless its condition is false."""
    dbrx = router_aux(_built("dbrx", output_router_logits=True))
    assert (dbrx.num_experts, dbrx.top_k, dbrx.coef, dbrx.enabled) == (4, 2, 0.01, True)
    jet = router_aux(_built("jetmoe", output_router_logits=True, aux_loss_coef=0.25))
    assert (jet.coef, jet.enabled) == (0.25, True)
    assert not router_aux(_built("mixtral", output_router_logits=False)).enabled
    assert router_aux(_built("llama")) is None  # nothing beyond the cross-entropy
    assert router_aux(_built("bamba")) is None  # z_loss_coefficient 0: never added
    with pytest.raises(ValueError, match=r"self\.z_loss_coefficient \* z_loss"):
        router_aux(_built("bamba", z_loss_coefficient=0.1))
    # Doge routes over product keys: another loss, refused while on, nothing while off
    with pytest.raises(ValueError, match="DogeForCausalLM adds a router loss"):
        router_aux(_built("doge", output_router_logits=True))
    assert router_aux(_built("doge", output_router_logits=False)) is None


@pytest.mark.unit
def test_gpt_oss_mlp_runs_in_tiles():
    """GPT-OSS's MLP returns its router scores beside the hidden states: in tiles (one row)
    the loss and gradients equal the untiled model's; a batch of rows is refused (the
    scores' rows would not join in token order)."""
    from ulysses_cp.models.memory import tile_mlps

    topo = ucp.init_topology(1, 1)
    hf.register_attention(topo, backend="math")
    torch.manual_seed(0)
    plain = hf.from_config(moe_config("gpt_oss"), dtype=torch.float64)
    tiled = hf.from_config(moe_config("gpt_oss"), dtype=torch.float64)
    tiled.load_state_dict(plain.state_dict())
    assert tile_mlps(tiled, 4) == 2
    results = []
    for model in (plain, tiled):
        local = ucp.shard_batch({"input_ids": IDS[:1], "labels": IDS[:1]}, topo)
        loss = shard_loss(hf.HFCausalLM(model), local, topo)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    for a, b in zip(*results, strict=True):  # its router runs in float32: ~1e-7
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * a.abs().max().item())
    local = ucp.shard_batch({"input_ids": IDS, "labels": IDS}, topo)
    with pytest.raises(ValueError, match="one row per micro batch"):
        shard_loss(hf.HFCausalLM(tiled), local, topo)
