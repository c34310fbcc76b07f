"""The planner under ``"engine": "fsdp2"``: static memory by FSDP2's rules and its bytes per
step, against hand counts for a small shape (written out below, not from the code), where
they differ from ZeRO's, and the ``--engine`` override of the command line."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import ROOT
from ulysses_cp.config import RunConfig
from ulysses_cp.core.zero_comm import fsdp2_wire_bytes, zero_wire_bytes
from ulysses_cp.plan.cli import main, plan
from ulysses_cp.plan.fsdp2 import fsdp2_static_bytes
from ulysses_cp.plan.memory import static_bytes
from ulysses_cp.plan.search import Hardware
from ulysses_cp.plan.shapes import ModelShape
from ulysses_cp.plan.write import planned_config

pytestmark = pytest.mark.unit

# 4 layers of 1000 parameters, a 100 x 10 embedding and head (untied) and a norm of 10:
# 4000 + 2000 + 10 = 6010 parameters; bf16 compute (2 bytes)
SHAPE = ModelShape(
    family="reference",
    vocab=100,
    dim=10,
    layers=4,
    hq=2,
    hkv=2,
    head_dim=5,
    ffn=20,
    params=6010,
    layer_params=1000,
    dtype_bytes=2,
)
CFG = ROOT / "configs" / "tiny_cpu_zero2_u2r2.json"


def test_static_memory_by_hand():
    """8 ranks: a rank's share ceil(6010 / 8) = 752 elements, float32 (4 bytes) sharded."""
    part = 752
    root = 2 * 100 * 10 + 10  # embedding, head, final norm: unsharded all step
    unit = max(1000, root)  # the largest unit's gradient: bf16 and its fp32 reduce input
    resharded = fsdp2_static_bytes(SHAPE, reshard_after_forward=True, world=8)
    assert resharded == {
        "params": (root + 2 * 1000) * 2,  # the layer in use and the one prefetched
        "grads": part * 4 + unit * (2 + 4),
        "master": part * 4,
        "optimizer": 2 * part * 4,
    }
    kept = fsdp2_static_bytes(SHAPE, reshard_after_forward=False, world=8)
    assert kept["params"] == (root + 4 * 1000) * 2  # every layer from forward to backward
    assert {k: v for k, v in kept.items() if k != "params"} == {
        k: v for k, v in resharded.items() if k != "params"
    }
    # ZeRO-2 keeps whole bf16 gradients and the whole bf16 model on every rank; FSDP2 with
    # reshard False keeps every layer unsharded but shards the gradients
    zero2 = static_bytes(SHAPE, zero_stage=2, world=8)
    assert zero2["params"] == 6010 * 2 and zero2["grads"] == 6010 * 2
    assert kept["params"] == zero2["params"]
    assert kept["grads"] - unit * 6 == part * 4 < zero2["grads"]  # the persistent share
    assert resharded["params"] < zero2["params"]
    # an fp32 model: no mixed precision, every dtype 4 bytes
    fp32 = fsdp2_static_bytes(
        ModelShape(**{**SHAPE.__dict__, "dtype_bytes": 4}), reshard_after_forward=True, world=8
    )
    assert fp32["params"] == (root + 2000) * 4 and fp32["grads"] == part * 4 + unit * 8


def test_wire_bytes_by_hand():
    """4 ranks, 1000 parameters (250 a rank), bf16 gathers, fp32 reduce-scatter, 2 micro
    batches: ring all-gather sends 3 x 250 x 2 bytes per micro batch, the reduce-scatter
    3 x 250 x 4 once per step (the engines defer the micro steps' reductions)."""
    args = dict(params=1000, param_bytes=2, reduce_bytes=4, world=4, micro_steps=2)
    gather, scatter = 3 * 250 * 2, 3 * 250 * 4
    assert fsdp2_wire_bytes(reshard_after_forward=False, **args) == 2 * gather + scatter
    assert fsdp2_wire_bytes(reshard_after_forward=True, **args) == 2 * 2 * gather + scatter
    # the root kept (400 parameters not gathered again: 600 regathered, 150 a rank)
    kept = fsdp2_wire_bytes(reshard_after_forward=True, kept_params=400, **args)
    assert kept == 2 * (gather + 3 * 150 * 2) + scatter
    assert fsdp2_wire_bytes(reshard_after_forward=True, **{**args, "world": 1}) == 0
    # ZeRO-3 in bf16 all-gathers as often but reduce-scatters in bf16: fewer bytes
    zero3 = zero_wire_bytes(
        stage=3, max_live_parameters=1e9, params=1000, element_bytes=2, world=4, micro_steps=2
    )
    assert zero3 == 2 * (gather + 3 * 250 * 2)


def test_the_engine_flag_plans_fsdp2_and_is_shown(tmp_path, capsys):
    run = RunConfig.load(CFG)
    assert run.engine == "deepspeed"
    out = tmp_path / "plan.json"
    result = main(
        ["--deepspeed_config", str(CFG), "--world", "4", "--engine", "fsdp2", "--json", str(out)]
    )
    assert "engine fsdp2" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["inputs"]["engine"] == "fsdp2" and saved["config"]["engine"] == "fsdp2"
    assert all(c["engine"] == "fsdp2" for c in saved["candidates"])
    assert {c["zero_stage"] for c in saved["candidates"]} == {2, 3}  # ZeRO-1 is ZeRO-2 here
    assert set(result["config"]["zero_comm_bytes_per_step"]) == {"all_gather", "reduce_scatter"}
    ds = plan(run, world=4, hw=Hardware())
    assert ds["inputs"]["engine"] == "deepspeed"
    assert ds["config"]["static_parts"] != result["config"]["static_parts"]
    # the written config says the engine it was planned for
    assert planned_config(run, result["chosen"], world=4)["engine"] == "fsdp2"
    with pytest.raises(SystemExit):
        main(["--deepspeed_config", str(CFG), "--world", "4", "--engine", "fsdp"])


def test_optimizer_offload_is_refused_by_name():
    raw = json.loads(CFG.read_text())
    raw["engine"] = "fsdp2"
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    run = RunConfig.load(raw)
    with pytest.raises(ValueError, match="offload_optimizer is DeepSpeed's"):
        plan(run, world=4, hw=Hardware())
