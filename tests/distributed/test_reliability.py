"""Bad input is reported on every rank before it can hang; collective failures are named."""

from __future__ import annotations

import time

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import run_config, topology, topology_for
from ulysses_cp.core.comm import CollectiveError, collective


def _mismatch(rank, u, r, what):
    """Every rank must raise the same ValueError, quickly, when one rank's input differs."""
    topo = topology(u, r)
    s_l, dtype, cu = 8, torch.float32, None
    if what == "length" and rank == 1:
        s_l = 16
    if what == "odd" and rank == 1:
        s_l = 7  # only rank 1's local checks would reject this (odd zigzag shard)
    if what == "dtype" and rank == 1:
        dtype = torch.float64
    if what == "documents":
        cu = torch.tensor([0, 16, 32] if rank != 1 else [0, 24, 32], dtype=torch.int32)
    x = torch.zeros(1, s_l, 4, 8, dtype=dtype)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        ucp.attention(x, x, x, topo, backend="math", cu_seqlens=cu)
    return str(info.value), time.monotonic() - t0


@pytest.mark.parametrize("u,r", [(4, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize(
    "what,field",
    [
        ("length", "local seq"),
        ("odd", "local seq"),
        ("dtype", "dtype"),
        ("documents", "cu_seqlens"),
    ],
)
def test_rank_dependent_inputs_raise_on_every_rank(pools, u, r, what, field):
    results = pools(u * r).run(_mismatch, u, r, what)
    for msg, seconds in results:
        assert "different inputs" in msg and field in msg and "rank 1" in msg, msg
        assert seconds < 5, seconds
    assert len({msg for msg, _ in results}) == 1  # the same message everywhere


def _check_off(rank):
    """The input check's all-gather shows in the byte counters: present by default,
    absent with check_inputs=False."""
    sent = []
    for check in (True, False):
        topo = topology(2, 1, check_inputs=check)
        x = torch.randn(1, 8, 4, 8, dtype=torch.float64)
        ucp.comm_stats.reset()
        ucp.attention(x, x, x, topo, backend="math")
        sent.append(ucp.comm_stats.total("all_gather", "input check"))
    return sent


def test_input_check_can_be_switched_off(pools):
    for on, off in pools(2).run(_check_off):
        assert on > 0 and off == 0, (on, off)


def _input_check_bytes(rank, n_layers, planned):
    """Input-check bytes of one batch through a decoder with activation checkpointing:
    sharded (its one check) and attended with the batch's plan, or, without the plan,
    every attention call checked (the forward and its recomputation, per layer)."""
    from ulysses_cp.config import ModelConfig
    from ulysses_cp.models.decoder import Decoder

    topo = topology(2, 1, backend="math")
    mc = ModelConfig(
        dim=16,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=32,
        activation_checkpointing=True,
    )
    model = Decoder(mc, ucp.Attention(topo))
    ids = torch.randint(256, (1, 32), generator=torch.Generator().manual_seed(0))
    ucp.comm_stats.reset()
    local = ucp.shard_batch({"input_ids": ids}, topo)
    plan = local["batch"] if planned else None
    logits = model(local["input_ids"], local["position_ids"], plan)
    ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo).backward()
    return ucp.comm_stats.total("all_gather", "input check")


def test_inputs_are_checked_once_per_batch_not_per_layer(pools):
    two, eight = (pools(2).run(_input_check_bytes, n, True)[0] for n in (2, 8))
    assert two == eight > 0, (two, eight)
    # the same count without the batch's plan grows with the layers: every call checks
    two, eight = (pools(2).run(_input_check_bytes, n, False)[0] for n in (2, 8))
    assert eight > two > 0, (two, eight)


def _named_failure(rank):
    topo = topology(2, 1)
    with (
        pytest.raises(CollectiveError) as info,
        collective("all_to_all", "forward", topo.ulysses_group),
    ):
        raise RuntimeError("Connection closed by peer")
    return str(info.value)


def test_collective_errors_name_the_op_and_group(pools):
    for rank, msg in enumerate(pools(2).run(_named_failure)):
        assert (
            f"rank {rank}: all_to_all (forward) on the ulysses group (global ranks [0, 1])" in msg
        )
        assert "Connection closed by peer" in msg and "--resume" in msg


def _skip_nonfinite(rank, stage):
    import os

    import deepspeed

    from tests.support.faults import FaultHooks
    from tests.support.helpers import TINY
    from ulysses_cp.models.decoder import Decoder
    from ulysses_cp.run_blocks import DataConfig
    from ulysses_cp.training.data import KVRecall, global_batch
    from ulysses_cp.training.nonfinite import any_rank, gradients_finite, skip_update

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(2, 1, stage)
    topo = topology_for(cfg)
    torch.manual_seed(0)
    model = Decoder(TINY, ucp.Attention(topo, backend="torch"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine = ucp.initialize(model=model, config=cfg, topo=topo, optimizer=opt)
    data = KVRecall(DataConfig(seq_len=64, n_queries=8))

    def loss_of(step):
        full = global_batch(
            data, step=step, micro_step=0, grad_accum=1, micro_batch=1, dp_rank=0, dp_degree=1
        )
        local = ucp.shard_batch(full, topo)
        logits = engine(local["input_ids"], local["position_ids"], local["batch"])
        return ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)

    def params():
        ps = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(ps, enabled=stage == 3):
            return [p.detach().clone() for p in ps]

    engine.backward(loss_of(0))
    engine.step()
    before = params()
    loss = FaultHooks("nan_grad:step=2").loss(loss_of(1), 2)
    assert torch.isfinite(loss)  # a finite loss whose gradients are NaN
    engine.backward(loss)
    seen = any_rank(not gradients_finite(engine), torch.device("cpu"))
    skip_update(engine)
    after = params()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    engine.backward(loss_of(2))
    engine.step()
    later = params()
    moved = max((a - b).abs().max().item() for a, b in zip(after, later))
    finite = all(torch.isfinite(p).all() for p in later)
    return seen, unchanged, moved, finite


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_gradients_detected_and_update_skipped(pools, stage):
    for seen, unchanged, moved, finite in pools(2).run(_skip_nonfinite, stage):
        assert seen, "non-finite gradients not detected"
        assert unchanged, "a skipped update moved parameters"
        assert finite and moved > 1e-4, "training did not continue normally"


def _bad_inputs(rank):
    """Each bad input raises ValueError on this rank, before any collective, in seconds."""
    topo = topology(2, 2)
    x = torch.zeros(1, 8, 4, 8)
    cases = {
        "degrees vs world": lambda: ucp.init_topology(3, 1),
        "heads vs ulysses degree": lambda: ucp.attention(
            torch.zeros(1, 8, 3, 8), torch.zeros(1, 8, 3, 8), torch.zeros(1, 8, 3, 8), topo
        ),
        "length vs layout": lambda: ucp.shard_sequence(torch.zeros(1, 12, 4, 8), topo),
        "unknown key": lambda: ucp.SequenceParallelConfig.from_dict({"ulysess_degree": 2}),
        "wrong type": lambda: ucp.SequenceParallelConfig.from_dict({"ring_degree": 2.0}),
        "backend not installed": lambda: ucp.attention(x, x, x, topo, backend="flash_attn"),
        "dtype mismatch": lambda: ucp.attention(x, x.double(), x, topo),
        "odd zigzag shard": lambda: ucp.attention(x[:, :7], x[:, :7], x[:, :7], topo),
        "layout mismatch": lambda: ucp.attention(x, x, x, topo, layout="contiguous"),
    }
    out = {}
    for name, fn in cases.items():
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            fn()
        out[name] = (str(info.value), time.monotonic() - t0)
    return out


def test_bad_inputs_raise_on_every_rank_within_seconds(pools):
    results = pools(4).run(_bad_inputs)
    for name in results[0]:
        messages = {r[name][0] for r in results}
        assert len(messages) == 1, (name, messages)  # identical on every rank
        assert max(r[name][1] for r in results) < 5, name
    first = results[0]
    assert "does not divide WORLD_SIZE(4)" in first["degrees vs world"][0]
    assert "Ulysses degrees that work" in first["heads vs ulysses degree"][0]
    assert "pad to 16" in first["length vs layout"][0]
    assert "ulysess_degree" in first["unknown key"][0]
    assert "ring_degree must be an integer, got 2.0" in first["wrong type"][0]
    assert "flash_attn" in first["backend not installed"][0]
    assert "dtypes differ" in first["dtype mismatch"][0]
    assert "must be even" in first["odd zigzag shard"][0]
    assert "disagrees with the run's layout 'zigzag'" in first["layout mismatch"][0]


def _different_full_tensors(rank):
    """Each rank shards a full tensor made with its own seed: a wrong result with no error
    before; now every rank raises the same message (and check_inputs=False skips it)."""
    topo = topology(2, 1)
    same = torch.arange(16.0).view(1, 16)
    ucp.shard_sequence(same, topo)  # identical everywhere: fine
    mine = torch.randn(1, 16, generator=torch.Generator().manual_seed(rank))
    with pytest.raises(ValueError, match="the full tensor differs between sequence-parallel") as e:
        ucp.shard_sequence(mine, topo)
    reordered = same.flip(1) if rank else same  # same values, another order on rank 1
    with pytest.raises(ValueError, match="differs"):
        ucp.shard_sequence(reordered, topo)
    ucp.shard_sequence(mine, topo.with_options(check_inputs=False))
    return str(e.value)


def test_ranks_sharding_different_full_tensors_raise(pools):
    first, second = pools(2).run(_different_full_tensors)
    assert first == second
