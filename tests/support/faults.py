"""Fault injection for the reliability tests: :class:`FaultHooks` acts at the trainer's
hook points (``ulysses_cp.training.trainer.Hooks``), and ``tests/support/train_with_faults.py`` runs
``train.py`` with them, built from the ``UCP_FAULT`` environment variable of the test that
launched it (the library itself reads no such variable).

``"KIND:step=N[,rank=R]"`` with KIND one of

- ``kill``: the rank SIGKILLs itself at the start of step N (a dead peer);
- ``hang``: the rank sleeps for an hour at the start of step N (a hung peer);
- ``crash_in_save``: the rank exits while writing the checkpoint of step N (after
  DeepSpeed's files, before the checkpoint is published);
- ``nan_loss``: the loss of step N is NaN;
- ``nan_grad``: the loss of step N is finite but its gradients are NaN.

Without ``rank=`` every rank is affected.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from ulysses_cp.training.trainer import Hooks

KINDS = ("kill", "hang", "crash_in_save", "nan_loss", "nan_grad")


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class FaultHooks(Hooks):
    """One fault, ``FaultHooks("nan_grad:step=2")``."""

    def __init__(self, spec: str) -> None:
        kind, _, args = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {list(KINDS)}")
        fields = dict(item.split("=") for item in args.split(",") if item)
        self.kind, self.step = kind, int(fields["step"])
        self.rank = None if fields.get("rank") is None else int(fields["rank"])

    def _active(self, kind: str, step: int) -> bool:
        if (self.kind, self.step) != (kind, step):
            return False
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.rank is None or self.rank == rank

    def step_start(self, step: int) -> None:
        if self._active("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._active("hang", step):
            time.sleep(3600)

    def in_save(self, step: int) -> None:
        if self._active("crash_in_save", step):
            os._exit(17)

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if self._active("nan_loss", step):
            return loss * float("nan")
        if self._active("nan_grad", step):
            return _NanGrad.apply(loss)
        return loss
