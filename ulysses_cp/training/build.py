"""What a training run builds from its config, before the loop: the checks that need no
collective, the output folder's verdict, the model and the optimizer.

``train.py`` wires these together; each is usable on its own (and tested without a
launcher).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import HFModelConfig, ModelConfig, RunConfig
from ..core.sharding import sequence_multiple
from ..core.tiles import LOSS_TILE_BYTES, MLP_TILE_BYTES, gpu_budget_gb, is_auto
from ..core.topology import Topology, validate_degrees
from ..models.compiled import compile_layers
from ..models.decoder import Decoder
from ..modes.attention import Attention
from ..modes.ulysses import kv_replication
from . import checkpoint
from .data import data_vocab_size

__all__ = [
    "build_model",
    "check_output_dir",
    "cpu_optimizer",
    "model_counts",
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


def build_model(
    mc: ModelConfig | HFModelConfig, topo: Topology, run: RunConfig | None = None
) -> torch.nn.Module:
    """The reference decoder (``ModelConfig``) or a Hugging Face model (``HFModelConfig``),
    with the run's attention (``topo.options``). With ``run`` under ZeRO-3 a Hugging Face
    model is built partitioned, never whole on a rank (``training/loading.py``)."""
    model: torch.nn.Module
    if isinstance(mc, ModelConfig):
        model = Decoder(mc, Attention(topo))
    else:
        from . import loading

        if run is not None and loading.partitioned_build(run):
            model = loading.build_partitioned(run, topo)
        else:
            from ..models import hf

            model = hf.build_model(topo, mc)  # probed before its layers are compiled
    if mc.compile:
        compile_layers(model)
    return model


def with_memory_budget(run: RunConfig) -> tuple[RunConfig, str | None]:
    """The run with the per-rank budget that sizes ``"auto"`` tiles, and a line that says
    where it came from (None when no tile is ``"auto"``): ``model.memory_budget_gb`` as
    written; else on a GPU its free memory at start less the larger of
    2 GiB and 10% of its memory (``core.tiles.gpu_budget_gb``); else (CPU) none, and the
    line says which tiles that gives."""
    mc = run.model
    if not (is_auto(mc.tiled_mlp) or is_auto(mc.tiled_loss)):
        return run, None
    if mc.memory_budget_gb is not None:
        return run, f'"auto" tiles sized for a budget of {mc.memory_budget_gb:g} GiB per rank'
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        budget = gpu_budget_gb(free, total)
        line = (
            f'"auto" tiles sized for a budget of {budget:.1f} GiB per rank: the GPU\'s free '
            f"memory at start ({free / 2**30:.1f} GiB) less a margin; set "
            f"model.memory_budget_gb to choose it"
        )
        return replace(run, model=replace(mc, memory_budget_gb=budget)), line
    return run, (
        f'"auto" tiles without model.memory_budget_gb: loss tiles of up to '
        f"{LOSS_TILE_BYTES // 2**20} MiB of logits and MLP tiles of up to "
        f"{MLP_TILE_BYTES // 2**20} MiB (sized for a large GPU); on this CPU set "
        f'"memory_budget_gb" to the memory each rank may use for tiles sized to it'
    )


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
