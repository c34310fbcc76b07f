"""The planner against measurements made at test time (independent of its code): the
attention byte counters, the live tensor bytes of a training step, what a DeepSpeed
engine leaves allocated and what its comms logger records, and benchmark_memory.py's
longest-sequence search; then its CLI: fields, ranking, errors."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from tests.support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import plan_vs_measured as pvm

from ulysses_cp.config import ModelConfig, RunConfig
from ulysses_cp.plan.cli import main, plan
from ulysses_cp.plan.comm import attention_bytes, split_nodes, zero_bytes
from ulysses_cp.plan.memory import activation_bytes, attention_activation
from ulysses_cp.plan.search import Hardware, Run, ZeroKnobs, candidates, predict
from ulysses_cp.plan.shapes import model_shape

TOKENS = 1024  # per rank (at 512 a fixed few hundred KB of the ring modes weighs 15%)
CASES = {
    1: [(1, 1)],
    2: [(2, 1), (1, 2)],
    4: [(4, 1), (1, 4), (2, 2)],
}


def _steps(rank, world):
    out = []
    # at P = 4 "tiled" (between the two others) is left to scripts/plan_vs_measured.py
    features_of = ("none", "tiled", "tiled+ckpt") if world < 4 else ("none", "tiled+ckpt")
    for u, r in CASES[world]:
        for kind in ("reference", "hf"):
            for features in features_of:
                kw = dict(u=u, r=r, kind=kind, features=features, N=TOKENS * world)
                out.append((kw, pvm.measure_step(rank, **kw)))
    return out


def _zero(rank, world, kinds):
    return [
        (stage, kind, pvm.measure_zero(rank, world, stage, kind))
        for kind in kinds
        for stage in (1, 2, 3)
    ]


def _longest(rank, cases):
    return [pvm.measure_longest(rank, **kw) for kw in cases]


def _exchange_bytes(rank, exchange, shape):
    import torch

    import ulysses_cp as ucp
    from tests.support.helpers import topology

    topo = topology(2, 2, "zigzag", kv_exchange=exchange, check_inputs=False)
    g = torch.Generator().manual_seed(0)
    s_l = 512 // 4
    q = torch.randn(1, s_l, shape.hq, shape.head_dim, generator=g, requires_grad=True)
    k, v = (
        torch.randn(1, s_l, shape.hkv, shape.head_dim, generator=g, requires_grad=True)
        for _ in range(2)
    )
    ucp.comm_stats.reset()
    ucp.attention(q, k, v, topo, backend="math").sum().backward()
    ops = ("all_to_all", "ring", "kv_allgather", "kv_reduce_scatter")
    return sum(ucp.comm_stats.total(op) for op in ops)


# ---------------------------------------------------------------- the model's rules


def _tiny(**kw):
    return model_shape(ModelConfig(**kw))


def test_head_chunks_shrink_only_the_ulysses_staging():
    shape = _tiny()
    one = attention_activation(shape, s_local=256, batch=1, ulysses=4, ring=1, head_chunks=1)
    four = attention_activation(shape, s_local=256, batch=1, ulysses=4, ring=1, head_chunks=4)
    # the saved copies stay; the chunk's working set shrinks, down to the end of the
    # backward (the gradient pieces put together), which chunks do not change
    assert four["saved"] == one["saved"] and 0 < four["staging"] < one["staging"]


def test_attention_bytes_follow_the_modes():
    shape = _tiny(n_layers=1)
    kw = dict(seq_len=1024, batch=1)
    assert attention_bytes(shape, ulysses=1, ring=1, **kw)["total"] == 0
    uly = attention_bytes(shape, ulysses=4, ring=1, **kw)
    assert uly["ring_forward"] == uly["ring_backward"] == 0 and uly["all_to_all"] > 0
    ring = attention_bytes(shape, ulysses=1, ring=4, **kw)
    # backward: kv 3 times in fp32 and dk/dv accumulators 4 times in fp32, forward kv 3 times
    assert ring["ring_backward"] * 3 == ring["ring_forward"] * 7 and ring["all_to_all"] == 0
    ckpt = attention_bytes(replace(shape, activation_checkpointing=True), ulysses=4, ring=1, **kw)
    assert ckpt["all_to_all"] * 2 == uly["all_to_all"] * 3  # the recomputed forward


def test_intra_and_inter_node_bytes():
    shape = _tiny()
    att = attention_bytes(shape, seq_len=1024, batch=1, ulysses=2, ring=2)
    z = zero_bytes(shape, stage=2, world=4)
    # u2 inside each node of 2, ring across: all-to-all intra, ring and ZeRO inter
    s = split_nodes(world=4, gpus_per_node=2, ulysses=2, ring=2, attention=att, zero=z)
    ring = att["ring_forward"] + att["ring_backward"]
    zw = sum(v["wire"] for v in z.values())
    assert s == {"intra": att["all_to_all"], "inter": ring + zw}
    one = split_nodes(world=4, gpus_per_node=4, ulysses=2, ring=2, attention=att, zero=z)
    assert one == {"intra": att["total"] + zw, "inter": 0}
    # u4 over nodes of 2: two of the three all-to-all peers are on the other node
    att4 = attention_bytes(shape, seq_len=1024, batch=1, ulysses=4, ring=1)
    s4 = split_nodes(world=4, gpus_per_node=2, ulysses=4, ring=1, attention=att4, zero={})
    assert s4["inter"] == att4["all_to_all"] * 2 // 3
    # redo_all_to_all's backward all-to-alls travel the same links (and so cost time)
    redo = attention_bytes(shape, seq_len=1024, batch=1, ulysses=2, ring=2, redo=True)
    sr = split_nodes(world=4, gpus_per_node=4, ulysses=2, ring=2, attention=redo, zero=z)
    assert redo["all_to_all_redo"] > 0 and sr == {"intra": redo["total"] + zw, "inter": 0}


def test_candidates_try_redo_with_ulysses_only():
    shape = _tiny()
    runs = candidates(shape, Run(2, 1, "zigzag", 3), world=4, seq_len=1024)
    for u in (2, 4):
        assert {r.redo_all_to_all for r in runs if r.ulysses == u} == {False, True}
    assert {r.redo_all_to_all for r in runs if r.ulysses == 1} == {False}


def test_zero_stages_order_static_memory():
    shape = _tiny()
    hw = Hardware()
    kw = dict(seq_len=1024, batch=1, micro_steps=1, world=8, hw=hw)
    knobs = ZeroKnobs(reduce_bucket_size=0)
    peaks = [
        predict(shape, Run(2, 1, "zigzag", stage), **kw, zero_knobs=knobs)["static_bytes_per_rank"]
        for stage in (1, 2, 3)
    ]
    assert peaks[0] == peaks[1] > peaks[2]  # ZeRO-2 all-reduces whole gradients here (mpu)
    act = activation_bytes(shape, seq_len=4096, batch=1, ulysses=2, ring=1)["total"]
    assert (
        act
        == predict(
            shape, Run(2, 1, "zigzag", 1), seq_len=4096, batch=1, micro_steps=1, world=8, hw=hw
        )["activation_bytes_per_rank"]
    )


# ---------------------------------------------------------------- the CLI


def test_plan_of_the_config_as_written_matches_predict():
    run = RunConfig.load(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json")
    got = plan(run, world=8, hw=Hardware(gpus_per_node=4))
    shape = model_shape(run.model)
    att = attention_bytes(shape, seq_len=512, batch=4, ulysses=2, ring=2)
    assert got["config"]["attention_comm_bytes_per_step"] == att["total"]
    assert got["config"]["static_bytes_per_rank"] < got["config"]["peak_bytes_per_rank"]


def _error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["--deepspeed_config", *args])
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "6"], "does not divide WORLD_SIZE(6)"),
        (["--world", "8", "--gpus-per-node", "3"], "whole number of nodes"),
        (["--world", "4", "--seq-len", "100"], "must be a multiple of 8"),
    ],
)
def test_cli_errors_name_the_numbers(capsys, args, message):
    err = _error(capsys, str(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json"), *args)
    assert message in err, err


def test_cli_errors_for_heads_and_missing_config(capsys, tmp_path):
    cfg = json.loads((ROOT / "configs" / "tiny_cpu_zero2_u2r2.json").read_text())
    cfg["sequence_parallel"] = {"ulysses_degree": 3, "ring_degree": 1}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    err = _error(capsys, str(path), "--world", "3")
    assert "cannot split 4 query heads" in err and "degrees that work: [1, 2, 4]" in err, err
    err = _error(capsys, str(tmp_path / "nope.json"), "--world", "4")
    assert "no such file" in err, err
