"""Conformance: a tiny random model of each family under Ulysses, ring and hybrid gives the
single-process loss and, summed over the ranks, the single-process gradients of the same
model run with transformers' own ``"eager"`` attention (the reference, independent of
ulysses_cp's kernels). Sliding windows (per layer), softcap and sinks included."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import HF_TINY, hf_loss_and_grads, hf_pair, topology

transformers = pytest.importorskip("transformers")

# sliding (window 8) then full attention layers, heads of 8
SLIDING = dict(head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
# family: (config class name, extra config, what it exercises); a window of 8 tokens
# crosses the zigzag chunks of a 64-token row over 4 ranks (8 chunks of 8)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "full attention"),
    "qwen2": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "sliding window on the layers from max_window_layers on",
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=16), "q/k norms, explicit head_dim"),
    "mistral": ("MistralConfig", dict(sliding_window=8), "sliding window on every layer"),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=8,
            sliding_window=8,
            attn_logit_softcapping=0.01,  # below the scores: the cap bites
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        ),
        "softcap, alternating sliding and full layers, query_pre_attn_scalar",
    ),
    "gemma3": ("Gemma3TextConfig", SLIDING, "sliding pattern, q/k norms"),
    "gpt_oss": (
        "GptOssConfig",
        dict(SLIDING, num_local_experts=4, num_experts_per_tok=2),
        "attention sinks, sliding and full layers, MoE (float32: its kernels take no float64)",
    ),
    "phi3": ("Phi3Config", dict(pad_token_id=0), "fused qkv projection"),
    "olmo2": ("Olmo2Config", dict(pad_token_id=0, eos_token_id=1), "q/k norms after projection"),
}
FLOAT32 = {"gpt_oss"}
MODES = [(4, 1), (1, 4), (2, 2)]


def family_config(family: str):
    cls, extra, _ = FAMILIES[family]
    return getattr(transformers, cls)(**{**HF_TINY, **extra})


def _equal_to_eager(rank, u, r, family):
    topo = topology(u, r, "zigzag")
    dtype = torch.float32 if family in FLOAT32 else torch.float64
    sp, ref = hf_pair(family_config(family), topo, reference_attention="eager", dtype=dtype)
    ids = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, ref_loss, grads = hf_loss_and_grads(sp, ref, topo, ids, dtype)
    worst = {"loss": abs(loss.item() - ref_loss.item())}
    for name, (grad, want) in grads.items():
        worst[name] = (grad - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    return worst, loss.item(), ref_loss.item(), grads


@pytest.mark.parametrize("u,r", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_under_sp_equals_eager(pools, family, u, r):
    """transformers' eager attention takes its softmax in float32 (``softmax(...,
    dtype=float32)``), so even a float64 model agrees with it to about 1e-7 of the largest
    gradient entry, not to float64 precision: the bound is 1e-5 relative to the largest
    entry of each gradient (1e-4 for the float32 family). A 2x gradient is off by 1."""
    results = pools(u * r).run(_equal_to_eager, u, r, family)
    bound = 1e-4 if family in FLOAT32 else 1e-5
    for worst, loss, ref_loss, _ in results:
        assert loss == pytest.approx(ref_loss, rel=bound)
        bad = {name: err for name, err in worst.items() if err > bound}
        assert not bad, bad
