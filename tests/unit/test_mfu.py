"""The model FLOPs train.py logs per step (model_tflops, mfu): the shape read from the built
model, the count per causal span against PyTorch's FLOP counter and a mask's pairs, and
the peak table."""

import dataclasses

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from ulysses_cp.config import ModelConfig
from ulysses_cp.core.flops import FlopShape, device_peak_tflops, model_flops, step_flops
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.models.flop_count import flop_shape

CFG = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def _eager(q, k, v):
    """Full (unmasked) attention as plain matmuls the counter sees: ``(b, s, h, d)``."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (
        t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
    )
    return (torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v).transpose(1, 2)


def _norms(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if type(m).__name__.endswith("RMSNorm"))


def test_reference_decoder_shape_from_its_config():
    """Matmul parameters as the config gives them: per layer q/k/v, output, SwiGLU and two
    norms, then the LM head; no input embedding."""
    shape = flop_shape(Decoder(CFG, attn=_eager))
    d, c = CFG.head_dim, CFG
    layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * d + c.n_heads * d * c.dim
    layer += 3 * c.dim * c.ffn_dim + 2 * c.dim
    assert shape == FlopShape(c.n_layers * layer + c.vocab_size * c.dim, 4, d, causal=2)
    # a batch of 3 rows of 40: the planner's count for the same config
    want = model_flops(
        matmul_params=shape.matmul_params, attention_layers=2, hq=4, head_dim=d, seq_len=40, batch=3
    )
    assert step_flops(shape, [40, 40, 40]) == want
    assert step_flops(shape, [40] * 3, sp=4) == want / 4


def test_step_count_equals_torch_counter_on_the_decoders_step():
    """Forward and backward of our decoder under ``FlopCounterMode``: every matmul and the
    full score matrix eager attention computes, i.e. our causal count plus the masked half,
    less the norms' weights (no matmul)."""
    torch.manual_seed(0)
    model, n, b = Decoder(CFG, attn=_eager), 24, 2
    ids = torch.randint(0, CFG.vocab_size, (b, n))
    pos = torch.arange(n).expand(b, n)
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(ids, pos)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    shape = flop_shape(model)
    ours = step_flops(
        dataclasses.replace(shape, matmul_params=shape.matmul_params - _norms(model.layers)),
        [n] * b,
    )
    masked_half = 6 * b * n**2 * CFG.n_heads * CFG.head_dim * CFG.n_layers
    assert ours + masked_half == counter.get_total_flops()


class _Wrapped(torch.nn.Module):
    """What ``flop_shape`` reads of ``HFCausalLM``: the transformers model at ``.model``."""

    def __init__(self, model):
        super().__init__()
        self.model = model


def _meta(cls, **kw):
    with torch.device("meta"):
        return _Wrapped(cls(cls.config_class(**kw)))


def test_hugging_face_shape_tied_head_moe_and_windows():
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4)
    common |= dict(num_key_value_heads=2, num_hidden_layers=3)
    llama = _meta(transformers.LlamaForCausalLM, **common, tie_word_embeddings=True)
    linear = sum(
        m.weight.numel()
        for m in llama.model.model.layers.modules()
        if isinstance(m, torch.nn.Linear)
    )
    shape = flop_shape(llama)  # the tied head counted: its matmul runs
    assert shape.matmul_params == linear + _norms(llama.model.model.layers) + 64 * 32
    assert (shape.hq, shape.head_dim, shape.causal, shape.windows) == (4, 8, 3, ())
    # Mixtral: 8 experts of 3 x 32 x 48, 2 per token; every layer windowed (no layer types)
    mix = _meta(transformers.MixtralForCausalLM, **common, num_local_experts=8, sliding_window=16)
    all_layers = sum(p.numel() for p in mix.model.model.layers.parameters())
    experts = 3 * 8 * 3 * 32 * 48
    assert flop_shape(mix).matmul_params == all_layers - experts + experts * 2 / 8 + 64 * 32
    assert flop_shape(mix).windows == (16,) * 3 and flop_shape(mix).causal == 0
    # Gemma 2: layer types alternate sliding / full
    gemma = _meta(transformers.Gemma2ForCausalLM, **common, head_dim=8, sliding_window=16)
    assert (flop_shape(gemma).windows, flop_shape(gemma).causal) == ((16, 16), 1)


def _mask_pairs(n: int, window: int = 0, chunk: int = 0) -> int:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    seen = j <= i
    if window:
        seen &= i - window < j
    if chunk:
        seen &= i // chunk == j // chunk
    return int(seen.sum())


@pytest.mark.parametrize("n", [5, 16, 37])
def test_windows_and_chunks_count_their_masks_pairs(n):
    """``12 * pairs * hq * d`` per layer, pairs the mask's less the half diagonal (the
    ``N^2 / 2`` convention of a causal layer)."""
    one = FlopShape(0, 1, 1.0)
    causal = step_flops(dataclasses.replace(one, causal=1), [n])
    assert causal == 12 * (_mask_pairs(n) - n / 2)
    for w in (4, 16, 64):
        got = step_flops(dataclasses.replace(one, windows=(w,)), [n])
        assert got == 12 * (_mask_pairs(n, window=w) - min(w, n) / 2)
        got = step_flops(dataclasses.replace(one, chunks=(w,)), [n])
        assert got == 12 * (_mask_pairs(n, chunk=w) - n / 2)


def test_packed_documents_count_each_document():
    shape = flop_shape(Decoder(CFG, attn=_eager))
    one = lambda n: model_flops(  # noqa: E731
        matmul_params=shape.matmul_params, attention_layers=2, hq=4, head_dim=8, seq_len=n
    )
    assert step_flops(shape, [10, 30, 24]) == one(10) + one(30) + one(24) < one(64)


def test_peak_table():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989
    assert device_peak_tflops("NVIDIA H100 PCIe", "torch.float16") == 756
    assert device_peak_tflops("NVIDIA H200", "bfloat16") == 989
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312
    assert device_peak_tflops("NVIDIA B200", "bfloat16") == 2250
    assert device_peak_tflops("NVIDIA L40S", "bfloat16") == 362
    # float32 (TF32 or not), unknown devices, a name that only contains a known one: none
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "float32") is None
    assert device_peak_tflops("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert device_peak_tflops("NVIDIA GB200", "bfloat16") is None
