"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with sequence parallelism: one call builds
the device mesh and the topology together (example: docs/fsdp2/index.md).

The mesh has three dims, outermost first: ``"dp"`` (data parallel), ``"ring"`` and
``"ulysses"``, over the ranks in order, so that a rank's place in it is its place in
``ucp.init_topology``'s groups (``rank = dp_rank * sp + ring_rank * u + ulysses_rank``).
``fully_shard`` takes the whole mesh flattened (``shard_mesh``): the sequence-parallel
ranks are inside the sharding group, as torchtitan folds context parallelism into its FSDP
mesh, and FSDP's reduce-scatter sums every rank's gradient share.

The one rule: FSDP2 divides the reduced gradient by the ``dp * sp`` ranks it shards over,
while the ``sp`` ranks of a replica each hold a share of one sequence, so each rank's loss
is its tokens' share of its sequence's mean loss times ``sp`` (``loss_scale``). The
topology built here carries that factor as ``grad_scale``, so
``ucp.sequence_parallel_cross_entropy``, ``ulysses_cp.models.hf.HFCausalLM.loss`` and the
other losses of the package apply it; a hand-written loss multiplies by ``loss_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.options import RunOptions, reduction_grad_scale
from ..core.topology import Topology

__all__ = ["FSDPMesh", "fsdp_mesh"]

DIMS = ("dp", "ring", "ulysses")


@dataclass(frozen=True)
class FSDPMesh:
    """What `fsdp_mesh` builds: the meshes for ``fully_shard`` and ``context_parallel``
    and the topology for ``ucp.attention``, over the same ranks.

    Attributes:
        mesh: The ``("dp", "ring", "ulysses")`` device mesh.
        shard_mesh: The 1-D mesh ``fully_shard(module, mesh=...)`` takes: every dim of
            ``mesh`` flattened (``"dp_sp"``), data and sequence ranks together.
        cp_mesh: The ``("ring", "ulysses")`` sub-mesh, for ``ucp.context_parallel`` (it
            runs Ulysses, the ring or the hybrid by the degrees).
        topology: This rank's :class:`~ulysses_cp.core.topology.Topology` over the mesh's
            groups, for ``ucp.attention``, ``ucp.Attention``, ``ucp.shard_batch`` and
            ``ulysses_cp.models.hf.register_attention``; its ``grad_scale`` is ``sp``.
    """

    mesh: Any
    shard_mesh: Any
    cp_mesh: Any
    topology: Topology

    @property
    def dp(self) -> int:
        """The data-parallel degree."""
        return self.topology.dp_degree

    @property
    def sp(self) -> int:
        """The sequence-parallel degree, ``ulysses * ring``."""
        return self.topology.sp_world_size

    @property
    def loss_scale(self) -> float:
        """What a hand-written per-rank loss is multiplied by: ``sp`` (the module docstring's
        rule); the package's losses apply it through ``topology.grad_scale``."""
        return float(self.sp)


def _agreed(sizes: list[Any], device: torch.device) -> list[list[int]]:
    """Every rank's ``sizes`` (-1 for a value that is not a positive int), gathered before
    any check so that a bad or disagreeing value is refused on every rank."""
    mine = [v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else -1 for v in sizes]
    mine = [0 if s is None else v for s, v in zip(sizes, mine)]  # dp=None: inferred
    n = dist.get_world_size()
    parts = [torch.zeros(len(sizes), dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(parts, torch.tensor(mine, dtype=torch.int64, device=device))
    return [p.tolist() for p in parts]


def _check_sizes(given: list[Any], every: list[list[int]], world: int) -> int:
    """The data-parallel degree, or a ``ValueError`` naming the numbers and the fix."""
    names = ("dp", "ulysses", "ring")
    if any(row != every[0] for row in every):
        seen = "; ".join(f"rank {i}: {dict(zip(names, row))}" for i, row in enumerate(every))
        raise ValueError(
            f"fsdp_mesh: the ranks disagree on the sizes ({seen}; 0 = dp inferred, -1 = not a "
            f"positive integer); call it with the same dp, ulysses and ring on every rank"
        )
    for name, value, got in zip(names, given, every[0]):
        if got == -1 or (got == 0 and name != "dp"):
            raise ValueError(f"fsdp_mesh: {name} must be a positive integer, got {value!r}")
    dp, u, r = every[0]
    sp = u * r
    if dp == 0:
        if world % sp:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"fsdp_mesh: ulysses({u}) * ring({r}) = {sp} does not divide the world size "
                f"({world}); choose ulysses * ring among {fits}, or launch a multiple of {sp} "
                f"ranks"
            )
        return world // sp
    if dp * sp != world:
        raise ValueError(
            f"fsdp_mesh: dp({dp}) * ulysses({u}) * ring({r}) = {dp * sp} ranks, but the world "
            f"has {world}; make the product {world} (dp=None infers dp = world / (ulysses * "
            f"ring)), or launch {dp * sp} ranks"
        )
    return dp


def fsdp_mesh(
    dp: int | None = None,
    ulysses: int = 1,
    ring: int = 1,
    *,
    device_type: str | None = None,
    **options: Any,
) -> FSDPMesh:
    """The device mesh for ``fully_shard`` and the sequence-parallel topology, built together.

    Every rank calls it with the same arguments, after ``dist.init_process_group`` (the
    meshes' groups are made collectively). Sizes are gathered from every rank first, so a
    bad size is refused on every rank.

    Args:
        dp: The data-parallel degree; None: ``world / (ulysses * ring)``.
        ulysses: The Ulysses (head all-to-all) degree.
        ring: The ring (KV exchange) degree.
        device_type: The mesh's device type; None: ``"cuda"`` when CUDA is available,
            else ``"cpu"``.
        **options: Run options of ``ucp.init_topology`` (``layout``, ``backend``,
            ``kv_exchange``, ``head_chunks``, ...); ``grad_scale`` is set here (``sp``).

    Returns:
        The meshes and the topology (:class:`FSDPMesh`).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: Sizes that are not positive integers, differ between ranks, or whose
            product is not the world size (the message names them and the fix); an
            option out of its range, or ``grad_scale``.
    """
    if "grad_scale" in options:
        raise ValueError(
            f"fsdp_mesh sets grad_scale itself (the sequence-parallel degree, for FSDP's mean "
            f"over dp * sp ranks); got grad_scale={options['grad_scale']!r}: leave it out"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fsdp_mesh needs torch.distributed initialised: launch with torchrun and call "
            "torch.distributed.init_process_group() first (gloo on CPU, nccl on GPU)"
        )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    world, given = dist.get_world_size(), [dp, ulysses, ring]
    n_dp = _check_sizes(given, _agreed(given, device), world)
    scale = reduction_grad_scale(ulysses * ring, averages_over_sp=True)  # over dp x sp
    run_options = RunOptions(**options, grad_scale=scale)

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (n_dp, ring, ulysses), mesh_dim_names=DIMS)
    cp_mesh = mesh["ring", "ulysses"]
    topology = Topology(
        rank=dist.get_rank(),
        world_size=world,
        ulysses_degree=ulysses,
        ring_degree=ring,
        ulysses_group=mesh.get_group("ulysses"),
        ring_group=mesh.get_group("ring"),
        sp_group=cp_mesh._flatten().get_group(),
        dp_group=mesh.get_group("dp"),
        options=run_options,
    )
    return FSDPMesh(mesh, mesh._flatten("dp_sp"), cp_mesh, topology)
