"""Hugging Face causal LMs under SP equal the single-process sdpa model; refusals."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import (
    HF_TINY,
    HF_TOL,
    assert_same_loss_and_grads,
    hf_loss_and_grads,
    hf_packed_loss_and_grads,
    hf_pair,
    topology,
)

transformers = pytest.importorskip("transformers")
from ulysses_cp.core.batch import shard_batch  # noqa: E402
from ulysses_cp.models import hf  # noqa: E402


def tiny_config(family: str, **extra):
    common = HF_TINY
    if family == "llama":
        return transformers.LlamaConfig(**{**common, **extra})
    # Qwen3: explicit head_dim (16 * 4 heads != hidden 32) and q/k norms
    return transformers.Qwen3Config(**{**common, "head_dim": 16, **extra})


def models(family: str, topo, backend="math", **extra):
    """(SP model, single-process sdpa reference) with the same float64 weights."""
    return hf_pair(tiny_config(family, **extra), topo, backend)


def _equal_to_single_process(rank, u, r, family):
    topo = topology(u, r)
    sp, ref = models(family, topo)
    ids = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, ref_loss, grads = hf_loss_and_grads(sp, ref, topo, ids)
    errs = {"loss": abs(loss.item() - ref_loss.item())}
    worst = 0.0
    for name, (grad, want) in grads.items():
        torch.testing.assert_close(grad, want, **HF_TOL, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, (grad - want).abs().max().item())
    torch.testing.assert_close(loss, ref_loss, **HF_TOL)
    errs["grad"] = worst
    return errs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("u,r", [(4, 1), (1, 4), (2, 2)])
def test_hf_model_under_sp_equals_single_process_sdpa(pools, family, u, r):
    pools(u * r).run(_equal_to_single_process, u, r, family)


def _refusals(rank):
    topo = topology(2, 1)
    ids = torch.randint(96, (1, 16), generator=torch.Generator().manual_seed(0))
    local = shard_batch({"input_ids": ids}, topo, "zigzag")
    args = (local["input_ids"], local["position_ids"])
    out = {}

    def error(fn):
        with pytest.raises(ValueError) as info:
            fn()
        return str(info.value)

    hf.register_attention(topo)
    drop, _ = models("llama", topo, attention_dropout=0.1)
    out["dropout"] = error(lambda: hf.HFCausalLM(drop.train())(*args))
    plain, _ = models("llama", topo)
    out["position_ids"] = error(lambda: hf.HFCausalLM(plain)(local["input_ids"]))
    local_pos = torch.arange(8)[None]
    out["local_positions"] = error(
        lambda: hf.HFCausalLM(plain, topo=topo)(local["input_ids"], local_pos)
    )
    q = torch.zeros(1, 4, 8, 8)
    fn = transformers.AttentionInterface()["ulysses_cp"]
    out["window"] = error(
        lambda: fn(plain.model.layers[0].self_attn, q, q, q, None, sliding_window=0)
    )
    out["mask"] = error(
        lambda: fn(plain.model.layers[0].self_attn, q, q, q, torch.ones(1, 1, 8, 8))
    )
    bloom = transformers.AutoModelForCausalLM.from_config(
        transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4),
        attn_implementation="ulysses_cp",
    )
    out["alibi"] = error(lambda: hf.HFCausalLM(bloom)(*args))
    sdpa = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa"
    )
    out["implementation"] = error(lambda: hf.HFCausalLM(sdpa))
    return out


def test_what_cannot_be_honoured_is_refused(pools):
    out = pools(2).run(_refusals)[0]
    assert "sliding_window=0" in out["window"]
    assert "attention dropout 0.1" in out["dropout"]
    assert "position_ids are required" in out["position_ids"]
    assert "look local" in out["local_positions"]
    assert "an attention mask" in out["mask"]
    assert "BloomForCausalLM cannot train exactly" in out["alibi"]
    assert "without calling the attention interface" in out["alibi"]
    assert "attn_implementation='sdpa'" in out["implementation"]


def _packed(rank):
    """Packed documents under hybrid SP equal the documents run one by one with sdpa."""
    topo = topology(2, 2)
    sp, ref = models("llama", topo)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(96, (n,), generator=g) for n in (5, 9, 3, 20)]
    loss, ref_loss, grads = hf_packed_loss_and_grads(sp, ref, topo, docs)
    assert_same_loss_and_grads(loss, ref_loss, grads)


def test_hf_packed_documents_under_hybrid_sp(pools):
    pools(4).run(_packed)


def _layout_mismatch(rank):
    """The issue's silent case: attention registered in the run's layout (zigzag) and a batch
    sharded contiguous. Now every call that disagrees with the run's layout raises."""
    topo = topology(2, 1)
    hf.register_attention(topo)
    batch = {"input_ids": torch.randint(96, (1, 16)), "labels": torch.randint(96, (1, 16))}
    messages = []
    for call in (
        lambda: hf.shard_batch(batch, topo, layout="contiguous"),
        lambda: hf.register_attention(topo, layout="contiguous"),
    ):
        with pytest.raises(ValueError, match="disagrees with the run's layout 'zigzag'") as info:
            call()
        messages.append(str(info.value))
    return messages


def test_a_layout_that_disagrees_with_the_run_raises_on_every_rank(pools):
    first, second = pools(2).run(_layout_mismatch)
    assert first == second
