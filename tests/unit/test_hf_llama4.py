"""Llama 4 under sequence parallelism: the chunked-attention layers (chunks are documents
for them, moved there by ``core.relayout``) and the NoPE layers' temperature from global
positions, against transformers' eager model; and the relayout itself.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf_llama4.py.
"""

from __future__ import annotations

import copy

import torch

from tests.distributed.test_hf_llama4 import llama4_config, transformers
from ulysses_cp.core.relayout import chunk_bounds


def test_the_config_exercises_chunks_and_temperature():
    cfg = llama4_config()
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ids = torch.randint(96, (1, 64))
    base = model(input_ids=ids).logits
    for attr, value in (("attention_chunk_size", 10_000), ("attn_temperature_tuning", False)):
        other = copy.deepcopy(cfg)
        setattr(other, attr, value)
        changed = transformers.AutoModelForCausalLM.from_config(other, attn_implementation="eager")
        changed.load_state_dict(model.state_dict())
        assert (changed(input_ids=ids).logits - base).abs().max() > 1e-3, attr


def test_chunk_bounds():
    assert chunk_bounds([0, 24, 64], 16) == [0, 16, 24, 40, 56, 64]
    assert chunk_bounds([0, 8], 16) == [0, 8]
