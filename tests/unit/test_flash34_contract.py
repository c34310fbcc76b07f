"""The contract with FlashAttention-3 (backend "flash_attn3") and FlashAttention-4
("flash_attn4"), pinned on CPU, and the order "auto" tries the backends in.

Every test drives the public API (``local_attention`` / ``ucp.attention``) against the
stand-ins in ``tests/support/flash_standin`` (each release's exact Python interface over pure-torch
kernels with the library's conventions: lse layout, -inf for empty rows, FA4's None
windows) and compares outputs and gradients with float64 attention (``tests.support.helpers``).
Neither library has run on a GPU here.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.flash_standin import unuse, use
from tests.support.helpers import reference
from ulysses_cp.kernels import backends, flash3_backend, flash4_backend
from ulysses_cp.kernels.dispatch import local_attention
from ulysses_cp.kernels.spec import AttentionSpec

# (release, backend name, adapter module)
RELEASES = [
    ("3.0.0b1", "flash_attn3", flash3_backend),
    ("3.0.0", "flash_attn3", flash3_backend),
    ("4.0.0b18", "flash_attn4", flash4_backend),
    ("4.0.0b27", "flash_attn4", flash4_backend),
]
IDS = [r[0] for r in RELEASES]
TOL = 3e-2  # bfloat16 against float64


def install(version, module):
    use(version)
    module.reset()


def uninstall():
    unuse()
    flash3_backend.reset()
    flash4_backend.reset()


@pytest.fixture
def release(request):
    version, name, module = request.param
    install(version, module)
    yield version, name, module
    uninstall()


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def make(b, n, hq, hkv, d, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=g)
    k = torch.randn(b, n, hkv, d, generator=g)
    v = torch.randn(b, n, hkv, dv or d, generator=g)
    return q, k, v, torch.randn(b, n, hq, dv or d, generator=g)


def run(q, k, v, do, name, spec, cu=None, dtype=torch.bfloat16):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, spec, backend=name, cu_seqlens=cu)
    out.backward(do.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def assert_matches(got, ref, what):
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape, (what, label, a.shape, b.shape)
        assert rel_err(a, b) < TOL, (what, label, rel_err(a, b))


BOUNDS = torch.tensor([0, 40, 64, 96], dtype=torch.int32)


@pytest.mark.parametrize("release", RELEASES, indirect=True, ids=IDS)
@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 4, 64, 64), (4, 2, 40, 40), (4, 1, 16, 16)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_float64(release, hq, hkv, d, dv, causal, packed):
    q, k, v, do = make(1, 96, hq, hkv, d, dv)
    cu = BOUNDS if packed else None
    ref = reference(q, k, v, do, causal, bounds=None if cu is None else cu.tolist())
    got = run(q, k, v, do, release[1], AttentionSpec(causal=causal), cu)
    assert_matches(got, ref, release)


@pytest.mark.parametrize("release", RELEASES, indirect=True, ids=IDS)
@pytest.mark.parametrize("packed", [False, True])
def test_mla_widths_batch_scale_window_softcap(release, packed):
    """Values narrower than q/k (MLA), batch 2 (dense), a scale, a sliding window and a
    softcap reach the kernel: FA3 through zero padding, FA4 at its own widths."""
    b = 1 if packed else 2
    q, k, v, do = make(b, 96, 4, 2, 24, 16, seed=1)
    spec = AttentionSpec(causal=True, scale=0.3, softcap=5.0, window=(7, 0))
    cu = BOUNDS if packed else None
    bounds = None if cu is None else cu.tolist()
    ref = reference(q, k, v, do, True, softmax_scale=0.3, softcap=5.0, window=(7, 0), bounds=bounds)
    assert_matches(run(q, k, v, do, release[1], spec, cu), ref, release)


@pytest.mark.parametrize("release", RELEASES, indirect=True, ids=IDS)
@pytest.mark.parametrize("window", [(5, 3), (5, -1), (-1, 3)])
def test_windows_without_causal(release, window):
    """One side unbounded: FA3 says -1, FA4 None (a -1 would hide FA4's diagonal)."""
    q, k, v, do = make(1, 64, 2, 2, 32, seed=2)
    spec = AttentionSpec(causal=False, window=window)
    ref = reference(q, k, v, do, False, window=window)
    assert_matches(run(q, k, v, do, release[1], spec), ref, release)


@pytest.mark.parametrize("release", RELEASES, indirect=True, ids=IDS)
def test_the_release_is_read(release):
    version, name, module = release
    lib = module.library()
    assert lib.label.endswith(version)
    fwd = list(lib.forward.params)
    assert fwd[:3] == ["q", "k", "v"]
    if version == "3.0.0":  # a custom op: its Python signature says nothing
        import inspect

        assert str(inspect.signature(lib.forward.fn)) == "(*args, **kwargs)"
        assert "is_causal" in lib.backward.params and "causal" not in lib.backward.params
    if version == "3.0.0b1":
        assert "window_size" in fwd and lib.forward.params["causal"] is False  # no default
    if name == "flash_attn4":
        assert list(lib.backward.params)[:6] == ["q", "k", "v", "out", "dout", "lse"]
        assert lib.unbounded is None and lib.forward_values == {"return_lse": True}


# ---------------------------------------------------------------- refusals


def _swap(module, name, fn, adapter):
    setattr(module, name, fn)
    adapter.reset()


@pytest.mark.parametrize("release", [RELEASES[1], RELEASES[3]], indirect=True, ids=IDS[1::2])
def test_a_renamed_parameter_is_refused(release):
    version, name, adapter = release
    mod = adapter.library().forward.fn.__module__
    import sys

    fai = sys.modules[mod if version.startswith("4") else "flash_attn_interface"]
    fwd_name = adapter.library().forward.name

    def renamed(q, k, v, softmax_scale=None, causal=False, window_left=-1, window_right=-1):
        raise AssertionError("must not be called")

    if version.startswith("4"):
        renamed.__defaults__ = (None, False, None, None)
    _swap(fai, fwd_name, renamed, adapter)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=rf"{version}: {fwd_name} does not take \[.*'window_size_left'"
    ):
        local_attention(q, q, q, backend=name)


@pytest.mark.parametrize("release", [RELEASES[0], RELEASES[2]], indirect=True, ids=IDS[0::2])
def test_an_unknown_return_tuple_is_refused(release):
    version, name, adapter = release
    lib = adapter.library()
    real = lib.forward.fn

    @functools.wraps(real)  # the release's signature, three values back
    def three(*args, **kwargs):
        out, lse, *_ = real(*args, **kwargs)
        return out, lse, None

    import sys

    fai = sys.modules[real.__module__]
    _swap(fai, lib.forward.name, three, adapter)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{version}: {lib.forward.name} returned 3 values"):
        local_attention(q, q, q, backend=name)


@pytest.mark.parametrize("release", [RELEASES[3]], indirect=True, ids=IDS[3:])
def test_fa4_without_return_lse_is_refused(release):
    """Without ``return_lse`` FA4 gives no lse outside autograd: refused, not guessed."""
    _, name, adapter = release
    lib = adapter.library()
    real = lib.forward.fn
    import inspect
    import sys

    def no_lse(**kwargs):
        return real(**kwargs)

    params = [p for p in inspect.signature(real).parameters.values() if p.name != "return_lse"]
    no_lse.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    _swap(sys.modules[real.__module__], lib.forward.name, no_lse, adapter)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"does not take \['return_lse'\]"):
        local_attention(q, q, q, backend=name)


def test_missing_installs_name_the_package():
    uninstall()
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'flash_attn3' needs FlashAttention-3 .*hopper"):
        local_attention(q, q, q, backend="flash_attn3")
    with pytest.raises(ValueError, match=r"'flash_attn4' needs .*pip install flash-attn-4"):
        local_attention(q, q, q, backend="flash_attn4")


# ---------------------------------------------------------------- "auto"


@pytest.fixture
def imports(monkeypatch):
    """Pretend which libraries import: ``imports(flash_attn3="not installed", ...)``."""

    def set_(**problems):
        for name in backends._IMPORTS:
            problem = problems.get(name)
            monkeypatch.setitem(backends._IMPORTS, name, lambda p=problem: p)

    return set_


def test_auto_order_by_device(imports):
    bf16, hopper, blackwell, ampere = torch.bfloat16, (9, 0), (10, 0), (8, 6)
    choose = backends.auto_choice
    imports()  # all three import
    assert choose("cuda", bf16, 128, hopper)[0] == "flash_attn3"
    assert choose("cuda", bf16, 128, blackwell)[0] == "flash_attn4"
    assert choose("cuda", bf16, 128, ampere)[0] == "flash_attn"
    assert choose("cuda", bf16, 128, (7, 5))[0] == "torch"
    assert choose("cpu", bf16, 128, (0, 0))[0] == "torch"
    assert choose("cuda", torch.float32, 128, hopper)[0] == "torch"
    # head dims: FA4 on sm100 takes DeepSeek's (192, 128) but not 192 values
    assert choose("cuda", bf16, 192, blackwell, 128)[0] == "flash_attn4"
    choice, why = choose("cuda", bf16, 192, blackwell, 192)
    assert choice == "torch" and "(192, 192): sm100 takes" in why[0]
    assert choose("cuda", bf16, 512, hopper)[0] == "torch"
    imports(flash_attn3="FA3 not installed")
    choice, why = choose("cuda", bf16, 128, hopper)
    assert choice == "flash_attn4" and why == ["not flash_attn3: FA3 not installed"]
    imports(flash_attn3="no", flash_attn4="no")
    assert choose("cuda", bf16, 128, hopper)[0] == "torch"  # cuDNN, not flash-attn 2
    imports(flash_attn="no")
    assert choose("cuda", bf16, 128, ampere)[0] == "torch"
    assert choose("cuda", bf16, 128, blackwell)[0] == "flash_attn4"


def test_each_library_only_where_it_runs(imports):
    imports()
    bf16 = torch.bfloat16
    unusable = backends.backend_unusable
    assert "sm90 only" in unusable("flash_attn3", "cuda", bf16, 128, (10, 0))
    assert "sm90 only" in unusable("flash_attn3", "cuda", bf16, 128, (8, 0))
    assert unusable("flash_attn3", "cuda", torch.float16, 256, (9, 0)) is None
    assert "capability 8.0" in unusable("flash_attn4", "cuda", bf16, 128, (8, 0))
    assert unusable("flash_attn4", "cuda", bf16, 256, (9, 0)) is None
    assert unusable("flash_attn4", "cuda", bf16, 256, (10, 0)) is None  # its hd256 kernel
    assert "float32" in unusable("flash_attn4", "cuda", torch.float32, 64, (10, 0))
    assert unusable("torch", "cpu", torch.float64, 999, (0, 0)) is None
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    assert backends.resolve_backend("auto", q) == "torch"  # a CPU tensor
    for row in backends.AUTO_ORDER.values():
        assert row[-1] == "torch" and set(row) <= set(backends.BACKENDS)


# ---------------------------------------------------------------- every mode, 4 ranks


def _modes(rank, version, name):
    from tests.support.helpers import sharded_run, topology

    use(version)
    try:
        N, hq, hkv, d = 64, 8, 2, 24
        q, k, v, do = make(1, N, hq, hkv, d, seed=3)
        rows = []
        for u, r in ((4, 1), (1, 4), (2, 2)):
            for layout in ("zigzag", "contiguous"):
                topo = topology(u, r, layout)
                for cu in (None, torch.tensor([0, 16, 40, 64], dtype=torch.int32)):
                    bounds = None if cu is None else cu.tolist()
                    ref = reference(q, k, v, do, True, bounds=bounds)
                    low = (t.to(torch.bfloat16) for t in (q, k, v, do))
                    kw = dict(layout=layout, backend=name, cu_seqlens=cu)
                    got = sharded_run(*low, topo, **kw)[:4]
                    rows.append(
                        (u, r, layout, cu is not None, [rel_err(a, b) for a, b in zip(got, ref)])
                    )
        return rows
    finally:
        uninstall()
