"""``"model": {"compile": true}``: each decoder layer under ``torch.compile`` (CPU inductor,
float32) gives the eager loss and, per parameter, the eager gradients (nonzero) under
Ulysses, ring and hybrid, for the reference decoder and a tiny Hugging Face Llama; a
Ulysses layer is one graph (no break), ring and hybrid break exactly around the ring call;
the all-to-all byte counters count a compiled step as an eager one. Compiling is slow on
two CPU cores: one test per mode, both models in it.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_compile.py.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_compile import TINY_LLAMA
from ulysses_cp.config import HFModelConfig, ModelConfig, model_config


def test_compile_must_be_a_bool():
    assert ModelConfig.from_dict({"compile": True}).compile is True
    assert ModelConfig.from_dict({}).compile is False
    with pytest.raises(ValueError, match=r"model\.compile must be true or false, got 1"):
        ModelConfig.from_dict({"compile": 1})
    with pytest.raises(ValueError, match=r"model\.compile must be true or false, got 'yes'"):
        model_config({"hf_config": TINY_LLAMA, "compile": "yes"})
    assert isinstance(model_config({"hf_config": TINY_LLAMA, "compile": True}), HFModelConfig)
