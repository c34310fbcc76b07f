"""``SequenceParallelGRPOTrainer``: TRL's ``GRPOTrainer`` under sequence parallelism."""

from __future__ import annotations

from trl import GRPOTrainer

from .rollouts import RolloutTrainerMixin

__all__ = ["SequenceParallelGRPOTrainer"]


class SequenceParallelGRPOTrainer(RolloutTrainerMixin, GRPOTrainer):
    """A drop-in ``trl.GRPOTrainer`` (the same arguments: ``reward_funcs``,
    ``rollout_func``, ``peft_config``, ...). With a ``"sequence_parallel"`` block in the
    DeepSpeed config of ``args.deepspeed``, completions are generated outside sequence
    parallelism (SP rank 0's shared with its replica), and scoring and the update run
    sequence parallel, with every ``loss_type`` TRL ships giving the one-process losses and
    metrics (:mod:`.rollouts`). Without the block it is ``GRPOTrainer``."""

    parent_module = "trl.trainer.grpo_trainer"
