"""Pieces the hybrid mixers' adapters share (:mod:`~ulysses_cp.models.hf_mixers`,
:mod:`~ulysses_cp.models.hf_mamba`): the family's own kernel functions, a kernel run once
per document, the depthwise causal conv on a rank's channels, channel index blocks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..modes.mixer import MixerExchange

__all__ = ["by_document", "causal_conv", "family_kernel", "units"]


def family_kernel(module: Any, name: str) -> Callable:
    """The family's own kernel function of that name (its modeling module's)."""
    return getattr(sys.modules[type(module).__module__], name)


def by_document(ex: MixerExchange, run: Callable, *seq: torch.Tensor) -> Any:
    """``run(*seq)`` on the whole sequence (dim 1), or on each document's piece, so that
    every document starts from a fresh state; the outputs concatenated along dim 1."""
    docs = ex.documents()
    if len(docs) == 1:
        return run(*seq)
    return torch.cat([run(*(t[:, a:b] for t in seq)) for a, b in docs], dim=1)


def _conv_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(b, c, s)`` in a layout causal-conv1d takes (csrc/causal_conv1d.cpp): as it is
    where channel-last is allowed (c and strides 0 and 2 multiples of 8; a view of the
    exchanged channels, which the dt or gate channels follow), else channel-first."""
    if x.shape[1] % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0:
        return x
    return x.contiguous()


def causal_conv(module: Any, conv: nn.Conv1d, ex: MixerExchange, x, mine, activation):
    """Depthwise causal conv of channels ``mine`` (``x`` ``(b, s, c)`` natural order)."""
    fn = family_kernel(module, "causal_conv1d_fn")
    weight = conv.weight.squeeze(1)[mine]  # (C, K) -> (c, K)
    bias = None if conv.bias is None else conv.bias[mine]

    def run(piece):  # (b, s_doc, c) -> (b, c, s_doc) -> (b, s_doc, c)
        kw = {} if activation is None else {"activation": activation}
        return fn(_conv_layout(piece.transpose(1, 2)), weight, bias, **kw).transpose(1, 2)

    return by_document(ex, run, x)


def units(n: int, width: int, offset: int = 0) -> torch.Tensor:
    """Channel indices of ``n`` units (heads, groups) of ``width`` channels: ``(n, width)``."""
    return torch.arange(offset, offset + n * width).view(n, width)
