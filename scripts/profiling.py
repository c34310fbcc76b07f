"""Peak memory of a piece of work, per rank, on CPU and CUDA.

CUDA: the caching allocator's peak. CPU has no allocator statistics; two ways, each the
peak of what the work allocated on top of what already existed:

- ``scratch=True``: run the work under ``torch.profiler`` with ``profile_memory=True`` and
  replay its allocation events in time order. Sees every allocation, also scratch memory
  inside one kernel (the CPU flash attention forward+backward of a (1, N, 8, 64) input:
  6 MB more at N = 2048, 10 MB at 4096). Back-to-back profiler sessions in several ranks
  have aborted a process now and then ("terminate called without an active exception", torch 2.13).
- ``scratch=False``: a dispatch mode (:class:`LiveBytes`) that sees every tensor an
  operator returns, forward and backward: a new storage adds its bytes, its release (a
  weak-reference finalizer) subtracts them. No profiler; kernel scratch is not seen, and
  under the mode autograd may add two gradients of one tensor out of place (one gradient
  more than the profiler saw for ``(x * x).sum().backward()``). For whole models the two
  agreed to the byte (reference decoder, N = 2048 and 4096).

Slow: measure memory and time in separate runs.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _is_dense(x) -> bool:
    return isinstance(x, torch.Tensor) and x.layout == torch.strided


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created while active and still alive (``live``), and their
    maximum (``peak``). Device-agnostic; storages that existed before are not counted. A
    storage released early by resizing it to 0 bytes (what the attention's backward does
    with head-sharded copies it has used) stops counting from then: checked whenever
    ``live`` would set a new peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._held: dict[int, tuple[weakref.ref, int]] = {}

    def _release(self, key: int) -> None:
        if key in self._held:
            self.live -= self._held.pop(key)[1]

    def _shrunk(self) -> None:
        for key, (ref, nbytes) in list(self._held.items()):
            storage = ref()
            now = nbytes if storage is None else storage.nbytes()
            if now < nbytes:
                self._held[key] = (ref, now)
                self.live -= nbytes - now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output on an input's storage (in place, out=, a view) is no new memory
        inputs = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if _is_dense(a)}
        for t in tree_leaves(out):
            if not _is_dense(t):
                continue
            storage = t.untyped_storage()
            key, nbytes = id(storage), storage.nbytes()
            if key in self._held or key in inputs or nbytes == 0:
                continue
            self._held[key] = (weakref.ref(storage), nbytes)
            self.live += nbytes
            if self.live > self.peak:
                self._shrunk()
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key)
        return out


def peak_memory(
    fn: Callable[[], object], device: torch.device | None = None, *, scratch: bool = True
) -> int:
    """Bytes allocated at the peak while ``fn()`` runs, above what was live before
    (CPU: ``scratch`` picks the method, see the module docstring)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if not scratch:
        # the collector off while measuring: a release then comes only from a reference
        # count reaching zero, at the same point in every run (a collection at another
        # moment could move a finalizer; one test run in several saw a peak 512 KB higher)
        was_on = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with LiveBytes() as tracker:
                fn()
        finally:
            if was_on:
                gc.enable()
        return tracker.peak
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def longest_fitting(peak_at: Callable[[int], float], unit: int, budget: float) -> int:
    """The largest multiple of ``unit`` whose ``peak_at(n)`` is within ``budget`` (doubling,
    then bisection on multiples of ``unit``; peaks are assumed to grow with n); 0 if none."""
    lo, hi = 0, unit
    while peak_at(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if peak_at(mid) <= budget else (lo, mid)
    return lo
