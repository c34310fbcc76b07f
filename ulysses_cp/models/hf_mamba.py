"""Mamba's selective scans under sequence parallelism, on the exchange of
:mod:`~ulysses_cp.modes.mixer` (see :mod:`~ulysses_cp.models.hf_mixers` for the steps).

- Mamba2 (SSD: Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1): heads split; each rank's
  B/C groups travel with its heads, or to every rank whose heads use a shared group.
- Mamba1 (Mamba, FalconMamba, Jamba): the ``d_inner`` channels split. Its ``x_proj`` reads
  every channel to make each token's ``dt``, B and C (``dt_rank + 2 d_state`` numbers), so
  each rank projects its own channels and one all-reduce over the SP group sums the
  shares (in float32 at least) for the whole sequence; then ``dt_proj`` for this rank's
  channels, the scan on them, and the gate ``silu(z)`` on the shard after the exchange
  back (per token: ``z`` never travels).
- Zamba's multi-head Mamba1: each head has its own ``x_proj`` and ``dt_proj``, so the
  heads split and nothing is summed across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..modes.mixer import MixerExchange, split_channels
from .mixer_ops import by_document, causal_conv, family_kernel, units

__all__ = [
    "mamba1",
    "mamba1_units",
    "mamba2",
    "mamba2_groups",
    "mamba2_units",
    "zamba_mamba",
    "zamba_mamba_units",
]


def mamba2_groups(module: Any, P: int) -> list[torch.Tensor]:
    """Per rank, the B/C groups its heads use (contiguous head blocks; a group shared by
    several ranks goes to each of them)."""
    H, G = module.num_heads, module.n_groups
    per_group = H // G
    out = []
    for r in range(P):
        heads = range(r * H // P, (r + 1) * H // P)
        out.append(torch.tensor(sorted({h // per_group for h in heads})))
    if len({len(g) for g in out}) != 1:
        raise ValueError(f"{H} heads in {G} groups do not split evenly over {P} ranks")
    return out


def mamba2(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """Mamba2 (SSD): heads split, each rank's B/C groups with them; the gated norm (per
    token) and the output projection back on the shard."""
    H, p, G, N = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    I = module.intermediate_size
    dtype = x.dtype
    if hasattr(module, "mup_vector"):  # Falcon-H1's multipliers
        proj = module.in_proj(x * module.ssm_in_multiplier) * module.mup_vector
    else:
        proj = module.in_proj(x)
    gate, xbc, dt = proj.split([I, module.conv_dim, H], dim=-1)
    source = torch.cat([xbc, dt], dim=-1)  # (b, s_l, conv_dim + H)
    groups = mamba2_groups(module, ex.P)
    heads = split_channels([units(H, p)], ex.P, "heads")
    dts = split_channels([units(H, 1, module.conv_dim)], ex.P, "heads")
    index = [
        torch.cat(
            [heads[r], *(units(G, N, I + off)[groups[r]].flatten() for off in (0, G * N)), dts[r]]
        )
        for r in range(ex.P)
    ]
    rank = ex.topo.sp_rank
    full = ex.to_channels(source, index)  # (b, s, c)
    h_l, g_l = H // ex.P, len(groups[rank])
    c_conv = h_l * p + 2 * g_l * N
    mine = index[rank][:c_conv].to(x.device)
    conv = causal_conv(module, module.conv1d, ex, full[..., :c_conv], mine, module.activation)
    xs, B, C = conv.split([h_l * p, g_l * N, g_l * N], dim=-1)
    dt_l = full[..., c_conv:]  # (b, s, H/P)
    my = slice(rank * h_l, (rank + 1) * h_l)
    A = -torch.exp(module.A_log.float())[my]
    scan = family_kernel(module, "mamba2_chunk_scan")

    def run(xs, dt_l, B, C):
        return scan(
            xs.unflatten(-1, (h_l, p)),
            dt_l,
            A,
            B.unflatten(-1, (g_l, N)),
            C.unflatten(-1, (g_l, N)),
            chunk_size=module.chunk_size,
            D=module.D[my],
            z=None,
            dt_bias=module.dt_bias[my],
            dt_softplus=True,
            dt_limit=module.time_step_limit,
        )

    y = by_document(ex, run, xs, dt_l, B, C).flatten(2)  # (b, s, H/P * p)
    y = ex.from_channels(y)  # (b, s_l, I)
    norm = getattr(module, "mamba_rms_norm", True)  # Falcon-H1 may gate without the norm
    y = module.norm(y, gate) if norm else y * F.silu(gate)
    return module.out_proj(y.to(dtype))


def mamba2_units(module: Any) -> dict[str, int]:
    return {"heads": module.num_heads, "groups": module.n_groups}


# ---------------------------------------------------------------- Mamba1


def _gated_output(module: Any, y: torch.Tensor, gate: torch.Tensor, dtype) -> torch.Tensor:
    """``out_proj(y * silu(z))`` on the shard, the gate in float32 at least (where the
    kernel would apply it), back in the layer input's ``dtype``: ``y``, ``gate``
    ``(b, s_l, I)``."""
    wide = torch.promote_types(dtype, torch.float32)
    return module.out_proj((y.to(wide) * F.silu(gate.to(wide))).to(dtype))


def mamba1(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """Mamba1: channels split; ``x_proj``'s partial sums all-reduced; the RMS norms of
    dt, B and C (Jamba, FalconMamba) per token on the sums."""
    I, N, R = module.intermediate_size, module.ssm_state_size, module.time_step_rank
    dtype = x.dtype
    wide = torch.promote_types(dtype, torch.float32)
    hs, gate = module.in_proj(x).chunk(2, dim=-1)  # (b, s_l, I) each
    index = split_channels([units(I, 1)], ex.P, "channels")
    mine = index[ex.topo.sp_rank].to(x.device)
    full = ex.to_channels(hs, index)  # (b, s, I/P)
    u = causal_conv(module, module.conv1d, ex, full, mine, module.activation)
    share = F.linear(u, module.x_proj.weight[:, mine])  # (b, s, R + 2N): these channels'
    step, B, C = ex.sum_over_ranks(share.to(wide)).to(dtype).split([R, N, N], dim=-1)
    if hasattr(module, "b_layernorm"):
        step, B, C = module.dt_layernorm(step), module.b_layernorm(B), module.c_layernorm(C)
    dt = F.linear(step, module.dt_proj.weight[mine])  # (b, s, I/P), the bias in the scan
    A = -torch.exp(module.A_log.float())[mine]
    D = module.D.float()[mine]
    bias = None if module.dt_proj.bias is None else module.dt_proj.bias.float()[mine]
    scan = family_kernel(module, "mamba_selective_scan")

    def run(u, dt, B, C):  # (b, s_doc, .) -> the kernel's (b, ., s_doc) and back
        u, dt, B, C = (t.transpose(1, 2) for t in (u, dt, B, C))
        return scan(u, dt, A, B, C, D=D, z=None, delta_bias=bias, delta_softplus=True).mT

    y = ex.from_channels(by_document(ex, run, u, dt, B, C))  # (b, s_l, I)
    return _gated_output(module, y, gate, dtype)


def mamba1_units(module: Any) -> dict[str, int]:
    return {"channels": int(module.intermediate_size)}


def zamba_mamba(module: Any, ex: MixerExchange, x: torch.Tensor) -> torch.Tensor:
    """Zamba's multi-head Mamba1: each head has its own ``x_proj`` and ``dt_proj``, so the
    heads split over the ranks and nothing is summed across them."""
    H, hd = module.n_mamba_heads, module.mamba_head_dim
    N, R = module.ssm_state_size, module.time_step_rank
    proj = module.in_proj(x)  # (b, s_l, 2I): x and gate interleaved per channel
    hs, gate = proj[..., 0::2], proj[..., 1::2]
    index = split_channels([units(H, hd)], ex.P, "heads")
    rank, h_l = ex.topo.sp_rank, H // ex.P
    mine = index[rank].to(x.device)
    u = causal_conv(module, module.conv1d, ex, ex.to_channels(hs, index), mine, module.activation)
    u = u.unflatten(-1, (h_l, hd))  # (b, s, H/P, hd)
    my = slice(rank * h_l, (rank + 1) * h_l)
    ssm = torch.einsum("hkd,bshd->bshk", module.x_proj_weight[my], u)  # (b, s, H/P, R + 2N)
    step, B, C = ssm.split([R, N, N], dim=-1)
    dt = torch.einsum("hdr,bshr->bshd", module.dt_proj_weight[my], step)  # (b, s, H/P, hd)
    A = -torch.exp(module.A_log.float())[my]  # (H/P, hd, N)
    D = module.D[my]
    bias = None if module.dt_proj_bias is None else module.dt_proj_bias.float()[my]
    scan = family_kernel(module, "mamba_selective_scan")

    def run(u, dt, B, C):  # one scan per head, as the model does
        out = []
        for i in range(h_l):
            a, d, b, c = (t[:, :, i].transpose(1, 2) for t in (u, dt, B, C))
            kw = dict(D=D[i].float(), z=None, delta_softplus=True)
            kw["delta_bias"] = None if bias is None else bias[i]
            out.append(scan(a, d, A[i], b, c, **kw).mT)  # (b, s_doc, hd)
        return torch.cat(out, dim=-1)

    y = ex.from_channels(by_document(ex, run, u, dt, B, C))  # (b, s_l, I)
    return _gated_output(module, y, gate, x.dtype)


def zamba_mamba_units(module: Any) -> dict[str, int]:
    return {"heads": int(module.n_mamba_heads)}
