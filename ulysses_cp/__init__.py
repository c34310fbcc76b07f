"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. Public API: see README.md and docs/api.md."""

from . import comm
from .attention import attention
from .comm import stats as comm_stats
from .kernels import BACKENDS, attn_backward, attn_forward, local_attention
from .sharding import (
    LAYOUTS,
    gather_sequence,
    layout_indices,
    pad_batch,
    pad_to_multiple,
    sequence_multiple,
    shard_sequence,
)
from .topology import Topology, init_topology, plan_groups, validate_degrees
from .ulysses import kv_replication

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "Topology",
    "attention",
    "attn_backward",
    "attn_forward",
    "comm",
    "comm_stats",
    "gather_sequence",
    "init_topology",
    "kv_replication",
    "layout_indices",
    "local_attention",
    "pad_batch",
    "pad_to_multiple",
    "plan_groups",
    "sequence_multiple",
    "shard_sequence",
    "validate_degrees",
]
