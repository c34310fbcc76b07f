"""mamba-ssm 2.3.2.post1's ``selective_scan_fn`` (mamba_ssm/ops/selective_scan_interface.py
at tag v2.3.2.post1): its parameters, ``SelectiveScanFn``'s handling of B and C (a 3-D
``(batch, dstate, seqlen)`` one is taken as one group and its gradient squeezed back) and the
checks of the CUDA extension it calls (csrc/selective_scan/selective_scan.cpp,
``selective_scan_fwd`` / ``_bwd``, raised as ``TORCH_CHECK`` raises them: RuntimeError),
over the float64 scan of ``tests.support.mixer_standin.kernels``.

dtypes: u, and with it delta, z and a variable (3-D or 4-D) B or C, in float32, float16 or
bfloat16; A float32; D, delta_bias and a fixed (2-D ``(dim, dstate)``) B or C float32. The
output has u's dtype (``empty_like(delta)``, or ``empty_like(z)`` with z); the last state,
``(batch, dim, dstate)``, is a float32 view into the extension's chunk states
(``x[:, :, -1, 1::2]``) and its gradient is ignored, as the release documents. Gradients have
their inputs' dtypes. Stride fixes the release makes itself (``.contiguous()`` of u, delta,
B, C, D, z, dout) are no contract. The release does not check that n_groups divides dim (its
kernel then reads past the last group): the stand-in refuses that (ValueError).

Not modelled: complex A (NotImplementedError), the device, ``selective_scan_ref`` and
``mamba_inner_fn``. Without the latter transformers' ``use_kernel_func_from_hub_with_fallback``
binds its own torch ``mamba_inner_fn``, which returns None, and the Mamba mixer goes on to
``selective_scan_fn``; ulysses_cp's adapters call only that one.
"""

import torch

from tests.support.mixer_standin import kernels

_INPUT = (torch.float32, torch.float16, torch.bfloat16)
_BDL = "batch_size, dim, seqlen"
_VARIABLE = {  # CHECK_SHAPE's text, B's and C's lines as the release spaces them
    "B": "batch_size, n_groups, dstate, !is_complex ? seqlen : seqlen * 2",
    "C": "batch_size, n_groups, dstate, !is_complex ? seqlen: seqlen * 2",
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _expected(ok: bool, expression: str) -> None:  # TORCH_CHECK without a message
    _check(ok, f"Expected {expression} to be true, but got false.")


def _shape(t, shape, name, spec) -> None:  # CHECK_SHAPE
    _check(tuple(t.shape) == tuple(shape), f"{name} must have shape ({spec})")


def _checks(u, delta, A, B, C, D, z, delta_bias):
    """``selective_scan_fwd``'s checks (shared by ``_bwd``) on B and C as the wrapper passes
    them, less the device's and the strides the wrapper fixes."""
    input_type, weight_type = u.dtype, A.dtype
    _expected(
        input_type in _INPUT,
        "input_type == at::ScalarType::Float || input_type == at::ScalarType::Half || "
        "input_type == at::ScalarType::BFloat16",
    )
    _expected(
        weight_type in (torch.float32, torch.complex64),
        "weight_type == at::ScalarType::Float || weight_type == at::ScalarType::ComplexFloat",
    )
    if weight_type == torch.complex64:
        raise NotImplementedError("stand-in: complex A is not modelled")
    variable = {"B": B.dim() >= 3, "C": C.dim() >= 3}
    _expected(delta.dtype == input_type, "delta.scalar_type() == input_type")
    for name, t in (("B", B), ("C", C)):
        _expected(
            t.dtype == (input_type if variable[name] else weight_type),
            f"{name}.scalar_type() == (!is_variable_{name} ? weight_type : input_type)",
        )
    batch, dim, seqlen = u.shape[0], u.shape[1], u.shape[2]
    dstate = A.size(1)
    n_groups = B.size(1) if variable["B"] else 1
    _check(dstate <= 256, "selective_scan only supports state dimension <= 256")
    _shape(u, (batch, dim, seqlen), "u", _BDL)
    _shape(delta, (batch, dim, seqlen), "delta", _BDL)
    _shape(A, (dim, dstate), "A", "dim, dstate")
    for name, t in (("B", B), ("C", C)):
        if variable[name]:
            _shape(t, (batch, n_groups, dstate, seqlen), name, _VARIABLE[name])
        else:
            _shape(t, (dim, dstate), name, "dim, dstate")
    if D is not None:
        _expected(D.dtype == torch.float32, "D.scalar_type() == at::ScalarType::Float")
        _shape(D, (dim,), "D", "dim")
    if delta_bias is not None:
        _expected(
            delta_bias.dtype == torch.float32, "delta_bias.scalar_type() == at::ScalarType::Float"
        )
        _expected(
            delta_bias.stride(-1) == 1 or delta_bias.size(-1) == 1,
            "delta_bias.stride(-1) == 1 || delta_bias.size(-1) == 1",
        )
        _shape(delta_bias, (dim,), "delta_bias", "dim")
    if z is not None:
        _expected(z.dtype == input_type, "z.scalar_type() == input_type")
        _shape(z, (batch, dim, seqlen), "z", _BDL)
    if n_groups < 1 or dim % n_groups:
        raise ValueError(
            f"stand-in: {n_groups} groups of B and C do not divide dim {dim}; the release does "
            f"not check this, and its kernel reads group dim_id / (dim / n_groups)"
        )


class SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        u,
        delta,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
    ):
        kernels.CALLS["selective_scan_fn"] += 1
        ctx.squeeze = (B.dim() == 3, C.dim() == 3)
        B, C = (t[:, None] if t.dim() == 3 else t for t in (B, C))  # b dstate l -> b 1 dstate l
        tensors = (u, delta, A, B, C, D, z, delta_bias)
        _checks(*tensors)
        ctx.softplus = delta_softplus
        y, last = kernels.selective_scan(*map(kernels.as64, tensors), softplus=delta_softplus)
        ctx.save_for_backward(*tensors)
        out = torch.empty_like(delta if z is None else z).copy_(y)
        if not return_last_state:
            return out
        batch, dim, seqlen = u.shape
        chunks = u.new_empty(batch, dim, -(-seqlen // 2048), 2 * A.shape[1], dtype=A.dtype)
        chunks[:, :, -1, 1::2] = last
        return out, chunks[:, :, -1, 1::2]

    @staticmethod
    def backward(ctx, dout, *args):  # args: the last state's gradient, ignored
        kernels.CALLS["selective_scan_fn.backward"] += 1
        tensors = ctx.saved_tensors
        _checks(*tensors)
        u = tensors[0]
        _expected(dout.dtype == u.dtype, "dout.scalar_type() == input_type")
        _shape(dout, u.shape, "dout", _BDL)

        def run(*tensors):
            return kernels.selective_scan(*tensors, softplus=ctx.softplus)

        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = kernels.recompute_grads(
            run, tensors, ctx.needs_input_grad[:8], (dout, None)
        )
        dB, dC = (
            g.squeeze(1) if g is not None and squeeze else g
            for g, squeeze in zip((dB, dC), ctx.squeeze)
        )
        return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, None, None


def selective_scan_fn(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
):
    """u and delta ``(batch, dim, seqlen)``, A ``(dim, dstate)``, B and C ``(dim, dstate)``,
    ``(batch, dstate, seqlen)`` or ``(batch, n_groups, dstate, seqlen)``, D and delta_bias
    ``(dim,)``, z like u: out like u, or ``(out, last_state)`` with ``return_last_state``."""
    return SelectiveScanFn.apply(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state
    )
