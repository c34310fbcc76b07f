"""Stand-in for flash-attn 2.7.4's ``flash_attn/flash_attn_interface.py`` (internal functions
only): ``window_size_left/right`` ints, forward returns ``(out, softmax_lse, S_dmask,
rng_state)``, backward returns ``softmax_d`` and writes dq/dk/dv; wrapped as
``torch.library.custom_op`` with ``register_fake`` (mode "custom_op") or left plain (mode
"plain": what the release does on torch >= 2.10, whose version string compares below "2.4.0").
"""

# The release's own type hints (Optional, Tuple) are copied as they are:
# ruff: noqa: UP006, UP035, UP045

from typing import Optional, Tuple

import torch

from tests.support.flash_standin import kernels as _k


class flash_attn_gpu:  # stands in for `import flash_attn_2_cuda as flash_attn_gpu`
    """flash_api.cpp of 2.7.4: the positional arguments the Python passes, what C++ returns."""

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
        _k.check_inputs(q, k, v, fwd=True, pads=False)
        _k.check_unsupported(p_dropout, alibi_slopes_, return_softmax, out_=out_)
        _k._check(q.shape[0] > 0, "batch size must be positive")
        out, lse = _k.mha_fwd(
            q, k, v, softmax_scale, is_causal, window_size_left, window_size_right, softcap
        )
        return out, lse, q.new_empty((0,)), _k.rng_state(q)

    @staticmethod
    def varlen_fwd(
        q,
        k,
        v,
        out_,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        leftpad_k_,
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
        _k.check_inputs(q, k, v, fwd=True, pads=False, cu=(cu_seqlens_q, cu_seqlens_k))
        _k.check_unsupported(
            p_dropout,
            alibi_slopes_,
            return_softmax,
            out_=out_,
            seqused_k=seqused_k,
            leftpad_k=leftpad_k_,
            block_table=block_table_,
        )
        out, lse = _k.mha_varlen_fwd(
            q,
            k,
            v,
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
        return out, lse, q.new_empty((0,)), _k.rng_state(q)

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
        _k.check_inputs(q, k, v, fwd=False, pads=False, out=out, dout=dout)
        _k.check_unsupported(p_dropout, alibi_slopes_)
        return _k.mha_bwd(
            dout,
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
        _k.check_inputs(q, k, v, fwd=False, pads=False, out=out, dout=dout, cu=cu)
        _k.check_unsupported(p_dropout, alibi_slopes_)
        return _k.mha_varlen_bwd(
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
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            zero_tensors,
            is_causal,
            window_size_left,
            window_size_right,
            softcap,
        )


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


# The release: `if torch.__version__ >= "2.4.0": custom_op / register_fake, else no-ops`.
# Ours: the mode set by `tests.support.flash_standin.use(..., wrap=...)`; a fresh op namespace per
# import (so the stand-ins can be imported repeatedly, and two releases in one process); and
# device_types="cpu" instead of "cuda", since the stand-ins run on CPU tensors.
_WRAP = _k.WRAP
_NS = _k.next_namespace() if _WRAP == "custom_op" else "flash_attn"


def _torch_custom_op_wrapper(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
    if _WRAP == "custom_op":
        return torch.library.custom_op(
            name, fn, mutates_args=mutates_args, device_types=device_types, schema=schema
        )
    return (lambda func: func) if fn is None else fn


def _torch_register_fake_wrapper(op, fn=None, /, *, lib=None):
    if _WRAP == "custom_op":
        return torch.library.register_fake(op, fn, lib=lib)
    return (lambda func: func) if fn is None else fn


def _wrapped(name, fn):
    return getattr(getattr(torch.ops, _NS), name) if _WRAP == "custom_op" else fn


# --------------------------------------- the four internal functions, signatures as in 2.7.4


@_torch_custom_op_wrapper(f"{_NS}::_flash_attn_forward", mutates_args=(), device_types="cpu")
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.fwd(
        q,
        k,
        v,
        None,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        return_softmax,
        None,
    )
    return out, softmax_lse, S_dmask, rng_state


@_torch_register_fake_wrapper(f"{_NS}::_flash_attn_forward")
def _flash_attn_forward_fake(*args, **kwargs):
    return _k.fake_fwd(_k.bind(_flash_attn_forward, args, kwargs))


_wrapped_flash_attn_forward = _wrapped("_flash_attn_forward", _flash_attn_forward)


@_torch_custom_op_wrapper(f"{_NS}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.varlen_fwd(
        q,
        k,
        v,
        None,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        leftpad_k,
        block_table,
        alibi_slopes,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        zero_tensors,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        return_softmax,
        None,
    )
    return out, softmax_lse, S_dmask, rng_state


@_torch_register_fake_wrapper(f"{_NS}::_flash_attn_varlen_forward")
def _flash_attn_varlen_forward_fake(*args, **kwargs):
    return _k.fake_varlen_fwd(_k.bind(_flash_attn_varlen_forward, args, kwargs))


_wrapped_flash_attn_varlen_forward = _wrapped(
    "_flash_attn_varlen_forward", _flash_attn_varlen_forward
)


@_torch_custom_op_wrapper(
    f"{_NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    # dq, dk, dv are allocated by us so they should already be contiguous
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn_gpu.bwd(
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
        window_size_left,
        window_size_right,
        softcap,
        deterministic,
        None,
        rng_state,
    )
    return softmax_d


@_torch_register_fake_wrapper(f"{_NS}::_flash_attn_backward")
def _flash_attn_backward_fake(*args, **kwargs):
    return _k.fake_bwd(_k.bind(_flash_attn_backward, args, kwargs))


_wrapped_flash_attn_backward = _wrapped("_flash_attn_backward", _flash_attn_backward)


@_torch_custom_op_wrapper(
    f"{_NS}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    # dq, dk, dv are allocated by us so they should already be contiguous
    dout, q, k, v, out = [maybe_contiguous(x) for x in (dout, q, k, v, out)]
    dq, dk, dv, softmax_d = flash_attn_gpu.varlen_bwd(
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
        zero_tensors,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        deterministic,
        None,
        rng_state,
    )
    return softmax_d


@_torch_register_fake_wrapper(f"{_NS}::_flash_attn_varlen_backward")
def _flash_attn_varlen_backward_fake(*args, **kwargs):
    return _k.fake_varlen_bwd(_k.bind(_flash_attn_varlen_backward, args, kwargs))


_wrapped_flash_attn_varlen_backward = _wrapped(
    "_flash_attn_varlen_backward", _flash_attn_varlen_backward
)
