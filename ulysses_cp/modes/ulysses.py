"""Ulysses (Jacobs et al., DeepSpeed-Ulysses, arXiv:2309.14509): how the heads split over
the ulysses group, how many head chunks, and the token order around the all-to-all.

Legend: b batch, s full sequence, s_l = s/P, P ulysses degree, hq/hkv heads, d head dim,
c head chunks, hk kv heads after replication.

Rank j holds query heads ``[j*hq/P, (j+1)*hq/P)`` after the all-to-all. GQA: kv heads
that the degree divides travel with their own count; fewer kv heads than ranks are
replicated ``P / hkv`` times first (autograd sums the replicas' gradients), so that rank j
receives kv head ``floor(j * hkv / P)``, the one its query heads use. The attention itself,
chunk by chunk, is :mod:`.chunked`'s; :func:`ulysses_attention` is the same attention
as differentiable ops that dynamo traces, what a compiled layer runs (``model.compile``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.comm import group_size
from ..core.compiled_comm import BlockingAllToAll
from ..core.protocols import Group

__all__ = [
    "MIN_CHUNK_BYTES",
    "head_chunk_choices",
    "kv_replication",
    "resolve_head_chunks",
    "ulysses_attention",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_replication(hq: int, hkv: int, ulysses_degree: int) -> int:
    """How many times each kv head is replicated before the Ulysses all-to-all.

    Args:
        hq: Query heads.
        hkv: Key/value heads.
        ulysses_degree: The Ulysses degree ``u``.

    Returns:
        1 when ``hkv`` splits over ``u``, else ``u / hkv``.

    Raises:
        ValueError: The heads do not split over ``u`` (the message names the degrees that
            would work).
    """
    u = ulysses_degree
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if hq % u == 0 and hkv % u == 0:
        return 1
    if hq % u == 0 and u % hkv == 0:
        return u // hkv
    fits = [d for d in _divisors(hq) if hkv % d == 0 or d % hkv == 0]
    raise ValueError(
        f"ulysses_degree({u}) cannot split {hq} query heads and {hkv} kv heads: it must "
        f"divide the query heads and either divide the kv heads or be a multiple of them. "
        f"Ulysses degrees that work: {fits}. For a larger sequence-parallel degree keep "
        f"ulysses_degree in that list and put the rest in ring_degree (hybrid mode), which "
        f"carries any head count."
    )


def head_chunk_choices(hq: int, hkv: int, ulysses_degree: int, ring: bool = False) -> list[int]:
    """The head-chunk counts that work: ``c`` divides the query heads per rank, and the kv
    heads per rank (after replication) are a multiple or a divisor of ``c``. With a ring
    inside (``ring``: hybrid mode) they must be a multiple, so that every chunk's ring
    moves its own kv heads and no kv block travels twice."""
    P = ulysses_degree
    ql = hq // P
    kl = hkv * kv_replication(hq, hkv, P) // P
    return [c for c in _divisors(ql) if kl % c == 0 or (c % kl == 0 and not ring)]


# The automatic rule's smallest chunk: one chunk's head-sharded q, in bytes.
MIN_CHUNK_BYTES = 1 << 20


def resolve_head_chunks(
    requested: int,
    hq: int,
    hkv: int,
    ulysses_degree: int,
    ring: bool = False,
    head_bytes: int = 0,
) -> int:
    """``requested`` checked against :func:`head_chunk_choices`; ``ValueError`` naming the
    counts that work.

    0 (automatic) weighs memory against time: the most chunks (of the counts that work)
    whose head-sharded q stays at least :data:`MIN_CHUNK_BYTES` (1 MiB) per chunk.
    ``head_bytes``: the bytes of one head-sharded query head on this rank, ``b * (N / r)
    * d * B`` (0: unknown, one chunk). Memory: the all-to-all staging and the inner
    attention's working set (the ring's blocks and fp32 accumulators too) shrink with the
    chunk count. Time: chunks cost nothing in bytes moved, but below about 1 MiB per
    chunk the per-call and per-message overheads stop being small (measured on CPU:
    2 chunks of 2 MiB took 0.98-1.04x the time of one, docs/benchmarks/head_chunks.md), and short
    sequences, whose staging is small anyway, keep one chunk."""
    choices = head_chunk_choices(hq, hkv, ulysses_degree, ring)
    if requested == 0:
        per_rank = hq // ulysses_degree
        fits = [c for c in choices if head_bytes and per_rank // c * head_bytes >= MIN_CHUNK_BYTES]
        return max(fits, default=1)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested not in choices:
        where = " with a ring inside (hybrid: kv heads per rank a multiple of it)" if ring else ""
        raise ValueError(
            f"head_chunks={requested!r} does not split {hq} query heads and {hkv} kv heads "
            f"over ulysses_degree {ulysses_degree} ({hq // ulysses_degree} query heads per "
            f"rank){where}: use one of {choices}, or 0 (automatic)"
        )
    return requested


def _to_ranks(x: torch.Tensor, P: int, order) -> torch.Tensor:
    """``(b, s, h, d)`` in token order -> ``(P, b, s/P, h, d)``: dim 0 = the rank whose
    tokens these are (the layout's order, or the packed row's permutation), contiguous."""
    b, s, h, d = x.shape
    if isinstance(order, tuple):  # packed rows (b = 1): token order -> rank order
        return x.index_select(1, order[1].to(x.device)).view(P, b, s // P, h, d)
    if order == "contiguous":
        return x.unflatten(1, (P, s // P)).transpose(0, 1).contiguous()
    n = s // (2 * P)  # zigzag: rank p holds chunks p and 2P-1-p
    xv = x.unflatten(1, (2 * P, n))
    out = x.new_empty(P, b, 2, n, h, d)
    out[:, :, 0].copy_(xv[:, :P].transpose(0, 1))
    for p in range(P):
        out[p, :, 1].copy_(xv[:, 2 * P - 1 - p])
    return out.view(P, b, 2 * n, h, d)


def _from_ranks(x: torch.Tensor, P: int, order) -> torch.Tensor:
    """Inverse of :func:`_to_ranks`: ``(P, b, s/P, h, d)`` -> ``(b, s, h, d)``."""
    _, b, s_l, h, d = x.shape
    if isinstance(order, tuple):
        return x.view(b, P * s_l, h, d).index_select(1, order[0].to(x.device))
    if order == "contiguous":
        return x.transpose(0, 1).reshape(b, P * s_l, h, d)
    n = s_l // 2
    xv = x.view(P, b, 2, n, h, d)
    out = x.new_empty(b, 2 * P, n, h, d)
    out[:, :P].copy_(xv[:, :, 0].transpose(0, 1))
    for p in range(P):
        out[:, 2 * P - 1 - p].copy_(xv[p, :, 1])
    return out.view(b, 2 * P * n, h, d)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _flat(fn: Callable) -> Callable:
    """``fn`` of ``(..., h, d)`` tensors applied to ``(..., h * d)`` ones (one width 1 head)."""

    def on_flat(x: torch.Tensor) -> torch.Tensor:
        return fn(x.unsqueeze(-1)).squeeze(-1)

    return on_flat


class _Assemble(torch.autograd.Function):
    """The output chunks ``(P, b, s_l, hq/(cP), d)`` (dim 0 = the rank that computed
    them) -> ``(b, s_l, hq, d)``: one copy, and the backward hands each chunk a view of
    the gradient (no zero-filled full-size tensors)."""

    @staticmethod
    def forward(ctx, *chunks):
        P, b, s_l, hc, d = chunks[0].shape
        c = len(chunks)
        ctx.split = (P, c, hc)
        out = chunks[0].new_empty(b, s_l, P, c, hc, d)
        for i, x in enumerate(chunks):
            out[:, :, :, i].copy_(x.permute(1, 2, 0, 3, 4))
        return out.view(b, s_l, P * c * hc, d)

    @staticmethod
    def backward(ctx, grad):
        P, c, hc = ctx.split
        g = grad.unflatten(2, (P, c, hc))
        return tuple(g[:, :, :, i].permute(2, 0, 1, 3, 4) for i in range(c))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    inner: Callable,
    order: str | tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor | None = None,
    head_chunks: int = 1,
) -> torch.Tensor:
    """All-to-alls over ``group`` around ``inner(q, k, v[, sinks=]) -> out`` on
    head-sharded tensors, in ``head_chunks`` chunks of heads (module docstring).

    ``inner`` is the local kernel (Ulysses mode) or ring attention over the ring group
    (hybrid mode); it sees q ``(b, s/r, hq/(cP), d)`` and k/v ``(b, s/r, hk/(c_k P), d)``
    in token order (zigzag: the ring rank's two chunks in order). ``sinks``: this rank's
    ``(hq/P,)`` sink logits, handed to ``inner`` per chunk. Inputs validated by the caller;
    ``head_chunks`` must be one of :func:`head_chunk_choices`.

    q ``(b, s_l, hq, d)``, k/v ``(b, s_l, hkv, d)`` -> ``(b, s_l, hq, d)``. ``order``: how
    the ranks' tokens are put in token order after the all-to-all: the layout
    (``"zigzag"``, ``"contiguous"``), or for packed rows ``(perm, inverse)`` from
    :func:`~ulysses_cp.core.varlen.ulysses_permutation` (it puts every document's pieces in
    order)."""
    P = group_size(group)
    extra = {} if sinks is None else {"sinks": sinks}
    if P == 1:
        return inner(q, k, v, **extra)
    hq, hkv = q.shape[2], k.shape[2]
    rep = kv_replication(hq, hkv, P)
    if rep > 1:
        # (b, s_l, hkv, d) -> (b, s_l, P, d): kv head j replicated for ranks [j*rep, (j+1)*rep)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    c = head_chunks
    ql, kl = hq // P, k.shape[2] // P
    ck = min(c, kl)

    def to_ranks(x):
        return _to_ranks(x, P, order)

    def from_ranks(x):
        return _from_ranks(x, P, order)

    # views: q chunk i = (b, s_l, P, ql/c, d), dim 2 = destination rank; unbind's backward
    # stacks the chunks' gradients once, when all have arrived
    q_chunks = q.unflatten(2, (P, c, ql // c)).unbind(3)
    k_chunks = k.unflatten(2, (P, ck, kl // ck)).unbind(3)
    v_chunks = v.unflatten(2, (P, ck, kl // ck)).unbind(3)
    per_kv = c // ck  # query chunks per kv chunk

    # what a compiled layer runs (the eager path is .chunked's): the traceable custom op,
    # which waits at once (no overlap)
    def post(i: int) -> tuple[BlockingAllToAll, torch.Tensor]:
        parts = [q_chunks[i]]
        if i % per_kv == 0:
            parts += [k_chunks[i // per_kv], v_chunks[i // per_kv]]
        # (P, b, s_l, sum h_i d_i): heads x width, MLA's values at their own width
        send = torch.cat([t.permute(2, 0, 1, 3, 4).flatten(3) for t in parts], dim=3)
        pending = BlockingAllToAll(group)
        return pending, pending.start(send, _same, _same)

    qc, kc = ql // c, kl // ck
    d, dv = q.shape[-1], v.shape[-1]
    inbound = [post(0)]
    outbound: list[tuple[BlockingAllToAll, torch.Tensor]] = []
    kv = None
    done: list[torch.Tensor] = []
    for i in range(c):
        if i + 1 < c:
            inbound.append(post(i + 1))
        pending, recv = inbound[i]
        # (b, s, sum h_i d_i) in token order
        heads = pending.finish(recv, _flat(from_ranks), _flat(to_ranks))
        inbound[i] = None  # type: ignore[call-overload]  # the receive buffer is ours no more
        if i % per_kv == 0:
            qf, kf, vf = heads.split([qc * d, kc * d, kc * dv], dim=2)
            qh, kv = qf.unflatten(2, (qc, d)), (kf.unflatten(2, (kc, d)), vf.unflatten(2, (kc, dv)))
        else:
            qh = heads.unflatten(2, (qc, d))
        assert kv is not None
        part = {} if sinks is None else {"sinks": sinks[i * qc : (i + 1) * qc]}
        out = inner(qh, kv[0], kv[1], **part)  # (b, s, qc, d)
        pending_out = BlockingAllToAll(group)
        outbound.append((pending_out, pending_out.start(out, to_ranks, from_ranks)))
        if i > 0:
            done.append(outbound[i - 1][0].finish(outbound[i - 1][1], _same, _same))
    done.append(outbound[-1][0].finish(outbound[-1][1], _same, _same))
    return _Assemble.apply(*done)
