"""The Trainer integration accepts and refuses the families the Hugging Face path does:
its probe is the path's own, so a refusal is the same error, on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import HF_TINY

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.distributed

BLOCK = {"ulysses_degree": 2, "ring_degree": 1, "attention_backend": "math"}


def _families() -> dict:
    return {
        # refused: ALiBi mixes positions outside the attention interface
        "bloom": transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4),
        # accepted: the head's logit scale is the model's own
        "cohere": transformers.CohereConfig(**HF_TINY, logit_scale=0.25),
    }


def _verdict(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "accepted"


def _compare(rank: int) -> dict:
    from ulysses_cp.integrations.hf_trainer.run import SequenceParallelRun
    from ulysses_cp.models import hf

    out = {}
    for name, cfg in _families().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        run = SequenceParallelRun.from_block(BLOCK)
        run.attach(model)
        via_trainer = _verdict(run.probe)
        hf.register_attention(run.topo)
        torch.manual_seed(0)  # the same weights: the refusal names measured differences
        path_model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="ulysses_cp"
        )
        via_path = _verdict(lambda m=path_model, t=run.topo: hf.HFCausalLM(m, topo=t).probe())
        out[name] = (via_trainer, via_path)
    return out


def test_the_trainer_refuses_what_the_hf_path_refuses(pools):
    for rank_result in pools(2).run(_compare):
        trainer, path = rank_result["bloom"]
        assert "BloomForCausalLM cannot train exactly" in trainer, trainer
        assert trainer == path
        assert rank_result["cohere"] == ("accepted", "accepted")


def _vision_batch(rank: int) -> str:
    from ulysses_cp.integrations.hf_trainer.run import SequenceParallelRun

    run = SequenceParallelRun.from_block(BLOCK)
    ids = torch.arange(16)[None]
    batch = {"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(4, 12)}
    batch["image_grid_thw"] = torch.tensor([[1, 2, 2]])
    return _verdict(lambda: run.shard(batch))


def test_an_image_batch_is_refused_naming_the_images(pools):
    """Qwen2.5-VL's batch keys for a model without a vision tower: refused on every rank
    (tests/distributed/test_hf_vlm_images.py trains the families that have one)."""
    messages = pools(2).run(_vision_batch)
    assert len(set(messages)) == 1
    assert "['image_grid_thw', 'pixel_values']" in messages[0], messages[0]
    assert "the model has no vision tower" in messages[0]
