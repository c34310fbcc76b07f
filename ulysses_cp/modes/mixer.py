"""Token mixers (convolutions, SSM scans, gated delta nets) under sequence parallelism, the
Ulysses way: sequence-sharded in, channel-sharded over the whole sequence for the mixer's
own kernel, sequence-sharded out.

Legend: b batch, s full sequence, s_l = s / P tokens per rank, C channels of the mixer's
input (all heads), c the channels one rank mixes, P the size of the SP group (ulysses x
ring: a recurrence has no ring split, so every SP rank takes a share of the heads).

:class:`MixerExchange` holds, for one batch shape (and one packed row's documents), the
permutation between the ranks' shards in rank order and the natural order of the
sequence. :meth:`MixerExchange.to_channels` sends every rank the channels it mixes (an
index per rank: heads, or channel groups such as Mamba2's B/C that several ranks need,
which then travel to each of them) for all tokens, in natural order;
:meth:`MixerExchange.from_channels` sends each rank's mixed channels back to the ranks
holding the tokens. Both are one all-to-all over the SP group (``PendingAllToAll``, byte
counted) and differentiable; the backward of each is the other's all-to-all.

:meth:`MixerExchange.sum_over_ranks` all-reduces partial sums over the ranks' channels
(a projection that reads every channel, such as Mamba1's ``x_proj``), in forward and in
backward.

Documents: a packed row (``cu``, sharded in the run's packing: document-wise or row-wise)
is in natural order after :meth:`to_channels`, so the kernel runs once per document
(:meth:`MixerExchange.documents`), each from a fresh state.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..core.comm import PendingAllToAll, collective, stats
from ..core.sharding import layout_indices
from ..core.topology import Topology
from ..core.varlen import Permute, doc_layout_indices, inverse_permutation

__all__ = ["MixerExchange", "split_channels"]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _exchange(send: torch.Tensor, topo: Topology) -> torch.Tensor:
    """All-to-all over dim 0 (destination rank in, source rank out), differentiable."""
    pending = PendingAllToAll(topo.sp_group)
    return pending.finish(pending.start(send, _same, _same), _same, _same)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over the SP group in forward and in backward: every rank uses the
    sum, so each rank's share gets the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _all_reduce(x, topo, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.topo, "backward"), None


def _all_reduce(x: torch.Tensor, topo: Topology, phase: str) -> torch.Tensor:
    """Sum of ``x`` over the SP group, counted as a ring all-reduce sends: ``2 (P-1)/P`` of
    its bytes (op ``mixer_all_reduce``)."""
    x = x.contiguous().clone()
    P = topo.sp_world_size
    with collective("mixer_all_reduce", phase, topo.sp_group):
        dist.all_reduce(x, group=topo.sp_group)
    stats.add("mixer_all_reduce", phase, 2 * (P - 1) * x.numel() * x.element_size() // P)
    return x


def split_channels(groups: list[torch.Tensor], P: int, what: str) -> list[torch.Tensor]:
    """Per rank, the channel indices it mixes: ``groups`` are index tensors of one kind
    each (q, k, v channels; x, B, C...), each ``(n, width)`` with n units (heads or groups)
    that split evenly over P ranks. ``ValueError`` naming the unit counts otherwise."""
    for g in groups:
        if g.shape[0] % P:
            raise ValueError(
                f"{what}: {g.shape[0]} units do not split over {P} sequence-parallel ranks"
            )
    return [torch.cat([g.unflatten(0, (P, -1))[r].flatten() for g in groups]) for r in range(P)]


class MixerExchange:
    """The exchanges of one batch: ``b`` rows of ``s_l`` local tokens (or one packed row
    with global boundaries ``cu``) over the SP group of ``topo`` in its layout."""

    def __init__(self, topo: Topology, s_l: int, cu: torch.Tensor | None = None) -> None:
        P, layout = topo.sp_world_size, topo.layout
        self.topo, self.P, self.s_l = topo, P, s_l
        s = s_l * P
        self.bounds = [0, s] if cu is None else [int(x) for x in cu.tolist()]
        if cu is None or topo.options.packing == "row":  # sharded like an unpacked row
            held = [layout_indices(s, P, r, layout) for r in range(P)]
        else:
            held = [doc_layout_indices(self.bounds, P, r, layout) for r in range(P)]
        order = torch.cat(held)  # global index of each token, ranks' shards in rank order
        self.natural = inverse_permutation(order)  # rank order -> natural order
        self.order = order
        self.identity = bool(torch.equal(order, torch.arange(s)))

    def documents(self) -> list[tuple[int, int]]:
        """``[start, end)`` of every document in natural order (one for unpacked rows)."""
        return list(itertools.pairwise(self.bounds))

    def to_channels(self, x: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
        """``(b, s_l, C)`` this rank's tokens, all channels -> ``(b, s, c)``: every token
        in natural order, the channels ``index[sp_rank]``."""
        P = self.P
        if P == 1:
            return x.index_select(-1, index[0].to(x.device))
        idx = torch.stack(index).to(x.device)  # (P, c)
        # (b, s_l, C) -> (P, b, s_l, c): dim 0 = destination rank
        send = x[..., idx].permute(2, 0, 1, 3)
        recv = _exchange(send, self.topo)  # (P, b, s_l, c): dim 0 = source rank
        full = recv.permute(1, 0, 2, 3).flatten(1, 2)  # (b, s, c), shards in rank order
        if self.identity:
            return full
        perm, inv = self.natural.to(x.device), self.order.to(x.device)
        return Permute.apply(full, perm, inv, 1)  # natural order

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the SP group of every rank's ``x`` (partial sums over its channels
        of a projection that reads all channels: Mamba1's ``x_proj``), differentiable."""
        return x if self.P == 1 else _SumOverRanks.apply(x, self.topo)

    def from_channels(self, y: torch.Tensor) -> torch.Tensor:
        """``(b, s, c)`` this rank's mixed channels for every token, natural order ->
        ``(b, s_l, P * c)``: this rank's tokens, every rank's channels in rank order."""
        if self.P == 1:
            return y
        if not self.identity:
            perm, inv = self.order.to(y.device), self.natural.to(y.device)
            y = Permute.apply(y, perm, inv, 1)  # natural -> rank order
        # (b, s, c) -> (P, b, s_l, c): dim 0 = destination rank (its tokens)
        send = y.unflatten(1, (self.P, self.s_l)).permute(1, 0, 2, 3)
        recv = _exchange(send, self.topo)  # (P, b, s_l, c): dim 0 = source rank (channels)
        return recv.permute(1, 2, 0, 3).flatten(2, 3)  # (b, s_l, P * c)
