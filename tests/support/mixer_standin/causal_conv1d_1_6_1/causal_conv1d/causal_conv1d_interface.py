"""causal-conv1d 1.6.1's ``causal_conv1d_fn`` (causal_conv1d/causal_conv1d_interface.py at
tag v1.6.1.post4; the same in 1.5.x): its parameters, its Python-side checks and layout
fixes, and the checks of the CUDA extension it calls (csrc/causal_conv1d.cpp,
``causal_conv1d_fwd`` / ``causal_conv1d_bwd``, raised as ``TORCH_CHECK`` raises them:
RuntimeError), over the float64 convolution of ``tests.support.mixer_standin.kernels``.

The extension's layouts: x ``(batch, dim, seqlen)`` with ``stride(2) == 1`` (channel-first)
or ``stride(1) == 1`` (channel-last, when also ``stride(2) > 1``); channel-last needs dim
and x's strides 0 and 2 (and dout's, in the backward) to be multiples of 8. The output is
``torch.empty_like(x)`` (x's layout). Not modelled: the device checks (CPU here),
``initial_states`` / ``return_final_states`` / ``final_states_out`` (NotImplementedError),
``causal_conv1d_update``, the ``torch.library`` custom ops under the autograd function.
"""

import torch

from tests.support.mixer_standin import kernels

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STRIDES = (
    "causal_conv1d with channel last layout requires strides ({0}.stride(0) and {0}.stride(2)) "
    "to be multiples of 8"
)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _expected(ok: bool, expression: str) -> None:  # TORCH_CHECK without a message
    _check(ok, f"Expected {expression} to be true, but got false.")


def _layout(x, weight, bias, seq_idx, where):
    """The checks ``causal_conv1d_fwd`` and ``causal_conv1d_bwd`` share; True if channel-last."""
    _expected(
        x.dtype in _DTYPES,
        "input_type == at::ScalarType::Float || input_type == "
        "at::ScalarType::Half || input_type == at::ScalarType::BFloat16",
    )
    _expected(
        weight.dtype in _DTYPES,
        "weight_type == at::ScalarType::Float || weight_type =="
        " at::ScalarType::Half || weight_type == at::ScalarType::BFloat16",
    )
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    _check(tuple(weight.shape) == (dim, width), "weight must have shape (dim, width)")
    _expected(x.stride(2) == 1 or x.stride(1) == 1, "x.stride(2) == 1 || x.stride(1) == 1")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        _check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        _check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, _STRIDES.format("x"))
    _check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        _expected(bias.dtype == weight.dtype, "bias.scalar_type() == weight_type")
        _expected(bias.stride(-1) == 1, "bias.stride(-1) == 1")
        _check(tuple(bias.shape) == (dim,), "bias must have shape (dim)")
    if seq_idx is not None:
        _check(channel_last, f"seq_idx {where}supported for channel last layout")
        _expected(seq_idx.dtype == torch.int32, "seq_idx.scalar_type() == torch::kInt32")
        _expected(seq_idx.is_contiguous(), "seq_idx.is_contiguous()")
        _check(
            tuple(seq_idx.shape) == (batch, seqlen), "seq_idx must have shape (batch_size, seqlen)"
        )
    return channel_last


class CausalConv1dFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        if activation not in [None, "silu", "swish"]:
            raise NotImplementedError("activation must be None, silu, or swish")
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        if seq_idx is not None:
            assert initial_states is None, "initial_states must be None if seq_idx is not None"
            assert not return_final_states, (
                "If seq_idx is not None, we don't return final_states_out"
            )
        seq_idx = seq_idx.contiguous() if seq_idx is not None else None
        if initial_states is not None or return_final_states or final_states_out is not None:
            raise NotImplementedError("stand-in: initial and final states are not modelled")
        ctx.silu = activation in ["silu", "swish"]
        layout = (
            "channel_last" if _layout(x, weight, bias, seq_idx, "is only ") else "channel_first"
        )
        kernels.CALLS[f"causal_conv1d_fn:{layout}"] += 1
        args = [kernels.as64(t) for t in (x, weight, bias)]
        out = torch.empty_like(x).copy_(kernels.conv(*args, ctx.silu, seq_idx))
        ctx.save_for_backward(x, weight, bias, seq_idx)
        return out

    @staticmethod
    def backward(ctx, dout, *args):
        x, weight, bias, seq_idx = ctx.saved_tensors
        kernels.CALLS["causal_conv1d_fn.backward"] += 1
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        _check(
            tuple(dout.shape) == tuple(x.shape), "dout must have shape (batch_size, dim, seqlen)"
        )
        channel_last = _layout(x, weight, bias, seq_idx, "only ")
        if not channel_last and dout.stride(2) != 1:
            dout = dout.contiguous()
        if channel_last and dout.stride(1) != 1:
            dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)
        if channel_last:
            _check(dout.stride(2) % 8 == 0 and dout.stride(0) % 8 == 0, _STRIDES.format("dout"))

        def run(x, weight, bias):
            return kernels.conv(x, weight, bias, ctx.silu, seq_idx)

        needs = ctx.needs_input_grad[:3]
        dx, dweight, dbias = kernels.recompute_grads(run, (x, weight, bias), needs, (dout,))
        dx = torch.empty_like(x).copy_(dx)  # dx takes x's layout, as the extension's does
        return dx, dweight, dbias, None, None, None, None, None


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """Depthwise causal conv of x ``(batch, dim, seqlen)`` with weight ``(dim, width)``."""
    kernels.CALLS["causal_conv1d_fn"] += 1
    return CausalConv1dFn.apply(
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        return_final_states,
        final_states_out,
        activation,
    )
