"""The one recipe from a ``"model"`` block to a wrapped model, for every way in.

Two entries, one set of steps:

- :func:`build`: train.py (and anything that builds from a config). The reference decoder
  with the run's attention, or a Hugging Face model built whole (or loaded from
  ``hf_weights``) and probed, or, where the caller hands a ``partitioned`` loader (ZeRO-3:
  ``training.loading.build_partitioned``), built partitioned and probed by the engine;
  then each layer compiled when the block says ``"compile": true``.
- :func:`build_on_meta`: the ``partitioned`` loader of FSDP2 (``"engine": "fsdp2"``): a
  Hugging Face model with ``hf_weights`` built on the meta device, so no rank holds a whole
  copy; the engine shards it, fills each rank's rows from the safetensors and probes it.
- :func:`adopt`: the Hugging Face ``Trainer`` subclasses, handed a model the user built.
  The run's attention is registered and switched on in that model, and the same memory
  features as :func:`build` gives (``models.hf.wrap``: tiled MLP, lean norms, activation
  checkpointing and offload) are applied from the ``"model"`` block of the DeepSpeed JSON,
  with the tiled MLPs keeping their parameters' names, so the Trainer's saved folder (or
  PEFT adapter) is the plain model's. The probe runs at the first step
  (``HFCausalLM.probe``).

Both read the run's tiles from one :class:`~ulysses_cp.core.tiles.TilePlan`, resolved
once by the caller (``core.tiles.plan_tiles``), never the block's budget.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..config import HFModelConfig, ModelConfig
from ..core.tiles import TilePlan
from ..core.topology import Topology
from ..modes.attention import Attention
from . import hf
from .compiled import compile_layers
from .decoder import Decoder
from .hf_attention import KEY

__all__ = ["adopt", "build", "build_on_meta"]


def build(
    mc: ModelConfig | HFModelConfig,
    topo: Topology,
    *,
    tiles: TilePlan,
    partitioned: Callable[[], nn.Module] | None = None,
    backend: str | None = None,
) -> nn.Module:
    """The model of a ``"model"`` block with the run's attention (``topo.options``) and
    memory features, ``tiles`` the run's tile plan. ``partitioned``: for a Hugging Face
    model, a loader that builds it without a whole copy on any rank (ZeRO-3; not probed:
    the engine probes it after ``deepspeed.initialize``). ``backend``: the local kernel
    (None: the run's)."""
    model: nn.Module
    if isinstance(mc, ModelConfig):
        model = Decoder(mc, Attention(topo), tiles=tiles)
    elif partitioned is not None:
        model = partitioned()
    else:
        model = hf.build_model(topo, mc, backend=backend, tiles=tiles)  # probed
    if mc.compile:
        compile_layers(model)  # after the probe, which runs the layers eagerly
    return model


def build_on_meta(mc: HFModelConfig, topo: Topology, *, tiles: TilePlan) -> hf.HFCausalLM:
    """The Hugging Face model of ``mc`` (with ``hf_weights``, a local folder) built on the
    meta device and wrapped with the run's attention and memory features, parameter names
    kept (the safetensors' names): not probed, no storage yet."""
    import torch

    if not mc.hf_weights or not Path(mc.hf_weights).is_dir():
        raise ValueError(f"model.hf_weights: {mc.hf_weights!r} is not a local folder")
    hf.register_attention(topo)
    config = hf.load_config(mc.hf_config)
    with torch.device("meta"):
        model = hf.from_config(config, dtype=hf.DTYPES[mc.dtype])
    return hf.wrap(model, topo, mc, tiles=tiles, keep_names=True)


def adopt(
    model: Any, topo: Topology, block: HFModelConfig | None, *, tiles: TilePlan
) -> hf.HFCausalLM:
    """A transformers model built elsewhere (the ``Trainer``'s) switched to ulysses_cp
    attention on ``topo`` and wrapped with ``block``'s memory features (None: attention
    only, e.g. a frozen reference model), ``tiles`` the run's tile plan; not probed yet."""
    hf.register_attention(topo)
    model.set_attn_implementation(KEY)
    if model.config._attn_implementation != KEY:
        # a family that cannot switch (its attention bypasses the interface, as Bloom's):
        # named anyway, so that the probe gives the Hugging Face path's refusal
        model.config._attn_implementation = KEY
    if block is None:
        return hf.HFCausalLM(model, topo=topo, tiles=tiles)
    return hf.wrap(model, topo, block, tiles=tiles, keep_names=True)  # saved as it came
