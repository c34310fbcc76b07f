"""The LM head and the cross-entropy with their gradients computed in the forward
(``"model": {"fused_loss": true}``): nothing of the head is recomputed in backward.

The tiled loss (:func:`~ulysses_cp.models.memory.tiled_cross_entropy`) runs the head and
the loss per piece of the sequence under checkpointing, so every piece's logits are
computed twice: once for the value, once more in backward. The loss is the last thing of
the forward, so its gradients can be taken right away: :class:`_FusedHeadLoss` walks the
pieces once, and for each computes the logits ``z = h W^T + b``, the family's scale and
softcap (:class:`~ulysses_cp.models.hf_head.HeadTransform`), the summed cross-entropy, and
by hand its gradient ``dlogits = softmax - onehot`` (zero on ignored tokens) through the
softcap (``1 - tanh^2``) and the scale in float32 (float64 models: float64), then
``dh = dz W`` and ``dW += dz^T h`` with the GEMMs in the model's dtype (:mod:`.head_grads`)
and ``db += sum dz``. It saves ``dh``, ``dW`` and ``db``;
its backward returns them times the incoming gradient. That incoming gradient carries the
division by the GLOBAL token count of the SP group, the run's ``grad_scale`` and
DeepSpeed's loss scaling and gradient-accumulation factor, as for any other loss: the
weight's gradient is scaled like the input's (DeepSpeed's ALST ``TiledFusedLogitsLoss``
scales only the input's, so its weight gradient is off by that factor).

The weight arrives through autograd as an ordinary input, so it gets one ordinary
gradient per backward and ZeRO's gradient hooks fire once. The pieces run inside the head
module's own call (:func:`_inside_module_call`), so ZeRO-3's hooks gather its weight for
the forward (and, as for any module, again before its backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.topology import Topology
from .head_grads import add_weight_grad, scaled_grad, weight_grad_buffer
from .hf_head import HeadTransform
from .lean_norm import norm_backward, norm_input
from .loss import sequence_parallel_loss_from_sums

__all__ = ["fused_cross_entropy"]


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (the accumulation dtype)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _FusedHeadLoss(torch.autograd.Function):
    """Summed cross-entropy of ``transform(linear(hidden))`` over ``chunks`` pieces, with
    ``(d hidden, d weight, d bias)`` of that sum computed in forward.

    hidden ``(T, D)``, weight ``(V, D)``, bias ``(V,)`` or None, labels ``(T,)``; ``spec``:
    ``(scale, softcap, chunks, ignore_index, grads)`` (``grads``: compute the gradients).

    Folded final norm: with ``norm`` (:class:`~.lean_norm.NormInput`: ``x`` ``(T, D)``,
    the module, the form) and its ``norm_weight``, ``hidden`` is ``rms_norm(x)``
    (:mod:`.lean_norm`, given detached): each
    piece's ``d hidden`` goes through the norm's backward right away, and the gradients
    returned are ``x``'s and the norm weight's (``hidden``'s is None), so neither ``x`` nor
    ``d hidden`` is kept, only ``d x``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, spec, x=None, norm_weight=None, norm=None):
        scale, softcap, chunks, ignore_index, grads = spec
        work = _work_dtype(hidden, weight)  # the softmax, the sums, the weight's accumulator
        folded = x is not None
        d_hidden = torch.empty_like(x if folded else hidden) if grads else None
        d_norm = None  # the norm weight's gradient, accumulated in float32 / float64
        if grads and folded:
            d_norm = torch.zeros(norm_weight.shape, dtype=work, device=norm_weight.device)
        d_weight = weight_grad_buffer(weight, work, chunks) if grads else None
        d_bias = None
        if grads and bias is not None:
            d_bias = torch.zeros(bias.shape, dtype=work, device=bias.device)
        total = torch.zeros((), dtype=work, device=hidden.device)
        start = 0
        for h, y in zip(hidden.chunk(chunks, dim=0), labels.chunk(chunks, dim=0)):
            # the logits as the model computes them: linear in its dtype, then float32
            z = F.linear(h, weight, bias).to(work)  # (t, V)
            if scale != 1.0:
                z.mul_(scale)
            t = None
            if softcap:
                t = torch.tanh(z / softcap)  # (t, V)
                z = t * softcap
            lse = torch.logsumexp(z, dim=-1)  # (t,)
            valid = y != ignore_index
            target = torch.where(valid, y, 0)
            picked = z.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if d_hidden is None:  # no backward will come: the value
                continue
            # d(sum CE)/dz: softmax - onehot on counted tokens, zero on ignored ones
            g = z.sub_(lse[:, None]).exp_()  # (t, V), in place of the logits
            g[torch.arange(len(y), device=y.device), target] -= 1
            g.mul_(valid[:, None].to(work))
            if t is not None:
                g.mul_(t.square_().neg_().add_(1))  # d(cap tanh(u / cap))/du = 1 - tanh^2
            if scale != 1.0:
                g.mul_(scale)
            g_mm = g.to(weight.dtype)  # the GEMMs in the model's dtype (head_grads)
            dh = (g_mm @ weight).to(hidden.dtype)  # (t, D)
            if folded:  # through the final norm now: d x of the piece
                rows = slice(start, start + len(y))
                xs = x[rows]
                dh, dn = norm_backward(dh, xs, norm_weight, norm.rstd(xs), norm.form)
                assert d_norm is not None and dn is not None
                d_norm += dn.to(work)
            d_hidden[start : start + len(y)] = dh
            d_weight = add_weight_grad(d_weight, g_mm, h, weight)
            if d_bias is not None:
                d_bias += g.sum(0)
            start += len(y)
        ctx.save_for_backward(d_hidden, d_weight, d_bias, d_norm)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.folded = (norm_weight.dtype,) if folded else None
        return total

    @staticmethod
    def backward(ctx, grad):
        d_hidden, d_weight, d_bias, d_norm = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        g_hidden = d_hidden * grad.to(d_hidden.dtype)
        g_weight = scaled_grad(d_weight, grad, w_dtype)
        g_bias = None if d_bias is None else (d_bias * grad).to(b_dtype)
        if ctx.folded is None:
            return g_hidden, g_weight, g_bias, None, None, None, None, None
        g_norm = (d_norm * grad).to(ctx.folded[0])
        return None, g_weight, g_bias, None, None, g_hidden, g_norm, None


def _head_parts(head: nn.Module) -> tuple[nn.Linear, HeadTransform]:
    """The linear layer and the logit transform of an LM head (an ``nn.Linear``, or a
    :class:`~ulysses_cp.models.hf_head.LMHead` around one)."""
    linear: Any = getattr(head, "linear", head)
    transform = getattr(head, "transform", HeadTransform())
    if not isinstance(linear, nn.Linear):
        raise ValueError(
            f"fused_loss needs an LM head that is one nn.Linear (then the model's logit "
            f"scale and softcap); this model's head is {type(linear).__name__}. Use "
            f'"fused_loss": false (the tiled loss, "tiled_loss": n, works with any head)'
        )
    return linear, transform


def _inside_module_call(module: nn.Module, fn: Callable[..., torch.Tensor], *args):
    """``fn(*args)`` run as ``module``'s forward for this one call, so the hooks around the
    module's call (ZeRO-3's parameter gathering) run around it."""
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = fn
    try:
        return module(*args)
    finally:
        if had_own:
            module.forward = own  # type: ignore[assignment]
        else:
            del module.forward


def fused_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    topo: Topology,
    *,
    chunks: int = 1,
    ignore_index: int = -100,
    fold_norm: bool = False,
) -> torch.Tensor:
    """``sequence_parallel_cross_entropy(head(hidden), labels, topo)`` with the head's and
    the loss's gradients computed in the forward, ``chunks`` pieces of the sequence at a
    time (the full logits never exist when ``chunks > 1``). hidden ``(b, s_local, D)``,
    labels ``(b, s_local)``; ``head``: an ``nn.Linear`` or an ``LMHead`` around one.

    ``fold_norm``: when ``hidden`` is a lean final norm's output (:mod:`.lean_norm`), the
    norm's backward runs here too, piece by piece, and ``d x`` (its input's gradient) is
    kept instead of ``d hidden`` and ``x``; for a caller that holds no reference to
    ``hidden`` after this call (as :func:`~ulysses_cp.models.memory.lm_loss`), since
    while ``hidden`` lives the norm's own autograd node keeps ``x``."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree in "
            f"(batch, seq)"
        )
    linear, transform = _head_parts(head)
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (b*s, D), batch rows one after another
    flat_y = labels.reshape(-1)
    n = max(1, min(int(chunks), flat_y.numel()))
    grads = torch.is_grad_enabled()
    spec = (transform.scale, transform.softcap, n, ignore_index, grads)
    norm = norm_input(hidden) if grads and fold_norm else None
    if norm is None:

        def run(h):
            return _FusedHeadLoss.apply(h, linear.weight, linear.bias, flat_y, spec)

        total = _inside_module_call(linear, run, flat_h)
    else:  # hidden is a lean final norm's output: its backward folded in (module docstring)
        module, D = norm.module, hidden.shape[-1]
        x = norm.x.reshape(-1, D)
        del hidden  # the caller's reference and the norm's node go when the loss returns

        def run_folded(h):
            return _FusedHeadLoss.apply(
                h.detach(), linear.weight, linear.bias, flat_y, spec, x, module.weight, norm
            )

        # inside the norm's call too: ZeRO-3 gathers its weight for this forward and again
        # before the backward, as for the head's
        total = _inside_module_call(
            module, lambda h: _inside_module_call(linear, run_folded, h), flat_h
        )
    return sequence_parallel_loss_from_sums(total, (labels != ignore_index).sum(), topo)
