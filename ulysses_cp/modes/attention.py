"""``ucp.attention``: the call's spec and choices, the checks once, then dispatch by mode.

The mode follows the topology: the Ulysses all-to-all (:mod:`.ulysses`) around the local
kernel when ``ring_degree == 1``, around ring attention (:mod:`.ring`) over the ring group
otherwise (ring mode is the all-to-all of degree 1 around the ring, hybrid both).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.compiler import is_compiling as compiling

from ..core.batch import BatchPlan
from ..core.derived import once
from ..core.options import KV_EXCHANGES, RunOptions
from ..core.rows import RowDocs
from ..core.sharding import layout_of
from ..core.topology import Topology
from ..core.varlen import Docs
from ..kernels.backends import Kernel, resolve_backend
from ..kernels.dispatch import KernelCall, attend_local, attn_backward, attn_forward
from ..kernels.spec import AttentionSpec
from .checks import (
    check_across_ranks,
    check_sinks,
    checked_in_graph,
    signature,
    validate_qkv,
)
from .chunked import HeadChunks, chunked_attention
from .ring import Ring, ring_attention, ring_functions
from .ulysses import resolve_head_chunks, ulysses_attention

__all__ = [
    "Attention",
    "attend",
    "attention",
]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topo: Topology,
    *,
    causal: bool = True,
    layout: str | None = None,
    softmax_scale: float | None = None,
    backend: str | Kernel | None = None,
    cu_seqlens: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    kv_exchange: str | None = None,
    head_chunks: int | None = None,
    batch: BatchPlan | None = None,
    packing: str | None = None,
) -> torch.Tensor:
    """Sequence-parallel attention, equal to full attention on the gathered sequence.

    The mode follows the topology: Ulysses (an all-to-all of heads around the local
    kernel), ring (KV blocks passed between ranks) or hybrid (both). Before any collective
    the inputs are compared across the SP ranks when ``topo.check_inputs`` is on (once per
    call, or once per batch given ``batch``).

    Args:
        q: This rank's queries, ``(b, s_local, hq, d)``, sharded in the run's layout.
        k: This rank's keys, ``(b, s_local, hkv, d)``; ``hq`` must be a multiple of ``hkv``.
        v: This rank's values ``(b, s_local, hkv, dv)``: like ``k``, with a head dim of
            their own where the model has one (MLA: DeepSeek-V3's 128 against q/k's 192).
        topo: The run's topology (``init_topology`` or ``topology_from_config``).
        causal: Causal masking over global token positions.
        layout: ``"zigzag"`` or ``"contiguous"``; None takes the run's (``topo.layout``).
        softmax_scale: The score scale; None is ``1 / sqrt(d)``.
        backend: The local kernel (``"auto"``, ``"torch"``, ``"math"``, ``"flash_attn"``,
            ``"flash_attn3"``, ``"flash_attn4"``);
            None takes the run's.
        cu_seqlens: A packed row (batch 1): int32 global document boundaries, the same on
            every rank. Attention stays inside each document.
        softcap: flash-attn's logit softcap; scores become ``softcap * tanh(s / softcap)``
            (Gemma 2). 0 is off.
        sinks: ``(hq,)`` attention-sink logits (GPT-OSS), the same on every SP rank; each
            rank's gradient is its share.
        window: flash-attn's sliding window ``(left, right)`` over global positions; -1 is
            unbounded, ``(-1, -1)`` full attention. Packed rows: within each document.
        kv_exchange: How KV moves inside a ring group, ``"ring"`` or ``"allgather"``; None
            takes the run's.
        head_chunks: The Ulysses all-to-alls in this many chunks of heads (0: automatic);
            None takes the run's.
        batch: The batch's plan from ``shard_batch``: its documents are planned and the
            call checked once per batch, not per layer.
        packing: ``"document"`` or ``"row"`` for a packed row sharded by your own code; None
            takes the run's.

    Returns:
        This rank's output ``(b, s_local, hq, dv)`` in q's dtype, differentiable in q, k, v
        (and ``sinks``).

    Raises:
        ValueError: A ``layout`` or ``packing`` that disagrees with the run's, a length the
            layout cannot split, head counts the Ulysses degree cannot split (the message
            lists the degrees that work), an invalid option value, ``cu_seqlens`` and
            ``batch`` both given, or inputs that differ between SP ranks.

    The keywords build one :class:`~ulysses_cp.kernels.spec.AttentionSpec` and one
    :class:`~ulysses_cp.core.options.RunOptions` (``topo.options.for_call``: the run's
    options with the call's).
    """
    layout = layout_of(topo, layout)  # the same verdict on every rank: before any collective
    choice = topo.options.for_call(
        layout=layout,
        backend=backend,
        kv_exchange=kv_exchange,
        head_chunks=head_chunks,
        packing=packing,
    )
    window = tuple(window) if isinstance(window, list) else window
    spec = AttentionSpec(causal, softmax_scale, softcap, window, sinks is not None)
    if batch is None:
        return attend(q, k, v, topo, spec, choice, cu_seqlens, sinks)
    if cu_seqlens is not None and cu_seqlens is not batch.cu_seqlens:
        raise ValueError("give cu_seqlens or batch (which holds the batch's cu_seqlens), not both")
    return attend(q, k, v, topo, spec, choice, batch, sinks)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topo: Topology,
    spec: AttentionSpec,
    choice: RunOptions,
    batch: BatchPlan | torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention` from its spec and choices. ``batch``: the batch's plan, or a packed
    row's ``cu_seqlens`` alone (planned here, checked on every call)."""
    plan, cu = (batch, batch.cu_seqlens) if isinstance(batch, BatchPlan) else (None, batch)
    if topo.check_inputs and topo.sp_world_size > 1:
        # first, so that input that only some ranks would reject fails on every rank
        slots = signature((q, k, v), spec, choice, cu, sinks)
        if torch.compiler.is_compiling():  # at every call, from inside the graph
            q = checked_in_graph(q, slots, topo)
        elif plan is None or not plan.checked(tuple(value for _, value in slots)):
            check_across_ranks(slots, topo, q.device if isinstance(q, torch.Tensor) else "cpu")
    validate_qkv(q, k, v, topo, choice.layout)
    if choice.kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange {choice.kv_exchange!r} is not one of {list(KV_EXCHANGES)}")
    spec.check()
    check_sinks(q, sinks)
    u, r = topo.ulysses_degree, topo.ring_degree
    # one head-sharded query head: (b, s_local * u, 1, d)
    head_bytes = q.shape[0] * q.shape[1] * u * q.shape[3] * q.element_size()
    hq, hkv = q.shape[2], k.shape[2]
    chunks = 1 if u == 1 else resolve_head_chunks(choice.head_chunks, hq, hkv, u, r > 1, head_bytes)
    call = KernelCall(spec, resolve_backend(choice.backend, q, v))
    perm, docs = None, None
    if cu is not None:  # once per batch, not per layer
        plan = plan or _plan_of(cu, q, topo, choice.layout, choice.packing)
        plan.check_call(q, topo, choice.layout, choice.packing)
        perm, docs = plan.documents(q.device)
    if sinks is not None and u > 1:  # the all-to-all gives this rank a contiguous head range
        sinks = sinks.unflatten(0, (u, -1))[topo.ulysses_rank]
    order = perm if perm is not None else choice.layout
    if u == 1:  # ring mode: no all-to-all around the ring
        inner = _inner(topo, call, choice, docs)
        return inner(q, k, v) if sinks is None else inner(q, k, v, sinks=sinks)
    if compiling() and r == 1 and not choice.redo_all_to_all:
        # compiled Ulysses: differentiable traceable ops (one graph, no overlap)
        inner = _inner(topo, call, choice, docs)
        return ulysses_attention(
            q,
            k,
            v,
            group=topo.ulysses_group,
            inner=inner,
            order=order,
            sinks=sinks,
            head_chunks=chunks,
        )
    # Ulysses: a2a around the local kernel; hybrid: a2a around the ring. Head-sharded
    # copies kept for the backward and freed as it goes, or (redo_all_to_all) none kept
    # and the a2a redone there. Compiled hybrid or redo: eager as a whole (the graph
    # breaks around it, see _eager_in_graph)
    pair = _inner(topo, call, choice, docs, q.shape[1] * u)
    run = _eager_in_graph if compiling() else chunked_attention
    return run(
        q,
        k,
        v,
        group=topo.ulysses_group,
        inner=pair,
        order=order,
        sinks=sinks,
        chunks=HeadChunks(chunks, choice.redo_all_to_all),
    )


def _plan_of(
    cu: torch.Tensor, q: torch.Tensor, topo: Topology, layout: str, packing: str
) -> BatchPlan:
    """The plan of a packed row given as ``cu_seqlens`` alone, once per ``cu`` tensor."""
    P = topo.sp_world_size
    shape = (q.shape[0], q.shape[1] * P)
    key = ("plan", *shape, topo.ulysses_degree, topo.ring_degree, topo.sp_rank, layout, packing)
    make = partial(BatchPlan.of, topo, layout, shape, cu, "cu_seqlens", packing)
    return once((cu,), key, make)


# Both are torch.compiler.disable's, made at the first call (torch._disable_dynamo, as
# DeepSpeed's lazy_disable does): torch.compiler.disable imports torch._dynamo at once,
# 2.4 s of every rank's start on a CPU, for a run that compiles nothing.
# Ring attention run eagerly from a compiled layer (its graph breaks before and after):
_ring_outside_graph = torch._disable_dynamo(ring_attention)
# the hybrid's all-to-alls around a ring (and redo_all_to_all's): eager as a whole, one
# autograd function whose collectives dynamo does not trace; they keep their overlap
_eager_in_graph = torch._disable_dynamo(chunked_attention)


def _inner(
    topo: Topology,
    call: KernelCall,
    choice: RunOptions,
    docs: Docs | RowDocs | None,
    split: int = 0,
) -> Any:
    """What runs inside the all-to-all: the local kernel, or ring attention. ``split``: the
    head-sharded tokens per rank, for :mod:`.chunked`: then the pair ``(fwd, bwd)`` of
    not-differentiable functions instead of one differentiable call."""
    if topo.ring_degree == 1 and docs is None and call.spec.windowed:
        # block-sparse: the whole sequence in window-sized pieces, pairs out of reach skipped
        ring = Ring(None, "contiguous")
    elif topo.ring_degree == 1:
        local = call if docs is None else call.at(cu_q=docs.cu, cu_k=docs.cu)
        if split:
            return partial(attn_forward, call=local), partial(attn_backward, call=local)
        return partial(attend_local, call=local)
    else:
        ring = Ring(topo.ring_group, choice.layout, docs, choice.kv_exchange)
    if split:
        return ring_functions(ring, call, split)
    # the ring's send/recv cannot be traced: a compiled layer breaks its graph around it
    ring_fn = _ring_outside_graph if compiling() else ring_attention
    return partial(ring_fn, ring=ring, call=call)


class Attention:
    """`attention` over one topology, as the callable ``attn(q, k, v, batch=None)``.

    What the models take (``Decoder(cfg, Attention(topo))``) instead of a hand-written
    closure; ``batch`` is the batch's plan from ``shard_batch``. The run's layout and
    backend come from ``topo.options``.

    Args:
        topo: The run's topology.
        causal: Causal masking over global token positions.
        softmax_scale: The score scale; None is ``1 / sqrt(d)``.
        backend: Overrides the run's backend for this callable only.
    """

    def __init__(
        self,
        topo: Topology,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        backend: str | Kernel | None = None,
    ) -> None:
        self.topo, self.backend = topo, backend
        self.spec = AttentionSpec(causal=causal, scale=softmax_scale)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchPlan | None = None
    ) -> torch.Tensor:
        choice = self.topo.options.for_call(backend=self.backend)
        return attend(q, k, v, self.topo, self.spec, choice, batch)

    def __repr__(self) -> str:
        causal = self.spec.causal
        return f"Attention({self.topo.mode}, causal={causal}, options={self.topo.options})"
