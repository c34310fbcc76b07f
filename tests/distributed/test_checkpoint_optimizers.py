"""Checkpoints keep whatever the optimizer keeps: a run saved after 2 steps and resumed for
a third equals the uninterrupted 3-step run (loss of step 3 and final parameters), for SGD,
momentum SGD, Adagrad and AdamW, in DeepSpeed's own format (same ZeRO stage) and in the
portable format (another ZeRO stage). 2 gloo ranks, Ulysses 2, in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import needs_fp16, run_config, topology_for
from ulysses_cp.config import ModelConfig
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.run_blocks import DataConfig
from ulysses_cp.training import checkpoint
from ulysses_cp.training import portable as saved_state
from ulysses_cp.training.data import KVRecall, global_batch

TINY = ModelConfig(vocab_size=256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


FP16 = {"enabled": True, "initial_scale_power": 16, "hysteresis": 2, "loss_scale_window": 1000}
# after step 2 (in both runs) the fp16 loss scaler is given a running state no fresh run
# has, so a resume that dropped it would show
SCALER = {"cur_scale": 2.0**11, "cur_iter": 7, "last_overflow_iter": 5, "cur_hysteresis": 1}


def _config(stage, precision="fp32", degrees=(2, 1), layout="zigzag"):
    cfg = run_config(*degrees, stage, backend="math", sp={"layout": layout})
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = dict(FP16)
    return cfg


def _engine(stage, opt, precision="fp32", fused=False, **split):
    """The engine and ``[topology]``: the model's attention and the batches follow
    whatever topology the list holds (the uninterrupted run switches it for step 3)."""
    cfg = _config(stage, precision, **split)
    current = [topology_for(cfg)]
    torch.manual_seed(0)
    model = Decoder(TINY, lambda q, k, v: ucp.attention(q, k, v, current[0]))
    optimizer = OPTIMIZERS[opt](model.parameters())
    kwargs = dict(model=model, config=cfg, topo=current[0], optimizer=optimizer)
    if not fused:
        return ucp.initialize(**kwargs), current
    # DeepSpeed picks its fused FP16 optimizer (one flat fp32 master per parameter group)
    # for its FusedAdam, which needs CUDA; here it is told AdamW is fused (test only)
    import deepspeed.runtime.engine as ds_engine

    saved, ds_engine.FusedAdam = ds_engine.FusedAdam, type(optimizer)
    try:
        engine = ucp.initialize(**kwargs)
    finally:
        ds_engine.FusedAdam = saved
    assert type(engine.optimizer).__name__ == "FP16_Optimizer", type(engine.optimizer)
    return engine, current


def _batch(step, topo):
    full = global_batch(
        KVRecall(DataConfig(seq_len=64, n_queries=8)),
        step=step,
        micro_step=0,
        grad_accum=1,
        micro_batch=1,
        dp_rank=0,
        dp_degree=1,
    )
    return ucp.shard_batch(full, topo)


def _train(engine, current, steps):
    losses = []
    topo = current[0]
    for step in steps:
        local = _batch(step, topo)
        logits = engine(local["input_ids"], local["position_ids"])
        loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine):
    """The fp32 values the optimizer updates: master copies where DeepSpeed keeps them."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    masters = saved_state._masters(engine)
    params = list(engine.module.parameters())
    if any(saved_state._hp_mapped(p) for p in params):
        return [safe_get_full_fp32_param(p).float().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [
            (masters[id(p)][0] if id(p) in masters else p).detach().float().clone() for p in params
        ]


def _resume(rank, opt, stage_a, stage_b, out, precision="fp32", force_portable=False, **run_b):
    """Loss of step 3 uninterrupted and resumed (after saving at step 2 under
    ``stage_a`` and loading under ``stage_b`` and the ``run_b`` changes), the largest
    parameter difference after it, and the loss scales (fp16) at the end of both runs.
    The uninterrupted run is the one that saved: it goes on to step 3 from its live state
    (one engine fewer; a save that changed the live state otherwise than what it wrote
    shows as a difference)."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    fused = run_b.pop("fused", False)
    engine, current = _engine(stage_a, opt, precision, fused=fused)
    full = _train(engine, current, range(2))
    _mark_scaler(engine)
    checkpoint.save(engine, out, 2)
    if run_b:  # step 3 under the other split and layout, as the resumed run takes it
        current[0] = topology_for(_config(stage_a, precision, **run_b))
    full += _train(engine, current, [2])
    expected, scaler = _params(engine), _scaler_state(engine)
    engine, current = _engine(stage_b, opt, precision, fused=fused, **run_b)
    topo = current[0]

    def zero_loss():
        local = _batch(0, topo)
        logits = engine(local["input_ids"], local["position_ids"])
        ignored = torch.full_like(local["shift_labels"], -100)
        return ucp.sequence_parallel_cross_entropy(logits, ignored, topo)

    if force_portable:  # the portable state on the same stage: the same arithmetic after
        saved_state.load_portable(engine, Path(out) / "step2" / "portable.pt", zero_loss)
    else:
        assert checkpoint.load(engine, out, zero_loss=zero_loss) == 2
    resumed = _train(engine, current, [2])
    err = max((a - b).abs().max().item() for a, b in zip(_params(engine), expected))
    return full[2], resumed[0], err, (scaler, _scaler_state(engine))


def _mark_scaler(engine):
    scaler = saved_state._scaler(engine)
    for key, value in SCALER.items() if scaler is not None else ():
        if hasattr(scaler, key):
            setattr(scaler, key, value)


def _scaler_state(engine):
    scaler = saved_state._scaler(engine)
    return None if scaler is None else {k: getattr(scaler, k, None) for k in SCALER}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "stage_a,stage_b",
    [(0, 0), (2, 2), (3, 3), (0, 3), (3, 0)],
    ids=["ds0", "ds2", "ds3", "0to3", "3to0"],
)
def test_resume_equals_the_uninterrupted_run(pools, tmp_path, opt, stage_a, stage_b):
    for loss, resumed, err, _ in pools(2).run(_resume, opt, stage_a, stage_b, str(tmp_path)):
        assert abs(resumed - loss) <= 1e-6 * abs(loss), (opt, loss, resumed)
        assert err < 1e-6, f"{opt}: parameters after the resumed step differ by {err}"


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_resume_keeps_the_fp32_master_weights(pools, tmp_path, opt, stage):
    """bf16: the portable state holds the fp32 master copies (not the bf16 parameters) and
    the optimizer state keyed by them; loaded on the same stage, the resumed step equals the
    uninterrupted one exactly (so DeepSpeed's own format is checked beside it)."""
    for portable in (True, False):
        out = tmp_path / ("portable" if portable else "deepspeed")
        for loss, resumed, err, _ in pools(2).run(
            _resume, opt, stage, stage, str(out), "bf16", portable
        ):
            assert abs(resumed - loss) <= 1e-6 * abs(loss), (opt, portable, loss, resumed)
            assert err < 1e-7, f"{opt} bf16 portable={portable}: masters differ by {err}"


@needs_fp16
@pytest.mark.parametrize(
    "stage, fused",
    [(0, False), (0, True), (2, False), (3, False)],
    ids=["zero0", "zero0_fused", "zero2", "zero3"],
)
def test_fp16_resume_keeps_masters_and_the_loss_scaler(pools, tmp_path, stage, fused):
    """fp16: both formats keep the fp32 masters, the optimizer state and the loss scaler's
    running state (scale, iteration, last overflow, hysteresis), so the resumed step 3
    equals the uninterrupted one. ZeRO 0 with DeepSpeed's unfused and fused FP16 optimizers
    (one master per parameter / one flat master per group), ZeRO 2 and ZeRO 3."""
    for portable in (True, False):
        out = tmp_path / ("portable" if portable else "deepspeed")
        for loss, resumed, err, (scaler, scaler_resumed) in pools(2).run(
            _resume, "adamw", stage, stage, str(out), "fp16", portable, fused=fused
        ):
            assert scaler is not None and scaler["cur_scale"] != 2.0**16, scaler
            assert scaler_resumed == scaler, (portable, scaler, scaler_resumed)
            assert abs(resumed - loss) <= 1e-6 * abs(loss), (portable, loss, resumed)
            assert err < 1e-7, f"fp16 portable={portable}: masters differ by {err}"


# plain SGD (no optimizer state) and AdamW (two moments and a step count): the split and
# layout never reach the optimizer's state; every optimizer's state is checked above, across
# stages in fp32 and on the same stage in bf16 (momentum SGD, AdamW)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "precision,stage_a,stage_b",
    [
        ("fp32", 0, 3),
        ("fp32", 3, 0),
        ("bf16", 0, 3),
        ("bf16", 3, 0),
        ("bf16", 0, 0),
        ("bf16", 3, 3),
    ],
    ids=["fp32-0to3", "fp32-3to0", "bf16-0to3", "bf16-3to0", "bf16-ds0", "bf16-ds3"],
)
def test_resume_under_another_split_and_layout(pools, tmp_path, opt, precision, stage_a, stage_b):
    """Saved under Ulysses 2 / zigzag, resumed under ring 2 / contiguous: the layout never
    enters a checkpoint, so step 3 equals the uninterrupted run's step 3 taken under ring 2
    / contiguous. Across ZeRO stages (the portable format) and on the same stage
    (DeepSpeed's own)."""
    for loss, resumed, err, _ in pools(2).run(
        _resume,
        opt,
        stage_a,
        stage_b,
        str(tmp_path),
        precision,
        degrees=(1, 2),
        layout="contiguous",
    ):
        assert abs(resumed - loss) <= 1e-6 * abs(loss), (opt, precision, loss, resumed)
        assert err < 1e-6, f"{opt} {precision}: parameters differ by {err}"
