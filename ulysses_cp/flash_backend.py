"""flash-attn 2 adapter (CUDA only, imported lazily on first use).

flash-attn's internal ``_flash_attn_forward/_backward`` return/take the log-sum-exp that
ring attention needs, but their signatures changed in 2.7 (``window_size`` became
``window_size_left/right``); we pass keywords by name after reading the signature, so 2.6
through 2.8 work. Layout ``(b, s, h, d)``, GQA native, lse ``(b, h, s)`` fp32.
The kernels need a head dim that is a multiple of 8: we pad with zeros (which changes no
score) and slice the result.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


@functools.cache
def _interface():
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ValueError("backend 'flash_attn' needs flash-attn: `pip install .[gpu]`") from exc
    fwd, bwd = fai._flash_attn_forward, fai._flash_attn_backward
    return fwd, set(inspect.signature(fwd).parameters), bwd, set(inspect.signature(bwd).parameters)


@functools.cache
def _varlen_interface():
    _interface()  # the same import error message
    from flash_attn import flash_attn_interface as fai

    fwd, bwd = fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward
    return fwd, set(inspect.signature(fwd).parameters), bwd, set(inspect.signature(bwd).parameters)


def _window_kwargs(params: set[str]) -> dict:
    if "window_size_left" in params:
        return {"window_size_left": -1, "window_size_right": -1}
    return {"window_size": (-1, -1)}


def _pad8(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x


def _kwargs(params: set[str], scale: float, causal: bool, **extra) -> dict:
    """The keyword arguments this flash-attn version's internal function takes."""
    kwargs = dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        **_window_kwargs(params),
        **extra,
    )
    return {name: value for name, value in kwargs.items() if name in params}


def forward(q, k, v, causal, scale):
    fwd, params, _, _ = _interface()
    d = q.shape[-1]
    kwargs = _kwargs(params, scale, causal, return_softmax=False)
    res = fwd(_pad8(q).contiguous(), _pad8(k).contiguous(), _pad8(v).contiguous(), **kwargs)
    out, lse = res[0], res[1]
    return out[..., :d], lse


def backward(dout, q, k, v, out, lse, causal, scale):
    _, _, bwd, params = _interface()
    d = q.shape[-1]
    qp, kp, vp = _pad8(q).contiguous(), _pad8(k).contiguous(), _pad8(v).contiguous()
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    kwargs = _kwargs(params, scale, causal, deterministic=False, rng_state=None)
    bwd(
        _pad8(dout).contiguous(),
        qp,
        kp,
        vp,
        _pad8(out.to(q.dtype)).contiguous(),
        lse.float().contiguous(),
        dq,
        dk,
        dv,
        **kwargs,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


# ---------------------------------------------------------------- packed rows (varlen)
# q (1, tq, hq, d) -> flash-attn's (tq, hq, d); lse (hq, tq) in flash-attn >= 2.6 -> (1, hq, tq)


def _cu_args(cu_q, cu_k) -> dict:
    cu_q, cu_k = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    return dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()),
        max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
    )


def varlen_forward(q, k, v, cu_q, cu_k, causal, scale):
    fwd, params, _, _ = _varlen_interface()
    d = q.shape[-1]
    kwargs = _kwargs(params, scale, causal, return_softmax=False, **_cu_args(cu_q, cu_k))
    q2, k2, v2 = (_pad8(t[0]).contiguous() for t in (q, k, v))
    res = fwd(q2, k2, v2, **kwargs)
    return res[0][None, ..., :d], res[1][None]


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    _, _, bwd, params = _varlen_interface()
    d = q.shape[-1]
    qp, kp, vp = (_pad8(t[0]).contiguous() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    kwargs = _kwargs(
        params, scale, causal, deterministic=False, rng_state=None, **_cu_args(cu_q, cu_k)
    )
    bwd(
        _pad8(dout[0]).contiguous(),
        qp,
        kp,
        vp,
        _pad8(out[0].to(q.dtype)).contiguous(),
        lse[0].float().contiguous(),
        dq,
        dk,
        dv,
        **kwargs,
    )
    return dq[None, ..., :d], dk[None, ..., :d], dv[None, ..., :d]
