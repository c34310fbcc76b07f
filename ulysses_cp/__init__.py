"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. Public API: see README.md and docs/api.md."""

from .core import comm
from .core.comm import stats as comm_stats
from .core.options import RunOptions
from .core.sharding import (
    LAYOUTS,
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
from .kernels.dispatch import BACKENDS, Kernel, attn_backward, attn_forward, local_attention
from .kernels.dispatch import work as work_stats
from .models.loss import local_loss_term, replicated_loss_term, sequence_parallel_cross_entropy
from .modes.attention import Attention, attention, forward_comm_bytes
from .modes.ulysses import kv_replication
from .moved import MOVED, install
from .training import engine
from .training.engine import (
    SequenceParallelConfig,
    init_distributed,
    initialize,
    run_options,
    topology_from_config,
)

__version__ = "0.1.0"


def _keep_old_paths() -> None:
    """``ulysses_cp.ring`` and the other pre-folder module paths: modules already imported
    are registered under their old names now (as attributes too, as before, except
    ``attention``, which is the function); the rest on first import (:mod:`.moved`)."""
    import sys

    install(__name__)
    for old, new in MOVED.items():
        module = sys.modules.get(f"{__name__}.{new}")
        if module is not None:
            sys.modules.setdefault(f"{__name__}.{old}", module)
            if old not in globals():
                globals()[old] = module


_keep_old_paths()

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
    "context_parallel",
    "context_parallel_unshard",
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
    "set_rotate_method",
    "shard_sequence",
    "topology_from_config",
    "validate_degrees",
    "work_stats",
]
