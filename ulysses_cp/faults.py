"""Fault injection for the reliability tests, driven by the ``UCP_FAULT`` environment variable.

``UCP_FAULT="KIND:step=N[,rank=R]"`` with KIND one of

- ``kill``: the rank SIGKILLs itself at the start of step N (a dead peer);
- ``hang``: the rank sleeps for an hour at the start of step N (a hung peer);
- ``crash_in_save``: the rank exits while writing the checkpoint of step N (after
  DeepSpeed's files, before the checkpoint is published);
- ``nan_loss``: the loss of step N is NaN;
- ``nan_grad``: the loss of step N is finite but its gradients are NaN.

Without ``rank=`` every rank is affected. Unset (the normal case) nothing happens.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

KINDS = ("kill", "hang", "crash_in_save", "nan_loss", "nan_grad")


def _spec() -> tuple[str, int, int | None] | None:
    raw = os.environ.get("UCP_FAULT")
    if not raw:
        return None
    kind, _, args = raw.partition(":")
    if kind not in KINDS:
        raise ValueError(f"UCP_FAULT kind {kind!r} is not one of {list(KINDS)}")
    fields = dict(item.split("=") for item in args.split(",") if item)
    rank = fields.get("rank")
    return kind, int(fields["step"]), None if rank is None else int(rank)


def active(kind: str, step: int) -> bool:
    spec = _spec()
    if spec is None or spec[0] != kind or spec[1] != step:
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    return spec[2] is None or spec[2] == rank


def point(kind: str, step: int) -> None:
    """Act on ``kill`` / ``hang`` / ``crash_in_save`` faults."""
    if not active(kind, step):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(3600)
    os._exit(17)


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def corrupt_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """Apply ``nan_loss`` / ``nan_grad`` faults to a loss."""
    if active("nan_loss", step):
        return loss * float("nan")
    if active("nan_grad", step):
        return _NanGrad.apply(loss)
    return loss
