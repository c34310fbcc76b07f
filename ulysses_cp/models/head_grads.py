"""The LM head's gradients from the logits' gradient, piece by piece, with the GEMMs in the
model's dtype: what the fused loss (:mod:`.fused_loss`) and the log-prob head
(:mod:`.log_probs`) share.

Legend: t tokens of a piece, V vocabulary, D hidden.

The logits' gradient ``g`` ``(t, V)`` is made in float32 (float64 models: float64): the
softmax, the log-sum-exp and the sums need it, and cost no GEMM. It is rounded once to the
weight's dtype, and both GEMMs run in that dtype: ``d hidden = g W`` and ``d W += g^T h``.
A bf16 model thus runs bf16 GEMMs, as transformers' own autograd does (its backward casts
the float32 logits' gradient to bf16 before the same two GEMMs); no float32 copy of the
weight is made. Over several pieces the weight's gradient is summed in float32, so no bits
are lost across pieces (one bf16 GEMM's rounding per piece, as autograd has one for the
whole); one piece keeps its GEMM's result as it is.
"""

from __future__ import annotations

import torch

__all__ = ["add_weight_grad", "scaled_grad", "weight_grad_buffer"]


def weight_grad_buffer(weight: torch.Tensor, work: torch.dtype, pieces: int) -> torch.Tensor | None:
    """The accumulator of the weight's gradient over ``pieces`` pieces: ``(V, D)`` zeros
    in ``work`` (float32 / float64); None for one piece (:func:`add_weight_grad` then
    returns that piece's GEMM in the weight's dtype)."""
    if pieces <= 1:
        return None
    return torch.zeros(weight.shape, dtype=work, device=weight.device)


def add_weight_grad(
    acc: torch.Tensor | None, g_mm: torch.Tensor, h: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``acc += g^T h`` ``(V, D) += (V, t) @ (t, D)``, the GEMM in the weight's dtype
    (``g_mm``: the logits' gradient already in it, as for ``d hidden = g_mm @ W``); ``acc``
    None (one piece): the GEMM's result itself."""
    h_mm = h.to(weight.dtype)
    if acc is None:
        return g_mm.t() @ h_mm
    if acc.dtype == weight.dtype:  # float32 / float64 models: in place, no temporary
        return acc.addmm_(g_mm.t(), h_mm)
    return acc.add_(g_mm.t() @ h_mm)  # a bf16 GEMM, summed in float32


def scaled_grad(
    acc: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, rows: int = 4096
) -> torch.Tensor:
    """``(acc * grad).to(dtype)``, the loss's gradient times a saved gradient, rounded once
    to the parameter's dtype. A float32 accumulator is scaled ``rows`` rows at a time into
    the result, so no float32 temporary of the whole weight is made (at Llama-3's
    vocabulary that temporary was 2.1 GB on top of the accumulator)."""
    if acc.dtype == dtype or acc.dim() == 0:
        return (acc * grad).to(dtype)
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for start in range(0, acc.shape[0], rows):
        piece = slice(start, start + rows)
        out[piece] = acc[piece] * grad
    return out
