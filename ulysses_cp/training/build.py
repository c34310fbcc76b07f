"""What a training run builds from its config, before the loop: the checks that need no
collective, the output folder's verdict, the model and the optimizer.

``train.py`` wires these together; each is usable on its own (and tested without a
launcher).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import HFModelConfig, ModelConfig, RunConfig
from ..core.sharding import sequence_multiple
from ..core.tiles import TilePlan, device_memory, plan_tiles
from ..core.topology import Topology, validate_degrees
from ..models import recipe
from ..modes.ulysses import kv_replication
from . import checkpoint
from .data import data_vocab_size
from .fsdp2_settings import check_fsdp2

__all__ = [
    "build_model",
    "check_output_dir",
    "cpu_optimizer",
    "model_counts",
    "tile_plan",
    "validate",
]


def check_output_dir(out: Path, resume: str | None, overwrite: bool) -> bool:
    """Whether to resume from ``out``; refuses (before anything is built) a ``--resume``
    with nothing to resume, and a fresh start over an existing run without ``--overwrite``.
    ``resume``: None, ``"yes"`` or ``"auto"``."""
    has_checkpoint = checkpoint.latest_tag(out) is not None
    if resume == "yes" and not has_checkpoint:
        raise ValueError(
            f"--resume: no checkpoint in {out} (no {out / checkpoint.LATEST} naming a complete "
            f"one); check --output_dir, drop --resume to start at step 0, or use --resume auto "
            f"to resume only when a checkpoint exists"
        )
    if resume is None and not overwrite and (has_checkpoint or (out / "metrics.jsonl").exists()):
        raise ValueError(
            f"{out} already holds a run (metrics.jsonl or checkpoints): --resume continues it, "
            f"--overwrite starts afresh there, --output_dir DIR starts a new run elsewhere"
        )
    return resume is not None and has_checkpoint


def model_counts(mc: ModelConfig | HFModelConfig) -> tuple[int, int, int]:
    """(query heads, kv heads, vocabulary) of the model a ``"model"`` block builds; a
    Hugging Face model's from its transformers config (read, not built)."""
    if isinstance(mc, ModelConfig):
        return mc.n_heads, mc.n_kv_heads, mc.vocab_size
    from ..models import hf
    from ..models.hf_vision import text_config

    config = hf.load_config(mc.hf_config)
    return (*hf.heads(config), text_config(config).vocab_size)


def validate(run: RunConfig) -> None:
    """Everything that can be checked before any collective, identically on every rank."""
    sp, mc, dc = run.sequence_parallel, run.model, run.data
    check_fsdp2(run)  # "engine": "fsdp2": the DeepSpeed keys it cannot honour, by name
    validate_degrees(dist.get_world_size(), sp.ulysses_degree, sp.ring_degree)
    hq, hkv, vocab = model_counts(mc)
    kv_replication(hq, hkv, sp.ulysses_degree)
    need, what = data_vocab_size(dc)
    if vocab < need:
        raise ValueError(
            f"the model's vocabulary ({vocab}) is smaller than the data's ({need} {what}); "
            f"use vocab_size >= {need}"
            + ("" if isinstance(mc, ModelConfig) else " in model.hf_config")
        )
    m = sequence_multiple(sp.ulysses_degree * sp.ring_degree, sp.options.layout)
    if dc.seq_len % m:
        raise ValueError(
            f"data.seq_len {dc.seq_len} must be a multiple of {m} for "
            f"u{sp.ulysses_degree} x r{sp.ring_degree} in the {sp.options.layout!r} layout"
        )
    if mc.compile and dc.packing:
        raise ValueError(
            "model.compile is not supported with data.packing (packed rows' document plans "
            "are not traced); set one of them to false"
        )
    if dc.packing and sp.options.packing == "document" and dc.pack_multiple % m:
        raise ValueError(
            f"data.pack_multiple {dc.pack_multiple} must be a multiple of {m}: every packed "
            f"document is split over u{sp.ulysses_degree} x r{sp.ring_degree} ranks in the "
            f'{sp.options.layout!r} layout (sequence_parallel.packing "document"); or set '
            f'sequence_parallel.packing to "row", which splits only the row, and '
            f"data.pack_multiple to 1 (no padding per document)"
        )


def tile_plan(mc: ModelConfig | HFModelConfig) -> TilePlan:
    """The run's tiles and budget, resolved once (``core.tiles.plan_tiles``): the block's
    budget as written; else on a GPU its free memory at start less the larger of 2 GiB and
    10% of its memory; else (CPU) none, and ``source`` says which tiles that gives."""
    return plan_tiles(mc, gpu_memory=device_memory())


def build_model(
    mc: ModelConfig | HFModelConfig,
    topo: Topology,
    run: RunConfig | None = None,
    *,
    tiles: TilePlan | None = None,
) -> torch.nn.Module:
    """train.py's entry to the one recipe (``models.recipe.build``): the reference decoder
    (``ModelConfig``) or a Hugging Face model (``HFModelConfig``), with the run's attention
    (``topo.options``) and ``tiles`` (None: resolved from ``mc`` without a GPU's default).
    With ``run`` under ZeRO-3 a Hugging Face model is built partitioned, never whole on a
    rank (``training/loading.py``); under ``"engine": "fsdp2"`` one with ``hf_weights`` is
    built on meta (``recipe.build_on_meta``)."""
    tiles = tiles if tiles is not None else plan_tiles(mc)
    partitioned: Callable[[], torch.nn.Module] | None = None
    if run is not None and isinstance(mc, HFModelConfig):
        from . import loading

        if run.engine == "fsdp2":
            if mc.hf_weights:  # filled shard by shard and probed by the FSDP2 engine
                partitioned = partial(recipe.build_on_meta, mc, topo, tiles=tiles)
        elif loading.partitioned_build(run):
            partitioned = partial(loading.build_partitioned, run, topo, tiles=tiles)
    return recipe.build(mc, topo, tiles=tiles, partitioned=partitioned)


def cpu_optimizer(run: RunConfig, model: torch.nn.Module) -> tuple[object | None, RunConfig]:
    """``(optimizer, run)``: on CPU an Adam/AdamW block becomes ``torch.optim.AdamW``
    (DeepSpeed would JIT-compile a fused CPU Adam, minutes on 2 cores), returned with a
    config whose DeepSpeed part has no such block; otherwise ``(None, run)`` and DeepSpeed
    builds the optimizer from the block. The given config is never changed."""
    block = run.deepspeed.optimizer
    if (
        torch.cuda.is_available()
        or not block
        or block.get("type", "").lower() not in ("adam", "adamw")
    ):
        return None, run
    params = dict(block.get("params", {}))
    params.pop("torch_adam", None)
    params.pop("adam_w_mode", None)
    return torch.optim.AdamW(model.parameters(), **params), run.without_optimizer()
