"""flash-linear-attention 0.5.2's ``chunk_gated_delta_rule`` (fla/ops/gated_delta_rule/chunk.py
at tag v0.5.2): its parameters (``**kwargs`` included: ``chunk_size``, ``use_gate_in_kernel``,
``A_log``, ``dt_bias``, the deprecated ``transpose_state_layout`` and ``head_first``), its
checks and messages, and its return ``(o in q's dtype, final_state float32 or None)``, over
the float64 recurrence of ``tests.support.mixer_standin.kernels``.

Layout: ``[B, T, H, K]`` (``head_first`` is gone: passing it raises); value heads may be a
multiple of the key heads (grouped value attention, new in 0.5.0; earlier releases need
equal heads). The release makes every tensor argument contiguous itself (``input_guard``),
so strides are no contract. Checks the release leaves to its Triton kernels (which index
with the shapes of the docstring) are asserted here, marked "stand-in". Not modelled:
``cp_context`` and ``use_gate_in_kernel`` (NotImplementedError), the ``dispatch`` and
``torch.compiler.disable`` wrappers (``inspect.signature`` sees through both to these
parameters), the device.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.mixer_standin import kernels


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: FLACPContext | None = None,  # noqa: F821 - the release's hint
    **kwargs,
):
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (log decay) and beta ``[B, T, HV]``:
    ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(
                "Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`."
            )
        warnings.warn(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
            DeprecationWarning,
            stacklevel=2,
        )
        state_v_first = kwargs.pop("transpose_state_layout")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same number of heads, "
            f"but got q.shape[2]={q.shape[2]} and k.shape[2]={k.shape[2]}"
        )
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        raise ValueError(
            f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by "
            f"num_heads (H={H}), but got HV % H = {HV % H}"
        )
    if "head_first" in kwargs:
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in `[B, T, H, ...]` format.",
        )
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(
            f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}."
        )
    if cp_context is not None:
        raise NotImplementedError("stand-in: cp_context is not modelled")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using "
                f"`cu_seqlens`.Please flatten variable-length inputs before processing.",
            )
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input "
                f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.",
            )
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    if use_gate_in_kernel:
        assert kwargs.get("A_log") is not None, (
            "A_log must be provided when use_gate_in_kernel=True."
        )
        raise NotImplementedError("stand-in: use_gate_in_kernel is not modelled")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    B, T, _, K = k.shape  # the kernels' indexing (chunk_delta_h.py, chunk_fwd.py)
    assert q.shape == k.shape, f"stand-in: q {tuple(q.shape)} and k {tuple(k.shape)} differ"
    assert v.shape[:2] == (B, T), f"stand-in: v {tuple(v.shape)} is not [B, T, HV, V]"
    for name, t in (("g", g), ("beta", beta)):
        assert t.shape == (B, T, HV), f"stand-in: {name} {tuple(t.shape)} is not [B, T, HV]"
    assert K <= 256, "current kernel does not support head dimension larger than 256."
    flags = (use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    options = kernels.fla_options(scale, *flags, state_v_first, cu_seqlens)
    args = (q, k, v, g, beta, initial_state, output_final_state, options)
    return kernels.FlaDeltaFunction.apply("chunk_gated_delta_rule", kernels.gated_delta, *args)


chunk_gdn = chunk_gated_delta_rule
