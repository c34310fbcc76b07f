"""The checks of an attention call: every SP rank's call compared first, then its inputs.

Order matters. A check that only some ranks fail would leave the others waiting in the
next collective, so :func:`check_across_ranks` runs first: one all-gather of a few integers
(the call's :func:`signature`) over the SP group, the same ``ValueError`` on every rank
naming what differs. Identical calls then meet the same local checks everywhere
(:func:`validate_qkv`, :func:`check_sinks`, ``AttentionSpec.check``). With a batch from
``shard_batch`` the all-gather runs once per distinct signature of the batch, not per layer
(``core.batch.BatchPlan.checked``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..core.comm import collective, stats
from ..core.derived import once
from ..core.options import BACKENDS, KV_EXCHANGES, LAYOUTS, PACKINGS, RunOptions, check_layout
from ..core.topology import Topology
from ..kernels.spec import AttentionSpec
from .ulysses import kv_replication

__all__ = [
    "check_across_ranks",
    "check_sinks",
    "checked_in_graph",
    "signature",
    "validate_qkv",
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, seq and heads "
            "(their head dims may differ: MLA's values are narrower than its keys)"
        )
    (b, s, hq, d), (bk, sk, hkv, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim"
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


def check_sinks(q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """``sinks``: one floating logit per query head, on q's device; ``ValueError``."""
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


# ---------------------------------------------------------------- the call's signature

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
_SHAPE = ("dims", "batch", "local seq", "heads", "head dim")
Slots = list[tuple[str, int]]  # (what, its integer code): names and values made together


def _code(value, options) -> int:
    return options.index(value) if value in options else -1


def _shape(t) -> list[int]:
    dims = list(t.shape) if isinstance(t, torch.Tensor) else []
    return [len(dims), *(dims + [-1] * 4)[:4]]


def _cu_hash(cu: torch.Tensor) -> list[int]:
    h = 0
    for i, b in enumerate(cu.flatten().tolist()):
        h = (h * 1_000_003 + int(b) * (i + 1)) % (2**61 - 1)
    return [cu.numel(), h]


def _cu_summary(cu) -> list[int]:
    if cu is None:
        return [-1, 0]
    if not isinstance(cu, torch.Tensor) or cu.dtype.is_floating_point:
        return [-2, 0]
    return once((cu,), "summary", partial(_cu_hash, cu))


def _window(window) -> list[int]:
    w = list(window) if isinstance(window, (tuple, list)) else []
    return [int(x) if isinstance(x, int) else -2 for x in [*w, -2, -2][:2]]


def signature(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    spec: AttentionSpec,
    choice: RunOptions,
    cu: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> Slots:
    """Everything every SP rank must agree on, as named integers: the shapes, dtypes and
    devices of q, k, v, the spec, the choices and a packed row's documents (-1 = other)."""
    slots: Slots = []
    for name, t in zip("qkv", qkv):
        slots += [(f"{name} {what}", x) for what, x in zip(_SHAPE, _shape(t))]
    slots += [(f"{n} dtype", _code(t.dtype, _DTYPES)) for n, t in zip("qkv", qkv)]
    slots += [(f"{n} device", _code(t.device.type, ["cpu", "cuda"])) for n, t in zip("qkv", qkv)]
    entries, digest = _cu_summary(cu)
    softcap, chunks = spec.softcap, choice.head_chunks
    left, right = _window(spec.window)
    return [
        *slots,
        ("causal", int(bool(spec.causal))),
        ("layout", _code(choice.layout, list(LAYOUTS))),
        ("backend", _code(choice.backend, list(BACKENDS))),
        ("cu_seqlens entries", entries),
        ("cu_seqlens hash", digest),
        (
            "softcap (x 1e6)",
            round(float(softcap) * 1e6) if isinstance(softcap, int | float) else -1,
        ),
        ("sinks entries", sinks.numel() if isinstance(sinks, torch.Tensor) else -1),
        ("window left", left),
        ("window right", right),
        ("kv exchange", _code(choice.kv_exchange, list(KV_EXCHANGES))),
        ("head chunks", chunks if isinstance(chunks, int) else -2),
        ("redo all-to-all", int(choice.redo_all_to_all is True)),
        ("packing", _code(choice.packing, list(PACKINGS))),
    ]


def check_across_ranks(slots: Slots, topo: Topology, device: torch.device) -> None:
    """One all-gather of the call's :func:`signature` over the SP group, before any other
    check: every rank must call attention with the same shapes, dtypes, devices, options
    and documents, or the all-to-all would hang or mix data. Raises the same
    ``ValueError`` on every rank, naming what differs."""
    _compare([v for _, v in slots], [n for n, _ in slots], topo.sp_group, device)


def checked_in_graph(q: torch.Tensor, slots: Slots, topo: Topology) -> torch.Tensor:
    """:func:`check_across_ranks` inside a ``torch.compile``d layer: the same all-gather
    and ``ValueError``, as the custom op ``ulysses_cp::check_call`` that runs at every
    call (not once at trace time). Returns ``q`` plus the op's zero: the data dependency
    keeps the check in the graph and before the first all-to-all."""
    names = "\n".join(n for n, _ in slots)
    assert topo.sp_group is not None, "checked only with more than one SP rank"
    zero = _check_call(q.detach(), [v for _, v in slots], names, topo.sp_group.group_name)
    return q + zero


@torch.library.custom_op("ulysses_cp::check_call", mutates_args=())
def _check_call(like: torch.Tensor, values: list[int], names: str, group_name: str) -> torch.Tensor:
    group = _resolve_process_group(group_name)  # type: ignore[arg-type]
    _compare(values, names.split("\n"), group, like.device)
    return like.new_zeros(())


@_check_call.register_fake
def _(like: torch.Tensor, values: list[int], names: str, group_name: str) -> torch.Tensor:
    return like.new_zeros(())


def _compare(values: list[int], names: list[str], group, device: torch.device) -> None:
    sig = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(sig) for _ in range(dist.get_world_size(group))]
    with collective("all_gather", "input check", group):
        dist.all_gather(parts, sig, group=group)
    stats.add("all_gather", "input check", sig.numel() * sig.element_size())
    rows = [p.tolist() for p in parts]
    if all(row == rows[0] for row in rows):
        return
    diff = [i for i in range(len(names)) if len({row[i] for row in rows}) > 1]
    detail = "; ".join(
        f"{names[i]}: " + ", ".join(f"rank {r} {row[i]}" for r, row in enumerate(rows))
        for i in diff
    )
    raise ValueError(
        f"sequence-parallel ranks called ucp.attention with different inputs ({detail}); "
        f"every SP rank must pass its shard of the same sequence (same batch, local length, "
        f"heads, dtype, options and cu_seqlens). Shard with ucp.shard_sequence / "
        f"ucp.shard_batch on every rank. (SP ranks are numbered within the SP group; the "
        f"dtype index is into {[str(d) for d in _DTYPES]}, device into ['cpu', 'cuda'], "
        f"layout into {list(LAYOUTS)}, backend into {list(BACKENDS)}; -1 = other.)"
    )
