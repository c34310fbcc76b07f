"""The Ulysses all-to-all as a torch custom op, for layers under ``torch.compile``.

Dynamo does not trace ``dist.all_to_all_single(..., async_op=True)`` (pytorch#168352), nor
the autograd functions of :class:`~ulysses_cp.core.comm.PendingAllToAll` that hold its
work handle. Under ``torch.compile`` the modes use :class:`BlockingAllToAll` instead: the
same ``start`` / ``finish`` interface, but the transfer is one call of the custom op
``ulysses_cp::all_to_all`` (``torch.library.custom_op``) with a fake implementation (the
shapes, for tracing) and a registered autograd formula, so the whole Ulysses attention,
packing and unpacking included, is one traced graph with the all-to-all an opaque node.

Legend: P the group size; the op's input is ``(P, ...)``, dim 0 = destination rank, its
output ``(P, ...)``, dim 0 = source rank. An all-to-all over dim 0 is its own transpose, so
the backward is the same op on the gradient.

The op runs at every step (it is not folded into the graph at trace time), so the byte
counters (:data:`~ulysses_cp.core.comm.stats`) count a compiled step as they count an
eager one: the impl adds the bytes this rank sends, as ``PendingAllToAll.post`` does.
What is lost against eager: the overlap of a chunk's transfer with the previous chunk's
compute (the op waits before it returns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .comm import collective, stats
from .protocols import Group

__all__ = [
    "BlockingAllToAll",
    "all_to_all",
]


@torch.library.custom_op("ulysses_cp::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, group_name: str, phase: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)  # type: ignore[arg-type]
    send = x.contiguous()
    recv = torch.empty_like(send)
    with collective("all_to_all", phase, group):
        dist.all_to_all_single(recv, send, group=group)
    P = send.shape[0]  # this rank's own chunk stays here: not counted
    stats.add("all_to_all", phase, send.numel() * send.element_size() * (P - 1) // P)
    return recv


@_all_to_all_op.register_fake
def _(x: torch.Tensor, group_name: str, phase: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    ctx.group_name = inputs[1]


def _backward(ctx, grad: torch.Tensor):
    # the transpose of an all-to-all over dim 0 is the same all-to-all
    return _all_to_all_op(grad, ctx.group_name, "backward"), None, None


_all_to_all_op.register_autograd(_backward, setup_context=_setup_context)


def all_to_all(x: torch.Tensor, group: Group, phase: str = "forward") -> torch.Tensor:
    """Differentiable, traceable all-to-all over dim 0 of ``x`` ``(P, ...)``: dim 0 of the
    result indexes the source rank."""
    assert group is not None, "an all-to-all needs its process group"
    return _all_to_all_op(x, group.group_name, phase)


class BlockingAllToAll:
    """:class:`~ulysses_cp.core.comm.PendingAllToAll`'s interface over the custom op:
    ``start`` moves ``pack(x)`` at once, ``finish`` unpacks what arrived. The inverse
    functions are not needed: autograd differentiates ``pack`` and ``unpack`` itself."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def start(self, x: torch.Tensor, pack: Callable, pack_inv: Callable) -> torch.Tensor:
        return all_to_all(pack(x), self.group)

    def finish(self, recv: torch.Tensor, unpack: Callable, unpack_inv: Callable) -> torch.Tensor:
        return unpack(recv)
