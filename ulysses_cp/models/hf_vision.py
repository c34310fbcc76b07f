"""Vision-language models under sequence parallelism: the vision tower on whole images,
the language model on this rank's tokens.

Every SP rank holds the whole batch. The model's own forward embeds the tokens, runs the
vision tower on every image (replicated: each SP rank runs it on the whole images),
merges the image features into the full-length embeddings and computes the positions
(M-RoPE's three axes for Qwen-VL) on the full sequence. A forward pre-hook on the language
model then keeps this rank's tokens, in the run's layout: the embeddings, the positions,
and Qwen3-VL's deepstack mask and features. The vision tower's gradient on each rank is that
of its own tokens' share of the loss; summed over the SP group, as every parameter's
gradient is, it is the whole gradient.

Only the families below are accepted with images: each is pinned against the one-process
model (``tests/distributed/test_hf_vlm_images.py``). Others train on text and refuse image batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.sharding import layout_indices, pad_to_multiple
from ..core.topology import Topology

__all__ = [
    "IMAGE_FAMILIES",
    "PER_TOKEN_KEYS",
    "VISION_KEYS",
    "LanguageModelShard",
    "auto_class",
    "language_model",
    "text_config",
    "vision_attention",
    "vision_batch",
]

# the model types whose image batches train exactly (their language model is causal and
# takes the merged embeddings; pinned in tests/distributed/test_hf_vlm_images.py)
IMAGE_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
# the keys of an image or video batch (Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3, InternVL...)
VISION_KEYS = ("pixel_values", "image_", "video_", "second_per_grid", "image_sizes", "batch_num")
# the vision batch's keys with one value per token, padded with the tokens
PER_TOKEN_KEYS = frozenset({"mm_token_type_ids"})


def auto_class(config: Any) -> Any:
    """The transformers auto class that builds ``config``'s model with its LM head:
    ``AutoModelForCausalLM`` for every config it knows (multimodal ones such as Phi-4
    multimodal and Mllama's included: their causal-LM class), else
    ``AutoModelForImageTextToText`` for a vision-language model (Qwen-VL, InternVL)."""
    import transformers

    causal = transformers.AutoModelForCausalLM
    vlm = transformers.AutoModelForImageTextToText
    if type(config) in causal._model_mapping or getattr(config, "vision_config", None) is None:
        return causal
    return vlm if type(config) in vlm._model_mapping else causal


def text_config(config: Any) -> Any:
    """The language model's config: a vision-language model's ``text_config``, else the
    config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def language_model(model: nn.Module) -> nn.Module | None:
    """A vision-language model's language model (``model.model.language_model``), or None
    for a model without a vision tower."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    inner = getattr(model, "model", model)
    found = getattr(inner, "language_model", None)
    return found if isinstance(found, nn.Module) else None


def vision_attention(model: nn.Module, implementation: str) -> None:
    """Give the vision tower this attention: it runs on whole images on every rank, never
    on a shard. Every pretrained model under the VLM's inner model other than its language
    model is the vision side (its config may be a copy of ``config.vision_config``)."""
    lm = language_model(model)
    inner: Any = getattr(model, "model", model)
    for child in inner.children():
        if child is not lm and hasattr(getattr(child, "config", None), "_attn_implementation"):
            child.config._attn_implementation = implementation
    config: Any = model.config
    config.vision_config._attn_implementation = implementation


def vision_batch(
    inputs: dict[str, Any], family: str, multiple: int, *, ignored: frozenset
) -> dict[str, Any]:
    """The model's inputs of an image batch, the whole sequence padded at the end to
    ``multiple``: the token ids, the per-token keys, and the images' keys as they are.

    Raises:
        ValueError: A family whose image batches are not pinned, a packed row, or a key
            the path does not know."""
    if family not in IMAGE_FAMILIES:
        raise ValueError(
            f"this batch has images or videos, and model type {family!r} is not one whose "
            f"image batches train exactly under sequence parallelism (those are "
            f"{list(IMAGE_FAMILIES)}: the vision tower on whole images, the merged sequence "
            f"sharded); train {family!r} on text only, or with ulysses_degree = "
            f"ring_degree = 1"
        )
    out: dict[str, Any] = {"input_ids": pad_to_multiple(inputs["input_ids"], multiple)}
    for key, value in inputs.items():
        if key in PER_TOKEN_KEYS:
            out[key] = pad_to_multiple(value, multiple)
        elif key.startswith(VISION_KEYS):
            out[key] = value
        elif key == "position_ids":
            raise ValueError(
                "an image batch under sequence parallelism takes no position_ids: the model "
                "computes its own from the images (M-RoPE) on the whole sequence; drop them "
                "(packed image rows are not supported: pad the rows instead)"
            )
        elif key not in ignored and key not in ("input_ids", "labels", "shift_labels"):
            raise ValueError(
                f"an image batch under sequence parallelism takes input_ids, labels and the "
                f"images' keys; it also has {key!r}, which it cannot shard"
            )
    return out


class LanguageModelShard:
    """A forward pre-hook on a VLM's language model that keeps this rank's tokens of the
    full-length inputs the model's forward hands it, when armed (one call per arming)."""

    def __init__(self, lm: nn.Module, topo: Topology, layout: str) -> None:
        self.topo, self.layout = topo, layout
        self._pending: tuple[torch.Tensor, dict] | None = None
        self.handle = lm.register_forward_pre_hook(self._hook, with_kwargs=True)

    def arm(self, seq_len: int, extra: dict[str, Any]) -> None:
        """The next call of the language model gets this rank's tokens of a ``seq_len``
        sequence, and ``extra`` (the attention calls' batch plan) in its keyword arguments."""
        topo = self.topo
        index = layout_indices(seq_len, topo.sp_world_size, topo.sp_rank, self.layout)
        self._pending = (index, extra)

    def disarm(self) -> None:
        """The next call of the language model runs on what it is given (a text batch's
        shard): an arming that no call used (a forward that failed before) is dropped."""
        self._pending = None

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._pending is None:
            return None
        index, extra = self._pending
        self._pending = None
        embeds = kwargs.get("inputs_embeds")
        if args or embeds is None:
            raise ValueError(
                f"{type(module).__name__} was called without inputs_embeds as a keyword: the "
                f"vision-language path shards the merged embeddings there and cannot here"
            )
        b, s = embeds.shape[:2]
        if s != index.numel() * self.topo.sp_world_size:
            raise ValueError(
                f"{type(module).__name__} got {s} tokens where the image batch had "
                f"{index.numel() * self.topo.sp_world_size}: the vision-language path shards "
                f"the whole merged sequence"
            )
        index = index.to(embeds.device)
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(s, device=embeds.device).expand(b, s)
        kwargs["inputs_embeds"] = embeds.index_select(1, index)
        kwargs["position_ids"] = pos.index_select(pos.dim() - 1, index)
        mask = kwargs.get("visual_pos_masks")
        if mask is not None:  # Qwen3-VL's deepstack: the features of this rank's image tokens
            ordinal = (mask.flatten().cumsum(0) - 1).view(mask.shape).index_select(1, index)
            kwargs["visual_pos_masks"] = mask.index_select(1, index)
            rows = ordinal[kwargs["visual_pos_masks"]]
            features = kwargs.get("deepstack_visual_embeds") or []
            kwargs["deepstack_visual_embeds"] = [f.index_select(0, rows) for f in features]
        return args, {**kwargs, **extra}
