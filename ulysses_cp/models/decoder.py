"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) with pluggable attention.

The model holds no parallel code: attention is a callable ``attn(q, k, v) -> out`` on
``(b, s, h, d)`` tensors (``ucp.Attention(topo)``, or a local kernel), handed the batch's
plan as ``batch=`` when the forward gets one (``ucp.shard_batch`` makes it: packed
documents, and the checks made once per batch); RoPE is driven by the position ids it is
given, which must be GLOBAL positions of the tokens this rank holds (``ucp.shard_batch``
makes them).

Legend: b batch, s tokens held (local under SP), D model dim, h/hkv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..core.batch import BatchPlan
from ..core.offload import offloaded_layers
from ..core.tiles import TilePlan, plan_tiles
from .memory import TiledMLP, checkpointed

__all__ = [
    "Block",
    "Decoder",
    "SwiGLU",
    "rope",
]


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (b, s, ffn) x2
        return self.down(F.silu(gate) * up)


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x ``(b, s, h, d)``, position_ids ``(b, s)`` global positions."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = position_ids.float().unsqueeze(-1) * inv  # (b, s, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(2)  # (b, s, 1, d)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(2)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tiles: TilePlan | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.dim, (h + 2 * hkv) * d, bias=False)
        self.proj = nn.Linear(h * d, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        mlp = SwiGLU(cfg.dim, cfg.ffn_dim)
        tiles = tiles if tiles is not None else plan_tiles(cfg)
        self.mlp = TiledMLP(mlp, tiles.mlp, cfg.ffn_dim) if tiles.tiles_mlp else mlp

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attn: Callable) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        q, k, v = self.qkv(self.attn_norm(x)).split([h * d, hkv * d, hkv * d], dim=-1)
        q = rope(q.view(b, s, h, d), position_ids, cfg.rope_theta)  # (b, s, h, d)
        k = rope(k.view(b, s, hkv, d), position_ids, cfg.rope_theta)  # (b, s, hkv, d)
        v = v.view(b, s, hkv, d)
        x = x + self.proj(attn(q, k, v).reshape(b, s, h * d))  # (b, s, D)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """``forward(input_ids (b, s), position_ids (b, s), batch=None) -> logits
    (b, s, vocab)``. ``tiles``: the run's tile plan (``core.tiles.plan_tiles``; None:
    resolved from ``cfg`` alone, without a GPU's default budget)."""

    def __init__(self, cfg: ModelConfig, attn: Callable, *, tiles: TilePlan | None = None) -> None:
        super().__init__()
        self.cfg, self.attn = cfg, attn
        tiles = tiles if tiles is not None else plan_tiles(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, tiles) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        batch: BatchPlan | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """``batch``: the batch's plan (``ucp.shard_batch``; a packed row's documents);
        passed to ``attn`` as a keyword. ``return_hidden``: the final normed hidden states
        ``(b, s, D)`` instead of logits (for ``memory.tiled_cross_entropy`` with
        ``self.head``)."""
        x = self.embed(input_ids)  # (b, s, D)
        attn = self.attn if batch is None else partial(self.attn, batch=batch)
        offloaded = offloaded_layers(self.cfg.offload_activations, len(self.layers))
        for i, layer in enumerate(self.layers):
            if self.cfg.activation_checkpointing and self.training:
                run = partial(layer, position_ids=position_ids, attn=attn)
                x = checkpointed(run, x, offload=i < offloaded)
            else:
                x = layer(x, position_ids, attn)
        x = self.norm(x)
        return x if return_hidden else self.head(x)  # (b, s, D) or (b, s, V)
