"""``SequenceParallelSFTTrainer``: TRL's ``SFTTrainer`` under sequence parallelism."""

from __future__ import annotations

from typing import Any

import torch
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

    An MoE model's load-balancing loss is added as ``SFTTrainer`` adds it: TRL's
    ``router_aux_loss_coef``, not scaled by the processes, divided by the accumulation
    steps when the loss counts the accumulated tokens, and logged as ``aux_loss``.
    """

    aux_loss_enabled: bool
    router_aux_loss_coef: float
    current_gradient_accumulation_steps: int
    _metrics: Any

    def _router_aux_coef(self) -> float | None:
        sp = self.sequence_parallel
        if sp is None or sp.wrapper is None or sp.wrapper.router is None:
            return None
        return self.router_aux_loss_coef if self.aux_loss_enabled else None

    def _with_aux_loss(
        self, loss: torch.Tensor, aux: torch.Tensor, coef: float, scale: float, num_items: Any
    ) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        value = self.accelerator.gather_for_metrics(aux.detach()).mean().item()
        self._metrics[mode]["aux_loss"].append(value)
        steps = self.current_gradient_accumulation_steps if num_items is not None else 1
        return loss + coef * aux / steps
