"""Ulysses all-to-all attention (Jacobs et al., DeepSpeed-Ulysses, arXiv:2309.14509) in
head chunks, forward and backward written out by hand so that the memory of each step is
ours to choose.

Legend: b batch, s full sequence, s_l = s/P, P ulysses degree, c head chunks, qc/kc query
and kv heads of one chunk (kv heads after replication, :func:`~.ulysses.kv_replication`).

Forward, chunk by chunk: chunk i's q (and its kv chunk, with the first query chunk that
needs it) goes to the head-sharded layout in one all-to-all, posted before chunk i-1's
attention runs; the inner attention (the local kernel, or the ring in hybrid mode) runs on
``(b, s, qc, d)``; its output goes back in an all-to-all that runs during the next chunk.

What the backward needs, two ways (``redo``):

- kept (the default): each chunk's head-sharded q, k, v and output, saved for backward
  (as many bytes as the caller's sequence-sharded q, k, v and output), each in its own
  buffer, **freed as soon as the backward has used it** (its storage released), so the
  backward of chunk i holds only the chunks not yet done.
- redone (``redo_all_to_all``): nothing head-sharded is saved; the backward moves chunk
  i's q, output and kv chunk again, in the same message as its output gradient. Per rank
  and layer ``(N/P)(2 hq + 2 hk) d (P-1)/P`` bytes more (1.5x the all-to-all bytes of a
  step, counted as ``all_to_all_redo``), none overlapped. It pays where the saved copies
  add up: many layers without activation checkpointing.

Backward, chunk by chunk, one output gradient in flight at a time: fetch chunk i's dO
(waited for), run the inner backward, send dq back (and dk/dv when the kv chunk is done),
post the next chunk's fetch, wait. The gradients of q, k, v come back in pieces and are
put together once, at the end. Exact: the backward sees the tensors the forward did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.comm import PendingAllToAll, group_size, stats
from ..core.protocols import Group
from ..kernels.sinks import add_sinks, sinks_grad
from .ulysses import _from_ranks, _to_ranks, kv_replication

__all__ = ["HeadChunks", "chunked_attention"]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class HeadChunks(NamedTuple):
    """How the heads go through the all-to-alls: in ``number`` chunks (one of
    :func:`~.ulysses.head_chunk_choices`); ``redo``: keep nothing head-sharded for the
    backward and redo the all-to-alls there (module docstring)."""

    number: int = 1
    redo: bool = False


def _free(*tensors: torch.Tensor) -> None:
    """Release the memory of buffers only this module holds (saved for backward: the
    references stay with autograd until the backward returns, the bytes go now)."""
    for t in tensors:
        t.untyped_storage().resize_(0)


class _Plan:
    """What the forward and the backward share: the group, the token ``order``, the chunk
    split, the inner ``fwd``/``bwd`` (local kernel or ring, options bound), ``redo``."""

    def __init__(self, group, order, chunks: int, fwd: Forward, bwd: Backward, redo: bool):
        self.group, self.order, self.c, self.redo = group, order, chunks, redo
        self.P = group_size(group)
        self.fwd, self.bwd = fwd, bwd

    def shape(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Chunk sizes for q ``(b, s_l, hq, d)`` and k ``(b, s_l, hkv, d)``."""
        P, c = self.P, self.c
        self.rep = kv_replication(q.shape[2], k.shape[2], P)
        ql, kl = q.shape[2] // P, k.shape[2] * self.rep // P
        self.ck = min(c, kl)
        self.per_kv, self.qc, self.kc = c // self.ck, ql // c, kl // self.ck

    def replicated(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (b, s_l, hkv, d) -> (b, s_l, hkv * rep, d): kv head j for ranks [j*rep, (j+1)*rep)
        if self.rep == 1:
            return k, v
        return k.repeat_interleave(self.rep, 2), v.repeat_interleave(self.rep, 2)

    def part(self, x: torch.Tensor, i: int, c: int) -> torch.Tensor:
        """Chunk ``i`` of ``c`` of every rank's heads of ``x (b, s_l, h, d)``, as a send
        part ``(P, b, s_l, h/(P c), d)``: dim 0 = destination rank (a view)."""
        P = self.P
        return x.unflatten(2, (P, c, x.shape[2] // (P * c)))[:, :, :, i].permute(2, 0, 1, 3, 4)

    def post(
        self, parts: list[tuple[torch.Tensor, str]], phase: str, release: bool = False
    ) -> PendingAllToAll:
        """One all-to-all of ``parts`` ``(P, b, s_l, h_i, d_i)`` packed along heads x width
        (MLA's values are narrower than q and k); each part's bytes counted under its op.
        The packed send buffer is freed once sent; one contiguous part goes as it is, freed
        only with ``release`` (the caller's tensor)."""
        # (P, b, s_l, sum h_i d_i); one part keeps its shape, and goes as it is if contiguous
        one = len(parts) == 1 and parts[0][0].is_contiguous()
        if len(parts) == 1:
            send = parts[0][0].contiguous()
        else:
            send = torch.cat([t.flatten(3) for t, _ in parts], dim=3)
        sent: dict[str, int] = {}  # bytes per op; one call per op and message
        for t, op in parts:
            sent[op] = sent.get(op, 0) + t.numel() * t.element_size() * (self.P - 1) // self.P
        for op, nbytes in sent.items():
            stats.add(op, phase, nbytes)
        pending = PendingAllToAll(self.group)
        pending.post(send, phase, op=None, release=release or not one)
        return pending

    def unpack(
        self, pending: PendingAllToAll, sizes: list[tuple[int, int]], phase: str
    ) -> list[torch.Tensor]:
        """The received ``(P, b, s_l, sum n d)`` (dim 0 = source rank, i.e. sequence chunk)
        -> one ``(b, s, n, d)`` tensor in token order per ``(n, d)`` in ``sizes``, each its
        own buffer."""
        recv, out, at = pending.wait(phase), [], 0
        flat = recv.flatten(3)
        for n, d in sizes:
            part = flat[:, :, :, at : at + n * d].unflatten(3, (n, d))
            out.append(_from_ranks(part, self.P, self.order).contiguous())
            at += n * d
        ptr = recv.untyped_storage().data_ptr()
        if all(o.untyped_storage().data_ptr() != ptr for o in out):  # all copied out of it
            recv.untyped_storage().resize_(0)
        return out

    def send_back(self, x: torch.Tensor, phase: str, release: bool = False) -> PendingAllToAll:
        """Head-sharded ``(b, s, h', d)`` back to sequence-sharded: posted (``release``: the
        caller lets go of ``x``, freed once sent)."""
        # (b, s, h', d) -> (P, b, s_l, h', d): dim 0 = destination rank (sequence chunk)
        return self.post([(_to_ranks(x, self.P, self.order), "all_to_all")], phase, release)

    def back(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`send_back` in the backward, waited for: ``(b, s_l, P, h', d)`` (dim 2 =
        the rank whose heads these are). ``x`` is released by the caller."""
        return self.send_back(x, "backward", True).wait("backward").permute(1, 2, 0, 3, 4)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: _Plan):
        plan.shape(q, k)
        P, c, qc, kc, per_kv = plan.P, plan.c, plan.qc, plan.kc, plan.per_kv
        kr, vr = plan.replicated(k, v)
        b, s_l, _, d = q.shape
        dv = v.shape[-1]  # MLA: narrower than q and k

        def inbound(i: int) -> PendingAllToAll:  # chunk i's q, and its kv chunk if new
            parts = [plan.part(q, i, c)]
            if i % per_kv == 0:
                parts += [plan.part(t, i // per_kv, plan.ck) for t in (kr, vr)]
            return plan.post([(t, "all_to_all") for t in parts], "forward")

        out = q.new_empty(b, s_l, P, c, qc, dv)  # dim 2: the rank that computed the heads
        kept: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        pending: PendingAllToAll | None = inbound(0)
        back, kv = None, None
        for i in range(c):
            nxt = inbound(i + 1) if i + 1 < c else None  # in flight while chunk i computes
            new_kv = i % per_kv == 0
            assert pending is not None
            heads = plan.unpack(pending, [(qc, d)] + [(kc, d), (kc, dv)] * new_kv, "forward")
            pending = nxt
            if new_kv:
                kv = heads[1:]
            assert kv is not None
            o, lse = plan.fwd(heads[0], *kv)
            if sinks is not None:
                o, lse = add_sinks(o, lse, sinks[i * qc : (i + 1) * qc])
            o = o.to(q.dtype)
            lses.append(lse)
            if not plan.redo:
                kept += [heads[0], *heads[1:], o]
            sent = plan.send_back(o, "forward")  # runs during the next chunk
            del o, heads
            if back is not None:
                out[:, :, :, i - 1].copy_(back.wait("forward").permute(1, 2, 0, 3, 4))
            back = sent
        assert back is not None
        out[:, :, :, c - 1].copy_(back.wait("forward").permute(1, 2, 0, 3, 4))
        out = out.view(b, s_l, P * c * qc, dv)
        ctx.plan, ctx.width = plan, d
        ctx.n_kept = len(kept)
        mine = (q, k, v, out) if plan.redo else ()
        ctx.save_for_backward(*mine, *kept, torch.stack(lses), sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        plan = ctx.plan
        saved = list(ctx.saved_tensors)
        sinks, lses = saved.pop(), saved.pop()
        c, qc, kc, per_kv = plan.c, plan.qc, plan.kc, plan.per_kv
        if plan.redo:
            q, k, v, out = saved
            kr, vr = plan.replicated(k, v)
        elif any(t.untyped_storage().nbytes() == 0 and t.numel() > 0 for t in saved):
            raise RuntimeError(
                "a second backward through head-chunked Ulysses attention: its head-sharded "
                "copies are freed as the first backward uses them. Run the forward again "
                "(no retain_graph=True through attention), or set redo_all_to_all: true, "
                "which keeps nothing of its own"
            )
        dout = dout.contiguous()
        dv = dout.shape[-1]
        d = ctx.width  # q's and k's
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        redo = "all_to_all_redo"

        def fetch(i: int) -> PendingAllToAll:  # chunk i's dO (redo: and q, out, kv chunk)
            parts = [(plan.part(dout, i, c), "all_to_all")]
            if plan.redo:
                parts += [(plan.part(x, i, c), redo) for x in (q, out)]
                if i % per_kv == 0:
                    parts += [(plan.part(x, i // per_kv, plan.ck), redo) for x in (kr, vr)]
            return plan.post(parts, "backward")

        # the gradients come back a chunk at a time: (b, s_l, P, h', d) pieces, put
        # together once at the end (nothing allocated for them before they arrive)
        dq: list[torch.Tensor] = []
        dkv: list[list[torch.Tensor]] = [[], []]
        kv: list[torch.Tensor] = []
        acc = None
        fetched: PendingAllToAll | None = fetch(0)
        for i in range(c):
            new_kv = i % per_kv == 0
            assert fetched is not None
            redone = [(qc, d), (qc, dv)] + [(kc, d), (kc, dv)] * new_kv
            sizes = [(qc, dv)] + (redone if plan.redo else [])
            got = plan.unpack(fetched, sizes, "backward")
            gh = got[0]
            if plan.redo:
                qh, oh = got[1:3]
                kv = got[3:] if new_kv else kv
            else:  # this chunk's saved q, (k, v), output
                take = 2 + 2 * new_kv  # [q, (k, v), out]
                mine, saved = saved[:take], saved[take:]
                qh, oh = mine[0], mine[-1]
                kv = mine[1:3] if new_kv else kv
            del got
            dq_h, dk_h, dv_h = plan.bwd(gh, qh, *kv, oh, lses[i])
            if dsinks is not None:
                part = slice(i * qc, (i + 1) * qc)
                dsinks[part] = sinks_grad(gh, oh, lses[i], sinks[part])
            if not plan.redo:
                _free(qh, oh)
            del gh, qh, oh
            if acc is None:
                acc = (dk_h, dv_h)
            else:  # in place: the chunk's own kv gradients are freed at once
                acc[0].add_(dk_h)
                acc[1].add_(dv_h)
            del dk_h, dv_h
            last = i % per_kv == per_kv - 1  # the last query chunk of this kv chunk
            if last and not plan.redo:
                _free(*kv)
            # back to the sequence-sharded layout one tensor at a time, each waited for
            # before the next is staged: (b, s_l, P, h', d) pieces
            dq.append(plan.back(dq_h))
            del dq_h
            if last:
                kv = []
                assert acc is not None
                for j in (0, 1):
                    dkv[j].append(plan.back(acc[j]))
                acc = None
            fetched = fetch(i + 1) if i + 1 < c else None
        # pieces (b, s_l, P, h', d) -> (b, s_l, P, pieces, h', d) -> (b, s_l, h, d)
        grads = [torch.stack(x, 3).flatten(2, 4) for x in (dq, *dkv)]
        dk, dv = grads[1:]
        if plan.rep > 1:  # replicas' gradients summed: (b, s_l, hkv * rep, d) -> (b, s_l, hkv, d)
            dk, dv = (g.unflatten(2, (-1, plan.rep)).sum(3) for g in (dk, dv))
        return grads[0], dk, dv, dsinks, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    inner: tuple[Forward, Backward],
    order: str | tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None = None,
    chunks: HeadChunks,
) -> torch.Tensor:
    """All-to-alls over ``group`` around ``inner = (fwd, bwd)`` on head-sharded tensors, in
    ``chunks.number`` chunks of heads (module docstring); ``chunks.redo``: keep nothing
    head-sharded for the backward and redo the all-to-alls there.

    ``fwd(q, k, v) -> (out, lse)`` and ``bwd(dout, q, k, v, out, lse) -> (dq, dk, dv)``:
    the local kernel's or the ring's (hybrid mode), not differentiable themselves; they
    see q ``(b, s/r, qc, d)`` and k/v ``(b, s/r, kc, d)`` in token order (zigzag: the ring
    rank's two chunks in order). ``sinks``: this rank's ``(hq/P,)`` sink logits.

    q ``(b, s_l, hq, d)``, k/v ``(b, s_l, hkv, d)`` -> ``(b, s_l, hq, d)``. ``order``: how
    the ranks' tokens are put in token order after the all-to-all: the layout
    (``"zigzag"``, ``"contiguous"``), or for packed rows ``(perm, inverse)`` from
    :func:`~ulysses_cp.core.varlen.ulysses_permutation`. Inputs validated by the caller."""
    plan = _Plan(group, order, chunks.number, *inner, chunks.redo)
    return _Chunked.apply(q, k, v, sinks, plan)
