"""Hugging Face causal LMs under SP equal the single-process sdpa model; refusals.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_hf import tiny_config, transformers
from ulysses_cp.config import HFModelConfig
from ulysses_cp.models import hf


def test_hf_config_block_and_local_configs(tmp_path):
    mc = HFModelConfig.from_dict({"hf_config": "configs/hf/tiny_qwen3.json", "tiled_mlp": 2})
    assert hf.heads(hf.load_config(mc.hf_config)) == (4, 2)
    cfg = hf.load_config({"model_type": "llama", "num_attention_heads": 8, "hidden_size": 64})
    assert cfg.num_attention_heads == 8
    with pytest.raises(ValueError, match="not found"):
        hf.load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="model_type"):
        hf.load_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="unknown keys"):
        HFModelConfig.from_dict({"hf_config": "x", "tiled": 2})
    with pytest.raises(ValueError, match=r"needs model\.activation_checkpointing"):
        HFModelConfig.from_dict({"hf_config": "x", "offload_activations": True})


def test_a_vision_language_config_is_read_from_its_language_model():
    """train.py and the planner read a VLM's heads, MLP width and vocabulary from its
    text_config, and build it with its image-text class (the vision tower included)."""
    from ulysses_cp.models.hf_vision import auto_class
    from ulysses_cp.plan.shapes import model_shape
    from ulysses_cp.training.build import model_counts

    mc = HFModelConfig.from_dict({"hf_config": "configs/hf/tiny_qwen2_5_vl.json"})
    cfg = hf.load_config(mc.hf_config)
    assert (hf.heads(cfg), hf.ffn_width(cfg)) == ((4, 2), 128)
    assert auto_class(cfg).__name__ == "AutoModelForImageTextToText"
    # a multimodal config AutoModelForCausalLM knows keeps its causal-LM class (the sweep's)
    phi4 = hf.load_config({"model_type": "phi4_multimodal"})
    assert auto_class(phi4).__name__ == "AutoModelForCausalLM"
    assert model_counts(mc) == (4, 2, 256)
    shape = model_shape(mc)
    assert (shape.vocab, shape.dim, shape.layers, shape.ffn) == (256, 64, 2, 128)


def test_local_weights_and_set_attn_implementation(tmp_path):
    """hf_weights loads a local save_pretrained folder; an existing model can switch to
    ulysses_cp attention with set_attn_implementation."""
    import ulysses_cp as ucp

    topo = ucp.init_topology(1, 1)
    torch.manual_seed(3)
    saved = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    saved.save_pretrained(tmp_path / "weights")
    (tmp_path / "config.json").write_text(saved.config.to_json_string())
    mc = HFModelConfig(hf_config=str(tmp_path), hf_weights=str(tmp_path / "weights"))
    model = hf.build_model(topo, mc, backend="math")
    for (name, a), b in zip(model.model.named_parameters(), saved.parameters()):
        assert torch.equal(a, b), name
    ids = torch.randint(96, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        expected = saved(input_ids=ids, position_ids=pos).logits
        torch.testing.assert_close(model(ids, pos), expected, rtol=1e-5, atol=1e-5)
    saved.set_attn_implementation("ulysses_cp")
    with torch.no_grad():
        torch.testing.assert_close(hf.HFCausalLM(saved)(ids, pos), expected, rtol=1e-5, atol=1e-5)
