"""Pure-torch kernels of the mixer stand-ins (float64, written here from the operations'
definitions: a depthwise causal convolution, Mamba1's selective scan, the Mamba2 SSD
recurrence, the gated delta rule), call counters, and the backward by recomputation that the
stand-ins' autograd functions use. Nothing here checks a contract: the stand-in modules do, as
their release does.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

CALLS: Counter[str] = Counter()  # "<function>" and "<function>.backward" per call


def conv(x, weight, bias=None, silu=False, seq_idx=None):
    """``x`` ``(b, c, s)``, ``weight`` ``(c, w)``: ``out[t] = sum_j weight[:, w-1-j] x[t-j]``
    (+ bias, then SiLU), taps that cross a ``seq_idx`` boundary left out."""
    w, s = weight.shape[1], x.shape[-1]
    padded = F.pad(x, (w - 1, 0))
    out = torch.zeros_like(x)
    for j in range(w):  # tap j reads x[t - j]
        tap = padded[..., w - 1 - j : w - 1 - j + s]
        if seq_idx is not None and j:
            tap = tap * (F.pad(seq_idx, (j, 0), value=-1)[:, :s] == seq_idx)[:, None]
        out = out + weight[:, w - 1 - j, None] * tap
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out) if silu else out


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, softplus=False):
    """Mamba1's selective scan, one step at a time: ``u`` and ``delta`` ``(b, d, l)``, ``A``
    ``(d, n)`` (real), ``B``/``C`` ``(d, n)`` (fixed), ``(b, n, l)`` or ``(b, g, n, l)``
    (channel i reads group ``i // (d/g)``). ``x_t = exp(delta_t A) x_{t-1} + delta_t B_t u_t``,
    ``y_t = x_t C_t + D u_t``, times ``silu(z)``. Returns ``(y, last state (b, d, n))``."""
    b, d, s = u.shape
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if softplus:
        delta = F.softplus(delta)
    B, C = (_per_channel(M, b, d, s) for M in (B, C))  # (b, d, n, l)
    state = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(s):
        dt = delta[:, :, t, None]
        state = torch.exp(dt * A) * state + dt * B[..., t] * u[:, :, t, None]
        ys.append((state * C[..., t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return y, state


def _per_channel(M, b, d, s):
    """B or C as ``(b, d, n, l)``."""
    if M.dim() == 2:
        return M[None, :, :, None].expand(b, d, M.shape[1], s)
    if M.dim() == 3:
        M = M[:, None]
    return M.repeat_interleave(d // M.shape[1], dim=1)


def ssd(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    initial=None,
    seq_idx=None,
    softplus=False,
    limit=(0.0, float("inf")),
):
    """Mamba2's selective state space, one step at a time: ``x`` ``(b, s, h, p)``, ``dt``
    ``(b, s, h)``, ``A`` ``(h,)``, ``B``/``C`` ``(b, s, g, n)`` (head i reads group
    ``i // (h/g)``). ``h_t = exp(dt A) h_{t-1} + dt x_t B_t^T``, ``y_t = h_t C_t + D x_t``,
    times ``silu(z)``. Returns ``(y, final state (b, h, p, n))``."""
    b, s, h, p = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias
    if softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(limit[0], limit[1])
    B, C = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (B, C))
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial is None else initial
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)  # (b, h)
        if seq_idx is not None and t:
            decay = decay * (seq_idx[:, t] == seq_idx[:, t - 1])[:, None]
        inject = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = state * decay[..., None, None] + inject
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def gated_delta(q, k, v, g, beta, scale, initial=None, l2norm=False, bounds=None):
    """The gated delta rule, one step at a time: ``q``/``k`` ``(b, t, h, K)``, ``v``
    ``(b, t, hv, V)``, ``g`` (log decay) and ``beta`` ``(b, t, hv)``; value head i reads
    key head ``i // (hv/h)``. ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``;
    ``o = scale S^T q``. ``bounds``: documents of a batch-1 row, each from its own state.
    Returns ``(o (b, t, hv, V), final states (n, hv, K, V))``."""
    if l2norm:
        q, k = (u * torch.rsqrt((u * u).sum(-1, keepdim=True) + 1e-6) for u in (q, k))
    rep = v.shape[2] // q.shape[2]
    q, k = (u.repeat_interleave(rep, dim=2) for u in (q, k))
    b, T, hv, V = v.shape
    docs = [(0, T)] if bounds is None else list(itertools.pairwise(bounds))
    outs, finals = [], []
    for i, (start, end) in enumerate(docs):
        if initial is None:
            S = v.new_zeros(b, hv, k.shape[-1], V)
        else:
            S = initial if bounds is None else initial[i : i + 1]
        for t in range(start, end):
            S = S * g[:, t].exp()[..., None, None]
            kt = k[:, t]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
            S = S + kt[..., None] * u[..., None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
        finals.append(S)
    return torch.stack(outs, 1), torch.cat(finals)


def as64(t):
    """A float64 copy of a floating tensor (others as they are)."""
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def recompute_grads(fn: Callable, inputs: Sequence, needs: Sequence[bool], grad_out: Sequence):
    """Gradients of ``fn(*inputs)`` (recomputed in float64) for the inputs in ``needs``, each
    in its input's dtype; None elsewhere. ``grad_out``: one per output of ``fn`` (or None)."""
    with torch.enable_grad():
        leaves = [
            as64(t).detach().requires_grad_(n) if isinstance(t, torch.Tensor) else t
            for t, n in zip(inputs, needs)
        ]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(out, grad_out) if g is not None]
        wanted = [leaf for leaf, n in zip(leaves, needs) if n]
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [as64(g) for _, g in pairs], allow_unused=True
            )
        )
    grads = []
    for t, n in zip(inputs, needs):
        if not n:
            grads.append(None)
            continue
        grad = next(got)
        grads.append(torch.zeros_like(t) if grad is None else grad.to(t.dtype))
    return grads
