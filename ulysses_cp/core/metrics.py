"""What the training loops log, measured one way for ``train.py`` (``training.trainer``) and
the Hugging Face ``Trainer`` (``integrations.hf_trainer.metrics``): this rank's attention
bytes since the last ``comm_stats.reset()``, its peak memory, and the topology's summary
that a wandb run's config holds."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from .comm import stats as comm_stats
from .topology import Topology

__all__ = ["attention_bytes_sent", "largest_peak_memory_mb", "peak_memory_mb", "topology_info"]


def attention_bytes_sent() -> int:
    """This rank's attention traffic since the last reset: all-to-all (the backward's
    redone all-to-alls too), ring and all-gather KV exchange bytes (the input checks' few
    bytes are counted apart, under ``all_gather``)."""
    ops = ("all_to_all", "all_to_all_redo", "ring", "kv_allgather", "kv_reduce_scatter")
    return sum(comm_stats.total(op) for op in ops)


def peak_memory_mb() -> float:
    """CUDA's peak allocation on a GPU, else the process's peak resident size (MiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def largest_peak_memory_mb(device: torch.device | str) -> float:
    """The largest :func:`peak_memory_mb` of any rank (collective over every rank when
    torch.distributed runs; ``device``: where the collective's tensor lives)."""
    peak = torch.tensor([peak_memory_mb()], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def topology_info(topo: Topology) -> dict:
    """The run's degrees, mode and layout, as the wandb run's config holds them."""
    return {
        "world_size": topo.world_size,
        "dp": topo.dp_degree,
        "ulysses": topo.ulysses_degree,
        "ring": topo.ring_degree,
        "mode": topo.mode,
        "layout": topo.layout,
    }
