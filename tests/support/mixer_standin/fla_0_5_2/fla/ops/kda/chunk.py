"""flash-linear-attention 0.5.2's ``chunk_kda`` (Kimi Delta Attention, fla/ops/kda/chunk.py at
tag v0.5.2): its parameters (``**kwargs`` included: ``chunk_size``, ``A_log``, ``dt_bias``,
the deprecated ``transpose_state_layout``), its checks and messages, and its return
``(o in q's dtype, final_state float32 or None)``, over the float64 recurrence of
``tests.support.mixer_standin.kernels`` (``kda``: a decay per key channel, applied before the delta
update).

Layout: ``[B, T, H, K]``; g ``[B, T, HV, K]`` (log decay, any float dtype: the release takes
its chunk cumsum in float32), beta ``[B, T, HV]``; value heads may be a multiple of the key
heads. ``initial_state`` must be float32 (asserted by the release), ``[N, HV, K, V]``
(``[N, HV, V, K]`` with ``state_v_first``). The release makes every tensor argument
contiguous itself (``input_guard``), so strides are no contract. Checks the release leaves to
its Triton kernels (which index with the shapes of the docstring) are asserted here, marked
"stand-in". ``safe_gate`` without ``use_gate_in_kernel`` and ``disable_recompute`` choose
kernels, not results: accepted, no effect. Not modelled: ``cp_context``,
``use_gate_in_kernel`` (its gate from ``A_log``, ``dt_bias``, ``lower_bound``) and
``return_intermediate_states`` (NotImplementedError, after the release's checks), the
``dispatch`` and ``torch.compiler.disable`` wrappers (``inspect.signature`` sees through both
to these parameters), the device. ``fused_recurrent_kda`` is not here: transformers then
keeps its torch version for the one-token step.
"""

from __future__ import annotations

import warnings

import torch

from tests.support.mixer_standin import kernels


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: FLACPContext = None,  # noqa: F821 - the release's hint
    **kwargs,
):
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (log decay) ``[B, T, HV, K]``, beta
    ``[B, T, HV]``: ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``."""
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
    if initial_state is not None:
        assert initial_state.dtype == torch.float32, "initial_state must be in float32."
    if use_gate_in_kernel:
        assert "A_log" in kwargs, "A_log must be provided when use_gate_in_kernel=True."
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(
                "`lower_bound` must be specified when `safe_gate=True` and "
                "`use_gate_in_kernel=True`."
            )
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    B, T, H, K, HV = *q.shape, v.shape[2]
    assert q.shape == k.shape, f"q and k must have the same shape, got q={q.shape} vs k={k.shape}"
    assert K <= 256, f"Currently we only support key headdim <=256 for KDA, got {K}."
    assert HV % H == 0, (
        f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
        f"but got HV % H = {HV % H}"
    )
    assert g.shape == (B, T, HV, K), (
        f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}"
    )
    assert beta.shape == (B, T, HV), (
        f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}"
    )
    if scale is None:
        scale = K**-0.5
    # the kernels' indexing (chunk_delta_h.py, gla/chunk.py)
    assert v.shape[:2] == (B, T), f"stand-in: v {tuple(v.shape)} is not [B, T, HV, V]"
    if initial_state is not None:
        N, V = (B if cu_seqlens is None else len(cu_seqlens) - 1), v.shape[-1]
        state = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        assert initial_state.shape == state, (
            f"stand-in: initial_state {tuple(initial_state.shape)} is not {list(state)}"
        )
    if use_gate_in_kernel:
        raise NotImplementedError("stand-in: use_gate_in_kernel is not modelled")
    if return_intermediate_states:  # the release's autograd function asserts these first
        assert torch.is_inference_mode_enabled(), (
            "return_intermediate_states is only allowed in inference mode"
        )
        assert disable_recompute is False, (
            "return_intermediate_states must be used with disable_recompute=False"
        )
        raise NotImplementedError("stand-in: return_intermediate_states is not modelled")
    flags = (use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    options = kernels.fla_options(scale, *flags, state_v_first, cu_seqlens)
    return kernels.FlaDeltaFunction.apply(
        "chunk_kda", kernels.kda, q, k, v, g, beta, initial_state, output_final_state, options
    )
