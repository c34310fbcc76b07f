"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. The public API (README.md, docs/api.md), re-exported here from the
one module each name lives in."""

from .config import RunConfig, SequenceParallelConfig
from .core.batch import BatchPlan, shard_batch
from .core.comm import stats as comm_stats
from .core.options import BACKENDS, LAYOUTS, RunOptions
from .core.sharding import (
    gather_sequence,
    layout_indices,
    layout_of,
    pad_batch,
    pad_to_multiple,
    sequence_multiple,
    shard_sequence,
)
from .core.topology import Topology, init_topology, plan_groups, validate_degrees
from .core.varlen import cu_seqlens_from_position_ids, pack_documents
from .integrations.torch_native import (
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from .kernels.backends import Kernel
from .kernels.blocks import work as work_stats
from .kernels.dispatch import KernelCall, attn_backward, attn_forward, local_attention
from .kernels.spec import AttentionSpec, Scores
from .models.log_probs import kl_to_reference, sequence_log_probs, sequence_sums, token_log_probs
from .models.loss import local_loss_term, replicated_loss_term, sequence_parallel_cross_entropy
from .modes.attention import Attention, attention
from .modes.ulysses import kv_replication
from .plan.comm import forward_comm_bytes
from .training.engine import (
    init_distributed,
    initialize,
    run_options,
    topology_from_config,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "Attention",
    "AttentionSpec",
    "BatchPlan",
    "Kernel",
    "KernelCall",
    "RunConfig",
    "RunOptions",
    "Scores",
    "SequenceParallelConfig",
    "Topology",
    "attention",
    "attn_backward",
    "attn_forward",
    "comm_stats",
    "context_parallel",
    "context_parallel_unshard",
    "cu_seqlens_from_position_ids",
    "forward_comm_bytes",
    "gather_sequence",
    "init_distributed",
    "init_topology",
    "initialize",
    "kl_to_reference",
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
    "sequence_log_probs",
    "sequence_multiple",
    "sequence_parallel_cross_entropy",
    "sequence_sums",
    "set_rotate_method",
    "shard_batch",
    "shard_sequence",
    "token_log_probs",
    "topology_from_config",
    "validate_degrees",
    "work_stats",
]
