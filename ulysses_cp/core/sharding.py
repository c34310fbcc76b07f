"""Layout of tokens across sequence-parallel ranks: shard, gather, pad.

Legend: s full sequence, P = sp_world_size, c = s / (2P) tokens per zigzag chunk.

- ``"contiguous"``: SP rank r holds tokens ``[r*s/P, (r+1)*s/P)``.
- ``"zigzag"``: the sequence is cut into 2P chunks; SP rank r holds chunks r and 2P-1-r
  (in that order), so every rank has the same causal work. The same definition serves
  every mode: after the Ulysses all-to-all a group holds its ranks' pairs in rank order,
  and :func:`pairs_to_natural` reorders them into natural order (for pure Ulysses the
  whole sequence; in hybrid mode the ring rank's two zigzag chunks of ``2 * ring_degree``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import collective, comm_device, group_rank, group_size, stats
from .options import check_layout, check_packing
from .protocols import Group
from .topology import Topology
from .varlen import Permute, check_cu_seqlens, doc_layout_indices, inverse_permutation

__all__ = [
    "check_same_on_every_rank",
    "check_sequence_length",
    "gather_sequence",
    "layout_indices",
    "layout_of",
    "natural_to_pairs",
    "packing_of",
    "pad_batch",
    "pad_to_multiple",
    "pairs_to_natural",
    "sequence_multiple",
    "shard_sequence",
]


def layout_of(topo: Topology | None, layout: str | None = None) -> str:
    """The layout a call uses: the run's unless the call names one.

    Shards, attention and gathers in two layouts would give a wrong result with no error,
    so a layout that disagrees with the run's is refused.

    Args:
        topo: The run's topology (its ``layout`` is fixed by ``init_topology`` or the
            ``"sequence_parallel"`` block).
        layout: The call's ``layout=``; None takes the run's.

    Returns:
        The layout.

    Raises:
        ValueError: An unknown layout, or one that disagrees with the run's (naming both).
    """
    run = getattr(topo, "layout", "zigzag")
    if layout is None:
        return run
    check_layout(layout)
    if layout != run:
        raise ValueError(
            f"layout={layout!r} disagrees with the run's layout {run!r} (set by "
            f"ucp.init_topology(..., layout={run!r}) or the sequence_parallel block): tokens "
            f"sharded in one layout and attended or gathered in another give wrong results. "
            f"Leave layout= out to use the run's, or build the topology with "
            f"layout={layout!r}"
        )
    return layout


def check_same_on_every_rank(
    tensors: list[torch.Tensor], topo: Topology, dim: int, what: str = "shard_sequence"
) -> None:
    """Every SP rank must shard the SAME full tensors: a rank with other data (another
    seed, another sample) silently gives a wrong result. One all-gather of two float64
    checksums per tensor (the sum, and the sum of the first half along ``dim``, which also
    sees a reordering); ranks compare the same table, so all raise or none does."""
    with torch.no_grad():
        sums = torch.stack(
            [
                s
                for x in tensors
                for s in (
                    x.sum(dtype=torch.float64),
                    x.narrow(dim, 0, x.shape[dim] // 2).sum(dtype=torch.float64),
                )
            ]
        )
    sums = sums.to(comm_device(topo.sp_group, sums.device))
    parts = [torch.empty_like(sums) for _ in range(topo.sp_world_size)]
    with collective("all_gather", "input check", topo.sp_group):
        dist.all_gather(parts, sums, group=topo.sp_group)
    stats.add("all_gather", "input check", sums.numel() * sums.element_size())
    rows = [[float(v).hex() for v in p.tolist()] for p in parts]  # NaN equals NaN here
    if any(row != rows[0] for row in rows):
        table = ", ".join(f"rank {r} {float.fromhex(row[0]):.6g}" for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: the full tensor differs between sequence-parallel ranks "
            f"(checksums: {table}); every SP rank must hold the same full tensor (the same "
            f"data, or the same seed) and take its own tokens of it. "
            f"sequence_parallel.check_inputs: false (init_topology(check_inputs=False)) "
            f"turns this check off"
        )


def sequence_multiple(sp_world_size: int, layout: str) -> int:
    """The multiple a full sequence length must be of.

    Args:
        sp_world_size: The SP degree ``P``.
        layout: ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``P`` (contiguous) or ``2P`` (zigzag); 1 when ``P`` is 1.

    Raises:
        ValueError: An unknown layout.
    """
    check_layout(layout)
    return sp_world_size * (2 if layout == "zigzag" and sp_world_size > 1 else 1)


def check_sequence_length(seq_len: int, sp_world_size: int, layout: str) -> None:
    m = sequence_multiple(sp_world_size, layout)
    if seq_len % m != 0:
        padded = -(-seq_len // m) * m
        raise ValueError(
            f"sequence length {seq_len} does not split over {sp_world_size} sequence-parallel "
            f"ranks in the {layout!r} layout: it must be a multiple of {m}; pad to {padded} "
            f"with ucp.pad_to_multiple / ucp.pad_batch (end padding with ignored labels "
            f"changes no loss in causal models)"
        )


def pairs_to_natural(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """``n`` pairs ``[a_0, b_0, a_1, b_1, ...]`` along ``dim`` -> ``[a_0..a_{n-1}, b_{n-1}..b_0]``.

    With the zigzag layout the pairs of ranks 0..n-1 are chunks ``(i, 2P-1-i)``, so this
    puts them in increasing chunk order. Differentiable; the backward is the inverse
    reorder (one copy, where autograd through select/flip/cat would build zero-filled
    full-size tensors)."""
    if n == 1:
        return x
    return _Reorder.apply(x, n, dim, _pairs_to_natural, _natural_to_pairs)


def natural_to_pairs(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pairs_to_natural`."""
    if n == 1:
        return x
    return _Reorder.apply(x, n, dim, _natural_to_pairs, _pairs_to_natural)


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, dim, fwd, bwd):
        ctx.args = (n, dim, bwd)
        return fwd(x, n, dim)

    @staticmethod
    def backward(ctx, grad):
        n, dim, bwd = ctx.args
        return bwd(grad, n, dim), None, None, None, None


def _pairs_to_natural(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    pairs = x.unflatten(dim, (n, 2, x.shape[dim] // (2 * n)))  # (.., n, 2, c, ..)
    first = pairs.select(dim + 1, 0).flatten(dim, dim + 1)  # a_0 .. a_{n-1}
    second = pairs.select(dim + 1, 1).flip(dim).flatten(dim, dim + 1)  # b_{n-1} .. b_0
    return torch.cat([first, second], dim=dim)


def _natural_to_pairs(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    first, second = x.chunk(2, dim=dim)
    first = first.unflatten(dim, (n, -1))  # (.., n, c, ..)
    second = second.unflatten(dim, (n, -1)).flip(dim)
    return torch.stack([first, second], dim=dim + 1).flatten(dim, dim + 2)


def layout_indices(seq_len: int, sp_world_size: int, sp_rank: int, layout: str) -> torch.Tensor:
    """The global token indices an SP rank holds, in local order (for position ids).

    Args:
        seq_len: The full length.
        sp_world_size: The SP degree ``P``.
        sp_rank: The rank in the SP group.
        layout: ``"zigzag"`` or ``"contiguous"``.

    Returns:
        ``(seq_len / P,)`` int64 indices.
    """
    idx = torch.arange(seq_len)
    return _shard(idx, sp_world_size, sp_rank, layout, 0)


def _shard(x: torch.Tensor, P: int, rank: int, layout: str, dim: int) -> torch.Tensor:
    if layout == "zigzag":
        x = natural_to_pairs(x, P, dim)
    return x.chunk(P, dim=dim)[rank]


def _gather(x: torch.Tensor, group: Group, layout: str, dim: int) -> torch.Tensor:
    P = group_size(group)
    if P == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(P)]
    with collective("all_gather", "gather_sequence", group):
        dist.all_gather(parts, x.contiguous(), group=group)
    full = torch.cat(parts, dim=dim)  # the ranks' pieces in SP-rank order
    return pairs_to_natural(full, P, dim) if layout == "zigzag" else full


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout, dim):
        ctx.args = (group, layout, dim)
        return _gather(x, group, layout, dim)

    @staticmethod
    def backward(ctx, grad):
        group, layout, dim = ctx.args
        return _shard(grad, group_size(group), group_rank(group), layout, dim), None, None, None


def packing_of(topo: Topology | None, packing: str | None = None) -> str:
    """The packing a call uses: the run's (``topo.options.packing``) when ``packing`` is
    None, else ``packing`` (checked)."""
    if packing is None:
        options = getattr(topo, "options", None)
        packing = getattr(options, "packing", "document")
    check_packing(packing)
    return packing


def _packed(cu_seqlens, seq_len: int, P: int, layout: str, packing: str) -> list[int] | None:
    """A packed row's checked boundaries when it is sharded document-wise; None when the
    row is sharded like an unpacked one (no ``cu_seqlens``, or row-wise packing)."""
    if cu_seqlens is None:
        return None
    if packing == "row":
        check_cu_seqlens(cu_seqlens, seq_len, 1)
        return None
    return check_cu_seqlens(cu_seqlens, seq_len, sequence_multiple(P, layout))


def shard_sequence(
    x: torch.Tensor,
    topo: Topology,
    dim: int = 1,
    layout: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    packing: str | None = None,
) -> torch.Tensor:
    """This SP rank's tokens of a tensor every SP rank holds in full.

    Args:
        x: The full tensor, the same on every SP rank.
        topo: The run's topology.
        dim: The sequence dimension of ``x``.
        layout: ``"zigzag"`` or ``"contiguous"``; None takes the run's (``topo.layout``).
        cu_seqlens: ``x`` is a packed row with these int32 document boundaries; it is
            sharded in the run's packing: ``"document"`` splits every document on its own,
            ``"row"`` splits the row like an unpacked sequence.
        packing: Overrides the run's packing for this call.

    Returns:
        This rank's shard: ``x.shape[dim] / P`` tokens along ``dim``.

    Raises:
        ValueError: A length that does not split (the message names the multiple to pad
            to), a layout that disagrees with the run's, bad ``cu_seqlens``, or an ``x``
            that differs between SP ranks (when ``topo.check_inputs`` is on).
    """
    layout = layout_of(topo, layout)
    P = topo.sp_world_size
    bounds = _packed(cu_seqlens, x.shape[dim], P, layout, packing_of(topo, packing))
    if P > 1 and getattr(topo, "check_inputs", False) and topo.sp_group is not None:
        check_same_on_every_rank([x], topo, dim)
    if bounds is not None:
        idx = doc_layout_indices(bounds, P, topo.sp_rank, layout).to(x.device)
        return x.index_select(dim, idx)
    check_sequence_length(x.shape[dim], P, layout)
    return _shard(x, P, topo.sp_rank, layout, dim)


def gather_sequence(
    x_local: torch.Tensor,
    topo: Topology,
    dim: int = 1,
    layout: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    packing: str | None = None,
) -> torch.Tensor:
    """The full tensor from every SP rank's shard: the exact inverse of `shard_sequence`.

    An all-gather over the SP group. Its backward returns this rank's slice of the
    incoming gradient, which is right when every SP rank computes the same function of
    the gathered tensor.

    Args:
        x_local: This rank's shard.
        topo: The run's topology.
        dim: The sequence dimension.
        layout: None takes the run's; one that disagrees raises.
        cu_seqlens: The packed row's int32 document boundaries, as given to
            `shard_sequence`.
        packing: Overrides the run's packing for this call.

    Returns:
        The full tensor, ``P`` times ``x_local``'s length along ``dim``, on every SP rank.

    Raises:
        ValueError: A layout that disagrees with the run's, or bad ``cu_seqlens``.
    """
    layout = layout_of(topo, layout)
    P = topo.sp_world_size
    bounds = _packed(cu_seqlens, x_local.shape[dim] * P, P, layout, packing_of(topo, packing))
    if bounds is None or P == 1:
        return _Gather.apply(x_local, topo.sp_group, layout, dim)
    held = torch.cat([doc_layout_indices(bounds, P, p, layout) for p in range(P)])
    full = _Gather.apply(x_local, topo.sp_group, "contiguous", dim)  # rank order
    return Permute.apply(full, inverse_permutation(held), held, dim)


def pad_to_multiple(
    x: torch.Tensor, multiple: int, *, dim: int = 1, value: float | int = 0
) -> torch.Tensor:
    """Pad a tensor at the end of one dimension up to a multiple.

    Args:
        x: The tensor.
        multiple: The length along ``dim`` becomes a multiple of this (see
            `sequence_multiple`).
        dim: The dimension to pad.
        value: The fill value.

    Returns:
        ``x`` itself when its length is already a multiple, else a padded copy.
    """
    pad = -x.shape[dim] % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def pad_batch(
    batch: dict[str, torch.Tensor],
    multiple: int,
    *,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """Pad a batch's ``(b, s)`` tensors at the end so ``s`` is a multiple.

    In a causal model end padding changes neither the real tokens' outputs nor the loss:
    padded tokens come after every real token and carry no target. Non-causal attention
    would attend to padded keys; pack them as a separate document instead.

    Args:
        batch: Full ``(b, s)`` tensors by name.
        multiple: The multiple (see `sequence_multiple`).
        pad_token_id: The fill value of ``input_ids`` and any other tensor.
        ignore_index: The fill value of ``labels`` and ``shift_labels``.

    Returns:
        The padded batch; ``position_ids`` keep counting.
    """
    out = {}
    for key, x in batch.items():
        if key in ("labels", "shift_labels"):
            out[key] = pad_to_multiple(x, multiple, value=ignore_index)
        elif key == "position_ids":
            pad = -x.shape[1] % multiple
            tail = x[:, -1:] + torch.arange(1, pad + 1, device=x.device, dtype=x.dtype)
            out[key] = torch.cat([x, tail], dim=1) if pad else x
        else:
            out[key] = pad_to_multiple(x, multiple, value=pad_token_id)
    return out
