"""Stand-in for FlashAttention-3 3.0.0's ``hopper/flash_attn_interface.py`` (internal
functions only; as at commit e2743ab5, "Mark current main version as v3.0.0 stable"): both
are ``torch.library.custom_op`` (so their Python signature reads ``(*args, **kwargs)``;
registered here for CPU under a fresh namespace); ``window_size_left/right`` ints; the
forward returns ``(out, softmax_lse, out_accum, softmax_lse_accum)``; the backward takes
``is_causal``, mutates dq/dk/dv and returns ``softmax_d`` only."""

# The release's own type hints (Optional, Tuple) are copied as they are:
# ruff: noqa: UP006, UP035, UP045

from typing import Optional, Tuple

import torch

from tests.support.flash_standin import fa34, kernels

_NS = kernels.next_namespace()


@torch.library.custom_op(f"{_NS}::_flash_attn_forward", mutates_args=(), device_types="cpu")
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    out_: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None,
    kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    seqlens_rotary: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[torch.Tensor] = None,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    unused = (k_new, v_new, qv, out_, cu_seqlens_k_new, seqused_q, seqused_k, page_table)
    unused += (kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale)
    unused += (k_descale, v_descale, scheduler_metadata, pack_gqa)
    fa34.check(all(t is None for t in unused), "stand-in: only q, k, v and cu_seqlens")
    fa34.check(attention_chunk == 0 and num_splits == 1, "stand-in: no chunks or splits")
    cu = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    fa34.check_inputs(q, k, v, cu or (), fa4=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale

    def window(sq, sk):
        return fa34.fa3_window(causal, window_size_left, window_size_right, sq, sk)

    out, lse = fa34.forward(q, k, v, scale, softcap, window, cu, (max_seqlen_q, max_seqlen_k))
    return out, lse, q.new_empty(0), q.new_empty(0)


@torch.library.custom_op(
    f"{_NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    sequed_q: Optional[torch.Tensor] = None,
    sequed_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    fa34.check(sequed_q is None and sequed_k is None, "stand-in: no seqused")
    cu = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    fa34.check_inputs(q, k, v, cu or (), fa4=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale

    def window(sq, sk):
        return fa34.fa3_window(is_causal, window_size_left, window_size_right, sq, sk)

    grads = (dq, dk, dv)
    fa34.backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        grads,
        scale,
        softcap,
        window,
        cu,
        (max_seqlen_q, max_seqlen_k),
    )
    return q.new_zeros(softmax_lse.shape, dtype=torch.float32)
