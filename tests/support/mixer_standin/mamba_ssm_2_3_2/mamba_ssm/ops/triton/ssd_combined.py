"""mamba-ssm 2.3.2.post1's ``mamba_chunk_scan_combined`` (mamba_ssm/ops/triton/ssd_combined.py
at tag v2.3.2.post1; the same parameters and checks since 2.2.4): its parameters, the asserts
of ``_mamba_chunk_scan_combined_fwd`` / ``_bwd`` and ``_chunk_cumsum_fwd``
(ssd_chunk_state.py), and its return convention (``out``, ``(out, final_states)`` with
``return_final_states``), over the float64 recurrence of ``tests.support.mixer_standin.kernels``.

The Triton kernels take ``dt_limit[0]`` and ``dt_limit[1]`` as scalar arguments: numbers,
not tensors (a tensor would reach the kernel as a pointer). The output has x's dtype.
Stride fixes the release makes itself (``.contiguous()`` of B, C, D, x, z, dout) are no
contract. Not modelled: ``return_varlen_states`` (NotImplementedError), the device.
"""

import torch

from tests.support.mixer_standin import kernels


def _limit(dt_limit):
    lo, hi = dt_limit[0], dt_limit[1]
    for v in (lo, hi):
        if not isinstance(v, (int, float)):
            raise TypeError(
                f"dt_limit holds a {type(v).__name__}: _chunk_cumsum_fwd passes dt_limit[0] and "
                f"dt_limit[1] to a Triton kernel as scalars, which must be numbers"
            )
    return float(lo), float(hi)


def _checks(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
    batch, seqlen, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0
    assert B.shape == (batch, seqlen, ngroups, dstate)
    assert x.shape == (batch, seqlen, nheads, headdim)
    assert dt.shape == (batch, seqlen, nheads)
    assert A.shape == (nheads,)
    assert C.shape == B.shape
    if z is not None:
        assert z.shape == x.shape
    if D is not None:
        assert D.shape == (nheads, headdim) or D.shape == (nheads,)
    if seq_idx is not None:
        assert seq_idx.shape == (batch, seqlen)
    if initial_states is not None:
        assert initial_states.shape == (batch, nheads, headdim, dstate)
    if dt_bias is not None:  # _chunk_cumsum_fwd
        assert dt_bias.shape == (nheads,)


class MambaChunkScanCombinedFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        return_varlen_states=False,
    ):
        if return_varlen_states:
            assert cu_seqlens is not None, (
                "cu_seqlens must be provided if return_varlen_states is True"
            )
            raise NotImplementedError("stand-in: return_varlen_states is not modelled")
        _checks(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
        ctx.options = {"softplus": dt_softplus, "limit": _limit(dt_limit), "seq_idx": seq_idx}
        tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
        y, final = kernels.ssd(*map(kernels.as64, tensors), **ctx.options)
        ctx.save_for_backward(*tensors)
        ctx.return_final_states = return_final_states
        out = y.to(x.dtype)
        return out if not return_final_states else (out, final.float())

    @staticmethod
    def backward(ctx, dout, *args):
        kernels.CALLS["mamba_chunk_scan_combined.backward"] += 1
        tensors = ctx.saved_tensors
        x, dt, A, B, C = tensors[:5]
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        batch, seqlen, nheads, headdim = x.shape
        assert dout.shape == (batch, seqlen, nheads, headdim)
        assert dt.shape == (batch, seqlen, nheads)
        assert A.shape == (nheads,)
        assert C.shape == B.shape

        def run(*tensors):
            return kernels.ssd(*tensors, **ctx.options)

        dfinal = args[0] if ctx.return_final_states else None
        needs = (*ctx.needs_input_grad[:5], *ctx.needs_input_grad[6:10])
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = kernels.recompute_grads(
            run, tensors, needs, (dout, dfinal)
        )
        return dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit, *[None] * 6


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """x ``(batch, seqlen, nheads, headdim)``, dt ``(batch, seqlen, nheads)``, A ``(nheads,)``,
    B and C ``(batch, seqlen, ngroups, dstate)``, D ``(nheads, headdim)`` or ``(nheads,)``,
    z like x, dt_bias ``(nheads,)``: out like x."""
    kernels.CALLS["mamba_chunk_scan_combined"] += 1
    return MambaChunkScanCombinedFn.apply(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
        cu_seqlens,
        dt_softplus,
        dt_limit,
        return_final_states,
        return_varlen_states,
    )
