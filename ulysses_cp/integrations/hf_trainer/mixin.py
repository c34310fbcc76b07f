"""What a ``Trainer`` subclass changes under sequence parallelism, as one mixin placed
before the parent (``class SequenceParallelTrainer(SequenceParallelMixin, Trainer)``).

Every override is the parent's own method when the DeepSpeed config has no
``"sequence_parallel"`` block, except that ``__init__`` always hides the third-party
warnings a user can do nothing about (:func:`ulysses_cp.core.log.quiet_third_party`).
With one:

- ``__init__``: reads the block from ``args.deepspeed`` or, under FSDP2, from the file of
  the ``sequence_parallel_config=`` keyword (:mod:`.fsdp`: the model is then sharded with
  ``fully_shard`` over ``fsdp_mesh``'s mesh, and ``save_model`` gathers it);
  builds the topology (:class:`.run.SequenceParallelRun`), switches the
  model's attention to ``"ulysses_cp"`` and applies the memory features of the DeepSpeed
  config's ``"model"`` block through the one model recipe (``models.recipe.adopt``):
  lean RMSNorms (unless ``"lean_norms": false``), ``tiled_mlp``,
  ``activation_checkpointing`` and ``offload_activations``;
- ``_get_dataloader``: the data-parallel replicas get distinct batches, the SP ranks of
  one replica the same (Accelerate's batch sampler shards over the replicas, not over
  every process);
- ``compute_loss``: shards the batch (global positions, labels shifted on the full
  sequence, packed rows document by document), runs the model on the shard and takes the
  loss over the whole SP group with the Trainer's token count (``num_items_in_batch``);
  an MoE model's load-balancing loss is taken over the whole sequence too
  (:mod:`ulysses_cp.models.router_loss`) and added as the parent adds it;
- ``_get_num_items_in_batch`` / ``get_total_train_batch_size``: count each replica once;
- ``gather_function`` (evaluation, ``predict``; set again by ``evaluation_loop``, since
  transformers resets it after each loop): one copy per replica, so ``eval_loss`` and
  ``predict``'s rows are the one-process ones;
- ``_save``: the saved ``config.json`` names the model's original attention, so the folder
  is a plain Hugging Face model;
- ``log`` / ``evaluate`` / ``train``: training log lines get the sequence-parallel metrics
  (evaluations set aside), and a resume continues the checkpoint's wandb run
  (:mod:`.metrics`); under FSDP2 checkpoints keep the sharded model and optimizer
  (:mod:`.fsdp_checkpoint`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from ...config import RunConfig
from ...core.comm import stats as comm_stats
from ...core.log import quiet_third_party
from ..fsdp2 import FSDPMesh
from .fsdp import (
    check_fsdp_arguments,
    check_parallelism_config,
    deferred_reduction,
    reshard_after_forward,
    shard_model,
    sp_fsdp_mesh,
)
from .fsdp_checkpoint import FSDPCheckpointMixin
from .metrics import (
    SequenceParallelCallback,
    StepMeter,
    checkpoint_folder,
    fsdp2_bytes_per_step,
    resumed_wandb_run,
    zero_bytes_per_step,
)
from .run import (
    SequenceParallelRun,
    model_block_options,
    sequence_parallel_block,
    sequence_parallel_loss,
    trainer_config,
)

__all__ = ["SequenceParallelMixin"]


class SequenceParallelMixin(FSDPCheckpointMixin):
    """Sequence parallelism for a ``transformers.Trainer`` subclass (module docstring).
    ``self.sequence_parallel`` is the run's :class:`.run.SequenceParallelRun`, or None
    without the block."""

    # the attributes of transformers.Trainer this mixin reads (for type checkers)
    args: Any
    model: Any
    accelerator: Any
    gather_function: Any
    state: Any
    add_callback: Any

    def __init__(self, *args: Any, sequence_parallel_config: Any = None, **kwargs: Any) -> None:
        quiet_third_party()  # deprecations of DeepSpeed's and TRL's own calls, every rank
        given = _training_arguments(args, kwargs)
        fsdp = sequence_parallel_config is not None  # FSDP2: the block in its own file
        run: RunConfig | None
        if fsdp:
            run = _fsdp_run_config(given, sequence_parallel_config)
        else:
            run = trainer_config(getattr(given, "deepspeed", None))  # once, as train.py reads
        block = sequence_parallel_block(run) if run is not None else None
        if block is not None and not fsdp:
            # before the parent builds models under ZeRO-3's zero.Init (TRL's reference, a
            # policy given as a path): DeepSpeed's comm must know the world
            _deepspeed_comm()
        super().__init__(*args, **kwargs)
        if given is None and fsdp:
            _fsdp_run_config(self.args, sequence_parallel_config)
        elif given is None:  # the parent made its own arguments
            run = trainer_config(getattr(self.args, "deepspeed", None))
            block = sequence_parallel_block(run) if run is not None else None
        self.sequence_parallel: SequenceParallelRun | None = None
        self._fsdp_mesh: FSDPMesh | None = None
        if block is None or run is None:
            return
        checkpointing = bool(getattr(self.args, "gradient_checkpointing", False))
        model_block = model_block_options(run, gradient_checkpointing=checkpointing)
        mesh = sp_fsdp_mesh(run) if fsdp else None  # the one gradient rule: fsdp_mesh's
        self._fsdp_mesh = mesh
        if mesh is not None:
            self.sequence_parallel = SequenceParallelRun(
                topo=mesh.topology, config=run.sequence_parallel
            )
        else:
            self.sequence_parallel = SequenceParallelRun.from_config(run.sequence_parallel)
        self.sequence_parallel.attach(self.model, model_block)
        self.gather_function = self._gather_for_metrics
        zero: int | None = None  # the sharding's bytes per step: ZeRO's or FSDP2's
        if mesh is None:
            zero = zero_bytes_per_step(
                self.model,
                run.deepspeed,
                world=self.args.world_size,
                micro_steps=self.args.gradient_accumulation_steps,
            )
        else:
            with comm_stats.set_aside():  # the guard and the probe read whole weights
                self.sequence_parallel.probe()
            shard_model(self.model, mesh, self.args)
            zero = fsdp2_bytes_per_step(  # FSDP2's gathers and reduce-scatters
                self.model,
                reshard_after_forward=reshard_after_forward(self.args),
                bf16=bool(getattr(self.args, "bf16", False)),
                world=self.args.world_size,
                micro_steps=self.args.gradient_accumulation_steps,
            )
            # transformers' path for a model that owns its sharding: no DDP, no re-shard
            self.is_distributed_loading_by_transformers = True
        self._meter = StepMeter(
            self.sequence_parallel.topo, device=self.args.device, zero_bytes=zero
        )
        self.add_callback(SequenceParallelCallback(self.sequence_parallel.topo, self._meter, block))

    def _defer_fsdp_gradient_reduction(self) -> Any:
        """FSDP2's no_sync for the micro steps of an accumulation but the last."""
        if self._fsdp_mesh is None:
            return super()._defer_fsdp_gradient_reduction()  # type: ignore[misc]
        return deferred_reduction(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP2 the full state dict is gathered on every rank (collective) and the
        writer saves it as a plain Hugging Face folder."""
        if self._fsdp_mesh is None:
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    # ------------------------------------------------------------ data

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        loader = super()._get_dataloader(*args, **kwargs)  # type: ignore[misc]
        sp = self.sequence_parallel
        if sp is None or sp.topo.world_size == 1:
            return loader
        sampler: Any = getattr(loader, "batch_sampler", None)
        if not hasattr(sampler, "num_processes") or not hasattr(sampler, "process_index"):
            raise ValueError(
                f"sequence parallelism needs Accelerate's sharded batch sampler to give the "
                f"sequence-parallel ranks the same batches; this data loader has "
                f"{type(sampler).__name__} (an IterableDataset or dispatch_batches=True): "
                f"use a map-style dataset"
            )
        # Accelerate shards the batches over all W processes; shard them over the replicas
        sampler.num_processes = sp.topo.dp_degree
        sampler.process_index = sp.topo.dp_rank
        if sp.topo.dp_degree == 1 and hasattr(sampler, "even_batches"):
            # one replica: the batches of a one-process run (no short last batch filled up)
            sampler.even_batches = False
        return loader

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        n = super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        sp = self.sequence_parallel
        if sp is None or n is None or not self.args.average_tokens_across_devices:
            return n
        if self.args.world_size > 1:  # gathered over every process: each replica P times
            n = n / sp.topo.sp_world_size
        return n

    def get_total_train_batch_size(self, args: Any) -> int:
        total = super().get_total_train_batch_size(args)  # type: ignore[misc]
        sp = self.sequence_parallel
        return total if sp is None else total // sp.topo.sp_world_size

    # ------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ):
        sp = self.sequence_parallel
        if sp is None:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        with comm_stats.set_aside():  # the probe's traffic is no step's
            sp.probe()
        if model.training:
            self._meter.count(inputs["input_ids"])
        local = sp.shard(inputs)
        kwargs = sp.forward_kwargs(local)
        coef = self._router_aux_coef()
        if coef is not None:
            if sp.vision is not None:
                raise ValueError(
                    "under sequence parallelism the MoE load-balancing loss of a vision-"
                    "language model is not computed yet: set output_router_logits=False in "
                    "its text config (TRL: router_aux_loss_coef=0.0)"
                )
            kwargs["output_router_logits"] = True
        outputs = model(**kwargs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        # the Trainer multiplies its loss by W when num_items_in_batch counts every process;
        # here each replica's P ranks hold the same value, so by the dp replicas
        averaged = (
            num_items_in_batch is not None
            and self.args.average_tokens_across_devices
            and self.args.world_size > 1
        )
        scale = sp.topo.dp_degree if averaged else 1
        loss = sequence_parallel_loss(
            logits,
            local["shift_labels"],
            sp.topo,
            num_items_in_batch=num_items_in_batch,
            value_scale=scale,
        )
        if coef is not None:
            assert sp.wrapper is not None and sp.wrapper.router is not None
            aux = sp.wrapper.router.loss(outputs["router_logits"], sp.topo, local["token_mask"])
            outputs["aux_loss"] = aux
            loss = self._with_aux_loss(loss, aux, coef, scale, num_items_in_batch)
        if not return_outputs:
            return loss
        if not model.training and not self.args.prediction_loss_only:
            outputs["logits"] = sp.full_logits(logits, local)
        return loss, outputs

    def _router_aux_coef(self) -> float | None:
        """The coefficient of the MoE load-balancing loss this trainer adds, or None: the
        model's own (its forward adds ``coef * aux_loss`` when its config has
        ``output_router_logits``), as ``Trainer`` takes the model's loss."""
        sp = self.sequence_parallel
        router = None if sp is None or sp.wrapper is None else sp.wrapper.router
        return router.coef if router is not None and router.enabled else None

    def _with_aux_loss(
        self, loss: torch.Tensor, aux: torch.Tensor, coef: float, scale: float, num_items: Any
    ) -> torch.Tensor:
        """``Trainer``'s loss with ``coef`` x the load-balancing loss ``aux``: the model's
        loss holds that term, so the Trainer's scale by the replicas applies to it too."""
        return loss + coef * aux * scale

    # ------------------------------------------------------------ metrics, wandb, resume

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """A training log line (``loss``) gets the sequence-parallel metrics (collective:
        the Trainer logs on every rank)."""
        if self.sequence_parallel is not None and "loss" in logs:
            logs = {**logs, **self._meter.metrics(self.state.global_step)}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if self.sequence_parallel is None:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        with self._meter.set_aside():  # its traffic and time are not the training steps'
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """A resume continues the wandb run whose id the checkpoint folder keeps."""
        if self.sequence_parallel is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        folder = checkpoint_folder(resume_from_checkpoint, self.args.output_dir)
        with resumed_wandb_run(folder):
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    # ------------------------------------------------------------ evaluation

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The parent's loop, with our gather: transformers resets ``gather_function`` to
        Accelerate's after every loop, so a second evaluation or a ``predict`` would
        otherwise gather every row once per SP rank."""
        if self.sequence_parallel is not None:
            self.gather_function = self._gather_for_metrics
        return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]

    def _gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """``accelerator.gather_for_metrics`` over the replicas: the SP ranks of a replica
        hold copies, which a gather over every process would count P times."""
        from accelerate.utils import recursively_apply

        sp = self.sequence_parallel
        assert sp is not None
        if use_gather_object:
            raise ValueError("sequence parallelism gathers tensors only for metrics")
        data = recursively_apply(sp.dp_gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # accelerate's padded last batch
            return recursively_apply(lambda t: t[: state.remainder], data)
        return data

    # ------------------------------------------------------------ saving

    @contextmanager
    def _plain_attention(self):
        """The model's config names its original attention while it is saved."""
        sp = self.sequence_parallel
        if sp is None or sp.wrapper is None:
            yield
            return
        config = sp.wrapper.model.config
        current = config._attn_implementation
        config._attn_implementation = sp.original_attention
        try:
            yield
        finally:
            config._attn_implementation = current

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        with self._plain_attention():
            super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]


def _training_arguments(args: tuple, kwargs: dict) -> Any:
    """The ``TrainingArguments`` among a trainer's arguments (``args=``, or positional)."""
    for value in (kwargs.get("args"), *args):
        if hasattr(value, "deepspeed") and hasattr(value, "output_dir"):
            return value
    return None


def _fsdp_run_config(args: Any, source: Any) -> RunConfig:
    """The ``sequence_parallel_config=`` file (or dict) read by ``RunConfig.load`` (the
    one door, as ``deepspeed=``'s JSON), checked against the ``TrainingArguments`` (None:
    the parent's own, checked after it made them)."""
    run = RunConfig.load(source, trainer=True)
    if run.block("sequence_parallel") is None:
        raise ValueError(
            f"sequence_parallel_config={source!r} has no sequence_parallel block: add one "
            f'(e.g. {{"sequence_parallel": {{"ulysses_degree": 2}}}})'
        )
    if args is None:
        return run
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "both TrainingArguments(deepspeed=...) and sequence_parallel_config= were given: "
            "under DeepSpeed the sequence_parallel block goes in the deepspeed JSON; "
            "sequence_parallel_config= is for FSDP2 runs"
        )
    check_fsdp_arguments(args, run)
    config = run.sequence_parallel
    check_parallelism_config(
        getattr(args, "parallelism_config", None),
        int(args.world_size),
        config.ulysses_degree,
        config.ring_degree,
    )
    return run


def _deepspeed_comm() -> None:
    """DeepSpeed's comm bound to the process group a launcher or Accelerate started (on a
    CPU Accelerate starts ``torch.distributed`` alone; ``zero.Init`` then counts one
    process and fills the "auto" batch sizes for a world of 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import deepspeed

        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend())
