"""The numbers a step's model FLOPs need (``core.flops.FlopShape``), read from the model a
run built: the reference decoder or a Hugging Face model (``hf.HFCausalLM``), whole or
ZeRO-3 partitioned (parameters at full size).

- matmul parameters: the decoder layers' and the LM head's (the head counted even when
  tied to the input embedding: its matmul runs). Left out: the input embedding (a
  lookup), the final norm and anything beside the decoder stack (a vision encoder, which
  the text tokens do not run through). An MoE layer's routed experts (the parameters under
  a module named ``experts``) count ``num_experts_per_tok / num_experts`` of themselves:
  what a token runs through; shared experts and the router count whole.
- attention layers: from the config's ``layer_types`` where it has them (full, sliding,
  chunked; a hybrid model's mixer layers have no attention), else every decoder layer
  without a hybrid mixer; a sliding layer's window is the config's ``sliding_window``
  (every layer's where the config has no layer types, as Mistral's layers pass it), a
  chunked layer's chunk ``attention_chunk_size`` (Llama 4).
- ``hq`` and the head dim: the mean of the q/k and v head dims (:func:`head_dims`; MLA's
  differ).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..core.flops import FlopShape
from ..core.zero_comm import full_numel

__all__ = ["flop_shape", "head_dims"]

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def head_dims(cfg: Any, hq: int) -> tuple[int, int]:
    """``(q/k head dim, v head dim)`` of a Hugging Face config: MLA's (DeepSeek-V2/V3,
    Kimi-K2, GLM-4.7-Flash, MiniCPM3) are ``qk_nope_head_dim + qk_rope_head_dim`` and
    ``v_head_dim``; others have one ``head_dim`` (or ``hidden_size / heads``)."""
    nope, rope = getattr(cfg, "qk_nope_head_dim", None), getattr(cfg, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        d = nope + rope
    else:
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return d, getattr(cfg, "v_head_dim", None) or d


def flop_shape(model: nn.Module) -> FlopShape:
    """The FLOP shape of ``model`` (module docstring).

    Raises:
        ValueError: An MoE model whose config names no top-k or expert count, or a model
            of neither kind, named.
    """
    from .decoder import Decoder

    if isinstance(model, Decoder):
        cfg = model.cfg
        matmul = full_numel(model.layers.parameters()) + full_numel(model.head.parameters())
        return FlopShape(matmul, cfg.n_heads, cfg.head_dim, causal=cfg.n_layers)
    hf = getattr(model, "model", None)
    if not isinstance(hf, nn.Module) or not hasattr(hf, "config"):
        raise ValueError(f"{type(model).__name__}: neither the reference decoder nor HFCausalLM")
    from .hf import heads
    from .hf_guard import decoder_layers
    from .hf_head import head_module
    from .hf_vision import text_config

    cfg = text_config(hf.config)
    hq = heads(cfg)[0]
    d, dv = head_dims(cfg, hq)
    layers = decoder_layers(hf)[1]
    active = _active_params(layers, cfg) + full_numel(head_module(hf).parameters())
    return FlopShape(active, hq, (d + dv) / 2, **_attention(cfg, layers))


def _active_params(layers: nn.ModuleList, cfg: Any) -> float:
    """The layers' parameters a token runs through: routed experts at top-k of them."""
    routed = sum(
        full_numel(m.parameters())
        for n, m in layers.named_modules()
        if n.split(".")[-1] == "experts"
    )
    total = full_numel(layers.parameters())
    if not routed:
        return total
    k = getattr(cfg, "num_experts_per_tok", None)
    e = next((getattr(cfg, a) for a in _EXPERT_COUNTS if getattr(cfg, a, None)), None)
    if not k or not e:
        raise ValueError(
            f"{type(cfg).__name__}: modules named 'experts' but no num_experts_per_tok "
            f"({k}) or expert count ({' / '.join(_EXPERT_COUNTS)}: {e}) in the config: the "
            f"parameters a token runs through are unknown"
        )
    return total - routed + routed * k / e


def _attention(cfg: Any, layers: nn.ModuleList) -> dict[str, Any]:
    """``FlopShape``'s attention layers of a Hugging Face config (module docstring)."""
    from .hf_attention import layer_type_name
    from .hf_mixers import ADAPTERS

    window = getattr(cfg, "sliding_window", None)
    window = window if isinstance(window, int) and window > 0 else 0
    types = [layer_type_name(t) for t in getattr(cfg, "layer_types", None) or []]
    if not types:  # every layer without a hybrid mixer, with the config's window if any
        n = sum(not any(type(m).__name__ in ADAPTERS for m in layer.modules()) for layer in layers)
        return {"windows": (window,) * n} if window else {"causal": n}
    chunk = getattr(cfg, "attention_chunk_size", None) or 0
    sliding = sum(t == "sliding_attention" for t in types)
    chunked = sum(t == "chunked_attention" for t in types)
    causal = sum(t in ("full_attention", "attention") for t in types)
    # a type with no size set runs plainly causal
    causal += (0 if window else sliding) + (0 if chunk else chunked)
    return {
        "causal": causal,
        "windows": (window,) * sliding if window else (),
        "chunks": (chunk,) * chunked if chunk else (),
    }
