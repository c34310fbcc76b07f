"""Collectives over the data-parallel replicas for TRL trainers that gather over every
process (GRPO), and the broadcast that gives the SP ranks of a replica one copy of what a
rank computed alone (completions, rewards, random streams).

Every SP rank of a replica holds the same rows. A trainer written for data parallelism
gathers its per-process rows over all ``W = dp * P`` processes (``accelerator.gather``,
``gather_object``), slices them back by ``process_index`` and normalises by
``num_processes``: under sequence parallelism each replica's rows would come back P times,
group statistics (GRPO's per-prompt reward baselines) would mix copies, and token counts
would be P times too large. :class:`ReplicaAccelerator` stands in for the trainer's
``Accelerator`` inside such code: the same object, but ``gather``, ``reduce``,
``pad_across_processes`` run over the rank's dp group (the ranks with its SP rank, one
per replica), ``process_index`` is the dp rank and ``num_processes`` the dp degree.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from ...core.topology import Topology
from .run import SequenceParallelRun

__all__ = ["ReplicaAccelerator", "broadcast_from_sp_root", "random_state", "set_random_state"]


class ReplicaAccelerator:
    """An ``accelerate.Accelerator`` whose process collectives span the dp replicas
    (module docstring); every other attribute is the wrapped accelerator's."""

    def __init__(self, accelerator: Any, run: SequenceParallelRun) -> None:
        self._accelerator = accelerator
        self._run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def _topo(self) -> Topology:
        return self._run.topo

    @property
    def process_index(self) -> int:
        return self._topo.dp_rank

    @property
    def num_processes(self) -> int:
        return self._topo.dp_degree

    def gather(self, data: Any) -> Any:
        from accelerate.utils import recursively_apply

        return recursively_apply(self._gather_one, data)

    def _gather_one(self, x: torch.Tensor) -> torch.Tensor:
        # accelerate gathers a scalar as one row per process
        return self._run.dp_gather(x[None] if x.dim() == 0 else x)

    def reduce(self, x: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        out = x.clone()
        if self._topo.dp_degree > 1 and self._topo.dp_group is not None:
            dist.all_reduce(out, group=self._topo.dp_group)
        if reduction == "mean":
            out = out / self._topo.dp_degree
        return out * scale if scale != 1.0 else out

    def pad_across_processes(
        self, x: torch.Tensor, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
    ) -> torch.Tensor:
        size = torch.tensor([x.shape[dim]], device=x.device)
        longest = int(self._gather_one(size).max())
        if longest == x.shape[dim]:
            return x
        shape = list(x.shape)
        shape[dim] = longest - x.shape[dim]
        pad = x.new_full(shape, pad_index)
        return torch.cat([pad, x] if pad_first else [x, pad], dim=dim)

    def gather_object(self, obj: Any) -> list:
        """``accelerate.utils.gather_object`` over the replicas: the lists concatenated in
        dp-rank order (any other object: one entry per replica)."""
        group = self._topo.dp_group
        if self._topo.dp_degree == 1 or group is None:
            return list(obj) if isinstance(obj, list) else [obj]
        parts: list[Any] = [None] * self._topo.dp_degree
        dist.all_gather_object(parts, obj, group=group)
        if isinstance(obj, list):
            return [x for part in parts for x in part]
        return parts


def broadcast_from_sp_root(obj: Any, topo: Topology) -> Any:
    """SP rank 0's ``obj`` on every rank of its SP group (pickled: any object; a tensor
    comes back on the device it had)."""
    group = topo.sp_group
    if topo.sp_world_size == 1 or group is None:
        return obj
    root = dist.get_global_rank(group, 0)
    if isinstance(obj, torch.Tensor):
        out = obj.contiguous().clone()
        dist.broadcast(out, src=root, group=group)
        return out
    box = [obj]
    dist.broadcast_object_list(box, src=root, group=group)
    return box[0]


def random_state() -> dict[str, Any]:
    """The random streams a rank draws from: torch's (CPU and the current accelerator's),
    Python's and NumPy's."""
    import numpy as np

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Set the streams :func:`random_state` returned (on this rank's own devices)."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
