"""The LM head as the model computes it: ``lm_head(hidden)``, then the family's scale and
final softcap.

Families post-process the head's output in their own ``forward``: Cohere multiplies by
``logit_scale``, Granite divides by ``config.logits_scaling`` while HyperCLOVA X multiplies
by a field of the same name, Falcon-H1 multiplies by ``lm_head_multiplier``, Gemma 2/3 and
others softcap (``cap * tanh(logits / cap)``, ``final_logit_softcapping``). The names do
not say what a family does with them, so the head is not guessed from names alone:
:func:`candidates` lists the heads the model's scalars allow (no scale first; a scalar
``v`` as ``* v`` and ``/ v``; with and without the softcap), and the probe
(:mod:`~ulysses_cp.models.hf_guard`) keeps the first one whose logits equal the model's own
``forward`` on a short sequence. None equal: the model is refused.

:class:`LMHead` applies the chosen transform to float32 logits (float64 stays float64),
in the plain and the tiled loss alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["SCALE_NAMES", "HeadTransform", "LMHead", "candidates", "head_module"]

# scalars a family's forward may apply to the logits (on the config, the causal-LM
# module or its base model)
SCALE_NAMES = (
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "logit_multiplier",
    "output_multiplier",
)


@dataclass(frozen=True)
class HeadTransform:
    """``logits * scale``, then ``softcap * tanh(logits / softcap)`` when softcap is set."""

    scale: float = 1.0
    softcap: float | None = None
    source: str = "lm_head(hidden)"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _scalars(model: nn.Module) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    holders = [("config", getattr(model, "config", None)), ("model", model)]
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        holders.append(("model.base_model", base))
    for where, holder in holders:
        for name in SCALE_NAMES:
            value = getattr(holder, name, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value) and value not in (0.0, 1.0):
                found.append((f"{where}.{name}", float(value)))
    return found


def candidates(model: nn.Module) -> list[HeadTransform]:
    """Every head transform the model's scalars allow, the plainest first."""
    scales = [HeadTransform()]
    for name, value in _scalars(model):
        scales += [
            HeadTransform(value, None, f"* {name}"),
            HeadTransform(1 / value, None, f"/ {name}"),
        ]
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap:
        return scales
    capped = [HeadTransform(t.scale, float(cap), f"{t.source}, softcap {cap}") for t in scales]
    return capped + scales  # a configured softcap is what the family most likely applies


def head_module(model: nn.Module) -> nn.Module:
    """The module that maps the final hidden states to logits: the causal LM's child that
    holds the output embeddings (``lm_head`` itself, or a head around it such as BERT's
    ``cls``: dense, activation, norm, then the output embeddings)."""
    out = model.get_output_embeddings()  # type: ignore[operator]
    base = getattr(model, "base_model", None)
    for child in model.children():
        if child is out or (child is not base and any(m is out for m in child.modules())):
            return child
    return out


class LMHead(nn.Module):
    """The head module (:func:`head_module`) and the transform:
    ``transform(float32(linear(hidden)))``. Not registered as a submodule of the wrapper
    (the head belongs to the model); calling it as a module keeps ZeRO-3's parameter
    hooks."""

    def __init__(self, linear: nn.Module, transform: HeadTransform) -> None:
        super().__init__()
        self.linear, self.transform = linear, transform

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.transform.scale == 1.0 and not self.transform.softcap:
            return logits
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return self.transform.apply(logits)
