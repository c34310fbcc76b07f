"""Delta-rule linear attention under sequence parallelism, on the exchange of
:mod:`~ulysses_cp.modes.mixer` (see :mod:`~ulysses_cp.models.hf_mixers` for the steps).

- Gated delta nets (Qwen3-Next, Qwen3.5): a block of key heads and the value heads that
  use them per rank (consecutive, as the kernel groups them).
- KDA, Kimi Delta Attention (Kimi Linear): heads split. The forget gate's projection and
  the beta logits travel in the model's dtype with q, k and v; each rank makes its heads'
  per-channel decay in float32 from them, as the model does, so nothing is rounded that
  the one-process model keeps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..modes.mixer import MixerExchange, split_channels
from .mixer_ops import by_document, causal_conv, family_kernel, units

__all__ = ["gated_delta_net", "gated_delta_net_units", "kda", "kda_units"]


def _delta_rule(ex: MixerExchange, rule, q, k, v, g, beta) -> torch.Tensor:
    """The family's delta-rule kernel (fla's signature) on each document from a zero
    state, q and k l2-normalised inside it, as the models call it: the output only."""

    def run(q, k, v, g, beta):
        out, _ = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        return out

    return by_document(ex, run, q, k, v, g, beta)


# ---------------------------------------------------------------- gated delta net (Qwen3-Next)


def _qwen3_next_projection(module: Any, x: torch.Tensor):
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(x), module.in_proj_ba(x)
    )
    mixed = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)  # (b, s_l, 2 Kd + Vd)
    return mixed, z, b, a


def _qwen3_5_projection(module: Any, x: torch.Tensor):
    z = module.in_proj_z(x)
    z = z.unflatten(-1, (-1, module.head_v_dim))  # (b, s_l, Hv, dv)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


def gated_delta_net(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """The gated delta rule per value head; each rank takes a block of key heads and the
    value heads that use them (consecutive, as the kernel groups them)."""
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    if hasattr(module, "in_proj_qkvz"):
        mixed, z, b, a = _qwen3_next_projection(module, x)
    else:
        mixed, z, b, a = _qwen3_5_projection(module, x)
    kd = hk * dk
    conv_dim = 2 * kd + hv * dv
    source = torch.cat([mixed, b, a], dim=-1)  # (b, s_l, conv_dim + 2 Hv)
    blocks = [
        units(hk, dk),  # q
        units(hk, dk, kd),  # k
        units(hv, dv, 2 * kd),  # v
        units(hv, 1, conv_dim),  # b
        units(hv, 1, conv_dim + hv),  # a
    ]
    index = split_channels(blocks, ex.P, "key and value heads")
    rank = ex.topo.sp_rank
    full = ex.to_channels(source, index)  # (b, s, c)
    k_l, v_l = hk // ex.P, hv // ex.P
    c_conv = 2 * k_l * dk + v_l * dv
    mine = index[rank][:c_conv].to(x.device)
    heads = slice(rank * v_l, (rank + 1) * v_l)
    qkv = causal_conv(module, module.conv1d, ex, full[..., :c_conv], mine, module.activation)
    q, k, v = qkv.split([k_l * dk, k_l * dk, v_l * dv], dim=-1)
    q, k = (t.unflatten(-1, (k_l, dk)) for t in (q, k))  # (b, s, Hk/P, dk)
    v = v.unflatten(-1, (v_l, dv))  # (b, s, Hv/P, dv)
    b_, a_ = full[..., c_conv : c_conv + v_l], full[..., c_conv + v_l :]
    beta = b_.sigmoid()
    g = -module.A_log[heads].float().exp() * F.softplus(a_.float() + module.dt_bias[heads])
    rule = family_kernel(module, "torch_chunk_gated_delta_rule")
    core = _delta_rule(ex, rule, q, k, v, g, beta)  # (b, s, Hv/P, dv)
    core = ex.from_channels(core.flatten(2)).unflatten(-1, (hv, dv))  # (b, s_l, Hv, dv)
    shape = core.shape
    core = module.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(shape)
    return module.out_proj(core.flatten(2))


def gated_delta_net_units(module: Any) -> dict[str, int]:
    return {"key heads": module.num_k_heads, "value heads": module.num_v_heads}


# ---------------------------------------------------------------- KDA (Kimi Linear)


def kda(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """Kimi Delta Attention: q, k, v (short conv each), the forget gate's projection and
    the beta logits of this rank's heads for the whole sequence; the gated norm and the
    output projection on the shard."""
    H, d = module.num_heads, module.head_dim
    w = H * d
    gate = module.forget_gate
    f = gate.f_b_proj(gate.f_a_proj(x))  # (b, s_l, H d), before its float32 softplus
    source = torch.cat(
        [module.q_proj(x), module.k_proj(x), module.v_proj(x), f, module.b_proj(x)], dim=-1
    )
    blocks = [
        units(H, d),
        units(H, d, w),
        units(H, d, 2 * w),
        units(H, d, 3 * w),
        units(H, 1, 4 * w),
    ]
    index = split_channels(blocks, ex.P, "heads")
    rank, h_l = ex.topo.sp_rank, H // ex.P
    full = ex.to_channels(source, index)  # (b, s, h_l (4 d + 1))
    c_conv = 3 * h_l * d
    mine = index[rank][:c_conv].to(x.device)
    qkv = causal_conv(module, module.conv1d, ex, full[..., :c_conv], mine, module.activation)
    q, k, v = (t.unflatten(-1, (h_l, d)) for t in qkv.split(h_l * d, dim=-1))
    my = slice(rank * h_l * d, (rank + 1) * h_l * d)
    g = full[..., c_conv : c_conv + h_l * d].float() + gate.dt_bias.float()[my]
    g = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g))).unflatten(-1, (h_l, d))
    heads = slice(rank * h_l, (rank + 1) * h_l)
    g = -torch.exp(gate.A_log.float()[:, :, heads]) * g  # (b, s, h_l, d)
    beta = torch.sigmoid(full[..., c_conv + h_l * d :])  # (b, s, h_l)
    rule = family_kernel(module, "chunk_kimi_delta_attention")
    core = _delta_rule(ex, rule, q, k, v, g, beta)  # (b, s, h_l, d)
    core = ex.from_channels(core.flatten(2)).unflatten(-1, (H, d))  # (b, s_l, H, d)
    out_gate = module.g_b_proj(module.g_a_proj(x)).unflatten(-1, (H, d))
    return module.o_proj(module.o_norm(core, out_gate).flatten(2))


def kda_units(module: Any) -> dict[str, int]:
    return {"heads": int(module.num_heads)}
