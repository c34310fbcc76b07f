"""A batch's shard, and what attention needs to know about it, derived once per batch.

Legend: b batch, s full sequence, P = sp_world_size, s_l = s / P local tokens.

:func:`shard_batch` takes full ``(b, s)`` tensors that every SP rank holds and returns this
rank's ``input_ids``, global ``position_ids`` and ``shift_labels`` (labels shifted on the
full sequence, so no target is lost at a shard border), and a :class:`BatchPlan` under
``"batch"``. The plan is what the models hand to every attention call of the batch
(``model(ids, pos, local["batch"])``): a packed row's checked document bounds, its
document plan at the attention level (made by the first call, reused by every other layer,
ring step and backward), and the cross-rank input check, made by the first attention call
of the batch and skipped by the calls that repeat its signature (the other layers, the
recomputed forward of activation checkpointing).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .options import check_packing
from .rows import RowDocs
from .sharding import (
    check_same_on_every_rank,
    check_sequence_length,
    layout_indices,
    layout_of,
    sequence_multiple,
)
from .topology import Topology
from .varlen import (
    IGNORE,
    Docs,
    check_cu_seqlens,
    doc_layout_indices,
    inverse_permutation,
    ulysses_permutation,
)

__all__ = [
    "BatchPlan",
    "shard_batch",
    "shift_labels",
]

# the all-to-all output permutation and its inverse (Ulysses degree > 1, document-wise), and
# this rank's documents at the ring / kernel level (document-wise Docs, row-wise RowDocs)
Documents = tuple[tuple[torch.Tensor, torch.Tensor] | None, Docs | RowDocs]


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """One batch as the SP ranks hold it: the run's ``layout``, the full length ``seq_len``,
    ``batch_size``, the degrees and this rank's place, and for a packed row the global
    ``cu_seqlens``, their checked ``bounds`` and the ``packing`` (``"document"`` or
    ``"row"``, :mod:`~ulysses_cp.core.varlen`). ``memo`` keeps what the attention calls of
    this batch derive from it (see the module docstring)."""

    layout: str
    seq_len: int
    batch_size: int
    ulysses_degree: int
    ring_degree: int
    sp_rank: int
    cu_seqlens: torch.Tensor | None = None
    bounds: tuple[int, ...] | None = None
    packing: str = "document"
    memo: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        topo: Topology,
        layout: str,
        shape: tuple[int, int],
        cu_seqlens: torch.Tensor | None = None,
        what: str = "batch['cu_seqlens']",
        packing: str | None = None,
    ) -> BatchPlan:
        """The plan of full ``shape = (b, s)`` tensors in ``layout``; ``ValueError`` (with
        the multiple to pad to) when the length or a document does not split over the
        ranks, naming the ``cu_seqlens`` as ``what``. ``packing``: None takes the run's
        (``topo.options.packing``)."""
        b, s = shape
        P = topo.sp_world_size
        m = sequence_multiple(P, layout)
        packing = topo.options.packing if packing is None else packing
        check_packing(packing)
        bounds = None
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(
                    f"cu_seqlens describes one packed row: batch must be 1, got {b}; "
                    f"concatenate the rows into one and join their cu_seqlens"
                )
            if packing == "row":  # only the row splits over the ranks
                check_sequence_length(s, P, layout)
            each = m if packing == "document" else 1  # what every document must split into
            bounds = tuple(check_cu_seqlens(cu_seqlens, s, each, what=what))
        elif s % m:
            raise ValueError(
                f"sequence length {s} must be a multiple of {m} for {P} SP ranks in the "
                f"{layout!r} layout; pad with ucp.pad_batch(batch, {m})"
            )
        u, r = topo.ulysses_degree, topo.ring_degree
        return cls(layout, s, b, u, r, topo.sp_rank, cu_seqlens, bounds, packing)

    @property
    def sp_world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def spans(self) -> list[int]:
        """The lengths of the batch's causal spans: a packed row's documents (their end
        padding with them: the batch does not mark it), else ``batch_size`` rows of
        ``seq_len`` (end padding included likewise). What ``core.flops.step_flops`` takes."""
        if self.bounds is not None:
            return [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]
        return [self.seq_len] * self.batch_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_degree

    def to(self, device: torch.device | str) -> BatchPlan:
        """The same plan with ``cu_seqlens`` on ``device`` (what the batch's tensors get)."""
        cu = self.cu_seqlens
        if cu is None or cu.device == torch.device(device):
            return self
        return replace(self, cu_seqlens=cu.to(device), memo={})

    def check_call(self, q: torch.Tensor, topo: Topology, layout: str, packing: str) -> None:
        """A call of this batch's attention: the same layout, packing, degrees and tokens."""
        have = (topo.ulysses_degree, topo.ring_degree, topo.sp_rank, layout, packing)
        mine = (self.ulysses_degree, self.ring_degree, self.sp_rank, self.layout, self.packing)
        if self.bounds is None:  # unpacked: no packing to agree on
            have, mine = (*have[:4], "-"), (*mine[:4], "-")
        if have != mine:
            raise ValueError(
                f"the batch was sharded for u{mine[0]} r{mine[1]}, SP rank {mine[2]}, layout "
                f"{mine[3]!r}, packing {mine[4]!r} and attention runs u{have[0]} r{have[1]}, "
                f"SP rank {have[2]}, layout {have[3]!r}, packing {have[4]!r}: shard the batch "
                f"with the attention's topology"
            )
        if tuple(q.shape[:2]) != (self.batch_size, self.seq_len // self.sp_world_size):
            raise ValueError(
                f"q {tuple(q.shape)} does not hold this rank's shard of the batch: (batch, "
                f"local seq) must be ({self.batch_size}, {self.seq_len // self.sp_world_size}) "
                f"= the full length {self.seq_len} over {self.sp_world_size} ranks"
            )

    def documents(self, device: torch.device) -> Documents:
        """A packed row's plan at the attention level, made once per device."""
        assert self.bounds is not None, "documents of a packed row only"
        key = ("documents", str(device))
        if key not in self.memo:
            bounds, u, r = list(self.bounds), self.ulysses_degree, self.ring_degree
            perm = None
            if self.packing == "row":  # the unpacked all-to-all; the ring level's blocks
                rows = RowDocs(bounds, r, self.ring_rank, self.layout, device)
                self.memo[key] = (None, rows)
                return self.memo[key]
            if u > 1:
                fwd = ulysses_permutation(bounds, u, r, self.ring_rank, self.layout)
                perm = (fwd.to(device), inverse_permutation(fwd).to(device))
            self.memo[key] = (perm, Docs.from_bounds(bounds, r, device))
        return self.memo[key]

    def checked(self, signature: Hashable) -> bool:
        """Whether an attention call with this local ``signature`` was checked across the
        ranks already, in this batch; marks it checked."""
        seen = self.memo.setdefault("checked", set())
        found = signature in seen
        seen.add(signature)
        return found


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE) -> torch.Tensor:
    """``(b, s)`` labels -> targets of each position (next token), ``ignore_index`` last."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _targets(batch: dict[str, torch.Tensor], cu: torch.Tensor | None) -> torch.Tensor:
    """``shift_labels`` as given, or ``labels`` (default: the input ids) shifted here."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    if cu is not None and torch.equal(labels, ids):
        raise ValueError(
            "a packed row (cu_seqlens) with labels equal to input_ids: the padding at the "
            "end of each document cannot be told from its tokens, so the last token and "
            "the padding would be trained to predict the pad id. Pass shift_labels (or "
            "labels with -100 on the padding), as ucp.pack_documents returns them"
        )
    targets = shift_labels(labels)
    if cu is not None:
        targets[:, cu[1:].long() - 1] = IGNORE  # no target across a document border
    return targets


def shard_batch(
    batch: dict[str, torch.Tensor], topo: Topology, layout: str | None = None
) -> dict[str, Any]:
    """This SP rank's share of a batch, and the batch's plan.

    Every SP rank must hold the same full tensors: one all-gather of checksums compares
    them, unless the run's ``check_inputs`` is off. A packed row (``cu_seqlens`` in the
    batch, batch size 1) is sharded in the run's packing, its ``labels`` are shifted inside
    each document, and ``cu_seqlens`` is passed on.

    Args:
        batch: Full ``(b, s)`` tensors: ``input_ids`` and either ``shift_labels`` or
            ``labels`` (shifted here, on the full sequence); ``position_ids`` default to
            ``0..s-1``; ``cu_seqlens`` for a packed row; ``token_mask`` (1: a real
            token, 0: padding), sharded alongside when given (what an MoE model's
            load-balancing loss counts).
        topo: The run's topology.
        layout: None takes the run's; one that disagrees raises.

    Returns:
        This rank's ``input_ids``, global ``position_ids`` and ``shift_labels``, each
        ``(b, s / P)``, and the batch's `BatchPlan` under ``"batch"``, which the models
        hand to every attention call.

    Raises:
        ValueError: A length the layout cannot split, a layout that disagrees with the
            run's, packed labels equal to the input ids, bad ``cu_seqlens``, or tensors
            that differ between SP ranks.
    """
    layout = layout_of(topo, layout)
    ids, cu = batch["input_ids"], batch.get("cu_seqlens")
    plan = BatchPlan.of(topo, layout, (ids.shape[0], ids.shape[1]), cu)
    targets = _targets(batch, cu)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    full = {"input_ids": ids, "position_ids": pos, "shift_labels": targets}
    if "token_mask" in batch:
        full["token_mask"] = batch["token_mask"]
    P = topo.sp_world_size
    if P > 1 and topo.check_inputs and topo.sp_group is not None:
        check_same_on_every_rank(list(full.values()), topo, 1, "shard_batch")
    if plan.bounds is None or plan.packing == "row":
        idx = layout_indices(plan.seq_len, P, topo.sp_rank, layout)
    else:
        idx = doc_layout_indices(list(plan.bounds), P, topo.sp_rank, layout)
    out: dict[str, Any] = {k: x.index_select(1, idx.to(x.device)) for k, x in full.items()}
    if cu is not None:
        out["cu_seqlens"] = cu
    out["batch"] = plan
    return out
