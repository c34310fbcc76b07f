"""Which node each rank lives on, and whether the process groups respect the nodes.

The rank layout (``ulysses_cp.core.topology``) puts each ulysses group on consecutive
ranks, and every launcher (DeepSpeed's, torchrun, ``srun``) numbers the ranks node by
node, so with ``ulysses_degree`` dividing the GPUs per node each all-to-all stays inside a
node and only the ring (and data-parallel) traffic crosses nodes.
"""

from __future__ import annotations

import json
import os
import socket

import torch.distributed as dist

from ..core.topology import Topology

__all__ = ["NODE_ENV", "gather_groups", "group_spans", "node_of", "this_node"]

# the node index each launcher exports: DeepSpeed's launcher, torchrun, SLURM's srun
NODE_ENV = ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID")


def this_node() -> str:
    """This process's node: the launcher's node index, else the host name."""
    for key in NODE_ENV:
        if os.environ.get(key, "") != "":
            return os.environ[key]
    return socket.gethostname()


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node of ``rank`` when the launcher numbers ranks node by node."""
    return rank // gpus_per_node


def group_spans(
    groups: list[list[int]], node: dict[int, str] | None = None, *, gpus_per_node: int | None = None
) -> list[int]:
    """How many nodes each group touches (from ``node``: rank -> node, or ranks numbered
    node by node with ``gpus_per_node``)."""
    if node is None:
        if not gpus_per_node:
            raise ValueError("group_spans needs node (rank -> node) or gpus_per_node")
        return [len({node_of(r, gpus_per_node) for r in g}) for g in groups]
    return [len({node[r] for r in g}) for g in groups]


def gather_groups(topo: Topology) -> dict:
    """Every rank's node and its ulysses and ring groups as the processes built them
    (collective: every rank calls it): ``{"nodes": {node: ranks}, "ulysses": [...],
    "ring": [...]}``, each group once, in rank order."""
    world = dist.get_world_size()
    mine = (
        dist.get_rank(),
        this_node(),
        dist.get_process_group_ranks(topo.ulysses_group),
        dist.get_process_group_ranks(topo.ring_group),
    )
    rows: list = [None] * world
    dist.all_gather_object(rows, mine)
    nodes: dict[str, list[int]] = {}
    ulysses: list[list[int]] = []
    ring: list[list[int]] = []
    for rank, host, u, r in sorted(rows):
        nodes.setdefault(host, []).append(rank)
        for seen, g in ((ulysses, sorted(u)), (ring, sorted(r))):
            if g not in seen:
                seen.append(g)
    return {"nodes": nodes, "ulysses": ulysses, "ring": ring}


def describe(groups: dict) -> tuple[str, str | None]:
    """One log line for :func:`gather_groups`' result, and a warning (or None) when an
    all-to-all group crosses nodes."""
    line = "process groups: " + json.dumps(groups, separators=(",", ":"))
    node = {r: n for n, ranks in groups["nodes"].items() for r in ranks}
    wide = [g for g, n in zip(groups["ulysses"], group_spans(groups["ulysses"], node)) if n > 1]
    if not wide:
        return line, None
    per_node = min(len(r) for r in groups["nodes"].values())
    return line, (
        f"ulysses groups {wide} span several nodes: their all-to-all crosses the inter-node "
        f"link. Make sequence_parallel.ulysses_degree divide the ranks per node ({per_node}) "
        f"and put the rest of the sequence-parallel degree in ring_degree."
    )
