"""Packed variable-length rows: documents, their layout across ranks, and packing.

Legend: a packed row holds documents ``d`` of lengths ``L_d`` back to back; ``cu`` is the
int32 cumulative length vector ``[0, L_0, L_0 + L_1, ..., N]`` (flash-attn's
``cu_seqlens``); P ranks; ``m = sequence_multiple(P, layout)``.

Document-wise layout (``packing="document"``): every document is split like a whole sequence
would be (contiguous: P chunks, rank r takes chunk r; zigzag: 2P chunks, rank r takes chunks
r and 2P-1-r), and each rank concatenates its pieces in document order. So each rank holds
``L_d / P`` tokens of every document (every rank has the same causal work in every
document), its local tokens keep increasing global order, and its local ``cu`` is ``cu /
P``. This needs every ``L_d`` to be a multiple of ``m``; :func:`pack_documents` pads each
document at its end. A one-document ``cu = [0, N]`` gives exactly the unpacked layout.

Row-wise layout (``packing="row"``, :mod:`~ulysses_cp.core.rows`): the row is split like an
unpacked sequence of N tokens and documents cross rank borders; only N must be a multiple
of m (:func:`pack_documents` with ``row_multiple=m`` pads the row, not its documents).
Attention follows the global ``cu``. The run chooses one (``RunOptions.packing``, the
``"sequence_parallel"`` block's ``packing``); ``"document"`` is the default.

Why the same document-wise definition serves every mode: the Ulysses group of ring rank j (SP ranks
``j*u .. j*u+u-1``) holds, per document, chunks ``j*u .. j*u+u-1`` and their mirrors of
2P, which are chunks j and 2r-1-j of 2r: ring rank j's document-wise pieces. After the
all-to-all a fixed permutation (:func:`ulysses_permutation`) puts them in that order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "IGNORE",
    "Docs",
    "Permute",
    "check_cu_seqlens",
    "cu_seqlens_from_position_ids",
    "doc_layout_indices",
    "inverse_permutation",
    "pack_documents",
    "pack_row",
    "ulysses_permutation",
]

IGNORE = -100


def check_cu_seqlens(
    cu: torch.Tensor, seq_len: int, multiple: int = 1, *, what: str = "cu_seqlens"
) -> list[int]:
    """Validate ``cu`` for a packed row of ``seq_len`` tokens; return it as a list.

    Raises ``ValueError`` naming the offending document and the fix."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point:
        raise ValueError(
            f"{what} must be a 1-D integer tensor of cumulative document lengths, got "
            f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__}"
            f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else ''}"
        )
    bounds = cu.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(
            f"{what} must start at 0 and end at the packed row length {seq_len}, got "
            f"{bounds[0] if bounds else None} .. {bounds[-1] if bounds else None}"
        )
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        if b <= a:
            raise ValueError(f"{what} must be strictly increasing: document {i} is [{a}, {b})")
        if (b - a) % multiple:
            raise ValueError(
                f"document {i} has length {b - a}, not a multiple of {multiple}: in this "
                f"layout every document is split evenly over the sequence-parallel ranks. "
                f"Pad each document at its end (ucp.pack_documents(..., multiple={multiple}) "
                f"does), use documents whose lengths are multiples of {multiple}, or use "
                f'the row-wise packing (init_topology(..., packing="row"), the '
                f'sequence_parallel block\'s "packing": "row"), which splits only the row'
            )
    return bounds


def doc_layout_indices(bounds: list[int], P: int, rank: int, layout: str) -> torch.Tensor:
    """Global token indices rank ``rank`` of ``P`` holds, in local order (document-wise);
    ``layout`` is checked by the callers."""
    parts = []
    for a, b in itertools.pairwise(bounds):
        if layout == "contiguous" or P == 1:
            n = (b - a) // P
            parts.append(torch.arange(a + rank * n, a + (rank + 1) * n))
        else:
            c = (b - a) // (2 * P)
            first, second = a + rank * c, a + (2 * P - 1 - rank) * c
            parts += [torch.arange(first, first + c), torch.arange(second, second + c)]
    return torch.cat(parts)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def ulysses_permutation(
    bounds: list[int], u: int, r: int, ring_rank: int, layout: str
) -> torch.Tensor:
    """Index into the all-to-all output (ulysses ranks' local tokens, in rank order) that
    yields ring rank ``ring_rank``'s document-wise tokens over ``r`` ranks, in order."""
    held = torch.cat(
        [doc_layout_indices(bounds, u * r, ring_rank * u + i, layout) for i in range(u)]
    )
    want = doc_layout_indices(bounds, r, ring_rank, layout)
    where = torch.full((bounds[-1],), -1, dtype=torch.long)
    where[held] = torch.arange(held.numel())
    perm = where[want]
    assert (perm >= 0).all() and perm.numel() == held.numel(), "document layout mismatch"
    return perm


class Permute(torch.autograd.Function):
    """``x.index_select(dim, perm)`` whose backward applies the inverse permutation."""

    @staticmethod
    def forward(ctx, x, perm, inv, dim):
        ctx.args = (inv, perm, dim)
        return x.index_select(dim, perm.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        inv, _, dim = ctx.args
        return grad.index_select(dim, inv.to(grad.device)), None, None, None


@dataclass(frozen=True)
class Docs:
    """One rank's documents at one level (local kernel or ring), ``cu`` local.

    ``first``/``second``: indices of every document's first/second half (zigzag steps);
    ``cu_half``: cumulative half lengths."""

    cu: torch.Tensor
    first: torch.Tensor | slice
    second: torch.Tensor | slice
    cu_half: torch.Tensor

    @classmethod
    def from_bounds(cls, bounds: list[int], P: int, device: torch.device) -> Docs:
        local = torch.tensor(bounds, dtype=torch.int32) // P
        lens = (local[1:] - local[:-1]).long()
        half = lens // 2
        starts = local[:-1].long()
        first = torch.cat([torch.arange(s, s + h) for s, h in zip(starts.tolist(), half.tolist())])
        second = first + torch.repeat_interleave(half, half)
        cu_half = torch.cat([torch.zeros(1, dtype=torch.int32), half.cumsum(0).int()])
        if len(bounds) == 2:  # one document: the halves are plain slices (views, no gathers)
            h = int(half[0])
            return cls(local.to(device), slice(0, h), slice(h, 2 * h), cu_half.to(device))
        return cls(local.to(device), first.to(device), second.to(device), cu_half.to(device))


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The int32 ``cu_seqlens`` of a packed row whose position ids restart at 0 per document.

    Args:
        position_ids: ``(s,)`` or ``(1, s)``, in global (unsharded) order.

    Returns:
        The document boundaries, ``(documents + 1,)``, starting at 0 and ending at ``s``.

    Raises:
        ValueError: Another shape, or position ids that do not start at 0.
    """
    pos = position_ids
    if pos.dim() == 2 and pos.shape[0] == 1:
        pos = pos[0]
    if pos.dim() != 1:
        raise ValueError(
            f"position_ids of one packed row are (s,) or (1, s), got {tuple(position_ids.shape)}"
        )
    if pos.numel() == 0 or int(pos[0]) != 0:
        raise ValueError("position_ids of a packed row must start at 0")
    starts = torch.nonzero(pos == 0).flatten()
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def pack_documents(
    documents: list[torch.Tensor],
    *,
    multiple: int = 1,
    row_multiple: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE,
    labels: list[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Pack 1-D token tensors into one row for causal LM training.

    The padding has no target and, in causal attention, comes after every real token of
    its document, so it changes no loss. No target crosses a document border.

    Args:
        documents: Non-empty 1-D token tensors.
        multiple: Each document is padded at its end to this multiple (the document-wise
            packing: pass ``sequence_multiple(P, layout)``).
        row_multiple: The row is padded at its end to this multiple (the row-wise packing,
            ``packing="row"``: ``multiple=1``, ``row_multiple=sequence_multiple(P,
            layout)``); the row's padding joins the last document.
        pad_token_id: The id of padded tokens.
        ignore_index: The label of tokens without a target.
        labels: Per-document targets, already shifted, instead of the next token.

    Returns:
        ``(1, N)`` ``input_ids``, ``position_ids`` (restarting at 0 per document),
        ``shift_labels`` (token t's target), ``labels`` (the same targets unshifted, for
        code that shifts itself) and the int32 ``cu_seqlens``.

    Raises:
        ValueError: No documents, or one that is empty or not 1-D.
    """
    if not documents:
        raise ValueError("pack_documents needs at least one document")
    ids, pos, tgt, unshifted, cu = [], [], [], [], [0]
    for i, doc in enumerate(documents):
        if doc.dim() != 1 or doc.numel() == 0:
            raise ValueError(f"document {i} must be a non-empty 1-D tensor, got {tuple(doc.shape)}")
        n = doc.numel()
        pad = -n % multiple
        t = torch.cat([doc[1:], doc.new_full((1,), ignore_index)]) if labels is None else labels[i]
        ids.append(torch.cat([doc, doc.new_full((pad,), pad_token_id)]))
        tgt.append(torch.cat([t, t.new_full((pad,), ignore_index)]))
        before = t.new_full((1,), ignore_index) if labels is not None else doc[:1]
        unshifted.append(torch.cat([before, t[:-1], t.new_full((pad,), ignore_index)]))
        pos.append(torch.arange(n + pad, device=doc.device))
        cu.append(cu[-1] + n + pad)
    extra = -cu[-1] % row_multiple  # the row's padding, at the end of its last document
    if extra:
        ids.append(ids[-1].new_full((extra,), pad_token_id))
        tgt.append(tgt[-1].new_full((extra,), ignore_index))
        unshifted.append(unshifted[-1].new_full((extra,), ignore_index))
        pos.append(torch.arange(pos[-1].numel(), pos[-1].numel() + extra, device=pos[-1].device))
        cu[-1] += extra
    return {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(pos)[None],
        "shift_labels": torch.cat(tgt)[None],
        "labels": torch.cat(unshifted)[None],
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }


# one document of a row being packed: (tokens (n,), targets (n,)), targets already shifted
Document = tuple[torch.Tensor, torch.Tensor]


def pack_row(
    seq_len: int,
    multiple: int,
    draw: Callable[[int], Document | None],
    last: Callable[[int], Document],
) -> dict[str, torch.Tensor]:
    """One packed row of ``seq_len`` tokens: documents from ``draw(room)`` until it returns
    None (nothing more fits), then ``last(room)`` fills the rest; each document padded at
    its end to ``multiple`` (:func:`pack_documents`). Returns ``(seq_len,)`` tensors and
    ``cu_seqlens``. The row builder of every packed task (built-in tasks, tokenized files)."""
    tokens, labels, used = [], [], 0
    while used < seq_len:
        room = seq_len - used
        doc = draw(room) or last(room)
        tokens.append(doc[0])
        labels.append(doc[1])
        used += doc[0].numel() + (-doc[0].numel() % multiple)
    row = pack_documents(tokens, labels=labels, multiple=multiple)
    return {k: (v if k == "cu_seqlens" else v[0]) for k, v in row.items()}
