"""A Hugging Face model built partitioned under ZeRO-3 (``training/loading.py``) equals the
whole-model build: the same parameters (gathered) and the same first step, from a sharded
safetensors checkpoint and from a seed, and the same generator state after the build.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_loading.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_loading import CONFIG, _config, _same, _save_checkpoint, _step, transformers
from ulysses_cp.training import loading


def test_streamed_safetensors_equal_the_whole_load(pools, tmp_path):
    weights = _save_checkpoint(tmp_path)
    shards = sorted(p.name for p in weights.glob("*.safetensors"))
    assert len(shards) >= 3 and (weights / loading.INDEX).is_file()
    cfg = _config(tmp_path, str(weights))
    whole = pools(2).run(_step, cfg, False, 0)
    part = pools(2).run(_step, cfg, True, 0)
    _same(whole, part)
    # the weights are the checkpoint's (not a seed's)
    saved = transformers.AutoModelForCausalLM.from_pretrained(weights)
    assert torch.equal(part[0][0][0], next(saved.parameters()).detach())


@pytest.mark.parametrize(
    "block_bytes, extra",
    [
        (None, {}),  # each parameter in one block
        # 40-byte blocks: the 97 x 18 embedding in 8-row blocks (a last one of 9), the 33
        # biases in blocks of 16 and 17, partition edges inside blocks; a padding row makes
        # the embedding's init index a row: that module falls back to gathering
        (40, {"pad_token_id": 3}),
    ],
)
def test_random_init_equals_the_whole_init_of_the_same_seed(pools, tmp_path, block_bytes, extra):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **extra}))
    cfg = _config(tmp_path)
    whole = pools(2).run(_step, cfg, False, 3)
    part = pools(2).run(_step, cfg, True, 3, block_bytes)
    _same(whole, part)
    assert not torch.equal(whole[0][0][1], whole[1][0][0][1] * 0)  # not all zeros
