"""``SequenceParallelDPOTrainer``: TRL's ``DPOTrainer`` under sequence parallelism."""

from __future__ import annotations

from trl import DPOTrainer

from .log_prob_trainer import LogProbTrainerMixin

__all__ = ["SequenceParallelDPOTrainer"]


class SequenceParallelDPOTrainer(LogProbTrainerMixin, DPOTrainer):
    """A drop-in ``trl.DPOTrainer`` whose policy and reference run sequence parallel.

    It takes ``DPOTrainer``'s arguments (``ref_model``, ``peft_config``, ...). With a
    ``"sequence_parallel"`` block in the DeepSpeed config of ``args.deepspeed``, the
    chosen and rejected rows are sharded in the run's layout (padded to its multiple
    here), and the policy and the reference run sequence parallel. Every ``loss_type``
    TRL ships gives the one-process losses and metrics: ``DPOTrainer`` itself computes
    them from the gathered per-token log-probs. Without the block it is ``DPOTrainer``.

    An MoE model's load-balancing loss (``router_aux_loss_coef``) is taken over the whole
    sequence of the policy's rows and added as ``DPOTrainer`` adds it (and logged as
    ``aux_loss``). Refused under sequence parallelism, on every rank: vision datasets
    (``pixel_values``). ``precompute_ref_log_probs=True`` works
    and is exact, but runs before sequence parallelism is set up: each rank computes
    whole rows of its share of the dataset (without gradients).
    """
