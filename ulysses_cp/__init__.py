"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. The public API, re-exported here from the one module each name
lives in; everything else (kernels, planner and loss internals) is imported from its
module (``ulysses_cp.kernels.dispatch.local_attention``, ``ulysses_cp.core.options.RunOptions``,
...)."""

from .config import RunConfig, SequenceParallelConfig
from .core.batch import shard_batch
from .core.comm import stats as comm_stats
from .core.options import BACKENDS, LAYOUTS
from .core.sharding import (
    gather_sequence,
    pad_batch,
    pad_to_multiple,
    sequence_multiple,
    shard_sequence,
)
from .core.topology import Topology, init_topology
from .core.varlen import cu_seqlens_from_position_ids, pack_documents
from .integrations.torch_native import (
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from .models.log_probs import kl_to_reference, sequence_log_probs, token_log_probs
from .models.loss import sequence_parallel_cross_entropy
from .modes.attention import Attention, attention
from .training.engine import init_distributed, initialize, topology_from_config

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "Attention",
    "RunConfig",
    "SequenceParallelConfig",
    "Topology",
    "attention",
    "comm_stats",
    "context_parallel",
    "context_parallel_unshard",
    "cu_seqlens_from_position_ids",
    "gather_sequence",
    "init_distributed",
    "init_topology",
    "initialize",
    "kl_to_reference",
    "pack_documents",
    "pad_batch",
    "pad_to_multiple",
    "sequence_log_probs",
    "sequence_multiple",
    "sequence_parallel_cross_entropy",
    "set_rotate_method",
    "shard_batch",
    "shard_sequence",
    "token_log_probs",
    "topology_from_config",
]
