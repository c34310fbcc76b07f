"""Shared by the benchmark scripts: run a function on N spawned ranks and collect rank 0's
result, and the bookkeeping collectives the scripts make (on tensors of the rank's device).

Device and backend (:func:`pick_device_and_backend`): CPU without CUDA, gloo, threads split
between the ranks; with CUDA, ``cuda:LOCAL_RANK`` (set as the current device before any
CUDA work and before ``init_process_group``) and NCCL when each rank on this machine has
its own GPU; when there are more ranks on this machine than GPUs (several processes share a
GPU, e.g. a one-GPU test machine), gloo with CUDA tensors, said in one log line.

The scripts make no ``torch.distributed`` collective themselves: they call
:func:`gather_floats`, :func:`max_over_ranks`, :func:`barrier` and :func:`sync` with the
device ``run_ranks`` gave them (``tests/unit/test_scripts_devices.py`` checks this).
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ulysses_cp.core.process import exit_process

TIMEOUT = timedelta(seconds=900)


def pick_device_and_backend(
    rank: int,
    local_rank: int | None,
    world: int,
    cuda_count: int,
    *,
    local_world: int | None = None,
) -> tuple[str, str, bool]:
    """``(device, backend, shared)`` for one rank, a pure function of what it is given.

    ``local_rank``: the rank on this machine (``LOCAL_RANK``; None: ``rank``, one machine).
    ``local_world``: ranks on this machine (``LOCAL_WORLD_SIZE``; None: ``world``, one
    machine); every rank must see the same value, since the backend is chosen from it.
    ``cuda_count``: GPUs visible to the rank (0: no CUDA). ``shared``: more ranks on this
    machine than GPUs, so ranks share GPUs (``cuda:local_rank % cuda_count``) and talk gloo
    (one NCCL communicator cannot have two ranks on one GPU).
    """
    if cuda_count <= 0:
        return "cpu", "gloo", False
    local = rank if local_rank is None else local_rank
    on_machine = world if local_world is None else local_world
    if not 0 <= local < on_machine:
        raise ValueError(f"local rank {local} is not in [0, {on_machine}) (ranks on this machine)")
    shared = on_machine > cuda_count
    return f"cuda:{local % cuda_count}", "gloo" if shared else "nccl", shared


def init_kwargs(backend: str, world: int, device: torch.device) -> dict:
    """Extra ``init_process_group`` arguments: ``device_id`` binds NCCL to the rank's GPU
    (eager communicator, no device guessing); not for gloo, and not on one rank, where a
    bound device makes every ``new_group`` an ``ncclCommSplit`` with no peer (DeepSpeed
    leaves it out there too)."""
    return {"device_id": device} if backend == "nccl" and world > 1 else {}


def init_rank(rank: int, world: int, init_method: str) -> torch.device:
    """Choose this rank's device and backend from ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (the
    rank and world when unset), make the device current, then ``init_process_group``."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name, backend, shared = pick_device_and_backend(
        rank, local_rank, world, count, local_world=local_world
    )
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work and before the process group
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
        **init_kwargs(backend, world, device),
    )
    if shared and rank == 0:
        from ulysses_cp.core.log import configure_logging

        configure_logging().info(
            f"{local_world} ranks on this machine share "
            f"{count} GPU(s): gloo with CUDA tensors (ring point-to-point staged through the "
            "host), so times are not NCCL times"
        )
    return device


def _entry(rank, body, world, args, init_file, result_file):
    # The spawned ranks are all on this machine: an inherited LOCAL_RANK (a benchmark run
    # from inside a launched job) would put every rank on one GPU.
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    device = init_rank(rank, world, f"file://{init_file}")
    try:
        result = body(rank, world, args, device)
        if rank == 0:
            Path(result_file).write_text(json.dumps(result))
    except BaseException:
        dist.destroy_process_group()
        raise  # to mp.spawn, as usual
    # done, and the result is on disk: leave without the interpreter's teardown, where
    # gloo's threads once aborted a finished rank (exit_process's docstring)
    exit_process()


_GIVEN: set[int] = set()  # the ports free_port handed out in this process
_LOWEST_PORT = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's
    ``ip_local_port_range``; the usual default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launcher's master port, never the same twice
    in one process.

    Drawn at random below the ephemeral range: the OS takes the local ports of outgoing
    connections (gloo's, a TCP store client's) from that range, so a port found free there
    (by binding port 0) can be taken by another run's connection before the launched rank
    binds it, seconds later (``EADDRINUSE``). Where the range leaves no room below it, the
    OS's pick."""
    for port in _candidate_ports(ephemeral_ports()[0]):
        if port not in _GIVEN and _bindable(port):
            _GIVEN.add(port)
            return port
    raise AssertionError("unreachable: the OS's picks never run out")


def _candidate_ports(low: int) -> Iterator[int]:
    """Up to 100 random ports below ``low`` (where there are at least 1000), then the OS's."""
    draw = random.SystemRandom()  # not the seeded module generator: runs seed it alike
    if low - _LOWEST_PORT >= 1000:
        for _ in range(100):
            yield draw.randrange(_LOWEST_PORT, low)
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield port  # closed first: the caller binds it to check


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_method() -> str:
    """``forkserver`` with the script preloaded: the ranks fork from one process that
    imported the script's modules once, where spawned ranks would each import torch (and
    transformers, DeepSpeed) again: 4-5 s less per 4-rank launch on this 2-core machine. The
    server imports the script without running it and touches no GPU, so CUDA starts in
    each rank as with ``spawn``."""
    mp.set_forkserver_preload(["__main__"])
    return "forkserver"


def parse_args(p, **quick):
    """``p.parse_args()`` where ``--quick`` (a flag of ``p``) makes ``quick`` the defaults,
    so a flag given with it still wins."""
    if p.parse_args().quick:
        p.set_defaults(**quick)
    return p.parse_args()


def run_ranks(body, world: int, args):
    """``body(rank, world, args, device)`` on ``world`` spawned ranks on this machine (a
    module-level function; ``device``: the rank's, see :func:`pick_device_and_backend`);
    returns what rank 0 returned (JSON-serialisable)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(
            _entry,
            args=(body, world, args, os.path.join(tmp, "store"), result),
            nprocs=world,
            start_method=_start_method(),
        )
        return json.loads(Path(result).read_text())


def _comm_device(device: torch.device) -> torch.device:
    """Where bookkeeping tensors live: the rank's device under NCCL (it has no CPU
    support); the CPU under gloo, which supports CPU tensors for every collective."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def gather_floats(values, device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), index = rank, as float64 numbers
    (exact for integers below 2**53)."""
    mine = torch.tensor(
        [float(v) for v in values], dtype=torch.float64, device=_comm_device(device)
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def max_over_ranks(x: float, device: torch.device) -> float:
    """The largest ``x`` over the ranks."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=_comm_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier(device: torch.device) -> None:
    """All ranks meet; under NCCL on the rank's own GPU (``device_ids``), not the current
    device's guess."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
