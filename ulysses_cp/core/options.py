"""The per-run choices of sequence parallelism, in one frozen place.

A run fixes these once (``ucp.init_topology(...)`` keywords, or the ``"sequence_parallel"``
block through ``ucp.topology_from_config``); the topology carries them as ``topo.options``
and every call that takes the topology reads them from there, so nothing threads them by
hand and nothing changes them halfway through a run. A different choice is a new value
(``topo.with_options(layout="contiguous")``), never a mutation.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

__all__ = [
    "BACKENDS",
    "CONFIG_KEYS",
    "KV_EXCHANGES",
    "LAYOUTS",
    "OPTION_NAMES",
    "PACKINGS",
    "Backend",
    "KVExchange",
    "Layout",
    "Packing",
    "RunOptions",
    "check_layout",
    "check_packing",
    "reduction_grad_scale",
]

# How tokens are laid out across the sequence-parallel ranks (``ulysses_cp.core.sharding``).
Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = get_args(Layout)

# How KV moves inside a ring group: point-to-point ring steps, or one all-gather (with a
# reduce-scatter of dk/dv in the backward).
KVExchange = Literal["ring", "allgather"]
KV_EXCHANGES: tuple[str, ...] = get_args(KVExchange)

# How a packed row's tokens are laid out (``ulysses_cp.core.varlen``): every document split
# over the ranks on its own (``"document"``: each length a multiple of the layout's), or the
# row split like an unpacked sequence, documents crossing rank borders (``"row"``).
Packing = Literal["document", "row"]
PACKINGS: tuple[str, ...] = get_args(Packing)

# The local attention kernels by name (implemented in ``ulysses_cp.kernels``).
Backend = Literal["auto", "flash_attn", "flash_attn3", "flash_attn4", "torch", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {list(LAYOUTS)}")


def check_packing(packing: str) -> None:
    if packing not in PACKINGS:
        raise ValueError(
            f'packing {packing!r} is not one of {list(PACKINGS)}: "document" splits every '
            f'document over the ranks (lengths multiples of ucp.sequence_multiple), "row" '
            f"splits the whole row (documents of any length)"
        )


@dataclass(frozen=True)
class RunOptions:
    """The run's options: the one declaration of them, with their defaults and checks.

    The ``init_topology`` keywords, the ``"sequence_parallel"`` block's keys
    (``ulysses_cp.config.SequenceParallelConfig``: a field's ``metadata["key"]`` names its
    key when it differs, None when the config does not set it) and one call's choices
    (:meth:`for_call`) are these fields.

    Raises:
        ValueError: a value out of its range, naming the option and the value.
    """

    layout: Layout = "zigzag"
    """How tokens are sharded over the sequence-parallel ranks. `"zigzag"` balances the
    causal work; use it. `"contiguous"` gives each rank one slice."""
    backend: Backend = field(default="auto", metadata={"key": "attention_backend"})
    """The local attention kernel; the JSON key is `attention_backend`. `"auto"` takes the
    fastest library that imports and runs the inputs on the GPU found, else torch's kernels.
    Name one (`"flash_attn"`, `"flash_attn3"`, `"flash_attn4"`, `"torch"`, `"math"`) to
    pin it."""
    check_inputs: bool = True
    """Compare every SP rank's inputs (one tiny all-gather) before each attention call. A
    rank with a different shape then raises instead of hanging."""
    grad_scale: float = field(default=1.0, metadata={"key": None})
    """Multiplies the SP loss's gradient: 1, or the SP degree under ZeRO-3, which averages
    over the SP ranks too (`training.engine.zero_grad_scale`). Not a config key: it follows
    the ZeRO stage."""
    kv_exchange: KVExchange = "ring"
    """How KV moves inside a ring group. `"ring"`: point-to-point steps overlapped with
    compute. `"allgather"`: one all-gather (a reduce-scatter of dk/dv in the backward),
    holding the group's whole KV while it runs."""
    head_chunks: int = 0
    """Split the Ulysses all-to-alls into this many chunks of heads, each overlapped with
    the previous chunk's attention. 0: the most chunks whose query block stays at least
    1 MiB (``ulysses_cp.modes.ulysses.resolve_head_chunks``)."""
    redo_all_to_all: bool = False
    """Keep no head-sharded copies of q, k, v and the output for the backward; redo their
    all-to-alls there (``ulysses_cp.modes.chunked``). It costs 1.5x the all-to-all bytes.
    Use it for many layers without checkpointing, inside a node."""
    packing: Packing = "document"
    """How packed rows (`cu_seqlens`) split over the ranks. `"document"`: every document on
    its own, its length a multiple of `sequence_multiple`. `"row"`: the row like an
    unpacked one, documents of any length (``ulysses_cp.core.varlen``)."""

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {list(BACKENDS)}")
        if not isinstance(self.check_inputs, bool):
            raise ValueError(f"check_inputs must be True or False, got {self.check_inputs!r}")
        g = self.grad_scale
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) or g <= 0:
            raise ValueError(f"grad_scale must be a positive finite number, got {g!r}")
        object.__setattr__(self, "grad_scale", float(g))
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange {self.kv_exchange!r} is not one of {list(KV_EXCHANGES)}")
        c = self.head_chunks
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"head_chunks must be an integer >= 0 (0: automatic), got {c!r}")
        if not isinstance(self.redo_all_to_all, bool):
            raise ValueError(
                f"redo_all_to_all must be true or false, got {self.redo_all_to_all!r}: true "
                f"redoes the Ulysses all-to-alls in the backward (less memory, more traffic)"
            )
        check_packing(self.packing)

    def for_call(self, **overrides: Any) -> RunOptions:
        """One attention call's choices: these options with the call's overrides (a None
        keeps the run's; ``backend`` may also be a ``ulysses_cp.kernels.backends.Kernel``).
        Not checked here: the SP ranks compare them first (``ulysses_cp.modes.checks``), so
        that a value only some ranks would refuse fails on every rank."""
        call = copy.copy(self)
        for name, value in overrides.items():
            if name not in OPTION_NAMES:
                raise TypeError(f"for_call() got an unexpected keyword argument {name!r}")
            if value is not None:
                object.__setattr__(call, name, value)
        return call


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RunOptions))

# the "sequence_parallel" block's key of each option it sets: the one mapping between the
# config and the options (grad_scale follows the ZeRO stage and is no key)
CONFIG_KEYS: dict[str, str] = {
    f.metadata.get("key", f.name): f.name
    for f in fields(RunOptions)
    if f.metadata.get("key", f.name) is not None
}


def reduction_grad_scale(sp_world_size: int, *, averages_over_sp: bool) -> float:
    """The one gradient-scale rule, for every engine (``RunOptions.grad_scale``).

    The SP loss gives each rank the gradient of its own tokens' share of the sequence's
    mean, so the exact gradient is the SUM over the ``sp`` ranks of a sequence (and the
    mean over the data-parallel replicas). An engine whose gradient reduction averages over
    the SP ranks too divides that sum by ``sp``; the loss then scales its gradient by
    ``sp``. An engine that averages over the replicas only needs no scale.

    Who averages over the SP ranks: DeepSpeed ZeRO-3 with its reduce-scatter, the Hugging
    Face Trainer (it hands DeepSpeed no sequence-parallel groups) and FSDP2 sharding over
    ``dp x sp`` (``ulysses_cp.integrations.fsdp2``). DeepSpeed ZeRO 0-2 reduce over the
    replicas only (``training.engine``'s mpu).
    """
    if sp_world_size < 1:
        raise ValueError(f"the sequence-parallel size must be >= 1, got {sp_world_size}")
    return float(sp_world_size) if averages_over_sp else 1.0
