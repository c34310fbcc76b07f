"""The HF zoo (tests/support/hf_zoo.py): it covers every causal-LM model type of transformers,
and every
family in it builds tiny, trains one step in its dtype and has what its note claims."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from tests.support.hf_zoo import (
    EXCLUDED,
    F64,
    FAMILIES,
    config_layer_types,
    tiny_config,
    wake_zero_params_,
)

B, S = 2, 64
MAX_PARAMS = 300_000


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # tiny models: two threads only add synchronisation (about 20x slower on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _attr(cfg: PretrainedConfig, path: str) -> Any:
    value: Any = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _build(model_type: str, cfg: PretrainedConfig) -> torch.nn.Module:
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    kwargs: dict[str, Any] = {"dtype": FAMILIES[model_type].dtype}
    if getattr(cls, "_supports_attention_backend", False):
        kwargs["attn_implementation"] = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, **kwargs)


def test_zoo_covers_every_causal_lm_exactly_once() -> None:
    mapped = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert set(FAMILIES) | set(EXCLUDED) == mapped
    assert not set(FAMILIES) & set(EXCLUDED)
    assert all(reason.strip() and "\n" not in reason for reason in EXCLUDED.values())
    assert all(name == fam.model_type for name, fam in FAMILIES.items())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_builds_tiny_and_trains(model_type: str) -> None:
    fam = FAMILIES[model_type]
    cfg = tiny_config(model_type)
    assert tiny_config(model_type).to_dict() == cfg.to_dict()  # deterministic
    for path, value in fam.checks.items():
        assert _attr(cfg, path) == value, path
    if fam.layer_types:
        assert config_layer_types(cfg) == list(fam.layer_types)

    model = _build(model_type, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params <= MAX_PARAMS
    # some families keep a few parameters (router biases, ...) in float32: the rest is fam.dtype
    in_dtype = sum(p.numel() for p in model.parameters() if p.dtype == fam.dtype)
    assert in_dtype > n_params / 2
    classes = {type(m).__name__ for m in model.modules()}
    for fragment in fam.modules:  # the layer kinds are really built, not only configured
        assert any(fragment in name for name in classes), (fragment, sorted(classes))
    names = [n for n, _ in model.named_parameters()]
    for fragment in fam.params:
        assert any(fragment in n for n in names), fragment

    wake_zero_params_(model)
    vocab = cfg.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    assert takes_positions == fam.position_ids
    kwargs: dict[str, Any] = {"use_cache": False}
    if fam.position_ids:
        kwargs["position_ids"] = torch.arange(S).expand(B, S)
    logits = model(input_ids=ids, **kwargs).logits
    assert logits.shape[:2] == (B, S)
    loss = logits.mean()
    assert torch.isfinite(loss)
    loss.backward()

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    unused = {n for n, _ in trainable if any(f in n for f in fam.no_grad)}
    for fragment in fam.no_grad:  # each claimed-unused part exists
        assert any(fragment in n for n in unused), fragment
    for name, param in trainable:
        grad = param.grad
        if name in unused:
            assert grad is None or not grad.any(), f"{name} is used"
        else:
            assert grad is not None and grad.any(), f"{name} gets no gradient"
            assert torch.isfinite(grad).all(), name


def test_llama4_text_has_chunked_and_temperature_tuned_nope_layers(monkeypatch) -> None:
    from transformers.models.llama4 import modeling_llama4

    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    eager = modeling_llama4.eager_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, query.detach().clone(), attention_mask))
        return eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_llama4, "eager_attention_forward", spy)
    cfg = tiny_config("llama4_text")
    model = _build("llama4_text", cfg)
    chunked, nope = (layer.self_attn for layer in model.model.layers)
    assert chunked.use_rope and not nope.use_rope and nope.attn_temperature_tuning
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(S).expand(B, S)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
        (_, _, chunk_mask), (_, q_tuned, full_mask) = seen
        nope.attn_temperature_tuning = False
        model(input_ids=ids, position_ids=positions, use_cache=False)
    q_plain = seen[3][1]

    # the chunked layer's mask stops at chunk boundaries (16 tokens), the NoPE layer's does not
    c = cfg.attention_chunk_size
    assert chunk_mask[0, 0, c, c - 1] < 0 and chunk_mask[0, 0, c, c] == 0
    assert full_mask[0, 0, c, c - 1] == 0
    # temperature 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) on the NoPE queries:
    # 1 up to position 2, above 1 from position 3 on (floor_scale 4), from arange, not position_ids
    temp = [1 + cfg.attn_scale * math.log1p((p + 1) // cfg.floor_scale) for p in range(S)]
    temperature = torch.tensor(temp, dtype=F64).view(1, 1, S, 1)
    assert temperature[0, 0, :3].eq(1).all() and temperature[0, 0, 3:].gt(1).all()
    torch.testing.assert_close(q_tuned, q_plain * temperature)
