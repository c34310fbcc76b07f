"""The mixer stand-ins (tests/support/mixer_standin): each release's parameters, the binding
transformers makes to them, the checks they share with the release, and their kernels
against transformers' torch versions. The modeling modules are imported before the
stand-ins (transformers binds a module's kernels once, at its import)."""

from __future__ import annotations

import importlib
import inspect
import itertools
import sys

import pytest
import torch

from tests.support import mixer_standin
from tests.support.mixer_standin import kernels

transformers = pytest.importorskip("transformers")
from transformers.integrations import hub_kernels  # noqa: E402
from transformers.models.bamba import modeling_bamba  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

# Parameter lists (name=default) copied from the releases: causal_conv1d_interface.py at
# v1.6.1.post4, ops/selective_scan_interface.py and ops/triton/ssd_combined.py at
# v2.3.2.post1, ops/gated_delta_rule/chunk.py and ops/kda/chunk.py at v0.5.2.
SIGNATURES = {
    "causal_conv1d_fn": "x weight bias=None seq_idx=None initial_states=None"
    " return_final_states=False final_states_out=None activation=None",
    "selective_scan_fn": "u delta A B C D=None z=None delta_bias=None delta_softplus=False"
    " return_last_state=False",
    "mamba_chunk_scan_combined": "x dt A B C chunk_size D=None z=None dt_bias=None"
    " initial_states=None seq_idx=None cu_seqlens=None dt_softplus=False dt_limit=(0.0,inf)"
    " return_final_states=False return_varlen_states=False",
    "chunk_gated_delta_rule": "q k v g beta scale=None initial_state=None"
    " output_final_state=False use_qk_l2norm_in_kernel=False use_beta_sigmoid_in_kernel=False"
    " allow_neg_eigval=False state_v_first=False cu_seqlens=None cu_seqlens_cpu=None"
    " cp_context=None **kwargs",
    "chunk_kda": "q k v g beta scale=None initial_state=None output_final_state=False"
    " use_qk_l2norm_in_kernel=False use_gate_in_kernel=False use_beta_sigmoid_in_kernel=False"
    " allow_neg_eigval=False safe_gate=False lower_bound=None disable_recompute=False"
    " return_intermediate_states=False state_v_first=False cu_seqlens=None"
    " cu_seqlens_cpu=None cp_context=None **kwargs",
}
MODULES = {
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d"),
    "selective_scan_fn": ("mamba_ssm", "mamba_ssm.ops.selective_scan_interface"),
    "mamba_chunk_scan_combined": ("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined"),
    "chunk_gated_delta_rule": ("fla", "fla.ops.gated_delta_rule"),
    "chunk_kda": ("fla", "fla.ops.kda"),
}
# transformers' torch versions (the functions its decorator wraps)
TORCH = {
    "causal_conv1d_fn": modeling_bamba.causal_conv1d_fn.__wrapped__,
    "selective_scan_fn": modeling_mamba.mamba_selective_scan.__wrapped__,
    "mamba_chunk_scan_combined": modeling_bamba.mamba2_chunk_scan.__wrapped__,
    "chunk_gated_delta_rule": modeling_qwen3_next.torch_chunk_gated_delta_rule.__wrapped__,
    "chunk_kda": modeling_kimi_linear.chunk_kimi_delta_attention.__wrapped__,
}


@pytest.fixture(scope="module")
def fn():
    mixer_standin.use()
    yield {name: getattr(importlib.import_module(m), name) for name, (_, m) in MODULES.items()}
    mixer_standin.unuse()


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def conv_args(b=2, c=16, s=24, w=4):  # x (b, c, s) channel-first, weight, bias
    return _randn(b, c, s), _randn(c, w, seed=1), _randn(c, seed=2)


def ssm_args(b=2, d=8, s=29, n=6, g=None):  # u, delta, A, B, C (3-D, or 4-D: g groups)
    bc = (b, n, s) if g is None else (b, g, n, s)
    A = -torch.exp(0.5 * _randn(d, n, seed=2))
    return _randn(b, d, s), _randn(b, d, s, seed=1), A, _randn(*bc, seed=3), _randn(*bc, seed=4)


def ssm_extras(b=2, d=8, s=29):  # D, z, delta_bias
    D, bias = torch.linspace(0.5, 1.5, d), torch.linspace(-1, 1, d)
    return {"D": D, "z": _randn(b, d, s, seed=5), "delta_bias": bias}


def scan_args(b=2, s=37, h=4, p=8, g=2, n=8):  # x, dt, A, B, C
    A = -torch.linspace(0.5, 2.0, h)
    return (
        _randn(b, s, h, p),
        _randn(b, s, h, seed=1),
        A,
        _randn(b, s, g, n, seed=2),
        _randn(b, s, g, n, seed=3),
    )


def rule_args(b=2, t=40, h=2, hv=4, k=8, v=8):  # q, k, v, g (log decay), beta
    g = -torch.nn.functional.softplus(_randn(b, t, hv, seed=3))
    return (
        _randn(b, t, h, k),
        _randn(b, t, h, k, seed=1),
        _randn(b, t, hv, v, seed=2),
        g,
        _randn(b, t, hv, seed=4).sigmoid(),
    )


def kda_args(b=2, t=40, h=2, hv=2, k=8, v=8):  # as rule_args, g per key channel
    q, k_, v_, _, beta = rule_args(b, t, h, hv, k, v)
    return q, k_, v_, -torch.nn.functional.softplus(_randn(b, t, hv, k, seed=3)), beta


def test_signatures_and_versions(fn):
    for name, spec in SIGNATURES.items():
        got = []
        for p in inspect.signature(fn[name]).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                got.append(f"**{p.name}")
            else:
                default = "" if p.default is p.empty else "=" + str(p.default).replace(" ", "")
                got.append(p.name + default)
        assert " ".join(got) == spec, name
    versions = {name: sys.modules[name].__version__ for name in mixer_standin.RELEASES}
    assert versions == mixer_standin.RELEASES


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_transformers_binds_the_standin_and_filters_keywords(fn, name):
    """The decorator of the family modules, applied here as at their import."""
    package = MODULES[name][0]
    wrapper = hub_kernels.use_kernel_func_from_hub_with_fallback(name, package)(TORCH[name])
    args = {
        "causal_conv1d_fn": conv_args,
        "selective_scan_fn": ssm_args,
        "mamba_chunk_scan_combined": scan_args,
        "chunk_gated_delta_rule": rule_args,
        "chunk_kda": kda_args,
    }[name]()
    # chunk_kda takes chunk_size in **kwargs and refuses 16: transformers drops it
    extra = {"mamba_chunk_scan_combined": {"chunk_size": 8}, "chunk_kda": {"chunk_size": 16}}
    extra = extra.get(name, {})
    before = kernels.CALLS[name]
    wrapper(*args, **extra, not_a_parameter=1)  # dropped by transformers' filter
    assert kernels.CALLS[name] == before + 1


CONV_REFUSALS = {  # x layout or argument -> the release's error
    "gelu": (NotImplementedError, "activation must be None, silu, or swish"),
    "float64": (RuntimeError, r"Expected input_type == at::ScalarType::Float"),
    "width 5": (RuntimeError, "only supports width between 2 and 4"),
    "channel-last, 12 channels": (RuntimeError, "channel dimension divisible by 8"),
    "channel-last, row stride 20": (RuntimeError, r"requires strides \(x.stride\(0\) and x.s"),
    "bias float64": (RuntimeError, r"Expected bias.scalar_type\(\) == weight_type"),
}


@pytest.mark.parametrize("case", list(CONV_REFUSALS))
def test_causal_conv1d_refuses_what_the_release_refuses(fn, case):
    x, w, bias = conv_args()
    kw = {}
    if case == "gelu":
        kw["activation"] = "gelu"
    elif case == "float64":
        x = x.double()
    elif case == "width 5":
        w = _randn(16, 5)
    elif case.startswith("channel-last"):
        c = 12 if "12" in case else 16
        x = _randn(2, 24, 20)[..., :c].transpose(1, 2)  # stride(1) == 1, stride(2) == 20
        w, bias = w[:c], bias[:c]
    else:
        bias = bias.double()
    error, match = CONV_REFUSALS[case]
    with pytest.raises(error, match=match):
        fn["causal_conv1d_fn"](x, w, bias, **kw)


def test_causal_conv1d_backward_checks_the_gradient_layout(fn):
    """A channel-last x (strides multiples of 8) passes; a gradient that is channel-last
    with a row stride of 20 is refused, as the extension's backward refuses it."""
    x = _randn(2, 24, 16).transpose(1, 2).requires_grad_()
    _, w, bias = conv_args()
    out = fn["causal_conv1d_fn"](x, w, bias, activation="silu")
    assert out.stride() == x.stride()  # empty_like(x)
    dout = _randn(2, 24, 20)[..., :16].transpose(1, 2)
    with pytest.raises(RuntimeError, match=r"strides \(dout.stride\(0\) and dout.stride\(2\)\)"):
        out.backward(dout)


SSM_REFUSALS = {  # changed arguments -> the release's error
    "u float64": ({"u": _randn(2, 8, 29).double()}, "Expected input_type == at::ScalarType::Fl"),
    "A float16": ({"A": -torch.ones(8, 6).half()}, "Expected weight_type == at::ScalarType::Fl"),
    "delta float16": ({"delta": _randn(2, 8, 29).half()}, r"delta.scalar_type\(\) == input_t"),
    "B float64": ({"B": _randn(2, 6, 29).double()}, r"\(!is_variable_B \? weight_type : input"),
    "fixed C float16": ({"C": _randn(8, 6).half()}, r"\(!is_variable_C \? weight_type : input"),
    "D float16": ({"D": torch.ones(8).half()}, r"Expected D.scalar_type\(\) == at::ScalarType"),
    "delta_bias strided": ({"delta_bias": torch.ones(16)[::2]}, r"delta_bias.stride\(-1\) == 1"),
    "z of another shape": ({"z": _randn(2, 8, 5)}, r"z must have shape \(batch_size, dim, seqlen"),
    "dstate 257": (
        {"A": -torch.ones(8, 257), "B": _randn(2, 257, 29), "C": _randn(2, 257, 29)},
        "selective_scan only supports state dimension <= 256",
    ),
    "B of 2 groups, C of 1": (
        {"B": _randn(2, 2, 6, 29)},
        r"C must have shape \(batch_size, n_groups, dstate, !is_complex \? seqlen: seqlen \* 2\)",
    ),
}


@pytest.mark.parametrize("case", [*SSM_REFUSALS, "complex A", "3 groups, 8 channels"])
def test_selective_scan_fn_refuses_what_the_release_refuses(fn, case):
    """The extension's checks (RuntimeError); the stand-in's own refusals: complex A (not
    modelled), groups that do not divide dim (unchecked in the release)."""
    u, delta, A, B, C = ssm_args()
    args = {"u": u, "delta": delta, "A": A, "B": B, "C": C, **ssm_extras()}
    if case == "complex A":
        change, error, match = {"A": A.cfloat()}, NotImplementedError, "complex A is not modelled"
    elif case == "3 groups, 8 channels":
        B, C = ssm_args(g=3)[3:]
        change, error, match = {"B": B, "C": C}, ValueError, "3 groups of B and C do not divide"
    else:
        (change, match), error = SSM_REFUSALS[case], RuntimeError
    with pytest.raises(error, match=match):
        fn["selective_scan_fn"](**{**args, **change})


def test_selective_scan_fn_dtypes_and_layouts_of_B_C(fn):
    """bfloat16 in: out bfloat16, the last state a float32 view into the chunk states, the
    gradients in their inputs' dtypes and shapes (B, C 3-D). B and C of 2 groups, and fixed
    ``(dim, dstate)`` ones: as scans of the channels each group or row serves."""
    scan = fn["selective_scan_fn"]
    u, delta, A, B, C = ssm_args()
    D, z, bias = ssm_extras().values()
    low = [t.bfloat16().requires_grad_() for t in (u, delta, B, C, z)]
    f32 = [t.clone().requires_grad_() for t in (A, D, bias)]
    (u, delta, B, C, z), (A, D, bias) = low, f32
    out, last = scan(u, delta, A, B, C, D, z, bias, delta_softplus=True, return_last_state=True)
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32
    assert last.shape == (2, 8, 6) and last.stride(-1) == 2
    out.float().sum().backward()
    assert all(t.grad.dtype == t.dtype and t.grad.shape == t.shape for t in low + f32)
    u, delta, A, B, C = ssm_args(g=2)
    delta = torch.nn.functional.softplus(delta)  # decays below 1
    Bf, Cf = _randn(8, 6, seed=6), _randn(8, 6, seed=7)

    def part(c, B, C):  # channels c alone
        return scan(u[:, c], delta[:, c], A[c], B, C)

    grouped = [part(slice(4 * i, 4 * i + 4), B[:, i], C[:, i]) for i in range(2)]
    fixed = [
        part(slice(i, i + 1), *(M[i, :, None].expand(2, 6, 29) for M in (Bf, Cf))) for i in range(8)
    ]
    got = [scan(u, delta, A, B, C), scan(u, delta, A, Bf, Cf)]
    _compare(got, [torch.cat(grouped, 1), torch.cat(fixed, 1)], 1e-6)


def test_mamba_chunk_scan_combined_asserts_and_dt_limit(fn):
    scan = fn["mamba_chunk_scan_combined"]
    x, dt, A, B, C = scan_args(h=4, g=3)  # 4 heads in 3 groups
    with pytest.raises(AssertionError):
        scan(x, dt, A, B, C, 16)
    x, dt, A, B, C = scan_args()
    for bad in ({"D": torch.ones(3)}, {"dt_bias": torch.ones(4, 1)}, {"z": x[:, :5]}):
        with pytest.raises(AssertionError):
            scan(x, dt, A, B, C, 16, **bad)
    with pytest.raises(AssertionError):
        scan(x, dt, A, B, C[:, :, :1], 16)
    with pytest.raises(TypeError, match="dt_limit holds a Tensor"):
        scan(x, dt, A, B, C, 16, dt_limit=torch.tensor([0.0, 1.0]))
    with pytest.raises(AssertionError, match="cu_seqlens must be provided"):
        scan(x, dt, A, B, C, 16, return_varlen_states=True)
    out, final = scan(x, dt, A, B, C, 16, dt_limit=[0, 100], return_final_states=True)
    assert out.dtype == x.dtype and final.shape == (2, 4, 8, 8)


def test_chunk_gated_delta_rule_refusals(fn):
    rule = fn["chunk_gated_delta_rule"]
    q, k, v, g, beta = rule_args()
    cases = [
        ((q, k[:, :, :1], v, g, beta), {}, ValueError, "q and k must have the same number"),
        ((q, k, v[:, :, :3], g[..., :3], beta[..., :3]), {}, ValueError, r"HV % H = 1"),
        ((q, k, v, g, beta), {"head_first": False}, DeprecationWarning, "head_first has been"),
        ((q, k, v, g, beta), {"chunk_size": 128}, ValueError, "must be 16, 32, or 64"),
        (
            (q, k, v, g, beta),
            {"cu_seqlens": torch.tensor([0, 40])},
            ValueError,
            "batch size is expected to be 1 rather than 2",
        ),
        ((q, k, v, g.transpose(1, 2), beta), {}, AssertionError, r"g .* is not \[B, T, HV\]"),
        (
            (
                *(_randn(1, 4, 2, 300) for _ in range(2)),
                _randn(1, 4, 2, 8),
                g[:1, :4, :2],
                beta[:1, :4, :2],
            ),
            {},
            AssertionError,
            "head dimension larger than 256",
        ),
    ]
    for args, kw, error, match in cases:
        with pytest.raises(error, match=match):
            rule(*args, **kw)
    o, final = rule(*(t.bfloat16() for t in (q, k, v)), g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32


def _compare(got, want, rtol):
    for a, b in zip(got, want):
        assert ((a - b).abs().max() / b.abs().max()).item() < rtol


def _grads(f, inputs, every=False):
    """The first output of ``f`` (``every``: all its tensor outputs) and the gradients of a
    weighted sum of it (them)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = f(*leaves)
    outs = [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, tuple) else [out]
    outs = outs if every else outs[:1]
    sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs).backward()
    return [*(o.detach() for o in outs), *(t.grad for t in leaves)]


def test_kernels_equal_transformers_torch_versions(fn):
    """float32 in: the stand-ins' float64 kernels against transformers' torch versions."""
    got, want = (
        _grads(lambda *t, f=f: f(*t, activation="silu"), conv_args())
        for f in (fn["causal_conv1d_fn"], TORCH["causal_conv1d_fn"])
    )
    _compare(got, want, 1e-6)
    x, dt, A, B, C = scan_args()
    kw = {"chunk_size": 16, "dt_softplus": True, "dt_limit": (0.0, 5.0)}
    inputs = (x, dt, A, B, C, torch.linspace(0.5, 1.5, 4), torch.linspace(-1, 1, 4))
    got, want = (
        _grads(
            lambda x, dt, A, B, C, D, bias, f=f: f(x, dt, A, B, C, D=D, dt_bias=bias, **kw), inputs
        )
        for f in (fn["mamba_chunk_scan_combined"], TORCH["mamba_chunk_scan_combined"])
    )
    _compare(got, want, 2e-5)
    got, want = (
        _grads(
            lambda q, k, v, g, b, f=f: f(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True),
            rule_args(),
        )
        for f in (fn["chunk_gated_delta_rule"], TORCH["chunk_gated_delta_rule"])
    )
    _compare(got, want, 2e-5)


def test_packed_documents_equal_separate_runs(fn):
    """``seq_idx`` (conv, scan) and ``cu_seqlens`` (rule) keep documents apart."""
    bounds = [0, 9, 30, 40]
    docs = list(itertools.pairwise(bounds))
    seq_idx = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(docs)])[None].int()

    def split(f, *t, dim):  # f on each document's piece alone
        return torch.cat([f(*(u.narrow(dim, a, b - a) for u in t)) for a, b in docs], dim)

    x, w, bias = conv_args(b=1, s=40)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # seq_idx needs channel-last
    conv = fn["causal_conv1d_fn"]
    _compare([conv(x, w, bias, seq_idx)], [split(lambda x: conv(x, w, bias), x, dim=2)], 1e-6)
    scan = fn["mamba_chunk_scan_combined"]
    x, dt, A, B, C = scan_args(b=1, s=40)
    got = scan(x, dt, A, B, C, 16, seq_idx=seq_idx)
    want = split(lambda *t: scan(t[0], t[1], A, *t[2:], 16), x, dt, B, C, dim=1)
    _compare([got], [want], 1e-6)
    rule = fn["chunk_gated_delta_rule"]
    q, k, v, g, beta = rule_args(b=1)
    got, _ = rule(q, k, v, g, beta, cu_seqlens=torch.tensor(bounds))
    want = split(lambda *t: rule(*t)[0], q, k, v, g, beta, dim=1)
    _compare([got], [want], 1e-6)


@pytest.mark.parametrize("last", [False, True])
def test_selective_scan_fn_equals_transformers_torch_version(fn, last):
    """float32 in, B and C 3-D, with D, z, delta_bias and softplus: out, the last state and
    the gradients against autograd through transformers' torch version."""
    kw = {"delta_softplus": True, "return_last_state": last}

    def call(f, u, delta, A, B, C, D, z, bias):
        return f(u, delta, A, B, C, D=D, z=z, delta_bias=bias, **kw)

    inputs = (*ssm_args(), *ssm_extras().values())
    fs = (fn["selective_scan_fn"], TORCH["selective_scan_fn"])
    got, want = (_grads(lambda *t, f=f: call(f, *t), inputs) for f in fs)
    _compare(got, want, 2e-5)
    if last:
        _compare(*([call(f, *inputs)[1]] for f in fs), 2e-5)
