"""A Hugging Face model built partitioned under ZeRO-3 (``training/loading.py``) equals the
whole-model build: the same parameters (gathered) and the same first step, from a sharded
safetensors checkpoint and from a seed, and the same generator state after the build."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import run_config, topology_for
from ulysses_cp.config import RunConfig
from ulysses_cp.run_blocks import DataConfig
from ulysses_cp.training.data import KVRecall, global_batch

transformers = pytest.importorskip("transformers")
from ulysses_cp.models import hf  # noqa: E402
from ulysses_cp.training import loading, partitioned_init  # noqa: E402

# odd sizes: an MLP bias of 33 elements is padded in the partition of 2 ranks, and the
# 33 x 18 projections' partitions start in the middle of a row
SIZES = dict(vocab_size=97, hidden_size=18, intermediate_size=33, num_hidden_layers=2, head_dim=6)
HEADS = dict(num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512)
FLAGS = dict(mlp_bias=True, attention_bias=True, attention_dropout=0.0, tie_word_embeddings=False)
CONFIG = dict(model_type="llama", **SIZES, **HEADS, **FLAGS)


def _config(tmp, weights=None) -> dict:
    model = {"hf_config": str(tmp / "config.json"), "hf_weights": weights}
    # ring 2: three query heads need not split
    return run_config(1, 2, 3, model=model)


def _step(rank, cfg: dict, partitioned: bool, seed: int, block_bytes: int | None = None):
    """Build (seeded), ``ucp.initialize`` under ZeRO-3, one SGD step. Returns the gathered
    parameters after the build, the loss, the gathered parameters after the step and the
    generator's state after the build. ``block_bytes``: the random init's row blocks."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    run = RunConfig.load(cfg)
    topo = topology_for(cfg)
    torch.manual_seed(seed)
    if partitioned:
        default = partitioned_init.ROW_BLOCK_BYTES
        partitioned_init.ROW_BLOCK_BYTES = block_bytes or default
        try:
            model = loading.build_partitioned(run, topo, backend="torch")
        finally:
            partitioned_init.ROW_BLOCK_BYTES = default
        assert all(hasattr(p, "ds_id") for p in model.parameters())  # never whole
    else:
        model = hf.build_model(topo, run.model, backend="torch")
    rng = torch.get_rng_state()
    engine = ucp.initialize(
        model=model, config=cfg, topo=topo, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)
    )
    assert engine.module.probed is not None  # the guard and probe ran
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        built = [p.detach().clone() for p in params]
    data = KVRecall(DataConfig(seq_len=64, n_queries=8, n_keys=4, n_values=8))
    full = global_batch(
        data, step=0, micro_step=0, grad_accum=1, micro_batch=1, dp_rank=0, dp_degree=1
    )
    local = ucp.shard_batch(full, topo)
    logits = engine(local["input_ids"], local["position_ids"], local["batch"])
    loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(params):
        stepped = [p.detach().clone() for p in params]
    return built, loss.item(), stepped, rng


def _same(whole, part):
    for (b_w, loss_w, s_w, rng_w), (b_p, loss_p, s_p, rng_p) in zip(whole, part):
        assert len(b_w) == len(b_p)
        for i, (a, b) in enumerate(zip(b_w, b_p)):
            assert torch.equal(a, b), f"parameter {i} differs after the build"
        assert loss_w == loss_p, (loss_w, loss_p)
        for i, (a, b) in enumerate(zip(s_w, s_p)):
            assert torch.equal(a, b), f"parameter {i} differs after the first step"
        assert torch.equal(rng_w, rng_p), "the generator is not where the whole build left it"


def _save_checkpoint(tmp):
    config = hf.load_config(dict(CONFIG))
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp / "weights", max_shard_size="8KB")
    return tmp / "weights"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_blocks_draw_what_one_call_draws(dtype):
    """torch's CPU normal_ / uniform_ over the blocks of ``row_blocks`` give one call's
    numbers and leave the generator where one call does (partitioned_init's premise)."""
    cases = [((97, 18), 40), ((33, 18), 1), ((33,), 4), ((100, 3), 30), ((10,), 1)]
    cases += [((4000, 256), 2**16), ((7, 5, 3), 8)]
    for shape, block_bytes in cases:
        blocks = partitioned_init.row_blocks(shape, dtype.itemsize, block_bytes)
        assert blocks[0][0] == 0 and blocks[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
        if shape[0] > 20:
            assert len(blocks) >= 2, (shape, blocks)  # really cut
        for draw in (lambda t: t.normal_(0.1, 0.02), lambda t: t.uniform_(-0.5, 0.5)):
            torch.manual_seed(11)
            whole = draw(torch.empty(shape, dtype=dtype))
            after = torch.get_rng_state()
            torch.manual_seed(11)
            parts = [draw(torch.empty((b - a, *shape[1:]), dtype=dtype)) for a, b in blocks]
            assert torch.equal(torch.cat(parts), whole), (shape, blocks)
            assert torch.equal(torch.get_rng_state(), after), (shape, blocks)


def test_stood_in_parameters_refuse_what_blocks_cannot_replay():
    """Metadata of a stood-in (meta) parameter is answered; an op that makes values from
    it (a row view, trunc_normal_) raises, so the module falls back to gathering."""
    w = torch.nn.Parameter(torch.empty(5, 4, device="meta"), requires_grad=False)
    with partitioned_init._NoMetaChecks(), partitioned_init._Replay({id(w): w}):
        assert w.shape == (5, 4) and w.dim() == 2 and w.numel() == 20
        assert torch.nn.init._calculate_fan_in_and_fan_out(w) == (4, 5)
    ops = [lambda: torch.nn.init.zeros_(w[1]), lambda: torch.nn.init.trunc_normal_(w)]
    ops += [lambda: torch.nn.init.orthogonal_(w), lambda: w.data.normal_()]
    for op in ops:
        replay = partitioned_init._NoMetaChecks(), partitioned_init._Replay({id(w): w})
        with pytest.raises(partitioned_init._Unsupported), replay[0], replay[1]:
            op()


def test_a_checkpoint_with_other_names_is_not_streamed(tmp_path):
    weights = _save_checkpoint(tmp_path)
    index = json.loads((weights / loading.INDEX).read_text())
    index["weight_map"] = {f"renamed.{k}": v for k, v in index["weight_map"].items()}
    other = tmp_path / "other"
    other.mkdir()
    (other / loading.INDEX).write_text(json.dumps(index))
    names = {
        n
        for n, _ in transformers.AutoModelForCausalLM.from_config(
            hf.load_config(dict(CONFIG))
        ).named_parameters()
    }
    run = RunConfig.load(_config(tmp_path, str(weights)))
    why = loading._streamable(other, names, run)
    assert why is not None and "tensor names differ" in why and "missing" in why
    assert loading._streamable(weights, names, run) is None


def test_partitioned_build_only_under_zero3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    for stage, want in ((0, False), (2, False), (3, True)):
        cfg = run_config(1, 2, stage, model={"hf_config": str(tmp_path / "config.json")})
        assert loading.partitioned_build(RunConfig.load(cfg)) is want
    assert not loading.partitioned_build(RunConfig.load(run_config(1, 2, 3)))  # the decoder
