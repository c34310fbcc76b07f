"""Packed variable-length rows: attention stays inside documents in every mode."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import TOL64, make_qkv, reference, sharded_run, topology

MODES = [(4, 1), (1, 4), (2, 2)]  # u4, r4, hybrid u2r2

# real document lengths; every row is padded per document to the layout's multiple (8)
DOC_SETS = {
    "one": [64],  # one document spanning every rank: the unpacked case
    "length_one": [1] * 6,
    "many_short": [3, 5, 8, 2, 7, 1, 9, 4],
    "need_padding": [13, 30, 5],
    "mixed": [40, 8, 16],
}


def padded_bounds(lengths, multiple):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n + (-n % multiple))
    return cu


def packed_run(q, k, v, dout, topo, cu, *, causal, layout, backend):
    """Out and gradients of a packed row through the one runner (document-wise shards)."""
    kw = dict(causal=causal, layout=layout, backend=backend)
    return sharded_run(q, k, v, dout, topo, cu_seqlens=cu, **kw)[:4]


def _check(rank, u, r, lengths, causal, layout, hq, hkv, backend):
    topo = topology(u, r, layout)
    bounds = padded_bounds(lengths, ucp.sequence_multiple(u * r, layout))
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v, dout = make_qkv(seed=31, b=1, s=bounds[-1], hq=hq, hkv=hkv, d=16)
    real = torch.cat([torch.arange(a, a + n) for a, n in zip(bounds, lengths)])
    pad = torch.ones(bounds[-1], dtype=torch.bool)
    pad[real] = False
    dout[:, pad] = 0  # as in training: padding has no target, so no gradient flows into it
    got = packed_run(q, k, v, dout, topo, cu, causal=causal, layout=layout, backend=backend)
    ref = reference(q, k, v, dout, causal, bounds=bounds)
    errs = []
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g, x, **TOL64, msg=lambda m, n=name: f"{n}: {m}")
        errs.append((g - x).abs().max().item())
    if causal:
        # end-of-document padding changes nothing for the real tokens: compare them with
        # attention over the unpadded documents
        unpadded = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        sub = [t[:, real] for t in (q, k, v, dout)]
        ref_real = reference(*sub, causal, bounds=unpadded)
        for g, x in zip(got, ref_real[:4]):
            torch.testing.assert_close(g[:, real], x, **TOL64)
    return errs


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("docs", list(DOC_SETS))
@pytest.mark.parametrize("causal", [True, False])
def test_packed_matches_masked_reference_float64(pools, u, r, docs, causal):
    pools(u * r).run(_check, u, r, DOC_SETS[docs], causal, "zigzag", 8, 2, "math")


@pytest.mark.parametrize("u,r", [(1, 4), (2, 2), (2, 1)])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 8)])
def test_packed_contiguous_layout_and_heads(pools, u, r, hq, hkv):
    pools(u * r).run(_check, u, r, DOC_SETS["mixed"], True, "contiguous", hq, hkv, "math")


@pytest.mark.parametrize("u,r", MODES)
def test_packed_torch_backend_float64(pools, u, r):
    pools(u * r).run(_check, u, r, DOC_SETS["need_padding"], True, "zigzag", 8, 2, "torch")


def _one_doc_equals_unpacked(rank, u, r):
    topo = topology(u, r)
    q, k, v, dout = make_qkv(seed=5, b=1, s=64, hq=4, hkv=2, d=8)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    packed = packed_run(q, k, v, dout, topo, cu, causal=True, layout="zigzag", backend="torch")
    ref = reference(q, k, v, dout, True)
    for a, b in zip(packed, ref[:4]):
        torch.testing.assert_close(a, b, **TOL64)
    # and the document-wise layout of one document is the unpacked layout
    assert torch.equal(ucp.shard_sequence(q, topo, cu_seqlens=cu), ucp.shard_sequence(q, topo))


@pytest.mark.parametrize("u,r", MODES)
def test_one_document_equals_unpacked(pools, u, r):
    pools(u * r).run(_one_doc_equals_unpacked, u, r)


def _leakage(rank, u, r, backend):
    """Changing document A leaves document B's outputs and gradients bit-identical."""
    topo = topology(u, r)
    bounds = [0, 24, 56, 64]  # documents A = [0, 24), B = [24, 56), C = [56, 64)
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v, dout = make_qkv(seed=9, b=1, s=64, hq=4, hkv=2, d=8)
    first = packed_run(q, k, v, dout, topo, cu, causal=True, layout="zigzag", backend=backend)
    g = torch.Generator().manual_seed(99)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :24] = torch.randn(t[:, :24].shape, generator=g, dtype=t.dtype) * 3
    second = packed_run(q2, k2, v2, dout, topo, cu, causal=True, layout="zigzag", backend=backend)
    for a, b in zip(first, second):
        assert torch.equal(a[:, 24:], b[:, 24:]), "document A leaked into B or C"
        assert not torch.equal(a[:, :24], b[:, :24])  # A itself did change


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("backend", ["math", "torch"])
def test_documents_do_not_leak(pools, u, r, backend):
    pools(u * r).run(_leakage, u, r, backend)


def _bad_packed_inputs(rank):
    topo = topology(2, 2)
    q = torch.zeros(1, 16, 4, 8)
    errors = []
    for cu, msg in (
        (torch.tensor([0, 32, 48], dtype=torch.int32), "packed row length 64"),  # wrong end
        (torch.tensor([0, 20, 64]), "not a multiple of 8"),
        (torch.tensor([0, 0, 64]), "strictly increasing"),
        (torch.tensor([0.0, 64.0]), "integer tensor"),
    ):
        with pytest.raises(ValueError, match=msg):
            ucp.attention(q, q, q, topo, cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch must be 1"):
        x = torch.zeros(2, 16, 4, 8)
        ucp.attention(x, x, x, topo, cu_seqlens=torch.tensor([0, 64]))
    errors.append(True)
    return errors


def test_bad_packed_inputs_raise_before_communicating(pools):
    assert pools(4).run(_bad_packed_inputs) == [[True]] * 4


# ------------------------------------------------------------------ no processes needed


def _derived_counts(rank, u, r, n_layers):
    """Cache misses and hits of one packed batch's forward+backward through a decoder."""
    from ulysses_cp.config import ModelConfig
    from ulysses_cp.core import derived
    from ulysses_cp.models.decoder import Decoder

    topo = topology(u, r, backend="math")
    docs = [torch.arange(2, 2 + n) for n in (13, 30, 5)]
    packed = ucp.pack_documents(docs, multiple=ucp.sequence_multiple(u * r, "zigzag"))
    local = ucp.shard_batch(packed, topo)
    torch.manual_seed(0)
    mc = ModelConfig(dim=16, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=32)
    model = Decoder(mc, ucp.Attention(topo))
    derived.cache.clear()
    logits = model(local["input_ids"], local["position_ids"], local["batch"])
    ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo).backward()
    counts = (derived.cache.misses, derived.cache.hits)
    # a new batch (its own plan, even of equal values) plans again
    again = ucp.shard_batch(packed, topo)
    before = derived.cache.misses
    model(again["input_ids"], again["position_ids"], again["batch"])
    assert derived.cache.misses > before
    return counts


@pytest.mark.parametrize("u,r", [(2, 1), (1, 2)])
def test_packed_row_plans_are_made_once_per_batch_not_per_layer(pools, u, r):
    """Bounds, permutations, document halves and kernel groups of a packed row are derived
    at the first layer and reused by the others and by every ring step and the backward."""
    one = pools(u * r).run(_derived_counts, u, r, 1)[0]
    three = pools(u * r).run(_derived_counts, u, r, 3)[0]
    assert one[0] == three[0] > 0, (one, three)  # misses: the same for 1 and 3 layers
    assert three[1] > one[1], (one, three)
