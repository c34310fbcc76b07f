"""What TRL's log-prob trainers (DPO, and those built the same way) change under sequence
parallelism, on top of :class:`.mixin.SequenceParallelMixin`.

Their parents compute the loss from ``model(..., labels=..., fused_lm_head=True)``
(per-token log-probs). Under the ``"sequence_parallel"`` block:

- ``compute_loss`` is the PARENT's (not the causal-LM loss of the mixin): before its
  first call, the policy and the reference model are probed (the guard of
  :mod:`ulysses_cp.models.hf_guard`, collective) and given the sequence-parallel fused
  head (:mod:`.log_prob_head`), so the parent's objective and metrics run on full-length
  per-token values that are the same on every SP rank;
- the reference model (a second model: a DeepSpeed inference engine, partitioned under
  ZeRO-3) runs the same topology; with PEFT the reference is the policy with its adapter
  off, which is the same forward;
- token counts the parent gathers over every process (``num_tokens``) count each replica
  once (every SP rank of a replica holds the same rows).
"""

from __future__ import annotations

from typing import Any

from ...core.comm import stats as comm_stats
from ...models.hf import HFCausalLM
from . import log_prob_head
from .mixin import SequenceParallelMixin
from .run import SequenceParallelRun, _transformers_model

__all__ = ["LogProbTrainerMixin"]


class LogProbTrainerMixin(SequenceParallelMixin):
    """Sequence parallelism for a TRL trainer whose loss is built on the fused LM head."""

    ref_model: Any
    _total_train_tokens: int
    _metrics: Any

    # the temperature the parent's fused head divides the logits by (GRPO: args.temperature)
    head_temperature: float = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heads_ready = False
        self._ref_wrapper: HFCausalLM | None = None
        if self.sequence_parallel is not None and getattr(self, "ref_model", None) is not None:
            self._ref_wrapper = _attach_reference(self.sequence_parallel, self.ref_model)

    def _prepare_heads(self) -> None:
        """Probe the policy and the reference (collective over the SP group) and give both
        the sequence-parallel fused head, once."""
        sp = self.sequence_parallel
        assert sp is not None and sp.wrapper is not None
        if self._heads_ready:
            return
        with comm_stats.set_aside():  # the probes' traffic is no step's
            sp.probe()
            if self._ref_wrapper is not None:
                self._ref_wrapper.probe()
        log_prob_head.install(sp.wrapper.model, sp, sp.wrapper, temperature=self.head_temperature)
        if self._ref_wrapper is not None:
            ref = self._ref_wrapper
            log_prob_head.install(ref.model, sp, ref, temperature=self.head_temperature)
        self._heads_ready = True

    def _count_tokens(self, inputs: dict[str, Any]) -> None:
        """The step's tokens for the sequence-parallel metrics (``tokens_per_s``)."""
        self._meter.count(inputs["input_ids"])

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        sp = self.sequence_parallel
        # the parent's loss: skip SequenceParallelMixin.compute_loss (a causal-LM loss)
        parent = super(SequenceParallelMixin, self).compute_loss  # type: ignore[misc]
        if sp is None:
            return parent(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        self._prepare_heads()
        if model.training:
            self._count_tokens(inputs)
        before = getattr(self, "_total_train_tokens", None)
        result = parent(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        # DPO's count was gathered over every process: each replica P times
        added = 0 if before is None else self._total_train_tokens - before
        if added:
            assert before is not None
            self._total_train_tokens = before + added // sp.topo.sp_world_size
            for mode in ("train", "eval"):
                if "num_tokens" in self._metrics[mode]:
                    self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return result


def _attach_reference(sp: SequenceParallelRun, ref_model: Any) -> HFCausalLM:
    """The reference model (a DeepSpeed engine's module, or the model itself) switched to
    ulysses_cp attention and wrapped; probed and given the fused head at the first loss."""
    model = _transformers_model(getattr(ref_model, "module", ref_model))
    return sp.wrap_model(model)
