"""``python -m ulysses_cp.plan ... --write-config OUT.json``: the config as written, with
the settings of the plan the planner chose (degrees, layout, head chunks, KV exchange,
checkpointing, offload, tiles, ZeRO stage, optimizer offload and the engine), ready for ``train.py``
and the Trainer subclasses as it is. The files the config names (``schema.PATH_FIELDS``)
are written relative to the written file's folder, as the loader reads them."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from ..config import RunConfig
from ..schema import PATH_FIELDS
from .written import SETTINGS, row_key

__all__ = ["planned_config", "relocate_paths", "write_config"]


def planned_config(run: RunConfig, chosen: dict, *, world: int) -> dict:
    """The JSON of ``run`` (the whole file, to write again) with ``chosen``'s settings (a
    row of the planner's ``candidates``) for ``world`` ranks; an explicit
    ``train_batch_size`` follows the new data-parallel degree."""
    cfg = copy.deepcopy(run.raw)  # the file as written: only set here, never read
    for name, (block, key, _) in SETTINGS.items():  # where base_run read them
        cfg.setdefault(block, {})[key] = chosen[row_key(name)]
    if chosen["ulysses_degree"] > 1:
        cfg["sequence_parallel"]["head_chunks"] = chosen["head_chunks"]
    if chosen["engine"] != run.engine:  # planned under --engine
        cfg["engine"] = chosen["engine"]
    zero = cfg.setdefault("zero_optimization", {})
    if chosen["offload_optimizer"]:
        zero.setdefault("offload_optimizer", {})["device"] = "cpu"  # its other keys kept
    else:
        zero.pop("offload_optimizer", None)
    if "train_batch_size" in cfg:
        dp = world // (chosen["ulysses_degree"] * chosen["ring_degree"])
        cfg["train_batch_size"] = run.deepspeed.micro_batch * run.deepspeed.micro_steps * dp
    return cfg


def relocate_paths(cfg: dict, folder: str | Path, source: str | Path | None = None) -> dict:
    """``cfg`` (a loaded config's ``raw``: its relative paths joined to its own folder, so
    relative to the current folder) with those paths made relative to ``folder``, where it
    will be written; absolute where no relative path leads there (another drive). Paths
    outside ``source``'s folder that were absolute stay absolute."""
    cfg = copy.deepcopy(cfg)
    home = None if source is None else Path(source).parent

    def moved(value: str) -> str:
        path = Path(value)
        if path.is_absolute() and (home is None or not path.is_relative_to(home)):
            return value  # the user's absolute path
        try:
            return os.path.relpath(path.resolve(), Path(folder).resolve())
        except ValueError:  # another drive (Windows): no relative path
            return str(path.resolve())

    for block, key in PATH_FIELDS:
        value = cfg.get(block, {}).get(key) if isinstance(cfg.get(block), dict) else None
        if isinstance(value, str) and value:
            cfg[block][key] = moved(value)
        elif isinstance(value, list):
            cfg[block][key] = [moved(v) if isinstance(v, str) and v else v for v in value]
    return cfg


def write_config(result: dict, run: RunConfig, out: str | Path) -> str:
    """Write :func:`planned_config` of ``result``'s chosen plan for ``run`` to ``out`` (its
    folder made if missing), the paths made relative to ``out``'s folder
    (:func:`relocate_paths`); the line that says what was written. ``ValueError`` when no
    plan fits (nothing is written)."""
    chosen = result["chosen"]
    if chosen is None:
        raise ValueError(
            f"--write-config {out}: no plan fits {result['hardware']['gpu_mem_gb']:g} GiB per "
            f"GPU at seq_len {result['inputs']['seq_len']}; nothing written (try a shorter "
            f"--seq-len or more --gpu-mem-gb)"
        )
    out = Path(out)
    cfg = planned_config(run, chosen, world=result["inputs"]["world"])
    cfg = relocate_paths(cfg, out.parent, run.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    return (
        f"config: {out}: the chosen plan (u{chosen['ulysses_degree']} x "
        f"r{chosen['ring_degree']}, ZeRO-{chosen['zero_stage']}), fits up to "
        f"{chosen['max_seq_len']:,} tokens; data.seq_len as written "
        f"({result['inputs']['seq_len']:,})"
    )
