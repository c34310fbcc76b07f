"""The planner knows hybrid models: which layers attend, which mix tokens with an adapter
(how many channels their all-to-alls carry), and the bytes of a training step, equal to
the counters of a step measured here (tiny Qwen3-Next, Bamba, Jamba and Kimi Linear, the
shipped configs).

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_plan_hybrid.py.
"""

from __future__ import annotations

from dataclasses import replace

from tests.distributed.test_plan_hybrid import CONFIGS
from ulysses_cp.config import HFModelConfig
from ulysses_cp.plan.comm import mixer_bytes
from ulysses_cp.plan.shapes import MixerShape, model_shape


def test_the_shape_of_a_hybrid_model():
    qwen = model_shape(HFModelConfig(hf_config=CONFIGS["qwen3_next"]))
    assert qwen.layers == 4 and qwen.n_attention == 1
    # 4 key heads x 16, 8 value heads x 16: q, k, v and b, a per value head out, v back
    assert qwen.mixers == (MixerShape(3, 2 * 64 + 128 + 16, 128),)
    bamba = model_shape(HFModelConfig(hf_config=CONFIGS["bamba"]))
    assert bamba.n_attention == 1
    # 8 heads x 16 and dt out, B and C (2 x 16 per group, 2 groups) with them, 128 back
    assert bamba.mixers == (MixerShape(3, 128 + 8, 128, 32, 2),)
    assert bamba.mixers[0].channels(4) == (136 + 4 * 32, 128)  # a group goes to 2 ranks
    jamba = model_shape(HFModelConfig(hf_config=CONFIGS["jamba"]))
    assert jamba.n_attention == 1
    # Mamba1: 128 channels out and back; dt_rank 8 + B and C 2 x 16 all-reduced
    assert jamba.mixers == (MixerShape(3, 128, 128, reduced=8 + 2 * 16),)
    kimi = model_shape(HFModelConfig(hf_config=CONFIGS["kimi_linear"]))
    # KDA, 4 heads x 16: q, k, v, the forget gate's projection and beta out, values back;
    # its MLA attention: q/k 16 + 8 wide, values 16
    assert kimi.mixers == (MixerShape(3, 4 * 64 + 4, 64),) and kimi.n_attention == 1
    assert (kimi.head_dim, kimi.dv) == (24, 16)


def test_mixer_bytes_follow_the_degree_and_checkpointing():
    shape = model_shape(HFModelConfig(hf_config=CONFIGS["bamba"]))
    kw = dict(seq_len=1024, batch=1)
    assert mixer_bytes(shape, sp=1, **kw) == 0
    two = mixer_bytes(shape, sp=2, **kw)
    assert two == 3 * 2 * (512 * (136 + 64 + 128) // 2) * 4
    assert mixer_bytes(replace(shape, activation_checkpointing=True), sp=2, **kw) == two * 3 // 2
    jamba = model_shape(HFModelConfig(hf_config=CONFIGS["jamba"]))
    # the all-to-alls of 512 tokens, and the all-reduce of all 1024 tokens' 40 numbers
    a2a, reduce = 512 * (128 + 128) // 2, 2 * 1 * 1024 * 40 // 2
    assert mixer_bytes(jamba, sp=2, **kw) == 3 * 2 * (a2a + reduce) * 4
