"""``"tiled_mlp"`` / ``"tiled_loss"``: ``"auto"`` sizes tiles by bytes (``core/tiles.py``),
the run and the planner resolve it by the same rule, and auto tiles change nothing but
memory: the loss and every gradient equal the untiled model's."""

from __future__ import annotations

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import ROOT
from ulysses_cp.config import ModelConfig
from ulysses_cp.core import tiles
from ulysses_cp.core.tiles import resolve_tiles
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.models.memory import LossPlan, TiledMLP, lm_loss, loss_tiles
from ulysses_cp.plan.memory import activation_bytes
from ulysses_cp.plan.search import Hardware, Run, predict
from ulysses_cp.plan.shapes import ModelShape


def test_auto_tiles_follow_the_byte_budgets():
    # Llama-3-8B, 5M tokens over 8 ranks: 625,000 tokens per rank. Worked by hand:
    # loss: 625000 * 128256 * 4 B = 320.64e9 B of fp32 logits / 1 GiB = 298.6 -> 299 tiles
    # mlp: 625000 * 14336 * 2 B = 17.92e9 B of bf16 (tokens, ffn) / 128 MiB = 133.5 -> 134
    assert resolve_tiles("auto", "loss", tokens=625_000, width=128_256, element_bytes=2) == 299
    assert resolve_tiles("auto", "mlp", tokens=625_000, width=14_336, element_bytes=2) == 134
    # one MLP tile of Llama-3-8B is near ALST's hidden (4096) tokens: 2**27 / (14336 * 2)
    assert 4096 <= 2**27 // (14_336 * 2) <= 4096 * 1.2
    # float64 logits take 8 bytes; a short sequence is one tile (untiled)
    assert resolve_tiles("auto", "loss", tokens=2**20, width=2**8, element_bytes=8) == 2
    assert resolve_tiles("auto", "loss", tokens=2**20, width=2**8, element_bytes=4) == 1
    assert resolve_tiles("auto", "mlp", tokens=64, width=64, element_bytes=4) == 1
    for n, want in ((0, 1), (1, 1), (7, 7)):  # integers are counts; 0 and 1 are untiled
        assert resolve_tiles(n, "loss", tokens=10**9, width=10**5, element_bytes=4) == want


@pytest.mark.parametrize("bad", [-1, "Auto", True, 2.5])
def test_bad_tile_settings_name_the_value_and_the_fix(bad):
    with pytest.raises(ValueError) as err:
        resolve_tiles(bad, "mlp", tokens=1, width=1, element_bytes=4)
    assert repr(bad) in str(err.value) and 'tiled_mlp: "auto"' in str(err.value)
    assert ModelConfig.from_dict({"tiled_mlp": "auto", "tiled_loss": "auto"}).tiled_loss == "auto"


def _shape(**kw) -> ModelShape:
    return ModelShape(
        "hf",
        128_256,
        4096,
        32,
        32,
        8,
        128,
        14_336,
        8_030_000_000,
        218_000_000,
        2,
        activation_checkpointing=True,
        offload_activations=True,
        **kw,
    )


def test_the_planner_resolves_auto_by_the_same_rule():
    """The planner's activation for "auto" equals its activation for the counts the rule
    gives at that length, and predict reports those counts."""
    N, P = 5_000_000 // 8 * 8, 8
    t = N // P
    mlp = resolve_tiles("auto", "mlp", tokens=t, width=14_336, element_bytes=2)
    loss = resolve_tiles("auto", "loss", tokens=t, width=128_256, element_bytes=2)
    kw = dict(seq_len=N, batch=1, ulysses=8, ring=1)
    auto = activation_bytes(_shape(tiled_mlp="auto", tiled_loss="auto"), **kw)
    assert auto == activation_bytes(_shape(tiled_mlp=mlp, tiled_loss=loss), **kw)
    assert auto != activation_bytes(_shape(tiled_mlp=8, tiled_loss=8), **kw)
    run = Run(8, 1, "zigzag", 3, 1, True, True, "auto", "auto")
    got = predict(_shape(), run, seq_len=N, batch=1, micro_steps=1, world=8, hw=Hardware())
    assert got["tiles"] == {"mlp": mlp, "loss": loss}
    assert got["activation_bytes_per_rank"] == auto["total"]


def _loss_and_grads(model, topo, ids, labels, tiled_loss):
    model.zero_grad()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    loss = lm_loss(model, model.head, ids, pos, labels, topo, plan=LossPlan(tiled_loss))
    loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters())]


def test_auto_tiles_give_the_untiled_loss_and_gradients(monkeypatch):
    """Reference decoder in float64: budgets shrunk so that "auto" makes several tiles on a
    tiny model (checked), then loss and every gradient equal the untiled ones."""
    monkeypatch.setattr(tiles, "LOSS_TILE_BYTES", 48 * 64 * 8)  # 48 tokens of fp64 logits
    monkeypatch.setattr(tiles, "MLP_TILE_BYTES", 20 * 32 * 8)  # 20 tokens of a (s, 32) tile
    topo = ucp.init_topology(1, 1)
    torch.manual_seed(3)
    ids = torch.randint(64, (2, 100))
    labels = torch.randint(64, (2, 100))
    labels[:, :7] = -100
    results = []
    for setting in (0, "auto"):
        sizes = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32)
        mc = ModelConfig(**sizes, tiled_mlp=setting, tiled_loss=setting)
        torch.manual_seed(0)
        model = Decoder(mc, ucp.Attention(topo, backend="math")).double()
        tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
        if setting == "auto":  # the rule really tiles: ceil(200*64*8 / 24576) = 5 loss tiles
            assert loss_tiles("auto", model.head, ids) == 5
            assert len(tiled) == 2 and tiled[0].pieces(torch.zeros(2, 100, 16).double()) == 10
        else:
            assert not tiled and loss_tiles(0, model.head, ids) == 1
        results.append(_loss_and_grads(model, topo, ids, labels, setting))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_auto_tiles_on_a_hugging_face_model(monkeypatch):
    """The Hugging Face path: tile_mlps wraps the MLPs with the config's intermediate
    width, and the tiled loss resolves from the LM head; loss and gradients are exact."""
    pytest.importorskip("transformers")
    from ulysses_cp.config import HFModelConfig
    from ulysses_cp.models import hf

    monkeypatch.setattr(tiles, "LOSS_TILE_BYTES", 40 * 256 * 8)
    monkeypatch.setattr(tiles, "MLP_TILE_BYTES", 30 * 128 * 8)
    topo = ucp.init_topology(1, 1)
    ids = torch.randint(256, (1, 96))
    labels = torch.randint(256, (1, 96))
    results = []
    for setting in (0, "auto"):
        torch.manual_seed(0)
        mc = HFModelConfig(
            hf_config="configs/hf/tiny_llama.json",
            dtype="float64",
            tiled_mlp=setting,
            tiled_loss=setting,
        )
        model = hf.build_model(topo, mc, backend="math")
        tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
        assert len(tiled) == (2 if setting == "auto" else 0)
        if setting == "auto":  # ceil(96*256*8 / (40*256*8)) = 3, ceil(96/30) = 4
            assert loss_tiles("auto", model.head, ids) == 3
            assert tiled[0].pieces(torch.zeros(1, 96, 64, dtype=torch.float64)) == 4
        model.zero_grad()
        pos = torch.arange(96)[None]
        loss = model.loss(ids, pos, labels, topo, tiled_loss=setting)
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_table_says_every_number_is_a_prediction():
    from ulysses_cp.config import RunConfig
    from ulysses_cp.plan.cli import plan, table

    raw = RunConfig.load(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json").raw
    # a small reduce bucket: ZeRO-2's default one (5e8 elements) would not fit this GPU
    raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "reduce_bucket_size": 100_000}
    run = RunConfig.load(raw)
    result = plan(run, world=4, hw=Hardware(gpu_mem_gb=0.02, gpus_per_node=2), seq_step=16)
    lines = table(result).splitlines()
    assert lines[0].startswith("PREDICTED, not measured.")
    assert lines[-1].endswith(
        "is a prediction of the planner's cost model (docs/planner/cost-model.md), "
        "not a measurement"
    )
    n = result["config"]["max_seq_len"]
    assert any(
        f"predicted peak of the config as written at its longest sequence, {n}" in x for x in lines
    )
    at = result["config_at_max_seq_len"]
    assert at["seq_len"] == n and at["peak_bytes_per_rank"] <= 0.02 * 2**30


@pytest.mark.parametrize(
    "config, gib, goal",
    [
        ("llama3_8b_8gpu_zero3_u8r1.json", 80, 5_000_000),
        ("llama3_8b_8xh200_zero3_u8r1.json", 141, 9_000_000),
    ],
)
def test_the_8b_config_is_predicted_to_reach_the_goals(config, gib, goal):
    """The shipped Llama-3-8B configs (auto tiles) on 8 GPUs with 2 TiB of host memory per
    node: the planner's longest sequence for the config as written (its own search, no
    candidates), bound by the GPU and by the host (the 141 GiB config offloads the inputs
    of 27 of the 32 layers: every layer's would not fit the host at 9M tokens)."""
    pytest.importorskip("transformers")
    from ulysses_cp.config import RunConfig
    from ulysses_cp.plan.search import GiB, filled, longest
    from ulysses_cp.plan.shapes import model_shape
    from ulysses_cp.plan.written import base_run

    run = RunConfig.load(ROOT / "configs" / config)
    assert run.model.tiled_mlp == run.model.tiled_loss == "auto"
    shape, base, hw = model_shape(run.model, dtype_bytes=2), base_run(run), Hardware(gib)
    fill = lambda n: filled(  # noqa: E731  (the GPU peak, or the host's share if fuller)
        predict(shape, base, seq_len=n, batch=1, micro_steps=1, world=8, hw=hw), hw
    )
    assert longest(fill, 16 * 1024, gib * GiB) >= goal
