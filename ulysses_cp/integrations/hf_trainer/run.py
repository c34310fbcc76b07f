"""The sequence-parallel side of a Hugging Face ``Trainer`` run, kept apart from the
``Trainer`` subclasses (:mod:`.mixin`): the ``"sequence_parallel"`` block read from
``args.deepspeed``, the topology, the model's attention, each batch's shard and the loss.

Legend: b batch, s full sequence, s_l = s / P this rank's tokens, V vocabulary,
P = sp_world_size, W = world size = dp * P.

Gradient reduction. The Trainer hands DeepSpeed no mpu, so DeepSpeed treats all W ranks as
data parallel: every ZeRO stage averages gradients over W ranks (ZeRO-3 also partitions
parameters over all of them). The right reduction is a sum over the P ranks of a sequence
and a mean over the dp replicas, so the run's ``grad_scale`` is P: the SP loss multiplies
its gradient (not its value) by P (:func:`sequence_parallel_loss`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...config import HFModelConfig, RunConfig, SequenceParallelConfig
from ...core.batch import shard_batch
from ...core.log import get_logger
from ...core.options import reduction_grad_scale
from ...core.process import set_cpu_threads
from ...core.sharding import gather_sequence, pad_batch, sequence_multiple
from ...core.tiles import TilePlan, device_memory, plan_tiles
from ...core.topology import Topology, init_topology, validate_degrees
from ...core.varlen import cu_seqlens_from_position_ids
from ...models.hf import HFCausalLM
from ...models.hf_attention import KEY
from ...models.hf_vision import (
    VISION_KEYS,
    LanguageModelShard,
    language_model,
    vision_attention,
    vision_batch,
)
from ...models.loss import local_loss_term, sequence_parallel_loss_from_sums
from ...models.recipe import adopt
from ...run_blocks import TrainerModelConfig

__all__ = [
    "IGNORED_KEYS",
    "SequenceParallelRun",
    "model_block_options",
    "sequence_parallel_block",
    "sequence_parallel_loss",
    "trainer_config",
]

IGNORE = -100
# batch keys the shard replaces: the attention mask (end padding only, checked), the
# padding-free collators' document bounds (taken from position_ids instead)
IGNORED_KEYS = frozenset(
    {
        "attention_mask",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_lengths",
        "seq_idx",
        "token_type_ids",
        "completion_mask",
        "assistant_masks",
        "use_cache",
        "return_loss",
    }
)


def trainer_config(deepspeed: Any) -> RunConfig | None:
    """``args.deepspeed`` (a JSON path or a dict) read by :meth:`RunConfig.load` as
    train.py reads its config (an error names the file, the line and the key, with the
    closest valid keys), its ``"model"`` block the Trainer's
    (:class:`~ulysses_cp.run_blocks.TrainerModelConfig`); None without a DeepSpeed config
    or when the file is missing (the Trainer reports that itself)."""
    if deepspeed is None or deepspeed is False:
        return None
    if not isinstance(deepspeed, dict) and not Path(deepspeed).is_file():
        return None
    return RunConfig.load(deepspeed, trainer=True)


def sequence_parallel_block(deepspeed: Any | RunConfig) -> dict | None:
    """The ``"sequence_parallel"`` block of ``args.deepspeed`` (a JSON path, a dict or its
    :func:`trainer_config`) as written, or None when there is none (or no DeepSpeed
    config at all)."""
    run = deepspeed if isinstance(deepspeed, RunConfig) else trainer_config(deepspeed)
    return None if run is None else run.block("sequence_parallel")


HANDED = "(the model handed to the Trainer)"  # the block's hf_config under the Trainer


def model_block_options(
    deepspeed: Any | RunConfig, *, gradient_checkpointing: bool = False
) -> HFModelConfig:
    """The ``"model"`` block of ``args.deepspeed`` (a JSON path, a dict or its
    :func:`trainer_config`) as a Trainer run reads it
    (:class:`~ulysses_cp.run_blocks.TrainerModelConfig`): the memory features of train.py's
    model block (lean norms, default true; the tiled MLP; activation checkpointing and its
    offload; the per-rank budget of "auto" tiles), applied to the model the Trainer is
    handed (``models.recipe.adopt``). The keys that build the model or its loss are
    refused by name, and so is activation checkpointing beside
    ``TrainingArguments(gradient_checkpointing=True)``, which already checkpoints every
    layer."""
    run = deepspeed if isinstance(deepspeed, RunConfig) else trainer_config(deepspeed)
    block = TrainerModelConfig() if run is None or run.trainer_model is None else run.trainer_model
    mc = HFModelConfig(hf_config=HANDED, **asdict(block))
    mc.check()
    if mc.activation_checkpointing and gradient_checkpointing:
        raise ValueError(
            "the DeepSpeed config's model block sets activation_checkpointing and "
            "TrainingArguments sets gradient_checkpointing=True: every layer would be "
            "checkpointed twice; keep one (the model block's can also offload the saved "
            "inputs: offload_activations)"
        )
    return mc


def sequence_parallel_loss(
    logits_local: torch.Tensor,
    labels_local: torch.Tensor,
    topo: Topology,
    *,
    num_items_in_batch: torch.Tensor | float | None,
    value_scale: float,
) -> torch.Tensor:
    """The Trainer's causal-LM loss of this rank's shard, summed over the SP group.

    ``labels_local``: ``(b, s_l)``, shifted on the full sequence. With
    ``num_items_in_batch`` (the Trainer's count over the accumulated batch and, when it
    averages tokens across devices, every replica): ``sum CE / num_items_in_batch``;
    without: the token mean of this batch. Value times ``value_scale`` (the dp replicas the
    Trainer's own loss is multiplied by); gradient: this rank's share, times
    ``value_scale * topo.grad_scale``."""
    logits = logits_local if logits_local.dtype == torch.float64 else logits_local.float()
    # (b, s_l, V) -> (b * s_l, V)
    ce = F.cross_entropy(
        logits.flatten(0, 1), labels_local.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    if num_items_in_batch is None:
        loss = sequence_parallel_loss_from_sums(ce, (labels_local != IGNORE).sum(), topo)
    else:
        n = torch.as_tensor(num_items_in_batch, dtype=ce.dtype, device=ce.device)
        loss = local_loss_term(ce / n.clamp(min=1), topo)
    return loss * value_scale if value_scale != 1 else loss


@dataclass
class SequenceParallelRun:
    """One Trainer's sequence parallelism: the topology of the block and the model's
    wrapper (:class:`~ulysses_cp.models.hf.HFCausalLM`: the guard, the probe, the extra
    arguments of the attention calls)."""

    topo: Topology
    config: SequenceParallelConfig
    original_attention: str | None = None
    wrapper: HFCausalLM | None = field(default=None, repr=False)
    vision: LanguageModelShard | None = field(default=None, repr=False)
    tiles: TilePlan = field(default_factory=TilePlan)  # the run's, resolved at attach

    @classmethod
    def from_block(cls, block: dict) -> SequenceParallelRun:
        """Validate the block against the world and build the groups (collective)."""
        return cls.from_config(SequenceParallelConfig.from_dict(block))

    @classmethod
    def from_config(cls, config: SequenceParallelConfig) -> SequenceParallelRun:
        """The parsed block validated against the world, and the groups built (collective)."""
        config.check()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "the sequence_parallel block needs torch.distributed initialised: create the "
                "TrainingArguments (with deepspeed=) under a launcher (deepspeed, torchrun, "
                "accelerate launch) before the trainer"
            )
        world = dist.get_world_size()
        validate_degrees(world, config.ulysses_degree, config.ring_degree)
        sp = config.ulysses_degree * config.ring_degree
        scale = reduction_grad_scale(sp, averages_over_sp=True)
        set_cpu_threads(get_logger(__name__))  # on CPU: the cores shared by the local ranks
        topo = init_topology(
            config.ulysses_degree,
            config.ring_degree,
            timeout_s=config.collective_timeout_s,
            # DeepSpeed averages over all W ranks (module docstring)
            **asdict(replace(config.options, grad_scale=scale)),
        )
        return cls(topo=topo, config=config)

    # ------------------------------------------------------------ the model

    def attach(self, model: Any, block: HFModelConfig | None = None, *, lean: bool = True) -> None:
        """Switch a transformers model (a PEFT model's base model included) to ulysses_cp
        attention and wrap it with the memory features of ``block`` (the DeepSpeed JSON's
        ``"model"`` block, :func:`model_block_options`; None: lean norms as ``lean`` says,
        nothing else), through the one recipe (``models.recipe.adopt``). The run's tiles
        are resolved here, once (``core.tiles.plan_tiles``: the block's budget, else on a
        GPU its free memory at start less a margin). The guard and the probe run at
        :meth:`probe`."""
        if block is None:
            block = model_block_options({"model": {"lean_norms": lean}})
        self.tiles = plan_tiles(block, gpu_memory=device_memory())
        base = _transformers_model(model)
        self.original_attention = base.config._attn_implementation
        self.wrapper = adopt(base, self.topo, block, tiles=self.tiles)
        lm = language_model(base)
        if lm is not None:  # a VLM: its vision tower keeps its attention (whole images)
            vision_attention(base, _plain(self.original_attention))
            self.vision = LanguageModelShard(lm, self.topo, self.wrapper.layout)

    def wrap_model(self, model: Any) -> HFCausalLM:
        """A second model (a reference model) switched to ulysses_cp attention on this
        run's topology and wrapped with the run's tile plan, without memory features (it
        runs without gradients); not probed yet."""
        return adopt(model, self.topo, None, tiles=self.tiles)

    def probe(self) -> None:
        """The guard and the probe of :mod:`ulysses_cp.models.hf_guard`, once, collective
        over the SP group: a model the Hugging Face path refuses is refused here too."""
        assert self.wrapper is not None
        if self.wrapper.needs_probe:
            self.wrapper.probe()

    # ------------------------------------------------------------ batches

    def shard(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """This rank's ``input_ids``, global ``position_ids``, ``shift_labels`` and the
        batch plan from the full batch every SP rank holds; ``full_length`` is the
        length before end padding."""
        unknown = sorted(k for k in inputs if k not in IGNORED_KEYS and k not in _USED_KEYS)
        vision = [k for k in unknown if k.startswith(VISION_KEYS)]
        if vision:
            return self._shard_images(inputs)
        if unknown:
            raise ValueError(
                f"sequence parallelism shards input_ids, labels and position_ids; this batch "
                f"also has {unknown}, which it cannot shard"
            )
        ids = inputs["input_ids"]
        labels = inputs.get("shift_labels", inputs.get("labels"))
        if labels is None:
            raise ValueError("the batch has no labels: the sequence-parallel loss needs them")
        key = "shift_labels" if "shift_labels" in inputs else "labels"
        pos = inputs.get("position_ids")
        mask = inputs.get("attention_mask")
        if mask is not None:
            labels = _end_padding_only(mask, labels)
        # the real tokens (an MoE router's load-balancing loss counts them): the attention
        # mask's, without the end padding added below (pad_batch fills with 0)
        real = torch.ones_like(ids) if mask is None else mask.to(ids.dtype)
        batch = {"input_ids": ids, key: labels, "token_mask": real}
        cu = _packed_bounds(pos)
        if pos is not None:
            batch["position_ids"] = pos
        P = self.topo.sp_world_size
        full_length = ids.shape[1]
        if cu is None or self.topo.options.packing == "row":
            # an unpacked batch, or a packed row split like one ("packing": "row"): padded
            # at the end; the row's padding joins its last document (positions keep counting)
            batch = pad_batch(batch, sequence_multiple(P, self.topo.layout))
            cu = None if cu is None else _packed_bounds(batch["position_ids"])
        if cu is not None:
            batch["cu_seqlens"] = cu
        local = shard_batch(batch, self.topo)
        local["full_length"] = full_length
        return local

    def _shard_images(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """An image batch: the labels' shard as :meth:`shard` makes it, and under
        ``"images"`` the whole (end-padded) batch the model's forward takes, whose language
        model gets this rank's tokens (:class:`~ulysses_cp.models.hf_vision.LanguageModelShard`)."""
        if self.vision is None or self.wrapper is None:
            keys = sorted(k for k in inputs if k.startswith(VISION_KEYS))
            raise ValueError(
                f"this batch has images or videos ({keys}), and the model has no vision "
                f"tower under a language model the path knows: train on text only"
            )
        family = self.wrapper.model.config.model_type
        multiple = sequence_multiple(self.topo.sp_world_size, self.topo.layout)
        images = vision_batch(inputs, family, multiple, ignored=IGNORED_KEYS)
        text = {k: v for k, v in inputs.items() if k in IGNORED_KEYS or k in _USED_KEYS}
        local = self.shard(text)
        local["images"] = images
        return local

    def forward_kwargs(self, local: dict[str, Any]) -> dict[str, Any]:
        """The model's keyword arguments for this rank's shard."""
        assert self.wrapper is not None
        extra = self.wrapper.extra_kwargs(local["position_ids"], local["batch"])
        if "images" in local:
            assert self.vision is not None
            self.vision.arm(local["images"]["input_ids"].shape[1], extra)
            return {**local["images"], "use_cache": False}
        if self.vision is not None:
            self.vision.disarm()
        return {
            "input_ids": local["input_ids"],
            "position_ids": local["position_ids"],
            "use_cache": False,
            **extra,
        }

    def full_logits(self, logits_local: torch.Tensor, local: dict[str, Any]) -> torch.Tensor:
        """The whole sequence's logits on every SP rank (for metrics), end padding cut."""
        full = gather_sequence(logits_local, self.topo, dim=1, cu_seqlens=local.get("cu_seqlens"))
        return full[:, : local["full_length"]]

    def dp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate a tensor over the data-parallel replicas (dim 0, in dp-rank order):
        every SP rank of a replica holds the same value, so one copy per replica."""
        group = self.topo.dp_group
        if self.topo.dp_degree == 1 or group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.topo.dp_degree)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)


_USED_KEYS = frozenset({"input_ids", "labels", "shift_labels", "position_ids"})


def _plain(implementation: str | None) -> str:
    """The attention a vision tower keeps: the model's own, sdpa if it had ours."""
    return "sdpa" if implementation in (None, KEY) else implementation


def _transformers_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _end_padding_only(mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """An attention mask that only cuts the end of rows (right padding) changes nothing a
    causal model computes for the real tokens: the padded tokens lose their targets and the
    mask goes. Any other mask is refused."""
    m = mask.bool()
    # a row is end-padded when its mask never turns back on: cummin keeps it equal
    if not bool((m == m.int().cummin(dim=1).values.bool()).all()):
        raise ValueError(
            "sequence parallelism supports end (right) padding only: this batch's "
            "attention_mask has masked tokens before real ones (left padding or holes); "
            "pad on the right (tokenizer.padding_side='right') or pack the rows"
        )
    return labels.masked_fill(~m, IGNORE)


def _packed_bounds(pos: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens`` of a packed row (position ids restart at 0 inside the row), else
    None. Rows of a batch > 1 that restart are refused (pack them into one row)."""
    if pos is None or pos.shape[1] < 2:
        return None
    restarts = (pos[:, 1:] == 0).any(dim=1)
    if not bool(restarts.any()):
        return None
    if pos.shape[0] != 1:
        raise ValueError(
            f"packed rows (position_ids restarting at 0) must come one row per batch under "
            f"sequence parallelism, got a batch of {pos.shape[0]} rows: use a padding-free "
            f"collator (TRL's padding_free=True or packing) that flattens the batch"
        )
    return cu_seqlens_from_position_ids(pos)
