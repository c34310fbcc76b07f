"""What the Trainer cannot take from the ``"model"`` block is refused by name, and the
Trainer's tiled MLPs keep their parameters' names (tests/launcher/test_trainer_memory.py
trains with them)."""

from __future__ import annotations

import pytest
import torch

from ulysses_cp.integrations.hf_trainer.run import model_block_options


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

    from tests.support.helpers import HF_TINY
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
