"""train.py's FSDP2 engine (``training.fsdp2_engine``) against one process: 4 gloo ranks,
float64, the reference decoder, 3 optimizer steps of 2 accumulated micro steps each.

Two set-ups per layout (dp2 x u2, u2 x r2): AdamW under DeepSpeed's WarmupLR with a
clipping norm that binds (the clip factor needs the whole gradient's norm), and plain SGD
with a norm that does not bind (a gradient off by a constant factor moves the weights
differently: Adam and a binding clip would hide it). The reference is one process:
``torch.optim`` with DeepSpeed's own scheduler class, ``clip_grad_norm_``, each micro
step's loss divided by 2 as DeepSpeed's engine divides it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.helpers import TINY, run_config, sdpa_attention

TOL = dict(rtol=1e-10, atol=1e-10)
ROWS, SEQ, GAS, STEPS = 2, 32, 2, 3
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2}}
SETUPS = {
    "adamw, clipped": dict(
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        scheduler={**WARMUP, "params": {**WARMUP["params"], "warmup_num_steps": 3}},
        gradient_clipping=0.3,
    ),
    "sgd": dict(optimizer={"type": "SGD", "params": {"lr": 0.5}}, gradient_clipping=100.0),
}
_meshes: dict = {}


def _reference_optimizer(setup: dict, params):
    from deepspeed.runtime.lr_schedules import WarmupLR

    block = setup["optimizer"]
    opt_cls = torch.optim.AdamW if block["type"] == "AdamW" else torch.optim.SGD
    opt = opt_cls(params, **block["params"])
    sched = setup.get("scheduler")
    return opt, (WarmupLR(opt, **sched["params"]) if sched else None)


def _rows(step: int, micro: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(TINY.vocab_size, (dp * ROWS, SEQ), generator=g)


def _one_process_loss(ref, ids: torch.Tensor, dp: int) -> torch.Tensor:
    """The mean over the replicas of each replica's token-mean loss."""
    losses = []
    for d in range(dp):
        x = ids[d * ROWS : (d + 1) * ROWS]
        logits = ref(x, torch.arange(SEQ).expand_as(x))
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()))
    return sum(losses) / dp


def _train(rank, dp: int, u: int, r: int, name: str):
    from ulysses_cp.config import RunConfig
    from ulysses_cp.models.decoder import Decoder
    from ulysses_cp.training.fsdp2_engine import fsdp2_initialize

    setup = SETUPS[name]
    key = (dp, u, r)
    if key not in _meshes:  # group creation is collective: once per pool process
        _meshes[key] = ucp.fsdp_mesh(dp, u, r, backend="math")
    fm = _meshes[key]
    topo = fm.topology
    cfg = run_config(u, r, 3, micro_batch=ROWS, gradient_accumulation_steps=GAS, **setup)
    run = RunConfig.load({**cfg, "engine": "fsdp2", "model": {}})
    torch.manual_seed(0)
    model = Decoder(TINY, ucp.Attention(topo)).double()
    ref = Decoder(TINY, sdpa_attention).double()
    ref.load_state_dict(model.state_dict())
    engine = fsdp2_initialize(run, model, fm)
    opt, sched = _reference_optimizer(setup, ref.parameters())
    losses, ref_losses, norms, lrs = [], [], [], []
    for step in range(STEPS):
        logged = torch.zeros((), dtype=torch.float64)
        for m in range(GAS):
            ids = _rows(step, m, dp)
            mine = ids[topo.dp_rank * ROWS : (topo.dp_rank + 1) * ROWS]
            local = ucp.shard_batch({"input_ids": mine, "labels": mine}, topo)
            logits = engine(local["input_ids"], local["position_ids"], local["batch"])
            loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
            engine.backward(loss)
            engine.step()
            logged += loss.detach() / GAS
            ref_loss = _one_process_loss(ref, ids, dp)
            (ref_loss / GAS).backward()
            ref_losses.append(ref_loss.detach())
        torch.distributed.all_reduce(logged, group=topo.dp_group)
        losses.append(logged / dp)
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), setup["gradient_clipping"]))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        lrs.append((engine.get_lr()[0], opt.param_groups[0]["lr"]))  # for the next step
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    per_step = torch.stack(ref_losses).view(STEPS, GAS).mean(dim=1)
    return dict(
        losses=torch.stack(losses),
        ref_losses=per_step,
        weights=weights,
        ref=ref.state_dict(),
        norms=norms,
        lrs=lrs,
        counters=(engine.global_steps, engine.global_samples, engine.micro_steps),
        shards={p.device_mesh.size() for p in model.parameters()},
    )


@pytest.mark.parametrize("layout", ["dp2 x u2", "u2 x r2"])
def test_engine_steps_equal_one_process(pools, layout):
    dp, u, r = {"dp2 x u2": (2, 2, 1), "u2 x r2": (1, 2, 2)}[layout]
    for name, setup in SETUPS.items():
        for res in pools(4).run(_train, dp, u, r, name):
            torch.testing.assert_close(res["losses"], res["ref_losses"], **TOL)
            assert res["losses"][-1] != res["losses"][0]  # the weights moved
            for param, want in res["ref"].items():
                got = res["weights"][param]
                where = f"{name} {param}"
                torch.testing.assert_close(got, want, **TOL, msg=lambda m, w=where: f"{w}: {m}")
            clip = setup["gradient_clipping"]
            binds = [float(n) > clip for n in res["norms"]]
            assert all(binds) if clip < 1 else not any(binds), (name, res["norms"])
            assert [a for a, _ in res["lrs"]] == [b for _, b in res["lrs"]]  # DeepSpeed's lr
            assert res["counters"] == (STEPS, STEPS * GAS * ROWS * dp, STEPS * GAS)
            assert res["shards"] == {4}  # ZeRO-3 asked: sharded over dp x sp


def _nonfinite(rank):
    """A NaN gradient on one rank: every rank sees it (its own shard or another's, after
    the reduction), and the skipped update moves no weight while the counters advance."""
    from ulysses_cp.config import RunConfig
    from ulysses_cp.models.decoder import Decoder
    from ulysses_cp.training.fsdp2_engine import fsdp2_initialize
    from ulysses_cp.training.nonfinite import any_rank, gradients_finite, skip_update

    if (2, 2, 1) not in _meshes:
        _meshes[(2, 2, 1)] = ucp.fsdp_mesh(2, 2, 1, backend="math")
    fm = _meshes[(2, 2, 1)]
    cfg = run_config(2, 1, 2, micro_batch=ROWS, **SETUPS["adamw, clipped"])
    run = RunConfig.load({**cfg, "engine": "fsdp2", "model": {}})
    torch.manual_seed(0)
    engine = fsdp2_initialize(run, Decoder(TINY, ucp.Attention(fm.topology)).double(), fm)
    before = {n: p.detach().full_tensor() for n, p in engine.module.named_parameters()}
    local = ucp.shard_batch({"input_ids": _rows(0, 0, 1), "labels": _rows(0, 0, 1)}, fm.topology)
    logits = engine(local["input_ids"], local["position_ids"], local["batch"])
    loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], fm.topology)
    engine.backward(loss * (float("nan") if rank == 3 else 1.0))
    seen = not gradients_finite(engine)
    agreed = any_rank(seen, engine.device)
    skip_update(engine)
    after = {n: p.detach().full_tensor() for n, p in engine.module.named_parameters()}
    return dict(
        seen=seen,
        agreed=agreed,
        moved=[n for n in before if not torch.equal(before[n], after[n])],
        steps=engine.global_steps,
    )


def test_a_nonfinite_gradient_is_seen_and_its_update_skipped(pools):
    results = pools(4).run(_nonfinite)
    assert all(res["agreed"] for res in results)
    assert all(res["seen"] for res in results)  # a NaN reaches every shard's reduction
    assert all(res["moved"] == [] and res["steps"] == 1 for res in results)


def _other_engine(rank, folder: str, written: str, reshards: bool) -> str:
    from pathlib import Path

    from ulysses_cp.training import checkpoint

    out = Path(folder) / f"rank{rank}"  # each its own files
    (out / "step2").mkdir(parents=True, exist_ok=True)
    meta = {"world_size": 2, "zero_stage": 2, "step": 2}
    if written != "none":
        meta["engine"] = written
    (out / "step2" / "meta.json").write_text(json.dumps(meta))
    (out / "latest").write_text("step2")

    class Engine:  # what checkpoint.load asks before it loads anything
        def zero_optimization_stage(self):
            return 2

    engine = Engine()
    if reshards:
        engine.reshards = True  # type: ignore[attr-defined]
    try:
        checkpoint.load(engine, out)
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize(
    "written,reshards", [("deepspeed", True), ("none", True), ("fsdp2", False)]
)
def test_a_checkpoint_of_the_other_engine_is_refused(pools, tmp_path, written, reshards):
    for message in pools(2).run(_other_engine, str(tmp_path), written, reshards):
        kind = "fsdp2" if reshards else "deepspeed"
        other = "fsdp2" if kind == "deepspeed" else "deepspeed"
        assert f'written with "engine": "{other}"' in message, message
        assert f'this run\'s engine is "{kind}"' in message
