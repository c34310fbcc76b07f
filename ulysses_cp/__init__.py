"""ulysses_cp: sequence-parallel attention (Ulysses all-to-all, ring, hybrid) for
long-context training. The public API, re-exported here from the one module each name
lives in; everything else (kernels, planner and loss internals) is imported from its
module (``ulysses_cp.kernels.dispatch.local_attention``, ``ulysses_cp.core.options.RunOptions``,
...).

The names are loaded on first use (PEP 562): ``import ulysses_cp.config`` (the training
entry point's config check) imports neither torch nor DeepSpeed. Type checkers read the
imports below; :data:`_HOMES` is where each name is found at run time (a test keeps the two
equal)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from .integrations.fsdp2 import FSDPMesh, fsdp_mesh
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
    "FSDPMesh",
    "RunConfig",
    "SequenceParallelConfig",
    "Topology",
    "attention",
    "comm_stats",
    "context_parallel",
    "context_parallel_unshard",
    "cu_seqlens_from_position_ids",
    "fsdp_mesh",
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


# name -> (module, attribute): the names of ``__all__``, loaded on first use
_HOMES: dict[str, tuple[str, str]] = {
    "Attention": ("modes.attention", "Attention"),
    "BACKENDS": ("core.options", "BACKENDS"),
    "FSDPMesh": ("integrations.fsdp2", "FSDPMesh"),
    "LAYOUTS": ("core.options", "LAYOUTS"),
    "RunConfig": ("config", "RunConfig"),
    "SequenceParallelConfig": ("config", "SequenceParallelConfig"),
    "Topology": ("core.topology", "Topology"),
    "attention": ("modes.attention", "attention"),
    "comm_stats": ("core.comm", "stats"),
    "context_parallel": ("integrations.torch_native", "context_parallel"),
    "context_parallel_unshard": ("integrations.torch_native", "context_parallel_unshard"),
    "cu_seqlens_from_position_ids": ("core.varlen", "cu_seqlens_from_position_ids"),
    "fsdp_mesh": ("integrations.fsdp2", "fsdp_mesh"),
    "gather_sequence": ("core.sharding", "gather_sequence"),
    "init_distributed": ("training.engine", "init_distributed"),
    "init_topology": ("core.topology", "init_topology"),
    "initialize": ("training.engine", "initialize"),
    "kl_to_reference": ("models.log_probs", "kl_to_reference"),
    "pack_documents": ("core.varlen", "pack_documents"),
    "pad_batch": ("core.sharding", "pad_batch"),
    "pad_to_multiple": ("core.sharding", "pad_to_multiple"),
    "sequence_log_probs": ("models.log_probs", "sequence_log_probs"),
    "sequence_multiple": ("core.sharding", "sequence_multiple"),
    "sequence_parallel_cross_entropy": ("models.loss", "sequence_parallel_cross_entropy"),
    "set_rotate_method": ("integrations.torch_native", "set_rotate_method"),
    "shard_batch": ("core.batch", "shard_batch"),
    "shard_sequence": ("core.sharding", "shard_sequence"),
    "token_log_probs": ("models.log_probs", "token_log_probs"),
    "topology_from_config": ("training.engine", "topology_from_config"),
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
