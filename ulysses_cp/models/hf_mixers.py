"""Hybrid models' token mixers under sequence parallelism, exact in every mode.

transformers 5 builds its hybrid layers from kernels with the signatures of the CUDA
libraries (``causal_conv1d_fn`` of causal-conv1d, ``mamba2_chunk_scan`` =
mamba_ssm's ``mamba_chunk_scan_combined``, ``torch_chunk_gated_delta_rule`` = fla's
``chunk_gated_delta_rule``), pure torch on CPU and the libraries' kernels where installed.
Each adapter here replaces one mixer's ``forward`` (its parameters and state-dict names
stay as they are) with the Ulysses treatment (:mod:`~ulysses_cp.modes.mixer`):

1. the per-token input projections on this rank's shard (all heads);
2. one all-to-all over the SP group: this rank's heads (channels) for every token, in the
   sequence's natural order (the layout undone);
3. the family's own conv and recurrent kernels (looked up in the family's modeling module,
   so a GPU gets the kernels transformers would pick) on those heads, once per document;
4. one all-to-all back; the per-token gated norm and output projection on the shard.

Families: short convolutions (LFM2, LFM2-MoE: channels split), gated delta nets
(Qwen3-Next, Qwen3.5: key heads and their value heads split), Mamba2 (Bamba,
GraniteMoeHybrid, Nemotron-H, Falcon-H1: heads split; B/C groups split with them, or sent
to every rank whose heads use them), KDA (Kimi Linear: heads split;
:mod:`~ulysses_cp.models.hf_delta`), lightning attention (MiniMax: heads split;
:mod:`~ulysses_cp.models.hf_lightning`) and Mamba1 (Mamba, FalconMamba, Jamba: channels split,
one all-reduce of ``x_proj``'s partial sums; :mod:`~ulysses_cp.models.hf_mamba`). Head
counts that do not split over the SP degree are refused with the degrees that work. Every
other mixer is refused by the guard (:mod:`~ulysses_cp.models.hf_guard`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ..core.derived import once
from ..core.topology import Topology
from ..modes.mixer import MixerExchange, split_channels
from .hf_attention import local_topology, whole
from .hf_delta import gated_delta_net, gated_delta_net_units, kda, kda_units
from .hf_lightning import lightning, lightning_units
from .hf_mamba import (
    mamba1,
    mamba1_units,
    mamba2,
    mamba2_groups,
    mamba2_units,
    zamba_mamba,
    zamba_mamba_units,
)
from .mixer_ops import causal_conv, units

__all__ = [
    "ADAPTERS",
    "install_mixers",
    "mixer_channels",
    "mixer_degrees",
    "mixer_reduced",
]


# ---------------------------------------------------------------- short convolution (LFM2)


def short_conv(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """LFM2's ShortConv: ``out_proj(C * conv(B * x))``, the conv per channel."""
    B, C, h = module.in_proj(x).chunk(3, dim=-1)  # (b, s_l, D) each
    D = h.shape[-1]
    index = split_channels([units(D, 1)], ex.P, "channels")
    mine = index[ex.topo.sp_rank].to(x.device)
    full = ex.to_channels(B * h, index)  # (b, s, D/P)
    y = ex.from_channels(causal_conv(module, module.conv, ex, full, mine, None))  # (b, s_l, D)
    return module.out_proj((C * y).contiguous())


def short_conv_units(module: Any) -> dict[str, int]:
    return {"channels": int(module.conv.weight.shape[0])}


# ---------------------------------------------------------------- bytes


def mixer_channels(module: Any, P: int) -> tuple[int, int]:
    """Channels per token that one mixer layer's two all-to-alls carry over ``P`` ranks,
    summed over the destinations: ``(to heads, back)``. Each rank sends ``(P-1)/P`` of
    ``b * s_local * channels`` elements in each, in forward and again in backward."""
    kind = ADAPTERS[type(module).__name__][0]
    if kind is short_conv:
        d = int(module.conv.weight.shape[0])
        return d, d
    if kind is gated_delta_net:
        hk, hv = module.num_k_heads, module.num_v_heads
        dk, dv = module.head_k_dim, module.head_v_dim
        return 2 * hk * dk + hv * dv + 2 * hv, hv * dv
    if kind is lightning:  # q, k, v out, values back
        w = module.num_attention_heads * module.head_dim
        return 3 * w, w
    if kind is kda:  # q, k, v, the forget gate's projection and beta out; values back
        w = module.num_heads * module.head_dim
        return 4 * w + module.num_heads, w
    if kind in (mamba1, zamba_mamba):
        return module.intermediate_size, module.intermediate_size
    H, p, N = module.num_heads, module.head_dim, module.ssm_state_size
    groups = sum(len(g) for g in mamba2_groups(module, P))  # a shared group goes to each
    return H * p + 2 * groups * N + H, H * p


def mixer_reduced(module: Any) -> int:
    """Numbers per token of the whole sequence that one mixer layer all-reduces over the SP
    group (Mamba1's ``dt_rank + 2 d_state``; 0 for the others), in float32 at least. A
    ring all-reduce sends ``2 (P-1)/P`` of them, in forward and again in backward."""
    if ADAPTERS[type(module).__name__][0] is mamba1:
        return int(module.time_step_rank + 2 * module.ssm_state_size)
    return 0


# ---------------------------------------------------------------- installing


# class name -> (forward, head counts that must split)
ADAPTERS: dict[str, tuple[Callable, Callable]] = {
    "Lfm2ShortConv": (short_conv, short_conv_units),
    "Lfm2MoeShortConv": (short_conv, short_conv_units),
    "Qwen3NextGatedDeltaNet": (gated_delta_net, gated_delta_net_units),
    "Qwen3_5GatedDeltaNet": (gated_delta_net, gated_delta_net_units),
    "Qwen3_5MoeGatedDeltaNet": (gated_delta_net, gated_delta_net_units),
    "BambaMixer": (mamba2, mamba2_units),
    "GraniteMoeHybridMambaLayer": (mamba2, mamba2_units),
    "NemotronHMamba2Mixer": (mamba2, mamba2_units),
    "FalconH1Mixer": (mamba2, mamba2_units),
    "Mamba2Mixer": (mamba2, mamba2_units),
    "Zamba2MambaMixer": (mamba2, mamba2_units),
    "MambaMixer": (mamba1, mamba1_units),
    "FalconMambaMixer": (mamba1, mamba1_units),
    "JambaMambaMixer": (mamba1, mamba1_units),
    "ZambaMambaMixer": (zamba_mamba, zamba_mamba_units),
    "KimiLinearDeltaAttention": (kda, kda_units),
    "MiniMaxLightningAttention": (lightning, lightning_units),
}


def mixer_degrees(units: dict[str, int], limit: int = 64) -> list[int]:
    """SP degrees up to ``limit`` that split every unit count (groups may also be shared:
    a degree that is a multiple of the group count works)."""
    ok = []
    for P in range(1, limit + 1):
        fine = True
        for name, n in units.items():
            if n % P and not (name == "groups" and P % n == 0):
                fine = False
        if fine:
            ok.append(P)
    return ok


def _check(module: Any, units: dict[str, int], P: int) -> None:
    if P not in mixer_degrees(units, max(P, 1)):
        counts = ", ".join(f"{n} {name}" for name, n in units.items())
        raise ValueError(
            f"{type(module).__name__} has {counts}, which {P} sequence-parallel ranks cannot "
            f"split (each rank runs the recurrence for a share of them over the whole "
            f"sequence); sequence-parallel degrees (ulysses x ring) that work: "
            f"{mixer_degrees(units)}"
        )


def _exchange(topo: Topology, s_l: int, cu: torch.Tensor | None) -> MixerExchange:
    key = ("mixer", s_l, topo.sp_world_size, topo.sp_rank, topo.layout, id(topo.sp_group))
    if cu is None:
        if key not in _PLANS:
            _PLANS[key] = MixerExchange(topo, s_l)
        return _PLANS[key]
    return once((cu,), key, partial(MixerExchange, topo, s_l, cu))


_PLANS: dict[tuple, MixerExchange] = {}


def _forward(
    adapter: Callable,
    module: Any,
    topo: Topology,
    hidden_states=None,
    cache=None,
    attention_mask=None,
    **kwargs,
):
    if cache is not None or kwargs.get("cache_params") is not None:
        raise ValueError(
            f"{type(module).__name__} under sequence parallelism trains without a cache; "
            f"call the model with use_cache=False"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"{type(module).__name__}: a padding mask cannot be honoured; pad sequences at "
            f"their end with ignored labels, or pack documents (cu_seqlens)"
        )
    assert hidden_states is not None, "the mixer's hidden states"
    if whole():  # the probe's whole-sequence reference
        topo = local_topology(topo)
    plan = None if whole() else kwargs.get("ucp_batch")
    root = getattr(module, "_ucp_root_plan", None)  # what the base model was called with
    docs = 0 if root is None or root.bounds is None else len(root.bounds) - 1
    if plan is None and not whole() and docs > 1:
        raise ValueError(
            f"{type(module).__name__}: its decoder layer calls it without the batch "
            f"(transformers' layer passes no **kwargs on), so the {docs} documents of a "
            f"packed row would run as one sequence; train this model on unpacked rows (one "
            f"document per row, padded at its end with ignored labels)"
        )
    ex = _exchange(topo, hidden_states.shape[1], None if plan is None else plan.cu_seqlens)
    return adapter(module, ex, hidden_states)


def _record_plan(mixers: list[nn.Module], base: nn.Module, args, kwargs) -> None:
    """The base model's forward pre-hook: every mixer learns the batch the model runs."""
    for m in mixers:
        object.__setattr__(m, "_ucp_root_plan", kwargs.get("ucp_batch"))


def install_mixers(model: nn.Module, topo: Topology, base: nn.Module | None = None) -> int:
    """Give every known mixer of ``model`` its sequence-parallel forward over ``topo`` (its
    head counts checked against the SP degree first). ``base``: the decoder stack the run
    calls with the batch (``ucp_batch``); a mixer whose layer does not pass the batch on
    then refuses packed rows. Returns how many."""
    n, mixers = 0, []
    for module in model.modules():
        entry = ADAPTERS.get(type(module).__name__)
        if entry is None or getattr(module, "ucp_sequence_parallel", False):
            continue
        adapter, units = entry
        _check(module, units(module), topo.sp_world_size)
        module.forward = partial(_forward, adapter, module, topo)
        object.__setattr__(module, "ucp_sequence_parallel", True)  # read by the guard
        mixers.append(module)
        n += 1
    if base is not None and mixers:
        base.register_forward_pre_hook(partial(_record_plan, mixers), with_kwargs=True)
    return n
