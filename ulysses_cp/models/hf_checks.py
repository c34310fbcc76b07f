"""What the probe checks on the whole sequence beyond the module walk: the model with
ulysses_cp attention against its own eager attention and its own positions, the head it
computes, windows it masks outside the attention call, and Llama 4's temperature
(:mod:`~ulysses_cp.models.hf_guard`'s steps 3 and 4). Each returns findings: sentences
naming what is wrong, for the refusal."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .hf_head import HeadTransform, LMHead, candidates
from .hf_split import tolerance

__all__ = [
    "check_global_positions",
    "eager_logits",
    "failed",
    "head_transform",
    "masked_window",
    "own_positions",
    "same_as_eager",
    "temperature_findings",
]


def check_global_positions(position_ids: torch.Tensor, topo: Any, layout: str) -> None:
    """Local positions 0..s_local-1 are right only on SP rank 0 of the contiguous layout
    (``HFCausalLM``'s first forward checks); the verdict is all-reduced over the SP group
    so every rank raises (or none does)."""
    if topo is None or topo.sp_world_size == 1:
        return
    s_l = position_ids.shape[-1]
    local = bool((position_ids == torch.arange(s_l, device=position_ids.device)).all())
    right = layout == "contiguous" and topo.sp_rank == 0
    flag = torch.tensor([float(local and not right)], device=position_ids.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.sp_group)
    if flag.item():
        raise ValueError(
            "position_ids look local (0..s_local-1) on some sequence-parallel rank: "
            "RoPE needs the GLOBAL positions of each rank's tokens; build the shards "
            "with ucp.shard_batch"
        )


def temperature_findings(model: nn.Module) -> list[str]:
    """Position-dependent query scaling the short probe cannot see (Llama 4's starts at
    ``floor_scale`` tokens): handled only where the package applies it itself."""
    out = []
    for name, m in model.named_modules():
        tuned = getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", 1)
        if tuned and getattr(m, "_ucp_temperature", None) is None:
            out.append(
                f"{name} ({type(m).__name__}) scales queries by position (attention "
                f"temperature tuning) from its local arange; build the model through "
                f"ucp.models.hf.HFCausalLM, which applies it from the global positions"
            )
    return out


def failed(exc: Exception) -> str:
    text = " ".join(str(exc).split())[:300]
    return (
        f"it fails to run with ulysses_cp attention on the whole sequence ({type(exc).__name__}: "
        f"{text}): it expects an attention mask or an implementation of its own"
    )


def masked_window(base: nn.Module, record: list) -> list[str]:
    """A window the family applies through its mask (``create_sliding_window_causal_mask``
    in its forward, no layer types) that the attention calls do not carry: a window wider
    than the probe's sequence would not show in its logits."""
    config = getattr(base, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "layer_types", None):
        return []
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return []
    bare = [m for m, options in record if "window" not in options]
    if "create_sliding_window_causal_mask" not in source or not bare:
        return []
    return [
        f"its forward masks a sliding window of {window} tokens, which {type(bare[0]).__name__} "
        f"does not pass to the attention call: set config.sliding_window = None to train with "
        f"full attention, or use a family that passes its window (Mistral, Phi-3, Gemma 2/3)"
    ]


def eager_logits(model: Any, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
    """The logits with transformers' eager attention and its own masks (None where the model
    cannot switch its attention implementation)."""
    key = model.config._attn_implementation
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    kept = [
        (c, c._attn_implementation) for c in configs.values() if hasattr(c, "_attn_implementation")
    ]
    try:
        model.set_attn_implementation("eager")
        if model.config._attn_implementation != "eager":
            return None
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits
    except Exception:
        return None
    finally:
        model.set_attn_implementation(key)
        for config, implementation in kept:  # a VLM's vision tower keeps its own
            config._attn_implementation = implementation


def same_as_eager(logits: torch.Tensor, eager: torch.Tensor | None) -> list[str]:
    """Our attention on the whole sequence must give transformers' eager logits: a mask the
    family builds that the attention call does not carry (a window, chunks, a dynamic
    pattern) shows here."""
    if eager is None:
        return []
    err = float((logits.double() - eager.double()).abs().max())
    scale = float(eager.double().abs().max().clamp_min(1e-30))
    if err <= max(tolerance(logits.dtype), 1e-6) * scale:
        return []
    return [
        f"with ulysses_cp attention its logits differ from its own eager attention by "
        f"{err / scale:.2g} (relative) on the whole sequence: its layers attend with a mask "
        f"the attention call does not carry"
    ]


def own_positions(logits: torch.Tensor, natural: torch.Tensor) -> list[str]:
    """The model run without ``position_ids`` must number its tokens 0..n-1, as the global
    positions ulysses_cp passes do (RoBERTa-style models count from ``padding_idx + 1``)."""
    err = float((logits.double() - natural.double()).abs().max())
    if err <= tolerance(logits.dtype) * float(natural.double().abs().max().clamp_min(1e-30)):
        return []
    return [
        "without position_ids its forward numbers the tokens otherwise than 0..n-1 (for "
        "example from padding_idx + 1, RoBERTa-style), while ulysses_cp passes each token's "
        "global position: its logits differ by "
        f"{err:.2g}"
    ]


def head_transform(model, linear, hidden, logits, findings: list[str]) -> HeadTransform:
    tol = tolerance(logits.dtype)
    want = logits.double()
    scale = want.abs().max().clamp_min(1e-30)
    for cand in candidates(model):
        try:
            got = LMHead(linear, cand)(hidden).double()
        except Exception:  # the head module does not map hidden states to logits alone
            break
        if got.shape == want.shape and float((got - want).abs().max() / scale) <= tol:
            return cand
    findings.append(
        f"its logits are not lm_head(hidden states) up to a scale or softcap of its config "
        f"(tried: {', '.join(c.source for c in candidates(model))}); the family "
        f"post-processes its logits in a way ulysses_cp does not know"
    )
    return HeadTransform()
