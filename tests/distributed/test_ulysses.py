"""Ulysses attention equals full float64 attention: outputs and dq/dk/dv."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import TOL64, make_qkv, reference, sharded_run, topology

# (hq, hkv): MHA, GQA with hkv >= 4, GQA with hkv < P for P=4, MQA
HEADS = [(8, 8), (8, 4), (8, 2), (4, 1)]


def _check_float64(rank, u, hq, hkv, causal, layout, backend):
    topo = topology(u, 1, layout)
    q, k, v, dout = make_qkv(seed=7, b=2, s=32, hq=hq, hkv=hkv, d=24)
    got = sharded_run(q, k, v, dout, topo, causal=causal, layout=layout, backend=backend)[:4]
    ref = reference(q, k, v, dout, causal)
    errs = []
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g, r, **TOL64, msg=lambda m, n=name: f"{n}: {m}")
        errs.append((g - r).abs().max().item())
    return errs


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ulysses_matches_full_attention_float64(pools, P, hq, hkv, causal, layout):
    pools(P).run(_check_float64, P, hq, hkv, causal, layout, "math")


@pytest.mark.parametrize("P", [2, 4])
def test_ulysses_float64_torch_backend(pools, P):
    pools(P).run(_check_float64, P, 8, 2, True, "zigzag", "torch")


def _check_low_precision(rank, u, dtype, causal, layout):
    topo = topology(u, 1, layout)
    q, k, v, dout = make_qkv(seed=11, b=2, s=64, hq=8, hkv=4, d=40, dtype=dtype)
    got = sharded_run(q, k, v, dout, topo, causal=causal, layout=layout, backend="torch")[:4]
    ref = reference(q, k, v, dout, causal)
    tol = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[
        dtype
    ]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_low_precision_torch_backend(pools, dtype, causal):
    pools(4).run(_check_low_precision, 4, dtype, causal, "zigzag")


def _check_dp_x_ulysses(rank, causal):
    topo = topology(2, 1)
    assert (topo.dp_degree, topo.sp_world_size) == (2, 2)
    # each data-parallel replica gets its own data
    q, k, v, dout = make_qkv(seed=100 + topo.dp_rank, b=2, s=16, hq=4, hkv=2, d=12)
    got = sharded_run(q, k, v, dout, topo, causal=causal, layout="zigzag", backend="math")[:4]
    ref = reference(q, k, v, dout, causal)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL64)
    return topo.dp_rank, got[0].sum().item()


@pytest.mark.parametrize("causal", [True, False])
def test_data_parallel_times_ulysses(pools, causal):
    res = pools(4).run(_check_dp_x_ulysses, causal)
    assert [r[0] for r in res] == [0, 0, 1, 1]
    # the two replicas really computed different data
    assert res[0][1] == res[1][1] and res[0][1] != res[2][1]


def _check_softmax_scale(rank):
    topo = topology(2, 1, "contiguous")
    q, k, v, dout = make_qkv(seed=5, b=1, s=16, hq=4, hkv=4, d=8)
    got = sharded_run(
        q, k, v, dout, topo, causal=True, layout="contiguous", backend="torch", softmax_scale=0.3
    )[:4]
    ref = reference(q, k, v, dout, True, softmax_scale=0.3)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL64)


def test_softmax_scale_is_used(pools):
    pools(2).run(_check_softmax_scale)


def _check_padding(rank, layout):
    """End padding (causal) leaves the real tokens' outputs and grads unchanged."""
    topo = topology(4, 1, layout)
    q, k, v, dout = make_qkv(seed=9, b=2, s=21, hq=4, hkv=2, d=8)
    m = ucp.sequence_multiple(topo.sp_world_size, layout)
    padded = [ucp.pad_to_multiple(t, m) for t in (q, k, v)]
    dpad = ucp.pad_to_multiple(dout, m)
    assert padded[0].shape[1] % m == 0
    got = sharded_run(*padded, dpad, topo, causal=True, layout=layout, backend="math")[:4]
    ref = reference(q, k, v, dout, True)[:4]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g[:, :21], r, **TOL64)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_padding_does_not_change_results(pools, layout):
    pools(4).run(_check_padding, layout)
