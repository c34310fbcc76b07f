"""``SequenceParallelDPOTrainer``: TRL's ``DPOTrainer`` under sequence parallelism."""

from __future__ import annotations

from typing import Any

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

    Refused under sequence parallelism, on every rank, naming the option: the MoE
    load-balancing loss (``router_aux_loss_coef`` on a model with router logits: set it
    to 0.0), vision datasets (``pixel_values``). ``precompute_ref_log_probs=True`` works
    and is exact, but runs before sequence parallelism is set up: each rank computes
    whole rows of its share of the dataset (without gradients).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sequence_parallel is None:
            return
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                f"under sequence parallelism the MoE load-balancing loss is not computed over "
                f"the whole sequence (router_aux_loss_coef={self.router_aux_loss_coef}); set "
                f"DPOConfig(router_aux_loss_coef=0.0)"
            )
