"""The numbers the planner needs from a model config: sizes, head counts, parameters.

Parameter counts are exact: the model is built on PyTorch's ``meta`` device (no memory,
no weights), so every family the package builds (reference decoder, Hugging Face models)
is counted the way it will be trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import HFModelConfig, ModelConfig
from ..core.offload import offloaded_layers
from ..core.tiles import plan_tiles

__all__ = ["MixerShape", "ModelShape", "model_shape"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class MixerShape:
    """One kind of hybrid token-mixer layer (``ulysses_cp.models.hf_mixers``): ``count``
    layers; per token, ``to_fixed`` channels go to the heads' ranks plus ``group_width``
    for each B/C group a rank receives (Mamba2: every rank receives at least one, so
    ``max(groups, P)`` in all), and ``back`` channels come back; ``reduced`` numbers per
    token of the whole sequence are all-reduced over the SP group in float32 at least
    (Mamba1's ``x_proj`` partial sums)."""

    count: int
    to_fixed: int
    back: int
    group_width: int = 0
    groups: int = 0
    reduced: int = 0

    def channels(self, P: int) -> tuple[int, int]:
        """Channels per token of the two all-to-alls at degree ``P``, summed over ranks."""
        groups = max(self.groups, P) if self.group_width else 0
        return self.to_fixed + self.group_width * groups, self.back


@dataclass(frozen=True)
class ModelShape:
    """``family``: ``"reference"`` or ``"hf"``; ``params``: all parameters;
    ``layer_params``: the largest decoder layer's (what ZeRO-3 gathers at once)."""

    family: str
    vocab: int
    dim: int
    layers: int
    hq: int
    hkv: int
    head_dim: int
    ffn: int
    params: int
    layer_params: int
    dtype_bytes: int  # parameters and activations
    activation_checkpointing: bool = False
    offload_activations: bool | int = False  # every layer, none, or the first n (core/offload.py)
    tiled_mlp: int | str = 0  # a count, or "auto" (resolved per length: plan.memory.tile_counts)
    tiled_loss: int | str = 0
    param_numels: tuple[int, ...] = ()  # every parameter tensor's size (ZeRO-3 persistence)
    attention_layers: int | None = None  # layers with attention (None: every layer)
    mixers: tuple[MixerShape, ...] = ()  # hybrid models' token-mixer layers
    weights_file_bytes: int = 0  # the largest file of model.hf_weights (0: none)
    lean_norms: bool = False  # RMSNorms keep no normalised copy (models/lean_norm.py)
    budget_bytes: int | None = None  # sizes "auto" tiles (core.tiles.plan_tiles's budget)
    v_head_dim: int = 0  # MLA: the values' head dim where it is not q's and k's (0: the same)
    fused_loss: bool = False  # the LM head's gradients made in the loss's forward
    tied_head: bool = False  # the LM head is the input embedding (one weight, one gradient)

    def persistent(self, threshold: float) -> int:
        """Parameters ZeRO-3 keeps whole on every rank (tensors of at most ``threshold``
        elements: DeepSpeed's ``stage3_param_persistence_threshold``, default 1e5)."""
        return sum(n for n in self.param_numels if n <= threshold)

    @property
    def offloaded_layers(self) -> int:
        """How many layers keep their checkpointed input on the host."""
        if not self.activation_checkpointing:
            return 0
        return offloaded_layers(self.offload_activations, self.layers)

    @property
    def n_attention(self) -> int:
        """How many layers run attention."""
        return self.layers if self.attention_layers is None else self.attention_layers

    @property
    def dv(self) -> int:
        """The values' (and the attention output's) head dim."""
        return self.v_head_dim or self.head_dim

    @property
    def width(self) -> int:
        """The mean of the q/k and v head dims: a q/output or k/v pair holds twice this
        per head (the memory model counts pairs; MLA's are unequal)."""
        return (self.head_dim + self.dv) // 2

    @property
    def q_width(self) -> int:
        return self.hq * self.width

    @property
    def kv_width(self) -> int:
        return self.hkv * self.width


def _count(model: torch.nn.Module, layers) -> dict[str, Any]:
    numels = tuple(p.numel() for p in model.parameters())
    per_layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    return {"params": sum(numels), "layer_params": per_layer, "param_numels": numels}


def model_shape(mc: ModelConfig | HFModelConfig, *, dtype_bytes: int | None = None) -> ModelShape:
    """The planner's view of a ``"model"`` block. ``dtype_bytes``: override the bytes per
    parameter/activation element (default: float32 for the reference decoder, the block's
    ``dtype`` for Hugging Face models; a DeepSpeed ``bf16``/``fp16`` block sets 2)."""
    feats: dict[str, Any] = dict(
        activation_checkpointing=mc.activation_checkpointing,
        offload_activations=mc.offload_activations,
        tiled_mlp=mc.tiled_mlp,
        tiled_loss=mc.tiled_loss,
        budget_bytes=plan_tiles(mc).budget_bytes,
        fused_loss=mc.fused_loss,
    )
    if isinstance(mc, ModelConfig):
        from ..models.decoder import Decoder

        with torch.device("meta"):
            model = Decoder(mc, attn=lambda q, k, v: q)
        return ModelShape(
            "reference",
            mc.vocab_size,
            mc.dim,
            mc.n_layers,
            mc.n_heads,
            mc.n_kv_heads,
            mc.head_dim,
            mc.ffn_dim,
            dtype_bytes=dtype_bytes or 4,
            **_count(model, model.layers),
            **feats,
        )
    from ..models.flop_count import head_dims
    from ..models.hf import ffn_width, heads, load_config
    from ..models.hf_vision import auto_class, text_config
    from ..models.lean_norm import lean_norms

    full = load_config(mc.hf_config)
    cfg = text_config(full)  # a vision-language model's language model
    hq, hkv = heads(cfg)
    d, dv = head_dims(cfg, hq)
    with torch.device("meta"):
        model = auto_class(full).from_config(full)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return ModelShape(
        "hf",
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        hq,
        hkv,
        d,
        ffn_width(cfg),
        dtype_bytes=dtype_bytes or DTYPE_BYTES[mc.dtype],
        **_count(model, layers),
        **feats,
        **_hybrid(cfg, model),
        lean_norms=bool(mc.lean_norms and lean_norms(model)),  # probed on the meta model
        v_head_dim=dv if dv != d else 0,
        tied_head=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def _hybrid(cfg: Any, model: torch.nn.Module) -> dict[str, Any]:
    """The attention layers (from the config's layer types) and the mixer layers (the
    modules ``models/hf_mixers.py`` adapts) of a Hugging Face model built on meta."""
    from ..models.hf_attention import LAYER_TYPES, layer_type_name
    from ..models.hf_mixers import ADAPTERS, mixer_channels, mixer_reduced

    types = [layer_type_name(t) for t in getattr(cfg, "layer_types", None) or []]
    attention = sum(t in LAYER_TYPES for t in types) if types else None
    kinds: dict[tuple, int] = {}
    mod: Any
    for mod in model.modules():
        m = mod
        if type(m).__name__ in ADAPTERS:
            to, back = mixer_channels(m, 1)
            width = 2 * m.ssm_state_size if hasattr(m, "n_groups") else 0
            groups = int(m.n_groups) if width else 0
            key = (to - width * groups, back, width, groups, mixer_reduced(m))
            kinds[key] = kinds.get(key, 0) + 1
    mixers = tuple(MixerShape(n, *key) for key, n in kinds.items())
    return {"attention_layers": attention, "mixers": mixers}
