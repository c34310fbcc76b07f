"""Atomic checkpoints around DeepSpeed's ``save_checkpoint``/``load_checkpoint``.

A checkpoint ``DIR/stepK`` is written as ``DIR/stepK.tmp`` by every rank (DeepSpeed's
files plus one ``rng_rank{r}.pt`` per rank), and only after every rank has finished does
global rank 0 rename it to ``DIR/stepK`` (one ``os.replace``) and then replace ``DIR/latest``
through a temporary file. A crash at any point leaves ``latest`` naming a complete
checkpoint; a left-over ``*.tmp`` is ignored and removed by the next save.

The client state holds the step (the data position: every sample is a function of the step)
and each rank's RNG states (torch CPU and CUDA, Python, NumPy when installed) are saved in
its own file, so a resumed run draws the same random numbers.

Layouts. The (ulysses, ring) split and the token layout never enter a checkpoint: on the
same number of ranks and ZeRO stage DeepSpeed's own files load under any other split; on
another number of ranks or ZeRO stage ``portable.pt`` is loaded (``portable.py``). Under
``"engine": "fsdp2"`` (an engine with ``reshards``) the engine writes
``torch.distributed.checkpoint`` shards, which load on any number of ranks and any split:
no ``portable.pt``, no world-size check. ``meta.json`` names the engine; a checkpoint of
the other engine is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..core.log import get_logger
from ..core.protocols import Engine
from .portable import load_portable, portable_state, zero_stage

__all__ = [
    "LATEST",
    "SaveHook",
    "latest_meta",
    "latest_tag",
    "load",
    "save",
]

log = get_logger(__name__)
LATEST = "latest"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _engine_name(engine: Engine) -> str:
    return "fsdp2" if getattr(engine, "reshards", False) else "deepspeed"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SaveHook(Protocol):
    """What :func:`save` calls once this rank's files are written (``trainer.Hooks``)."""

    def in_save(self, step: int) -> None: ...


def save(
    engine: Engine,
    out_dir: str | Path,
    step: int,
    *,
    portable: bool = True,
    hook: SaveHook | None = None,
    meta: dict | None = None,
) -> Path:
    """Save the engine (model, optimizer, scheduler), ``step`` and RNG states atomically as
    ``out_dir/step{step}``; every rank must call it. Returns the checkpoint path.
    ``hook.in_save(step)`` (``trainer.Hooks``) runs when this rank's files are written and
    the checkpoint is not yet published (the tests crash there). ``meta``: more entries
    for ``meta.json`` (written by global rank 0: the tracker's wandb run id)."""
    out = Path(out_dir)
    tag = f"step{step}"
    tmp_tag = f"{tag}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / tmp_tag, ignore_errors=True)  # a crashed earlier attempt
    dist.barrier()
    engine.save_checkpoint(str(out), tag=tmp_tag, client_state={"step": step}, save_latest=False)
    torch.save(_rng_state(), out / tmp_tag / f"rng_rank{rank}.pt")
    kind = _engine_name(engine)
    state = portable_state(engine) if portable and kind == "deepspeed" else None  # collective
    if rank == 0:
        info = {
            **(meta or {}),
            "engine": kind,
            "world_size": dist.get_world_size(),
            "zero_stage": zero_stage(engine),
            "step": step,
        }
        (out / tmp_tag / "meta.json").write_text(json.dumps(info))
        if state is not None:
            torch.save(state, out / tmp_tag / "portable.pt")
    if hook is not None:
        hook.in_save(step)
    dist.barrier()  # every rank's files are complete
    if rank == 0:
        final = out / tag
        if final.exists():  # saving the same step again: replace it
            shutil.rmtree(final)
        os.replace(out / tmp_tag, final)
        _write_atomic(out / LATEST, tag)
    dist.barrier()
    return out / tag


def latest_tag(out_dir: str | Path) -> str | None:
    path = Path(out_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag if tag and (Path(out_dir) / tag).is_dir() else None


def latest_meta(out_dir: str | Path) -> dict:
    """The ``meta.json`` of the checkpoint ``latest`` names (``{}`` when there is none)."""
    tag = latest_tag(out_dir)
    path = Path(out_dir) / tag / "meta.json" if tag is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def load(
    engine: Engine, out_dir: str | Path, *, zero_loss: Callable[[], torch.Tensor] | None = None
) -> int | None:
    """Load the checkpoint ``latest`` names; returns its step, or None when there is none.

    Restores model, optimizer and scheduler (DeepSpeed), the step, and this rank's RNG
    states (when the checkpoint has a file for this rank, i.e. same or larger world).
    ``zero_loss()``: a differentiable loss of the model whose gradient is zero (for example
    the SP cross-entropy of one batch with every label ignored); needed to load a portable
    state under ZeRO 1-3, whose optimizer state only exists after a first step."""
    tag = latest_tag(out_dir)
    if tag is None:
        return None
    ckpt = Path(out_dir) / tag
    meta = json.loads((ckpt / "meta.json").read_text())
    now = {"world_size": dist.get_world_size(), "zero_stage": zero_stage(engine)}
    kind, written = _engine_name(engine), meta.get("engine", "deepspeed")
    if kind != written:
        raise ValueError(
            f'{ckpt} was written with "engine": "{written}"; this run\'s engine is "{kind}", '
            f"whose checkpoints differ: resume it with the engine that wrote it, or start "
            f"afresh (--overwrite, or another --output_dir)"
        )
    if kind == "fsdp2":  # torch.distributed.checkpoint reshards on load
        path, client = engine.load_checkpoint(str(out_dir), tag=tag)
        step = int(client["step"])
    elif all(meta[k] == v for k, v in now.items()):
        path, client = engine.load_checkpoint(str(out_dir), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt}")
        step = int(client["step"])
    else:
        if not (ckpt / "portable.pt").is_file():
            raise ValueError(
                f"{ckpt} was written on {meta['world_size']} ranks with ZeRO-"
                f"{meta['zero_stage']}; this run has {now['world_size']} ranks with ZeRO-"
                f"{now['zero_stage']}, so DeepSpeed's partitioned files do not fit and the "
                f"checkpoint has no portable.pt (it was saved with portable=False)"
            )
        log.info(
            f"{tag}: written on {meta['world_size']} ranks / ZeRO-{meta['zero_stage']}, "
            f"loading its portable state on {now['world_size']} ranks / ZeRO-"
            f"{now['zero_stage']}"
        )
        if zero_loss is None and now["zero_stage"] != 0:
            raise ValueError("checkpoint.load needs zero_loss= to load a portable state")
        load_portable(engine, ckpt / "portable.pt", zero_loss)
        step = int(meta["step"])
    rng = ckpt / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    else:
        log.warning(f"{rng.name} not in {tag} (the world grew): RNG states not restored")
    return step
