"""One training step under SP + DeepSpeed ZeRO equals a single process; SP loss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.helpers import (
    TINY,
    needs_fp16,
    run_config,
    sdpa_attention,
    topology,
    topology_for,
)
from ulysses_cp.config import ModelConfig
from ulysses_cp.core.batch import shard_batch
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.models.loss import local_loss_term, replicated_loss_term
from ulysses_cp.run_blocks import DataConfig
from ulysses_cp.training.data import KVRecall, global_batch


def _step(rank, u, r, stage, layout, grad_factor=1.0, own_terms=False):
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(u, r, stage, micro_batch=2, backend="math", sp={"layout": layout})
    topo = topology_for(cfg)
    torch.manual_seed(0)
    model = Decoder(TINY, ucp.Attention(topo))
    ref = Decoder(TINY, sdpa_attention)  # one process, PyTorch's own attention
    ref.load_state_dict(model.state_dict())
    initial = [p.detach().clone() for p in ref.parameters()]
    engine = ucp.initialize(
        model=model, config=cfg, topo=topo, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)
    )
    data = KVRecall(DataConfig(seq_len=128, n_queries=16))

    def batch(dp_rank):
        return global_batch(
            data,
            step=0,
            micro_step=0,
            grad_accum=1,
            micro_batch=2,
            dp_rank=dp_rank,
            dp_degree=topo.dp_degree,
        )

    local = shard_batch(batch(topo.dp_rank), topo, layout)
    logits = engine(local["input_ids"], local["position_ids"], local["batch"])
    loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
    fixed = torch.ones(3, TINY.dim)  # the same on every rank
    n_tokens = local["input_ids"].numel() * topo.sp_world_size  # of this replica's batch
    if own_terms:  # a replicated regulariser and a per-token auxiliary loss of the user's
        loss = loss + 0.5 * replicated_loss_term(engine.module.norm(fixed).pow(2).mean(), topo)
        loss = loss + 0.1 * local_loss_term(logits.float().pow(2).sum() / n_tokens, topo)
    engine.backward(loss * grad_factor)  # grad_factor != 1: a wrong gradient, on purpose
    engine.step()
    # single process: mean over the replicas of each replica's token-mean loss
    ref_losses = []
    for d in range(topo.dp_degree):
        full = batch(d)
        logits = ref(full["input_ids"], full["position_ids"])
        ce = F.cross_entropy(logits.flatten(0, 1), full["shift_labels"].flatten())
        if own_terms:
            ce = ce + 0.5 * ref.norm(fixed).pow(2).mean() + 0.1 * logits.pow(2).sum() / n_tokens
        ref_losses.append(ce)
    (sum(ref_losses) / len(ref_losses)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()  # no clipping: the step is 0.5 x grad
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        err = max((p - q).abs().max().item() for p, q in zip(params, ref.parameters()))
        moved = max((q - p0).abs().max().item() for q, p0 in zip(ref.parameters(), initial))
    return loss.item(), ref_losses[topo.dp_rank].item(), err, moved


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "u,r,layout", [(4, 1, "zigzag"), (2, 1, "zigzag"), (2, 2, "zigzag"), (2, 2, "contiguous")]
)
def test_training_step_equals_single_process(pools, stage, u, r, layout):
    for loss, ref_loss, err, moved in pools(4).run(_step, u, r, stage, layout):
        assert abs(loss - ref_loss) < 1e-5
        assert moved > 1e-3  # the step really changed the parameters
        assert err < 1e-6, f"updated parameters differ by {err}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("u,r", [(2, 2), (2, 1)])
def test_loss_terms_of_your_own_follow_the_same_rule(pools, stage, u, r):
    """A replicated regulariser (replicated_loss_term) and a per-token auxiliary loss
    (local_loss_term) added to the SP loss give the single-process update, ZeRO 1-3,
    with and without data parallelism."""
    for loss, ref_loss, err, moved in pools(4).run(_step, u, r, stage, "zigzag", 1.0, True):
        assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
        assert moved > 1e-3
        assert err < 1e-6, f"updated parameters differ by {err}"


@pytest.mark.parametrize("stage", [1, 3])
def test_the_equivalence_check_catches_a_2x_gradient(pools, stage):
    """The check above can fail: the same step with the gradient doubled on purpose moves
    the parameters far past its tolerance."""
    for _, _, err, moved in pools(4).run(_step, 2, 2, stage, "zigzag", 2.0):
        assert err > 1e3 * 1e-6, f"a 2x gradient changed the update by only {err}"
        assert err > 0.1 * moved


def _sp_loss(rank, u, r):
    topo = topology(u, r)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 32, 11, dtype=torch.float64, generator=g)
    labels = torch.randint(11, (2, 32), generator=g)
    labels[:, :13] = -100  # uneven: the first shards hold far more ignored tokens
    labels[1, 20:23] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    local = ucp.shard_sequence(logits, topo).requires_grad_()
    loss = ucp.sequence_parallel_cross_entropy(local, ucp.shard_sequence(labels, topo), topo)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        local.grad, ucp.shard_sequence(ref_logits.grad, topo), rtol=1e-12, atol=1e-12
    )
    # a shard with no target at all still gets a finite loss and zero gradient
    none = torch.full((2, 32 // topo.sp_world_size), -100)
    empty = ucp.sequence_parallel_cross_entropy(local.detach(), none, topo)
    assert empty.item() == 0.0


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2), (1, 4)])
def test_sp_cross_entropy_equals_full_loss(pools, u, r):
    pools(4).run(_sp_loss, u, r)


def _checkpointed_grads(rank):
    """Activation checkpointing (collectives re-run in backward) changes no gradient."""
    topo = topology(2, 2)
    data = KVRecall(DataConfig(seq_len=64, n_queries=8))
    full = global_batch(
        data, step=0, micro_step=0, grad_accum=1, micro_batch=2, dp_rank=0, dp_degree=1
    )
    local = shard_batch(full, topo, "zigzag")
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**TINY.__dict__, "activation_checkpointing": ckpt})
        model = Decoder(cfg, ucp.Attention(topo, backend="math"))
        loss = ucp.sequence_parallel_cross_entropy(
            model(local["input_ids"], local["position_ids"]), local["shift_labels"], topo
        )
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_same_gradients(pools):
    pools(4).run(_checkpointed_grads)


def _packed_step(rank, u, r, stage, packing="document", layout="zigzag"):
    """One DeepSpeed step on a packed row equals one process training the same documents
    one per row (unpadded, end-padded to a common length with ignored labels). Packing
    ``"document"`` pads every document, ``"row"`` only the row."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(u, r, stage, sp={"packing": packing, "layout": layout})
    topo = topology_for(cfg)
    g = torch.Generator().manual_seed(11)
    lengths = [1, 23, 8, 40, 3, 17]
    docs = [torch.randint(2, 256, (n,), generator=g) for n in lengths]
    m = ucp.sequence_multiple(u * r, layout)
    each = dict(multiple=m) if packing == "document" else dict(row_multiple=m)
    packed = ucp.pack_documents(docs, **each)
    if packing == "row":  # no document padded: only the row's end (92 -> 96 tokens)
        assert packed["cu_seqlens"][:-1].tolist() == [0, 1, 24, 32, 72, 75]
        assert packed["input_ids"].shape[1] == -(-sum(lengths) // m) * m
    torch.manual_seed(0)

    model = Decoder(TINY, ucp.Attention(topo, backend="torch"))
    ref = Decoder(TINY, sdpa_attention)
    ref.load_state_dict(model.state_dict())
    engine = ucp.initialize(
        model=model, config=cfg, topo=topo, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)
    )
    local = shard_batch(packed, topo, layout)
    logits = engine(local["input_ids"], local["position_ids"], local["batch"])
    loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
    engine.backward(loss)
    engine.step()
    # one process, one document per row, end-padded with ignored labels
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad(docs, batch_first=True)
    labels = pad(
        [torch.cat([d[1:], torch.tensor([-100])]) for d in docs],
        batch_first=True,
        padding_value=-100,
    )
    pos = torch.arange(max(lengths)).expand(len(docs), -1)
    ref_logits = ref(ids, pos)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()  # no clipping, as in run_config
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        err = max((p - q).abs().max().item() for p, q in zip(params, ref.parameters()))
    return loss.item(), ref_loss.item(), err


@pytest.mark.parametrize("u,r,stage", [(2, 2, 2), (4, 1, 3), (1, 4, 1)])
def test_packed_training_step_equals_one_document_per_row(pools, u, r, stage):
    for loss, ref_loss, err in pools(4).run(_packed_step, u, r, stage):
        assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
        assert err < 1e-6, f"updated parameters differ by {err}"


@pytest.mark.parametrize(
    "u,r,stage,layout", [(2, 2, 2, "zigzag"), (1, 4, 3, "contiguous"), (4, 1, 1, "zigzag")]
)
def test_row_packed_training_step_equals_one_document_per_row(pools, u, r, stage, layout):
    """Row-wise packing: documents of any length cross rank borders, only the row padded."""
    for loss, ref_loss, err in pools(4).run(_packed_step, u, r, stage, "row", layout):
        assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
        assert err < 1e-6, f"updated parameters differ by {err}"


def _dtypes(rank, stage, precision):
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(2, 1, stage, **{precision: {"enabled": True}})
    topo = topology_for(cfg)
    model = Decoder(TINY, ucp.Attention(topo))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ucp.initialize(model=model, config=cfg, topo=topo, optimizer=opt)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        kinds = {p.dtype for p in params}
    local = shard_batch(
        global_batch(
            KVRecall(DataConfig(seq_len=64, n_queries=8)),
            step=0,
            micro_step=0,
            grad_accum=1,
            micro_batch=1,
            dp_rank=0,
            dp_degree=1,
        ),
        topo,
    )
    return kinds, engine(local["input_ids"], local["position_ids"]).dtype


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=needs_fp16)])
@pytest.mark.parametrize("stage", [0, 3])
def test_low_precision_means_low_precision_under_every_stage(pools, stage, precision):
    """bf16/fp16 parameters and logits under ZeRO 0 and 3 (ZeRO-3 with SP partitions the
    model itself, and DeepSpeed then left it fp32: the run trained in fp32, silently)."""
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for kinds, logits in pools(2).run(_dtypes, stage, precision):
        assert kinds == {want} and logits == want, (kinds, logits)


def _trainer_run(rank, out):
    """The trainer in process (no launcher): every step reaches the hooks, losses are
    logged, and the end of the run is checkpointed."""
    from ulysses_cp.run_blocks import TrainingConfig
    from ulysses_cp.training import checkpoint
    from ulysses_cp.training.trainer import Hooks, Trainer

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(2, 1, 2)
    topo = topology_for(cfg)
    torch.manual_seed(0)
    model = Decoder(TINY, ucp.Attention(topo))
    engine = ucp.initialize(
        model=model, config=cfg, topo=topo, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)
    )
    seen = []

    class Record(Hooks):
        def after_step(self, trainer, state):
            # an evaluation would go here: the loss of a held-out batch, on every rank
            with torch.no_grad():
                held_out = trainer.loss(trainer.batch(1000 + state.step, 0)).item()
            seen.append((state.step, held_out))

    tc = TrainingConfig(max_steps=3, log_interval=1, save_on_signal=False)
    data = KVRecall(DataConfig(seq_len=64, n_queries=8))
    trainer = Trainer(engine, topo, data, tc=tc, out=Path(out), hooks=Record())
    state = trainer.run(0)
    return state.step, len(state.losses), seen, checkpoint.latest_tag(out)


def test_trainer_runs_in_process_with_hooks_after_every_step(pools, tmp_path):
    for steps, logged, seen, tag in pools(2).run(_trainer_run, str(tmp_path)):
        assert (steps, logged, tag) == (3, 3, "step3")
        assert [s for s, _ in seen] == [1, 2, 3]
        assert all(0 < loss < 10 for _, loss in seen), seen
