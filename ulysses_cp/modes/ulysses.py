"""Ulysses all-to-all attention (Jacobs et al., DeepSpeed-Ulysses, arXiv:2309.14509).

Legend: b batch, s full sequence, s_l = s/P, P ulysses degree, hq/hkv heads, d head dim.

q, k and v go through ONE all-to-all (packed along the head dim) from sequence-sharded to
head-sharded, the local kernel sees the whole sequence for its heads, and one all-to-all
brings the output back. GQA: kv heads that the degree divides travel with their own count;
fewer kv heads than ranks are replicated ``P / hkv`` times first (autograd sums the
replicas' gradients), so that rank r receives kv head ``floor(r * hkv / P)``, the one its
query heads use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.comm import group_size, head_to_seq, seq_to_head
from ..core.protocols import Group
from ..core.sharding import natural_to_pairs, pairs_to_natural
from ..core.varlen import Permute

__all__ = [
    "kv_replication",
    "ulysses_attention",
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


def _pack_heads(tensors: list[torch.Tensor], P: int) -> torch.Tensor:
    # each (b, s_l, h_i, d) -> (b, s_l, P, h_i/P, d), concatenated per destination rank
    parts = [t.unflatten(2, (P, t.shape[2] // P)) for t in tensors]
    return torch.cat(parts, dim=3).flatten(2, 3)  # (b, s_l, P * sum(h_i/P), d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    layout: str,
    inner: Callable,
    perm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """All-to-all over ``group`` around ``inner(q, k, v) -> out`` on head-sharded tensors.

    ``inner`` is the local kernel (Ulysses mode) or ring attention over the ring group
    (hybrid mode); it sees q ``(b, s/r, hq/P, d)`` and k/v ``(b, s/r, hk/P, d)`` in token
    order (zigzag: the ring rank's two chunks in order). Inputs validated by the caller.

    q ``(b, s_l, hq, d)``, k/v ``(b, s_l, hkv, d)`` -> ``(b, s_l, hq, d)``. Packed rows:
    ``perm = (perm, inverse)`` from :func:`~ulysses_cp.varlen.ulysses_permutation` replaces
    the zigzag reorder (it puts every document's pieces in order)."""
    P = group_size(group)
    if P == 1:
        return inner(q, k, v)
    hq, hkv = q.shape[2], k.shape[2]
    rep = kv_replication(hq, hkv, P)
    if rep > 1:
        # (b, s_l, hkv, d) -> (b, s_l, P, d): kv head j replicated for ranks [j*rep, (j+1)*rep)
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    hk = k.shape[2]
    # no names are kept for the staging tensors, so each is freed as soon as it is used
    # (b, s_l, hq + 2*hk, d) -> (b, s_l * P, (hq + 2*hk)/P, d), in rank order
    heads = seq_to_head(_pack_heads([q, k, v], P), group)
    if perm is not None:
        heads = Permute.apply(heads, perm[0], perm[1], 1)  # rank order -> document order
    elif layout == "zigzag":
        heads = pairs_to_natural(heads, P, dim=1)  # rank order -> token order
    qh, kh, vh = heads.split([hq // P, hk // P, hk // P], dim=2)
    out = inner(qh, kh, vh)  # (b, s_l * P, hq/P, d)
    if perm is not None:
        out = Permute.apply(out, perm[1], perm[0], 1)
    elif layout == "zigzag":
        out = natural_to_pairs(out, P, dim=1)
    return head_to_seq(out, group)  # (b, s_l, hq, d)
