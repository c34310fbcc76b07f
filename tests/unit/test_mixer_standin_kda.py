"""The stand-in of flash-linear-attention 0.5.2's ``chunk_kda`` (Kimi Delta Attention): the
release's refusals and options, its dtypes, its kernel against transformers' torch version
(``chunk_kimi_delta_attention``) and packed documents. Its parameter list and transformers'
binding are in the tables of tests/unit/test_mixer_standin.py, whose fixture and helpers these
tests share."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.unit.test_mixer_standin import TORCH, _compare, _grads, _randn, fn, kda_args

__all__ = ["fn"]  # the fixture these tests take


@pytest.fixture(scope="module")
def kda(fn):
    return fn["chunk_kda"]


def _inputs(**kw):
    return dict(zip(["q", "k", "v", "g", "beta"], kda_args(**kw)))


WIDE = {"q": _randn(2, 40, 2, 300), "k": _randn(2, 40, 2, 300), "g": -_randn(2, 40, 2, 300).abs()}
REFUSALS = {  # changed arguments -> the release's error (the last four: the stand-in's)
    "q and k shapes differ": (
        {"k": _randn(2, 40, 2, 4)},
        AssertionError,
        r"q and k must have the same shape, got q=torch.Size\(\[2, 40, 2, 8\]\) vs k=",
    ),
    "K 300": (WIDE, AssertionError, "only support key headdim <=256 for KDA, got 300"),
    "3 value heads, 2 key heads": (
        {n: t for n, t in _inputs(hv=3).items() if n in ("v", "g", "beta")},
        AssertionError,
        r"num_v_heads \(HV=3\) must be evenly divisible by num_qk_heads \(H=2\), .* = 1",
    ),
    "g per head": (
        {"g": _randn(2, 40, 2)},
        AssertionError,
        r"g must have shape \[B, T, HV, K\]=\[2, 40, 2, 8\], got \[2, 40, 2\]",
    ),
    "beta per channel": (
        {"beta": _randn(2, 40, 2, 8)},
        AssertionError,
        r"beta must have shape \[B, T, HV\]=\[2, 40, 2\], got \[2, 40, 2, 8\]",
    ),
    "chunk_size 16": ({"chunk_size": 16}, ValueError, "either 32 or 64 for KDA, got 16"),
    "cu_seqlens, batch 2": (
        {"cu_seqlens": torch.tensor([0, 40])},
        ValueError,
        r"expected to be 1 rather than 2 when using `cu_seqlens`.Please flatten",
    ),
    "3 documents, 1 initial state": (
        {
            **_inputs(b=1),
            "cu_seqlens": torch.tensor([0, 9, 30, 40]),
            "initial_state": torch.zeros(1, 2, 8, 8),
        },
        ValueError,
        r"equal to the number of input sequences, i.e., 3 rather than 1\.",
    ),
    "initial_state bfloat16": (
        {"initial_state": torch.zeros(2, 2, 8, 8, dtype=torch.bfloat16)},
        AssertionError,
        "initial_state must be in float32.",
    ),
    "gate in kernel, no A_log": (
        {"use_gate_in_kernel": True},
        AssertionError,
        "A_log must be provided when use_gate_in_kernel=True.",
    ),
    "safe gate, no lower_bound": (
        {"use_gate_in_kernel": True, "A_log": torch.zeros(2), "safe_gate": True},
        ValueError,
        "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.",
    ),
    "lower_bound -6": (
        {"use_gate_in_kernel": True, "A_log": torch.zeros(2), "safe_gate": True, "lower_bound": -6},
        ValueError,
        r"`lower_bound` must be in the safe range \[-5, 0\), got -6.",
    ),
    "negative eigenvalues, beta as given": (
        {"allow_neg_eigval": True},
        ValueError,
        r"`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.",
    ),
    "both state layouts": (
        {"state_v_first": True, "transpose_state_layout": True},
        ValueError,
        "Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.",
    ),
    "intermediate states outside inference mode": (
        {"return_intermediate_states": True},
        AssertionError,
        "return_intermediate_states is only allowed in inference mode",
    ),
    "v of another length": (
        {"v": _randn(2, 39, 2, 8)},
        AssertionError,
        r"stand-in: v \(2, 39, 2, 8\) is not \[B, T, HV, V\]",
    ),
    "initial_state [N, HV, K, V] with state_v_first": (
        {"v": _randn(2, 40, 2, 6), "initial_state": torch.zeros(2, 2, 8, 6), "state_v_first": True},
        AssertionError,
        r"stand-in: initial_state \(2, 2, 8, 6\) is not \[2, 2, 6, 8\]",
    ),
    "gate in kernel": (
        {"use_gate_in_kernel": True, "A_log": torch.zeros(2)},
        NotImplementedError,
        "stand-in: use_gate_in_kernel is not modelled",
    ),
    "cp_context": ({"cp_context": object()}, NotImplementedError, "cp_context is not modelled"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_chunk_kda_refuses_what_the_release_refuses(kda, case):
    change, error, match = REFUSALS[case]
    with pytest.raises(error, match=match):
        kda(**{**_inputs(), **change})


def test_chunk_kda_dtypes(kda):
    """bfloat16 q, k, v (g, beta float32, the initial state float32): o bfloat16, the final
    state float32, the gradients in their inputs' dtypes."""
    q, k, v, g, beta = kda_args()
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    leaves += [t.clone().requires_grad_() for t in (g, beta, _randn(2, 2, 8, 8, seed=5))]
    o, final = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert final.shape == (2, 2, 8, 8)
    (o.float().sum() + final.sum()).backward()
    assert all(t.grad.dtype == t.dtype and t.grad.shape == t.shape for t in leaves)
    assert kda(q, k, v, g, beta)[1] is None


def test_chunk_kda_options(kda):
    """beta in sigmoid space (times 2 with negative eigenvalues), the V-first state layout
    (and its deprecated name), the default scale 1/sqrt(K); safe_gate (without the gate in
    kernel) and disable_recompute choose kernels only."""
    args = _inputs()
    h0 = _randn(2, 2, 8, 8, seed=5)
    o, final = kda(**args, initial_state=h0, output_final_state=True)
    raw = {**args, "beta": torch.logit(args["beta"] / 2)}
    same = [
        kda(**{**args, "beta": torch.logit(args["beta"])}, use_beta_sigmoid_in_kernel=True),
        kda(**raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
        kda(**args, scale=8**-0.5, safe_gate=True, disable_recompute=True),
    ]
    _compare([s[0] for s in same], [kda(**args)[0]] * 3, 1e-6)
    h0t = h0.transpose(-1, -2).contiguous()
    o_t, final_t = kda(**args, initial_state=h0t, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="renamed to `state_v_first`"):
        o_d, final_d = kda(
            **args, initial_state=h0t, output_final_state=True, transpose_state_layout=True
        )
    _compare([o_t, final_t.transpose(-1, -2), o_d, final_d], [o, final, o, final_t], 1e-6)


@pytest.mark.parametrize(("initial", "final"), list(itertools.product([False, True], repeat=2)))
def test_chunk_kda_equals_transformers_torch_version(kda, initial, final):
    """float32 in, l2norm in the kernel, 70 steps (two of the torch version's chunks): o, the
    final state and the gradients (of q, k, v, g, beta and the initial state) against
    autograd through ``chunk_kimi_delta_attention``."""
    inputs = [*kda_args(t=70), *([_randn(2, 2, 8, 8, seed=5)] if initial else [])]

    def call(f, q, k, v, g, beta, h0=None):
        kw = {"initial_state": h0, "output_final_state": final}
        return f(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **kw)

    got, want = (
        _grads(lambda *t, f=f: call(f, *t), inputs, every=True) for f in (kda, TORCH["chunk_kda"])
    )
    assert len(got) == len(want) == len(inputs) + 1 + final
    _compare(got, want, 2e-5)


def test_chunk_kda_packed_documents_equal_separate_runs(kda):
    """``cu_seqlens``: each document from its own initial state, to its own final state;
    o, the final states and the gradients as of separate runs."""
    docs = list(itertools.pairwise([0, 9, 30, 40]))
    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}

    def packed(*t):
        return kda(*t[:5], initial_state=t[5], cu_seqlens=torch.tensor([0, 9, 30, 40]), **kw)

    def separate(*t):
        runs = [
            kda(*(u[:, a:b] for u in t[:5]), initial_state=t[5][i : i + 1], **kw)
            for i, (a, b) in enumerate(docs)
        ]
        return tuple(torch.cat(parts, d) for parts, d in zip(zip(*runs), (1, 0)))

    inputs = [*kda_args(b=1), _randn(3, 2, 8, 8, seed=5)]
    _compare(_grads(packed, inputs, every=True), _grads(separate, inputs, every=True), 1e-6)
