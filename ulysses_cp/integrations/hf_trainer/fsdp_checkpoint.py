"""Trainer checkpoints with optimizer state under FSDP2 (``sequence_parallel_config=``),
and ``train(resume_from_checkpoint=...)`` from them (docs: docs/huggingface/trainer_fsdp2.md).

A checkpoint folder (``checkpoint-N``) holds what the Trainer writes, the model as a plain
Hugging Face folder gathered by ``save_model``, ``trainer_state.json``, the RNG state of
each rank and the scheduler's ``scheduler.pt``, plus :data:`SHARDED`: the model's and the
optimizer's shards, written by ``torch.distributed.checkpoint`` (a ``.metadata`` index and
one file per rank), keyed by parameter name. A resume reads the shards back into the
sharded model and its optimizer, each rank only the pieces it holds, so nothing is
gathered whole; the gathered folder is for users, not for the resume.

The storage is :mod:`ulysses_cp.integrations.dcp_checkpoint`, which train.py's FSDP2
engine uses too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..dcp_checkpoint import load_sharded, save_sharded

__all__ = [
    "SHARDED",
    "FSDPCheckpointMixin",
    "check_sharded",
    "load_sharded_state",
    "save_sharded_state",
]

SHARDED = "fsdp2_sharded"  # the subfolder of a checkpoint with the shards
SCHEDULER = "scheduler.pt"  # transformers' name for the scheduler's state
MODEL, OPTIMIZER = "model", "optimizer"


def save_sharded_state(model: torch.nn.Module, optimizer: Any, folder: Path) -> None:
    """Write ``model``'s and ``optimizer``'s shards into ``folder`` (collective: every rank
    calls it with the same folder), by ``dcp_checkpoint.save_sharded``."""
    save_sharded(model, _unwrapped(optimizer), Path(folder))


def load_sharded_state(model: torch.nn.Module, optimizer: Any, folder: Path) -> None:
    """Read a folder of :func:`save_sharded_state` into the sharded ``model`` and
    ``optimizer`` (collective).

    Raises:
        ValueError: ``folder`` holds no shards (a checkpoint saved with
            ``save_only_model=True``, or not by this path).
    """
    check_sharded(folder)
    load_sharded(model, _unwrapped(optimizer), Path(folder))


def check_sharded(folder: Path) -> None:
    """``folder`` holds a complete :func:`save_sharded_state` (its ``.metadata``), else a
    ``ValueError`` naming the fix."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ValueError(
            f"{folder.parent} has no sharded model and optimizer state ({folder.name}/ is "
            f"missing or incomplete): under FSDP2 with sequence_parallel_config a resume "
            f"needs a checkpoint saved by it with save_only_model=False; a "
            f"save_only_model=True checkpoint holds the model alone (load it with "
            f"from_pretrained and start a new run)"
        )


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


class FSDPCheckpointMixin:
    """The Trainer's checkpoint hooks under FSDP2 (``self._fsdp_mesh`` set); the parent's
    otherwise. Placed before ``transformers.Trainer`` in the MRO (by
    :class:`.mixin.SequenceParallelMixin`)."""

    args: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    _fsdp_mesh: Any

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The shards of the model and optimizer in ``output_dir/fsdp2_sharded``
        (collective); the scheduler's state as the Trainer writes it."""
        if getattr(self, "_fsdp_mesh", None) is None:
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        save_sharded_state(self.model, self.optimizer, Path(output_dir) / SHARDED)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The Trainer would load the gathered folder into the sharded model: here only
        the shards are checked for; :meth:`_load_optimizer_and_scheduler`, which the
        Trainer calls once the optimizer exists, loads the model and optimizer together."""
        if getattr(self, "_fsdp_mesh", None) is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        check_sharded(Path(resume_from_checkpoint) / SHARDED)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The model's and optimizer's shards (collective) and the scheduler's state."""
        if getattr(self, "_fsdp_mesh", None) is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        load_sharded_state(self.model, self.optimizer, Path(checkpoint) / SHARDED)
        scheduler = Path(checkpoint) / SCHEDULER
        if not scheduler.is_file():
            raise ValueError(
                f"{checkpoint} has no {SCHEDULER}: it was not saved by a Trainer; resume "
                f"from a checkpoint-N folder the Trainer wrote"
            )
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
