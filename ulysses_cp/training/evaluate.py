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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..core.batch import shard_batch
from ..core.log import get_logger
from ..core.topology import Topology
from ..core.varlen import IGNORE
from ..run_blocks import EvalConfig
from .data import global_batch

if TYPE_CHECKING:
    from .data import Dataset

__all__ = [
    "Evaluator",
    "LossFn",
    "evaluate",
]

# the SP mean loss of one shard, ``loss_fn(local)`` (every SP rank gets the same value)
LossFn = Callable[[dict[str, Any]], torch.Tensor]

log = get_logger("train")


def evaluate(
    dataset: Dataset,
    loss_fn: LossFn,
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
    """The held-out loss of a run: ``evaluator(step, loss_fn)`` evaluates when
    ``eval.interval`` says so (and after ``max_steps``), logs the line, and returns the
    metrics (None when not due). ``loss_fn``: the trainer's loss of one shard, with the
    model in eval mode (``Trainer`` sets it)."""

    def __init__(
        self,
        dataset: Dataset,
        cfg: EvalConfig,
        topo: Topology,
        *,
        micro_batch: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.dataset, self.cfg, self.topo = dataset, cfg, topo
        self.micro_batch, self.device = micro_batch, device

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.interval == 0 or step == max_steps)

    def __call__(self, step: int, loss_fn: LossFn) -> dict[str, float]:
        metrics = evaluate(
            self.dataset,
            loss_fn,
            self.topo,
            batches=self.cfg.batches,
            micro_batch=self.micro_batch,
            device=self.device,
        )
        log.info(
            f"step {step:5d}  eval_loss {metrics['eval_loss']:.4f}  "
            f"eval_ppl {metrics['eval_ppl']:.2f}  ({metrics['eval_tokens']} tokens)"
        )
        return metrics
