"""Move a packed row's tokens from one document-wise layout to another, across ranks.

Legend: a row of N tokens, P sequence-parallel ranks, ``bounds`` the document boundaries
(``[0, ..., N]``); ``doc_layout_indices(bounds, P, rank, layout)`` says which global tokens
a rank holds, in its local order (:mod:`~ulysses_cp.core.varlen`).

Two boundary lists over the same row give two layouts. Where a layer needs documents other
than the row's (Llama 4's chunked-attention layers see each document cut into chunks of
``attention_chunk_size`` tokens), its q, k, v move to the layout of those documents, the
attention runs there, and its output moves back. :class:`Relayout` is that move: one
all-to-all with uneven splits over the SP group (rank ``a`` sends rank ``b`` the tokens it
holds under the first layout that ``b`` holds under the second), differentiable (the
backward is the move the other way). Every rank holds ``N / P`` tokens in both layouts,
so shapes do not change.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .comm import collective, stats
from .protocols import Group
from .varlen import doc_layout_indices, inverse_permutation

__all__ = ["Relayout", "chunk_bounds"]


def chunk_bounds(bounds: list[int], chunk: int) -> list[int]:
    """``bounds`` with every document also cut every ``chunk`` tokens from its start (the
    chunks of Llama 4's chunked attention, positions restarting per document)."""
    if chunk < 1:
        raise ValueError(f"the chunk size must be >= 1, got {chunk}")
    out = [0]
    for a, b in itertools.pairwise(bounds):
        out += [*range(a + chunk, b, chunk), b]
    return out


class _Plan:
    """Index lists of one direction of the move, for one rank (built identically on every
    rank from the same bounds, so no collective is needed to agree on them)."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor], rank: int) -> None:
        P, n = len(src), sum(t.numel() for t in src)
        owner = torch.empty(n, dtype=torch.long)  # the rank holding token g under dst
        where = torch.empty(n, dtype=torch.long)  # its local position there
        for r, idx in enumerate(dst):
            owner[idx] = r
            where[idx] = torch.arange(idx.numel())
        mine = src[rank]  # global ids, in this rank's local order under src
        # send: this rank's tokens grouped by destination, each group in the receiver's order
        order = torch.argsort(owner[mine] * n + where[mine])
        self.send = order
        self.send_counts = torch.bincount(owner[mine], minlength=P).tolist()
        # receive: blocks from ranks 0..P-1, each in this rank's dst order
        recv_global = []
        for s in range(P):
            theirs = src[s][owner[src[s]] == rank]
            recv_global.append(theirs[torch.argsort(where[theirs])])
        got = torch.cat(recv_global)
        self.recv_counts = [t.numel() for t in recv_global]
        # received token i goes to local position where[got[i]]
        self.place = inverse_permutation(where[got])


class Relayout:
    """Tokens of a ``(b, s_local, ...)`` tensor (dim 1) from the layout of ``src_bounds`` to
    that of ``dst_bounds`` over ``group`` (``P`` ranks, this rank ``rank``); :meth:`back`
    is the inverse move. Both calls are differentiable."""

    def __init__(
        self,
        src_bounds: list[int],
        dst_bounds: list[int],
        *,
        P: int,
        rank: int,
        layout: str,
        group: Group,
    ) -> None:
        if src_bounds[-1] != dst_bounds[-1]:
            raise ValueError(f"bounds of different rows: {src_bounds[-1]} vs {dst_bounds[-1]}")
        src = [doc_layout_indices(src_bounds, P, r, layout) for r in range(P)]
        dst = [doc_layout_indices(dst_bounds, P, r, layout) for r in range(P)]
        self.forward_plan, self.backward_plan = _Plan(src, dst, rank), _Plan(dst, src, rank)
        self.group, self.rank = group, rank
        self.identity = all(torch.equal(a, b) for a, b in zip(src, dst))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return x
        return _Move.apply(x, self.forward_plan, self.backward_plan, self.group, self.rank)

    def back(self, x: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return x
        return _Move.apply(x, self.backward_plan, self.forward_plan, self.group, self.rank)


def _move(x: torch.Tensor, plan: _Plan, group: Group, rank: int, phase: str) -> torch.Tensor:
    # (b, s_l, ...) -> (s_l, b, ...): the all-to-all splits dim 0
    send = x.index_select(1, plan.send.to(x.device)).movedim(1, 0).contiguous()
    recv = send.new_empty((sum(plan.recv_counts), *send.shape[1:]))
    with collective("all_to_all", f"relayout {phase}", group):
        dist.all_to_all_single(recv, send, plan.recv_counts, plan.send_counts, group=group)
    per_token = send[0].numel() * send.element_size() if send.shape[0] else 0
    stats.add("all_to_all", phase, per_token * (send.shape[0] - plan.send_counts[rank]))
    # (s_l, b, ...) -> (b, s_l, ...), each token at its local position
    return recv.index_select(0, plan.place.to(x.device)).movedim(0, 1)


class _Move(torch.autograd.Function):
    """A relayout; its backward is the move the other way."""

    @staticmethod
    def forward(ctx, x, plan, back, group, rank):
        ctx.args = (back, group, rank)
        return _move(x, plan, group, rank, "forward")

    @staticmethod
    def backward(ctx, grad):
        back, group, rank = ctx.args
        return _move(grad.contiguous(), back, group, rank, "backward"), None, None, None, None
