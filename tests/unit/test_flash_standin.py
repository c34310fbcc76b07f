"""The flash-attn stand-ins (tests/support/flash_standin): each release's interface, and the kernels
against a float64 reference built here with plain ``torch.softmax``."""

from __future__ import annotations

import ast
import inspect
import math
from typing import Optional, Tuple  # noqa: UP035 - the releases' own hints

import pytest
import torch

from tests.support import flash_standin as fs

NAMES = ("_flash_attn_forward", "_flash_attn_varlen_forward")
NAMES += ("_flash_attn_backward", "_flash_attn_varlen_backward")
# Parameter lists copied from flash_attn/flash_attn_interface.py at each tag (name=default).
SIGNATURES = {
    "2.6.0": (
        "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes return_softmax",
        "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale"
        " causal window_size softcap alibi_slopes return_softmax block_table",
        "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size softcap"
        " alibi_slopes deterministic rng_state=None",
        "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
        " dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic"
        " rng_state=None",
    ),
    "2.7.4": (
        "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap"
        " alibi_slopes return_softmax",
        "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale"
        " causal window_size_left=-1 window_size_right=-1 softcap=0.0 alibi_slopes=None"
        " return_softmax=False block_table=None leftpad_k=None seqused_k=None zero_tensors=False",
        "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left"
        " window_size_right softcap alibi_slopes deterministic rng_state=None",
        "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k"
        " dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes"
        " deterministic rng_state=None zero_tensors=False",
    ),
}
SIGNATURES["2.8.3"] = SIGNATURES["2.7.4"]  # the four functions are identical in the two tags
_T = torch.Tensor
_HINT_GROUPS = {
    _T: "q k v dout out softmax_lse cu_seqlens_q cu_seqlens_k",
    Optional[_T]: "dq dk dv alibi_slopes block_table leftpad_k seqused_k rng_state",  # noqa: UP045
    int: "window_size_left window_size_right max_seqlen_q max_seqlen_k",
    float: "dropout_p softmax_scale softcap",
    bool: "causal return_softmax deterministic zero_tensors",
}
HINTS = {name: hint for hint, names in _HINT_GROUPS.items() for name in names.split()}
# The C++ extension's positional parameters (flash_api.cpp mha_fwd, mha_varlen_fwd, mha_bwd,
# mha_varlen_bwd); 2.6.0's mha_varlen_fwd has no leftpad_k_.
CPP = (
    "q k v out_ alibi_slopes_ p_dropout softmax_scale is_causal window_size_left"
    " window_size_right softcap return_softmax gen_",
    "q k v out_ cu_seqlens_q cu_seqlens_k seqused_k leftpad_k_ block_table_ alibi_slopes_"
    " max_seqlen_q max_seqlen_k p_dropout softmax_scale zero_tensors is_causal window_size_left"
    " window_size_right softcap return_softmax gen_",
    "dout q k v out softmax_lse dq_ dk_ dv_ alibi_slopes_ p_dropout softmax_scale is_causal"
    " window_size_left window_size_right softcap deterministic gen_ rng_state",
    "dout q k v out softmax_lse dq_ dk_ dv_ cu_seqlens_q cu_seqlens_k alibi_slopes_ max_seqlen_q"
    " max_seqlen_k p_dropout softmax_scale zero_tensors is_causal window_size_left"
    " window_size_right softcap deterministic gen_ rng_state",
)
CONFIGS = [("2.6.0", "plain"), ("2.7.4", "custom_op"), ("2.7.4", "plain")]
CONFIGS += [("2.8.3", "custom_op"), ("2.8.3", "plain")]


def _params(spec: str) -> list[tuple[str, object]]:
    out = []
    for tok in spec.split():
        name, _, default = tok.partition("=")
        out.append((name, ast.literal_eval(default) if default else inspect.Parameter.empty))
    return out


_CACHE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_standins():
    yield
    fs.unuse()
    _CACHE.clear()


def fai(version: str, wrap: str):
    """That release's flash_attn_interface (imported once per config in this module)."""
    if (version, wrap) not in _CACHE:
        fa = fs.use(version, wrap)
        assert fa.__version__ == version
        _CACHE[version, wrap] = fa.flash_attn_interface
    return _CACHE[version, wrap]


# ----------------------------------------------------------------------------- interfaces


@pytest.mark.parametrize("version,wrap", CONFIGS)
def test_signatures(version, wrap):
    mod = fai(version, wrap)
    for name, spec in zip(NAMES, SIGNATURES[version]):
        fn = getattr(mod, name)
        want = _params(spec)
        if version != "2.6.0" and wrap == "custom_op":
            assert isinstance(fn, torch._library.custom_ops.CustomOpDef)
            # The trap for callers that read the signature: a custom op shows (*args, **kwargs).
            assert str(inspect.signature(fn)) == "(*args, **kwargs)"
            schema = fn._opoverload._schema
            got = [(a.name, a.default_value) for a in schema.arguments]
            assert got == [(n, None if d is inspect.Parameter.empty else d) for n, d in want]
            written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
            assert written == ({"dq", "dk", "dv"} if "backward" in name else set())
            wrapped = getattr(mod, "_wrapped" + name)
            assert wrapped is getattr(getattr(torch.ops, schema.name.split("::")[0]), name)
            fn = fn._init_fn
        else:
            assert inspect.isfunction(fn)
            if version != "2.6.0":
                assert getattr(mod, "_wrapped" + name) is fn
        sig = inspect.signature(fn)
        assert [(p.name, p.default) for p in sig.parameters.values()] == want
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
        if version == "2.6.0":
            assert all(p.annotation is p.empty for p in sig.parameters.values())
        else:
            assert {p.name: p.annotation for p in sig.parameters.values()} == {
                n: HINTS[n] for n in sig.parameters
            }
            ret = Tuple[_T, _T, _T, _T] if "forward" in name else _T  # noqa: UP006
            assert sig.return_annotation == ret


@pytest.mark.parametrize("version", fs.VERSIONS)
def test_extension_shim_arguments(version):
    mod = fai(version, "plain")
    ext = mod.flash_attn_cuda if version == "2.6.0" else mod.flash_attn_gpu
    for fn, spec in zip((ext.fwd, ext.varlen_fwd, ext.bwd, ext.varlen_bwd), CPP):
        if version == "2.6.0":
            spec = spec.replace(" leftpad_k_", "")
        assert list(inspect.signature(fn).parameters) == spec.split()


def test_namespaces_are_fresh_per_import():
    a = fs.use("2.7.4").flash_attn_interface
    b = fs.use("2.7.4").flash_attn_interface
    c = fs.use("2.8.3").flash_attn_interface
    names = {m._flash_attn_forward._opoverload._schema.name for m in (a, b, c)}
    assert len(names) == 3
    q = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
    outs = [
        m._flash_attn_forward(q, q, q, 0.0, 1.0, True, -1, -1, 0.0, None, False) for m in (a, c)
    ]
    torch.testing.assert_close(outs[0][0], outs[1][0])


def test_custom_op_passes_opcheck():
    mod = fai("2.8.3", "custom_op")
    q, k, v = (torch.randn(2, 5, h, 16, dtype=torch.bfloat16) for h in (4, 2, 2))
    args = (q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    out, lse, _, _ = mod._flash_attn_forward(*args)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(mod._flash_attn_forward, args, test_utils=tests)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    bwd_args = (out, q, k, v, out, lse, *grads, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(mod._flash_attn_backward, bwd_args, test_utils=tests)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    args = (q[0], k[0], v[0], cu, cu, 3, 3, 0.0, 0.25, True)
    out, lse, _, _ = mod._flash_attn_varlen_forward(*args)
    torch.library.opcheck(mod._flash_attn_varlen_forward, args, test_utils=tests)
    bwd_args = (out, q[0], k[0], v[0], out, lse, None, None, None, cu, cu, 3, 3, 0.0, 0.25, True)
    bwd_args += (-1, -1, 0.0, None, False)
    torch.library.opcheck(mod._flash_attn_varlen_backward, bwd_args, test_utils=tests)


# ------------------------------------------------------------------------ float64 reference


def reference(q, k, v, dout, scale, causal, window, softcap, max_seqlen_k=None):
    """One document, (s, h, d): out, lse (h, sq), dq, dk, dv in float64, by plain softmax.

    flash_api.cpp treats a window side >= seqlen_k (varlen: max_seqlen_k) as unbounded."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    kx, vx = (t[:, torch.arange(hq) // (hq // hkv)] for t in (k, v))  # GQA: head i -> i // g
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    row, col = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]  # bottom-right
    left, right = (-1 if w >= (max_seqlen_k or sk) else w for w in window)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= col <= row
    if left >= 0:
        vis &= col >= row - left
    if right >= 0:
        vis &= col <= row + right
    p = torch.softmax(s.masked_fill(~vis, -1e30), dim=-1) * vis  # empty rows: p = 0
    out = torch.einsum("hqk,khd->qhd", p, vx)
    lse = torch.logsumexp(s.masked_fill(~vis, -math.inf), dim=-1)
    lse = lse.masked_fill(~vis.any(-1), math.inf)  # flash-attn: +inf for a row with no key
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


# (b, sq, sk, hq, hkv, d, causal, window, softcap, scale)
DENSE = {
    "plain": (2, 6, 6, 2, 2, 16, False, (-1, -1), 0.0, 0.25),
    "causal": (2, 6, 6, 2, 2, 16, True, (-1, -1), 0.0, 0.25),
    "causal_sq<sk": (1, 3, 8, 4, 2, 32, True, (-1, -1), 0.0, 0.2),
    "causal_sq>sk": (2, 8, 3, 4, 2, 16, True, (-1, -1), 0.0, 0.25),  # rows 0..4 see nothing
    "gqa": (2, 5, 7, 6, 2, 8, False, (-1, -1), 0.0, 0.3),
    "window": (1, 9, 9, 2, 1, 16, False, (2, 1), 0.0, 0.25),
    "window_causal_sq!=sk": (1, 5, 9, 2, 2, 16, True, (3, -1), 0.0, 0.25),
    "softcap": (2, 6, 6, 2, 2, 16, True, (-1, -1), 2.0, 1.0),
    "window>=sk": (1, 8, 3, 2, 2, 16, False, (-1, 3), 0.0, 0.25),  # right 3 >= sk: unbounded
}
VARLEN = {  # cu_seqlens_q, cu_seqlens_k, hq, hkv, d, causal, window, softcap, scale
    "causal": ([0, 3, 8, 12], [0, 5, 8, 14], 4, 2, 16, True, (-1, -1), 0.0, 0.25),
    "plain_gqa": ([0, 4, 5, 11], [0, 2, 9, 11], 6, 3, 8, False, (-1, -1), 0.0, 0.3),
    "window_softcap": ([0, 7, 13], [0, 7, 13], 2, 1, 16, True, (2, -1), 3.0, 0.5),
    "window_vs_max_k": ([0, 6, 8], [0, 2, 8], 2, 2, 8, False, (-1, 3), 0.0, 0.5),  # 3 < max_k 6
}
TOL = dict(atol=2e-2, rtol=2e-2)


def _window_kw(version, window):
    if version == "2.6.0":
        return {"window_size": window}
    return {"window_size_left": window[0], "window_size_right": window[1]}


def _fwd(mod, version, q, k, v, scale, causal, window, softcap, cu=None):
    kw = dict(softmax_scale=scale, causal=causal, softcap=softcap, alibi_slopes=None)
    kw |= dict(return_softmax=False, **_window_kw(version, window))
    if cu is None:
        res = mod._flash_attn_forward(q, k, v, 0.0, **kw)
    else:
        mq, mk = (int((c[1:] - c[:-1]).max()) for c in cu)
        extra = {"block_table": None} if version == "2.6.0" else {}
        res = mod._flash_attn_varlen_forward(q, k, v, *cu, mq, mk, 0.0, **kw, **extra)
    assert len(res) == (8 if version == "2.6.0" else 4)
    return (res[0], res[5]) if version == "2.6.0" else (res[0], res[1])


def _bwd(mod, version, dout, q, k, v, out, lse, grads, scale, causal, window, softcap, cu=None):
    kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=softcap)
    kw |= dict(alibi_slopes=None, deterministic=False, **_window_kw(version, window))
    if cu is None:
        res = mod._flash_attn_backward(dout, q, k, v, out, lse, *grads, **kw)
    else:
        mq, mk = (int((c[1:] - c[:-1]).max()) for c in cu)
        kw |= dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=mq, max_seqlen_k=mk)
        res = mod._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, **kw)
    if version == "2.6.0":
        assert len(res) == 4
        return res[3]
    assert isinstance(res, torch.Tensor)
    return res


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(DENSE))
@pytest.mark.parametrize("version,wrap", CONFIGS)
def test_dense_matches_reference(version, wrap, case, dtype):
    b, sq, sk, hq, hkv, d, causal, window, softcap, scale = DENSE[case]
    mod = fai(version, wrap)
    torch.manual_seed(0)
    q, k, v = _randn(b, sq, hq, d, dtype=dtype), *(_randn(b, sk, hkv, d, dtype=dtype) for _ in "kv")
    dout = _randn(b, sq, hq, d, dtype=dtype)
    out, lse = _fwd(mod, version, q, k, v, scale, causal, window, softcap)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    ptrs = [g.data_ptr() for g in grads]
    softmax_d = _bwd(mod, version, dout, q, k, v, out, lse, grads, scale, causal, window, softcap)
    assert softmax_d.shape == (b, hq, -(-sq // 128) * 128) and softmax_d.dtype == torch.float32
    assert [g.data_ptr() for g in grads] == ptrs  # written in place
    for i in range(b):
        ref = reference(q[i], k[i], v[i], dout[i], scale, causal, window, softcap)
        torch.testing.assert_close(out[i].double(), ref[0], **TOL)
        torch.testing.assert_close(lse[i].double(), ref[1], **TOL)
        for g, r in zip(grads, ref[2:]):
            torch.testing.assert_close(g[i].double(), r, **TOL)
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[..., :sq], delta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(VARLEN))
@pytest.mark.parametrize("version,wrap", CONFIGS)
def test_varlen_matches_reference(version, wrap, case, dtype):
    cu_q, cu_k, hq, hkv, d, causal, window, softcap, scale = VARLEN[case]
    mod = fai(version, wrap)
    torch.manual_seed(1)
    cu = tuple(torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    q, dout = (_randn(cu_q[-1], hq, d, dtype=dtype) for _ in "qo")
    k, v = (_randn(cu_k[-1], hkv, d, dtype=dtype) for _ in "kv")
    out, lse = _fwd(mod, version, q, k, v, scale, causal, window, softcap, cu)
    assert lse.shape == (hq, cu_q[-1]) and lse.dtype == torch.float32
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    softmax_d = _bwd(
        mod, version, dout, q, k, v, out, lse, grads, scale, causal, window, softcap, cu
    )
    assert softmax_d.shape == (hq, cu_q[-1] + 128 * (len(cu_q) - 1))
    max_k = int((cu[1][1:] - cu[1][:-1]).max())
    for i, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        ref = reference(
            q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1], scale, causal, window, softcap, max_k
        )
        torch.testing.assert_close(out[q0:q1].double(), ref[0], **TOL)
        delta = (dout[q0:q1].float() * out[q0:q1].float()).sum(-1).t()
        torch.testing.assert_close(softmax_d[:, q0 + 128 * i : q1 + 128 * i], delta)
        torch.testing.assert_close(lse[:, q0:q1].double(), ref[1], **TOL)
        for g, r in zip(grads, (ref[2], ref[3], ref[4])):
            rows = slice(q0, q1) if g is grads[0] else slice(k0, k1)
            torch.testing.assert_close(g[rows].double(), r, **TOL)


# ---------------------------------------------------------------- layout, in-place, errors


def test_backward_treats_minus_inf_lse_as_zero():
    """A row with lse -inf (e.g. from zero_tensors) is read as the kernel does (max -inf -> 0):
    masked entries give p = 0, not NaN."""
    mod = fai("2.7.4", "plain")
    q, k, v, dout = (_randn(1, 6, 2, 8, dtype=torch.bfloat16) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # sq 6 > sk 2, causal: rows 0..3 see no key, lse +inf
    out, lse = _fwd(mod, "2.7.4", q, k, v, 0.5, True, (-1, -1), 0.0)
    assert torch.isinf(lse[..., :4]).all() and (lse[..., :4] > 0).all()
    assert not out[:, :4].any()
    grads = []
    for l in (lse, lse.masked_fill(torch.isinf(lse), -math.inf)):
        g = [torch.empty_like(t) for t in (q, k, v)]
        _bwd(mod, "2.7.4", dout, q, k, v, out, l, g, 0.5, True, (-1, -1), 0.0)
        grads.append(g)
    for a, b in zip(*grads):
        assert not b.isnan().any()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("version,wrap", CONFIGS)
def test_non_contiguous_lse_gives_wrong_gradients(version, wrap):
    """The backward reads lse through its data pointer, like the CUDA kernel."""
    mod = fai(version, wrap)
    torch.manual_seed(2)
    q, k, v, dout = (_randn(2, 6, 4, 16, dtype=torch.bfloat16) for _ in range(4))
    out, lse = _fwd(mod, version, q, k, v, 0.25, True, (-1, -1), 0.0)
    shuffled = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout
    assert torch.equal(shuffled, lse) and not shuffled.is_contiguous()
    dq = []
    for l in (lse, shuffled, shuffled.contiguous()):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        _bwd(mod, version, dout, q, k, v, out, l, grads, 0.25, True, (-1, -1), 0.0)
        dq.append(grads[0].float())
    assert (dq[1] - dq[0]).abs().max() > 0.1
    torch.testing.assert_close(dq[2], dq[0])
    cu = (torch.tensor([0, 5, 12], dtype=torch.int32),) * 2
    q, k, v, dout = (t.reshape(12, 4, 16) for t in (q, k, v, dout))
    out, lse = _fwd(mod, version, q, k, v, 0.25, True, (-1, -1), 0.0, cu)
    dq = []
    for l in (lse, lse.t().contiguous().t()):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        _bwd(mod, version, dout, q, k, v, out, l, grads, 0.25, True, (-1, -1), 0.0, cu)
        dq.append(grads[0].float())
    assert (dq[1] - dq[0]).abs().max() > 0.1


def test_v26_pads_the_head_dim_itself():
    mod = fai("2.6.0", "plain")
    torch.manual_seed(3)
    q, k, v, dout = (_randn(1, 5, 2, 12, dtype=torch.bfloat16) for _ in range(4))
    res = mod._flash_attn_forward(q, k, v, 0.0, 0.3, True, (-1, -1), 0.0, None, False)
    out, qp, kp, vp, out_padded, lse = res[:6]
    assert out.shape[-1] == 12 and all(t.shape[-1] == 16 for t in (qp, kp, vp, out_padded))
    assert torch.equal(qp[..., :12], q) and not qp[..., 12:].any()
    grads = [torch.empty_like(t) for t in (qp, kp, vp)]
    dq, dk, dv, _ = mod._flash_attn_backward(
        dout, qp, kp, vp, out_padded, lse, *grads, 0.0, 0.3, True, (-1, -1), 0.0, None, False
    )
    assert dq.shape[-1] == 12 and dq.data_ptr() == grads[0].data_ptr()
    res = mod._flash_attn_forward(qp, kp, vp, 0.0, 0.3, True, (-1, -1), 0.0, None, False)
    assert res[0] is res[4] and res[1] is qp  # no padding: the same tensors come back
    ref = reference(q[0], k[0], v[0], dout[0], 0.3, True, (-1, -1), 0.0)
    torch.testing.assert_close(out[0].double(), ref[0], **TOL)
    for g, r in zip((dq, dk, dv), ref[2:]):
        torch.testing.assert_close(g[0].double(), r, **TOL)
    # returned grads: views of the given (padded) tensors; fresh ones when None
    dq2, *_ = mod._flash_attn_backward(
        dout,
        qp,
        kp,
        vp,
        out_padded,
        lse,
        None,
        None,
        None,
        0.0,
        0.3,
        True,
        (-1, -1),
        0.0,
        None,
        False,
    )
    torch.testing.assert_close(dq2, dq)


def _raises(exc, match, fn, *args):
    with pytest.raises(exc, match=match):
        fn(*args)


@pytest.mark.parametrize("version", fs.VERSIONS)
def test_checks_and_messages(version):
    mod = fai(version, "plain")
    w = ((-1, -1),) if version == "2.6.0" else (-1, -1)

    def fwd(q, k, v, dropout=0.0, alibi=None):
        return mod._flash_attn_forward(q, k, v, dropout, 0.25, False, *w, 0.0, alibi, False)

    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    _raises(RuntimeError, "only support fp16 and bf16 data type", fwd, x.float(), x, x)
    _raises(RuntimeError, "query and key must have the same dtype", fwd, x, x.half(), x)
    _raises(RuntimeError, "query and value must have the same dtype", fwd, x, x, x.half())
    _raises(RuntimeError, "must divide number of heads", fwd, x, *[x.repeat(1, 1, 3, 1)] * 2)
    big = torch.zeros(1, 2, 1, 264, dtype=torch.bfloat16)
    _raises(RuntimeError, "head dimension at most 256", fwd, big, big, big)
    odd = torch.zeros(1, 2, 1, 12, dtype=torch.bfloat16)
    if version == "2.6.0":
        fwd(odd, odd, odd)  # the 2.6 C++ pads it
    else:
        _raises(RuntimeError, "head_size that is a multiple of 8", fwd, odd, odd, odd)
    _raises(NotImplementedError, "stand-in: dropout not supported", fwd, x, x, x, 0.1)
    alibi = torch.zeros(2)
    _raises(NotImplementedError, "stand-in: alibi_slopes not supported", fwd, x, x, x, 0.0, alibi)
    # a last dim that is not contiguous: the Python makes it so, the extension refuses it
    t = torch.randn(1, 4, 16, 2, dtype=torch.bfloat16).transpose(-1, -2)
    fwd(t, t, t)
    ext = mod.flash_attn_cuda if version == "2.6.0" else mod.flash_attn_gpu
    args = (t, x, x, None, None, 0.0, 0.25, False, -1, -1, 0.0, False, None)
    _raises(RuntimeError, "Input tensor must have contiguous last dimension", ext.fwd, *args)
    cu = torch.tensor([0, 4])  # int64
    args = (x[0], x[0], x[0], cu, cu, 4, 4, 0.0, 0.25, False, *w, 0.0, None, False)
    args += (None,) if version == "2.6.0" else ()  # block_table: required in 2.6.0
    varlen_fwd = mod._flash_attn_varlen_forward
    _raises(RuntimeError, "cu_seqlens_q must have dtype int32", varlen_fwd, *args)
    args = (x[0], x[0], x[0], cu.int(), cu.int(), 3, 4, *args[7:])  # max_seqlen_q 3 < 4 rows
    _raises(RuntimeError, "longer than max_seqlen_q/k", varlen_fwd, *args)


@pytest.mark.parametrize("zero_tensors", [False, True])
def test_varlen_rows_outside_documents(zero_tensors):
    """The kernel leaves them unwritten (NaN here), or 0 / -inf with zero_tensors."""
    mod = fai("2.8.3", "custom_op")
    q = _randn(7, 2, 8, dtype=torch.float16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)  # rows 5, 6: no document
    out, lse, _, _ = mod._flash_attn_varlen_forward(
        q, q, q, cu, cu, 3, 3, 0.0, 0.3, True, zero_tensors=zero_tensors
    )
    assert out[:5].isfinite().all() and lse[:, :5].isfinite().all()
    if zero_tensors:
        assert not out[5:].any() and (lse[:, 5:] == -math.inf).all()
    else:
        assert out[5:].isnan().all() and lse[:, 5:].isnan().all()
