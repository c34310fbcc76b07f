"""The sequence-parallel metrics of a ``Trainer`` run and its wandb run across resumes.

- :class:`StepMeter`: what every training log line gets (so ``trainer.state.log_history``
  and every ``report_to`` integration), with ``metrics.jsonl``'s names for the same
  quantities (``train.py``): ``tokens_per_s`` (all replicas), ``tokens_per_s_per_gpu``,
  ``peak_mem_mb`` (the largest rank's), ``attention_comm_bytes_per_step`` (this rank's
  all-to-all and ring bytes, counted by ``ucp.comm_stats``) and ``comm_bytes_per_step``
  (plus ZeRO's or, under FSDP2, FSDP2's bytes by the planner's formulas). Evaluations
  stay out of them.
- :class:`SequenceParallelCallback`: the wandb run's config gets the ``topology`` (degrees,
  mode, layout) and each checkpoint folder the run's id (:data:`RUN_ID_FILE`);
  :func:`resumed_wandb_run` makes ``transformers``' ``WandbCallback`` continue that run
  when training resumes from the folder.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ...core.comm import stats as comm_stats
from ...core.log import get_logger
from ...core.metrics import attention_bytes_sent, largest_peak_memory_mb, topology_info
from ...core.topology import Topology
from ...core.zero_comm import fsdp2_wire_bytes, full_numel, zero_wire_bytes
from ...deepspeed_block import DeepSpeedSettings

__all__ = [
    "RUN_ID_FILE",
    "SequenceParallelCallback",
    "StepMeter",
    "fsdp2_bytes_per_step",
    "resumed_wandb_run",
    "zero_bytes_per_step",
]

log = get_logger(__name__)
RUN_ID_FILE = "wandb_run.json"  # {"id": ...} in a checkpoint folder


def zero_bytes_per_step(
    model: Any, settings: DeepSpeedSettings, *, world: int, micro_steps: int
) -> int | None:
    """ZeRO's bytes this rank sends per optimizer step (``core.zero_comm``) under the
    config's DeepSpeed ``settings``, or None when some parameters are frozen (LoRA): the
    formula counts every parameter."""
    params = list(model.parameters())
    if not params or not all(p.requires_grad for p in params):
        return None
    return zero_wire_bytes(
        stage=settings.zero_stage,
        max_live_parameters=settings.stage3_max_live_parameters,
        params=full_numel(params),
        element_bytes=params[0].element_size(),
        world=world,
        micro_steps=micro_steps,
    )


def fsdp2_bytes_per_step(
    model: Any, *, reshard_after_forward: bool, bf16: bool, world: int, micro_steps: int
) -> int | None:
    """FSDP2's bytes this rank sends per optimizer step for a model sharded by
    :func:`.fsdp.shard_model` (``core.zero_comm.fsdp2_wire_bytes``), or None when some
    parameters are frozen (LoRA: the formula reduces every parameter's gradient).

    ``reshard_after_forward`` is given to every ``fully_shard`` call, the root's too, so
    nothing is kept for the backward (``kept_params`` 0). ``bf16``: gathered in bfloat16,
    reduced in float32 (``shard_model``'s policy). The micro steps but the last defer the
    reduction (:func:`.fsdp.deferred_reduction`): the parameters are gathered every micro
    step and the gradients reduce-scattered once, as the formula counts."""
    params = list(model.parameters())
    if not params or not all(p.requires_grad for p in params):
        return None
    element = params[0].element_size()
    counts = dict(params=full_numel(params), world=world)
    kw = dict(param_bytes=2 if bf16 else element, reduce_bytes=4 if bf16 else element)
    return fsdp2_wire_bytes(
        reshard_after_forward=reshard_after_forward, micro_steps=micro_steps, **counts, **kw
    )


class StepMeter:
    """Tokens, time and bytes between two training log lines of one rank.

    :meth:`count` each training micro batch (this replica's full batch), :meth:`start` at
    the start of training, :meth:`set_aside` around evaluations, :meth:`metrics` at each
    training log line: a collective over every rank (the Trainer logs on every rank)."""

    def __init__(self, topo: Topology, *, device: torch.device, zero_bytes: int | None) -> None:
        self.topo, self.device, self.zero_bytes = topo, device, zero_bytes
        self.tokens = 0
        self.last_step = 0
        self.started = time.perf_counter()

    def start(self, step: int) -> None:
        self.tokens, self.last_step = 0, step
        comm_stats.reset()
        self.started = time.perf_counter()

    def count(self, input_ids: torch.Tensor) -> None:
        self.tokens += input_ids.numel()

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Traffic and time inside the block (an evaluation) are not the steps'."""
        began = time.perf_counter()
        with comm_stats.set_aside():
            yield
        self.started += time.perf_counter() - began

    def metrics(self, step: int) -> dict[str, float]:
        steps = max(step - self.last_step, 1)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        # tokens summed over the replicas (one rank of each in the dp group)
        tokens = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.device)
        if self.topo.dp_group is not None and self.topo.dp_degree > 1:
            dist.all_reduce(tokens, group=self.topo.dp_group)
        attention = attention_bytes_sent() / steps
        tokens_per_s = float(tokens.item()) / elapsed
        out = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / self.topo.world_size,
            "peak_mem_mb": largest_peak_memory_mb(self.device),
            "attention_comm_bytes_per_step": attention,
        }
        if self.zero_bytes is not None:
            out["comm_bytes_per_step"] = attention + self.zero_bytes
        self.start(step)
        return out


def _wandb_run() -> Any:
    """The active wandb run of this process, or None (wandb not imported or no run)."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


class SequenceParallelCallback(TrainerCallback):
    """Added by the mixin under sequence parallelism, after the ``report_to`` callbacks
    (so wandb's run exists at ``on_train_begin``)."""

    def __init__(self, topo: Topology, meter: StepMeter, block: dict) -> None:
        self.topo, self.meter, self.block = topo, meter, block

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.start(state.global_step)
        run = _wandb_run()
        if run is not None and state.is_world_process_zero:
            info = {"topology": topology_info(self.topo), "sequence_parallel": self.block}
            run.config.update(info, allow_val_change=True)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = _wandb_run()
        if run is None or not state.is_world_process_zero or state.is_hyper_param_search:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / RUN_ID_FILE).write_text(json.dumps({"id": run.id}))


def checkpoint_folder(resume_from_checkpoint: str | bool | None, output_dir: str) -> Path | None:
    """The folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from (None: none)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        return Path(last) if last is not None else None  # the Trainer raises itself
    return Path(resume_from_checkpoint)


@contextmanager
def resumed_wandb_run(folder: Path | None) -> Iterator[None]:
    """While training resumes from ``folder``: ``WANDB_RUN_ID`` (with ``WANDB_RESUME=allow``)
    names the run saved there, so the run ``WandbCallback`` starts is that one. Variables
    the user set are left as they are; ours are removed afterwards."""
    path = folder / RUN_ID_FILE if folder is not None else None
    if path is None or not path.is_file():
        yield
        return
    run_id = json.loads(path.read_text())["id"]
    ours = {
        k: v
        for k, v in (("WANDB_RUN_ID", run_id), ("WANDB_RESUME", "allow"))
        if k not in os.environ
    }
    os.environ.update(ours)
    try:
        yield
    finally:
        for key in ours:
            os.environ.pop(key, None)
        run = _wandb_run()
        if run is not None and run.id != run_id:
            log.warning(
                f"{path} names wandb run {run_id}, but this training logged to run {run.id} "
                f"(WANDB_RUN_ID set to another run, or wandb.init called before train())"
            )
