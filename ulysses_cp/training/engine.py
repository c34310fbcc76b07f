"""DeepSpeed plugin: our config block, the topology, an mpu, ``deepspeed.initialize``.

This is the one module that imports deepspeed (lazily, inside functions).

Gradient scale. Each SP rank's loss gradient is its share of the global token mean
(``loss.py``), so the right reduction is a SUM over SP ranks and a MEAN over data-parallel
replicas. With this mpu DeepSpeed reduces over dp x sp ranks and divides by dp for ZeRO
0, 1 and 2, but ZeRO-3's reduce-scatter divides by dp x sp (deepspeed 0.19.8). There the
run's ``grad_scale`` (``topology_from_config``) is ``sp``, which the SP loss applies to its
gradient (not its value); :func:`initialize` refuses a topology built with another.
Tests compare updated parameters against a single process for every stage.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import asdict, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import SequenceParallelConfig
from ..core.log import get_logger
from ..core.options import RunOptions
from ..core.protocols import Engine, Group
from ..core.topology import Topology, init_topology, validate_degrees

__all__ = [
    "DEEPSPEED_KEYS",
    "NOT_FOR_DEEPSPEED",
    "OUR_BLOCKS",
    "PATH_FIELDS",
    "SequenceParallelConfig",
    "SequenceParallelMPU",
    "check_top_level_keys",
    "check_topology",
    "deepspeed_part",
    "init_distributed",
    "initialize",
    "known_top_level_keys",
    "load_config",
    "resolve_paths",
    "run_options",
    "topology_from_config",
    "zero_grad_scale",
]

OUR_BLOCKS = ("sequence_parallel", "model", "data", "eval", "training")
# the standard "wandb" block is honoured by ulysses_cp.tracking (one run, our step numbers),
# not by DeepSpeed's monitor, which would open a second run logging at sample counts
NOT_FOR_DEEPSPEED = (*OUR_BLOCKS, "wandb")


# DeepSpeed's documented top-level blocks and keys (deepspeed 0.19); the string constants of
# deepspeed.runtime.constants are added when deepspeed imports (see known_top_level_keys)
DEEPSPEED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "flops_profiler", "activation_checkpointing", "sparse_attention", "data_efficiency",
    "curriculum_learning", "tensorboard", "csv_monitor", "wandb", "comet", "comms_logger",
    "autotuning", "elasticity", "communication_data_type", "data_types", "checkpoint", "aio",
    "nebula", "compression_training", "pipeline", "eigenvalue", "progressive_layer_drop",
    "quantize_training", "weight_quantization", "hybrid_engine", "compile",
    "data_parallel_size", "sequence_parallel_size", "disable_allgather", "dataloader_drop_last",
    "seq_parallel_communication_data_type", "gradient_allreduce_op", "mics_shard_size",
    "mics_hierarchical_params_gather", "use_node_local_storage", "load_universal",
    "graph_harvesting", "timers", "tensor_parallel", "vocabulary_size", "disable_python_gc",
)  # fmt: skip


def known_top_level_keys() -> set[str]:
    """Top-level keys a config may hold: our blocks and DeepSpeed's."""
    keys = {*OUR_BLOCKS, *DEEPSPEED_KEYS}
    try:
        import deepspeed.runtime.constants as ds_constants
    except Exception:  # deepspeed missing or broken: the documented list alone
        return keys
    for name, value in vars(ds_constants).items():
        if name.isupper() and isinstance(value, str) and value.isidentifier():
            keys.add(value)
    return keys


def check_top_level_keys(config: dict, source: str = "the config") -> None:
    """DeepSpeed ignores top-level keys it does not know, so a misspelled block (say
    ``"sequence_paralel"``) would silently train without it: refuse unknown keys, with the
    closest known ones. Keys starting with ``_`` are left alone (comments)."""
    known = known_top_level_keys()
    unknown = sorted(k for k in config if k not in known and not str(k).startswith("_"))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), sorted(known), n=2, cutoff=0.6)
            hints.append(f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)"
                                       if close else ""))  # fmt: skip
        raise ValueError(
            f"unknown top-level key(s) in {source}: {', '.join(hints)}. DeepSpeed would ignore "
            f"them silently; fix the spelling, or start a key with '_' to keep it as a comment"
        )


PATH_FIELDS = (
    ("model", "hf_config"),
    ("model", "hf_weights"),
    ("data", "files"),
    ("data", "tokenizer"),
    ("data", "cache_dir"),
    ("eval", "files"),
)


def resolve_paths(config: dict, base: Path) -> dict:
    """Relative file paths in our blocks (``model.hf_config``, ``model.hf_weights``,
    ``data.files``, ``data.tokenizer``, ``data.cache_dir``, ``eval.files``) made relative
    to ``base``, the config file's folder, so that a config means the same files from
    whatever folder the run starts in."""
    for block, key in PATH_FIELDS:
        value = config.get(block, {}).get(key) if isinstance(config.get(block), dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            config[block][key] = str(base / value)
        elif isinstance(value, list):
            config[block][key] = [
                str(base / v) if isinstance(v, str) and not Path(v).is_absolute() else v
                for v in value
            ]
    return config


def load_config(config: str | Path | dict) -> dict:
    """A DeepSpeed JSON config (path or dict), deep-copied and checked for unknown top-level
    keys; a JSON syntax error names the file, line and column. From a file, relative paths
    in our blocks resolve against the file's folder (:func:`resolve_paths`)."""
    if isinstance(config, dict):
        config = copy.deepcopy(config)
        check_top_level_keys(config)
        return config
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"DeepSpeed config not found: {path}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: a DeepSpeed config is a JSON object, got {type(config).__name__}"
        )
    check_top_level_keys(config, str(path))
    return resolve_paths(config, path.parent)


def deepspeed_part(config: dict) -> dict:
    """The config without our blocks (and ``wandb``), as handed to DeepSpeed."""
    return {k: v for k, v in config.items() if k not in NOT_FOR_DEEPSPEED}


def init_distributed(timeout_s: float | None = None) -> None:
    """``deepspeed.init_distributed`` with nccl on CUDA machines, gloo elsewhere;
    ``timeout_s``: the collective timeout (DeepSpeed's default when None)."""
    import deepspeed

    if not torch.cuda.is_available():
        # DeepSpeed's CPU shared-memory allreduce (used when the launcher sets LOCAL_SIZE)
        # creates a 69 MB /dev/shm buffer per rank and run that is never unlinked, not even
        # on a clean exit (deepspeed 0.19.8): a day of runs filled /dev/shm (19 GB, i.e.
        # RAM) and the OOM killer took a test rank. gloo's allreduce does the same job.
        os.environ.pop("LOCAL_SIZE", None)
    else:
        # before any CUDA work: this rank's GPU (the launcher's LOCAL_RANK), not GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo", **kwargs
        )


def run_options(config: dict) -> RunOptions:
    """The run's choices (layout, backend, input checks, gradient scale) from a config."""
    sp = SequenceParallelConfig.from_dict(config.get("sequence_parallel"))
    return RunOptions(
        layout=sp.layout,
        backend=sp.attention_backend,
        check_inputs=sp.check_inputs,
        grad_scale=zero_grad_scale(config, sp.ulysses_degree * sp.ring_degree),
        kv_exchange=sp.kv_exchange,
        head_chunks=sp.head_chunks,
    )


def topology_from_config(config: str | Path | dict) -> Topology:
    """Validate the ``"sequence_parallel"`` block against the world, then build the groups
    with the run's choices (:func:`run_options`)."""
    config = load_config(config)
    sp = SequenceParallelConfig.from_dict(config.get("sequence_parallel"))
    validate_degrees(dist.get_world_size(), sp.ulysses_degree, sp.ring_degree)
    options = run_options(config)
    return init_topology(
        sp.ulysses_degree,
        sp.ring_degree,
        timeout_s=sp.collective_timeout_s,
        **asdict(options),
    )


def check_topology(topo: Topology, config: dict) -> None:
    """A topology given to :func:`initialize` must be the config's: the same degrees and
    the same run choices (a ZeRO-3 config needs the gradient scale it implies)."""
    sp = SequenceParallelConfig.from_dict(config.get("sequence_parallel"))
    want = run_options(config)
    have = f"u{topo.ulysses_degree} r{topo.ring_degree}"
    config_degrees = f"u{sp.ulysses_degree} r{sp.ring_degree}"
    diffs = [] if have == config_degrees else [f"degrees {have} vs the config's {config_degrees}"]
    diffs += [
        f"{f.name} {getattr(topo.options, f.name)!r} vs the config's {getattr(want, f.name)!r}"
        for f in fields(want)
        if getattr(topo.options, f.name) != getattr(want, f.name)
    ]
    if diffs:
        raise ValueError(
            f"the topology given to ucp.initialize differs from the config: {'; '.join(diffs)}"
            f" (grad_scale follows the ZeRO stage: ZeRO-3 averages gradients over the SP "
            f"ranks too). Build it with ucp.topology_from_config(config)."
        )


class SequenceParallelMPU:
    """What DeepSpeed asks an mpu (``deepspeed/utils/groups.py``), from a topology.

    Data parallel = replicas (integer sizes: a float here breaks DeepSpeed's batch
    arithmetic); sequence-data-parallel = every rank (ZeRO shards and reduces over it);
    model parallel = this rank alone."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._seq_dp_group, self._mp_group = topo.all_group, topo.self_group
        if self._seq_dp_group is None or self._mp_group is None:  # a hand-built topology
            world = dist.get_world_size()
            self._seq_dp_group = dist.new_group(list(range(world)))
            for r in range(world):  # every rank creates every single-rank group
                g = dist.new_group([r])
                if r == topo.rank:
                    self._mp_group = g

    def get_sequence_parallel_group(self) -> Group:
        return self.topo.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.topo.sp_world_size

    def get_sequence_parallel_rank(self) -> int:
        return self.topo.sp_rank

    def get_sequence_data_parallel_group(self) -> Group:
        return self._seq_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topo.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.topo.rank

    def get_data_parallel_group(self) -> Group:
        return self.topo.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.topo.dp_degree

    def get_data_parallel_rank(self) -> int:
        return self.topo.dp_rank

    def get_model_parallel_group(self) -> Group:
        return self._mp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def _zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def zero_grad_scale(config: dict, sp_world_size: int) -> float:
    """ZeRO-3's reduce-scatter averages over dp x sp ranks; the others over dp only."""
    zero = config.get("zero_optimization") or {}
    if _zero_stage(config) == 3 and zero.get("reduce_scatter", True):
        return float(sp_world_size)
    return 1.0


def _partition_over_all_ranks(
    model: torch.nn.Module, mpu: SequenceParallelMPU, ds_config: dict
) -> None:
    """ZeRO-3 would partition parameters over ``mpu.get_data_parallel_group()`` (replicas
    only) but reduce-scatters gradients over every rank: partition over every rank first,
    as ``deepspeed.zero.Init`` does for an already-built model."""
    import deepspeed

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return  # built under zero.Init already
    dtype = next(model.parameters()).dtype
    if (ds_config.get("bf16") or {}).get("enabled"):
        dtype = torch.bfloat16
    elif (ds_config.get("fp16") or {}).get("enabled"):
        dtype = torch.float16
    # DeepSpeed casts the model to bf16/fp16 itself only when it partitions it: cast here,
    # or the partitions stay fp32 and the whole run silently trains in fp32
    model.to(dtype)
    deepspeed.zero.Init(
        module=model,
        data_parallel_group=mpu.get_sequence_data_parallel_group(),
        config_dict_or_path=ds_config,
        dtype=dtype,
        mpu=mpu,
    )


def initialize(
    *,
    model: torch.nn.Module,
    config: str | Path | dict,
    topo: Topology | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
) -> Engine:
    """``deepspeed.initialize`` with our mpu; returns the DeepSpeed engine.

    ``engine.topology`` is the topology (built from the config's ``"sequence_parallel"``
    block unless given). Call :func:`init_distributed` first."""
    import deepspeed

    config = load_config(config)
    if topo is None:
        topo = topology_from_config(config)
    check_topology(topo, config)
    if model_parameters is None and optimizer is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    mpu = SequenceParallelMPU(topo)
    ds_config = deepspeed_part(config)
    if _zero_stage(config) == 3 and topo.sp_world_size > 1:
        _partition_over_all_ranks(model, mpu, ds_config)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        config=ds_config,
        mpu=mpu,
    )
    from .checkpoint import settle_initial_state

    settle_initial_state(engine)  # state an optimizer made in __init__ (Adagrad)
    get_logger(__name__).info(
        f"DeepSpeed engine ready: ZeRO-{_zero_stage(config)}, {topo.mode} "
        f"u{topo.ulysses_degree} r{topo.ring_degree} dp{topo.dp_degree}, {topo.options}"
    )
    engine.topology = topo
    return engine
