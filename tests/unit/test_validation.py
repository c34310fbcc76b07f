"""Validation that needs no processes: topology arithmetic, heads, lengths, layouts."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from ulysses_cp.core.sharding import (
    check_sequence_length,
    layout_indices,
    layout_of,
    natural_to_pairs,
    pairs_to_natural,
)
from ulysses_cp.core.topology import Topology, plan_groups, validate_degrees
from ulysses_cp.kernels.dispatch import local_attention
from ulysses_cp.modes.checks import validate_qkv
from ulysses_cp.modes.ulysses import kv_replication


def test_plan_groups_hybrid_8_ranks():
    plan = plan_groups(8, 4, 2)
    assert plan.ulysses_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.ring_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan.sp_groups == [list(range(8))]
    assert plan.dp_groups == [[i] for i in range(8)]


def test_plan_groups_data_parallel_outermost():
    plan = plan_groups(8, 2, 2)
    assert plan.dp_degree == 2
    assert plan.ulysses_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.ring_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.sp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # every rank is in exactly one group of each kind
    for groups in (plan.ulysses_groups, plan.ring_groups, plan.sp_groups, plan.dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_topology_ranks_follow_the_plan():
    for rank in range(8):
        t = Topology(rank=rank, world_size=8, ulysses_degree=2, ring_degree=2)
        plan = plan_groups(8, 2, 2)
        ring = next(g for g in plan.ring_groups if rank in g)
        uly = next(g for g in plan.ulysses_groups if rank in g)
        assert ring.index(rank) == t.ring_rank and uly.index(rank) == t.ulysses_rank
        assert t.sp_rank == t.ring_rank * 2 + t.ulysses_rank
        assert t.dp_rank == rank // 4


@pytest.mark.parametrize("world,u,r", [(6, 4, 1), (8, 3, 1), (4, 2, 4)])
def test_degrees_that_do_not_divide(world, u, r):
    with pytest.raises(ValueError) as e:
        validate_degrees(world, u, r)
    msg = str(e.value)
    assert f"ulysses_degree({u})" in msg and f"ring_degree({r})" in msg
    assert f"WORLD_SIZE({world})" in msg


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_degree_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="positive integer"):
        validate_degrees(4, bad, 1)


def test_local_topology_without_distributed():
    t = ucp.init_topology(1, 1)
    assert (t.sp_world_size, t.dp_degree, t.mode) == (1, 1, "local")
    with pytest.raises(ValueError):
        ucp.init_topology(2, 1)  # needs a world of 2


def test_the_layout_is_stated_once():
    """Every call that takes the topology uses its layout; a layout= that disagrees is an
    error naming both, never a silently different sharding."""
    assert ucp.init_topology().layout == "zigzag"
    t = ucp.init_topology(layout="contiguous")
    assert (t.layout, layout_of(t), layout_of(t, "contiguous")) == ("contiguous",) * 3
    assert t.with_layout("zigzag").layout == "zigzag" and t.layout == "contiguous"
    x = torch.zeros(1, 8, 2, 4)
    calls = {
        "shard_sequence": lambda: ucp.shard_sequence(x, t, layout="zigzag"),
        "gather_sequence": lambda: ucp.gather_sequence(x, t, layout="zigzag"),
        "attention": lambda: ucp.attention(x, x, x, t, layout="zigzag"),
        "shard_batch": lambda: ucp.shard_batch(
            {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, t, layout="zigzag"
        ),
    }
    for call in calls.values():
        with pytest.raises(
            ValueError, match="layout='zigzag' disagrees with the run's layout 'contiguous'"
        ):
            call()
    with pytest.raises(ValueError, match=r"\['zigzag', 'contiguous'\]"):
        ucp.init_topology(layout="striped")


@pytest.mark.parametrize(
    "hq,hkv,u,rep",
    [(8, 8, 4, 1), (8, 4, 4, 1), (8, 2, 4, 2), (8, 1, 8, 8), (32, 8, 8, 1), (4, 4, 1, 1)],
)
def test_kv_replication(hq, hkv, u, rep):
    assert kv_replication(hq, hkv, u) == rep


@pytest.mark.parametrize(
    "hq,hkv,u,fits", [(12, 4, 8, "[1, 2, 4, 12]"), (6, 6, 4, "[1, 2, 3, 6]"), (8, 6, 4, None)]
)
def test_heads_that_do_not_split(hq, hkv, u, fits):
    with pytest.raises(ValueError) as e:
        kv_replication(hq, hkv, u)
    msg = str(e.value)
    if fits is None:
        assert "multiple of kv heads" in msg
    else:
        assert f"ulysses_degree({u})" in msg and fits in msg and "ring_degree" in msg


def test_sequence_length_error_names_the_multiple():
    with pytest.raises(ValueError, match=r"multiple of 8; pad to 104"):
        check_sequence_length(100, 4, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of 4; pad to 12"):
        check_sequence_length(10, 4, "contiguous")
    check_sequence_length(96, 4, "zigzag")


def test_bad_layout_and_backend_list_valid_values():
    with pytest.raises(ValueError, match=r"\['zigzag', 'contiguous'\]"):
        ucp.sequence_multiple(2, "striped")
    q = torch.zeros(1, 4, 2, 8)
    valid = r"\['auto', 'flash_attn', 'flash_attn3', 'flash_attn4', 'torch', 'math'\]"
    with pytest.raises(ValueError, match=valid):
        local_attention(q, q, q, backend="cudnn")
    with pytest.raises(ValueError, match="needs flash-attn, which is not installed"):
        local_attention(q, q, q, backend="flash_attn")


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2)), "batch, seq, heads"),
        (
            ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 1, 8)),
            r"k \(1, 4, 2, 8\) and v \(1, 4, 1, 8\) must agree",
        ),
        (((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), "must agree"),
        (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "multiple of kv heads"),
    ],
)
def test_bad_shapes(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        validate_qkv(q, k, v, ucp.init_topology(), "zigzag")


def test_dtype_mismatch():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="dtypes differ"):
        ucp.attention(q, q.double(), q, ucp.init_topology())


def test_odd_local_length_in_zigzag():
    t = Topology(rank=0, world_size=2, ulysses_degree=2, ring_degree=1)
    q = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="must be even"):
        validate_qkv(q, q, q, t, "zigzag")


def test_pairs_round_trip_and_order():
    x = torch.arange(16).view(1, 16)
    # 4 ranks of zigzag over 8 chunks of 2: rank r holds chunks r and 7-r
    sharded = torch.cat([layout_indices(16, 4, r, "zigzag") for r in range(4)])
    assert sharded.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert torch.equal(pairs_to_natural(sharded.view(1, 16), 4), x)
    assert torch.equal(natural_to_pairs(x, 4), sharded.view(1, 16))


def test_single_process_shard_is_identity_and_pad_batch():
    t = ucp.init_topology()
    x = torch.randn(2, 6, 3)
    assert torch.equal(ucp.shard_sequence(x, t), x)
    assert torch.equal(ucp.gather_sequence(x, t), x)
    batch = {
        "input_ids": torch.ones(1, 5, dtype=torch.long),
        "labels": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.arange(5).view(1, 5),
    }
    out = ucp.pad_batch(batch, 8, pad_token_id=0)
    assert out["input_ids"].tolist() == [[1] * 5 + [0] * 3]
    assert out["labels"].tolist() == [[1] * 5 + [-100] * 3]
    assert out["position_ids"].tolist() == [list(range(8))]
