"""Degrees -> process groups.

Rank layout (USP, arXiv:2405.07719): data parallel is outermost, then ring, then ulysses.
Inside each data-parallel block of ``u * r`` ranks starting at ``off``:

- ulysses groups are contiguous: ``[off + i*u, off + (i+1)*u)`` (fast links, one node);
- ring groups are strided: ``{off + j, off + j + u, ..., off + j + (r-1)*u}``;
- the sequence-parallel (SP) group is the whole block, and ``sp_rank = ring_rank * u +
  ulysses_rank``.

Data-parallel groups join the ranks with the same ``sp_rank`` across blocks.

Example, 8 ranks, u=4, r=2: ulysses {0-3}, {4-7}; ring {0,4}, {1,5}, {2,6}, {3,7}.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .comm import name_group
from .options import Backend, KVExchange, Layout, Packing, RunOptions
from .protocols import Group

__all__ = [
    "GroupPlan",
    "Topology",
    "init_topology",
    "plan_groups",
    "validate_degrees",
]


@dataclass(frozen=True)
class GroupPlan:
    """Which ranks form each group; pure arithmetic, no processes needed."""

    world_size: int
    ulysses_degree: int
    ring_degree: int
    ulysses_groups: list[list[int]]
    ring_groups: list[list[int]]
    sp_groups: list[list[int]]
    dp_groups: list[list[int]]

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def dp_degree(self) -> int:
        return self.world_size // self.sp_degree


def validate_degrees(world_size: int, ulysses_degree: int, ring_degree: int) -> None:
    """Raise ``ValueError`` naming every number when the degrees do not fit the world."""
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sp = ulysses_degree * ring_degree
    if world_size % sp != 0:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"ulysses_degree({ulysses_degree}) * ring_degree({ring_degree}) = {sp} does not "
            f"divide WORLD_SIZE({world_size}); the sequence-parallel degree must be one of "
            f"{fits} (data-parallel degree = WORLD_SIZE / (ulysses_degree * ring_degree))"
        )


def plan_groups(world_size: int, ulysses_degree: int, ring_degree: int) -> GroupPlan:
    """Enumerate all groups, in the same order on every rank."""
    validate_degrees(world_size, ulysses_degree, ring_degree)
    u, r = ulysses_degree, ring_degree
    sp = u * r
    dp = world_size // sp
    ulysses, ring, sp_groups = [], [], []
    for block in range(dp):
        off = block * sp
        sp_groups.append(list(range(off, off + sp)))
        ulysses += [list(range(off + i * u, off + (i + 1) * u)) for i in range(r)]
        ring += [[off + j + k * u for k in range(r)] for j in range(u)]
    dp_groups = [[block * sp + s for block in range(dp)] for s in range(sp)]
    return GroupPlan(world_size, u, r, ulysses, ring, sp_groups, dp_groups)


@dataclass
class Topology:
    """Process groups and degrees for one rank. Groups are ``None`` when the run is local."""

    rank: int
    world_size: int
    ulysses_degree: int
    ring_degree: int
    ulysses_group: Group = None
    ring_group: Group = None
    sp_group: Group = None
    dp_group: Group = None
    # every rank / this rank alone: what DeepSpeed's mpu asks for (ZeRO's sequence-data-
    # parallel and model-parallel groups), made once here rather than per engine
    all_group: Group = None
    self_group: Group = None
    # the run's choices (layout, backend, input checks, gradient scale): frozen, read by
    # every call that takes the topology; another choice is another value (with_options)
    options: RunOptions = field(default_factory=RunOptions)
    _owned: list = field(default_factory=list, repr=False)

    def with_options(self, **changes: Any) -> Topology:
        """The same process groups with other run choices (a new value: this topology and
        everything built with it keep theirs; the groups are shared, so destroy only one)."""
        return replace(self, options=replace(self.options, **changes))

    def with_layout(self, layout: str) -> Topology:
        """``with_options(layout=layout)``."""
        return self.with_options(layout=layout)

    @property
    def layout(self) -> str:
        """The run's token layout: used by every call that takes the topology."""
        return self.options.layout

    @property
    def backend(self) -> str:
        """The run's local attention backend (a call's ``backend=`` overrides it)."""
        return self.options.backend

    @property
    def check_inputs(self) -> bool:
        """Whether attention and sharding compare every SP rank's inputs first."""
        return self.options.check_inputs

    @property
    def grad_scale(self) -> float:
        """Multiplies the SP loss gradient (see ``ulysses_cp.models.loss``)."""
        return self.options.grad_scale

    @property
    def sp_world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def dp_degree(self) -> int:
        return self.world_size // self.sp_world_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_world_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_world_size

    @property
    def mode(self) -> str:
        """``"local"``, ``"ulysses"``, ``"ring"`` or ``"hybrid"``."""
        if self.sp_world_size == 1:
            return "local"
        if self.ring_degree == 1:
            return "ulysses"
        if self.ulysses_degree == 1:
            return "ring"
        return "hybrid"

    def destroy(self) -> None:
        """Destroy the process groups this topology created (not the default group)."""
        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()
        self.ulysses_group = self.ring_group = self.sp_group = self.dp_group = None
        self.all_group = self.self_group = None


_DEFAULT = RunOptions()


def init_topology(
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    *,
    layout: Layout = _DEFAULT.layout,
    backend: Backend = _DEFAULT.backend,
    check_inputs: bool = _DEFAULT.check_inputs,
    grad_scale: float = _DEFAULT.grad_scale,
    kv_exchange: KVExchange = _DEFAULT.kv_exchange,
    head_chunks: int = _DEFAULT.head_chunks,
    redo_all_to_all: bool = _DEFAULT.redo_all_to_all,
    packing: Packing = _DEFAULT.packing,
    timeout_s: float | None = None,
) -> Topology:
    """Build the process groups of sequence and data parallelism (module docstring).

    Every rank must call this with the same arguments (group creation is collective).
    Without an initialised ``torch.distributed`` only ``1 x 1`` is allowed (a local
    topology). The keywords from ``layout`` to ``packing`` are the run's options
    (:class:`~ulysses_cp.core.options.RunOptions`, where each is described), fixed here
    and read by every call that takes the topology; a ``layout=`` given to such a call
    that disagrees is an error.

    Args:
        ulysses_degree: ranks in each Ulysses (head all-to-all) group, contiguous ranks.
        ring_degree: ranks in each ring (KV exchange) group, strided ranks.
        layout: how tokens are sharded: ``"zigzag"`` (causal work balanced) or
            ``"contiguous"``.
        backend: the local attention kernel, one of ``ucp.BACKENDS``.
        check_inputs: compare every SP rank's inputs before communicating.
        grad_scale: multiplies the gradient of the SP loss (the SP degree under ZeRO-3).
        kv_exchange: how KV moves inside a ring group: ``"ring"`` or ``"allgather"``.
        head_chunks: the Ulysses all-to-alls in this many chunks of heads (0: automatic).
        redo_all_to_all: redo the Ulysses all-to-alls in the backward instead of keeping
            head-sharded copies (less memory, more traffic).
        packing: how packed rows are split: ``"document"`` or ``"row"``.
        timeout_s: the collective timeout of the new groups (None: the default group's).

    Returns:
        This rank's :class:`Topology`: its groups (None where the run is local), degrees
        and options (``topo.options``).

    Raises:
        ValueError: degrees that are not positive integers or do not divide the world
            size, or an option out of its range (naming the value).
        TypeError: an unknown keyword.
    """
    options = RunOptions(
        layout=layout,
        backend=backend,
        check_inputs=check_inputs,
        grad_scale=grad_scale,
        kv_exchange=kv_exchange,
        head_chunks=head_chunks,
        redo_all_to_all=redo_all_to_all,
        packing=packing,
    )
    if not dist.is_available() or not dist.is_initialized():
        validate_degrees(1, ulysses_degree, ring_degree)
        return Topology(rank=0, world_size=1, ulysses_degree=1, ring_degree=1, options=options)
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = plan_groups(world, ulysses_degree, ring_degree)
    topo = Topology(
        rank=rank,
        world_size=world,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        options=options,
    )
    kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    for attr, groups in (
        ("ulysses_group", plan.ulysses_groups),
        ("ring_group", plan.ring_groups),
        ("sp_group", plan.sp_groups),
        ("dp_group", plan.dp_groups),
        ("all_group", [list(range(world))]),
        ("self_group", [[r] for r in range(world)]),
    ):
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, **kwargs)
            name_group(group, attr.removesuffix("_group"))
            topo._owned.append(group)
            if rank in ranks:
                setattr(topo, attr, group)
    return topo
