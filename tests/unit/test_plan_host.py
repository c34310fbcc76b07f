"""The planner's host memory (``ulysses_cp/plan/host.py``) against what is really there:
DeepSpeed's offloaded optimizer state, counted tensor by tensor after a step, and the
layer inputs an offloaded checkpoint keeps on CPU."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import TINY, offloaded_inputs, run_config, sdpa_attention, topology_for
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.plan.host import host_bytes
from ulysses_cp.plan.shapes import model_shape


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def _offloaded_optimizer(rank, stage):
    """Bytes DeepSpeed keeps for the optimizer with ``offload_optimizer`` after a step: the
    fp32 master partition and its gradient, Adam's state, ZeRO-3's flat gradient buffer."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    cfg = run_config(2, 1, stage, zero_optimization=zero, zero_force_ds_cpu_optimizer=False)
    topo = topology_for(cfg)
    torch.manual_seed(0)
    model = Decoder(TINY, ucp.Attention(topo))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ucp.initialize(model=model, config=cfg, topo=topo, optimizer=opt)
    ids = torch.randint(0, TINY.vocab_size, (1, 32))
    pos = torch.arange(32)[None]
    sl = slice(16 * rank, 16 * rank + 16)
    engine.backward(engine(ids[:, sl], pos[:, sl], None).float().pow(2).mean())
    engine.step()
    ds = engine.optimizer
    state = _nbytes(t for s in ds.optimizer.state.values() for t in s.values() if t.dim())
    if stage == 3:
        masters = list(ds.fp32_partitioned_groups_flat)
        extra = _nbytes([ds.grad_partitions_flat_buffer])
    else:
        masters, extra = list(ds.single_partition_of_fp32_groups), 0
    assert all(m.device.type == "cpu" for m in masters)
    return state + _nbytes(masters) + _nbytes(m.grad for m in masters) + extra


@pytest.mark.parametrize("offload, layers", [(True, 3), (2, 2), (1, 1)])
def test_offloaded_activations_bytes_equal_what_the_checkpoints_keep(offload, layers):
    """``offload_activations`` true (every layer) or a count (the first n layers): the
    inputs on CPU are exactly those layers', and the planner counts their bytes."""
    mc = replace(TINY, n_layers=3, activation_checkpointing=True, offload_activations=offload)
    torch.manual_seed(0)
    model = Decoder(mc, sdpa_attention)
    b, s = 2, 24
    ids = torch.randint(0, mc.vocab_size, (b, s))
    out = model(ids, torch.arange(s).expand(b, s), None)
    kept = offloaded_inputs(out)
    assert len(kept) == layers
    want = host_bytes(model_shape(mc), zero_stage=0, world=1, tokens=b * s)
    assert _nbytes(kept) > 0 and _nbytes(kept) == want["activations"], (kept, want)
    # the first layers: the embedding's output is the first layer's input
    assert any(torch.equal(x, model.embed(ids)) for x in kept)
    plain = host_bytes(model_shape(TINY), zero_stage=0, world=1, tokens=b * s)
    assert plain["activations"] == 0


def test_load_is_partitioned_only_when_asked_and_peak_is_the_larger_part():
    shape = replace(model_shape(TINY), weights_file_bytes=100)
    whole = host_bytes(shape, zero_stage=3, world=4, tokens=8)
    part = host_bytes(shape, zero_stage=3, world=4, tokens=8, partitioned_load=True)
    assert whole["load"] == shape.params * 4 + 100
    assert part["load"] == -(-shape.params * 4 // 4) + 100
    big = host_bytes(shape, zero_stage=1, world=4, tokens=8, offload_optimizer=True)
    assert big["peak"] == max(big["load"], big["optimizer"]) and big["optimizer"] > 0
