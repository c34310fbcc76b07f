"""Pure-torch kernels of the mixer stand-ins (float64, written here from the operations'
definitions: a depthwise causal convolution, Mamba1's selective scan, the Mamba2 SSD
recurrence, the gated delta rule, Kimi Delta Attention), call counters, the backward by
recomputation that the stand-ins' autograd functions use, and the one the fla stand-ins share.
Nothing here checks a contract: the stand-in modules do, as their release does.
"""

from __future__ import annotations

import functools
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


def kda(q, k, v, g, beta, scale, initial=None, l2norm=False, bounds=None):
    """Kimi Delta Attention, one step at a time: ``q``/``k`` ``(b, t, h, K)``, ``v``
    ``(b, t, hv, V)``, ``g`` (log decay per key channel) ``(b, t, hv, K)``, ``beta``
    ``(b, t, hv)``; value head i reads key head ``i // (hv/h)``. ``S = diag(exp(g)) S``;
    ``S += k (beta (v - S^T k))^T``; ``o = scale S^T q`` (S ``(K, V)`` per head). ``l2norm``:
    q and k over K first. ``bounds``: documents of a batch-1 row, each from its own state.
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
            S = S * g[:, t].exp()[..., None]
            kt = k[:, t]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
            S = S + kt[..., None] * u[..., None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
        finals.append(S)
    return torch.stack(outs, 1), torch.cat(finals)


def gated_delta(q, k, v, g, beta, scale, initial=None, l2norm=False, bounds=None):
    """The gated delta rule: ``kda`` with one decay per head, ``g`` ``(b, t, hv)``."""
    return kda(q, k, v, g[..., None], beta, scale, initial, l2norm, bounds)


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


def fla_delta(kernel, q, k, v, g, beta, initial, *, scale, l2norm, beta_sigmoid, v_first, bounds):
    """fla's in-kernel options around ``kernel`` (``gated_delta`` or ``kda``):
    ``beta_sigmoid`` (0: beta as given, else ``beta_sigmoid * sigmoid(beta)``), ``v_first``
    (states ``(..., V, K)`` in and out)."""
    if beta_sigmoid:
        beta = beta.sigmoid() * beta_sigmoid
    if initial is not None and v_first:
        initial = initial.transpose(-1, -2)
    o, final = kernel(q, k, v, g, beta, scale, initial, l2norm, bounds)
    return o, final.transpose(-1, -2) if v_first else final


def fla_options(scale, l2norm, beta_sigmoid, allow_neg_eigval, state_v_first, cu_seqlens):
    """``fla_delta``'s keywords from the releases' arguments."""
    return {
        "scale": scale,
        "l2norm": l2norm,
        "beta_sigmoid": (2.0 if allow_neg_eigval else 1.0) if beta_sigmoid else 0,
        "v_first": state_v_first,
        "bounds": None if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()],
    }


class FlaDeltaFunction(torch.autograd.Function):
    """fla's chunked delta rules (``chunk_gated_delta_rule``, ``chunk_kda``): ``fla_delta`` of
    ``kernel`` over float64 copies of the inputs, made contiguous as the releases'
    ``input_guard`` makes them: ``(o in q's dtype, final state float32 or None)``; the
    backward by recomputation. Counts ``name`` and ``name + ".backward"``. ``options``:
    ``fla_options``."""

    @staticmethod
    def forward(ctx, name, kernel, q, k, v, g, beta, initial_state, output_final_state, options):
        CALLS[name] += 1
        tensors = tuple(
            t.contiguous() if t is not None else None  # input_guard
            for t in (q, k, v, g, beta, initial_state)
        )
        ctx.name, ctx.run = name, functools.partial(fla_delta, kernel, **options)
        o, final = ctx.run(*map(as64, tensors))
        ctx.save_for_backward(*tensors)
        return o.to(q.dtype), final.float() if output_final_state else None

    @staticmethod
    def backward(ctx, do, dht):
        CALLS[ctx.name + ".backward"] += 1
        needs = ctx.needs_input_grad[2:8]
        grads = recompute_grads(ctx.run, ctx.saved_tensors, needs, (do.contiguous(), dht))
        return (None, None, *grads, None, None)
