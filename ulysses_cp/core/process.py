"""The process a run lives in: its launcher (or none), its CPU threads and its exit.

Nothing here imports torch at module level (the training entry point imports this module
before it has checked the config): torch is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping

__all__ = [
    "cpu_threads",
    "exit_process",
    "launched",
    "one_process_rendezvous",
    "set_cpu_threads",
]

# what a launcher leaves in its ranks' environment: torchrun's and DeepSpeed's launcher's
# RANK / WORLD_SIZE; Open MPI's, MPICH's (and Slurm's PMI) and MVAPICH's ranks, which
# DeepSpeed finds through mpi4py; Azure ML's and SageMaker's, which DeepSpeed reads itself
_LAUNCHER_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "AZUREML_EXPERIMENT_ID",
    "SM_TRAINING_ENV",
)

# the launchers' count of ranks on this machine: torchrun and accelerate's
# LOCAL_WORLD_SIZE, DeepSpeed's launcher's LOCAL_SIZE
_LOCAL_RANKS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process: torchrun or DeepSpeed's (``RANK``,
    ``WORLD_SIZE``), MPI, Azure ML or SageMaker, whose environments DeepSpeed reads.

    Args:
        env: the environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    return any(k in env for k in _LAUNCHER_KEYS)


def one_process_rendezvous(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Make a process that no launcher started a world of one: ``RANK=0``,
    ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT`` (those the user set are kept). Without them DeepSpeed looks for an MPI
    world and fails on a missing ``mpi4py``. Call it before ``torch.distributed`` starts.

    Args:
        env: the environment to complete (default ``os.environ``).

    Returns:
        True when it set the world of one, False under a launcher (nothing changed).
    """
    env = os.environ if env is None else env
    if launched(env):
        return False
    env.update(RANK="0", WORLD_SIZE="1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if not env.get("MASTER_PORT", "").strip():
        # this process binds it again at once, as the TCP store's only member
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
    return True


def _cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads(env: Mapping[str, str] | None = None, cores: int | None = None) -> int | None:
    """The torch thread count for one CPU rank: ``max(1, cores // local ranks)``, the
    machine's cores shared among the ranks on it (``LOCAL_WORLD_SIZE``, or the DeepSpeed
    launcher's ``LOCAL_SIZE``; 1 when neither is set). None when ``OMP_NUM_THREADS`` is set:
    the user's choice stands.

    Args:
        env: the environment (default ``os.environ``).
        cores: the cores to share (default: those this process may run on).

    Returns:
        The thread count, or None to leave torch's as it is.
    """
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    local = next((env[k] for k in _LOCAL_RANKS if env.get(k, "").strip()), "1")
    try:
        ranks = max(1, int(local))
    except ValueError:
        ranks = 1
    return max(1, (_cores() if cores is None else cores) // ranks)


def set_cpu_threads(log: logging.Logger | None = None) -> int | None:
    """On a CPU run, set torch's intra-op threads to :func:`cpu_threads` (the launchers
    leave ``OMP_NUM_THREADS`` unset, and every rank would use every core). Does nothing
    when CUDA is available or the user set ``OMP_NUM_THREADS``.

    Args:
        log: a logger; the choice is logged at INFO (rank 0 prints it where the entry
            point configured logging).

    Returns:
        The thread count set, or None when left alone.
    """
    import torch

    if torch.cuda.is_available():
        return None
    n = cpu_threads()
    if n is None:
        if log is not None:
            log.info(f"CPU threads: {torch.get_num_threads()} per rank (OMP_NUM_THREADS)")
        return None
    torch.set_num_threads(n)
    if log is not None:
        log.info(
            f"CPU threads: {n} per rank ({_cores()} cores / local ranks); set "
            f"OMP_NUM_THREADS to choose"
        )
    return n


def exit_process(code: int = 0) -> None:
    """Leave a finished distributed run: destroy the default process group, flush the
    output and exit without the interpreter's teardown.

    Process groups still referenced elsewhere (DeepSpeed's partitioned parameters hold
    theirs) are otherwise freed while the interpreter finalises, and gloo's threads there
    once aborted a rank after its work was done ("terminate called without an active
    exception", SIGABRT, a failed run to the launcher). Call it last, after every file is
    written; an exception should propagate instead, so that it is reported.

    Args:
        code: the exit status.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
