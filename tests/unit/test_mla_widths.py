"""Values of their own head dim (MLA: DeepSeek-V3's q/k heads are 128 + 64 RoPE = 192 wide,
its values 128), exact in every mode, layout, packing, window and head-chunk setting.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_mla_widths.py.
"""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import make_qkv, reference
from tests.unit.test_flash_contract import install, uninstall
from ulysses_cp.kernels import widths
from ulysses_cp.kernels.dispatch import local_attention


def test_padding_switched_off_is_seen_failing(monkeypatch):
    """Without :mod:`ulysses_cp.kernels.widths` torch's kernel gets v at its own width and
    the result is wrong or refused: the padding is what makes the torch backend exact."""
    q, k, v, dout = make_qkv(seed=3, b=1, s=16, hq=2, hkv=2, d=12, dv=8)
    want = reference(q, k, v, dout)[0]
    got = local_attention(q, k, v, backend="torch")
    torch.testing.assert_close(got, want)
    monkeypatch.setattr(widths, "forward", lambda fn, *args: fn(*args))
    with pytest.raises((RuntimeError, AssertionError)):
        torch.testing.assert_close(local_attention(q, k, v, backend="torch"), want)


def test_mismatched_value_shapes_are_refused():
    topo = ucp.init_topology(1, 1)
    q, k, v, _ = make_qkv(seed=1, b=1, s=8, hq=2, hkv=2, d=8, dv=4)
    with pytest.raises(ValueError, match=r"must agree in batch, seq and heads"):
        ucp.attention(q, k, v[:, :4], topo, backend="math")


def test_flash_attn_2_refuses_values_of_another_width_unpadded(monkeypatch):
    install("2.8.3", "plain")
    try:
        q, k, v, _ = (t.bfloat16() for t in make_qkv(seed=2, b=1, s=16, hq=2, hkv=2, d=24, dv=16))
        assert local_attention(q, k, v, backend="flash_attn").shape == (1, 16, 2, 16)
        monkeypatch.setattr(widths, "forward", lambda fn, *args: fn(*args))
        with pytest.raises(RuntimeError, match="v must have shape"):
            local_attention(q, k, v, backend="flash_attn")
    finally:
        uninstall()


def test_the_planner_reads_mla_widths():
    """The planner's shape of a DeepSeek-V3 config: q/k heads 128 + 64 wide, values 128
    (not the config's ``head_dim``, which is the RoPE part)."""
    transformers = pytest.importorskip("transformers")
    from ulysses_cp.models.flop_count import head_dims

    cfg = transformers.DeepseekV3Config(
        num_attention_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    assert head_dims(cfg, 128) == (192, 128)
    assert head_dims(transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32), 32) == (
        128,
        128,
    )
