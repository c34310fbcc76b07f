"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. Public API: see README.md and docs/api.md."""

from . import comm, engine
from .attention import Attention, attention, forward_comm_bytes
from .comm import stats as comm_stats
from .engine import (
    SequenceParallelConfig,
    init_distributed,
    initialize,
    run_options,
    topology_from_config,
)
from .kernels import BACKENDS, Kernel, attn_backward, attn_forward, local_attention
from .loss import local_loss_term, replicated_loss_term, sequence_parallel_cross_entropy
from .options import RunOptions
from .sharding import (
    LAYOUTS,
    gather_sequence,
    layout_indices,
    layout_of,
    pad_batch,
    pad_to_multiple,
    sequence_multiple,
    shard_sequence,
)
from .topology import Topology, init_topology, plan_groups, validate_degrees
from .ulysses import kv_replication
from .varlen import cu_seqlens_from_position_ids, pack_documents

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "Attention",
    "Kernel",
    "RunOptions",
    "SequenceParallelConfig",
    "Topology",
    "attention",
    "attn_backward",
    "attn_forward",
    "comm",
    "comm_stats",
    "cu_seqlens_from_position_ids",
    "engine",
    "forward_comm_bytes",
    "gather_sequence",
    "init_distributed",
    "init_topology",
    "initialize",
    "kv_replication",
    "layout_indices",
    "layout_of",
    "local_attention",
    "local_loss_term",
    "pack_documents",
    "pad_batch",
    "pad_to_multiple",
    "plan_groups",
    "replicated_loss_term",
    "run_options",
    "sequence_multiple",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
    "topology_from_config",
    "validate_degrees",
]
