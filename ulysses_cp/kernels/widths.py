"""Values wider or narrower than queries and keys (MLA: DeepSeek-V2/V3, Kimi-K2, MiniCPM3),
for the kernels that take one head dim.

Multi-head latent attention scores with a q/k head dim (DeepSeek-V3: 128 + 64 RoPE = 192)
other than its value head dim (128). The math backend takes any widths; flash-attn 2 and
torch's fused kernels take one head dim for q, k and v. For those, the narrower side is
padded with zeros to the wider one around the call and the results are cut back:

- narrower values: v (and, in the backward, ``out`` and ``dout``) padded; the padded
  output columns are zeros (a softmax-weighted sum of zeros), cut off, and so is their
  gradient;
- narrower queries and keys: q and k padded; zeros add nothing to a score, and the scale
  was already taken from the true q/k width (``Scores.scale``).

Exact either way: the padded call computes the same scores, probabilities and outputs.
Only the local kernel sees the padding; every exchange between ranks carries V at its own
width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["backward", "forward"]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def forward(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest):
    """``fn(q, k, v, *rest) -> (out, lse)`` with q/k and v at one width; ``out`` at v's."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return fn(q, k, v, *rest)
    w = max(dqk, dv)
    out, lse = fn(_pad(q, w), _pad(k, w), _pad(v, w), *rest)
    return out[..., :dv], lse


def backward(fn: Callable, dout, q, k, v, out, lse, *rest):
    """``fn(dout, q, k, v, out, lse, *rest) -> (dq, dk, dv)`` with one width inside; each
    gradient at its input's width."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk == dv:
        return fn(dout, q, k, v, out, lse, *rest)
    w = max(dqk, dv)
    padded = (_pad(t, w) for t in (dout, q, k, v, out))
    gq, gk, gv = fn(*padded, lse, *rest)
    return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]
