"""Values derived from a batch's tensors, computed once per batch.

A packed row's local ``cu_seqlens`` (the tensors of a batch's documents at the kernel
level, ``varlen.Docs``) serve every layer's attention (and, in a ring, every step of it,
forward and backward), which needs what follows from them: the grouping of documents into
kernel calls, flash-attn's longest document (a device-to-host copy on GPU), the check
summary of a ``cu_seqlens`` given alone. :func:`once` keeps the last few results keyed by
the tensors' identity and version, so they are computed at the first layer and reused by
the rest: no recomputation, no host sync per layer. A tensor changed in place (its version
moves) or a new batch's tensor is a miss; a freed tensor's entry can never match a new one
(a weak reference is checked). What ``shard_batch`` derives for a whole batch (bounds,
permutation, documents, the input check) is kept in its ``core.batch.BatchPlan``.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

__all__ = [
    "once",
]

T = TypeVar("T")

_SIZE = 64  # a few batches' worth: one row's levels and ring-step pairs are < 10 entries


class _Cache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, tensors: tuple[torch.Tensor, ...], key: Hashable, build: Callable[[], T]) -> T:
        full = (tuple((id(t), t._version) for t in tensors), key)
        entry = self.entries.get(full)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors)):
            self.entries.move_to_end(full)
            self.hits += 1
            return entry[1]
        self.misses += 1
        value = build()  # may raise: nothing is stored then
        self.entries[full] = ([weakref.ref(t) for t in tensors], value)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


cache = _Cache(_SIZE)


def once(tensors: tuple[torch.Tensor, ...], key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, computed once for these tensors (as they are now) and ``key``; ``key``
    must hold everything else the result depends on (degrees, ranks, layout, device)."""
    return cache.get(tensors, key, build)
