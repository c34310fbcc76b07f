"""Hugging Face causal LMs under sequence parallelism (``pip install .[hf]``).

``register_attention(topo)`` puts ``ucp.attention`` behind transformers' attention
interface under the key ``"ulysses_cp"``, so every attention layer of a model built with
``attn_implementation="ulysses_cp"`` runs Ulysses, ring or hybrid attention on its local
shard. transformers calls it with ``(module, query, key, value, attention_mask, scaling=,
dropout=, **kwargs)``, ``(b, h, s, d)`` tensors with RoPE applied and GQA heads not
expanded, and expects ``((b, s, h, d), None)``. A key without "flash"/"sdpa" in it skips
transformers' kernel checks, and without a registered mask function the model passes
``attention_mask=None``: causality is our kernel's.

Sliding windows (per layer, as the model's ``layer_types`` say), logit softcap (Gemma 2)
and attention sinks (``s_aux``, GPT-OSS) are honoured in every mode. What the kernels
cannot do is refused, never approximated: attention dropout, a padding mask, a final logit
softcap, and models that bypass the attention interface (ALiBi models such as Bloom and
Falcon; detected from the class and, as a safety net, by counting calls in the first
forward).

``prepare_model`` also refuses a forward without ``position_ids``: the model would number
each shard's tokens from 0 and RoPE would be wrong on every rank but the first.
"""

from __future__ import annotations

import importlib.util
import json
from functools import partial
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import HFDtype, HFModelConfig
from ..core.batch import BatchPlan, shard_batch
from ..core.sharding import layout_of
from ..core.topology import Topology
from ..modes.attention import attention
from .memory import checkpointed, lm_loss, tile_mlps

# shard_batch's one home is ulysses_cp.core.batch; it is named here too because the API
# contract (shared/API.md) has Hugging Face users import it from this module
__all__ = [
    "DTYPES",
    "KEY",
    "HFCausalLM",
    "build_model",
    "check_supported",
    "heads",
    "load_config",
    "register_attention",
    "shard_batch",
]

KEY = "ulysses_cp"
_CALLS = {"n": 0}
# the names model.dtype accepts (config.HFDtype), as torch dtypes
DTYPES = {name: getattr(torch, name) for name in get_args(HFDtype)}


def _transformers():
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "Hugging Face models need transformers: `pip install .[hf]` (transformers >= 5)"
        )
    import transformers

    return transformers


def _refuse(what: str, fix: str) -> None:
    raise ValueError(f"ulysses_cp attention cannot honour {what}; {fix}")


class _Registered:
    """The function registered under :data:`KEY`: transformers calls it with ``(module,
    query, key, value, attention_mask, scaling=, dropout=, **kwargs)``."""

    def __init__(self, topo: Topology, backend: str | None, layout: str) -> None:
        self.topo, self.backend, self.layout = topo, backend, layout

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        return _attention_forward(
            self, module, (query, key, value), attention_mask, scaling, dropout, kw
        )


def _attention_forward(run: _Registered, module, qkv, attention_mask, scaling, dropout, kwargs):
    query, key, value = qkv
    if dropout:
        _refuse(f"attention dropout {dropout}", "set config.attention_dropout = 0.0")
    if attention_mask is not None:
        _refuse(
            "an attention mask",
            "pad sequences at their end with ignored labels, or pack documents "
            "(cu_seqlens), instead of masking",
        )
    if query.dim() != 4 or query.shape[0] != key.shape[0]:
        raise ValueError(f"unexpected query shape {tuple(query.shape)} (want (b, h, s, d))")
    _CALLS["n"] += 1
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d)
    out = attention(
        q,
        k,
        v,
        run.topo,
        causal=causal,
        layout=run.layout,
        softmax_scale=scaling,
        backend=run.backend,
        batch=kwargs.get("ucp_batch"),
        **_variants(kwargs, causal),
    )
    return out, None


def _variants(kwargs: dict, causal: bool) -> dict:
    """The attention variants a layer asks for, in ``ucp.attention``'s terms: a sliding
    window of W tokens (transformers: key j visible to query i when ``i - W < j <= i``) is
    ``window=(W - 1, -1)``; ``softcap`` (Gemma 2) as is; ``s_aux`` (GPT-OSS sinks, one logit
    per query head) as ``sinks``."""
    out: dict[str, Any] = {}
    w = kwargs.get("sliding_window")
    if w is not None:
        if not isinstance(w, int) or w < 1:
            _refuse(f"sliding_window={w!r}", "set a positive integer window or None")
        if not causal:
            _refuse(
                f"sliding_window={w} in a bidirectional layer",
                "ulysses_cp takes transformers' sliding windows in causal layers",
            )
        out["window"] = (w - 1, -1)
    if kwargs.get("softcap") is not None:
        out["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        out["sinks"] = kwargs["s_aux"]
    return out


def register_attention(
    topo: Topology, backend: str | None = None, layout: str | None = None
) -> str:
    """Register ``ucp.attention`` over ``topo`` as ``attn_implementation="ulysses_cp"``
    (process-wide; registering again replaces the topology), with the run's choices
    (``topo.options``: a ``layout=`` that disagrees raises; ``backend=`` overrides the run's
    backend). Returns the key."""
    transformers = _transformers()
    fn = _Registered(topo, backend, layout_of(topo, layout))
    transformers.AttentionInterface.register(KEY, fn)
    return KEY


def check_supported(model: nn.Module) -> None:
    """Refuse models whose attention does not go through the attention interface."""
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} computes attention itself (for example ALiBi models "
            f"such as Bloom or Falcon) instead of through transformers' attention "
            f"interface, so ulysses_cp cannot replace it; models such as Llama, Mistral, "
            f"Qwen2/3, Gemma 2/3 and GPT-OSS can"
        )


class HFCausalLM(nn.Module):
    """A transformers causal LM as ulysses_cp trains it: ``forward(input_ids,
    position_ids, batch=None, return_hidden=False)`` on this rank's shard, returning
    logits, or the final hidden states for :func:`~ulysses_cp.models.memory.tiled_cross_entropy`
    with :attr:`head`. Global ``position_ids`` are required."""

    def __init__(
        self,
        model: Any,  # a transformers PreTrainedModel (its config and heads are read)
        *,
        topo: Topology | None = None,
        layout: str | None = None,
        activation_checkpointing: bool = False,
        offload_activations: bool = False,
    ) -> None:
        super().__init__()
        check_supported(model)
        if getattr(model.config, "_attn_implementation", None) != KEY:
            raise ValueError(
                f"the model was built with attn_implementation="
                f"{model.config._attn_implementation!r}; build it with "
                f"attn_implementation='{KEY}' after register_attention(topo)"
            )
        if getattr(model.config, "final_logit_softcapping", None):
            _refuse("final_logit_softcapping", "use a model without it")
        self.model, self.topo, self.layout = model, topo, layout_of(topo, layout)
        self.checkpointing, self.offload = activation_checkpointing, offload_activations
        self._checked = False
        if activation_checkpointing:
            for layer in self.decoder_layers():
                layer.forward = partial(_checkpointed_layer, layer.forward, offload_activations)

    def decoder_layers(self) -> list[nn.Module]:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.model).__name__}: no model.layers to checkpoint")
        return list(layers)

    def _check_global_positions(self, position_ids: torch.Tensor) -> None:
        """Local positions 0..s_local-1 are right only on SP rank 0 of the contiguous
        layout; the verdict is all-reduced so every rank raises (or none does)."""
        topo = self.topo
        if topo is None or topo.sp_world_size == 1:
            return
        s_l = position_ids.shape[-1]
        local = bool((position_ids == torch.arange(s_l, device=position_ids.device)).all())
        right = self.layout == "contiguous" and topo.sp_rank == 0
        flag = torch.tensor([float(local and not right)], device=position_ids.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.sp_group)
        if flag.item():
            raise ValueError(
                "position_ids look local (0..s_local-1) on some sequence-parallel rank: "
                "RoPE needs the GLOBAL positions of each rank's tokens; build the shards "
                "with ucp.shard_batch"
            )

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        batch: BatchPlan | None = None,
        return_hidden: bool = False,
    ):
        """``batch``: the batch's plan (``ucp.shard_batch``), handed to every attention."""
        if position_ids is None:
            raise ValueError(
                "position_ids are required under sequence parallelism: pass the GLOBAL "
                "positions of this rank's tokens (ucp.shard_batch makes them); local "
                "0..s_local-1 would give every rank but the first the wrong RoPE"
            )
        packed = batch is not None and batch.cu_seqlens is not None
        if not self._checked and not packed:
            self._check_global_positions(position_ids)
        before = _CALLS["n"]
        kwargs = {} if batch is None else {"ucp_batch": batch}
        out = self.model.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs
        )
        if not self._checked:
            if _CALLS["n"] == before:
                raise ValueError(
                    f"{type(self.model).__name__} ran without calling the ulysses_cp attention "
                    f"function: its attention bypasses the attention interface"
                )
            self._checked = True
        hidden = out.last_hidden_state
        return hidden if return_hidden else self.head(hidden)

    def loss(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        topo: Topology,
        *,
        batch: BatchPlan | None = None,
        tiled_loss: int = 0,
    ) -> torch.Tensor:
        """SP cross-entropy of shifted ``labels`` (tiled when ``tiled_loss > 1``)."""
        return lm_loss(
            self,
            self.head,
            input_ids,
            position_ids,
            labels,
            topo,
            batch=batch,
            tiled_loss=tiled_loss,
        )


def _checkpointed_layer(forward, offload, hidden_states, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(hidden_states, *args, **kwargs)
    return checkpointed(partial(forward, *args, **kwargs), hidden_states, offload=offload)


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


def heads(config: Any) -> tuple[int, int]:
    """(query heads, kv heads) of a transformers config (:func:`load_config`'s result)."""
    hq = config.num_attention_heads
    return hq, getattr(config, "num_key_value_heads", None) or hq


def build_model(
    topo: Topology, mc: HFModelConfig, *, backend: str | None = None, layout: str | None = None
) -> HFCausalLM:
    """Build (random init) or load (``mc.hf_weights``: a local folder) the causal LM of a
    ``"model"`` block with ulysses_cp attention and the block's dtype and memory features."""
    transformers = _transformers()
    register_attention(topo, backend=backend, layout=layout)
    config, dtype = load_config(mc.hf_config), DTYPES[mc.dtype]
    if mc.hf_weights:
        if not Path(mc.hf_weights).is_dir():
            raise ValueError(f"model.hf_weights: {mc.hf_weights} is not a local folder")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            mc.hf_weights,
            config=config,
            attn_implementation=KEY,
            dtype=dtype,
            local_files_only=True,
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=KEY, dtype=dtype
        )
    if mc.tiled_mlp > 1:
        tile_mlps(model, mc.tiled_mlp)
    return HFCausalLM(
        model,
        topo=topo,
        layout=layout,
        activation_checkpointing=mc.activation_checkpointing,
        offload_activations=mc.offload_activations,
    )
