"""TRL's fused LM head under sequence parallelism: the forward that TRL's preference and RL
trainers call as ``model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)``.

TRL (>= 1.16) patches a model's ``forward`` (``trl.trainer.utils.add_fused_lm_head``) so
that this call returns per-token log-probabilities (``FusedCausalLMOutput``: ``log_probs``,
``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``, ``(b, s - 1)`` each)
instead of logits. :func:`install` replaces that forward on a transformers model with one
that takes the same call on the FULL rows every SP rank of a replica holds and:

1. shards them in the run's layout (:meth:`.run.SequenceParallelRun.shard`: global
   positions, labels shifted on the full sequence, end padding to the layout's multiple);
2. runs the decoder on this rank's tokens (ulysses_cp attention);
3. computes the log-probs of this rank's tokens with the tiled head of
   :func:`ulysses_cp.models.log_probs.sequence_log_probs` (no ``(tokens, V)`` logits kept)
   and gathers them to full length on every SP rank.

The trainer's own objective then runs unchanged on the gathered ``(b, s - 1)`` tensors, the
same on every SP rank; each rank's gradient is its tokens' share times the run's
``grad_scale`` (:mod:`ulysses_cp.models.log_probs`). With ``output_router_logits=True``
(TRL asks when it adds an MoE model's load-balancing loss) the output's ``aux_loss`` is
that loss over the whole sequence, padding excluded, with the same gradient rule. A call
without ``fused_lm_head`` (the logits TRL recomputes for ``compute_metrics``) returns the
full-length logits, gathered the same way. Rows padded on the left (RL prompts) are moved
to the left edge first and their outputs moved back (:func:`_left_aligned`), so the shard
sees end padding only; padding inside a row is refused. What cannot be sharded is refused
by name on every rank."""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...models.hf import HFCausalLM
from ...models.log_probs import OUTPUTS, sequence_log_probs
from .run import SequenceParallelRun

__all__ = ["install", "plain_forward"]

IGNORE = -100
# keyword arguments a caller may pass that change nothing here (PEFT passes some as None)
_NEUTRAL = {"use_cache", "return_dict", "output_attentions", "output_hidden_states"}


def _batch(kwargs: dict[str, Any], args: tuple) -> dict[str, Any]:
    """The full rows of the call: ``input_ids`` and ``attention_mask``/``position_ids``
    when given; anything else that would change the result is refused by name."""
    if args:
        kwargs = {"input_ids": args[0], **kwargs}
        if len(args) > 1:
            raise ValueError(
                "under sequence parallelism the fused LM head takes keyword arguments only"
            )
    batch = {}
    for key in ("input_ids", "attention_mask", "position_ids"):
        if kwargs.get(key) is not None:
            batch[key] = kwargs.pop(key)
    other = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL)
    if other:
        raise ValueError(
            f"under sequence parallelism the model call shards input_ids, attention_mask "
            f"and position_ids; it was also given {other}, which it cannot shard"
        )
    if "input_ids" not in batch:
        raise ValueError("under sequence parallelism the model call needs input_ids")
    return batch


def _left_aligned(batch: dict) -> torch.Tensor | None:
    """Rows padded on the left (prompts of RL batches) moved to the left edge in place:
    ``rolled[i, t] = x[i, (t + k_i) % s]`` with ``k_i`` the row's leading padding, so the
    padding ends the row (which the shard takes: no real token sees it). The real tokens
    keep the positions they had (``arange(s)``, the causal LMs' default, or the given
    ``position_ids``). Returns ``k`` ``(b,)``, or None when no row starts with padding."""
    mask = batch.get("attention_mask")
    if mask is None:
        return None
    lead = (mask == 0).long().cumprod(dim=1).sum(dim=1)  # (b,) leading zeros
    if not bool(lead.any()):
        return None
    b, s = mask.shape
    t = torch.arange(s, device=mask.device)
    if "position_ids" not in batch:
        batch["position_ids"] = t.expand(b, s)
    idx = (t + lead[:, None]) % s  # (b, s)
    for key in ("input_ids", "attention_mask", "position_ids", "labels", "shift_labels"):
        if key in batch:
            batch[key] = batch[key].gather(1, idx.to(batch[key].device))
    # the padding that wrapped to the end keeps counting positions (not a packed document)
    pos = batch["position_ids"]
    first_pad = (s - lead)[:, None]  # (b, 1)
    last_real = pos.gather(1, (first_pad - 1).clamp(min=0))
    batch["position_ids"] = torch.where(t >= first_pad, last_real + t - first_pad + 1, pos)
    return lead


def _restored(x: torch.Tensor, lead: torch.Tensor | None, s: int) -> torch.Tensor:
    """The inverse of :func:`_left_aligned` for an output ``(b, n, ...)`` with ``n <= s``
    positions (``n = s - 1``: the next-token values): ``x[i, (t - k_i) % s]``."""
    if lead is None:
        return x
    n = x.shape[1]
    if n < s:  # the values of the row's last position (no target): zeros
        pad = x.new_zeros((x.shape[0], s - n, *x.shape[2:]))
        x = torch.cat([x, pad], dim=1)
    idx = (torch.arange(s, device=x.device) - lead[:, None].to(x.device)) % s  # (b, s)
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)[:, :n]


def _shard(run: SequenceParallelRun, batch: dict) -> tuple[dict, torch.Tensor | None, int]:
    """This rank's shard of the full rows (left padding moved to the rows' ends first):
    ``(local, lead, s)`` for :func:`_restored`."""
    s = batch["input_ids"].shape[1]
    lead = _left_aligned(batch)
    return run.shard(batch), lead, s


def _aux_loss(wrapper: HFCausalLM, local: dict) -> torch.Tensor:
    """The load-balancing loss of the call's rows over the whole sequence, from the router
    logits the wrapper kept (padding excluded, as the model's own forward excludes it
    through the attention mask)."""
    aux = wrapper.aux_loss(local["token_mask"])
    if aux is None:
        raise ValueError(
            f"output_router_logits=True, and {type(wrapper.model).__name__}'s forward adds no "
            f"load-balancing loss that ulysses_cp reads"
        )
    return aux


def _fused(
    run: SequenceParallelRun,
    wrapper: HFCausalLM,
    temperature: float,
    batch: dict,
    labels,
    shift_labels,
    num_items_in_batch,
    router_logits: bool = False,
) -> Any:
    from trl.trainer.utils import FusedCausalLMOutput

    if shift_labels is not None:  # already shifted on the full rows: (b, s) outputs
        batch["shift_labels"], mask = shift_labels, shift_labels != IGNORE
    elif labels is not None:
        batch["labels"], mask = labels, labels[:, 1:] != IGNORE
    else:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
    local, lead, s = _shard(run, batch)
    hidden = wrapper(
        local["input_ids"],
        local["position_ids"],
        local["batch"],
        return_hidden=True,
        router_logits=router_logits,
    )
    aux = _aux_loss(wrapper, local) if router_logits else None
    full = sequence_log_probs(
        hidden,
        wrapper.head,
        local["shift_labels"],
        run.topo,
        cu_seqlens=local.get("cu_seqlens"),
        temperature=temperature,
        outputs=OUTPUTS,
        tiles=wrapper.tiles.under_budget("auto"),  # the run's tile plan's budget
    )
    n = mask.shape[1]  # the end padding the shard added, and the last token (no target), cut
    out = {name: _restored(x[:, :n], lead, s).masked_fill(~mask, 0) for name, x in full.items()}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(
        loss=-out["log_probs"].sum() / count,
        log_probs=out["log_probs"],
        entropy=out["entropy"],
        log_sum_sq_probs=out["log_sum_sq_probs"],
        mean_logits=out["mean_logits"],
        is_top1=out["is_top1"],
        label_mask=mask,
        aux_loss=aux,
    )


def _logits(
    run: SequenceParallelRun, wrapper: HFCausalLM, batch: dict, router_logits: bool = False
) -> Any:
    """The full rows' logits on every SP rank (what the model's own forward returns)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    batch["labels"] = batch["input_ids"]  # sharded alongside, unused
    local, lead, s = _shard(run, batch)
    logits = wrapper(
        local["input_ids"], local["position_ids"], local["batch"], router_logits=router_logits
    )
    full = _restored(run.full_logits(logits, local), lead, s)
    aux = _aux_loss(wrapper, local) if router_logits else None
    return MoeCausalLMOutputWithPast(logits=full, aux_loss=aux)


def install(
    model: Any, run: SequenceParallelRun, wrapper: HFCausalLM, *, temperature: float = 1.0
) -> None:
    """Give the transformers ``model`` (a PEFT model's base model) the sequence-parallel
    forward of the module docstring, in place of the one it has (TRL's fused head). Call
    after the model's probe (:meth:`HFCausalLM.probe`), which runs the model's own
    forward."""

    def forward(
        self,
        *args,
        fused_lm_head=False,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        output_router_logits=None,
        **kwargs,
    ):
        batch = _batch(kwargs, args)
        router = bool(output_router_logits)  # TRL asks when it adds the MoE aux loss
        if fused_lm_head:
            return _fused(
                run, wrapper, temperature, batch, labels, shift_labels, num_items_in_batch, router
            )
        if labels is not None or shift_labels is not None:
            raise ValueError(
                "under sequence parallelism a model call with labels needs fused_lm_head=True "
                "(the trainer's loss computes its own per-token log-probs)"
            )
        return _logits(run, wrapper, batch, router)

    if not hasattr(model, "_ucp_forward_before"):
        # the forward it had (TRL's fused head: generation goes through it): plain_forward
        model._ucp_forward_before = model.__dict__.get("forward")
    model.forward = types.MethodType(forward, model)


@contextmanager
def plain_forward(model: Any) -> Iterator[None]:
    """The forward ``model`` had before :func:`install` (TRL's, which generation calls
    with a KV cache) inside the block; nothing changes on a model without ours."""
    if not hasattr(model, "_ucp_forward_before"):
        yield
        return
    ours = model.__dict__["forward"]
    before = model._ucp_forward_before
    if before is None:
        del model.forward  # the class's own
    else:
        model.forward = before
    try:
        yield
    finally:
        model.forward = ours
