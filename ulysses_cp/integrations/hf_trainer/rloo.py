"""``SequenceParallelRLOOTrainer``: TRL's ``RLOOTrainer`` under sequence parallelism."""

from __future__ import annotations

from trl import RLOOTrainer

from .rollouts import RolloutTrainerMixin

__all__ = ["SequenceParallelRLOOTrainer"]


class SequenceParallelRLOOTrainer(RolloutTrainerMixin, RLOOTrainer):
    """A drop-in ``trl.RLOOTrainer`` whose scoring and update run sequence parallel.

    It takes ``RLOOTrainer``'s arguments. With a ``"sequence_parallel"`` block in the
    DeepSpeed config of ``args.deepspeed`` it runs as `SequenceParallelGRPOTrainer` does:
    the leave-one-out baselines and the sequence-level KL penalty are computed from the
    replicas' rewards and the gathered per-token log-probs, as one process computes them.
    Without the block it is ``RLOOTrainer``.
    """

    parent_module = "trl.trainer.rloo_trainer"
