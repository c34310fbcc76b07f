"""Sequence-parallel cross-entropy: the full-sequence token mean on every SP rank.

Labels are shifted on the FULL sequence before sharding (``ucp.shard_batch``), so the
target of a shard's last token (the first token of the next shard) is not lost.

Value: ``sum over all SP ranks of CE / number of non-ignored tokens of the whole sequence``
(the same on every SP rank). Gradient on each rank: the derivative of that global mean with
respect to the rank's own logits, i.e. its share. Summed over the SP group (which is what
DeepSpeed's gradient reduction does) the shares give the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.comm import collective, group_size
from ..core.topology import Topology

__all__ = [
    "local_loss_term",
    "replicated_loss_term",
    "scale_gradient",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_loss_from_sums",
]


class _SumKeepGrad(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: every rank's loss value is the
    global sum while each rank's gradient stays its own share."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        with collective("all_reduce", "loss", group):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward, the gradient times ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """The same value, bit for bit (``x * f - x * (f - 1)`` would round), with its gradient
    multiplied by ``factor``."""
    if factor == 1 or not loss.requires_grad:
        return loss
    return _ScaleGrad.apply(loss, factor)


def sequence_parallel_cross_entropy(
    logits_local: torch.Tensor, labels_local: torch.Tensor, topo: Topology, ignore_index: int = -100
) -> torch.Tensor:
    """The token-mean cross-entropy of the whole sequence, on every SP rank.

    Computed in float32 (float64 stays float64). The value is the mean over every
    non-ignored token of all SP ranks. Each rank's gradient is its share, times
    ``topo.grad_scale``: `topology_from_config` sets that scale to make up for a ZeRO stage
    whose reduction also averages over the SP ranks.

    Args:
        logits_local: This rank's logits, ``(b, s_local, V)``.
        labels_local: This rank's labels, ``(b, s_local)``, already shifted on the full
            sequence (``shard_batch`` gives them as ``shift_labels``).
        topo: The run's topology.
        ignore_index: The label of tokens without a target.

    Returns:
        A scalar loss, the same on every SP rank.

    Raises:
        ValueError: ``logits_local`` and ``labels_local`` disagree in (batch, seq).
    """
    if logits_local.shape[:-1] != labels_local.shape:
        raise ValueError(
            f"logits {tuple(logits_local.shape)} and labels "
            f"{tuple(labels_local.shape)} must agree in (batch, seq)"
        )
    logits = logits_local if logits_local.dtype == torch.float64 else logits_local.float()
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels_local.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return sequence_parallel_loss_from_sums(ce, (labels_local != ignore_index).sum(), topo)


def sequence_parallel_loss_from_sums(
    ce: torch.Tensor, count: torch.Tensor, topo: Topology
) -> torch.Tensor:
    """The token mean over the SP group from this rank's summed loss and target count
    (value: the global mean on every rank; gradient: this rank's share, times
    ``topo.grad_scale``)."""
    count = count.to(ce.dtype)
    group = topo.sp_group
    if group_size(group) > 1:
        ce = _SumKeepGrad.apply(ce, group)
        count = count.clone()
        with collective("all_reduce", "loss", group):
            dist.all_reduce(count, group=group)
    loss = ce / count.clamp(min=1)  # no target anywhere -> 0, not NaN
    return scale_gradient(loss, topo.grad_scale)


def replicated_loss_term(term: torch.Tensor, topo: Topology) -> torch.Tensor:
    """A loss term of your own that every SP rank computes identically.

    A regulariser on the parameters, say, or a term from data every SP rank holds in
    full. The gradient reduction sums over the SP ranks, so without this the term would
    count ``sp_world_size`` times. Add the result to the SP cross-entropy before
    ``engine.backward``.

    Args:
        term: The term, the same on every SP rank.
        topo: The run's topology.

    Returns:
        The same value, with its gradient times ``topo.grad_scale / sp_world_size``.
    """
    return scale_gradient(term, topo.grad_scale / topo.sp_world_size)


def local_loss_term(term_local: torch.Tensor, topo: Topology) -> torch.Tensor:
    """A loss term of your own, summed over this rank's tokens.

    An auxiliary per-token loss, say: normalise it by the global token count yourself, as
    the SP cross-entropy does.

    Args:
        term_local: This rank's sum.
        topo: The run's topology.

    Returns:
        The sum over the SP group, the same on every rank. The gradient is this rank's
        share, times ``topo.grad_scale`` (the rule of `sequence_parallel_cross_entropy`).
    """
    if group_size(topo.sp_group) > 1:
        term_local = _SumKeepGrad.apply(term_local, topo.sp_group)
    return scale_gradient(term_local, topo.grad_scale)
