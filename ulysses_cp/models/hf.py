"""Hugging Face causal LMs under sequence parallelism (``pip install .[hf]``): the home of
``register_attention``, ``shard_batch``, :class:`HFCausalLM` and :func:`build_model`.

A model trains exactly (the one-process loss and, summed over the SP ranks, gradients) or
is refused on every rank before its first step:

- attention runs through transformers' attention interface
  (:mod:`~ulysses_cp.models.hf_attention`: Ulysses, ring or hybrid attention, with the
  layer's window, softcap, sinks, Llama 4's chunks and temperature);
- the guard and the start-up probe (:mod:`~ulysses_cp.models.hf_guard`) refuse a model
  with any other token mixing that would run on a shard (convolutions, SSMs, linear
  attention), naming the layer and module;
- the logits are the model's own (:mod:`~ulysses_cp.models.hf_head`: logit scales,
  multipliers and the final softcap), in the plain and the tiled loss;
- so is the loss: an MoE router's load-balancing loss over the whole sequence, any other
  term the family's forward adds refused (:mod:`~ulysses_cp.models.hf_loss_terms`).

What the kernels cannot do is refused, never approximated: attention dropout, a padding
mask, and a forward without ``position_ids`` (RoPE would be wrong on every rank but the
first).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, get_args

import torch
import torch.nn as nn

from ..config import HFDtype, HFModelConfig
from ..core.batch import BatchPlan, shard_batch
from ..core.offload import offloaded_layers
from ..core.sharding import layout_of
from ..core.tiles import TilePlan, plan_tiles
from ..core.topology import Topology
from .hf_attention import (
    KEY,
    called,
    global_temperature,
    register_attention,
    registered_topology,
    temperature,
    transformers_module,
)
from .hf_checks import check_global_positions
from .hf_guard import ProbeResult, decoder_layers, probe
from .hf_head import HeadTransform, LMHead, head_module
from .hf_loss_terms import RouterAux, router_aux
from .hf_mixers import install_mixers
from .hf_vision import auto_class, text_config
from .lean_norm import lean_norms
from .memory import LossPlan, checkpointed_layer, lm_loss, tile_mlps

# shard_batch's home is ulysses_cp.core.batch, register_attention's models/hf_attention.py;
# they are named here too because the API has Hugging Face users import them from here
__all__ = [
    "DTYPES",
    "HFCausalLM",
    "build_model",
    "ffn_width",
    "from_config",
    "heads",
    "load_config",
    "register_attention",
    "shard_batch",
    "wrap",
]

# the names model.dtype accepts (config.HFDtype), as torch dtypes
DTYPES = {name: getattr(torch, name) for name in get_args(HFDtype)}
_transformers = transformers_module


def _base(model: nn.Module) -> nn.Module:
    """The decoder stack under the LM head (``model.model``, ``transformer``, ...)."""
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        return inner
    raise ValueError(f"{type(model).__name__}: no base model under the LM head")


class HFCausalLM(nn.Module):
    """A transformers causal LM as ulysses_cp trains it, on this rank's shard.

    ``topo`` defaults to the one given to `register_attention`. `probe` runs the guard and
    the start-up probe once, collectively on the SP group: call it before
    ``deepspeed.initialize`` (`build_model` does), else the first forward runs it.
    ``probe=False`` skips it (nothing is checked: for tests of the checks themselves)."""

    def __init__(
        self,
        model: Any,  # a transformers PreTrainedModel (its config and heads are read)
        *,
        topo: Topology | None = None,
        layout: str | None = None,
        activation_checkpointing: bool = False,
        offload_activations: bool | int = False,
        probe: bool = True,
        tiles: TilePlan | None = None,  # the run's tile plan: loss(tiled_loss="auto")'s budget
    ) -> None:
        super().__init__()
        if getattr(model.config, "_attn_implementation", None) != KEY:
            raise ValueError(
                f"the model was built with attn_implementation="
                f"{model.config._attn_implementation!r}; build it with "
                f"attn_implementation='{KEY}' after ucp.models.hf.register_attention(topo)"
            )
        topo = topo if topo is not None else registered_topology()
        self.model, self.topo, self.layout = model, topo, layout_of(topo, layout)
        self.base = _base(model)
        self.checkpointing, self.offload = activation_checkpointing, offload_activations
        self.tiles = tiles if tiles is not None else TilePlan()
        self.probed: ProbeResult | None = None
        self._probe, self._checked = probe, False
        self._transform = HeadTransform()
        # an MoE model's load-balancing loss (hf_loss_terms); any other loss term: refused
        self.router: RouterAux | None = router_aux(model)
        self._router_logits: tuple | None = None
        self._positions = False  # pass the global positions to the attention calls
        for module in model.modules():
            if temperature(module) is not None:
                module._ucp_temperature = temperature(module)
                module.forward = partial(global_temperature, module.forward, module)
                self._positions = True
        # hybrid layers' SP forwards (or a refusal); a model of mixers alone calls no attention
        self._mixers = 0 if topo is None else install_mixers(model, topo, self.base)
        if activation_checkpointing:
            layers = self.decoder_layers()
            offloaded = offloaded_layers(offload_activations, len(layers))
            for i, layer in enumerate(layers):
                layer.forward = partial(checkpointed_layer, layer.forward, i < offloaded)

    def decoder_layers(self) -> list[nn.Module]:
        return list(decoder_layers(self.model)[1])

    @property
    def needs_probe(self) -> bool:
        """True until :meth:`probe` has run (and the wrapper was built to probe)."""
        return self._probe and self.probed is None

    def probe(self) -> ProbeResult:
        """Run the guard, the start-up probe and the head check, once, on every SP rank.

        Returns:
            What the probe found: the head to train with, the modules checked.

        Raises:
            ValueError: On every rank, for a model not exact under this run's split.
        """
        if self.probed is None:
            self.probed = probe(self, self.topo)
            self._transform = self.probed.head
        return self.probed

    def extra_kwargs(self, position_ids, batch: BatchPlan | None) -> dict:
        """What the attention calls and mixers need beyond transformers' arguments."""
        kwargs: dict[str, Any] = {} if batch is None else {"ucp_batch": batch}
        return {**kwargs, "ucp_positions": position_ids} if self._positions else kwargs

    def run_base(self, input_ids, position_ids, batch: BatchPlan | None, router=False):
        """The decoder stack's final hidden states; ``router``: keep the router logits."""
        kwargs = self.extra_kwargs(position_ids, batch)
        if router:
            kwargs["output_router_logits"] = True
        out = self.base(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        self._router_logits = out.router_logits if router else None
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def aux_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last forward's load-balancing loss over the whole sequence, without the
        coefficient (None: no router logits kept); ``token_mask`` ``(b, s_l)``: 0 on padding."""
        logits, self._router_logits = self._router_logits, None
        if logits is None or self.router is None:
            return None
        return self.router.loss(logits, self.topo, token_mask)

    @property
    def head(self) -> nn.Module:
        """The LM head as the model computes it (its scale and softcap included; the probe
        finds which, so this runs it first if it has not run)."""
        if self.needs_probe:
            self.probe()
        return LMHead(head_module(self.model), self._transform)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        batch: BatchPlan | None = None,
        return_hidden: bool = False,
        router_logits: bool | None = None,
    ) -> torch.Tensor:
        """The model on this rank's shard.

        Args:
            input_ids: This rank's token ids ``(b, s_local)``.
            position_ids: Their global positions; required.
            batch: The batch's plan from ``shard_batch``, for every attention and mixer.
            return_hidden: Return the final hidden states instead of the logits.
            router_logits: Keep the router logits for :meth:`aux_loss` (None: when the
                model's own forward adds its load-balancing loss).

        Returns:
            The model's own logits ``(b, s_local, V)``, or the final hidden states.
        """
        if position_ids is None:
            raise ValueError(
                "position_ids are required under sequence parallelism: pass the GLOBAL "
                "positions of this rank's tokens (ucp.shard_batch makes them); local "
                "0..s_local-1 would give every rank but the first the wrong RoPE"
            )
        if self.needs_probe:
            self.probe()
        packed = batch is not None and batch.cu_seqlens is not None
        if not self._checked and not packed:
            check_global_positions(position_ids, self.topo, self.layout)
        called(reset=True)
        if router_logits is None:
            router_logits = self.router is not None and self.router.enabled
        hidden = self.run_base(input_ids, position_ids, batch, router_logits)
        if not self._checked:
            if not called() and not self._mixers:
                raise ValueError(
                    f"{type(self.model).__name__} ran without calling the ulysses_cp attention "
                    f"function: its attention bypasses the attention interface"
                )
            self._checked = True
        return hidden if return_hidden else self.head(hidden)

    def loss(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        topo: Topology,
        *,
        batch: BatchPlan | None = None,
        tiled_loss: int | str = 0,
        fused_loss: bool = False,
    ) -> torch.Tensor:
        """The sequence-parallel cross-entropy of this rank's shard.

        Args:
            input_ids: This rank's token ids ``(b, s_local)``.
            position_ids: Their global positions.
            labels: This rank's shifted labels (``shard_batch``'s ``shift_labels``).
            topo: The run's topology.
            batch: The batch's plan from ``shard_batch``.
            tiled_loss: LM head + loss in tiles of tokens (``"auto"``: by bytes, under the
                budget of the model's tile plan, ``self.tiles``; 0: untiled).
            fused_loss: Compute the head's and the loss's gradients in the forward.

        Returns:
            The full-sequence token-mean loss, the same on every SP rank (plus an MoE
            model's load-balancing loss times its coefficient, as its forward adds it).
        """
        loss = lm_loss(
            self,
            self.head,
            input_ids,
            position_ids,
            labels,
            topo,
            batch=batch,
            plan=LossPlan(self.tiles.under_budget(tiled_loss), fused_loss),
        )
        aux = self.aux_loss()
        return loss if aux is None else loss + self.router.coef * aux  # type: ignore[union-attr]


def load_config(spec: str | dict) -> Any:
    """A transformers config from a local ``config.json`` (or a folder holding one), or a
    dict with ``model_type`` and the fields; nothing is downloaded."""
    transformers = _transformers()
    if isinstance(spec, dict):
        fields = dict(spec)
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model.hf_config: {path} not found (a local config.json is needed)")
        fields = json.loads(path.read_text())
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("model.hf_config needs a model_type (for example 'llama', 'qwen3')")
    fields.pop("architectures", None)
    return transformers.AutoConfig.for_model(model_type, **fields)


def from_config(config: Any, *, dtype: torch.dtype = torch.float32, hf_weights=None) -> Any:
    """The model of ``config`` (its :func:`auto_class`) with ulysses_cp attention: random
    init, or the weights of the local folder ``hf_weights``. A family that picks its
    attention code itself is refused with a ``ValueError``. Call `register_attention` first."""
    _transformers()  # a clear error without transformers
    if hf_weights and not Path(hf_weights).is_dir():
        raise ValueError(f"model.hf_weights: {hf_weights} is not a local folder")
    auto = auto_class(config)
    try:
        if hf_weights:
            kwargs = dict(config=config, attn_implementation=KEY, dtype=dtype)
            model = auto.from_pretrained(hf_weights, local_files_only=True, **kwargs)
        else:
            model = auto.from_config(config, attn_implementation=KEY, dtype=dtype)
    except (KeyError, TypeError, AttributeError) as exc:  # the family picks its own attention
        raise ValueError(
            f"transformers cannot build {config.model_type!r} with attn_implementation="
            f"{KEY!r} ({type(exc).__name__}: {exc}): the family chooses its attention code "
            f"itself instead of through the attention interface, so ulysses_cp cannot run it"
        ) from exc
    return model


def ffn_width(config: Any) -> int:
    """The MLP's intermediate width of a transformers config (``intermediate_size``, else
    4 x hidden): what ``"tiled_mlp": "auto"`` and the planner size MLP tiles by."""
    config = text_config(config)
    return getattr(config, "intermediate_size", None) or 4 * config.hidden_size


def heads(config: Any) -> tuple[int, int]:
    """(query heads, kv heads) of a transformers config (:func:`load_config`'s result)."""
    config = text_config(config)
    hq = config.num_attention_heads
    return hq, getattr(config, "num_key_value_heads", None) or hq


def build_model(
    topo: Topology,
    mc: HFModelConfig,
    *,
    backend: str | None = None,
    layout: str | None = None,
    tiles: TilePlan | None = None,
) -> HFCausalLM:
    """The causal LM of a ``"model"`` block, built or loaded, wrapped and probed.

    Args:
        topo: The run's topology.
        mc: The ``"model"`` block: config, weights (a local folder), dtype, memory features.
        backend: The local kernel; None takes the run's.
        layout: None takes the run's; one that disagrees raises.
        tiles: The run's tile plan (None: ``core.tiles.plan_tiles(mc)``).

    Returns:
        The model, probed (a collective over the SP group).

    Raises:
        ValueError: A model the guard or the probe refuses, on every rank.
    """
    _transformers()  # a clear error without transformers
    register_attention(topo, backend=backend, layout=layout)
    config = load_config(mc.hf_config)
    model = from_config(config, dtype=DTYPES[mc.dtype], hf_weights=mc.hf_weights)
    wrapped = wrap(model, topo, mc, layout=layout, tiles=tiles)
    wrapped.probe()  # before the engine: refused on every rank, or the head to train with
    return wrapped


def wrap(
    model: Any,
    topo: Topology,
    mc: HFModelConfig,
    *,
    layout: str | None = None,
    tiles: TilePlan | None = None,
    keep_names: bool = False,
) -> HFCausalLM:
    """A built transformers model as `HFCausalLM`, with the block's memory features.

    Args:
        model: A transformers causal LM built with ``attn_implementation="ulysses_cp"``.
        topo: The run's topology.
        mc: The ``"model"`` block (lean norms, checkpointing, offload).
        layout: None takes the run's.
        tiles: The run's tile plan: the tiled MLP, the loss's budget (None: the block's).
        keep_names: Tiled MLPs keep their parameters' names (``memory.tile_mlps``).
    """
    tiles = tiles if tiles is not None else plan_tiles(mc)
    # "auto": tiles sized from the MLP's intermediate width and the budget (core/tiles.py)
    tile_mlps(model, tiles.mlp, width=ffn_width(model.config), keep_names=keep_names)
    if mc.lean_norms:
        lean_norms(model)
    return HFCausalLM(
        model,
        topo=topo,
        layout=layout,
        activation_checkpointing=mc.activation_checkpointing,
        offload_activations=mc.offload_activations,
        tiles=tiles,
    )
