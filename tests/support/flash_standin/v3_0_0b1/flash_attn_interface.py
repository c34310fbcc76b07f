"""Stand-in for FlashAttention-3 3.0.0b1's ``hopper/flash_attn_interface.py`` (internal
functions only; as at commit 24f0957b of Dao-AILab/flash-attention): plain functions whose
parameters have no defaults up to ``window_size=(-1, -1)``; the forward returns ``(out,
softmax_lse, out_accum, softmax_lse_accum)``; the backward takes ``causal``, writes the given
dq/dk/dv and returns ``(dq, dk, dv, softmax_d)``."""

import torch

from tests.support.flash_standin import fa34


def _flash_attn_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    unused = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table)
    unused += (kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale)
    unused += (k_descale, v_descale, scheduler_metadata, pack_gqa)
    fa34.check(all(t is None for t in unused), "stand-in: only q, k, v and cu_seqlens")
    fa34.check(attention_chunk == 0 and num_splits == 1, "stand-in: no chunks or splits")
    cu = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    fa34.check_inputs(q, k, v, cu or (), fa4=False)

    def window(sq, sk):
        return fa34.fa3_window(causal, *window_size, sq, sk)

    o, lse = fa34.forward(q, k, v, softmax_scale, softcap, window, cu, (max_seqlen_q, max_seqlen_k))
    return o, lse, torch.empty(0), torch.empty(0)


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    sequed_q,
    sequed_k,
    max_seqlen_q,
    max_seqlen_k,
    dq,
    dk,
    dv,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):
    fa34.check(sequed_q is None and sequed_k is None, "stand-in: no seqused")
    cu = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    fa34.check_inputs(q, k, v, cu or (), fa4=False)

    def window(sq, sk):
        return fa34.fa3_window(causal, *window_size, sq, sk)

    grads = fa34.backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        (dq, dk, dv),
        softmax_scale,
        softcap,
        window,
        cu,
        (max_seqlen_q, max_seqlen_k),
    )
    return (*grads, torch.empty(0))
