"""The guard, the probe's head check and the split test, in one process (no ranks needed:
the guard runs on the whole sequence; ``probe(..., guard=True)`` runs it at P = 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.helpers import HF_TINY

transformers = pytest.importorskip("transformers")
from ulysses_cp.models import hf  # noqa: E402
from ulysses_cp.models.hf_guard import probe  # noqa: E402
from ulysses_cp.models.hf_head import candidates  # noqa: E402
from ulysses_cp.models.hf_split import split_test  # noqa: E402

N = 40


class CausalConv(nn.Module):
    """A depthwise causal convolution over the sequence, as in Mamba or LFM2."""

    def __init__(self, d: int = 8, k: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)

    def forward(self, x):  # (b, s, d)
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class Mean(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)  # a statistic over the sequence


class Shift(nn.Module):
    def forward(self, x):
        return x + F.pad(x, (0, 0, 1, 0))[:, :-1]  # token shift (RWKV)


class Fixed(nn.Module):
    def forward(self, x):
        assert x.shape[1] == N, "runs on the whole sequence only"
        return x


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


@pytest.mark.parametrize(
    "module,verdict",
    [
        (MLP(), None),
        (nn.LayerNorm(8), None),
        (CausalConv(), "mixes tokens"),
        (Mean(), "mixes tokens"),
        (Shift(), "mixes tokens"),
        (Fixed(), "cannot run on part of the sequence"),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, nn.Module) else str(x),
)
def test_split_test_tells_per_token_modules_from_token_mixers(module, verdict):
    x = torch.randn(1, N, 8, dtype=torch.float64)
    found = split_test(module.double(), (x,), {}, N)
    if verdict is None:
        assert found is None
    else:
        assert found is not None and verdict in found


def _wrap(cfg, dtype=torch.float64):
    topo = ucp.init_topology(1, 1)
    hf.register_attention(topo, backend="math")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="ulysses_cp", dtype=dtype
    )
    return hf.HFCausalLM(model)


def _refusal(cfg, dtype=torch.float64) -> str:
    with pytest.raises(ValueError) as info:
        probe(_wrap(cfg, dtype), None, guard=True)
    return str(info.value)


def test_the_guard_passes_attention_models():
    result = probe(_wrap(transformers.LlamaConfig(**HF_TINY)), None, guard=True)
    assert result.attention_modules == 2 and result.split_tested >= 4  # MLPs, norms, rotary


# token mixers the package has no sequence-parallel version of (the zoo's tiny configs);
# the adapted ones (LFM2, Qwen3-Next, Bamba...) are in tests/distributed/test_hf_mixers.py
UNADAPTED = {
    "recurrent_gemma": "(RecurrentGemmaRecurrentBlock) mixes tokens",
    "lfm3": "(Lfm3ShortConv) mixes tokens",
    "olmo_hybrid": "(OlmoHybridGatedDeltaNet) mixes tokens",
}


@pytest.mark.parametrize("family", list(UNADAPTED))
def test_the_guard_names_token_mixers_outside_attention(family):
    from tests.support.hf_zoo import FAMILIES, tiny_config

    message = _refusal(tiny_config(family), FAMILIES[family].dtype)
    assert UNADAPTED[family] in message and "Way out" in message


def test_adapted_mixers_pass_the_guard():
    """The same guard passes LFM2 once its convolutions have their SP forward."""
    cfg = transformers.Lfm2Config(**{**HF_TINY, "layer_types": ["conv", "full_attention"]})
    result = probe(_wrap(cfg), None, guard=True)
    assert result.attention_modules == 1


def test_the_guard_refuses_attention_outside_the_interface():
    cfg = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4)
    message = _refusal(cfg)
    assert "without calling the attention interface" in message
    assert "BloomAttention" in message  # and it names the module that mixes tokens


@pytest.mark.parametrize(
    "cfg,source",
    [
        (lambda: transformers.LlamaConfig(**HF_TINY), "lm_head(hidden)"),
        (lambda: transformers.CohereConfig(**HF_TINY, logit_scale=0.25), "* config.logit_scale"),
        (lambda: transformers.GraniteConfig(**HF_TINY, logits_scaling=4.0), "/ config.logits_"),
        (lambda: transformers.HyperCLOVAXConfig(**HF_TINY, logits_scaling=4.0), "* config.logits_"),
        (
            lambda: transformers.Gemma2Config(**HF_TINY, head_dim=8, final_logit_softcapping=2.0),
            "softcap 2.0",
        ),
    ],
    ids=["llama", "cohere", "granite", "hyperclovax", "gemma2"],
)
def test_the_head_is_the_models_own(cfg, source):
    """Granite divides by ``logits_scaling`` and HyperCLOVA X multiplies by a field of the
    same name: the probe picks what the model's own forward does."""
    wrapped = _wrap(cfg())
    result = wrapped.probe()
    assert source in result.head.source
    ids = torch.randint(96, (1, 24))
    want = wrapped.model(input_ids=ids).logits
    got = wrapped(ids, torch.arange(24)[None])
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12)


def test_an_unknown_head_is_refused():
    wrapped = _wrap(transformers.LlamaConfig(**HF_TINY))
    forward = type(wrapped.model).forward

    def biased(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits + 0.5  # a logit bias of no known name
        return out

    wrapped.model.forward = biased.__get__(wrapped.model)
    with pytest.raises(ValueError, match="post-processes its logits"):
        wrapped.probe()
    assert [c.source for c in candidates(wrapped.model)] == ["lm_head(hidden)"]
