"""The Trainer subclasses under FSDP2: ``TrainingArguments(fsdp=..., fsdp_config={"version":
2})`` with the sequence-parallel JSON given as ``sequence_parallel_config=`` (docs:
docs/huggingface/trainer_fsdp2.md).

The model is sharded here, with ``fully_shard`` over :func:`..fsdp2.fsdp_mesh`'s
``shard_mesh`` (every rank: the data-parallel replicas and the SP ranks of each), and the
Trainer is told the model owns its sharding (transformers' path for a model sharded at load
time), so Accelerate neither wraps it in DDP nor shards it again. Two reasons: Accelerate
1.16 turns FSDP on for accelerator devices only (a CPU run gets DDP), and one mesh on every
device keeps the one gradient rule (``fsdp_mesh``'s ``grad_scale``) in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch

from ...config import RunConfig
from ...core.log import get_logger
from ...core.process import set_cpu_threads
from ..fsdp2 import FSDPMesh, fsdp_mesh

__all__ = [
    "check_fsdp_arguments",
    "check_parallelism_config",
    "deferred_reduction",
    "fsdp_requested",
    "reshard_after_forward",
    "shard_model",
    "sp_fsdp_mesh",
]

# fsdp_config keys Accelerate would act on that this path does not apply: refused by name
_REFUSED_KEYS = {
    "cpu_offload": "offload is not applied by this path; drop it",
    "activation_checkpointing": (
        "use the sequence_parallel_config file's model block "
        '("activation_checkpointing": true) or TrainingArguments(gradient_checkpointing=True)'
    ),
    "cpu_ram_efficient_loading": "load the model whole on every rank; drop it",
    "transformer_layer_cls_to_wrap": (
        "each decoder layer (the model's _no_split_modules) is sharded on its own; drop it"
    ),
}


def fsdp_requested(args: Any) -> bool:
    """Whether ``TrainingArguments`` ask for FSDP (``fsdp=True`` or a legacy string)."""
    return bool(getattr(args, "fsdp", None))


def check_fsdp_arguments(args: Any, run: RunConfig) -> None:
    """``args`` fit an FSDP2 run with the file's sequence_parallel block, else a
    ``ValueError`` naming the setting and the fix."""
    if not fsdp_requested(args):
        raise ValueError(
            "sequence_parallel_config= is the sequence-parallel file of an FSDP2 run: set "
            'TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2}); under '
            "DeepSpeed put the sequence_parallel block in the deepspeed= JSON instead"
        )
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    version = int(fsdp_config.get("version", 2))
    if version != 2:
        raise ValueError(
            f'fsdp_config["version"] is {version}: sequence parallelism runs under FSDP2 '
            f'only; set fsdp_config={{"version": 2}}'
        )
    for key, fix in _REFUSED_KEYS.items():
        if fsdp_config.get(key) not in (None, False, "false", "False", []):
            raise ValueError(f"fsdp_config[{key!r}] under sequence parallelism: {fix}")
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError(
            "load_best_model_at_end=True is not supported under FSDP2 with "
            "sequence_parallel_config yet (the best checkpoint is not read back into the "
            "sharded model): set load_best_model_at_end=False and load the best "
            "checkpoint-N folder with from_pretrained after training"
        )
    set_keys = run.deepspeed_keys  # every one, named as written (as train.py's fsdp2 refuses)
    if set_keys:
        raise ValueError(
            f"the sequence_parallel_config file has DeepSpeed settings ({', '.join(set_keys)}): "
            f"FSDP2 does the sharding here; drop them (or run under DeepSpeed with deepspeed=)"
        )


def check_parallelism_config(pc: Any, world: int, ulysses: int, ring: int) -> None:
    """Accelerate's ``ParallelismConfig`` (None: nothing to check) against our degrees.

    Honoured: ``dp_replicate_size`` 1 and ``dp_shard_size`` the world size (every rank in
    the shard group, the SP ranks included, as :func:`..fsdp2.fsdp_mesh` shards), or 1.
    Refused by name: ``cp_size`` or ``sp_size`` > 1 (Accelerate's own context and
    sequence parallelism, beside ours), ``tp_size`` > 1, HSDP (``dp_replicate_size`` > 1)
    and a ``dp_shard_size`` that leaves ranks out."""
    if pc is None:
        return
    sp = ulysses * ring
    ours = f"ulysses({ulysses}) * ring({ring}) = {sp}"
    sizes = {k: getattr(pc, f"{k}_size", None) or 1 for k in ("cp", "sp", "tp")}
    for name, value in sizes.items():
        if value > 1:
            raise ValueError(
                f"ParallelismConfig({name}_size={value}) beside sequence_parallel_config's "
                f"{ours}: the sequence split is ours; set {name}_size=1"
                + (" (tensor parallelism is not supported with it)" if name == "tp" else "")
            )
    replicate = getattr(pc, "dp_replicate_size", None) or 1
    shard = getattr(pc, "dp_shard_size", None) or 1
    if replicate > 1:
        raise ValueError(
            f"ParallelismConfig(dp_replicate_size={replicate}): HSDP is not supported with "
            f"sequence parallelism; set dp_replicate_size=1 and dp_shard_size={world}"
        )
    if shard not in (1, world):
        raise ValueError(
            f"ParallelismConfig(dp_shard_size={shard}) on {world} ranks: the FSDP2 shard group "
            f"holds the data-parallel replicas ({world // sp if world % sp == 0 else '?'}) and "
            f"the {ours} sequence-parallel ranks of each, so dp_shard_size must be {world} "
            f"(or leave ParallelismConfig out)"
        )


def sp_fsdp_mesh(run: RunConfig) -> FSDPMesh:
    """The mesh and topology of the file's sequence_parallel block (collective): degrees
    and options as the block says, ``grad_scale`` by ``fsdp_mesh``'s one rule."""
    config = run.sequence_parallel
    config.check()
    set_cpu_threads(get_logger(__name__))  # on CPU: the cores shared by the local ranks
    options = {k: v for k, v in asdict(config.options).items() if k != "grad_scale"}
    return fsdp_mesh(ulysses=config.ulysses_degree, ring=config.ring_degree, **options)


def _layer_classes(model: Any) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def reshard_after_forward(args: Any) -> bool:
    """``fsdp_config["reshard_after_forward"]`` of the ``TrainingArguments`` (default
    true), given to every ``fully_shard`` call of :func:`shard_model`, the root's too."""
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    return str(fsdp_config.get("reshard_after_forward", True)).lower() == "true"


def shard_model(model: torch.nn.Module, mesh: FSDPMesh, args: Any) -> None:
    """``fully_shard`` each decoder layer (the classes of the model's
    ``_no_split_modules``) and then the whole model over ``mesh.shard_mesh``;
    ``reshard_after_forward`` from ``fsdp_config`` (default true), bf16 compute with fp32
    reduction under ``TrainingArguments(bf16=True)``. Models that generate are marked
    FSDP-managed for transformers' ``generate`` (``synced_gpus``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = reshard_after_forward(args)
    policy = MixedPrecisionPolicy()
    if getattr(args, "bf16", False):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh.shard_mesh, reshard_after_forward=reshard, mp_policy=policy)
    classes = _layer_classes(model)
    for module in model.modules():
        if type(module).__name__ in classes and module is not model:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if hasattr(module, "generate"):  # the model, and a PEFT model's transformers model
            # transformers' marker of an FSDP2 model (its own apply_fsdp2 sets it): generate
            # then runs with synced_gpus, so a rank whose rows end early keeps calling
            # forward (FSDP2 all-gathers per forward) until every rank's rows have ended
            module._is_fsdp_managed_module = True  # type: ignore[assignment]


@contextmanager
def deferred_reduction(model: Any) -> Iterator[None]:
    """FSDP2's ``no_sync``: the gradients of the micro steps before the last of an
    accumulation stay unreduced."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
