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
from tests.helpers import ds_config
from ulysses_cp import checkpoint
from ulysses_cp.data import DataConfig, KVRecall, global_batch, shard_batch
from ulysses_cp.model import Decoder, ModelConfig

TINY = ModelConfig(vocab_size=256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


def _engine(stage, opt, bf16=False):
    cfg = ds_config(2, 1, stage, backend="math")
    if bf16:
        cfg["bf16"] = {"enabled": True}
    topo = ucp.topology_from_config(cfg)
    torch.manual_seed(0)
    model = Decoder(TINY, lambda q, k, v: ucp.attention(q, k, v, topo, backend="math"))
    engine = ucp.initialize(model=model, config=cfg, topo=topo, optimizer=OPTIMIZERS[opt](
        model.parameters()))  # fmt: skip
    return engine, topo


def _batch(step, topo):
    full = global_batch(
        KVRecall(DataConfig(seq_len=64, n_queries=8)),
        step=step, micro_step=0, grad_accum=1, micro_batch=1, dp_rank=0, dp_degree=1,
    )  # fmt: skip
    return shard_batch(full, topo)


def _train(engine, topo, steps):
    losses = []
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

    masters = checkpoint._masters(engine)
    params = list(engine.module.parameters())
    if any(checkpoint._hp_mapped(p) for p in params):
        return [safe_get_full_fp32_param(p).float().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [masters.get(id(p), p).detach().float().clone() for p in params]


def _resume(rank, opt, stage_a, stage_b, out, bf16=False, force_portable=False):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    engine, topo = _engine(stage_a, opt, bf16)
    full = _train(engine, topo, range(3))
    expected = _params(engine)
    engine, topo = _engine(stage_a, opt, bf16)
    _train(engine, topo, range(2))
    checkpoint.save(engine, out, 2)
    engine, topo = _engine(stage_b, opt, bf16)

    def zero_loss():
        local = _batch(0, topo)
        logits = engine(local["input_ids"], local["position_ids"])
        ignored = torch.full_like(local["shift_labels"], -100)
        return ucp.sequence_parallel_cross_entropy(logits, ignored, topo)

    if force_portable:  # the portable state on the same stage: the same arithmetic after
        checkpoint._load_portable(engine, Path(out) / "step2" / "portable.pt", zero_loss)
    else:
        assert checkpoint.load(engine, out, zero_loss=zero_loss) == 2
    resumed = _train(engine, topo, [2])
    err = max((a - b).abs().max().item() for a, b in zip(_params(engine), expected))
    return full[2], resumed[0], err


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("stage_a,stage_b", [(2, 2), (0, 3), (3, 0)], ids=["ds", "0to3", "3to0"])
def test_resume_equals_the_uninterrupted_run(pools, tmp_path, opt, stage_a, stage_b):
    for loss, resumed, err in pools(2).run(_resume, opt, stage_a, stage_b, str(tmp_path)):
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
        for loss, resumed, err in pools(2).run(
            _resume, opt, stage, stage, str(out), True, portable
        ):
            assert abs(resumed - loss) <= 1e-6 * abs(loss), (opt, portable, loss, resumed)
            assert err < 1e-7, f"{opt} bf16 portable={portable}: masters differ by {err}"
