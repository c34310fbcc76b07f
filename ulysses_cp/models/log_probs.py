"""Per-token log-probabilities of the labels under sequence parallelism: the primitive that
preference and RL objectives (DPO, GRPO, ...) stand on.

Legend: b batch, s full sequence, s_l = s / P this rank's tokens, T = b * s_l, D hidden,
V vocabulary, P = sp_world_size.

- :func:`token_log_probs` (local): ``log p(label)`` of every token of this rank's shard
  from the final hidden states and the LM head, ``tiles`` pieces of the tokens at a time,
  so no ``(T, V)`` logits are kept: the forward keeps one tile's logits at a time and the
  backward recomputes them tile by tile (the softmax gradient ``onehot - p``). Optional
  per-token outputs, as TRL's fused LM head names them: ``entropy`` (differentiable),
  ``log_sum_sq_probs``, ``mean_logits`` and ``is_top1`` (not differentiable).
- :func:`sequence_log_probs`: the same on the shard, gathered to full length on every SP
  rank in the run's layout, so that any objective written for one process runs unchanged
  on the gathered ``(b, s)`` tensors (they are ``s`` floats a row: no vocabulary).
- :func:`sequence_sums`: per-row sums (and token counts) over the whole sequence without
  gathering, for objectives that need only the sequence totals (DPO's chosen/rejected sums,
  their length-normalised means).
- :func:`kl_to_reference`: the per-token KL estimators to a reference policy.

The gradient rule is the one of the SP cross-entropy (``ucp.sequence_parallel_cross_entropy``
and ``ulysses_cp.models.loss.local_loss_term``): a loss that every SP rank computes
identically from the gathered (or summed) values gives each rank the gradient of its own
tokens only (its share), times the run's ``topo.grad_scale``; summed over the SP ranks by
the gradient reduction, the shares are the one-process gradient. Do not also pass such a
loss through ``replicated_loss_term``: the scale is applied here, once per path through the gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.sharding import gather_sequence
from ..core.tiles import TileSetting, resolve_tiles
from ..core.topology import Topology
from .fused_loss import _head_parts, _inside_module_call
from .head_grads import add_weight_grad, weight_grad_buffer
from .loss import local_loss_term, scale_gradient

__all__ = [
    "OUTPUTS",
    "kl_to_reference",
    "sequence_log_probs",
    "sequence_sums",
    "token_log_probs",
]

IGNORE = -100
# the per-token outputs, in the order the kernel returns them (TRL's FusedCausalLMOutput)
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _tile_slices(T: int, tiles: int) -> list[slice]:
    """``tiles`` contiguous pieces of ``T`` token rows, as ``tensor_split`` cuts them (the
    bounds computed on the host: no device sync per tile); empty pieces left out."""
    base, extra = divmod(T, tiles)
    bounds, start = [], 0
    for i in range(tiles):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            bounds.append(slice(start, stop))
        start = stop
    return bounds


def _logits(h, weight, bias, transform, work):
    """One tile's logits as the model computes them, then divided by the temperature:
    ``(z, tanh)`` with ``tanh`` the softcap's ``tanh(u / cap)`` (None without a softcap)."""
    scale, softcap, temperature = transform
    z = F.linear(h, weight, bias).to(work)  # (t, V)
    if scale != 1.0:
        z = z * scale
    t = None
    if softcap:
        t = torch.tanh(z / softcap)
        z = t * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, t


class _TokenLogProbs(torch.autograd.Function):
    """hidden ``(T, D)``, weight ``(V, D)``, bias ``(V,)`` or None, labels ``(T,)``;
    ``spec = (transform, tiles, wanted)``. Returns the five :data:`OUTPUTS` (``(T,)``
    each; None where not ``wanted``), zero on ignored labels. Saves hidden, weight, bias,
    labels and the per-token log-normaliser; the backward recomputes each tile's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, spec):
        transform, tiles, wanted = spec
        ctx.set_materialize_grads(False)
        work = _work_dtype(hidden, weight)
        T = hidden.shape[0]
        valid = labels != IGNORE
        target = torch.where(valid, labels, 0)
        out = {name: torch.zeros(T, dtype=work, device=hidden.device) for name in OUTPUTS}
        out["is_top1"] = torch.zeros(T, dtype=torch.bool, device=hidden.device)
        lse_all = torch.empty(T, dtype=work, device=hidden.device)
        with torch.no_grad():
            for sl in _tile_slices(T, tiles):
                z, _ = _logits(hidden[sl], weight, bias, transform, work)  # (t, V)
                lse = torch.logsumexp(z, dim=-1)  # (t,)
                lse_all[sl] = lse
                picked = z.gather(1, target[sl, None]).squeeze(1)
                out["log_probs"][sl] = picked - lse
                if "mean_logits" in wanted:
                    out["mean_logits"][sl] = z.mean(-1)
                if "is_top1" in wanted:
                    out["is_top1"][sl] = z.argmax(-1) == target[sl]
                if "entropy" not in wanted and "log_sum_sq_probs" not in wanted:
                    continue
                logp = z - lse[:, None]  # (t, V)
                if "entropy" in wanted:
                    out["entropy"][sl] = -(logp.exp() * logp).sum(-1)
                if "log_sum_sq_probs" in wanted:
                    out["log_sum_sq_probs"][sl] = torch.logsumexp(2 * logp, dim=-1)
        result = {n: out[n].masked_fill(~valid, 0) if n in wanted else None for n in OUTPUTS}
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all)
        ctx.spec = (transform, tiles)
        ctx.mark_non_differentiable(
            *(result[n] for n in ("log_sum_sq_probs", "mean_logits", "is_top1") if n in wanted)
        )
        return tuple(result[name] for name in OUTPUTS)

    @staticmethod
    def backward(ctx, g_logp, g_entropy, *_):
        hidden, weight, bias, labels, lse_all = ctx.saved_tensors
        transform, tiles = ctx.spec
        scale, _, temperature = transform
        work = lse_all.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        valid = (labels != IGNORE).to(work)
        target = torch.where(labels != IGNORE, labels, 0)
        slices = list(_tile_slices(hidden.shape[0], tiles))
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = weight_grad_buffer(weight, work, len(slices)) if need_w else None
        d_bias = None
        if need_b and bias is not None:
            d_bias = torch.zeros(bias.shape, dtype=work, device=bias.device)
        for sl in slices:
            h = hidden[sl]
            z, t = _logits(h, weight, bias, transform, work)  # (t, V)
            logp = z - lse_all[sl, None]
            p = logp.exp()
            g = torch.zeros_like(z)  # d(sum of g_out * out) / dz, (t, V)
            if g_logp is not None:  # d logp_y / dz = onehot(y) - p
                gl = g_logp[sl].to(work) * valid[sl]
                g -= p * gl[:, None]
                g[torch.arange(len(gl), device=g.device), target[sl]] += gl
            if g_entropy is not None:  # dH/dz = -p (log p + H)
                ge = g_entropy[sl].to(work) * valid[sl]
                H = -(p * logp).sum(-1, keepdim=True)
                g -= ge[:, None] * p * (logp + H)
            if temperature != 1.0:
                g = g / temperature
            if t is not None:
                g = g * (1 - t.square())  # d(cap tanh(u / cap))/du
            if scale != 1.0:
                g = g * scale
            g_mm = g.to(weight.dtype)  # the GEMMs in the model's dtype (head_grads)
            if d_hidden is not None:
                d_hidden[sl] = g_mm @ weight
            if need_w:
                d_weight = add_weight_grad(d_weight, g_mm, h, weight)
            if d_bias is not None:
                d_bias += g.sum(0)
        return (
            None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None,
            None,
        )


def token_log_probs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tiles: TileSetting = "auto",
    outputs: Sequence[str] = ("log_probs",),
) -> dict[str, torch.Tensor]:
    """Per-token ``log p(label)`` of this rank's tokens, from the LM head in tiles.

    No ``(tokens, V)`` logits are kept: the backward recomputes each tile. The head's
    weight is used inside the head module's call, so ZeRO-3 gathers it for the forward
    and again for the backward.

    Args:
        hidden: The final hidden states, ``(b, s_l, D)``.
        head: An ``nn.Linear``, or an ``LMHead`` around one (the family's logit scale and
            softcap are applied, then ``/ temperature``).
        labels: ``(b, s_l)``, already shifted; ``-100`` where there is no target (those
            tokens get 0 in every output).
        temperature: Divides the logits; must be > 0.
        tiles: How many pieces of the tokens; ``"auto"`` keeps each piece's float32 logits
            at most 1 GiB, ``AutoTiles(budget_bytes)`` (``core.tiles``) at most 1/16 of
            the budget when that is less.
        outputs: The names to compute: ``"log_probs"`` (required), ``"entropy"``,
            ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"``.

    Returns:
        ``{name: (b, s_l)}`` for the names asked, float32 (float64 for float64 models;
        ``is_top1`` bool). Gradients flow through ``log_probs`` and ``entropy``.

    Raises:
        ValueError: ``outputs`` without ``"log_probs"`` or with an unknown name, ``hidden``
            and ``labels`` that disagree in (batch, seq), or ``temperature <= 0``.
    """
    unknown = sorted(set(outputs) - set(OUTPUTS))
    if unknown or "log_probs" not in outputs:
        raise ValueError(
            f"outputs must include 'log_probs' and be among {list(OUTPUTS)}, got {list(outputs)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree in "
            f"(batch, seq)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    linear, transform = _head_parts(head)
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (b*s_l, D)
    flat_y = labels.reshape(-1)
    n = resolve_tiles(
        tiles,
        "loss",
        tokens=max(flat_y.numel(), 1),
        width=linear.weight.shape[0],
        element_bytes=flat_h.element_size(),
    )
    n = max(1, min(n, flat_y.numel()))
    spec = ((transform.scale, transform.softcap, float(temperature)), n, frozenset(outputs))

    def run(h):
        return _TokenLogProbs.apply(h, linear.weight, linear.bias, flat_y, spec)

    results = _inside_module_call(linear, run, flat_h)
    return {
        name: x.view(labels.shape)
        for name, x in zip(OUTPUTS, results, strict=True)
        if name in outputs
    }


def sequence_log_probs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    topo: Topology,
    *,
    cu_seqlens: torch.Tensor | None = None,
    temperature: float = 1.0,
    tiles: TileSetting = "auto",
    outputs: Sequence[str] = ("log_probs",),
) -> dict[str, torch.Tensor]:
    """`token_log_probs` of this rank's shard, gathered to the whole sequence.

    Position ``t`` holds the value for the target of token ``t`` (``shift_labels[t]``, that
    is token ``t + 1``). When every SP rank computes the same loss from the gathered
    values, each rank gets the gradient of its own tokens only, times ``topo.grad_scale``.

    Args:
        hidden: This rank's final hidden states, ``(b, s_l, D)``.
        head: The LM head, as for `token_log_probs`.
        labels: This rank's shifted labels, ``(b, s_l)``.
        topo: The run's topology.
        cu_seqlens: The packed row's document bounds the shard was made with.
        temperature: As for `token_log_probs`.
        tiles: As for `token_log_probs`.
        outputs: As for `token_log_probs`.

    Returns:
        ``{name: (b, s)}`` in natural token order, the same on every SP rank. ``s`` includes
        the end padding the shard added: slice it off.

    Raises:
        ValueError: As for `token_log_probs`.
    """
    local = token_log_probs(
        hidden, head, labels, temperature=temperature, tiles=tiles, outputs=outputs
    )
    out = {}
    for name, x in local.items():
        full = gather_sequence(x, topo, dim=1, cu_seqlens=cu_seqlens)
        out[name] = scale_gradient(full, topo.grad_scale)  # identity for values w/o grad
    return out


def sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, topo: Topology
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sums over the whole sequence, and the rows' token counts.

    ``sums / counts.clamp(min=1)`` is the length-normalised mean. The gradient is this
    rank's share times ``topo.grad_scale`` (the rule of
    `ulysses_cp.models.loss.local_loss_term`).

    Args:
        values: This rank's per-token values, ``(b, s_l)``.
        mask: Which tokens count, ``(b, s_l)``.
        topo: The run's topology.

    Returns:
        ``(sums, counts)``, each ``(b,)`` and the same on every SP rank.

    Raises:
        ValueError: ``values`` and ``mask`` differ in shape.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    sums = local_loss_term((values * mask.to(values.dtype)).sum(dim=1), topo)
    counts = local_loss_term(mask.to(values.dtype).sum(dim=1).detach(), topo)
    return sums, counts.detach()


KLKind = Literal["k1", "k2", "k3"]


def kl_to_reference(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from the sampled tokens' log-probs.

    Schulman's estimators: ``k1 = log p - log r``, ``k2 = (log p - log r)^2 / 2``,
    ``k3 = exp(log r - log p) - (log r - log p) - 1`` (GRPO's, always >= 0). Elementwise,
    so it applies to gathered and local values alike.

    Args:
        log_probs: The policy's log-probabilities; the gradient flows through them.
        ref_log_probs: The reference model's, the same shape.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        The estimate, the shape of ``log_probs``.

    Raises:
        ValueError: An unknown ``kind``.
    """
    delta = ref_log_probs - log_probs
    if kind == "k1":
        return -delta
    if kind == "k2":
        return delta.square() / 2
    if kind == "k3":
        return torch.exp(delta) - delta - 1
    raise ValueError(f"kind must be one of ['k1', 'k2', 'k3'], got {kind!r}")
