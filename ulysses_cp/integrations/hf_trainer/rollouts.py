"""What TRL's online RL trainers (``GRPOTrainer``, ``RLOOTrainer``: the same generation,
reward and collective code) change under sequence parallelism, as one mixin on top of
:class:`.log_prob_trainer.LogProbTrainerMixin`.

With a ``"sequence_parallel"`` block (in the DeepSpeed JSON, or under FSDP2 the file of
``sequence_parallel_config=``; without one the class is its parent):

- **Generation** (the model's ``generate``, or the user's ``rollout_func``, with TRL's
  tool loop) runs outside sequence parallelism: the model's original attention and
  forward are put back around it. Every SP rank runs it (ZeRO-3's gathers and FSDP2's
  per-forward all-gathers are collective; under FSDP2 ``generate`` runs with
  ``synced_gpus``, :func:`.fsdp.shard_model`), and SP rank 0's completions, metrics and
  random streams are broadcast to the other SP ranks of its replica (:mod:`.replicas`):
  no rank counts on equal random streams, and SP rank 0's streams are those of a
  one-process run (nothing here draws from them). The rewards are SP rank 0's too.
- **Scoring and the update** (old, reference and current log-probs, entropies) go through
  the sequence-parallel fused head (:mod:`.log_prob_head`): TRL's own objective then runs
  on full-length per-token values, the same on every SP rank, for every ``loss_type``.
- **Collectives over processes** (reward gathers, the advantage slice of each process, the
  token count of ``dapo``/``cispo``/``vespo``, the entropy quantile, metrics) span the dp
  replicas, one copy each (:class:`.replicas.ReplicaAccelerator`).
- **Batches**: ``generation_batch_size`` counts the replicas' rows,
  ``per_device_train_batch_size * dp * steps_per_generation`` (the parents' configs count
  every process).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...config import RunConfig, SequenceParallelConfig
from . import log_prob_head
from .log_prob_trainer import LogProbTrainerMixin
from .replicas import ReplicaAccelerator, broadcast_from_sp_root, random_state, set_random_state
from .run import sequence_parallel_block

__all__ = ["RolloutTrainerMixin"]


class RolloutTrainerMixin(LogProbTrainerMixin):
    """Sequence parallelism for a TRL trainer that generates, scores and updates as
    ``GRPOTrainer`` does (module docstring). Refused under sequence parallelism, on every
    rank, naming the option: ``use_vllm`` (not run yet: generate with the model or a
    ``rollout_func``), ``use_transformers_continuous_batching``, vision batches
    (``pixel_values``), and a generation or evaluation batch that does not split into
    whole prompt groups over the replicas. An MoE model's load-balancing loss
    (``router_aux_loss_coef``) is taken over the whole sequence and added as the parent
    adds it."""

    # the parent's module, whose gather and gather_object span the replicas in its code
    parent_module: str
    temperature: float
    _metrics: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        source = kwargs.get("sequence_parallel_config")  # FSDP2: the block in its own file
        run = RunConfig.load(source, trainer=True) if source is not None else None
        block = sequence_parallel_block(
            run if run is not None else getattr(config, "deepspeed", None)
        )
        if block is not None and config is not None:
            _check_options(config)
            _replica_batches(config, block)
        super().__init__(*args, **kwargs)
        if self.sequence_parallel is None:
            return
        self.head_temperature = self.temperature

    # ------------------------------------------------------------ collectives

    @contextmanager
    def _replica_collectives(self) -> Iterator[None]:
        """Inside the block, the parent's collectives over processes span the replicas."""
        sp = self.sequence_parallel
        if sp is None or isinstance(self.accelerator, ReplicaAccelerator):
            yield
            return
        import importlib

        parent_module: Any = importlib.import_module(self.parent_module)
        accelerator = self.accelerator
        replica = ReplicaAccelerator(accelerator, sp)
        saved = parent_module.gather, parent_module.gather_object
        self.accelerator = replica
        parent_module.gather, parent_module.gather_object = replica.gather, replica.gather_object
        try:
            yield
        finally:
            self.accelerator = accelerator
            parent_module.gather, parent_module.gather_object = saved

    # ------------------------------------------------------------ generation and rewards

    def _generate_and_score_completions(self, inputs: list) -> dict[str, Any]:
        if self.sequence_parallel is None:
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        with self._replica_collectives():
            self._prepare_heads()
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]

    def _generate(self, prompts: list) -> Any:
        sp = self.sequence_parallel
        if sp is None:
            return super()._generate(prompts)  # type: ignore[misc]
        assert sp.wrapper is not None
        mode = "train" if self.model.training else "eval"
        with self._plain_attention(), log_prob_head.plain_forward(sp.wrapper.model):
            out = super()._generate(prompts)  # type: ignore[misc]
        # what SP rank 0 generated, logged and left in the random streams, on every SP rank
        root = broadcast_from_sp_root(
            {
                "out": out,
                "metrics": dict(self._metrics[mode]),
                "tokens": self.state.num_input_tokens_seen,
                "random": random_state(),
            },
            sp.topo,
        )
        if sp.topo.sp_rank != 0:
            self._metrics[mode].clear()
            self._metrics[mode].update(root["metrics"])
            self.state.num_input_tokens_seen = root["tokens"]
            set_random_state(root["random"])
        return root["out"]

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards = super()._calculate_rewards(*args, **kwargs)  # type: ignore[misc]
        sp = self.sequence_parallel
        return rewards if sp is None else broadcast_from_sp_root(rewards, sp.topo)

    # ------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        with self._replica_collectives():
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    def _count_tokens(self, inputs: dict[str, Any]) -> None:
        self._meter.count(inputs["prompt_ids"])
        self._meter.count(inputs["completion_ids"])


def _check_options(args: Any) -> None:
    for name, hint in (
        ("use_vllm", "generate with the model (use_vllm=False) or a rollout_func"),
        ("use_transformers_continuous_batching", "set it to False"),
    ):
        if getattr(args, name, False):
            raise ValueError(f"{name}=True is not supported under sequence parallelism yet: {hint}")


def _replica_batches(args: Any, block: dict) -> None:
    """GRPOConfig (RLOOConfig) sized the generation batch over every process; under sequence
    parallelism the SP ranks of a replica share its rows, so it counts the replicas."""
    config = SequenceParallelConfig.from_dict(block)
    sp = config.ulysses_degree * config.ring_degree
    world = args.world_size
    if world % sp:
        return  # the topology refuses it, naming the numbers
    dp = world // sp
    rows = args.per_device_train_batch_size * dp * args.steps_per_generation
    if rows % args.num_generations:
        raise ValueError(
            f"under sequence parallelism a generation batch is per_device_train_batch_size "
            f"({args.per_device_train_batch_size}) x dp replicas ({dp}) x steps_per_generation "
            f"({args.steps_per_generation}) = {rows} completions, which does not split into "
            f"groups of num_generations={args.num_generations}: change one of them"
        )
    args.generation_batch_size = rows
    evals = args.per_device_eval_batch_size * dp
    n_eval = args.num_generations_eval or args.num_generations
    if args.eval_strategy != "no" and evals % n_eval:
        raise ValueError(
            f"under sequence parallelism an evaluation batch is per_device_eval_batch_size "
            f"({args.per_device_eval_batch_size}) x dp replicas ({dp}) = {evals} completions, "
            f"which does not split into groups of num_generations_eval={n_eval}: change one "
            f"of them"
        )
