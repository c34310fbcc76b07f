"""Hugging Face ``Trainer`` and TRL ``SFTTrainer`` under sequence parallelism
(``pip install .[trainer]``): the DeepSpeed JSON of ``--deepspeed`` carries the
``"sequence_parallel"`` block, and these drop-in subclasses read it.

``SequenceParallelTrainer`` needs transformers and accelerate; ``SequenceParallelSFTTrainer``,
``SequenceParallelDPOTrainer``, ``SequenceParallelGRPOTrainer`` and
``SequenceParallelRLOOTrainer`` also TRL, imported only when those names are used."""

from __future__ import annotations

from typing import Any

__all__ = [
    "SequenceParallelDPOTrainer",
    "SequenceParallelGRPOTrainer",
    "SequenceParallelRLOOTrainer",
    "SequenceParallelSFTTrainer",
    "SequenceParallelTrainer",
]


def __getattr__(name: str) -> Any:
    if name == "SequenceParallelTrainer":
        from .trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    if name == "SequenceParallelSFTTrainer":
        from .sft import SequenceParallelSFTTrainer

        return SequenceParallelSFTTrainer
    if name == "SequenceParallelDPOTrainer":
        from .dpo import SequenceParallelDPOTrainer

        return SequenceParallelDPOTrainer
    if name == "SequenceParallelGRPOTrainer":
        from .grpo import SequenceParallelGRPOTrainer

        return SequenceParallelGRPOTrainer
    if name == "SequenceParallelRLOOTrainer":
        from .rloo import SequenceParallelRLOOTrainer

        return SequenceParallelRLOOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
