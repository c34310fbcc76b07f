"""Held-out loss during training, under the run's sequence parallelism.

Every ``eval.interval`` steps (and after the last one) each data-parallel replica reads
``eval.batches`` micro batches of the held-out samples (the same ones every time, so the
numbers are comparable), shards them like training batches and runs the model's forward
without gradients: the same attention and memory features as a training step, less
memory. The loss is the token mean over every replica's batches; ``eval_ppl`` is its
exponential. Logged to stdout, ``metrics.jsonl`` and wandb (a row of its own at the step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..config import EvalConfig
from ..core.log import get_logger
from ..core.topology import Topology
from ..core.varlen import IGNORE
from .data import global_batch, shard_batch

if TYPE_CHECKING:
    from .data import Dataset
    from .trainer import Trainer, TrainState

__all__ = [
    "EvalConfig",
    "Evaluator",
    "evaluate",
]

log = get_logger("train")


def evaluate(
    dataset: Dataset,
    loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    topo: Topology,
    *,
    batches: int,
    micro_batch: int,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """``{"eval_loss", "eval_ppl", "eval_tokens"}`` over ``batches`` micro batches per
    data-parallel replica; ``loss_fn(local)``: the SP mean loss of one shard (every SP rank
    gets the same value). Collective over the SP and data-parallel groups."""
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for k in range(batches):
            full = global_batch(
                dataset,
                step=0,
                micro_step=k,
                grad_accum=batches,
                micro_batch=micro_batch,
                dp_rank=topo.dp_rank,
                dp_degree=topo.dp_degree,
            )
            count = int((full["shift_labels"] != IGNORE).sum())
            local = {key: t.to(device) for key, t in shard_batch(full, topo).items()}
            loss = float(loss_fn(local))
            sums += torch.tensor([loss * count, count], dtype=torch.float64)
    if topo.dp_degree > 1:
        dist.all_reduce(sums, group=topo.dp_group)
    total, count = float(sums[0]), int(sums[1])
    mean = total / max(count, 1)
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 700.0)), "eval_tokens": count}


class Evaluator:
    """What the trainer calls after every step (``Trainer(evaluator=...)``)."""

    def __init__(self, dataset: Dataset, cfg: EvalConfig) -> None:
        self.dataset, self.cfg = dataset, cfg

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.interval == 0 or step == max_steps)

    def __call__(self, trainer: Trainer, state: TrainState) -> dict[str, float] | None:
        if not self.due(state.step, trainer.tc.max_steps):
            return None
        module = trainer.engine.module
        module.eval()
        try:
            metrics = evaluate(
                self.dataset,
                trainer.loss,
                trainer.topo,
                batches=self.cfg.batches,
                micro_batch=trainer.engine.train_micro_batch_size_per_gpu(),
                device=trainer.device,
            )
        finally:
            module.train()
        if trainer.tracker is not None:
            trainer.tracker.log(state.step, metrics)
        log.info(
            f"step {state.step:5d}  eval_loss {metrics['eval_loss']:.4f}  "
            f"eval_ppl {metrics['eval_ppl']:.2f}  ({metrics['eval_tokens']} tokens)"
        )
        return metrics
