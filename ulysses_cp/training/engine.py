"""DeepSpeed plugin: the topology from the run's config, an mpu, ``deepspeed.initialize``.

The module that initialises DeepSpeed (imported lazily, inside functions). Every function
takes the parsed :class:`~ulysses_cp.config.RunConfig`; the public entries
(:func:`topology_from_config`, :func:`initialize`) also take a path or a dict, read once.

Gradient scale. Each SP rank's loss gradient is its share of the global token mean
(``loss.py``), so the right reduction is a SUM over SP ranks and a MEAN over data-parallel
replicas. With this mpu DeepSpeed reduces over dp x sp ranks and divides by dp for ZeRO
0, 1 and 2, but ZeRO-3's reduce-scatter divides by dp x sp (deepspeed 0.19.8). There the
run's ``grad_scale`` (``topology_from_config``) is ``sp``, which the SP loss applies to its
gradient (not its value); :func:`initialize` refuses a topology built with another.
Tests compare updated parameters against a single process for every stage.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import asdict, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import OUR_KEYS, RunConfig
from ..core.log import get_logger
from ..core.options import RunOptions, reduction_grad_scale
from ..core.process import one_process_rendezvous
from ..core.protocols import Engine, Group
from ..core.topology import Topology, init_topology, validate_degrees

__all__ = [
    "NOT_FOR_DEEPSPEED",
    "SequenceParallelMPU",
    "check_topology",
    "deepspeed_part",
    "init_distributed",
    "initialize",
    "run_options",
    "topology_from_config",
    "zero_grad_scale",
]

# the standard "wandb" block is honoured by training/tracking.py (one run, our step
# numbers), not by DeepSpeed's monitor, which would open a second run logging at sample counts
NOT_FOR_DEEPSPEED = (*OUR_KEYS, "wandb")


def deepspeed_part(run: RunConfig) -> dict:
    """The config without our blocks (and ``wandb``), as handed to DeepSpeed."""
    return {k: v for k, v in run.raw.items() if k not in NOT_FOR_DEEPSPEED}


def init_distributed(timeout_s: float | None = None) -> None:
    """Start ``torch.distributed`` through DeepSpeed: NCCL on CUDA machines, gloo elsewhere.

    A process that no launcher started is a world of one
    (:func:`~ulysses_cp.core.process.one_process_rendezvous`): ``python script.py`` runs
    without ``torchrun``. On CUDA each rank first binds to the GPU of its ``LOCAL_RANK``.
    A process group that is already initialised is kept, and DeepSpeed's comm is bound to
    it (Accelerate on a CPU starts ``torch.distributed`` without it: ZeRO-3's
    ``zero.Init`` would then count one process). Imports DeepSpeed.

    Args:
        timeout_s: The collective timeout in seconds; None keeps DeepSpeed's default.
    """
    if not dist.is_initialized():
        one_process_rendezvous()  # no launcher: rank 0 of 1, not DeepSpeed's MPI search
    cpu = not torch.cuda.is_available()
    if cpu:
        # DeepSpeed's own switch, set unless the user set it: without it every rank warns
        # at import that it "was unable to detect" a GPU and fell back to the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if cpu:
        _quiet_cpu_deepspeed()
    else:
        # before any CUDA work: this rank's GPU (the launcher's LOCAL_RANK), not GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        deepspeed.init_distributed(dist_backend="nccl" if not cpu else "gloo", **kwargs)
    elif not deepspeed.comm.is_initialized():
        # started by someone else (Accelerate on CPU starts torch.distributed alone):
        # DeepSpeed's comm wraps the group, else zero.Init counts one process and fills
        # "auto" batch sizes for a world of 1
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def _quiet_cpu_deepspeed() -> None:
    """On CPU, DeepSpeed's shared-memory collectives are not used: gloo does the job.

    DeepSpeed's CPU shared-memory allreduce (used when the launcher sets LOCAL_SIZE)
    creates a 69 MB /dev/shm buffer per rank and run that is never unlinked, not even on a
    clean exit (deepspeed 0.19.8): a day of runs filled /dev/shm (19 GB, i.e. RAM) and the
    OOM killer took a test rank. The op behind it serves only DeepSpeed's inference
    all-reduce, yet every rank JIT-compiles it on the first run (a C++ compiler, and a
    build killed halfway leaves a lock that makes every later start wait) and loads it on
    every run, printing a line per rank: it is not built."""
    # the module itself: the attribute ``deepspeed.comm.torch`` is torch (a star import)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    local_ranks = os.environ.pop("LOCAL_SIZE", None)
    if local_ranks is not None:  # kept under torchrun's name (core.process reads it)
        os.environ.setdefault("LOCAL_WORLD_SIZE", local_ranks)
    ds_torch.build_shm_op = lambda: None  # type: ignore[attr-defined]


class _Drop(logging.Filter):
    """Drops DeepSpeed log records that contain ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def run_options(run: RunConfig) -> RunOptions:
    """The run's options of a config: its ``"sequence_parallel"`` block's, with the
    gradient scale of its ZeRO stage (:func:`zero_grad_scale`)."""
    return replace(run.sequence_parallel.options, grad_scale=zero_grad_scale(run))


def topology_from_config(config: RunConfig | str | Path | dict) -> Topology:
    """The topology a config's ``"sequence_parallel"`` block asks for.

    The degrees are checked against the world size, then the groups are built with the
    run's choices (layout, backend, packing, ...) and the gradient scale the ZeRO stage
    needs. Call after `init_distributed`.

    Args:
        config: The run's config: a ``RunConfig``, or a path or dict read once.

    Returns:
        The run's topology.

    Raises:
        ValueError: Degrees that do not divide the world size (the message names every
            number), or an invalid config.
    """
    run = RunConfig.load(config)
    sp = run.sequence_parallel
    validate_degrees(dist.get_world_size(), sp.ulysses_degree, sp.ring_degree)
    return init_topology(
        sp.ulysses_degree,
        sp.ring_degree,
        timeout_s=sp.collective_timeout_s,
        **asdict(run_options(run)),
    )


def check_topology(topo: Topology, run: RunConfig) -> None:
    """A topology given to :func:`initialize` must be the config's: the same degrees and
    the same run choices (a ZeRO-3 config needs the gradient scale it implies)."""
    sp = run.sequence_parallel
    want = run_options(run)
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


def _zero_stage(run: RunConfig) -> int:
    return run.deepspeed.zero_stage


def zero_grad_scale(run: RunConfig) -> float:
    """ZeRO-3's reduce-scatter averages over dp x sp ranks; the others over dp only: the
    SP degree under ZeRO-3 (with its reduce-scatter), else 1."""
    sp = run.sequence_parallel
    averages = _zero_stage(run) == 3 and run.deepspeed.reduce_scatter
    return reduction_grad_scale(sp.ulysses_degree * sp.ring_degree, averages_over_sp=averages)


def _partition_over_all_ranks(
    model: torch.nn.Module, mpu: SequenceParallelMPU, ds_config: dict, train_dtype: str
) -> None:
    """ZeRO-3 would partition parameters over ``mpu.get_data_parallel_group()`` (replicas
    only) but reduce-scatters gradients over every rank: partition over every rank first,
    as ``deepspeed.zero.Init`` does for an already-built model."""
    import deepspeed

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return  # built under zero.Init already
    dtype = next(model.parameters()).dtype
    if train_dtype in ("bfloat16", "float16"):  # the config's bf16/fp16 (deepspeed_block)
        dtype = getattr(torch, train_dtype)
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
    config: RunConfig | str | Path | dict,
    topo: Topology | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
) -> Engine:
    """``deepspeed.initialize`` with the sequence-parallel groups.

    DeepSpeed gets our mpu (its data-parallel group spans the replicas, and ZeRO-3
    partitions over every rank) and the config without our blocks. Call
    `init_distributed` first. A Hugging Face model built partitioned runs its guard and
    probe here, before any step.

    Args:
        model: The model; its attention calls ``attention`` with the topology.
        config: The run's config: a ``RunConfig``, or a path or dict read once.
        topo: The topology; None builds it from the config (`topology_from_config`).
        optimizer: Passed to DeepSpeed; None lets the config's ``"optimizer"`` block make
            one.
        model_parameters: Passed to DeepSpeed; None takes the parameters that require
            grad when no optimizer is given.
        lr_scheduler: Passed to DeepSpeed.

    Returns:
        The DeepSpeed engine, with the topology as ``engine.topology``.

    Raises:
        ValueError: A ``topo`` whose degrees or choices differ from the config's (each
            named), or an invalid config.
    """
    import deepspeed

    run = RunConfig.load(config)
    if topo is None:
        topo = topology_from_config(run)
    check_topology(topo, run)
    if model_parameters is None and optimizer is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    mpu = SequenceParallelMPU(topo)
    ds_config = deepspeed_part(run)
    if _zero_stage(run) == 3 and topo.sp_world_size > 1:
        _partition_over_all_ranks(model, mpu, ds_config, run.deepspeed.dtype)
    # DeepSpeed's warmup schedulers ask for their learning rate in their own constructor
    # and warn, on every rank, that they "have not started": noise at every start
    quiet = _Drop("get learning rate from scheduler before it has started")
    logging.getLogger("DeepSpeed").addFilter(quiet)
    try:
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            config=ds_config,
            mpu=mpu,
        )
    finally:
        logging.getLogger("DeepSpeed").removeFilter(quiet)
    from .portable import settle_initial_state

    settle_initial_state(engine)  # state an optimizer made in __init__ (Adagrad)
    probe = getattr(model, "probe", None)
    if getattr(model, "needs_probe", False) and callable(probe):
        # a Hugging Face model built partitioned (training/loading.py): its guard and probe
        # run now, before any step, with ZeRO-3 fetching each module's weights as it runs
        probe()
    get_logger(__name__).info(
        f"DeepSpeed engine ready: ZeRO-{_zero_stage(run)}, {topo.mode} "
        f"u{topo.ulysses_degree} r{topo.ring_degree} dp{topo.dp_degree}, {topo.options}"
    )
    engine.topology = topo
    return engine
