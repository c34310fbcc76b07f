"""The contract with flash-attn 2.6, 2.7 and 2.8, pinned on CPU.

Every test drives the public API (``local_attention`` / ``ucp.attention`` with
``backend="flash_attn"``) against the stand-ins in ``tests/support/flash_standin`` (each release's
exact interface, custom-op wrapping included, over pure-torch kernels with flash-attn's
conventions) and compares outputs and gradients with float64 math attention.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from tests.support.flash_standin import unuse, use
from tests.support.helpers import reference as float64_attention
from ulysses_cp.kernels import backends, flash_backend, torch_backend
from ulysses_cp.kernels.dispatch import local_attention
from ulysses_cp.kernels.spec import AttentionSpec, Scores

# (release, wrap): 2.6 has plain functions; 2.7/2.8 custom ops (torch 2.4-2.9) or plain
# functions (torch >= 2.10, where the release's string version check fails)
RELEASES = [
    ("2.6.0", "plain"),
    ("2.7.4", "custom_op"),
    ("2.7.4", "plain"),
    ("2.8.3", "custom_op"),
    ("2.8.3", "plain"),
]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def install(version: str, wrap: str):
    use(version, wrap)
    flash_backend.reset()


def uninstall():
    unuse()
    flash_backend.reset()


@pytest.fixture
def standin(request):
    install(*request.param)
    yield request.param
    uninstall()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def bounds(N: int, multiple: int) -> torch.Tensor:
    """Three documents of unequal lengths, each a multiple of ``multiple``."""
    u = N // multiple
    lens = [u // 2, u // 4, u - u // 2 - u // 4]
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) * multiple


def make(shape_q, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s, _, d = shape_q
    q, do = torch.randn(shape_q, generator=g), torch.randn(shape_q, generator=g)
    k, v = (torch.randn(b, s, hkv, d, generator=g) for _ in range(2))
    return q, k, v, do


def reference(q, k, v, do, causal, cu=None):
    bounds = None if cu is None else cu.tolist()
    return float64_attention(q, k, v, do, causal, bounds=bounds)


def run(q, k, v, do, dtype, fn):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


# ---------------------------------------------------------------- one rank


@pytest.mark.parametrize("standin", RELEASES, indirect=True, ids=lambda r: "-".join(r))
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (4, 2, 40), (4, 1, 16)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_local_attention_matches_float64(standin, hq, hkv, d, causal, packed):
    N = 96
    q, k, v, do = make((1, N, hq, d), hkv)
    cu = bounds(N, 8) if packed else None
    ref = reference(q, k, v, do, causal, cu)
    for dtype in (torch.bfloat16, torch.float16):
        got = run(
            q,
            k,
            v,
            do,
            dtype,
            lambda *t: local_attention(
                *t, AttentionSpec(causal=causal), backend="flash_attn", cu_seqlens=cu
            ),
        )
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert a.dtype == dtype, name
            assert rel_err(a, b) < TOL[dtype], (standin, dtype, name, rel_err(a, b))


@pytest.mark.parametrize("standin", RELEASES, indirect=True, ids=lambda r: "-".join(r))
def test_batch_and_scale_reach_the_kernel(standin):
    q, k, v, do = make((3, 32, 4, 32), 2, seed=1)
    ref = float64_attention(q, k, v, do, True, softmax_scale=0.3)
    got = run(
        q,
        k,
        v,
        do,
        torch.bfloat16,
        lambda *t: local_attention(*t, AttentionSpec(scale=0.3), backend="flash_attn"),
    )
    for a, b in zip(got, ref):
        assert rel_err(a, b) < TOL[torch.bfloat16]


@pytest.mark.parametrize("standin", RELEASES, indirect=True, ids=lambda r: "-".join(r))
def test_parameters_read_from_the_release(standin):
    version, wrap = standin
    fa = flash_backend.interface()
    assert fa.version == version
    fwd = list(fa.forward.params)
    window = ["window_size"] if version == "2.6.0" else ["window_size_left", "window_size_right"]
    assert fwd == [
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        *window,
        "softcap",
        "alibi_slopes",
        "return_softmax",
    ]
    if version == "2.6.0":
        assert fa.varlen_forward.params["block_table"] is False  # required in 2.6.0
    if wrap == "custom_op":  # the trap: a custom op's Python signature says nothing
        import inspect

        sig = str(inspect.signature(fa.forward.fn))
        assert sig == "(*args, **kwargs)", sig


# ---------------------------------------------------------------- refusals


def _swap(name, fn):
    import flash_attn.flash_attn_interface as fai

    setattr(fai, name, fn)
    flash_backend.reset()


@pytest.mark.parametrize("standin", [("2.8.3", "plain")], indirect=True)
def test_an_essential_argument_not_taken_is_refused(standin):
    def no_window(q, k, v, dropout_p, softmax_scale, causal, softcap, alibi_slopes, return_softmax):
        raise AssertionError("must not be called")

    _swap("_flash_attn_forward", no_window)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    match = r"flash-attn 2\.8\.3: _flash_attn_forward does not take \['window_size_left', "
    with pytest.raises(ValueError, match=match + r"'window_size_right'\]"):
        local_attention(q, q, q, backend="flash_attn")


@pytest.mark.parametrize("standin", [("2.8.3", "plain")], indirect=True)
def test_an_unknown_required_argument_is_refused(standin):
    def extra(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
        sink_scale,
    ):
        raise AssertionError("must not be called")

    _swap("_flash_attn_forward", extra)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"2\.8\.3: _flash_attn_forward requires argument "
        r"'sink_scale'",
    ):
        local_attention(q, q, q, backend="flash_attn")


@pytest.mark.parametrize("standin", [("2.7.4", "custom_op")], indirect=True)
def test_a_nonzero_softcap_is_never_dropped(standin):
    fa = flash_backend.interface()
    f = flash_backend.Fn("f", lambda **kw: kw, {"q": False, "causal": False})
    with pytest.raises(ValueError, match=r"2\.7\.4: f does not take \['softcap', 'window"):
        flash_backend._call(f, fa.version, {"q": 1, "causal": True}, (-1, -1), 0.5)


@pytest.mark.parametrize("standin", [("2.7.4", "plain")], indirect=True)
def test_an_unknown_return_convention_is_refused(standin):
    import flash_attn.flash_attn_interface as fai

    real = fai._flash_attn_forward

    @functools.wraps(real)  # the release's signature, three return values
    def three(*args, **kwargs):
        return real(*args, **kwargs)[:3]

    _swap("_flash_attn_forward", three)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"2\.7\.4: _flash_attn_forward returned 3 values"):
        local_attention(q, q, q, backend="flash_attn")


@pytest.mark.parametrize("version", ["2.5.9", "3.0.0b1"])
def test_unsupported_versions_are_refused(version):
    install("2.8.3", "plain")
    try:
        sys.modules["flash_attn"].__version__ = version
        flash_backend.reset()
        q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"flash-attn {version} is installed; "):
            local_attention(q, q, q, backend="flash_attn")
    finally:
        uninstall()


def test_missing_broken_and_flash3_installs_say_which(tmp_path, monkeypatch):
    uninstall()
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs flash-attn, which is not installed; install"):
        local_attention(q, q, q, backend="flash_attn")
    (tmp_path / "flash_attn_interface.py").write_text("")  # flash-attn 3's module
    monkeypatch.syspath_prepend(str(tmp_path))
    flash_backend.reset()
    with pytest.raises(
        ValueError,
        match="FlashAttention-3 `flash_attn_interface` module is installed: use backend='flash_",
    ):
        local_attention(q, q, q, backend="flash_attn")
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')"
    )
    flash_backend.reset()
    try:
        with pytest.raises(ValueError, match=r"installed but does not import.*undefined symbol"):
            local_attention(q, q, q, backend="flash_attn")
    finally:
        sys.modules.pop("flash_attn", None)
        flash_backend.reset()


# ---------------------------------------------------------------- "auto"


def test_auto_picks_flash_attn_only_for_inputs_it_runs():
    install("2.8.3", "custom_op")
    try:
        assert backends.flash_attn_unusable("cuda", torch.bfloat16, 128) is None
        assert backends.flash_attn_unusable("cuda", torch.float16, 256) is None
        assert "float32" in backends.flash_attn_unusable("cuda", torch.float32, 128)
        assert "head dim 512" in backends.flash_attn_unusable("cuda", torch.bfloat16, 512)
        assert "on cpu" in backends.flash_attn_unusable("cpu", torch.bfloat16, 128)
        assert "capability 7.5" in backends.flash_attn_unusable("cuda", torch.float16, 64, (7, 5))
        assert backends.flash_attn_unusable("cuda", torch.float16, 64, (8, 0)) is None
        q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)  # CPU: never flash-attn
        assert backends.resolve_backend("auto", q) == "torch"
    finally:
        uninstall()
    assert "not installed" in backends.flash_attn_unusable("cuda", torch.bfloat16, 128)


# ---------------------------------------------------------------- torch backend, CUDA calls


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,kernel",
    [
        (torch.bfloat16, 8, 2, 72, "flash"),
        (torch.float16, 4, 4, 64, "cudnn"),
        (torch.bfloat16, 32, 8, 128, "cudnn"),
        (torch.bfloat16, 8, 1, 192, "cudnn"),
        (torch.float32, 8, 2, 60, "efficient"),
    ],
)
def test_cuda_kernel_calls_bind_to_the_aten_schemas(dtype, hq, hkv, d, kernel):
    """The CUDA branch of the torch backend on meta tensors (standing for a Hopper GPU with
    cuDNN 9): the aten ops' meta functions check every argument and give the output shapes
    (cuDNN's attention for head dims of 64-256 by 64, GQA and MQA native, its lse (b, h, s,
    1) made (b, h, s); torch's flash kernel for other fp16/bf16 dims; float32: the efficient
    kernel on expanded k/v; head dims padded to 8)."""
    b, s = 2, 100
    q, dout = (torch.empty(b, s, hq, d, device="meta", dtype=dtype) for _ in range(2))
    k, v = (torch.empty(b, s, hkv, d, device="meta", dtype=dtype) for _ in range(2))
    assert torch_backend._kernel(q) == kernel
    out, lse = torch_backend.forward(q, k, v, Scores(True, 0.125))
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, hq, s) and lse.dtype == torch.float32
    dq, dk, dv = torch_backend.backward(dout, q, k, v, out, lse, Scores(True, 0.125))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_cuda_kernel_rule():
    """cuDNN only where it was measured (sm90+, cuDNN 9, fp16/bf16, d 64..256 by 64), then
    torch's flash (sm80+, d <= 256), then the efficient kernel: by rule, never by trying."""
    rule = torch_backend.cuda_kernel
    bf16, hopper, ampere = torch.bfloat16, (9, 0), (8, 0)
    assert rule(bf16, 128, hopper, 91900) == "cudnn"
    assert rule(torch.float16, 256, (10, 0), 90100) == "cudnn"
    assert rule(bf16, 128, ampere, 91900) == "flash"  # measured on Hopper only
    assert rule(bf16, 128, hopper, 8900) == "flash"  # cuDNN 8
    assert rule(bf16, 128, hopper, None) == "flash"  # no cuDNN
    assert rule(bf16, 80, hopper, 91900) == "flash"  # a head dim not measured
    assert rule(bf16, 512, hopper, 91900) == "efficient"
    assert rule(bf16, 64, (7, 5), None) == "efficient"
    assert rule(torch.float32, 128, hopper, 91900) == "efficient"


def test_float64_off_cpu_goes_to_math():
    q = torch.empty(1, 16, 2, 8, device="meta", dtype=torch.float64)
    out, lse = torch_backend.forward(q, q, q, Scores(True, 0.3))
    assert out.dtype == torch.float64 and lse.dtype == torch.float64


# ---------------------------------------------------------------- every mode, 4 ranks


def _modes(rank, version, wrap):
    from tests.support.helpers import sharded_run, topology

    install(version, wrap)
    try:
        N, hq, hkv, d = 64, 8, 2, 24
        q, k, v, do = make((1, N, hq, d), hkv, seed=3)
        rows = []
        for u, r in ((4, 1), (1, 4), (2, 2)):
            for layout in ("zigzag", "contiguous"):
                topo = topology(u, r, layout)
                for cu in (None, bounds(N, 8)):
                    ref = reference(q, k, v, do, True, cu)
                    low = (t.to(torch.bfloat16) for t in (q, k, v, do))
                    kw = dict(layout=layout, backend="flash_attn", cu_seqlens=cu)
                    got = sharded_run(*low, topo, **kw)[:4]
                    errs = [rel_err(a, b) for a, b in zip(got, ref)]
                    rows.append((u, r, layout, cu is not None, errs))
        return rows
    finally:
        uninstall()


def _host_staged(rank):
    import torch.distributed as dist

    from ulysses_cp.core.comm import host_staged

    group = dist.group.WORLD
    return host_staged(group, torch.device("cuda", 0)), host_staged(group, torch.device("cpu"))
