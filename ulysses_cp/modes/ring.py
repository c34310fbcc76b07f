"""Ring attention (Liu et al., arXiv:2310.01889) with zigzag load balancing.

Legend: b batch, s_l local tokens, hq/hkv heads, d head dim, P ring size, r ring rank,
``src = (r - step) mod P`` the rank whose kv block is visiting at ``step``.

Forward: every step attends the local q to the visiting kv block with the local kernel,
merges ``(out, lse)`` into fp32 accumulators with the stable update (ring-flash-attention
PR #34): ``out -= sigmoid(lse_b - lse) * (out - out_b)``, ``lse -= logsigmoid(lse - lse_b)``,
and passes kv on; the send of the next block is posted before the compute.

Backward recomputes block by block from the saved local q/k/v, the FINAL out and lse
(FlashAttention-2 backward), accumulates dq locally, and sends the dk/dv accumulators
around the ring with their kv block: after P hops they are home. Saved state is O(s_l).

Which blocks a step computes (causal skipping, zigzag halves, windows, packed rows) is
:mod:`.schedule`'s; the point-to-point step is ``core.comm.RingComm``. With
``Ring(group=None)`` (one rank) the same machinery is block-sparse local attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.comm import RingComm, collective, group_rank, group_size, stats
from ..core.protocols import Group
from ..core.rows import RowDocs
from ..core.varlen import Docs
from ..kernels.blocks import work
from ..kernels.dispatch import KernelCall, attn_backward, attn_forward
from ..kernels.math_backend import lse_dtype
from ..kernels.sinks import SavedAttention
from .schedule import Schedule, window_split

__all__ = [
    "Ring",
    "merge",
    "merge_",
    "ring_attention",
    "ring_backward",
    "ring_forward",
    "ring_functions",
]


@dataclass(frozen=True, eq=False)
class Ring:
    """How a ring runs: its process ``group`` (None: one rank, block-sparse local
    attention), the ``layout`` of the tokens over it, a packed row's ``docs`` (batch 1) in
    this ring's document-wise layout (:class:`~ulysses_cp.core.varlen.Docs`) or row-wise
    (:class:`~ulysses_cp.core.rows.RowDocs`), how KV moves
    (``exchange``: ``"ring"`` point-to-point steps, or ``"allgather"``: one all-gather of KV
    and an all-to-all + sum of the dk/dv shares in the backward), the pieces per layout
    chunk under a window (``split``; None: :func:`~.schedule.window_split`'s choice) and
    ``overlap`` (False waits for each kv transfer before computing: only to measure what
    the overlap buys)."""

    group: Group
    layout: str
    docs: Docs | RowDocs | None = None
    exchange: str = "ring"
    split: int | None = None
    overlap: bool = True

    def schedule(self, s_l: int, call: KernelCall) -> Schedule:
        P, rank = group_size(self.group), group_rank(self.group)
        window = (call.spec.window[0], call.spec.window[1])
        split = 1 if self.split is None else self.split
        return Schedule(P, rank, s_l, call.spec.causal, self.layout, self.docs, window, split)


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result into the accumulators (all fp32/fp64); returns new (out, lse)
    (:func:`merge_` on copies).

    out ``(b, s, h, d)``, lse ``(b, h, s)``. Rows empty on both sides stay empty (-inf)."""
    out, lse = out.clone(), lse.clone()
    merge_(out, lse, out_b, lse_b)
    return out, lse


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """:func:`merge` in place: ``out`` and ``lse`` (views of the accumulators allowed) are
    overwritten, with no temporary of ``out``'s size (``out + w (out_b - out)`` by lerp)."""
    w = torch.sigmoid(lse_b - lse).nan_to_num(0.0)  # both -inf: nan -> keep out
    out.lerp_(out_b, w.transpose(1, 2).unsqueeze(-1))
    new = lse - F.logsigmoid(lse - lse_b)
    lse.copy_(torch.where(torch.isinf(lse) | torch.isinf(lse_b), torch.maximum(lse, lse_b), new))


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k and v in one buffer, one send per step: ``(2, b, s_l, hkv, d)``, or for values of
    their own width (MLA) ``(b, s_l, hkv, dk + dv)``, V at its width."""
    return torch.stack([k, v]) if k.shape == v.shape else torch.cat([k, v], dim=-1)


def _unpack(kv: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_pack`'s ``(k, v)`` (views); ``dk``: k's head dim."""
    if kv.dim() == 5:
        return kv[0], kv[1]
    return kv[..., :dk], kv[..., dk:]


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: Ring, call: KernelCall
) -> tuple[torch.Tensor, torch.Tensor]:
    b, s_l, hq, _ = q.shape
    schedule = ring.schedule(s_l, call)
    acc = lse_dtype(q.dtype)
    out = torch.zeros(b, s_l, hq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, s_l), float("-inf"), dtype=acc, device=q.device)
    for step, kv in _visiting(_pack(k, v), ring, "forward"):
        kb, vb = _unpack(kv, k.shape[-1])
        blocks, skipped = schedule.blocks(step)
        work.skipped["forward"] += skipped
        for qs, ks, where in blocks:
            o_b, l_b = attn_forward(q[:, qs], kb[:, ks], vb[:, ks], call.at(**where))
            o, lo = out[:, qs], lse[:, :, qs]  # views for a slice (merged in place), else copies
            merge_(o, lo, o_b.to(acc), l_b.to(acc))
            if not isinstance(qs, slice):
                out[:, qs], lse[:, :, qs] = o, lo
            del o, lo, o_b, l_b
    return out, lse


def _visiting(kv: torch.Tensor, ring: Ring, phase: str, tag: int = 0):
    """``(step, kv block of rank (r - step) mod P)`` for every step. ``"ring"``: the next
    block's send/receive is posted before the caller computes on this one (``overlap=False``
    waits first, to measure what the overlap buys); ``"allgather"``: one all-gather."""
    group = ring.group
    P, rank = group_size(group), group_rank(group)
    if ring.exchange == "allgather" and P > 1:
        blocks = _all_gather(kv, group, phase)
        for step in range(P):
            yield step, blocks[(rank - step) % P]
        return
    comm = cast(RingComm, RingComm(group, "ring", phase, tag) if P > 1 else None)  # P > 1 only
    for step in range(P):
        if step + 1 < P:
            comm.send_recv(kv)  # posted before the compute so they overlap
            nxt = None if ring.overlap else comm.wait()
        yield step, kv
        if step + 1 < P:
            kv = comm.wait() if nxt is None else nxt


def _all_gather(x: torch.Tensor, group: Group, phase: str) -> list[torch.Tensor]:
    """Every ring rank's ``x`` (index = rank in the group); counted as ``kv_allgather``:
    this rank's block sent to the P - 1 others."""
    P = group_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(P)]
    stats.add("kv_allgather", phase, x.numel() * x.element_size() * (P - 1))
    with collective("all_gather", phase, group):
        dist.all_gather(parts, x, group=group)
    return parts


def _reduce_scatter(parts: torch.Tensor, group: Group) -> torch.Tensor:
    """``parts (P, ...)``: this rank's contribution to every rank's block -> the sum of
    every rank's contribution to ours (an all-to-all, then a local sum: gloo has no
    reduce-scatter); counted as ``kv_reduce_scatter``: P - 1 parts sent."""
    P = parts.shape[0]
    parts = parts.contiguous()
    got = torch.empty_like(parts)
    stats.add("kv_reduce_scatter", "backward", parts[0].numel() * parts.element_size() * (P - 1))
    with collective("all_to_all", "backward", group):
        dist.all_to_all_single(got, parts, group=group)
    return got.sum(0)


def _add_blocks(dkv: torch.Tensor, done: list, dk: int) -> None:
    """The step's kv-block gradients ``[(kv selection, dk, dv)]`` into ``dkv`` (packed as
    :func:`_pack`; ``dk``: k's head dim)."""
    gk, gv = _unpack(dkv, dk)
    for ks, dk_b, dv_b in done:
        gk[:, ks] += dk_b
        gv[:, ks] += dv_b


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    ring: Ring,
    call: KernelCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = ring.group
    P, rank = group_size(group), group_rank(group)
    schedule = ring.schedule(q.shape[1], call)
    call = call.at(accumulate=True)  # block gradients are summed
    acc = lse_dtype(q.dtype)
    dq: torch.Tensor | None = None  # the first whole block's dq, or zeros
    whole = slice(0, q.shape[1])
    gathered = ring.exchange == "allgather" and P > 1
    kv_own = _pack(k, v)  # dk and dv are packed as the kv block they belong to
    if gathered:  # this rank's share of every block's dk/dv, reduce-scattered at the end
        dkv_all = torch.zeros((P, *kv_own.shape), dtype=acc, device=k.device)
    dkv = torch.zeros(kv_own.shape, dtype=acc, device=k.device)  # travels with its kv block
    # used only on the ring with P > 1
    dkv_comm = cast(RingComm, RingComm(group, "ring", "backward", tag=2) if P > 1 else None)
    for step, kv in _visiting(kv_own, ring, "backward", tag=1):
        kb, vb = _unpack(kv, k.shape[-1])
        done = []
        blocks, skipped = schedule.blocks(step)
        work.skipped["backward"] += skipped
        for qs, ks, where in blocks:
            rows = (dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs])
            dq_b, dk_b, dv_b = attn_backward(*rows, lse[:, :, qs], call.at(**where))
            if dq is None and isinstance(qs, slice) and qs == whole and dq_b.dtype == acc:
                dq = dq_b  # no zeros and no copy: later blocks add into it
            else:
                dq = torch.zeros_like(q, dtype=acc) if dq is None else dq
                dq[:, qs] += dq_b
            done.append((ks, dk_b, dv_b))
            del dq_b, dk_b, dv_b  # the next block's gradients must not meet these
        if gathered:
            dkv = dkv_all[(rank - step) % P]
        elif step > 0:
            dkv = dkv_comm.wait()  # the accumulator of the visiting block (overlapped compute)
        _add_blocks(dkv, done, k.shape[-1])
        done = []  # released before the next block's gradients exist
        if P > 1 and not gathered:
            dkv_comm.send_recv(dkv)  # on to the next rank; overlaps the next step
    if gathered:
        dkv = _reduce_scatter(dkv_all, group)
    elif P > 1:
        dkv = dkv_comm.wait()  # our own block's accumulator, home after P hops
    dq = torch.zeros_like(q) if dq is None else dq  # every block skipped
    gk, gv = _unpack(dkv, k.shape[-1])
    return dq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: Ring,
    call: KernelCall,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention over ``ring.group``; inputs validated by the caller.

    q ``(b, s_l, hq, d)``, k/v ``(b, s_l, hkv, d)`` in ``ring.layout`` over the ring ->
    ``(b, s_l, hq, d)`` in q's dtype. ``call``: the spec and backend of every block (the
    softcap per block is exact: the merge only needs each block's lse; a window is taken
    over global positions, chunk pair by chunk pair, pairs out of every query's reach
    skipped). ``sinks`` ``(hq,)``: attention-sink logits, applied once to the merged result
    (:func:`~ulysses_cp.kernels.sinks.add_sinks`)."""
    fwd, bwd = ring_functions(ring, call, q.shape[1])
    return SavedAttention.apply(q, k, v, sinks, fwd, bwd)


def ring_functions(ring: Ring, call: KernelCall, s_l: int) -> tuple[partial, partial]:
    """``(fwd(q, k, v) -> (out, lse), bwd(dout, q, k, v, out, lse) -> (dq, dk, dv))`` of
    ring attention over ``s_l`` local tokens, not differentiable themselves (the pieces
    :func:`ring_attention` puts in one autograd function, and
    :mod:`.redo` calls itself)."""
    if ring.split is None and call.spec.windowed:
        parts = 1 if ring.layout == "contiguous" else 2
        window = (int(call.spec.window[0]), int(call.spec.window[1]))
        ring = replace(ring, split=window_split(s_l, window, parts))
    return partial(ring_forward, ring=ring, call=call), partial(ring_backward, ring=ring, call=call)
