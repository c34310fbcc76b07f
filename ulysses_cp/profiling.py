"""Peak memory of a piece of work, per rank, on CPU and CUDA.

CUDA: the caching allocator's peak. CPU has no allocator statistics, so we run the work
under ``torch.profiler`` with ``profile_memory=True`` and replay its allocation events
(sizes, + for alloc and - for free) in time order; the running maximum is the peak of the
memory the work allocated on top of what already existed. Slow: measure memory and time in
separate runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_memory(fn: Callable[[], object], device: torch.device | None = None) -> int:
    """Bytes allocated at the peak while ``fn()`` runs, above what was live before."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
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
