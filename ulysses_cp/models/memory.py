"""Memory savers for long sequences (ALST, arXiv:2506.13996), for any model.

- :class:`TiledMLP`: the MLP runs on ``chunks`` pieces of the sequence, each under
  non-reentrant activation checkpointing, so its ``(b, s, ffn)`` intermediates exist for
  one piece at a time, in forward and in backward. The MLP is per token, so the result is
  the untiled one. When its input is a lean norm's output (:mod:`.lean_norm`), each piece
  runs the norm too, so the norm's output is never kept whole (one hidden-size tensor
  less per layer).
- :func:`tiled_cross_entropy`: the LM head and the loss run per piece of the sequence under
  checkpointing, so the full ``(b, s, vocab)`` fp32 logits never exist; the sum and the
  token count go through the sequence-parallel loss as before. When the hidden states are
  a lean final norm's output (:mod:`.lean_norm`), each piece runs that norm on its part of
  the norm's input, so the checkpoints keep the input alone (one hidden-size tensor less;
  ``fold_norm``, taken by :func:`lm_loss`).
- :func:`checkpointed`: activation checkpointing of a layer, optionally with the saved
  layer input (the checkpointed hidden state) moved to CPU until backward.

Why non-reentrant checkpointing: every piece's backward feeds the same parameters inside
ONE autograd graph, so each parameter's gradient is accumulated once per backward and
DeepSpeed's ZeRO gradient hooks fire once per parameter (with reentrant checkpointing each
piece runs its own backward and the hooks fire once per piece, which ALST had to patch
with ``ds_grad_is_ready``). The same number of pieces on every rank keeps the ZeRO-3
parameter gathers in step (the local length is the same on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.batch import BatchPlan
from ..core.tiles import TileSetting, check_tiles, is_auto, resolve_tiles
from ..core.topology import Topology
from .fused_loss import fused_cross_entropy
from .lean_norm import norm_input
from .loss import sequence_parallel_cross_entropy, sequence_parallel_loss_from_sums

__all__ = [
    "LossPlan",
    "TiledMLP",
    "checkpointed",
    "checkpointed_layer",
    "lm_loss",
    "loss_tiles",
    "tile_mlps",
    "tiled_cross_entropy",
    "vocab_size",
]


class TiledMLP(nn.Module):
    """Wrap a per-token module (``(b, s, D) -> (b, s, D)``) to run in ``chunks`` pieces of
    the sequence (dim 1). ``chunks <= 1`` runs it whole; ``"auto"`` sizes the pieces by
    bytes from the input's shape and ``width`` (the MLP's intermediate width), by
    ``core.tiles.resolve_tiles``."""

    def __init__(self, mlp: nn.Module, chunks: TileSetting, width: int | None = None) -> None:
        super().__init__()
        check_tiles(chunks, "model.tiled_mlp")
        if is_auto(chunks) and not width:
            raise ValueError('TiledMLP(chunks="auto") needs width: the MLP\'s intermediate width')
        self.mlp, self.chunks, self.width = mlp, chunks, width

    def pieces(self, x: torch.Tensor) -> int:
        """How many pieces ``x`` ``(b, s, D)`` runs in."""
        n = resolve_tiles(
            self.chunks,
            "mlp",
            tokens=x.shape[0] * x.shape[1],
            width=self.width or 0,
            element_bytes=x.element_size(),
        )
        return min(n, x.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple:
        n = self.pieces(x) if torch.is_grad_enabled() else 1
        if n <= 1:
            return self.mlp(x)
        fn: Callable[[torch.Tensor], torch.Tensor] = self.mlp
        source, norm = x, norm_input(x)
        del x
        if norm is not None:
            # the input is a lean norm's output (the decoder layer's
            # mlp(post_attention_layernorm(h))): each piece runs that norm on its part of h,
            # so the checkpoints keep h (which the norm's node keeps anyway while the output
            # lives) and the norm's output is never kept whole
            fn, source = partial(self._normed_piece, norm.module), norm.x
        outs = [checkpoint(fn, p, use_reentrant=False) for p in source.chunk(n, dim=1)]
        if not isinstance(outs[0], tuple):
            return torch.cat(outs, 1)
        return self._joined(outs)

    def _joined(self, outs: list) -> tuple:
        """An MLP that returns ``(hidden, per-token extras)`` (GPT-OSS: its router scores,
        ``(b * t, E)`` rows): hidden joined along the sequence, the extras along their rows,
        which is token order only for one row."""
        hidden = torch.cat([o[0] for o in outs], 1)
        if hidden.shape[0] != 1:
            raise ValueError(
                f"tiled_mlp: {type(self.mlp).__name__} returns per-token outputs beside its "
                f"hidden states, which pieces of a batch of {hidden.shape[0]} rows cannot "
                f"join in order: use one row per micro batch or tiled_mlp 0"
            )
        extras = [
            torch.cat(parts, 0) if parts[0] is not None else None
            for parts in zip(*(o[1:] for o in outs))
        ]
        return (hidden, *extras)

    def _normed_piece(self, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(norm(h))


class _OwnForward(nn.Module):
    """An MLP's own ``forward``, for a :class:`TiledMLP` that runs inside that MLP's
    ``forward`` (:func:`tile_mlps` with ``keep_names``); it holds no module, so the MLP's
    parameters keep their names."""

    def __init__(self, forward: Callable) -> None:
        super().__init__()
        self.own = forward

    def forward(self, *args: Any) -> Any:
        return self.own(*args)


def tile_mlps(
    model: nn.Module,
    chunks: TileSetting,
    attr: str = "mlp",
    *,
    width: int | None = None,
    keep_names: bool = False,
) -> int:
    """Wrap every submodule attribute named ``attr`` in :class:`TiledMLP` (``width``: the
    MLP's intermediate width, needed by ``"auto"``); returns how many. 0 or 1: none.
    ``keep_names``: the MLP's ``forward`` runs the tiles instead, so its parameters keep
    their names (``...mlp.gate_proj``, not ``...mlp.mlp.gate_proj``): a model saved by the
    ``Trainer`` or a PEFT adapter loads into the plain model."""
    check_tiles(chunks, "model.tiled_mlp")
    if isinstance(chunks, int) and chunks <= 1:  # checked: a count, or "auto"
        return 0
    n = 0
    for module in list(model.modules()):
        inner = getattr(module, attr, None)
        if not isinstance(inner, nn.Module) or isinstance(inner, TiledMLP):
            continue
        if keep_names and not hasattr(inner, "_ucp_tiled"):
            tiled = TiledMLP(_OwnForward(inner.forward), chunks, width)
            # a plain attribute (not a submodule: no new parameter names)
            object.__setattr__(inner, "_ucp_tiled", tiled)
            inner.forward = tiled.forward
        elif not keep_names:
            setattr(module, attr, TiledMLP(inner, chunks, width))
        n += 1
    return n


def vocab_size(head: nn.Module) -> int:
    """The output width of an LM head (an ``nn.Linear``, or a module holding one as
    ``linear``); ZeRO-3's partitioned weight keeps its full shape in ``ds_shape``."""
    inner: Any = getattr(head, "linear", head)
    if isinstance(getattr(inner, "out_features", None), int):
        return int(inner.out_features)
    weight = inner.weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def loss_tiles(setting: TileSetting, head: nn.Module, input_ids: torch.Tensor) -> int:
    """How many pieces the loss of ``input_ids`` ``(b, s_local)`` runs in (1: untiled);
    ``"auto"`` reads the vocabulary and dtype from ``head``."""
    check_tiles(setting, "model.tiled_loss")
    width = element_bytes = 0
    if is_auto(setting):
        width = vocab_size(head)
        element_bytes = next(head.parameters()).element_size()
    n = resolve_tiles(
        setting, "loss", tokens=input_ids.numel(), width=width, element_bytes=element_bytes
    )
    return min(n, input_ids.shape[-1])


def _ce_sum(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    pre: nn.Module | None = None,
):
    logits = head(hidden if pre is None else pre(hidden))
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def tiled_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    topo: Topology,
    *,
    chunks: int,
    ignore_index: int = -100,
    fold_norm: bool = False,
) -> torch.Tensor:
    """``sequence_parallel_cross_entropy(head(hidden), labels, topo)`` without the full
    logits: ``head`` (the LM head) and the loss run on ``chunks`` pieces of the sequence,
    each recomputed in backward. hidden ``(b, s_local, D)``, labels ``(b, s_local)``.

    ``fold_norm``: when ``hidden`` is a lean final norm's output (:mod:`.lean_norm`), each
    piece runs that norm again on its part of the norm's input (a per-token op: the same
    values), so the checkpoints keep the input alone, not the output as well. Only for a
    caller that holds no reference to ``hidden`` after this call (as :func:`lm_loss`):
    while ``hidden`` lives, the norm's own autograd node keeps its input too."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree in "
            f"(batch, seq)"
        )
    n = max(1, min(int(chunks), hidden.shape[1]))
    tiled = n > 1 and torch.is_grad_enabled()
    norm = norm_input(hidden) if tiled and fold_norm else None
    if norm is not None:
        del hidden
        source, pre = norm.x, norm.module
    else:
        source, pre = hidden, None
    total = None
    for h, y in zip(source.chunk(n, dim=1), labels.chunk(n, dim=1)):
        if tiled:
            part = checkpoint(_ce_sum, head, h, y, ignore_index, pre, use_reentrant=False)
        else:
            part = _ce_sum(head, h, y, ignore_index)
        total = part if total is None else total + part
    count = (labels != ignore_index).sum()
    assert total is not None, "at least one piece"
    return sequence_parallel_loss_from_sums(total, count, topo)


@dataclass(frozen=True)
class LossPlan:
    """How the LM head and the loss run: in ``tiles`` pieces (an integer, or ``"auto"``
    by bytes), and ``fused``: their gradients computed in the forward."""

    tiles: TileSetting = 0
    fused: bool = False


def lm_loss(
    forward: Callable[..., torch.Tensor],
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    topo: Topology,
    *,
    batch: BatchPlan | None = None,
    plan: LossPlan = LossPlan(),
) -> torch.Tensor:
    """SP cross-entropy of a causal LM on this rank's shard. ``forward(input_ids,
    position_ids, batch, return_hidden=...)`` is the model (or its DeepSpeed engine);
    ``batch``: the batch's plan (``ucp.shard_batch``); when ``plan.tiles`` resolves to more
    than one piece (an integer > 1, or ``"auto"`` by bytes: :func:`loss_tiles`) the model
    returns hidden states and ``head`` + loss run tiled. ``plan.fused``: the head's and the
    loss's gradients are computed in the forward, in the same pieces
    (:func:`~ulysses_cp.models.fused_loss.fused_cross_entropy`), so nothing is recomputed."""
    chunks = loss_tiles(plan.tiles, head, input_ids)
    # the hidden states are this call's alone: a lean final norm's backward is folded in
    if plan.fused:
        hidden = forward(input_ids, position_ids, batch, return_hidden=True)
        return fused_cross_entropy(hidden, head, labels, topo, chunks=chunks, fold_norm=True)
    if chunks > 1:
        hidden = forward(input_ids, position_ids, batch, return_hidden=True)
        return tiled_cross_entropy(hidden, head, labels, topo, chunks=chunks, fold_norm=True)
    return sequence_parallel_cross_entropy(forward(input_ids, position_ids, batch), labels, topo)


class _OffloadedCheckpoint(torch.autograd.Function):
    """Checkpoint whose one saved tensor, the layer input, waits on CPU until backward."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run, ctx.device = run, x.device
        pin = x.device.type == "cuda"
        ctx.x_cpu = x.detach().to("cpu", non_blocking=pin, copy=True)
        if pin:
            ctx.x_cpu = ctx.x_cpu.pin_memory()
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x_cpu.to(ctx.device).requires_grad_()
        ctx.x_cpu = None
        with torch.enable_grad():
            out = ctx.run(x)
        # the layer's parameters are used once in it, so their hooks still fire once
        torch.autograd.backward(out, grad)
        return None, x.grad


def checkpointed(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, offload: bool = False
) -> torch.Tensor:
    """``run(x)`` (a layer, other arguments bound) under activation checkpointing: only its
    input is kept, the rest is recomputed in backward. ``offload`` keeps that input on CPU
    until backward (pinned on CUDA). Layers must be deterministic (no dropout)."""
    if not torch.is_grad_enabled():
        return run(x)
    if offload:
        return _OffloadedCheckpoint.apply(run, x)
    return checkpoint(run, x, use_reentrant=False)


def checkpointed_layer(forward, offload: bool, hidden_states, *args, **kwargs):
    """A decoder layer's ``forward`` under :func:`checkpointed` (its other arguments bound;
    ``offload``: the saved input on CPU); a plain call without gradients."""
    if not torch.is_grad_enabled():
        return forward(hidden_states, *args, **kwargs)
    return checkpointed(partial(forward, *args, **kwargs), hidden_states, offload=offload)
