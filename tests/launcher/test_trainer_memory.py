"""The Trainer subclasses take the memory features of the DeepSpeed JSON's ``"model"``
block through the one model recipe (``models.recipe.adopt``): the tiled MLP, activation
checkpointing and its offload, as train.py's model block gives them. Against the
one-process Trainer without them (transformers' sdpa attention, float32, SGD): the same
training and eval losses, and a saved folder that is the plain model (the tiled MLPs keep
their parameters' names). What the Trainer cannot take is refused by name."""

from __future__ import annotations

import pytest

from tests.launcher.test_hf_trainer import (
    U2,
    assert_plain_folders,
    assert_same_losses,
    assets,  # noqa: F401 (the module's fixture)
    ref_and_sp,
    side_by_side,
)

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
