"""Collectives used by the attention modes, with byte counters.

Legend: b batch, s full sequence, s_l = s / P local tokens, h heads, d head dim,
P the size of the group the collective runs on.

The sequence <-> head all-to-all is DeepSpeed-Ulysses' (Jacobs et al., arXiv:2309.14509):
scatter heads, gather sequence. Its backward is the same all-to-all with the scatter and
gather dims swapped, i.e. the other function of the pair.

:class:`PendingAllToAll` is an all-to-all posted now and waited for later, :class:`RingComm`
the point-to-point step of a ring (send to the next rank, receive from the previous one).

Byte counters record what this rank *sends to other ranks* (its own chunk of an all-to-all
stays local and is not counted), per op and per phase (``forward`` / ``backward``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from einops import rearrange

from .protocols import Group

__all__ = [
    "CollectiveError",
    "CommStats",
    "PendingAllToAll",
    "RingComm",
    "collective",
    "comm_device",
    "describe_group",
    "group_rank",
    "group_size",
    "head_to_seq",
    "host_staged",
    "name_group",
    "seq_to_head",
]


class CommStats:
    """Bytes this rank sent to other ranks, and calls, per ``(op, phase)``.

    One process-wide instance, ``ulysses_cp.core.comm.stats`` (``ucp.comm_stats``); the
    caller resets it. Ops: ``all_to_all``, ``ring``, ``kv_allgather``,
    ``kv_reduce_scatter``, ``mixer_all_reduce`` (Mamba1's partial sums), and ``all_gather`` /
    ``input check`` for the input checks.
    Phases: ``forward``, ``backward``.
    """

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, op: str, phase: str, nbytes: int) -> None:
        """Count one call of ``nbytes`` bytes."""
        self.bytes[(op, phase)] += int(nbytes)
        self.calls[(op, phase)] += 1

    def reset(self) -> None:
        """Forget every count."""
        self.bytes.clear()
        self.calls.clear()

    def total(self, op: str | None = None, phase: str | None = None) -> int:
        """Bytes of one op and phase; None sums over all."""
        return sum(
            n
            for (o, p), n in self.bytes.items()
            if (op is None or o == op) and (phase is None or p == phase)
        )

    def snapshot(self) -> dict[str, int]:
        """Bytes as ``{"op/phase": n}``."""
        return {f"{op}/{phase}": n for (op, phase), n in sorted(self.bytes.items())}

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Traffic inside the block is not counted: the counts are as before it (an
        evaluation between training steps stays out of the steps' bytes)."""
        saved = (dict(self.bytes), dict(self.calls))
        try:
            yield
        finally:
            self.reset()
            self.bytes.update(saved[0])
            self.calls.update(saved[1])


stats = CommStats()


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or the link broke."""


_GROUP_NAMES: dict[int, str] = {}


def name_group(group: Group, name: str) -> None:
    """Register a readable name (``"ulysses"``, ``"ring"``, ...) for error messages."""
    if group is not None:
        _GROUP_NAMES[id(group)] = name


def describe_group(group: Group) -> str:
    name = _GROUP_NAMES.get(id(group), "process")
    try:
        ranks = str(dist.get_process_group_ranks(group))
    except Exception:  # pragma: no cover - a destroyed group
        ranks = "?"
    return f"{name} group (global ranks {ranks})"


@contextmanager
def collective(op: str, phase: str, group: Group) -> Iterator[None]:
    """Re-raise any failure inside as :class:`CollectiveError` naming the op and group."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"rank {rank}: {op} ({phase}) on the {describe_group(group)} failed: "
            f"{type(exc).__name__}: {str(exc).strip()[:300]}. A peer rank died, hung "
            f"past the collective timeout (sequence_parallel.collective_timeout_s) or lost "
            f"its link; resume from the last checkpoint with --resume."
        ) from exc


def host_staged(group: Group, device: torch.device) -> bool:
    """Must point-to-point traffic of ``device`` tensors go through host memory on
    ``group``? gloo moves CUDA tensors in its collectives (all-to-all, all-gather,
    all-reduce) but its send/recv read raw host pointers, so ring steps on a gloo group
    with CUDA tensors (several ranks sharing one GPU, say) are staged through the CPU."""
    if device.type != "cuda":
        return False
    backend = str(dist.get_backend(group)).lower()
    return "nccl" not in backend and "cuda:" not in backend


def comm_device(group: Group, device: torch.device) -> torch.device:
    """Where a small bookkeeping tensor must live for a collective on ``group``: NCCL takes
    only CUDA tensors (this rank's current GPU), gloo takes CPU and CUDA tensors."""
    backend = str(dist.get_backend(group)).lower()
    if device.type != "cuda" and "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group: Group, phase: str) -> torch.Tensor:
    """All-to-all over dim 0 (which must equal the group size), waited for at once; dim 0
    of the result indexes the source rank."""
    pending = PendingAllToAll(group)
    pending.post(x, phase)
    return pending.wait(phase)


def _seq_to_head(x: torch.Tensor, group: Group, phase: str) -> torch.Tensor:
    P = group_size(group)
    if P == 1:
        return x
    # (b, s_l, h, d) -> (P, b, s_l, h/P, d): dim 0 = destination rank (head group)
    x = rearrange(x, "b s (p h) d -> p b s h d", p=P)
    x = _all_to_all(x, group, phase)
    # (P, b, s_l, h/P, d), dim 0 = source rank (sequence chunk) -> (b, s, h/P, d)
    return rearrange(x, "p b s h d -> b (p s) h d")


def _head_to_seq(x: torch.Tensor, group: Group, phase: str) -> torch.Tensor:
    P = group_size(group)
    if P == 1:
        return x
    # (b, s, h/P, d) -> (P, b, s_l, h/P, d): dim 0 = destination rank (sequence chunk)
    x = rearrange(x, "b (p s) h d -> p b s h d", p=P)
    x = _all_to_all(x, group, phase)
    # (P, b, s_l, h/P, d), dim 0 = source rank (head group) -> (b, s_l, h, d)
    return rearrange(x, "p b s h d -> b s (p h) d")


class _AllToAll(torch.autograd.Function):
    """``fwd`` in forward; its inverse ``bwd`` (the same all-to-all with scatter and gather
    dims swapped) in backward."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, "backward"), None, None, None


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage (no other tensor can view a part of it)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class PendingAllToAll:
    """One all-to-all over dim 0 that is posted now and waited for later, in the forward and
    again (for the gradient) in the backward, so that compute can run while it moves:

        pending = PendingAllToAll(group)
        recv = pending.start(x, pack, pack_inv)      # posted; recv not valid yet
        ...                                          # compute something else
        y = pending.finish(recv, unpack, unpack_inv) # waited; y = unpack(recv)

    ``pack(x)`` makes the send buffer ``(P, ...)`` (dim 0 = destination rank), ``unpack``
    turns the receive buffer (dim 0 = source rank) into the result; ``*_inv`` are their
    inverses, used on the gradients. Differentiable: ``finish``'s backward posts the
    gradient's all-to-all and ``start``'s backward waits for it, so in the backward too
    the transfer runs while autograd computes what lies between the two. Every rank must
    start and finish its pending all-to-alls in the same order (the group runs them in the
    order they were posted)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._work = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._release = False  # free the send buffer once sent (post's ``release``)

    def post(
        self,
        send: torch.Tensor,
        phase: str,
        op: str | None = "all_to_all",
        *,
        release: bool = False,
    ) -> torch.Tensor:
        """Post the all-to-all of ``send`` (dim 0 = destination rank); its bytes counted
        under ``op`` (None: the caller counts them). ``release``: the caller will not use
        ``send`` again, so :meth:`wait` frees its storage once the transfer is done (the
        backend's own reference to it can outlive the wait for a while, which made the
        peak depend on its thread's timing)."""
        self._release = release
        send = send.contiguous()
        recv = torch.empty_like(send)
        with collective("all_to_all", phase, self.group):
            self._work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        if op is not None:
            nbytes = send.numel() * send.element_size()
            stats.add(op, phase, nbytes * (send.shape[0] - 1) // send.shape[0])
        self._buffers = (send, recv)  # the send buffer must live until the transfer ends
        return recv

    def wait(self, phase: str) -> torch.Tensor:
        assert self._work is not None and self._buffers is not None, "wait before post"
        with collective("all_to_all", phase, self.group):
            self._work.wait()
        send, recv = self._buffers
        if self._release and _whole_storage(send):
            send.untyped_storage().resize_(0)
        self._work = self._buffers = None
        return recv

    def start(self, x: torch.Tensor, pack: Callable, pack_inv: Callable) -> torch.Tensor:
        return _Start.apply(x, self, pack, pack_inv)

    def finish(self, recv: torch.Tensor, unpack: Callable, unpack_inv: Callable) -> torch.Tensor:
        return _Finish.apply(recv, self, unpack, unpack_inv)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending, pack, pack_inv):
        ctx.pending, ctx.pack_inv = pending, pack_inv
        return pending.post(pack(x), "forward")

    @staticmethod
    def backward(ctx, grad_recv):
        # grad_recv is the buffer _Finish.backward posted: valid once the wait returns
        return ctx.pack_inv(ctx.pending.wait("backward")), None, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, pending, unpack, unpack_inv):
        ctx.pending, ctx.unpack_inv = pending, unpack_inv
        pending.wait("forward")
        return unpack(recv)

    @staticmethod
    def backward(ctx, grad):
        return ctx.pending.post(ctx.unpack_inv(grad), "backward"), None, None, None


class RingComm:
    """Send to the next rank, receive from the previous one: ``send_recv`` posts,
    ``wait`` returns what arrived. ``op`` names the byte counter. CUDA tensors on a group
    whose send/recv cannot take them (gloo) travel through host copies
    (:func:`host_staged`)."""

    def __init__(self, group: Group, op: str, phase: str, tag: int = 0) -> None:
        self.group, self.op, self.phase, self.tag = group, op, phase, tag
        assert group is not None, "a ring needs its process group"
        P, r = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (r + 1) % P)
        self.prev = dist.get_global_rank(group, (r - 1) % P)
        self._reqs: list = []
        self._recv: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None
        self._device: torch.device | None = None  # where the result goes, when staged

    def send_recv(self, x: torch.Tensor) -> None:
        assert not self._reqs, "wait() before the next send_recv()"
        stats.add(self.op, self.phase, x.numel() * x.element_size())
        self._device = x.device if host_staged(self.group, x.device) else None
        x = x.contiguous() if self._device is None else x.to("cpu")
        self._recv = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, self.tag),
            dist.P2POp(dist.irecv, self._recv, self.prev, self.group, self.tag),
        ]
        with collective(self.op, self.phase, self.group):
            self._reqs = dist.batch_isend_irecv(ops)
        self._sent = x  # keep the send buffer alive until wait()

    def wait(self) -> torch.Tensor:
        with collective(self.op, self.phase, self.group):
            for req in self._reqs:
                req.wait()
        self._reqs, self._sent = [], None
        out, self._recv = self._recv, None
        assert out is not None, "wait() without send_recv()"
        return out if self._device is None else out.to(self._device)


def seq_to_head(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``(b, s/P, h, d)`` sequence-sharded -> ``(b, s, h/P, d)`` head-sharded; rank j gets
    heads ``[j*h/P, (j+1)*h/P)`` and the sequence in group-rank order. Differentiable."""
    return _AllToAll.apply(x, group, _seq_to_head, _head_to_seq)


def head_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``(b, s, h/P, d)`` -> ``(b, s/P, h, d)``."""
    return _AllToAll.apply(x, group, _head_to_seq, _seq_to_head)
