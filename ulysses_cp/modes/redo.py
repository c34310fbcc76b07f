"""Ulysses attention that redoes its all-to-alls in the backward (``redo_all_to_all``).

Legend: b batch, s full sequence, s_l = s/P, P ulysses degree, c head chunks, qc/kc query
and kv heads of one chunk (kv heads after replication, as in :mod:`.ulysses`).

:func:`~.ulysses.ulysses_attention` keeps the head-sharded q, k, v and output of every
chunk for the backward: ``(b, s, hq/P + 2 hk/P + hq/P, d)``, as many bytes as the caller's
own sequence-sharded q, k, v and output. Here the forward keeps only what the caller
already holds (the sequence-sharded q, k, v and the returned output, saved by reference)
and each chunk's lse ``(b, qc, s)`` in fp32. The backward, chunk by chunk, moves q, k, v
and the output to the head-sharded layout again (the forward's all-to-alls, redone),
together with the output gradient, runs the kernel's backward from them, and sends the
gradients back. Every all-to-all here is waited for at once and its buffers released
before the next, so that at most one chunk's head-sharded tensors are alive.

Cost: the backward moves q, k, v and the output once more: per rank and layer
``(N/P)(2 hq + 2 hk) d (P-1)/P`` bytes more, i.e. 1.5x the all-to-all bytes of a training
step (counted as ``all_to_all_redo`` in ``ucp.comm_stats``), and none of it overlaps
compute. Exact: the backward sees the same tensors as the forward did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..core.comm import collective, group_size, stats
from ..core.protocols import Group
from ..kernels.sinks import add_sinks, sinks_grad
from .ulysses import _from_ranks, _to_ranks, kv_replication

__all__ = ["redo_attention"]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _exchange(send: torch.Tensor, group: Group, phase: str, op: str) -> torch.Tensor:
    """One all-to-all over dim 0 (= the group size), waited for; dim 0 of the result
    indexes the source rank. ``send`` is released by the caller right after."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    P = send.shape[0]
    stats.add(op, phase, send.numel() * send.element_size() * (P - 1) // P)
    with collective("all_to_all", phase, group):
        dist.all_to_all_single(recv, send, group=group)
    return recv


class _Plan:
    """What the forward and the backward share: the group, the token ``order``, the chunk
    split and the inner ``fwd``/``bwd`` (local kernel or ring, options bound)."""

    def __init__(self, group, order, chunks: int, fwd: Forward, bwd: Backward) -> None:
        self.group, self.order, self.c = group, order, chunks
        self.P = group_size(group)
        self.fwd, self.bwd = fwd, bwd

    def heads(self, x: torch.Tensor, i: int, c: int, phase: str, op: str) -> torch.Tensor:
        """Chunk ``i`` of ``c`` of this rank's share of the heads of the sequence-sharded
        ``x (b, s_l, h, d)`` -> head-sharded ``(b, s, h/(P c), d)`` in token order."""
        P = self.P
        part = x.unflatten(2, (P, c, x.shape[2] // (P * c)))[:, :, :, i]  # (b, s_l, P, h', d)
        # (b, s_l, P, h', d) -> (P, b, s_l, h', d): dim 0 = destination rank (head group)
        recv = _exchange(part.permute(2, 0, 1, 3, 4), self.group, phase, op)
        return _from_ranks(recv, P, self.order)  # dim 0 was the source (sequence chunk)

    def tokens(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        """Head-sharded ``x (b, s, h', d)`` of one chunk back to sequence-sharded
        ``(b, s_l, P, h', d)`` (dim 2 = the rank whose heads these are; a view)."""
        # (b, s, h', d) -> (P, b, s_l, h', d): dim 0 = destination rank (sequence chunk)
        recv = _exchange(_to_ranks(x, self.P, self.order), self.group, phase, "all_to_all")
        return recv.permute(1, 2, 0, 3, 4)  # dim 0 was the head group


class _Redo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: _Plan, rep: int):
        P, c = plan.P, plan.c
        kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
        ql, kl = q.shape[2] // P, kr.shape[2] // P
        ck = min(c, kl)
        per_kv = c // ck
        b, s_l, _, d = q.shape
        out = q.new_empty(b, s_l, P, c, ql // c, d)
        lses, kv = [], None
        a2a = "all_to_all"
        for i in range(c):
            if i % per_kv == 0:
                kv = None  # the previous kv chunk released first, then the next one fetched
                kv = tuple(plan.heads(t, i // per_kv, ck, "forward", a2a) for t in (kr, vr))
            assert kv is not None
            qh = plan.heads(q, i, c, "forward", "all_to_all")
            o, lse = plan.fwd(qh, *kv)
            del qh
            if sinks is not None:
                o, lse = add_sinks(o, lse, sinks[i * (ql // c) : (i + 1) * (ql // c)])
            lses.append(lse)
            out[:, :, :, i].copy_(plan.tokens(o.to(q.dtype), "forward"))
            del o
        out = out.view(b, s_l, P * c * (ql // c), d)
        ctx.plan, ctx.rep = plan, rep
        ctx.save_for_backward(q, k, v, out, torch.stack(lses), sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lses, sinks = ctx.saved_tensors
        plan, rep = ctx.plan, ctx.rep
        P, c = plan.P, plan.c
        kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
        ql, kl = q.shape[2] // P, kr.shape[2] // P
        ck = min(c, kl)
        per_kv, qc = c // ck, ql // c
        b, s_l, _, d = q.shape
        # the gradients come back a chunk at a time: (b, s_l, P, h', d) pieces, put together
        # once at the end (nothing allocated for them before they arrive)
        dq: list[torch.Tensor] = []
        dkv: list[list[torch.Tensor]] = [[], []]
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        kv = acc = None
        redo = "all_to_all_redo"
        for i in range(c):
            if i % per_kv == 0:
                kv = tuple(plan.heads(t, i // per_kv, ck, "backward", redo) for t in (kr, vr))
            assert kv is not None
            qh = plan.heads(q, i, c, "backward", redo)
            oh = plan.heads(out, i, c, "backward", redo)
            gh = plan.heads(dout, i, c, "backward", "all_to_all")
            dq_h, dk_h, dv_h = plan.bwd(gh, qh, *kv, oh, lses[i])
            if sinks is not None and dsinks is not None:
                part = slice(i * qc, (i + 1) * qc)
                dsinks[part] = sinks_grad(gh, oh, lses[i], sinks[part])
            del qh, oh, gh
            dq.append(plan.tokens(dq_h, "backward"))
            del dq_h
            if acc is None:
                acc = (dk_h, dv_h)
            else:  # in place: the chunk's own kv gradients are freed at once
                acc[0].add_(dk_h)
                acc[1].add_(dv_h)
            del dk_h, dv_h
            if i % per_kv == per_kv - 1:  # the last query chunk of this kv chunk
                kv = None
                for g, into in zip(acc, dkv):
                    into.append(plan.tokens(g, "backward"))
                acc = None
        # pieces (b, s_l, P, h', d) -> (b, s_l, P, pieces, h', d) -> (b, s_l, h, d)
        grads = [torch.stack(x, 3).view(b, s_l, -1, d) for x in (dq, *dkv)]
        dk, dv = grads[1:]
        if rep > 1:  # the replicas' gradients summed: (b, s_l, hkv * rep, d) -> (b, s_l, hkv, d)
            dk, dv = (g.unflatten(2, (-1, rep)).sum(3) for g in (dk, dv))
        return grads[0], dk, dv, dsinks, None, None


def redo_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    inner: tuple[Forward, Backward],
    order: str | tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None = None,
    head_chunks: int = 1,
) -> torch.Tensor:
    """:func:`~.ulysses.ulysses_attention` with the all-to-alls redone in the backward
    (module docstring). ``inner``: ``fwd(q, k, v) -> (out, lse)`` and ``bwd(dout, q, k, v,
    out, lse) -> (dq, dk, dv)``, the local kernel's or the ring's, on head-sharded tensors; the rest
    as in :func:`~.ulysses.ulysses_attention`. Inputs validated by the caller."""
    P = group_size(group)
    rep = kv_replication(q.shape[2], k.shape[2], P)
    plan = _Plan(group, order, head_chunks, *inner)
    return _Redo.apply(q, k, v, sinks, plan, rep)
