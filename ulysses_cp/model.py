"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) with pluggable attention.

The model holds no parallel code: attention is a callable ``attn(q, k, v) -> out`` on
``(b, s, h, d)`` tensors (``ucp.attention`` bound to a topology, or a local kernel; packed
rows add ``cu_seqlens=``), and RoPE is driven by the position ids it is given, which must
be GLOBAL positions of the tokens this rank holds (``data.shard_batch`` makes them).

Legend: b batch, s tokens held (local under SP), D model dim, h/hkv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import from_block
from .memory import TiledMLP, checkpointed


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = False
    offload_activations: bool = False  # checkpointed layer inputs wait on CPU (needs the above)
    tiled_mlp: int = 0  # > 1: the MLP runs in this many sequence pieces (ulysses_cp.memory)
    tiled_loss: int = 0  # > 1: LM head + loss in this many pieces, no full logits (train.py)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        mc = from_block(cls, cfg, "model")
        check_memory_options(mc)
        if mc.dim % mc.n_heads or mc.n_heads % mc.n_kv_heads or (mc.dim // mc.n_heads) % 2:
            raise ValueError(
                f"model: dim ({mc.dim}) must split into n_heads ({mc.n_heads}) "
                f"heads of even size and n_heads must be a multiple of "
                f"n_kv_heads ({mc.n_kv_heads})"
            )
        return mc

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def check_memory_options(block) -> None:
    """The ALST switches shared by the reference decoder and Hugging Face models."""
    for name in ("tiled_mlp", "tiled_loss"):
        value = getattr(block, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"model.{name} must be a number of pieces >= 0, got {value!r}")
    for name in ("activation_checkpointing", "offload_activations"):
        if not isinstance(getattr(block, name), bool):
            raise ValueError(f"model.{name} must be true or false")
    if block.offload_activations and not block.activation_checkpointing:
        raise ValueError(
            "model.offload_activations moves the checkpointed layer inputs to CPU: it needs "
            "model.activation_checkpointing: true"
        )


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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.dim, (h + 2 * hkv) * d, bias=False)
        self.proj = nn.Linear(h * d, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        mlp = SwiGLU(cfg.dim, cfg.ffn_dim)
        self.mlp = TiledMLP(mlp, cfg.tiled_mlp) if cfg.tiled_mlp > 1 else mlp

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
    """``forward(input_ids (b, s), position_ids (b, s), cu_seqlens=None) -> logits
    (b, s, vocab)``."""

    def __init__(self, cfg: ModelConfig, attn: Callable) -> None:
        super().__init__()
        self.cfg, self.attn = cfg, attn
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
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
        cu_seqlens: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """``cu_seqlens``: a packed row (b = 1); passed to ``attn`` as a keyword.
        ``return_hidden``: the final normed hidden states ``(b, s, D)`` instead of logits
        (for ``memory.tiled_cross_entropy`` with ``self.head``)."""
        x = self.embed(input_ids)  # (b, s, D)
        attn = self.attn if cu_seqlens is None else partial(self.attn, cu_seqlens=cu_seqlens)
        for layer in self.layers:
            if self.cfg.activation_checkpointing and self.training:
                run = partial(layer, position_ids=position_ids, attn=attn)
                x = checkpointed(run, x, offload=self.cfg.offload_activations)
            else:
                x = layer(x, position_ids, attn)
        x = self.norm(x)
        return x if return_hidden else self.head(x)  # (b, s, D) or (b, s, V)
