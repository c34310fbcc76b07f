"""MiniMax's lightning attention under sequence parallelism, on the exchange of
:mod:`~ulysses_cp.modes.mixer` (see :mod:`~ulysses_cp.models.hf_mixers` for the steps).

Lightning attention is linear attention with a fixed decay per head: token ``t`` reads
``sum_{j <= t} exp(-slope (t - j)) (q_t . k_j) v_j``. transformers computes it in blocks
of ``block_size`` tokens inside the module's own ``forward`` (no kernel function to call),
so the recurrence is written here, block for block in the same order, with the module's
own decay buffers (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``) for
this rank's heads. The heads split over the SP group; each rank runs its heads over the
whole sequence (each document of a packed row from a zero state), and the norm over all
heads, the output gate and the projection run per token on the shard.
"""

from __future__ import annotations

from typing import Any

import torch

from ..modes.mixer import MixerExchange, split_channels
from .mixer_ops import by_document, units

__all__ = ["lightning", "lightning_units"]


def _blocks(module: Any, heads: slice, q, k, v) -> torch.Tensor:
    """``q``, ``k``, ``v`` ``(b, h, n, d)`` of ``heads`` over one document: the decayed
    linear attention, ``block_size`` tokens at a time (within a block exactly, across
    blocks through the running ``k^T v`` state)."""
    B = module.block_size
    slope = module.slope_rate[heads]  # (h, 1, 1)
    q_decay, k_decay = module.query_decay[heads], module.key_decay[heads]  # (h, B, 1)
    diag = module.diagonal_decay[:, heads]  # (1, h, B, B)
    b, h, n, d = q.shape
    state = q.new_zeros(b, h, d, v.shape[-1])
    out = []
    for start in range(0, n, B):
        qi, ki, vi = (t[:, :, start : start + B] for t in (q, k, v))
        m = qi.shape[2]
        within = ((qi @ ki.transpose(-1, -2)) * diag[:, :, :m, :m]) @ vi
        out.append((qi * q_decay[:, :m]) @ state + within)
        state = state * torch.exp(-slope * m) + (ki * k_decay[:, -m:]).transpose(-1, -2) @ vi
    return torch.cat(out, dim=2)


def lightning(module: Any, ex: MixerExchange, x: torch.Tensor):
    """MiniMax's lightning attention layer: ``(output, None)`` as the layer unpacks it."""
    H, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(x))  # (b, s_l, H 3d): per head q, k, v
    index = split_channels([units(H, 3 * d)], ex.P, "heads")
    rank, h_l = ex.topo.sp_rank, H // ex.P
    full = ex.to_channels(qkv, index).unflatten(-1, (h_l, 3 * d))  # (b, s, h_l, 3d)
    heads = slice(rank * h_l, (rank + 1) * h_l)

    def run(piece):  # (b, s_doc, h_l, 3d) -> (b, s_doc, h_l, d)
        q, k, v = (t.transpose(1, 2) for t in piece.split(d, dim=-1))
        return _blocks(module, heads, q, k, v).transpose(1, 2)

    y = ex.from_channels(by_document(ex, run, full).flatten(2))  # (b, s_l, H d)
    y = torch.sigmoid(module.output_gate(x)) * module.norm(y)
    return module.out_proj(y), None


def lightning_units(module: Any) -> dict[str, int]:
    return {"heads": int(module.num_attention_heads)}
