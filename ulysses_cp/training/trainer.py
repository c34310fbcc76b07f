"""The training loop: steps, gradient accumulation, metrics, checkpoints, and the reliability
rules (non-finite loss or gradients, signals) in one place.

``Trainer(engine, topo, dataset, ...).run(start)`` trains from step ``start`` to
``training.max_steps`` and returns the :class:`TrainState`. Everything a run chooses comes
in as arguments (the topology carries the sequence-parallel choices, ``TrainingConfig`` the
loop's); nothing is read from the environment. Tests inject faults through
:class:`Hooks` (``tests/support/faults.py``).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..core.batch import shard_batch
from ..core.comm import stats as comm_stats
from ..core.flops import FlopShape, step_flops
from ..core.log import get_logger
from ..core.metrics import attention_bytes_sent, largest_peak_memory_mb
from ..core.protocols import Engine
from ..core.topology import Topology
from ..models.memory import LossPlan, lm_loss
from ..run_blocks import TrainingConfig
from . import checkpoint
from .data import global_batch
from .evaluate import Evaluator
from .nonfinite import any_rank, gradients_finite, skip_update
from .tracking import Tracker

if TYPE_CHECKING:
    from .data import Dataset

__all__ = [
    "Hooks",
    "SignalFlag",
    "TrainState",
    "Trainer",
    "TrainingStopped",
]

log = get_logger("train")
log_all = get_logger("train.ranks", all_ranks=True)


class Hooks:
    """Points where a test can act (the defaults do nothing): the start of a step, the loss
    of a micro batch, and the moment a checkpoint's files are written but not published."""

    def step_start(self, step: int) -> None:
        """``step``: 1-based, the step about to be taken."""

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss

    def in_save(self, step: int) -> None:
        """Called by :func:`checkpoint.save` between writing and publishing."""

    def after_step(self, trainer: Trainer, state: TrainState) -> None:
        """After every step (and its log line), on every rank: where an evaluation or a
        custom metric goes (``trainer.batch``, ``trainer.loss`` and the engine are there;
        any collective must run on every rank)."""


class TrainingStopped(Exception):
    """The run stops on purpose (``on_nonfinite: stop``); ``exit_code`` for the process."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SignalFlag:
    """SIGTERM/SIGINT set a flag; the ranks agree on it at the end of every step, save,
    and leave the loop. A second signal exits at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.raised, self.seen = enabled, False, False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank has received a signal (one all-reduce)."""
        if self.enabled and any_rank(self.raised, device):
            self.seen = True
        return self.seen

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True
        log_all.warning(f"{signal.Signals(signum).name}: saving at the end of this step")


@dataclass
class TrainState:
    """Where the loop is: ``step`` (steps done), the mean losses logged so far, updates
    skipped, and what accumulates between two log lines."""

    step: int
    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    stopped_by_signal: bool = False
    evals: list[dict] = field(default_factory=list)  # the evaluations' metrics, in order
    since: int = 0  # finite steps since the last log line
    flops: float = 0.0  # this rank's model FLOPs since the last log line (every micro batch)
    ran: int = 0  # steps since the last log line, skipped ones included
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    """One run's loop. ``tc``: a ``TrainingConfig``; ``loss_plan``: the LM head and loss in
    ``tiles`` pieces (> 1; ``"auto"``: sized by bytes, ``core.tiles``), ``fused``: their
    gradients computed in the forward (``models.memory.LossPlan``); ``evaluator``: the
    held-out loss after the steps it chooses
    (``evaluate.Evaluator``, given the trainer's loss). ``tracker`` (metrics.jsonl, wandb)
    is set once the run knows its first step (after a resume), and ``zero_bytes_per_step``
    by the launcher script; ``flop_shape`` (``models.flop_count``) and ``peak_tflops`` by it
    too: the log's model TFLOP/s (none without a shape) and MFU (none without a peak)."""

    tracker: Tracker | None = None
    aux: torch.Tensor | None = None  # the last training loss's load-balancing term (MoE)
    # ZeRO's collective bytes this rank sends per step (``core.zero_comm.zero_wire_bytes``: the
    # planner's formula for the run's stage; DeepSpeed's comm is not counted live)
    zero_bytes_per_step: int = 0
    flop_shape: FlopShape | None = None
    peak_tflops: float | None = None  # the device's dense peak for the run's dtype

    def __init__(
        self,
        engine: Engine,
        topo: Topology,
        dataset: Dataset,
        *,
        tc: TrainingConfig,
        out: Path,
        loss_plan: LossPlan | None = None,
        hooks: Hooks | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        self.engine, self.topo, self.dataset, self.tc = engine, topo, dataset, tc
        self.out, self.loss_plan = out, loss_plan or LossPlan()
        self.hooks, self.evaluator = hooks or Hooks(), evaluator
        self.signals = SignalFlag(tc.save_on_signal)
        self.device = engine.device  # inputs and the loss accumulator live with the model

    # ------------------------------------------------------------------ batches and losses

    def batch(self, step: int, micro_step: int) -> dict[str, Any]:
        """This rank's shard of micro batch ``micro_step`` of ``step``, on the device, with
        the batch's plan (``"batch"``)."""
        full = global_batch(
            self.dataset,
            step=step,
            micro_step=micro_step,
            grad_accum=self.engine.gradient_accumulation_steps(),
            micro_batch=self.engine.train_micro_batch_size_per_gpu(),
            dp_rank=self.topo.dp_rank,
            dp_degree=self.topo.dp_degree,
        )
        return {k: t.to(self.device) for k, t in shard_batch(full, self.topo).items()}

    def loss(self, local: dict[str, Any], *, with_aux: bool = True) -> torch.Tensor:
        """SP cross-entropy of this rank's shard; LM head + loss tiled when asked. In
        training, an MoE model's load-balancing loss over the whole sequence is added with
        its coefficient, as the model's own forward adds it (evaluations keep the
        cross-entropy alone: ``eval_ppl`` is its exponential)."""
        module = self.engine.module
        loss = lm_loss(
            self.engine,
            module.head,
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            self.topo,
            batch=local.get("batch"),
            plan=self.loss_plan,
        )
        if not (module.training and with_aux and hasattr(module, "aux_loss")):
            return loss  # a forward's router logits wait for the next forward to replace them
        aux = module.aux_loss()
        if aux is None:
            return loss
        self.aux = aux.detach()
        return loss + module.router.coef * aux

    def ignored_loss(self, local: dict[str, Any]) -> torch.Tensor:
        """The loss of ``local`` with every label ignored (zero gradient), with the run's
        memory features: under ``tiled_loss`` the full logits are never materialised."""
        ignored = torch.full_like(local["shift_labels"], -100)
        return self.loss({**local, "shift_labels": ignored}, with_aux=False)

    def zero_loss(self) -> torch.Tensor:
        """A loss with zero gradient (one real batch, every label ignored): what
        ``checkpoint.load`` needs to create ZeRO's optimizer state."""
        return self.ignored_loss(self.batch(0, 0))

    def save(self, step: int) -> Path:
        """A checkpoint after ``step``; its ``meta.json`` keeps the wandb run's id."""
        meta = self.tracker.checkpoint_meta() if self.tracker is not None else {}
        return checkpoint.save(
            self.engine,
            self.out,
            step,
            portable=self.tc.portable_checkpoint,
            hook=self.hooks,
            meta=meta,
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """The evaluator's metrics after ``step``, with the model in eval mode; logged."""
        assert self.evaluator is not None
        module = self.engine.module
        module.eval()
        try:
            metrics = self.evaluator(step, self.loss)
        finally:
            module.train()
        if self.tracker is not None:
            self.tracker.log(step, metrics)
        return metrics

    # ------------------------------------------------------------------ the loop

    def run(self, start: int) -> TrainState:
        """Train steps ``start + 1 .. max_steps``; saves at ``save_interval``, on a signal
        (then returns early) and, unless stopped by a signal, at the end."""
        state = TrainState(step=start)
        acc = torch.zeros(2, device=self.device)  # the loss and the MoE aux loss, summed
        comm_stats.reset()
        for step in range(start, self.tc.max_steps):
            n = step + 1  # the step being taken, as logged
            self.hooks.step_start(n)
            finite = self._step(step, acc, state)
            state.step, state.since, state.ran = n, state.since + finite, state.ran + 1
            if n % self.tc.log_interval == 0 or n == self.tc.max_steps:
                self._log(state, acc)
            if self.evaluator is not None and self.evaluator.due(n, self.tc.max_steps):
                # the evaluation's traffic and time stay out of the next log line's
                # bytes per step and tokens/s (they are the training steps')
                began = time.perf_counter()
                with comm_stats.set_aside():
                    state.evals.append({"step": n, **self.evaluate(n)})
                state.started += time.perf_counter() - began
            self.hooks.after_step(self, state)
            if self.signals.agreed(self.device):
                self.save(n)
                log.info(f"stopped by signal after step {n}; saved {self.out / f'step{n}'}")
                state.stopped_by_signal = True
                return state
            if self.tc.save_interval and n % self.tc.save_interval == 0 and n < self.tc.max_steps:
                self.save(n)
        if state.step > start:
            self.save(state.step)
        return state

    def _step(self, step: int, acc: torch.Tensor, state: TrainState) -> bool:
        """One optimizer step over the accumulated micro batches; False when skipped."""
        n, gas, bad = step + 1, self.engine.gradient_accumulation_steps(), None
        for m in range(gas):
            local = self.batch(step, m)
            if self.flop_shape is not None:  # the batch's own rows or documents
                sp = self.topo.sp_world_size
                state.flops += step_flops(self.flop_shape, local["batch"].spans, sp=sp)
            loss = self.hooks.loss(self.loss(local), n)
            if any_rank(not torch.isfinite(loss).item(), self.device):
                bad = bad or f"non-finite loss at step {n} (micro step {m})"
                self._nonfinite(bad, step)
                # the micro batch contributes nothing: a no-target loss keeps DeepSpeed's
                # backward/step sequence (and its gradient reduction) in line
                del loss  # frees the bad graph before the second forward
                loss = self.ignored_loss(local)
            self.engine.backward(loss)
            boundary = m == gas - 1
            check = boundary and bad is None and self.tc.check_gradients
            if check and any_rank(not gradients_finite(self.engine), self.device):
                bad = f"non-finite gradients at step {n}"
                self._nonfinite(bad, step)
            if boundary and bad is not None:
                skip_update(self.engine)
                state.skipped += 1
                log.warning(f"{bad}: update skipped ({state.skipped} so far)")
            else:
                self.engine.step()
                if bad is None:
                    acc[0] += loss.detach().float() / gas
                    if self.aux is not None:
                        acc[1] += self.aux.float() / gas
        return bad is None

    def _nonfinite(self, what: str, step: int) -> None:
        """``stop``: save the state before this step's update, then stop (exit code 3)."""
        if self.tc.on_nonfinite == "stop":
            self.save(step)
            raise TrainingStopped(
                f"{what}; training.on_nonfinite is 'stop': saved {self.out / f'step{step}'} "
                f"(the state before this step) and stopped. Lower the learning rate or "
                f"inspect the data of this step, then --resume.",
                exit_code=3,
            )

    def _log(self, state: TrainState, acc: torch.Tensor) -> None:
        topo, engine, since = self.topo, self.engine, state.since
        dist.all_reduce(acc, group=topo.dp_group)  # mean over data-parallel replicas
        # None when every step since the last log was skipped
        mean_loss, mean_aux = (acc / (topo.dp_degree * since)).tolist() if since else (None, None)
        tokens_per_step = (
            engine.train_micro_batch_size_per_gpu()
            * engine.gradient_accumulation_steps()
            * topo.dp_degree
            * self.dataset.cfg.seq_len
        )
        attention = attention_bytes_sent()
        elapsed = time.perf_counter() - state.started
        tokens_per_s = tokens_per_step * max(since, 1) / elapsed
        metrics = {
            "loss": mean_loss,
            "lr": engine.get_lr()[0],
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s / dist.get_world_size(),
            "peak_mem_mb": largest_peak_memory_mb(acc.device),  # as the HF Trainer's
            # what this rank sends per step: attention (counted) and ZeRO (by formula),
            # the plan's comm_bytes_per_step_per_rank; the attention part apart
            "comm_bytes_per_step": attention / max(since, 1) + self.zero_bytes_per_step,
            "attention_comm_bytes_per_step": attention / max(since, 1),
            "skipped_steps": state.skipped,
        }
        metrics.update(self._flop_metrics(state.flops, state.ran, elapsed))
        if self.aux is not None:  # an MoE model's load-balancing loss, without its coefficient
            metrics["aux_loss"] = mean_aux
        if self.tracker is not None:
            self.tracker.log(state.step, metrics)
        shown = "skipped" if mean_loss is None else f"{mean_loss:.4f}"
        speed = f"  TFLOP/s {metrics['model_tflops']:.3g}" if "model_tflops" in metrics else ""
        speed += f"  MFU {100 * metrics['mfu']:.1f}%" if "mfu" in metrics else ""
        log.info(
            f"step {state.step:5d}  loss {shown}  lr {metrics['lr']:.2e}  "
            f"tok/s {metrics['tokens_per_s']:.0f}{speed}  peak {metrics['peak_mem_mb']:.0f}MB"
        )
        if mean_loss is not None:
            state.losses.append(mean_loss)
        acc.zero_()
        state.since, state.flops, state.ran = 0, 0.0, 0
        comm_stats.reset()
        state.started = time.perf_counter()

    def _flop_metrics(self, flops: float, steps: int, elapsed: float) -> dict[str, float]:
        """Per rank, over the ``steps`` since the last log line (``flops``: this rank's),
        the mean over the data-parallel replicas (each counts its own batches):
        ``model_flops_per_step``, ``model_tflops`` (model FLOPs per second) and ``mfu``
        (that over ``peak_tflops``, when known). Empty without a FLOP shape."""
        if self.flop_shape is None:
            return {}
        total = torch.tensor([flops], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.topo.dp_group)
        mean = total.item() / self.topo.dp_degree
        tflops = mean / elapsed / 1e12
        out = {"model_flops_per_step": mean / max(steps, 1), "model_tflops": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out
