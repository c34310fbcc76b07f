"""``ucp.attention``: validate once, then dispatch on the topology's mode."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..core.comm import collective, stats
from ..core.derived import once
from ..core.options import KV_EXCHANGES
from ..core.sharding import LAYOUTS, check_layout, layout_of, sequence_multiple
from ..core.topology import Topology
from ..core.varlen import Docs, check_cu_seqlens, inverse_permutation, ulysses_permutation
from ..kernels.dispatch import BACKENDS, Kernel, local_attention, resolve_backend
from .ring import ring_attention
from .ulysses import kv_replication, resolve_head_chunks, ulysses_attention

__all__ = [
    "Attention",
    "attention",
    "check_across_ranks",
    "forward_comm_bytes",
    "packed_plan",
    "validate_packed",
    "validate_qkv",
    "validate_variants",
]


def validate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: Topology, layout: str
) -> None:
    """Local checks of shapes, dtypes and devices; raise ``ValueError`` with the numbers."""
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (b, s, hq, d), (bk, sk, hkv, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, seq and head_dim"
        )
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if layout == "zigzag" and topo.sp_world_size > 1 and s % 2 != 0:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, so the local "
            f"sequence length must be even, got {s}; pad the full sequence to "
            f"a multiple of {2 * topo.sp_world_size}"
        )
    kv_replication(hq, hkv, topo.ulysses_degree)


def validate_variants(
    q: torch.Tensor,
    softcap: float,
    sinks: torch.Tensor | None,
    window: tuple[int, int] = (-1, -1),
) -> None:
    """``softcap`` a finite number >= 0; ``sinks`` one floating logit per query head on q's
    device; ``window`` two integers >= -1.
    ``ValueError`` with the values."""
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if not ok or not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        raise ValueError(
            f"window must be (left, right), two integers (-1: unbounded); got {window!r}"
        )
    if min(window) < -1:
        raise ValueError(f"window sizes must be >= 0 or -1 (unbounded), got {tuple(window)}")

    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap must be a number (0 = off), got {softcap!r}")
    if not (0.0 <= float(softcap) < float("inf")):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if sinks is None:
        return
    hq = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.numel() != hq:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a ({hq},) tensor, one logit per query head; got {shape}")
    if not sinks.dtype.is_floating_point or sinks.device != q.device:
        raise ValueError(
            f"sinks must be floating point on q's device ({q.device}); got {sinks.dtype} "
            f"on {sinks.device}"
        )


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
) -> torch.Tensor:
    """Sequence-parallel attention equal to full attention on the gathered sequence.

    q ``(b, s_local, hq, d)``, k/v ``(b, s_local, hkv, d)`` sharded in the run's layout
    (``topo.layout``; a ``layout=`` that disagrees raises, see :func:`layout_of`);
    returns ``(b, s_local, hq, d)`` in q's dtype, differentiable in q, k, v.

    ``cu_seqlens``: a packed row (batch 1): int32 global document boundaries, the same on
    every rank; q/k/v sharded document-wise (``shard_sequence(..., cu_seqlens=cu)``).
    Attention stays inside each document.

    ``backend``: the local kernel; None takes the run's (``topo.backend``).

    ``softcap`` (flash-attn's meaning, 0 = off): scores become ``softcap * tanh(scores /
    softcap)`` before the mask (Gemma 2). ``sinks``: ``(hq,)`` logits, one per query head,
    that join every softmax denominator with a zero value vector (GPT-OSS attention sinks);
    differentiable, every SP rank passes the same values (the gradient of each rank is its
    share: sum it over the SP group, as for every replicated parameter). ``window=(left,
    right)``: flash-attn's sliding window over global token positions (query i sees keys
    ``i - left .. i + right``, -1 unbounded; ``(-1, -1)`` is full attention); packed rows:
    within each document. ``kv_exchange``: how KV moves inside the ring group, ``"ring"``
    or ``"allgather"``; None takes the run's (``topo.options.kv_exchange``).
    ``head_chunks``: the Ulysses all-to-alls in this many chunks of heads (0: automatic;
    :func:`~ulysses_cp.modes.ulysses.head_chunk_choices` lists the counts that work);
    None takes the run's (``topo.options.head_chunks``)."""
    layout = layout_of(topo, layout)  # the same verdict on every rank: before any collective
    if backend is None:
        backend = topo.backend
    if kv_exchange is None:
        kv_exchange = topo.options.kv_exchange
    if head_chunks is None:
        head_chunks = topo.options.head_chunks
    if topo.check_inputs and topo.sp_world_size > 1:
        # first, so that input that only some ranks would reject fails on every rank
        check_across_ranks(
            q,
            k,
            v,
            topo,
            causal=causal,
            layout=layout,
            backend=backend,
            cu=cu_seqlens,
            softcap=softcap,
            sinks=sinks,
            window=window,
            kv_exchange=kv_exchange,
            head_chunks=head_chunks,
        )
    validate_qkv(q, k, v, topo, layout)
    if kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange {kv_exchange!r} is not one of {list(KV_EXCHANGES)}")
    validate_variants(q, softcap, sinks, window)
    u = topo.ulysses_degree
    r = topo.ring_degree
    chunks = 1 if u == 1 else resolve_head_chunks(head_chunks, q.shape[2], k.shape[2], u, r > 1)
    backend = resolve_backend(backend, q)
    opts: dict[str, Any] = dict(causal=causal, softmax_scale=softmax_scale, backend=backend)
    if softcap:
        opts.update(softcap=float(softcap))
    if tuple(window) != (-1, -1):
        opts.update(window=tuple(int(w) for w in window))
    perm, docs = None, None
    if cu_seqlens is not None:  # once per batch, not per layer (derived.once)
        key = ("packed", *q.shape[:2], u, r, topo.ring_rank, layout, str(q.device))
        perm, docs = once((cu_seqlens,), key, partial(packed_plan, q, cu_seqlens, topo, layout))
    if sinks is not None and u > 1:  # the all-to-all gives this rank a contiguous head range
        sinks = sinks.unflatten(0, (u, -1))[topo.ulysses_rank]
    if r == 1 and docs is None and "window" in opts:
        # block-sparse: the whole sequence in window-sized pieces, pairs out of reach skipped
        inner = partial(ring_attention, group=None, layout="contiguous", **opts)
    elif r == 1:
        if docs is not None:
            opts.update(cu_seqlens=docs.cu)
        inner = partial(local_attention, **opts)
    else:
        inner = partial(
            ring_attention,
            group=topo.ring_group,
            layout=layout,
            docs=docs,
            exchange=kv_exchange,
            **opts,
        )
    # ulysses: a2a around the local kernel; ring: no a2a (degree 1); hybrid: a2a around ring
    return ulysses_attention(
        q,
        k,
        v,
        group=topo.ulysses_group,
        layout=layout,
        inner=inner,
        perm=perm,
        sinks=sinks,
        head_chunks=chunks,
    )


class Attention:
    """:func:`attention` over one topology as a callable, ``attn(q, k, v, cu_seqlens=None)``:
    what the models take (``Decoder(cfg, Attention(topo))``), instead of a hand-written
    closure. The run's layout and backend come from ``topo.options``; ``backend=`` here
    overrides the backend for this callable only."""

    def __init__(
        self,
        topo: Topology,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        backend: str | Kernel | None = None,
    ) -> None:
        self.topo, self.causal, self.softmax_scale = topo, causal, softmax_scale
        self.backend = backend

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attention(
            q,
            k,
            v,
            self.topo,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            backend=self.backend,
            cu_seqlens=cu_seqlens,
        )

    def __repr__(self) -> str:
        return f"Attention({self.topo.mode}, causal={self.causal}, options={self.topo.options})"


_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _code(value, options) -> int:
    return options.index(value) if value in options else -1


def _shape(t) -> list[int]:
    dims = list(t.shape) if isinstance(t, torch.Tensor) else []
    return [len(dims), *(dims + [-1] * 4)[:4]]


def _cu_summary(cu) -> list[int]:
    if cu is None:
        return [-1, 0]
    if not isinstance(cu, torch.Tensor) or cu.dtype.is_floating_point:
        return [-2, 0]
    return once((cu,), "summary", partial(_cu_hash, cu))


def _window_code(window) -> list[int]:
    w = list(window) if isinstance(window, (tuple, list)) else []
    return [int(x) if isinstance(x, int) else -2 for x in [*w, -2, -2][:2]]


def _cu_hash(cu: torch.Tensor) -> list[int]:
    h = 0
    for i, b in enumerate(cu.flatten().tolist()):
        h = (h * 1_000_003 + int(b) * (i + 1)) % (2**61 - 1)
    return [cu.numel(), h]


def _signature(
    q,
    k,
    v,
    *,
    causal,
    layout,
    backend,
    cu,
    softcap=0.0,
    sinks=None,
    window=(-1, -1),
    kv_exchange="ring",
    head_chunks=0,
) -> list[int]:
    dtypes = [_code(t.dtype, _DTYPES) for t in (q, k, v)]
    devices = [_code(t.device.type, ["cpu", "cuda"]) for t in (q, k, v)]
    return [
        *_shape(q),
        *_shape(k),
        *_shape(v),
        *dtypes,
        *devices,
        int(bool(causal)),
        _code(layout, list(LAYOUTS)),
        _code(backend, list(BACKENDS)),
        *_cu_summary(cu),
        round(float(softcap) * 1e6) if isinstance(softcap, (int, float)) else -1,
        sinks.numel() if isinstance(sinks, torch.Tensor) else -1,
        *_window_code(window),
        _code(kv_exchange, list(KV_EXCHANGES)),
        head_chunks if isinstance(head_chunks, int) else -2,
    ]


_FIELDS = [
    *(f"{n} {f}" for n in "qkv" for f in ("dims", "batch", "local seq", "heads", "head dim")),
    *(f"{n} dtype" for n in "qkv"),
    *(f"{n} device" for n in "qkv"),
    "causal",
    "layout",
    "backend",
    "cu_seqlens entries",
    "cu_seqlens hash",
    "softcap (x 1e6)",
    "sinks entries",
    "window left",
    "window right",
    "kv exchange",
    "head chunks",
]


def check_across_ranks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topo: Topology,
    *,
    causal: bool,
    layout: str,
    backend: str | Kernel,
    cu: torch.Tensor | None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    kv_exchange: str = "ring",
    head_chunks: int = 0,
) -> None:
    """One all-gather of a few integers over the SP group, before any other check: every
    rank must call attention with the same shapes, dtypes, devices, options and documents,
    or the all-to-all would hang or mix data (and a check that only some ranks fail would
    leave the others waiting). Raises the same ``ValueError`` on every rank, naming what
    differs; identical inputs then meet the same local checks everywhere."""
    sig = torch.tensor(
        _signature(
            q,
            k,
            v,
            causal=causal,
            layout=layout,
            backend=backend,
            cu=cu,
            softcap=softcap,
            sinks=sinks,
            window=window,
            kv_exchange=kv_exchange,
            head_chunks=head_chunks,
        ),
        dtype=torch.int64,
        device=q.device if isinstance(q, torch.Tensor) else "cpu",
    )
    parts = [torch.empty_like(sig) for _ in range(topo.sp_world_size)]
    with collective("all_gather", "input check", topo.sp_group):
        dist.all_gather(parts, sig, group=topo.sp_group)
    stats.add("all_gather", "input check", sig.numel() * sig.element_size())
    rows = [p.tolist() for p in parts]
    if all(row == rows[0] for row in rows):
        return
    diff = [i for i, name in enumerate(_FIELDS) if len({row[i] for row in rows}) > 1]
    detail = "; ".join(
        f"{_FIELDS[i]}: " + ", ".join(f"rank {r} {row[i]}" for r, row in enumerate(rows))
        for i in diff
    )
    raise ValueError(
        f"sequence-parallel ranks called ucp.attention with different inputs ({detail}); "
        f"every SP rank must pass its shard of the same sequence (same batch, local length, "
        f"heads, dtype, options and cu_seqlens). Shard with ucp.shard_sequence / "
        f"data.shard_batch on every rank. (SP ranks are numbered within the SP group; the "
        f"dtype index is into {[str(d) for d in _DTYPES]}, device into ['cpu', 'cuda'], "
        f"layout into {list(LAYOUTS)}, backend into {list(BACKENDS)}; -1 = other.)"
    )


def packed_plan(
    q: torch.Tensor, cu_seqlens: torch.Tensor, topo: Topology, layout: str
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, Docs]:
    """A packed row's checked bounds turned into ``(perm, docs)``: the all-to-all output
    permutation and its inverse (Ulysses degree > 1, else None) and this rank's documents
    at the ring/kernel level (:class:`~ulysses_cp.varlen.Docs`)."""
    bounds = validate_packed(q, cu_seqlens, topo, layout)
    u, r = topo.ulysses_degree, topo.ring_degree
    perm = None
    if u > 1:
        fwd = ulysses_permutation(bounds, u, r, topo.ring_rank, layout)
        perm = (fwd.to(q.device), inverse_permutation(fwd).to(q.device))
    return perm, Docs.from_bounds(bounds, r, q.device)


def validate_packed(
    q: torch.Tensor, cu_seqlens: torch.Tensor, topo: Topology, layout: str
) -> list[int]:
    """Check a packed row's ``cu_seqlens`` against the local q; return the boundaries."""
    if q.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens describes one packed row: batch must be 1, got {q.shape[0]}; "
            f"concatenate the rows into one and join their cu_seqlens"
        )
    P = topo.sp_world_size
    return check_cu_seqlens(cu_seqlens, q.shape[1] * P, sequence_multiple(P, layout))


def forward_comm_bytes(
    *,
    batch: int,
    seq_len: int,
    hq: int,
    hkv: int,
    head_dim: int,
    ulysses_degree: int,
    ring_degree: int,
    bytes_per_element: int,
) -> tuple[int, int]:
    """Bytes one rank sends in one forward call, ``(all_to_all, ring)`` (docs/design.md):

    all-to-all over u ranks: b * (N/P) * (2*hq + 2*hkv_sent) * d * (u-1)/u * B;
    kv ring over r ranks:    2 * b * (N/r) * (hkv_sent/u) * d * (r-1) * B;
    hkv_sent = hkv times its replication for u. The tests check the counters against
    their own copy of these formulas."""
    u, r = ulysses_degree, ring_degree
    b, N, d, B = batch, seq_len, head_dim, bytes_per_element
    hkv_sent = hkv * kv_replication(hq, hkv, u)
    a2a = b * (N // (u * r)) * (2 * hq + 2 * hkv_sent) * d * (u - 1) // u * B
    ring = 2 * b * (N // r) * (hkv_sent // u) * d * (r - 1) * B
    return a2a, ring
