"""``"model": {"memory_budget_gb": x}``: the per-rank budget that sizes ``"auto"`` tiles
(``core/tiles.py``). The rule keeps each tile within its share of the budget for any
budget and vocabulary, the run, the Hugging Face wrapper and the planner all take it, and
a 4-rank run (Ulysses 2 x ring 2) is exact at a small budget (many tiles) and a large one
(one tile), against one process of transformers' own model."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from ulysses_cp.config import HFModelConfig, ModelConfig, RunConfig
from ulysses_cp.core.tiles import (
    LOSS_SHARE,
    LOSS_TILE_BYTES,
    MLP_SHARE,
    AutoTiles,
    resolve_tiles,
    tile_bytes,
    with_budget,
)
from ulysses_cp.plan.memory import tile_counts
from ulysses_cp.training.build import tile_plan

GIB = 2**30
BUDGETS = [64 * 2**20, 160 * 2**20, GIB, 16 * GIB, 80 * GIB]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("vocab", [32_000, 128_256, 151_936])
def test_loss_tiles_stay_within_their_share_of_the_budget(budget, vocab):
    """Each loss tile's fp32 logits (the largest piece: ceil(tokens / tiles) tokens) hold
    at most budget / LOSS_SHARE, and the 1 GiB cap, at every length."""
    share = min(budget // LOSS_SHARE, LOSS_TILE_BYTES)
    for tokens in (1_024, 4_096, 65_536, 625_000):
        n = resolve_tiles(AutoTiles(budget), "loss", tokens=tokens, width=vocab, element_bytes=2)
        assert -(-tokens // n) * vocab * 4 <= share, (budget, vocab, tokens, n)
        # and not needlessly fine: one tile fewer would break the share
        if n > 1:
            assert -(-tokens // (n - 1)) * vocab * 4 > share or tokens % (n - 1)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("ffn", [1_024, 14_336, 53_248])
def test_mlp_tiles_stay_within_their_share_of_the_budget(budget, ffn):
    for tokens in (1_024, 65_536, 625_000):
        n = resolve_tiles(AutoTiles(budget), "mlp", tokens=tokens, width=ffn, element_bytes=2)
        assert -(-tokens // n) * ffn * 2 <= tile_bytes("mlp", budget) <= budget // MLP_SHARE


def test_a_small_budget_tiles_finely_and_a_large_one_as_without():
    kw = dict(tokens=4_096, width=32_000, element_bytes=4)
    counts = [resolve_tiles(AutoTiles(b), "loss", **kw) for b in BUDGETS]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    # 160 MiB per rank: tiles of at most 10 MiB of fp32 logits, 81 tokens of 32000 x 4 B;
    # 4096 tokens in pieces of 81 -> 51
    assert resolve_tiles(AutoTiles(160 * 2**20), "loss", **kw) == 51
    # 80 GiB: the share (5 GiB) is above the 1 GiB cap, so "auto" as without a budget
    assert resolve_tiles(AutoTiles(80 * GIB), "loss", **kw) == resolve_tiles("auto", "loss", **kw)
    assert with_budget("auto", 0.5) == AutoTiles(GIB // 2)
    assert with_budget(4, 0.5) == 4 and with_budget("auto", None) == "auto"


@pytest.mark.parametrize("bad", [0, -1.0, True])
def test_a_bad_budget_names_the_value_and_the_fix(bad):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"tiled_loss": "auto", "memory_budget_gb": bad}).check()
    assert repr(bad) in str(err.value) and "memory_budget_gb" in str(err.value)
    if not isinstance(bad, bool):  # a bool is refused by the block's types first
        assert '"memory_budget_gb": 16' in str(err.value)
    block = HFModelConfig.from_dict({"hf_config": "x.json", "memory_budget_gb": 0.25})
    assert block.memory_budget_gb == 0.25


def _plan(**model):
    return tile_plan(RunConfig.load({"train_micro_batch_size_per_gpu": 1, "model": model}).model)


def test_the_run_says_where_its_budget_comes_from(monkeypatch):
    assert _plan(tiled_loss=4).source is None
    plan = _plan(tiled_loss="auto", memory_budget_gb=0.5)
    assert plan.budget_bytes == 0.5 * GIB and "0.5 GiB per rank" in plan.source
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = _plan(tiled_mlp="auto")
    assert plan.budget_bytes is None and "memory_budget_gb" in plan.source
    # a GPU: 70 of 80 GiB free -> 70 - max(2, 8) = 62 GiB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * GIB, 80 * GIB))
    plan = _plan(tiled_loss="auto")
    assert plan.budget_bytes == 62 * GIB and "70.0 GiB" in plan.source


def test_the_planner_resolves_the_budget_by_the_same_rule():
    from ulysses_cp.plan.shapes import model_shape

    mc = ModelConfig(tiled_mlp="auto", tiled_loss="auto", memory_budget_gb=0.001)
    t = 8_192
    want = {
        kind: resolve_tiles(AutoTiles(int(0.001 * GIB)), kind, tokens=t, width=w, element_bytes=4)
        for kind, w in (("mlp", mc.ffn_dim), ("loss", mc.vocab_size))
    }
    assert tile_counts(model_shape(mc), t) == want
    assert want["loss"] > tile_counts(model_shape(ModelConfig(tiled_loss="auto")), t)["loss"]


# ---------------------------------------------------------------- 4 ranks, exact

SEQ = 128  # 32 tokens per rank at u2 x r2


def _budget_case(rank, budget_gb):
    """Loss and SP-summed gradients of the tiny Llama (float64) under u2 x r2 with "auto"
    tiles under ``budget_gb``, against transformers' own model in one process; the tile
    counts the run used."""
    import torch.distributed as dist
    import transformers

    from tests.support.helpers import topology
    from ulysses_cp.models import hf, memory

    topo = topology(2, 2, "zigzag")
    mc = HFModelConfig(
        hf_config="configs/hf/tiny_llama.json",
        dtype="float64",
        tiled_mlp="auto",
        tiled_loss="auto",
        memory_budget_gb=budget_gb,
    )
    torch.manual_seed(0)
    model = hf.build_model(topo, mc, backend="math")
    ref = transformers.AutoModelForCausalLM.from_config(
        hf.load_config(mc.hf_config), attn_implementation="eager", dtype=torch.float64
    )
    # the same weights: the SP model's MLPs sit inside their TiledMLP wrappers
    ref.load_state_dict(
        {k.replace(".mlp.mlp.", ".mlp."): v for k, v in model.model.state_dict().items()}
    )
    ids = torch.randint(256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    logits = ref(input_ids=ids).logits
    ref_loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    ref_loss.backward()
    local = ucp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    seen: dict[str, list[int]] = {"loss": [], "mlp": []}  # the tile counts the run used
    loss_tiles, pieces = memory.loss_tiles, memory.TiledMLP.pieces
    memory.loss_tiles = lambda *a: seen["loss"].append(loss_tiles(*a)) or seen["loss"][-1]
    memory.TiledMLP.pieces = lambda m, x: seen["mlp"].append(pieces(m, x)) or seen["mlp"][-1]
    try:
        loss = model.loss(
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            topo,
            batch=local["batch"],
            tiled_loss="auto",
        )
        loss.backward()
    finally:
        memory.loss_tiles, memory.TiledMLP.pieces = loss_tiles, pieces
    worst = 0.0
    for p, q in zip(model.model.parameters(), ref.parameters(), strict=True):
        grad = torch.zeros_like(q) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), worst, seen
