"""core.flops.model_flops against PyTorch's own FLOP counter on a real model's step."""

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from ulysses_cp.core.flops import model_flops


def _tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",  # its matmuls are visible to the counter
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_model_flops_equal_torch_counter_on_a_llama_step():
    """Forward and backward of transformers' Llama, counted by ``FlopCounterMode``: every
    matmul, the full (unmasked) score matrix, as eager attention computes it."""
    model, n, b = _tiny_llama(), 48, 2
    ids = torch.randint(0, 256, (b, n))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    ours = model_flops(
        matmul_params=linear,
        attention_layers=2,
        hq=4,
        head_dim=16,
        seq_len=n,
        batch=b,
        causal=False,
    )
    assert ours == counter.get_total_flops()


def test_causal_halves_attention_and_sp_divides_everything():
    kw = dict(matmul_params=0, attention_layers=3, hq=8, head_dim=64, seq_len=1024)
    full, causal = model_flops(**kw, causal=False), model_flops(**kw)
    assert causal == full / 2 == 6 * 1024**2 * 8 * 64 * 3
    both = dict(kw, matmul_params=1000)
    assert model_flops(**both, sp=4) == model_flops(**both) / 4


def test_bad_counts_refused():
    with pytest.raises(ValueError, match="sp 0"):
        model_flops(matmul_params=1, attention_layers=1, hq=1, head_dim=1, seq_len=8, sp=0)
