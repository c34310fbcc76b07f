"""Non-finite losses and gradients under DeepSpeed ZeRO 0-3 and FSDP2: detect on every
rank, skip.

``any_rank`` turns one rank's observation into the same answer everywhere (one all-reduce),
so every rank takes the same branch and no collective is left waiting.
``gradients_finite`` reads the reduced gradients before the update through DeepSpeed's
``safe_get_full_grad`` (ZeRO 0-2) / ``safe_get_local_grad`` (ZeRO-3, this rank's partition).
``skip_update`` zeroes them and steps with learning rate 0, so no parameter moves while
DeepSpeed's accumulation and step counters stay in line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.protocols import Engine

__all__ = [
    "any_rank",
    "gradients_finite",
    "skip_update",
]


def any_rank(value: bool, device: torch.device) -> bool:
    """The same answer on every rank: is ``value`` true on any rank?"""
    flag = torch.tensor([float(value)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def gradients_finite(engine: Engine) -> bool:
    """This rank's view of the reduced gradients, before the update (ZeRO 0-3; under
    FSDP2 this rank's shards, ``FSDP2Engine.local_gradients``)."""
    local = getattr(engine, "local_gradients", None)
    if local is not None:
        return all(bool(torch.isfinite(g).all()) for g in local())
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad

    stage3 = engine.zero_optimization_stage() == 3
    for p in engine.module.parameters():
        g = safe_get_local_grad(p) if stage3 else safe_get_full_grad(p)
        if g is not None and not torch.isfinite(g).all():
            return False
    return True


def skip_update(engine: Engine) -> None:
    """Zero the gradients and step with learning rate 0: no parameter moves, DeepSpeed's
    accumulation and step counters stay in line (the scheduler and Adam's moments advance
    one step on a zero gradient)."""
    from deepspeed.utils import safe_get_local_grad, safe_set_full_grad, safe_set_local_grad

    stage3 = engine.zero_optimization_stage() == 3
    sharded = hasattr(engine, "local_gradients")  # FSDP2: p.grad is this rank's shard
    for p in engine.module.parameters():
        if sharded:
            if p.grad is not None:
                p.grad.zero_()
        elif stage3:
            safe_set_local_grad(p, torch.zeros_like(safe_get_local_grad(p)))
        elif p.grad is not None:
            p.grad.zero_()
        else:
            safe_set_full_grad(p, torch.zeros_like(p, dtype=torch.float32))
    groups = engine.optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    engine.step()
    if engine.lr_scheduler is None:
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
