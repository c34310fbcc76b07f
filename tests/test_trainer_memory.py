"""The Trainer subclasses take the memory features of the DeepSpeed JSON's ``"model"``
block through the one model recipe (``models.recipe.adopt``): the tiled MLP, activation
checkpointing and its offload, as train.py's model block gives them. Against the
one-process Trainer without them (transformers' sdpa attention, float32, SGD): the same
training and eval losses, and a saved folder that is the plain model (the tiled MLPs keep
their parameters' names). What the Trainer cannot take is refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.test_hf_trainer import (
    U2,
    assert_plain_folders,
    assert_same_losses,
    assets,  # noqa: F401 (the module's fixture)
    ref_and_sp,
    side_by_side,
)
from ulysses_cp.integrations.hf_trainer.run import model_block_options

pytest.importorskip("trl")
pytest.importorskip("peft")

LAYERS = 2  # the tiny Llama's decoder layers (tests.helpers.HF_TINY)


@pytest.mark.launcher
def test_trainer_tiled_mlp_and_checkpointing_equal_one_process(assets, tmp_path):  # noqa: F811
    """Trainer, tiny Llama, Ulysses 2, ZeRO-2, with ``"model": {"tiled_mlp": 2,
    "activation_checkpointing": true, "offload_activations": 1}``: every MLP tiled, every
    layer checkpointed (the first one's input on the host), and the losses, eval loss and
    saved folder of the one-process Trainer without them."""
    block = {"tiled_mlp": 2, "activation_checkpointing": True, "offload_activations": 1}
    sp_only = dict(zero=2, sp=U2, model_block=block)
    ref, sp = ref_and_sp("trainer", "llama", assets, tmp_path, sp_only, save=True)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2)
    assert sp_result["tiled_mlps"] == LAYERS and ref_result["tiled_mlps"] == 0
    assert sp_result["checkpointed"] == {"layers": LAYERS, "offloaded": 1}
    assert ref_result["checkpointed"] == {"layers": 0, "offloaded": 0}
    assert_same_losses(ref_result, sp_result)
    assert_plain_folders(tmp_path / "ref_model", tmp_path / "sp_model")


def test_the_trainer_refuses_what_it_cannot_take():
    """Checkpointing twice (the block's and ``gradient_checkpointing``), train.py's keys
    for building the model or its loss, and offload without checkpointing: refused, naming
    the keys and the fix."""
    ckpt = {"model": {"activation_checkpointing": True}}
    assert model_block_options(ckpt).activation_checkpointing
    with pytest.raises(ValueError, match="gradient_checkpointing=True: every layer would"):
        model_block_options(ckpt, gradient_checkpointing=True)
    for key, value in (("tiled_loss", "auto"), ("fused_loss", True), ("compile", True)):
        with pytest.raises(ValueError, match=rf"takes only .*\['{key}'\]"):
            model_block_options({"model": {key: value}})
    with pytest.raises(ValueError, match="offload_activations"):
        model_block_options({"model": {"offload_activations": True}})
    assert model_block_options({"model": {"tiled_mlp": "auto"}}).tiled_mlp == "auto"


def test_tiles_that_keep_names_match_the_wrapped_mlp():
    """``tile_mlps(keep_names=True)`` (the Trainer's): the parameters keep their names, the
    output and gradients are the untiled MLP's, and the tiles run (3 pieces)."""
    import transformers

    from tests.helpers import HF_TINY
    from ulysses_cp.models import memory

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_TINY)).double()
    mlp = model.model.layers[0].mlp
    names = [n for n, _ in model.named_parameters()]
    x = torch.randn(1, 12, HF_TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    assert memory.tile_mlps(model, 3, width=HF_TINY["intermediate_size"], keep_names=True) == 2
    assert [n for n, _ in model.named_parameters()] == names
    seen, pieces = [], memory.TiledMLP.pieces
    memory.TiledMLP.pieces = lambda m, t: seen.append(pieces(m, t)) or seen[-1]
    try:
        got = mlp(x)
        (g_got,) = torch.autograd.grad(got.square().sum(), x)
    finally:
        memory.TiledMLP.pieces = pieces
    assert seen == [3]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-12)
