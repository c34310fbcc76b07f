"""``SequenceParallelSFTTrainer``: TRL's ``SFTTrainer`` under sequence parallelism."""

from __future__ import annotations

from trl import SFTTrainer

from .mixin import SequenceParallelMixin

__all__ = ["SequenceParallelSFTTrainer"]


class SequenceParallelSFTTrainer(SequenceParallelMixin, SFTTrainer):
    """A drop-in ``trl.SFTTrainer`` that trains and evaluates sequence parallel.

    It takes ``SFTTrainer``'s arguments. With a ``"sequence_parallel"`` block in the
    DeepSpeed config of ``args.deepspeed``, training and evaluation run sequence parallel
    (packed rows included: position ids restarting per document) and give the one-process
    losses; without one it is ``SFTTrainer``. TRL's token-accuracy and entropy metrics are
    not logged under sequence parallelism.
    """
