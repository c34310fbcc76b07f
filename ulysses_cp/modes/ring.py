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

Causal, contiguous layout: blocks with ``src > r`` are skipped (communication still
moves); ``src == r`` uses the causal kernel. Zigzag layout (rank r holds chunks r and
2P-1-r of 2P): ``src < r``: all local q against the FIRST half of kv; ``src > r``: the
SECOND half of local q against all kv; so every step but the first is half a block on
every rank.

Sliding windows: blocks go chunk pair by chunk pair (each layout chunk cut in pieces near
the window's length), each with its offset in global positions; pairs that no query's
window reaches are skipped (``work_stats``). Packed rows: each document is cut in its own
chunks, so the offset goes to the kernel in chunks and each document group gets its band.
With ``group=None`` (one rank) the same machinery is block-sparse local attention.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.comm import collective, group_rank, group_size, host_staged, stats
from ..core.protocols import Group
from ..core.varlen import Docs
from ..kernels.dispatch import (
    FULL_WINDOW,
    Kernel,
    SavedAttention,
    attn_backward,
    attn_forward,
    band_is_empty,
    lse_dtype,
    window_band,
    work,
)

__all__ = [
    "RingComm",
    "merge",
    "ring_attention",
    "ring_backward",
    "ring_forward",
    "window_split",
]


class RingComm:
    """Send to the next rank, receive from the previous one: ``send_recv`` posts,
    ``wait`` returns what arrived. ``op`` names the byte counter. CUDA tensors on a group
    whose send/recv cannot take them (gloo) travel through host copies
    (:func:`~ulysses_cp.comm.host_staged`)."""

    def __init__(self, group: Group, op: str, phase: str, tag: int = 0) -> None:
        self.group, self.op, self.phase, self.tag = group, op, phase, tag
        assert group is not None, "a ring needs its process group"
        P, r = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (r + 1) % P)
        self.prev = dist.get_global_rank(group, (r - 1) % P)
        self._reqs: list = []
        self._recv: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None
        self._device: torch.device | None = None  # where the result goes, when staged

    def send_recv(self, x: torch.Tensor) -> None:
        assert not self._reqs, "wait() before the next send_recv()"
        stats.add(self.op, self.phase, x.numel() * x.element_size())
        self._device = x.device if host_staged(self.group, x.device) else None
        x = x.contiguous() if self._device is None else x.to("cpu")
        self._recv = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, self.tag),
            dist.P2POp(dist.irecv, self._recv, self.prev, self.group, self.tag),
        ]
        with collective(self.op, self.phase, self.group):
            self._reqs = dist.batch_isend_irecv(ops)
        self._sent = x  # keep the send buffer alive until wait()

    def wait(self) -> torch.Tensor:
        with collective(self.op, self.phase, self.group):
            for req in self._reqs:
                req.wait()
        self._reqs, self._sent = [], None
        out, self._recv = self._recv, None
        assert out is not None, "wait() without send_recv()"
        return out if self._device is None else out.to(self._device)


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result into the accumulators (all fp32/fp64); returns (out, lse).

    out ``(b, s, h, d)``, lse ``(b, h, s)``. Rows empty on both sides stay empty (-inf)."""
    diff = lse_b - lse
    w = torch.sigmoid(diff).nan_to_num(0.0)  # both -inf: nan -> keep out
    out = out - w.transpose(1, 2).unsqueeze(-1) * (out - out_b)
    new = lse - F.logsigmoid(lse - lse_b)
    new = torch.where(torch.isinf(lse) | torch.isinf(lse_b), torch.maximum(lse, lse_b), new)
    return out, new


def _blocks(step: int, rank: int, P: int, s_l: int, causal: bool, layout: str, docs=None):
    """``(q sel, kv sel, causal kernel, kernel kwargs)`` for this step, or None when fully
    masked. Packed rows (``docs``, a :class:`~ulysses_cp.varlen.Docs`): the same rule per
    document, so the halves are every document's halves (index tensors) and the kernel
    gets the matching ``cu_q``/``cu_k``."""
    everything = slice(0, s_l)
    whole = {} if docs is None else dict(cu_q=docs.cu, cu_k=docs.cu)
    if step == 0:
        return everything, everything, causal, whole
    if not causal:
        return everything, everything, False, whole
    src = (rank - step) % P
    if layout == "contiguous":
        return (everything, everything, False, whole) if src < rank else None
    if docs is None:
        half = s_l // 2
        first, second = slice(0, half), slice(half, s_l)
        if src < rank:
            return everything, first, False, {}
        return second, everything, False, {}
    if src < rank:
        return everything, docs.first, False, dict(cu_q=docs.cu, cu_k=docs.cu_half)
    return docs.second, everything, False, dict(cu_q=docs.cu_half, cu_k=docs.cu)


def _step_blocks(step, rank, P, s_l, causal, layout, docs, window, phase, split=1) -> list[tuple]:
    """``[(q sel, kv sel, kernel keywords)]`` of one ring step."""
    if tuple(window) != FULL_WINDOW and docs is not None:
        return _packed_window_blocks(step, rank, P, causal, layout, docs, window)
    if tuple(window) != FULL_WINDOW:
        pairs = _window_blocks(step, rank, P, s_l, causal, layout, window, split)
        n = (1 if layout == "contiguous" else 2) * split
        work.skipped[phase] += n * n - len(pairs)
        return [(qs, ks, dict(causal=causal, window=window, offset=o)) for qs, ks, o in pairs]
    blk = _blocks(step, rank, P, s_l, causal, layout, docs)
    if blk is None:
        return []
    qs, ks, is_causal, cu = blk
    return [(qs, ks, dict(causal=is_causal, **cu))]


def window_split(s_l: int, window: tuple[int, int], parts: int) -> int:
    """Into how many pieces to cut each of a rank's ``parts`` layout chunks so that a piece
    is about as long as the window (at least 64 tokens): pairs of pieces that no query's
    window reaches are then skipped. 1 when the window is unbounded on both sides."""
    reach = max(window)
    if reach < 0:
        return 1
    c = s_l // parts
    target = max(reach, 64)
    return next(m for m in range(1, c + 1) if c % m == 0 and c // m <= target)


def _packed_window_blocks(step, rank, P, causal, layout, docs, window) -> list[tuple]:
    """Packed rows with a window: every document is cut in its own chunks (zigzag: 2P, the
    rank holding chunks r and 2P-1-r of each; contiguous: P), so a pair of halves is one
    kernel call over all documents whose offset is counted in chunks
    (``chunk_offset``); the kernel skips the document groups out of reach."""
    src = (rank - step) % P
    if layout == "contiguous":
        mine, theirs = [(rank, slice(None))], [(src, slice(None))]
        cu = dict(cu_q=docs.cu, cu_k=docs.cu)
    else:
        mine = [(rank, docs.first), (2 * P - 1 - rank, docs.second)]
        theirs = [(src, docs.first), (2 * P - 1 - src, docs.second)]
        cu = dict(cu_q=docs.cu_half, cu_k=docs.cu_half)
    kw = dict(causal=causal, window=window, **cu)
    return [
        (qs, ks, dict(kw, chunk_offset=qi - ki))
        for qi, qs in mine
        for ki, ks in theirs
        if not causal or qi >= ki  # a later chunk never sees an earlier query's keys
    ]


def _window_blocks(
    step: int,
    rank: int,
    P: int,
    s_l: int,
    causal: bool,
    layout: str,
    window: tuple[int, int],
    split: int = 1,
) -> list[tuple[slice, slice, int]]:
    """Sliding window: ``[(q sel, kv sel, offset)]`` for this step, one per pair of chunks
    (contiguous: one chunk per rank; zigzag: chunks r and 2P-1-r; each cut in ``split``
    pieces) that has a visible key; ``offset`` = the q piece's first position minus the kv
    piece's. Pairs wholly outside every query's window are skipped."""
    src = (rank - step) % P
    if layout == "contiguous":
        mine, theirs = [rank], [src]
    else:
        mine, theirs = [rank, 2 * P - 1 - rank], [src, 2 * P - 1 - src]
    c = s_l // len(mine) // split  # piece length

    def pieces(chunks: list[int]) -> list[tuple[int, slice]]:
        # (global piece index, local slice): piece t of the rank's layout chunk h
        return [
            (chunk * split + t, slice((h * split + t) * c, (h * split + t + 1) * c))
            for h, chunk in enumerate(chunks)
            for t in range(split)
        ]

    mine_p, theirs_p = pieces(mine), pieces(theirs)
    pairs: list[tuple[slice, slice, int]] = []
    for qi, qs in mine_p:
        for ki, ks in theirs_p:
            band = window_band(window, causal, (qi - ki) * c)
            if band is not None and not band_is_empty(band, c, c):
                pairs.append((qs, ks, (qi - ki) * c))
    return pairs


def _pack(k, v):
    return torch.stack([k, v])  # (2, b, s_l, hkv, d): one send per step


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool,
    softmax_scale: float | None,
    backend: str | Kernel,
    layout: str,
    overlap: bool = True,
    docs: Docs | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = FULL_WINDOW,
    split: int = 1,
    exchange: str = "ring",
) -> tuple[torch.Tensor, torch.Tensor]:
    P, rank = group_size(group), group_rank(group)
    b, s_l, hq, d = q.shape
    acc = lse_dtype(q.dtype)
    out = torch.zeros(b, s_l, hq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, s_l), float("-inf"), dtype=acc, device=q.device)
    for step, kv in _visiting(_pack(k, v), group, "forward", exchange, overlap):
        for qs, ks, kw in _step_blocks(
            step, rank, P, s_l, causal, layout, docs, window, "forward", split
        ):
            o_b, l_b = attn_forward(
                q[:, qs],
                kv[0][:, ks],
                kv[1][:, ks],
                softmax_scale=softmax_scale,
                backend=backend,
                softcap=softcap,
                **kw,
            )
            out[:, qs], lse[:, :, qs] = merge(out[:, qs], lse[:, :, qs], o_b.to(acc), l_b.to(acc))
    return out, lse


def _visiting(
    kv: torch.Tensor, group: Group, phase: str, exchange: str, overlap: bool, tag: int = 0
):
    """``(step, kv block of rank (r - step) mod P)`` for every step. ``"ring"``: the next
    block's send/receive is posted before the caller computes on this one (``overlap=False``
    waits first, to measure what the overlap buys); ``"allgather"``: one all-gather."""
    P, rank = group_size(group), group_rank(group)
    if exchange == "allgather" and P > 1:
        blocks = _all_gather(kv, group, phase)
        for step in range(P):
            yield step, blocks[(rank - step) % P]
        return
    comm = cast(RingComm, RingComm(group, "ring", phase, tag) if P > 1 else None)  # P > 1 only
    for step in range(P):
        if step + 1 < P:
            comm.send_recv(kv)  # posted before the compute so they overlap
            nxt = None if overlap else comm.wait()
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


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: Group,
    causal: bool,
    softmax_scale: float | None,
    backend: str | Kernel,
    layout: str,
    overlap: bool = True,
    docs: Docs | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = FULL_WINDOW,
    split: int = 1,
    exchange: str = "ring",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    P, rank = group_size(group), group_rank(group)
    s_l = q.shape[1]
    acc = lse_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    gathered = exchange == "allgather" and P > 1
    if gathered:  # this rank's share of every block's dk/dv, reduce-scattered at the end
        dkv_all = torch.zeros((P, 2, *k.shape), dtype=acc, device=k.device)
    dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # travels with its kv block
    # used only on the ring with P > 1
    dkv_comm = cast(RingComm, RingComm(group, "ring", "backward", tag=2) if P > 1 else None)
    for step, kv in _visiting(_pack(k, v), group, "backward", exchange, overlap, tag=1):
        done = []
        blocks = _step_blocks(step, rank, P, s_l, causal, layout, docs, window, "backward", split)
        for qs, ks, kw in blocks:
            dq_b, dk_b, dv_b = attn_backward(
                dout[:, qs],
                q[:, qs],
                kv[0][:, ks],
                kv[1][:, ks],
                out[:, qs],
                lse[:, :, qs],
                softmax_scale=softmax_scale,
                backend=backend,
                accumulate=True,
                softcap=softcap,
                **kw,
            )
            dq[:, qs] += dq_b
            done.append((ks, dk_b, dv_b))
        if gathered:
            dkv = dkv_all[(rank - step) % P]
        elif step > 0:
            dkv = dkv_comm.wait()  # the accumulator of the visiting block (overlapped compute)
        for ks, dk_b, dv_b in done:
            dkv[0][:, ks] += dk_b
            dkv[1][:, ks] += dv_b
        if P > 1 and not gathered:
            dkv_comm.send_recv(dkv)  # on to the next rank; overlaps the next step
    if gathered:
        dkv = _reduce_scatter(dkv_all, group)
    elif P > 1:
        dkv = dkv_comm.wait()  # our own block's accumulator, home after P hops
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool,
    softmax_scale: float | None,
    backend: str | Kernel,
    layout: str,
    overlap: bool = True,
    docs: Docs | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] = FULL_WINDOW,
    split: int | None = None,
    exchange: str = "ring",
) -> torch.Tensor:
    """Ring attention over ``group``; inputs validated by the caller.

    q ``(b, s_l, hq, d)``, k/v ``(b, s_l, hkv, d)`` in ``layout`` over the ring ->
    ``(b, s_l, hq, d)`` in q's dtype. ``overlap=False`` waits for each kv transfer before
    computing (only to measure what the overlap buys). ``docs``: the packed row's documents
    in this ring's document-wise layout (:class:`~ulysses_cp.varlen.Docs`), batch 1.
    ``softcap``: flash-attn's logit softcap per block (exact: the merge only needs each
    block's lse). ``sinks`` ``(hq,)``: attention-sink logits, applied once to the merged
    result (:func:`~ulysses_cp.kernels.dispatch.add_sinks`). ``window=(left, right)``:
    flash-attn's sliding window over global positions; blocks are taken chunk by chunk and
    a pair of chunks wholly outside every query's window is skipped (dense rows only).
    ``split``: pieces per layout chunk (None: :func:`window_split`'s choice). With a window
    and ``group=None`` (one rank) this is block-sparse local attention. ``exchange``:
    ``"ring"`` (point-to-point steps) or ``"allgather"`` (one all-gather of KV, and an
    all-to-all + sum of the dk/dv shares in the backward)."""
    opts = dict(
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        backend=backend,
        layout=layout,
        overlap=overlap,
        docs=docs,
        softcap=softcap,
        window=tuple(window),
        exchange=exchange,
    )
    if tuple(window) != FULL_WINDOW:
        parts = 1 if layout == "contiguous" else 2
        w = (int(window[0]), int(window[1]))
        opts["split"] = window_split(q.shape[1], w, parts) if split is None else split
    return SavedAttention.apply(q, k, v, sinks, ring_forward, ring_backward, opts)
