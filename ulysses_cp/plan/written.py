"""The config as written, as the planner's :class:`~.search.Run`, read from the typed
:class:`~ulysses_cp.config.RunConfig` (never the raw dict).

:data:`SETTINGS` is the one table of where each planned setting lives: the typed attribute
:func:`base_run` reads it from and the file's block and key ``--write-config``
(``plan/write.py``) writes the chosen value back to. Three settings are not plain copies:
``head_chunks`` (checked against the heads), ``offload_optimizer`` (a device in the file,
a flag here) and ``engine`` (the ``--engine`` override, else the config's).
"""

from __future__ import annotations

from dataclasses import asdict
from operator import attrgetter

from ..config import ENGINES, ModelConfig, RunConfig
from ..modes.ulysses import resolve_head_chunks
from .search import Run

__all__ = ["SETTINGS", "base_run", "describe", "row_key"]

# Run field: (the file's block, its key there, the RunConfig attribute that holds it)
SETTINGS = {
    "ulysses": ("sequence_parallel", "ulysses_degree", "sequence_parallel.ulysses_degree"),
    "ring": ("sequence_parallel", "ring_degree", "sequence_parallel.ring_degree"),
    "layout": ("sequence_parallel", "layout", "sequence_parallel.options.layout"),
    "kv_exchange": ("sequence_parallel", "kv_exchange", "sequence_parallel.options.kv_exchange"),
    "redo_all_to_all": (
        "sequence_parallel",
        "redo_all_to_all",
        "sequence_parallel.options.redo_all_to_all",
    ),
    "activation_checkpointing": (
        "model",
        "activation_checkpointing",
        "model.activation_checkpointing",
    ),
    "offload_activations": ("model", "offload_activations", "model.offload_activations"),
    "tiled_mlp": ("model", "tiled_mlp", "model.tiled_mlp"),
    "tiled_loss": ("model", "tiled_loss", "model.tiled_loss"),
    "zero_stage": ("zero_optimization", "stage", "deepspeed.zero_stage"),
}


def base_run(run: RunConfig, engine: str | None = None) -> Run:
    """The config as written, as a :class:`Run`; ``engine`` (``--engine``) replaces the
    config's ``"engine"`` when given."""
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    sp, mc = run.sequence_parallel, run.model
    chunks = 1  # what the run asks for (0: the automatic rule, resolved per sequence length)
    if sp.ulysses_degree > 1:
        hq, hkv = (mc.n_heads, mc.n_kv_heads) if isinstance(mc, ModelConfig) else _hf_heads(mc)
        resolve_head_chunks(sp.options.head_chunks, hq, hkv, sp.ulysses_degree, sp.ring_degree > 1)
        chunks = sp.options.head_chunks
    return Run(
        **{name: attrgetter(path)(run) for name, (_, _, path) in SETTINGS.items()},
        head_chunks=chunks,
        offload_optimizer=run.deepspeed.offloads_optimizer,
        engine=engine or run.engine,
    )


def _hf_heads(mc) -> tuple[int, int]:
    from ..models import hf

    return hf.heads(hf.load_config(mc.hf_config))


def row_key(name: str) -> str:
    """A :class:`Run` field's key in the planner's rows (:func:`describe`)."""
    return {"ulysses": "ulysses_degree", "ring": "ring_degree"}.get(name, name)


def describe(run: Run) -> dict:
    """A :class:`Run` as a row of the planner's JSON (the degrees under the config's names)."""
    d = asdict(run)
    d.pop("extra")
    return {row_key(k): v for k, v in d.items()}
