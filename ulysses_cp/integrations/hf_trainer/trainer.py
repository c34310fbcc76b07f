"""``SequenceParallelTrainer``: ``transformers.Trainer`` under sequence parallelism."""

from __future__ import annotations

from transformers import Trainer

from .mixin import SequenceParallelMixin

__all__ = ["SequenceParallelTrainer"]


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """A drop-in ``transformers.Trainer`` (the same arguments). With a
    ``"sequence_parallel"`` block in the DeepSpeed config of ``args.deepspeed``, training
    and evaluation run sequence parallel (:mod:`ulysses_cp.integrations.hf_trainer.mixin`)
    and give the one-process losses; without one it is ``Trainer``."""
