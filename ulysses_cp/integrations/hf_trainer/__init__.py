"""Hugging Face ``Trainer`` and TRL ``SFTTrainer`` under sequence parallelism
(``pip install .[trainer]``): the DeepSpeed JSON of ``--deepspeed`` carries the
``"sequence_parallel"`` block, and these drop-in subclasses read it.

``SequenceParallelTrainer`` needs transformers and accelerate; ``SequenceParallelSFTTrainer``
also TRL, imported only when that name is used."""

from __future__ import annotations

from typing import Any

__all__ = ["SequenceParallelSFTTrainer", "SequenceParallelTrainer"]


def __getattr__(name: str) -> Any:
    if name == "SequenceParallelTrainer":
        from .trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    if name == "SequenceParallelSFTTrainer":
        from .sft import SequenceParallelSFTTrainer

        return SequenceParallelSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
