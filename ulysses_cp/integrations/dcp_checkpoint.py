"""Sharded checkpoints of an FSDP2 model and its optimizer, with ``torch.distributed.checkpoint``.

Every rank writes its own shards into one folder (DCP's ``.metadata`` plus one
``__{rank}_0.distcp`` file per rank) and reads back only the pieces its shards need, so
the state is never gathered whole. The model and optimizer states come from
``torch.distributed.checkpoint.state_dict.get_state_dict``: keyed by each parameter's
name (the optimizer's too), not by a rank's layout. A checkpoint written on 4 ranks thus
loads on 2, or on 4 over another mesh: DCP reshards while reading.

The scheduler's state and the caller's ``extra`` (``{"step": n}``) travel as one small
pickled entry, written once by the coordinator rank and read by every rank. Atomic
publication (a temporary folder, then a rename and the ``latest`` file) is the caller's:
these functions write and read the folder they are given.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

__all__ = ["is_sharded_checkpoint", "load_sharded", "save_sharded"]

METADATA = ".metadata"  # DCP's index of a checkpoint, written last by the coordinator
TRAIN_STATE = "train_state"  # the scheduler's state and the caller's extra, pickled
MODEL, OPTIMIZER = "model", "optimizer"  # the top-level entries (DCP joins names by dots)


def is_sharded_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds a DCP checkpoint (its ``.metadata`` file)."""
    return (Path(folder) / METADATA).is_file()


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """The model's and optimizer's states keyed by parameter name, DTensors as they are
    sharded. A fresh optimizer gets its state created first (``get_state_dict`` steps it
    once with zero gradients and learning rate), so a load has shards to read into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {MODEL: get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL: model_sd, OPTIMIZER: optim_sd}


def _packed(value: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    folder: Path,
    *,
    scheduler: Any = None,
    extra: dict | None = None,
) -> None:
    """Write ``model``'s and ``optimizer``'s shards (and ``scheduler.state_dict()`` and
    ``extra``) into ``folder``. Every rank calls it, with the same folder (a shared file
    system across nodes). ``optimizer`` None: the model alone."""
    import torch.distributed.checkpoint as dcp

    state = _states(model, optimizer)
    sched = scheduler.state_dict() if scheduler is not None else None
    state[TRAIN_STATE] = _packed({"scheduler": sched, "extra": dict(extra or {})})
    dcp.save(state, checkpoint_id=Path(folder))


def _expected_keys(state: dict) -> list[str]:
    """The keys DCP stores for ``state``'s tensors (its flattening: names joined by
    dots), less the optimizer's param_groups (plain values, read by DCP's own rules)."""
    keys = [f"{MODEL}.{k}" for k in state[MODEL]]
    for fqn, entries in state.get(OPTIMIZER, {}).get("state", {}).items():
        keys += [f"{OPTIMIZER}.state.{fqn}.{k}" for k in entries]
    return [*keys, TRAIN_STATE]


def load_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    folder: Path,
    *,
    scheduler: Any = None,
) -> dict:
    """Load a checkpoint of :func:`save_sharded` into ``model`` and ``optimizer``, already
    ``fully_shard``ed on any mesh (another world size or layout than the save's: DCP
    reshards). Every rank calls it. Restores ``scheduler`` when given. Returns the
    ``extra`` dict that was saved.

    Raises:
        ValueError: ``folder`` is not a DCP checkpoint, lacks tensors the model or
            optimizer has (naming them), or holds no scheduler state when one is given.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    folder = Path(folder)
    if not is_sharded_checkpoint(folder):
        have = sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else None
        raise ValueError(
            f"{folder} is not a sharded (torch.distributed.checkpoint) checkpoint: it has "
            f"no {METADATA} file ({'no such folder' if have is None else f'it holds {have}'});"
            f" give a folder written by save_sharded (train.py's FSDP2 engine)"
        )
    state = _states(model, optimizer)
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    missing = [k for k in _expected_keys(state) if k not in stored]
    if missing:
        raise ValueError(
            f"{folder} lacks {len(missing)} entries the model or optimizer needs "
            f"({missing[:6]}): it was saved from another model, or without the optimizer "
            f"(save_sharded(model, None, ...)); load it with the model and optimizer it "
            f"was saved with"
        )
    state[TRAIN_STATE] = b""
    dcp.load(state, checkpoint_id=folder)
    train_state = torch.load(io.BytesIO(state.pop(TRAIN_STATE)), weights_only=False)
    if optimizer is None:
        set_model_state_dict(model, state[MODEL])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIMIZER]
        )
    if scheduler is not None:
        if train_state["scheduler"] is None:
            raise ValueError(
                f"{folder} holds no scheduler state (saved with scheduler=None); load it "
                f"with scheduler=None, or save with the scheduler"
            )
        scheduler.load_state_dict(train_state["scheduler"])
    return train_state["extra"]
