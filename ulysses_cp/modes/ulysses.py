"""Ulysses (Jacobs et al., DeepSpeed-Ulysses, arXiv:2309.14509): how the heads split over
the ulysses group, how many head chunks, and the token order around the all-to-all.

Legend: b batch, s full sequence, s_l = s/P, P ulysses degree, hq/hkv heads, d head dim,
c head chunks, hk kv heads after replication.

Rank j holds query heads ``[j*hq/P, (j+1)*hq/P)`` after the all-to-all. GQA: kv heads
that the degree divides travel with their own count; fewer kv heads than ranks are
replicated ``P / hkv`` times first (autograd sums the replicas' gradients), so that rank j
receives kv head ``floor(j * hkv / P)``, the one its query heads use. The attention itself,
chunk by chunk, is :mod:`.chunked`'s.
"""

from __future__ import annotations

import torch

__all__ = [
    "MIN_CHUNK_BYTES",
    "head_chunk_choices",
    "kv_replication",
    "resolve_head_chunks",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_replication(hq: int, hkv: int, ulysses_degree: int) -> int:
    """How many times each kv head is replicated before the all-to-all (1 = none).

    Raises ``ValueError`` naming the degrees that would work when the heads do not split."""
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
    2 chunks of 2 MiB took 0.98-1.04x the time of one, docs/benchmarks.md), and short
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
