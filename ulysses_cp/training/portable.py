"""The optimizer's state as DeepSpeed keeps it, read and written by parameter name:
``portable.pt``, and the fixes a fresh engine's state needs.

``portable.pt`` (written by rank 0 into every checkpoint unless ``portable=False``): full
fp32 parameters or master copies, every optimizer state tensor and its step, the scheduler
state and, in fp16, the loss scaler's running state. Parameters are replicated over the
sequence-parallel ranks; only ZeRO partitions them and their optimizer state, over every
rank (``engine.SequenceParallelMPU``). So ``checkpoint.load`` loads DeepSpeed's own files
on the same number of ranks and ZeRO stage (under any split: u4 -> u2r2 -> r4, dp2 x u2 ->
u4) and this state when the world size or stage differs (it gathers the full model and
optimizer state on rank 0's CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..core.protocols import Engine

__all__ = [
    "SCALER_FIELDS",
    "load_portable",
    "move_state_to_masters",
    "portable_state",
    "settle_initial_state",
    "zero_stage",
]


def zero_stage(engine: Engine) -> int:
    return int(engine.zero_optimization_stage())


def _base_optimizer(engine: Engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _optimizer_step(engine: Engine) -> int:
    """The optimizer's own step count (Adam, Adagrad...), 0 for optimizers without one."""
    for state in _base_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _state_keys(engine: Engine) -> list[str]:
    """The per-parameter tensors the optimizer keeps, whatever they are called (Adam's
    ``exp_avg``/``exp_avg_sq``, momentum SGD's ``momentum_buffer``, Adagrad's ``sum``...);
    under ZeRO they are the same for every flat partition."""
    keys: set[str] = set()
    for state in _base_optimizer(engine).state.values():
        keys |= {k for k, v in state.items() if k != "step" and torch.is_tensor(v) and v.dim()}
    return sorted(keys)


def _hp_mapped(p) -> bool:
    """Does DeepSpeed keep this parameter's fp32 master copy and optimizer state elsewhere
    (ZeRO 1-3, or bf16 under ZeRO 0)? Then they are read through its safe_get API."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _masters(engine: Engine) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
    """ZeRO 0 in bf16/fp16: DeepSpeed's FP16 optimizers keep an fp32 master copy of every
    parameter and key the optimizer state by the masters. ``id(param) -> (master, owner,
    offset)``: ``master`` a view of the parameter's fp32 copy, ``owner`` the tensor its
    optimizer state is keyed by, ``offset`` where the parameter starts in ``owner``. The
    unfused optimizer keeps one master per parameter (``fp32_groups``: owner = master,
    offset 0); the fused one (DeepSpeed's FusedAdam on GPU) one flat master per group
    (``fp32_groups_flat``, parameters back to back). Empty in full precision."""
    opt = engine.optimizer
    low = getattr(opt, "fp16_groups", None)
    per_param, flat = getattr(opt, "fp32_groups", None), getattr(opt, "fp32_groups_flat", None)
    if not low:
        return {}
    if per_param:
        return {id(p): (m, m, 0) for lo, hi in zip(low, per_param) for p, m in zip(lo, hi)}
    out = {}
    for lo, owner in zip(low, flat or []):
        offset = 0
        for p in lo:
            out[id(p)] = (owner.narrow(0, offset, p.numel()).view_as(p), owner, offset)
            offset += p.numel()
    return out


def settle_initial_state(engine: Engine) -> None:
    """Optimizers that create their state in ``__init__`` (Adagrad's ``sum``) break
    DeepSpeed's checkpoints (deepspeed 0.19.8), so that a run could train but not save or
    resume. Called by ``ucp.initialize``; does nothing for the other optimizers.

    - ZeRO 0 in bf16/fp16: the state stays keyed by the model's parameters after the FP16
      optimizer swaps in fp32 masters: the optimizer never finds it and ``save_checkpoint``
      raises ``KeyError``. It is moved to the masters (:func:`move_state_to_masters`).
    - ZeRO-3 rebuilds Adagrad over its flat partitions but leaves them in the param groups,
      which it otherwise keeps empty between steps (it fills them only to save or load):
      a fresh engine's groups then hold twice the saved count and ``load_checkpoint``
      raises "parameter group that doesn't match the size". They are emptied."""
    move_state_to_masters(engine)
    opt = _base_optimizer(engine)
    if zero_stage(engine) == 3 and any(g["params"] for g in opt.param_groups):
        for group in opt.param_groups:
            group["params"] = []


def move_state_to_masters(engine: Engine) -> int:
    """Move state keyed by a model parameter that the optimizer no longer holds (ZeRO 0,
    bf16/fp16: it holds the fp32 masters) to that parameter's master, in fp32. Returns how
    many entries moved."""
    opt = _base_optimizer(engine)
    masters = _masters(engine)
    owned = {id(p) for group in opt.param_groups for p in group["params"]}
    moved = 0
    for key in [k for k in opt.state if id(k) not in owned and id(k) in masters]:
        master, owner, offset = masters[id(key)]
        slot = opt.state[owner]
        for name, value in opt.state.pop(key).items():
            if torch.is_tensor(value) and value.shape == key.shape:
                _put(slot, name, owner, offset, master, value)
            else:
                slot.setdefault(name, value)
        moved += 1
    return moved


def _put(slot: dict, key: str, owner: torch.Tensor, offset: int, master, value) -> None:
    """Write one parameter's part of the optimizer state ``slot[key]`` (shaped like
    ``owner``, created as zeros when the optimizer has none yet)."""
    if key not in slot:
        slot[key] = torch.zeros_like(owner)
    _slice(slot[key], owner, offset, master).copy_(value)


def _slice(state: torch.Tensor, owner: torch.Tensor, offset: int, like: torch.Tensor):
    """The part of an optimizer state tensor (shaped like ``owner``) for one parameter."""
    return state.view(-1).narrow(0, offset, like.numel()).view_as(like)


# the loss scaler's running state (fp16): DeepSpeed's ZeRO optimizers keep it in a
# ``loss_scaler``, its FP16 optimizers (ZeRO 0) in a ``loss_scale_config``; the rest
# (factor, window, minimum) comes from the config of the run that loads it
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _scaler(engine: Engine):
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    return getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None)


def _scaler_state(engine: Engine) -> dict | None:
    scaler = _scaler(engine)
    if scaler is None:
        return None
    return {k: getattr(scaler, k) for k in SCALER_FIELDS if getattr(scaler, k, None) is not None}


def _set_scaler_state(engine: Engine, state: dict | None) -> None:
    scaler = _scaler(engine)
    if scaler is None or not state:
        return
    for key, value in state.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value)


def portable_state(engine: Engine) -> dict:
    """Full fp32 parameters and every optimizer state tensor by parameter name
    (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params, keys, masters = {}, _state_keys(engine), _masters(engine)
    opt_state = _base_optimizer(engine).state
    for name, p in engine.module.named_parameters():
        if id(p) in masters:  # ZeRO 0, bf16/fp16: the fp32 master holds the value and state
            master, owner, offset = masters[id(p)]
            entry = {"param": master.detach().float().cpu()}
            for key in keys:
                value = opt_state.get(owner, {}).get(key)
                if torch.is_tensor(value) and value.numel() == owner.numel():
                    entry[key] = _slice(value, owner, offset, master).detach().float().cpu()
        elif _hp_mapped(p):
            entry = {"param": safe_get_full_fp32_param(p).cpu()}
            for key in keys:
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    entry[key] = value.cpu()
        else:  # ZeRO 0: the optimizer holds the parameter itself (or its fp32 master)
            entry = {"param": p.detach().float().cpu()}
            for key in keys:
                value = opt_state.get(p, {}).get(key)
                if value is not None:
                    entry[key] = value.detach().float().cpu()
        params[name] = entry
    sched = engine.lr_scheduler
    return {
        "params": params,
        "optimizer_step": _optimizer_step(engine),
        "scheduler": None if sched is None else sched.state_dict(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "loss_scaler": _scaler_state(engine),
    }


def _wants_step(opt) -> bool:
    """Optimizers that keep a per-parameter ``step`` (Adam family, Adagrad)."""
    return any("step" in s for s in opt.state.values()) or type(opt).__name__.startswith(
        ("Adam", "Adagrad")
    )


def load_portable(engine: Engine, path: Path, zero_loss: Callable[[], torch.Tensor] | None) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from .nonfinite import skip_update

    state = torch.load(path, weights_only=False)
    stage = zero_stage(engine)
    if any(_hp_mapped(p) for p in engine.module.parameters()):
        # ZeRO (and the bf16 optimizer) creates the optimizer state and links it to the
        # parameters in its first step: take one step on a zero gradient with learning
        # rate 0, then overwrite everything
        if zero_loss is None:
            raise ValueError("checkpoint.load needs zero_loss= to load a portable state here")
        engine.backward(zero_loss())
        skip_update(engine)
    opt = _base_optimizer(engine)
    named = dict(engine.module.named_parameters())
    missing = sorted(set(named) ^ set(state["params"]))
    if missing:
        raise ValueError(f"{path}: parameter names differ from the model's: {missing[:5]}")
    step = state.get("optimizer_step", state.get("adam_step", 0))  # older files: adam_step
    masters = _masters(engine)
    for name, p in named.items():
        entry = state["params"][name]
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=stage == 3):
            p.data.copy_(entry["param"].to(p.device, p.dtype))
        moments = {k: v for k, v in entry.items() if k != "param"}
        if id(p) in masters:  # ZeRO 0, bf16/fp16: the fp32 master is what the step updates
            master, owner, offset = masters[id(p)]
            master.data.copy_(entry["param"].to(master.device, master.dtype))
            slot = opt.state[owner]
            for key, value in moments.items():
                _put(slot, key, owner, offset, master, value)
            if _wants_step(opt):
                slot["step"] = torch.tensor(float(step))
        elif _hp_mapped(p):
            safe_set_full_fp32_param(p, entry["param"].to(p.device))
            for key, value in moments.items():
                safe_set_full_optimizer_state(p, value.to(p.device), key)
        else:
            slot = opt.state[p]
            for key, value in moments.items():
                slot[key] = value.to(p.device, p.dtype)
            if _wants_step(opt):
                slot["step"] = torch.tensor(float(step))
    for slot in opt.state.values():
        if "step" in slot:
            slot["step"] = torch.tensor(float(step)) if torch.is_tensor(slot["step"]) else step
    sched = engine.lr_scheduler
    if state["scheduler"] is not None and sched is not None:
        sched.load_state_dict(state["scheduler"])
        # the learning rate in the param groups is the scheduler's output: set it again
        if hasattr(sched, "last_batch_iteration"):  # DeepSpeed's schedulers
            sched.step(sched.last_batch_iteration)
        elif hasattr(sched, "_last_lr"):  # torch's
            for group, lr in zip(engine.optimizer.param_groups, sched._last_lr):
                group["lr"] = lr
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    _set_scaler_state(engine, state.get("loss_scaler"))
