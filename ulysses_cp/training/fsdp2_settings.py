"""What ``"engine": "fsdp2"`` reads from a config's DeepSpeed part, and what it refuses.

The same JSON runs under either engine. Under FSDP2 the DeepSpeed keys keep their meaning
where PyTorch has one: the batch sizes, ``gradient_clipping``, the ``optimizer`` block
(Adam, AdamW, SGD as ``torch.optim``), the ``scheduler`` block (WarmupLR, WarmupDecayLR,
WarmupCosineLR as a ``LambdaLR`` giving DeepSpeed's learning rate at every step), the
ZeRO stage (``reshard_after_forward``) and ``bf16``. :func:`check_fsdp2` refuses every
other DeepSpeed key by name, with the fix, identically on every rank and before any
collective (``training.build.validate`` calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..config import RunConfig

__all__ = [
    "SCHEDULERS",
    "check_fsdp2",
    "clipping",
    "deepspeed_lr",
    "make_optimizer",
    "make_scheduler",
]

# top-level DeepSpeed keys with a meaning here (or none that changes training)
KEPT = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "bf16",
    "fp16",
    "zero_allow_untested_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "wandb",
}
# zero_optimization keys that only tune DeepSpeed's own buckets and overlap
ZERO_KEPT = {
    "stage",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "allgather_partitions",
    "round_robin_gradients",
}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# each scheduler's parameters and DeepSpeed's defaults (None: required, or the optimizer's lr)
SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
}
OPTIMIZERS = ("Adam", "AdamW", "SGD")


def _zero_fix(key: str) -> str:
    if key.startswith("offload_"):
        return "FSDP2 here keeps parameters and optimizer state on the device: drop it"
    if key.startswith("stage3_"):
        return "ZeRO-3's own tuning knob: FSDP2 gathers one layer at a time; drop it"
    return "a DeepSpeed-only ZeRO feature: drop it"


def _refusals(run: RunConfig) -> list[str]:
    ds, out = run.deepspeed, []
    for key in sorted(set(run.deepspeed_keys) - KEPT):
        out.append(f"{key} (a DeepSpeed-only key: drop it)")
    for dotted in sorted(k for k in ds.written if "." in k):
        block, key = dotted.split(".", 1)
        if block == "zero_optimization" and key not in ZERO_KEPT:
            out.append(f"{dotted} ({_zero_fix(key)})")
        elif block != "zero_optimization" and key != "enabled":
            out.append(f"{dotted} (a DeepSpeed precision knob: drop it)")
    if ds.dtype == "float16":
        out.append('fp16.enabled (bf16 only under fsdp2: set "bf16": {"enabled": true})')
    if ds.dtype == "auto":
        out.append('bf16/fp16 "enabled": "auto" (write true or false)')
    if ds.gradient_clipping is None or ds.gradient_clipping < 0:
        got = "auto" if ds.gradient_clipping is None else ds.gradient_clipping
        out.append(f"gradient_clipping {got!r} (write a number >= 0; 0: no clipping)")
    out += _optimizer_refusals(ds.optimizer)
    out += _scheduler_refusals(ds.scheduler)
    return out


def _optimizer_refusals(block: dict | None) -> list[str]:
    if not block:
        return ['optimizer missing (write an "optimizer" block: type Adam, AdamW or SGD)']
    kind = block.get("type")
    if kind not in OPTIMIZERS:
        return [f"optimizer.type {kind!r} (one of {list(OPTIMIZERS)} under fsdp2)"]
    return []


def _scheduler_refusals(block: Any) -> list[str]:
    if block is None:
        return []
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in SCHEDULERS:
        return [f"scheduler.type {kind!r} (one of {list(SCHEDULERS)} under fsdp2)"]
    params = block.get("params") or {}
    known = SCHEDULER_PARAMS[kind]
    extra = sorted(set(params) - set(known))
    out = [f"scheduler.params.{k} (not a {kind} parameter)" for k in extra]
    if kind != "WarmupLR" and "total_num_steps" not in params:
        out.append(f"scheduler.params.total_num_steps missing ({kind} needs it)")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        out.append(f"scheduler.params.warmup_type {params['warmup_type']!r} (log or linear)")
    n = params.get("warmup_num_steps", 1000)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        out.append(f"scheduler.params.warmup_num_steps {n!r} (a positive integer)")
    return out


def check_fsdp2(run: RunConfig) -> None:
    """Refuse, naming each key and its fix, what ``"engine": "fsdp2"`` cannot honour (a
    no-op for ``"engine": "deepspeed"``). Reads the config only: every rank raises the
    same error before any collective."""
    if run.engine != "fsdp2":
        return
    bad = _refusals(run)
    if bad:
        raise ValueError(
            '"engine": "fsdp2" does not take these DeepSpeed settings: '
            + "; ".join(bad)
            + ' (or run them with "engine": "deepspeed")'
        )


def clipping(run: RunConfig) -> float:
    """``gradient_clipping`` (0: none; ``"auto"`` and a negative norm are refused by
    :func:`check_fsdp2`)."""
    return run.deepspeed.gradient_clipping or 0.0


def make_optimizer(block: dict, params) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of a DeepSpeed ``optimizer`` block: AdamW for
    ``AdamW``, and for ``Adam`` unless ``adam_w_mode`` is false (DeepSpeed's Adam
    decouples weight decay by default), ``SGD`` for ``SGD``."""
    kind, kwargs = block["type"], dict(block.get("params") or {})
    kwargs.pop("torch_adam", None)
    decoupled = kwargs.pop("adam_w_mode", True)
    if kind == "SGD":
        return torch.optim.SGD(params, **kwargs)
    if kind == "Adam" and not decoupled:
        return torch.optim.Adam(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def _warmup(it: int, n: int, kind: str) -> float:
    """The warmup fraction at iteration ``it`` of ``n`` (``n`` at least 2, as DeepSpeed)."""
    return (1.0 / math.log(n)) * math.log(it + 1) if kind == "log" else it / n


def deepspeed_lr(kind: str, params: dict, base_lr: float) -> Callable[[int], float]:
    """``lr(it)``: the learning rate DeepSpeed's scheduler ``kind`` sets after ``it + 1``
    of its steps (``it = -1`` before the first), written from its definition:
    ``base_lr`` is the optimizer's learning rate."""
    p = {**SCHEDULER_PARAMS[kind], **params}
    n, wt = max(2, int(p["warmup_num_steps"])), p["warmup_type"]
    if kind == "WarmupCosineLR":
        total, lo, floor = p["total_num_steps"], p["warmup_min_ratio"], p["cos_min_ratio"]

        def cosine(it: int) -> float:
            if it < 0:
                return 0.0
            if it < n:
                return base_lr * (lo + _warmup(it, n, wt) * (1.0 - lo))
            done = min(1.0, (it - n + 1) / max(1, total - n))
            ratio = floor + (1.0 - floor) * ((1 + math.cos(math.pi * done)) / 2)
            return base_lr * max(0.0, ratio)

        return cosine
    lo = p["warmup_min_lr"]
    hi = base_lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]

    def warmup(it: int) -> float:
        if it < 0:
            return lo
        if it < n:
            return lo + (hi - lo) * _warmup(it, n, wt)  # DeepSpeed's order of operations
        if kind == "WarmupLR":
            return hi
        total = p["total_num_steps"]
        return lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - n))

    return warmup


def make_scheduler(block: dict | None, optimizer: torch.optim.Optimizer):
    """A ``LambdaLR`` that sets DeepSpeed's learning rate for ``block`` at every step (None
    without a block). The groups' base rate is set to 1, so the factor is the rate."""
    if block is None:
        return None
    base = optimizer.param_groups[0]["lr"]
    lr = deepspeed_lr(block["type"], block.get("params") or {}, base)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = 1.0
    # LambdaLR's count k: k scheduler steps taken, DeepSpeed's iteration k - 1
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr(k - 1))
