"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. The public API (README.md, docs/api.md), re-exported here from the
one module each name lives in.

The names are loaded on first use (PEP 562): ``import ulysses_cp.config`` (the training
entry point's config check) imports neither torch nor DeepSpeed. Type checkers read the
imports below; :data:`_HOMES` is where each name is found at run time (a test keeps the two
equal)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from .models.log_probs import (
        kl_to_reference,
        sequence_log_probs,
        sequence_sums,
        token_log_probs,
    )
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


# name -> (module, attribute): the names of ``__all__``, loaded on first use
_HOMES: dict[str, tuple[str, str]] = {
    "Attention": ("modes.attention", "Attention"),
    "AttentionSpec": ("kernels.spec", "AttentionSpec"),
    "BACKENDS": ("core.options", "BACKENDS"),
    "BatchPlan": ("core.batch", "BatchPlan"),
    "Kernel": ("kernels.backends", "Kernel"),
    "KernelCall": ("kernels.dispatch", "KernelCall"),
    "LAYOUTS": ("core.options", "LAYOUTS"),
    "RunConfig": ("config", "RunConfig"),
    "RunOptions": ("core.options", "RunOptions"),
    "Scores": ("kernels.spec", "Scores"),
    "SequenceParallelConfig": ("config", "SequenceParallelConfig"),
    "Topology": ("core.topology", "Topology"),
    "attention": ("modes.attention", "attention"),
    "attn_backward": ("kernels.dispatch", "attn_backward"),
    "attn_forward": ("kernels.dispatch", "attn_forward"),
    "comm_stats": ("core.comm", "stats"),
    "context_parallel": ("integrations.torch_native", "context_parallel"),
    "context_parallel_unshard": ("integrations.torch_native", "context_parallel_unshard"),
    "cu_seqlens_from_position_ids": ("core.varlen", "cu_seqlens_from_position_ids"),
    "forward_comm_bytes": ("plan.comm", "forward_comm_bytes"),
    "gather_sequence": ("core.sharding", "gather_sequence"),
    "init_distributed": ("training.engine", "init_distributed"),
    "init_topology": ("core.topology", "init_topology"),
    "initialize": ("training.engine", "initialize"),
    "kl_to_reference": ("models.log_probs", "kl_to_reference"),
    "kv_replication": ("modes.ulysses", "kv_replication"),
    "layout_indices": ("core.sharding", "layout_indices"),
    "layout_of": ("core.sharding", "layout_of"),
    "local_attention": ("kernels.dispatch", "local_attention"),
    "local_loss_term": ("models.loss", "local_loss_term"),
    "pack_documents": ("core.varlen", "pack_documents"),
    "pad_batch": ("core.sharding", "pad_batch"),
    "pad_to_multiple": ("core.sharding", "pad_to_multiple"),
    "plan_groups": ("core.topology", "plan_groups"),
    "replicated_loss_term": ("models.loss", "replicated_loss_term"),
    "run_options": ("training.engine", "run_options"),
    "sequence_log_probs": ("models.log_probs", "sequence_log_probs"),
    "sequence_multiple": ("core.sharding", "sequence_multiple"),
    "sequence_parallel_cross_entropy": ("models.loss", "sequence_parallel_cross_entropy"),
    "sequence_sums": ("models.log_probs", "sequence_sums"),
    "set_rotate_method": ("integrations.torch_native", "set_rotate_method"),
    "shard_batch": ("core.batch", "shard_batch"),
    "shard_sequence": ("core.sharding", "shard_sequence"),
    "token_log_probs": ("models.log_probs", "token_log_probs"),
    "topology_from_config": ("training.engine", "topology_from_config"),
    "validate_degrees": ("core.topology", "validate_degrees"),
    "work_stats": ("kernels.blocks", "work"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home[0]}", __name__), home[1])
    globals()[name] = value  # the next lookup skips this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
