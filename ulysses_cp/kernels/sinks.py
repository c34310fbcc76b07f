"""Attention with sinks, and the autograd function every attention path goes through.

Legend: b batch, s tokens, hq query heads; out ``(b, s, hq, d)``, lse ``(b, hq, s)``.

A sink is one more logit per query head, ``sinks (hq,)``, whose value vector is 0 (GPT-OSS
``s_aux``): it joins every softmax denominator. Given the ``(out, lse)`` of attention
without it, the result with it is exact (:func:`add_sinks`), and so is the backward from
the final ``(out, lse)`` (FlashAttention-2's backward reads only those).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "SavedAttention",
    "add_sinks",
    "sinks_grad",
]


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. The backward of
    attention from ``(out', lse')`` is the exact backward with the sink."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    return out.to(lse.dtype) * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1), new


def sinks_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """``d loss / d sinks`` from the final ``out``/``lse`` (with the sink): the sink's
    probability times ``-rowsum(dout * out)``, summed over batch and tokens."""
    cdt = lse.dtype
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1).transpose(1, 2)  # (b, hq, s)
    p_sink = torch.exp(sinks.to(cdt).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


class SavedAttention(torch.autograd.Function):
    """``fwd(q, k, v) -> (out, lse)`` in forward, saving q, k, v, out (in q's dtype) and
    lse; ``bwd(dout, q, k, v, out, lse) -> (dq, dk, dv)`` in backward (both with the call's
    options bound). Serves the local kernel and ring attention alike. ``sinks`` (``(hq,)``
    or None): one logit per query head joins every softmax (:func:`add_sinks`),
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, fwd: Callable, bwd: Callable):
        out, lse = fwd(q, k, v)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # as returned: no extra copy when it already is
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = ctx.bwd(dout, q, k, v, out, lse)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return (*grads, dsinks, None, None)
