"""The MoE router's load-balancing loss over the whole sequence (Switch Transformer,
arXiv:2101.03961, eqs. 4-6), as Hugging Face's MoE families compute it, under sequence
parallelism.

Legend: L router calls (one per MoE layer; more when a tiled MLP runs a layer in pieces),
T_l = b * s_l this rank's rows of one call, E experts, K experts per token.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, ... share
one body) concatenates every layer's router logits, takes the softmax ``p`` and each row's
top-K experts, and with R the number of rows (padding excluded through the attention mask)::

    count_e = sum over rows, layers of [e in top-K(row)]       (E,)  no gradient
    prob_e  = sum over rows, layers of p_e(row)                (E,)
    loss    = E * sum_e (count_e / R) * (prob_e / R)

Every factor is a sum over rows, so on P ranks each holding a shard of the sequence the
whole-sequence loss needs three all-reduces over the SP group: ``count`` and ``R`` (no
gradient) and ``prob``, whose all-reduce keeps only this rank's own sum in the gradient (the
other ranks' sums enter as constants). The loss is then evaluated once, the same value on
every SP rank, and each rank's gradient is its own rows' share: summed over the SP group
(what the gradient reduction does), the one-process gradient. Computed per shard instead,
the loss would be the mean of P products of per-shard statistics: a different number
whenever the experts' loads differ between shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.comm import collective, group_size
from ..core.topology import Topology
from .loss import _SumKeepGrad, scale_gradient

__all__ = ["load_balancing_loss", "row_masks"]


def row_masks(
    router_logits: Sequence[torch.Tensor], token_mask: torch.Tensor | None
) -> list[torch.Tensor | None]:
    """The mask of each router call's rows, from this rank's ``token_mask`` ``(b, s_l)``
    (1: a real token, 0: padding; None: every row counts).

    A call sees ``(b, n)`` tokens flattened batch-first: ``n = s_l`` for a whole layer,
    less when a tiled MLP runs the layer in pieces of the sequence, in order; the pieces of
    one layer cover ``s_l`` exactly."""
    if token_mask is None:
        return [None] * len(router_logits)
    b, s_l = token_mask.shape
    masks: list[torch.Tensor | None] = []
    start = 0
    for logits in router_logits:
        rows = logits.shape[0]
        n = rows // b
        if rows % b or n == 0 or start + n > s_l:
            raise ValueError(
                f"router logits of {rows} rows do not follow this rank's {b} x {s_l} tokens "
                f"(at token {start}): the router sees tokens the sequence-parallel shard "
                f"does not hold, so its load-balancing loss cannot be computed here"
            )
        masks.append(token_mask[:, start : start + n].reshape(-1))
        start = (start + n) % s_l
    if start:
        raise ValueError(
            f"router calls ended {start} tokens into a layer of {s_l}: the router logits do "
            f"not cover whole layers of this rank's tokens"
        )
    return masks


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    topo: Topology | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The load-balancing loss of the whole sequence, on every SP rank.

    Args:
        router_logits: Every router call's logits on this rank's rows, ``(T_l, E)`` each
            (what transformers returns as ``outputs.router_logits``).
        num_experts: E.
        top_k: K, the experts each token is routed to.
        topo: The run's topology; None computes this rank's rows alone (one process).
        token_mask: ``(b, s_l)``, 1 for this rank's real tokens, 0 for padding (the
            attention mask's, and the padding sequence parallelism adds); None: all count.

    Returns:
        A scalar float32 loss, the same on every SP rank. Its gradient on each rank is its
        rows' share, times ``topo.grad_scale`` (the rule of the SP cross-entropy).
    """
    if not router_logits:
        raise ValueError("no router logits: the model ran no MoE layer that records them")
    device = router_logits[0].device
    count = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits, mask in zip(router_logits, row_masks(router_logits, token_mask)):
        # (T_l, E) -> softmax over experts; top-K experts of each row (T_l, K)
        p = F.softmax(logits.to(device), dim=-1)
        top = torch.topk(p, top_k, dim=-1).indices
        weight = (
            torch.ones(top.shape[0], dtype=torch.float32, device=device)
            if mask is None
            else mask.to(device=device, dtype=torch.float32)
        )
        # (T_l * K,) expert ids, each weighted by its row's mask
        count = count.scatter_add(0, top.reshape(-1), weight.repeat_interleave(top_k))
        prob = prob + (p.float() * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    group = None if topo is None else topo.sp_group
    if group_size(group) > 1:
        stats = torch.cat([count, rows[None]])  # (E + 1,): no gradient
        with collective("all_reduce", "loss", group):
            dist.all_reduce(stats, group=group)
        count, rows = stats[:num_experts], stats[num_experts]
        prob = _SumKeepGrad.apply(prob, group)
    rows = rows.clamp(min=1)  # no real token anywhere -> 0, not NaN
    loss = num_experts * torch.sum((count / rows) * (prob / rows))
    return loss if topo is None else scale_gradient(loss, topo.grad_scale)
