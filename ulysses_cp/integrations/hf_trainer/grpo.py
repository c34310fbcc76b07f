"""``SequenceParallelGRPOTrainer``: TRL's ``GRPOTrainer`` under sequence parallelism."""

from __future__ import annotations

from trl import GRPOTrainer

from .rollouts import RolloutTrainerMixin

__all__ = ["SequenceParallelGRPOTrainer"]


class SequenceParallelGRPOTrainer(RolloutTrainerMixin, GRPOTrainer):
    """A drop-in ``trl.GRPOTrainer`` whose scoring and update run sequence parallel.

    It takes ``GRPOTrainer``'s arguments (``reward_funcs``, ``rollout_func``,
    ``peft_config``, ...). With a ``"sequence_parallel"`` block in the DeepSpeed config of
    ``args.deepspeed``, completions are generated outside sequence parallelism (SP rank
    0's are shared with its replica); scoring and the update run sequence parallel. Every
    ``loss_type`` TRL ships gives the one-process losses and metrics. Without the block it
    is ``GRPOTrainer``.
    """

    parent_module = "trl.trainer.grpo_trainer"
