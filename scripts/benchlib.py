"""Shared by the benchmark scripts: run a function on N spawned ranks and collect rank 0's
result. gloo on CPU (threads split between the ranks), NCCL with one GPU per rank."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, body, world, args, init_file, result_file):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
    )
    try:
        result = body(rank, world, args, device)
        if rank == 0:
            Path(result_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(body, world: int, args):
    """``body(rank, world, args, device)`` on ``world`` spawned ranks (a module-level
    function); returns what rank 0 returned (JSON-serialisable)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(_entry, args=(body, world, args, os.path.join(tmp, "store"), result), nprocs=world)
        return json.loads(Path(result).read_text())
