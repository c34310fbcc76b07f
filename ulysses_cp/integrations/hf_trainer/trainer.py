"""``SequenceParallelTrainer``: ``transformers.Trainer`` under sequence parallelism."""

from __future__ import annotations

from transformers import Trainer

from .mixin import SequenceParallelMixin

__all__ = ["SequenceParallelTrainer"]


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """A drop-in ``transformers.Trainer`` that trains and evaluates sequence parallel.

    It takes ``Trainer``'s arguments. With a ``"sequence_parallel"`` block in the DeepSpeed
    config of ``args.deepspeed``, training and evaluation run sequence parallel and give
    the one-process losses; without one it is ``Trainer``. Needs transformers and
    accelerate (``pip install .[trainer]``).
    """
