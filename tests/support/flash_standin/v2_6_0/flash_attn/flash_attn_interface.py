"""Stand-in for flash-attn 2.6.0's ``flash_attn/flash_attn_interface.py`` (internal functions
only): plain functions, ``window_size`` a tuple, forward returns 8 values incl. the
head-dim-padded q/k/v/out (the C++ pads a head dim that is not a multiple of 8 itself)."""

import torch.nn.functional as F

from tests.support.flash_standin import kernels as _k


def _pad8(x):
    return F.pad(x, [0, 8 - x.shape[-1] % 8]) if x.shape[-1] % 8 else x


def _cut(x, d):
    """The C++ returns ``x[..., :d]`` when it padded, else ``x`` itself."""
    return x[..., :d] if d % 8 else x


class flash_attn_cuda:  # stands in for `import flash_attn_2_cuda as flash_attn_cuda`
    """flash_api.cpp of 2.6.0: the positional arguments the Python passes, what C++ returns."""

    @staticmethod
    def fwd(
        q,
        k,
        v,
        out_,
        alibi_slopes_,
        p_dropout,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        softcap,
        return_softmax,
        gen_,
    ):
        _k.check_inputs(q, k, v, fwd=True, pads=True)
        _k.check_unsupported(p_dropout, alibi_slopes_, return_softmax, out_=out_)
        _k._check(q.shape[0] > 0, "batch size must be postive")  # sic, 2.6.0's message
        q_p, k_p, v_p = _pad8(q), _pad8(k), _pad8(v)
        out_padded, lse = _k.mha_fwd(
            q_p, k_p, v_p, softmax_scale, is_causal, window_size_left, window_size_right, softcap
        )
        out = _cut(out_padded, q.shape[-1])
        return out, q_p, k_p, v_p, out_padded, lse, q.new_empty((0,)), _k.rng_state(q)

    @staticmethod
    def varlen_fwd(
        q,
        k,
        v,
        out_,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        block_table_,
        alibi_slopes_,
        max_seqlen_q,
        max_seqlen_k,
        p_dropout,
        softmax_scale,
        zero_tensors,
        is_causal,
        window_size_left,
        window_size_right,
        softcap,
        return_softmax,
        gen_,
    ):
        _k.check_inputs(q, k, v, fwd=True, pads=True, cu=(cu_seqlens_q, cu_seqlens_k))
        _k.check_unsupported(
            p_dropout,
            alibi_slopes_,
            return_softmax,
            out_=out_,
            seqused_k=seqused_k,
            block_table=block_table_,
        )
        q_p, k_p, v_p = _pad8(q), _pad8(k), _pad8(v)
        out_padded, lse = _k.mha_varlen_fwd(
            q_p,
            k_p,
            v_p,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            zero_tensors,
            is_causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        out = _cut(out_padded, q.shape[-1])
        return out, q_p, k_p, v_p, out_padded, lse, q.new_empty((0,)), _k.rng_state(q)

    @staticmethod
    def bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq_,
        dk_,
        dv_,
        alibi_slopes_,
        p_dropout,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        softcap,
        deterministic,
        gen_,
        rng_state,
    ):
        _k.check_inputs(q, k, v, fwd=False, pads=True, out=out, dout=dout)
        _k.check_unsupported(p_dropout, alibi_slopes_)
        dq, dk, dv, softmax_d = _k.mha_bwd(
            _pad8(dout),
            q,
            k,
            v,
            out,
            softmax_lse,
            dq_,
            dk_,
            dv_,
            softmax_scale,
            is_causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        d = dout.shape[-1]
        return _cut(dq, d), _cut(dk, d), _cut(dv, d), softmax_d

    @staticmethod
    def varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq_,
        dk_,
        dv_,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes_,
        max_seqlen_q,
        max_seqlen_k,
        p_dropout,
        softmax_scale,
        zero_tensors,
        is_causal,
        window_size_left,
        window_size_right,
        softcap,
        deterministic,
        gen_,
        rng_state,
    ):
        cu = (cu_seqlens_q, cu_seqlens_k)
        _k.check_inputs(q, k, v, fwd=False, pads=True, out=out, dout=dout, cu=cu)
        _k.check_unsupported(p_dropout, alibi_slopes_)
        dq, dk, dv, softmax_d = _k.mha_varlen_bwd(
            _pad8(dout),
            q,
            k,
            v,
            out,
            softmax_lse,
            dq_,
            dk_,
            dv_,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            zero_tensors,
            is_causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        d = dout.shape[-1]
        return _cut(dq, d), _cut(dk, d), _cut(dv, d), softmax_d


# ------------------------------------------ the four internal functions, signatures as in 2.6.0


def _maybe_contiguous(x):
    return x.contiguous() if x.stride(-1) != 1 else x


def _flash_attn_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state = flash_attn_cuda.fwd(
        q,
        k,
        v,
        None,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        return_softmax,
        None,
    )
    return out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_softmax,
    block_table,
):
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state = flash_attn_cuda.varlen_fwd(
        q,
        k,
        v,
        None,
        cu_seqlens_q,
        cu_seqlens_k,
        None,
        block_table,
        alibi_slopes,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        False,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        return_softmax,
        None,
    )
    return out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    # dq, dk, dv are allocated by us so they should already be contiguous
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn_cuda.bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        deterministic,
        None,
        rng_state,
    )
    return dq, dk, dv, softmax_d


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    # dq, dk, dv are allocated by us so they should already be contiguous
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn_cuda.varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        False,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        deterministic,
        None,
        rng_state,
    )
    return dq, dk, dv, softmax_d
