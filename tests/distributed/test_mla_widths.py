"""Values of their own head dim (MLA: DeepSeek-V3's q/k heads are 128 + 64 RoPE = 192 wide,
its values 128), exact in every mode, layout, packing, window and head-chunk setting.

Reference: float64 attention on the full tensors (``tests.support.helpers.reference``), which
takes any value width. The cases use q/k 12 and v 8 wide, DeepSeek-V3's 3:2, and the
other way round (v wider than q/k). The all-to-all and the ring carry V at its own width:
the bytes sent are counted and compared with the formula."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_compile import compiled_equals_eager
from tests.support.helpers import attend_and_check, make_qkv, reference, topology
from tests.unit.test_flash_contract import install, rel_err, uninstall
from ulysses_cp.plan.comm import forward_comm_bytes

MODES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
MLA = (12, 8)  # q/k head dim, v head dim: DeepSeek-V3's 192/128 in proportion


@pytest.mark.parametrize("u,r", MODES)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_narrower_values_match_float64_in_every_mode(pools, u, r, layout):
    attend_and_check(pools, u, r, layout, seed=5, hq=4, hkv=2, widths=MLA, backend="math")


@pytest.mark.parametrize("u,r", [(2, 1), (1, 2), (2, 2)])
def test_wider_values_match_float64(pools, u, r):
    attend_and_check(pools, u, r, seed=6, hq=4, hkv=4, widths=(8, 12), backend="math")


@pytest.mark.parametrize("u,r", [(4, 1), (1, 4), (2, 2)])
def test_packed_rows_and_windows(pools, u, r):
    bounds = [0, 8, 32, 40, 64]  # every document a multiple of 2P = 8
    kw = dict(seed=7, hq=8, hkv=2, widths=MLA, backend="math")
    attend_and_check(pools, u, r, bounds=bounds, **kw)
    attend_and_check(pools, u, r, window=(5, 0), sinks=True, **kw)


@pytest.mark.parametrize(
    "options",
    [
        {"head_chunks": 2},
        {"head_chunks": 2, "redo_all_to_all": True},
        {"kv_exchange": "allgather"},
    ],
)
def test_head_chunks_redo_and_allgather(pools, options):
    attend_and_check(pools, 2, 2, seed=8, hq=8, hkv=4, widths=MLA, backend="math", options=options)


@pytest.mark.parametrize("u,r", [(1, 1), (2, 2)])
def test_torch_backend_pads_values_to_one_width(pools, u, r):
    """torch's fused kernels take one head dim: the values go in padded, come out cut."""
    attend_and_check(pools, u, r, seed=9, hq=4, hkv=2, widths=MLA, backend="torch")
    attend_and_check(pools, u, r, seed=9, hq=4, hkv=2, widths=(8, 12), backend="torch")


@pytest.mark.parametrize("u,r", [(2, 1), (1, 2)], ids=str)
def test_bytes_carry_values_at_their_width(pools, u, r):
    """Ulysses 2: q, k and v go out in one all-to-all, the output comes back in another,
    each rank sending half of every tensor it holds. Ring 2: one kv block per forward step.
    V and the output at 8 wide, as the planner's formula says."""
    results = attend_and_check(pools, u, r, seed=10, hq=4, hkv=4, widths=MLA, backend="math")
    b, s_l, h, (d, dv), item = 2, 16, 4, MLA, 8
    a2a = b * s_l * h * (2 * d + 2 * dv) * item // 2 if u > 1 else 0
    ring = b * s_l * h * (d + dv) * item if r > 1 else 0
    planned = forward_comm_bytes(
        batch=b,
        seq_len=2 * s_l,
        hq=h,
        hkv=h,
        head_dim=(d, dv),
        ulysses_degree=u,
        ring_degree=r,
        bytes_per_element=item,
    )
    assert planned == (a2a, ring)
    for _, sent in results:
        assert sent.get("all_to_all/forward", 0) == a2a, sent
        assert sent.get("ring/forward", 0) == ring, sent


def _compiled_widths(rank: int) -> bool:
    """The compiled Ulysses path (traced all-to-alls, ``fullgraph=True``) with values 8 wide
    and q/k 12: equal to eager, gradients included."""
    shapes = ((2, 8, 4, 12), (2, 8, 2, 12), (2, 8, 2, 8))
    out = compiled_equals_eager(rank, topology(2, 1), shapes)
    assert out.shape == (2, 8, 4, 8)
    return True


def test_compiled_ulysses_carries_values_at_their_width(pools):
    assert pools(2).run(_compiled_widths) == [True, True]


# ---------------------------------------------------------------- flash-attn 2 (stand-ins)


def _flash_modes(rank: int) -> list[float]:
    """flash-attn 2.8.3's stand-in at u2 x r2, dense and packed, bf16, MLA widths: the
    largest relative error of out and the gradients against float64, per case."""
    from tests.support.helpers import sharded_run

    install("2.8.3", "custom_op")
    try:
        q, k, v, do = make_qkv(seed=4, b=1, s=64, hq=8, hkv=2, d=24, dv=16)
        errs = []
        for cu in (None, torch.tensor([0, 16, 48, 64], dtype=torch.int32)):
            bounds = None if cu is None else cu.tolist()
            ref = reference(q, k, v, do, bounds=bounds)[:4]
            low = (t.to(torch.bfloat16) for t in (q, k, v, do))
            got = sharded_run(*low, topology(2, 2), backend="flash_attn", cu_seqlens=cu)[:4]
            errs.append(max(rel_err(a, b) for a, b in zip(got, ref)))
        return errs
    finally:
        uninstall()


def test_flash_attn_2_takes_values_padded_in_every_mode(pools):
    """flash-attn 2 takes one head dim for q, k and v (its stand-in refuses others, as the
    release does): the values reach it padded to 24 and come back 16 wide."""
    for err in pools(4).run(_flash_modes)[0]:
        assert err < 3e-2, err
