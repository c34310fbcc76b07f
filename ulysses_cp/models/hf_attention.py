"""``ucp.attention`` behind transformers' attention interface.

``register_attention(topo)`` registers :func:`attention_forward` under the key
``"ulysses_cp"``, so every attention layer of a model built with
``attn_implementation="ulysses_cp"`` runs Ulysses, ring or hybrid attention on its local
shard. transformers calls it with ``(module, query, key, value, attention_mask, scaling=,
dropout=, **kwargs)``, ``(b, h, s, d)`` tensors with RoPE applied and GQA heads not
expanded, and expects ``((b, s, h, d), None)``. A key without "flash"/"sdpa" in it skips
transformers' kernel checks, and without a registered mask function the model passes
``attention_mask=None``: the mask is ours to build, from the layer's type.

What each layer type means here (``config.layer_types[module.layer_idx]``):

- ``full_attention`` (or no layer types): causal attention over the document.
- ``sliding_attention``: the window transformers passes as ``sliding_window`` (W tokens:
  key j visible to query i when ``i - W < j <= i``), our ``window=(W - 1, -1)``.
- ``chunked_attention`` (Llama 4): causal attention inside chunks of
  ``config.attention_chunk_size`` tokens counted from each document's start. The chunks
  are documents for that layer: q, k, v move to the chunks' document-wise layout
  (:class:`~ulysses_cp.core.relayout.Relayout`), attend there and move back.

Softcap (Gemma 2) and sinks (``s_aux``, GPT-OSS) pass through. Llama 4's NoPE layers
scale queries by a temperature that grows with the token's position; transformers takes
that position from ``arange(local length)``, so :class:`~ulysses_cp.models.hf.HFCausalLM`
switches transformers' scaling off for its calls and :func:`attention_forward` applies it
from the global ``position_ids`` (``ucp_positions``).

The probe (:mod:`~ulysses_cp.models.hf_guard`) runs the model once on the whole sequence
with :func:`whole_sequence` (plain local attention, same masks) and records, per call, the
module and what it asked for (:func:`recording`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from ..core.derived import once
from ..core.relayout import Relayout, chunk_bounds
from ..core.sharding import layout_of, sequence_multiple
from ..core.topology import Topology
from ..modes.attention import attention

__all__ = [
    "KEY",
    "LAYER_TYPES",
    "Registered",
    "global_temperature",
    "layer_type",
    "layer_type_name",
    "local_topology",
    "recording",
    "register_attention",
    "registered_topology",
    "temperature",
    "transformers_module",
    "whole",
    "whole_sequence",
]

KEY = "ulysses_cp"
# the attention layer types this adapter builds the mask of; Falcon-H1 and ZAYA call their
# layers (attention beside another mixer) "hybrid" (causal) and "hybrid_sliding" (windowed)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
_ALIASES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# process-wide state of the calls: how many (the first-forward check), whole-sequence mode
# (the probe's reference run), and an optional record of each call's module and options
_STATE: dict[str, Any] = {"calls": 0, "called": False, "whole": False, "record": None, "topo": None}


def transformers_module():
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "Hugging Face models need transformers: `pip install .[hf]` (transformers >= 5)"
        )
    import transformers

    return transformers


def refuse(what: str, fix: str) -> None:
    raise ValueError(f"ulysses_cp attention cannot honour {what}; {fix}")


def calls() -> int:
    """How many attention calls went through the interface so far (process-wide), not
    counting calls from ``torch.compile``d layers (see :func:`called`)."""
    return int(_STATE["calls"])


def called(reset: bool = False) -> bool:
    """Whether an attention call went through the interface since the last
    ``called(reset=True)`` (which returns the old value and clears it); compiled layers
    too (a store, which dynamo replays at every call without guarding on it)."""
    seen = bool(_STATE["called"])
    if reset:
        _STATE["called"] = False
    return seen


@contextmanager
def whole_sequence() -> Iterator[None]:
    """Inside: the interface runs plain local attention on the whole (unsharded) sequence,
    with the same masks; the probe's reference."""
    before = _STATE["whole"]
    _STATE["whole"] = True
    try:
        yield
    finally:
        _STATE["whole"] = before


def whole() -> bool:
    """Inside :func:`whole_sequence`?"""
    return bool(_STATE["whole"])


def local_topology(topo: Topology) -> Topology:
    """No sequence parallelism, the run's options (the whole-sequence reference)."""
    return Topology(rank=0, world_size=1, ulysses_degree=1, ring_degree=1, options=topo.options)


@contextmanager
def recording() -> Iterator[list[tuple[Any, dict]]]:
    """Inside: every call appends ``(module, options)`` to the yielded list."""
    before = _STATE["record"]
    record: list[tuple[Any, dict]] = []
    _STATE["record"] = record
    try:
        yield record
    finally:
        _STATE["record"] = before


def layer_type_name(name: str) -> str:
    """A config's layer type in this module's terms (Falcon-H1's "hybrid" is causal)."""
    return _ALIASES.get(str(name), str(name))


def layer_type(module) -> str | None:
    """``config.layer_types[module.layer_idx]`` where the model declares layer types."""
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or not isinstance(idx, int) or not 0 <= idx < len(types):
        return None
    return layer_type_name(types[idx])


def temperature(module) -> tuple[float, float] | None:
    """``(floor_scale, attn_scale)`` of a Llama 4 NoPE layer with temperature tuning."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    return float(module.floor_scale), float(module.attn_scale)


def _scale_queries(query: torch.Tensor, module, positions: torch.Tensor | None) -> torch.Tensor:
    """Llama 4's temperature from the GLOBAL positions: ``q * (1 + attn_scale *
    log1p(floor((pos + 1) / floor_scale)))``, computed in float32 as transformers does."""
    floor_scale, attn_scale = module._ucp_temperature
    if positions is None:
        raise ValueError(
            f"{type(module).__name__} scales queries by position (attention temperature "
            f"tuning) and needs the global position_ids: call the model through "
            f"ucp.models.hf.HFCausalLM"
        )
    pos = positions.to(query.device).float()  # (b, s)
    scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scale[:, None, :, None]).to(query.dtype)  # (b, h, s, d) * (b, 1, s, 1)


class Registered:
    """The function registered under :data:`KEY` for ``topo``: transformers calls it with
    ``(module, query, key, value, attention_mask, scaling=, dropout=, **kwargs)``; the
    batch's :class:`~ulysses_cp.core.batch.BatchPlan` comes as ``ucp_batch``."""

    def __init__(self, topo: Topology, backend: str | None, layout: str) -> None:
        self.topo, self.backend, self.layout = topo, backend, layout

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        _check_call(module, query, key, attention_mask, dropout)
        _STATE["called"] = True
        if not torch.compiler.is_compiling():  # a read: dynamo would recompile per value
            _STATE["calls"] += 1
        causal = kw.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
        kind, options = layer_type(module), _variants(kw, causal)
        _check_layer(module, kind, options, causal)
        whole = bool(_STATE["whole"])
        topo = local_topology(self.topo) if whole else self.topo
        positions = kw.get("ucp_positions")
        if getattr(module, "_ucp_temperature", None) is not None and positions is not None:
            query = _scale_queries(query, module, positions)  # transformers' own is off
        elif temperature(module) is not None and topo.sp_world_size > 1:
            _scale_queries(query, module, None)  # raises: the positions would be local
        plan = None if whole else kw.get("ucp_batch")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, h, s, d) -> (b, s, h, d)

        def run(q, k, v, cu_seqlens=None, batch=None, packing=None):
            return attention(
                q,
                k,
                v,
                topo,
                causal=causal,
                layout=self.layout,
                softmax_scale=scaling,
                backend=self.backend,
                cu_seqlens=cu_seqlens,
                batch=batch,
                packing=packing,
                **options,
            )

        if kind == "chunked_attention":
            chunk = int(module.config.attention_chunk_size)
            out = _chunked(q, k, v, topo, self.layout, plan, chunk, run)
        else:
            out = run(q, k, v, batch=plan)
        return out.contiguous(), None  # as transformers' own kernels return it


def _check_call(module, query, key, attention_mask, dropout) -> None:
    if dropout:
        refuse(f"attention dropout {dropout}", "set config.attention_dropout = 0.0")
    if attention_mask is not None:
        refuse(
            f"an attention mask (passed to {type(module).__name__})",
            "pad sequences at their end with ignored labels, or pack documents "
            "(cu_seqlens), instead of masking",
        )
    if query.dim() != 4 or query.shape[0] != key.shape[0]:
        raise ValueError(f"unexpected query shape {tuple(query.shape)} (want (b, h, s, d))")


def _check_layer(module, kind: str | None, options: dict, causal: bool) -> None:
    """Record the call (for the probe); refuse a layer type this adapter cannot mask."""
    if _STATE["record"] is not None:
        _STATE["record"].append((module, dict(options, causal=causal, layer_type=kind)))
    if kind is not None and kind not in LAYER_TYPES:
        refuse(
            f"layer type {kind!r} ({type(module).__name__})",
            f"ulysses_cp builds the masks of {list(LAYER_TYPES)}",
        )
    if kind == "sliding_attention" and "window" not in options:
        refuse(
            f"a sliding_attention layer ({type(module).__name__}) that passes no sliding_window",
            "this family masks its window outside the attention call; use full attention",
        )
    if kind == "chunked_attention" and not causal:
        refuse("a bidirectional chunked_attention layer", "chunked layers are causal")


def _variants(kwargs: dict, causal: bool) -> dict:
    """The attention variants a layer asks for, in ``ucp.attention``'s terms: a sliding
    window of W tokens (transformers: key j visible to query i when ``i - W < j <= i``) is
    ``window=(W - 1, -1)``; ``softcap`` (Gemma 2) as is; ``s_aux`` (GPT-OSS sinks, one logit
    per query head) as ``sinks``."""
    out: dict[str, Any] = {}
    w = kwargs.get("sliding_window")
    if w is not None:
        if not isinstance(w, int) or w < 1:
            refuse(f"sliding_window={w!r}", "set a positive integer window or None")
        if not causal:
            refuse(
                f"sliding_window={w} in a bidirectional layer",
                "ulysses_cp takes transformers' sliding windows in causal layers",
            )
        out["window"] = (w - 1, -1)
    if kwargs.get("softcap") is not None:
        out["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        out["sinks"] = kwargs["s_aux"]
    return out


def _chunked(q, k, v, topo: Topology, layout: str, plan, chunk: int, run) -> torch.Tensor:
    """Causal attention inside chunks of ``chunk`` tokens of every document: the chunks are
    the documents of this call. A batch of b unpacked rows is one packed row of b
    documents (each rank's shards of the rows, concatenated, are its document-wise shard
    of that row), so batches and packed rows take the same path; there the attention runs
    document-wise. A packed row sharded row-wise needs no move: its chunks are documents of
    the same row-wise layout."""
    cu = None if plan is None else plan.cu_seqlens
    P = topo.sp_world_size
    b, s = q.shape[:2]
    if cu is not None and plan.packing == "row":
        inner = once((cu,), ("row chunks", chunk, str(q.device)), partial(_row_chunks, cu, chunk))
        return run(q, k, v, cu_seqlens=inner, packing="row")
    m = sequence_multiple(P, layout)
    if chunk % m:
        raise ValueError(
            f"chunked attention with attention_chunk_size {chunk} over {P} sequence-parallel "
            f"ranks in the {layout} layout needs chunks that are multiples of {m}; use a "
            f"degree or layout whose multiple divides {chunk}"
        )
    key = (b, s, chunk, P, topo.sp_rank, layout, str(q.device))
    if cu is None:
        move, cu_inner = _chunk_plan([i * s * P for i in range(b + 1)], chunk, topo, key)
    else:
        move, cu_inner = once(
            (cu,), ("chunks", *key), partial(_chunk_plan_of, cu, chunk, topo, key)
        )
    q, k, v = (t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v))  # rows -> documents
    out = move.back(run(move(q), move(k), move(v), cu_seqlens=cu_inner, packing="document"))
    return out.reshape(b, s, *out.shape[2:])


_PLANS: dict[tuple, tuple[Relayout, torch.Tensor]] = {}


def _chunk_plan(bounds: list[int], chunk: int, topo: Topology, key: tuple):
    """The move to the chunks' layout and the chunks' ``cu_seqlens`` (kept per shape)."""
    full = (tuple(bounds), *key, id(topo.sp_group))
    if full not in _PLANS:
        if len(_PLANS) > 32:
            _PLANS.clear()
        inner = chunk_bounds(bounds, chunk)
        move = Relayout(
            bounds,
            inner,
            P=topo.sp_world_size,
            rank=topo.sp_rank,
            layout=key[5],
            group=topo.sp_group,
        )
        _PLANS[full] = (move, torch.tensor(inner, dtype=torch.int32, device=key[6]))
    return _PLANS[full]


def _row_chunks(cu: torch.Tensor, chunk: int) -> torch.Tensor:
    """The chunks of every document of a packed row, as its ``cu_seqlens``."""
    inner = chunk_bounds([int(x) for x in cu.tolist()], chunk)
    return torch.tensor(inner, dtype=torch.int32, device=cu.device)


def _chunk_plan_of(cu: torch.Tensor, chunk: int, topo: Topology, key: tuple):
    return _chunk_plan([int(x) for x in cu.tolist()], chunk, topo, key)


def register_attention(
    topo: Topology, backend: str | None = None, layout: str | None = None
) -> str:
    """Register ``attention`` over ``topo`` as ``attn_implementation="ulysses_cp"``.

    Process-wide: registering again replaces the topology. A transformers model built
    with that attention implementation then runs sequence-parallel attention with the
    run's choices.

    Args:
        topo: The run's topology.
        backend: The local kernel; None takes the run's.
        layout: None takes the run's; one that disagrees raises.

    Returns:
        The key to pass as ``attn_implementation`` (``"ulysses_cp"``).

    Raises:
        ValueError: A layout that disagrees with the run's.
    """
    transformers = transformers_module()
    transformers.AttentionInterface.register(
        KEY, Registered(topo, backend, layout_of(topo, layout))
    )
    _STATE["topo"] = topo
    return KEY


def registered_topology() -> Topology | None:
    """The topology of the last :func:`register_attention` (None before any)."""
    return _STATE["topo"]


def global_temperature(forward, module, *args, **kwargs):
    """Llama 4 NoPE attention: transformers' own temperature (from the local arange) off
    for the calls that carry the global positions; the adapter applies it from those."""
    if kwargs.get("ucp_positions") is None:
        return forward(*args, **kwargs)
    module.attn_temperature_tuning = False
    try:
        return forward(*args, **kwargs)
    finally:
        module.attn_temperature_tuning = True
