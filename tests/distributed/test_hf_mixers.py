"""Hybrid token mixers under sequence parallelism: the channel exchange, packed documents
(each starts a fresh state), refusals of head counts that do not split, and the bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.helpers import HF_TINY, hf_packed_loss_and_grads, hf_pair, topology
from tests.support.hf_zoo import tiny_config, wake_zero_params_
from ulysses_cp.core.comm import stats
from ulysses_cp.core.varlen import doc_layout_indices
from ulysses_cp.modes.mixer import MixerExchange, split_channels

transformers = pytest.importorskip("transformers")
from ulysses_cp.models import hf  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-10)


def lfm2():
    return transformers.Lfm2Config(**{**HF_TINY, "layer_types": ["conv", "full_attention"]})


def bamba():
    """8 Mamba2 heads in 2 B/C groups (split with the heads at P = 2, shared at P = 4)."""
    return transformers.BambaConfig(
        **HF_TINY,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
    )


def jamba():
    """Mamba1 (64 channels, dt rank 4, state 8) then attention; dense MLPs. Its decoder
    layer calls the mixer without the batch: packed rows are refused."""
    return transformers.JambaConfig(
        **HF_TINY,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        mamba_d_state=8,
        mamba_dt_rank=4,
        mamba_expand=2,
    )


def zamba():
    """Zamba's multi-head Mamba1 (4 heads of 16 channels), then two hybrid layers (the
    shared attention block)."""
    return transformers.ZambaConfig(
        **{**HF_TINY, "num_hidden_layers": 3},
        layers_block_type=["mamba", "hybrid", "hybrid"],
        n_mamba_heads=4,
        attention_head_dim=16,
        mamba_d_state=8,
    )


def qwen3_next(k_heads=4):
    return transformers.Qwen3NextConfig(
        **HF_TINY,
        head_dim=8,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1],
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )


def kimi_linear():
    """KDA (4 heads of 8) then MLA attention (the zoo's tiny Kimi Linear)."""
    return tiny_config("kimi_linear")


def minimax():
    """Lightning attention in blocks of 16 (a 32-token document spans two), then softmax
    attention (the zoo's tiny MiniMax)."""
    return tiny_config("minimax")


FAMILIES = {
    "lfm2": lfm2,
    "bamba": bamba,
    "qwen3_next": qwen3_next,
    "zamba": zamba,
    "kimi_linear": kimi_linear,
    "minimax": minimax,
}


def _exchange(rank, layout, packed):
    """to_channels gives the full tensor's channels of this rank in natural order;
    from_channels is its inverse; gradients come back to the sending ranks."""
    topo = topology(2, 2, layout)
    P, s, C = 4, 32, 8
    full = torch.randn(2 if not packed else 1, s, C, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 8, 32], dtype=torch.int32) if packed else None
    bounds = [0, 8, 32] if packed else [0, s]
    mine = full[:, doc_layout_indices(bounds, P, topo.sp_rank, layout)].requires_grad_()
    ex = MixerExchange(topo, s // P, cu)
    index = split_channels([torch.arange(C).view(C, 1)], P, "channels")
    got = ex.to_channels(mine, index)
    assert torch.equal(got, full[..., index[topo.sp_rank]])
    back = ex.from_channels(got)
    assert torch.equal(back, mine)
    (back * 3).sum().backward()
    assert torch.equal(mine.grad, torch.full_like(mine, 3.0))
    assert ex.documents() == list(itertools.pairwise(bounds))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_exchange_moves_channels_and_back(pools, layout, packed):
    pools(4).run(_exchange, layout, packed)


def _packed(rank, u, r, family, packing="document"):
    """A packed row equals its documents run alone: no state crosses a document."""
    topo = topology(u, r, packing=packing)
    cfg = FAMILIES[family]()
    sp, ref = hf_pair(cfg, topo)  # sdpa: float64 softmax, where eager takes it in float32
    if family == "zamba":  # its x_proj starts at zero: B = C = 0 would hide the scan
        with torch.no_grad():
            wake_zero_params_(sp, std=0.5)
        ref.load_state_dict(sp.state_dict())
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(96, (n,), generator=g) for n in (13, 32, 8)]
    loss, ref_loss, grads = hf_packed_loss_and_grads(sp, ref, topo, docs)
    # the gated delta rule and KDA compute in float32 inside their kernels
    tol = TOL if family not in ("qwen3_next", "kimi_linear") else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for grad, want in grads.values():
        torch.testing.assert_close(grad, want, **tol)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)], ids=str)
def test_packed_documents_start_fresh_states(pools, family, u, r):
    pools(u * r).run(_packed, u, r, family)


@pytest.mark.parametrize("family", ["lfm2", "bamba", "zamba"])
@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)], ids=str)
def test_row_packed_documents_start_fresh_states(pools, family, u, r):
    """Row-wise packing (13 + 32 + 8 tokens, only the row padded) through the mixers."""
    pools(u * r).run(_packed, u, r, family, "row")


def _packed_rows_of_a_layer_that_drops_the_batch(rank):
    topo = topology(2, 1)
    sp, _ = hf_pair(jamba(), topo)
    docs = [torch.arange(n) % 96 for n in (12, 20)]
    with pytest.raises(ValueError) as info:
        hf_packed_loss_and_grads(sp, sp, topo, docs)
    return str(info.value)


def test_a_mixer_its_layer_calls_without_the_batch_refuses_packed_rows(pools):
    """transformers' Jamba (and Mamba, FalconMamba) layers call the mixer without
    ``**kwargs``: the documents' bounds never reach it, so a packed row is refused."""
    messages = pools(2).run(_packed_rows_of_a_layer_that_drops_the_batch)
    assert len(set(messages)) == 1
    assert "JambaMambaMixer" in messages[0] and "the 2 documents" in messages[0], messages[0]


def _heads_that_do_not_split(rank):
    topo = topology(4, 1)
    hf.register_attention(topo, backend="math")
    model = transformers.AutoModelForCausalLM.from_config(
        qwen3_next(k_heads=2), attn_implementation="ulysses_cp"
    )
    with pytest.raises(ValueError) as info:
        hf.HFCausalLM(model)
    return str(info.value)


def test_head_counts_that_do_not_split_are_refused_with_the_degrees_that_work(pools):
    messages = pools(4).run(_heads_that_do_not_split)
    assert len(set(messages)) == 1
    assert "2 key heads, 8 value heads" in messages[0]
    assert "that work: [1, 2]" in messages[0]


def _bytes(rank):
    """One LFM2 conv layer moves B*x to channels and the result back: two all-to-alls of
    b * s_l * D elements, (P-1)/P of each leaving the rank, in forward and in backward."""
    topo = topology(4, 1)
    cfg = transformers.Lfm2Config(**{**HF_TINY, "layer_types": ["conv"], "num_hidden_layers": 1})
    sp, _ = hf_pair(cfg, topo)
    model = hf.HFCausalLM(sp)
    model.probe()
    ids = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(3))
    local = hf.shard_batch({"input_ids": ids, "labels": ids}, topo)
    stats.reset()
    loss = model.loss(
        local["input_ids"], local["position_ids"], local["shift_labels"], topo, batch=local["batch"]
    )
    forward = stats.total("all_to_all", "forward")
    loss.backward()
    return forward, stats.total("all_to_all", "backward")


def test_mixer_bytes_match_the_formula(pools):
    b, s, D, P, B = 2, 64, 32, 4, 8
    want = 2 * b * (s // P) * D * (P - 1) // P * B
    for forward, backward in pools(4).run(_bytes):
        assert forward == want and backward == want
