"""``ulysses_cp.training.fsdp2_loading`` in one process: a model built on meta and given
storage by ``to_empty`` (no sharding: every tensor read whole) equals the saved one, and
each mismatch between model and checkpoint is refused by name. The sharded reads are
tested on 4 ranks in tests/distributed/test_fsdp2_loading.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import HF_TINY
from ulysses_cp.training.fsdp2_loading import init_buffers, load_safetensors_sharded

transformers = pytest.importorskip("transformers")


def _model(meta: bool = True, **changes):
    cfg = transformers.LlamaConfig(**{**HF_TINY, **changes})
    device = "meta" if meta else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    if meta:
        model.to_empty(device="cpu")
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    ref = _model(meta=False)
    folder = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder


def test_a_model_built_on_meta_equals_the_saved_one(saved):
    ref, folder = saved
    model = _model()
    assert load_safetensors_sharded(model, folder) == len(dict(ref.named_parameters()))
    got = dict([*model.named_parameters(), *model.named_buffers()])
    for name, want in [*ref.named_parameters(), *ref.named_buffers()]:
        assert torch.equal(got[name], want), name


def test_the_parameters_take_the_models_dtype(saved):
    ref, folder = saved
    cfg = transformers.LlamaConfig(**HF_TINY)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to_empty(device="cpu")
    load_safetensors_sharded(model, folder)
    w = model.model.embed_tokens.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, ref.model.embed_tokens.weight.float())


BAD = {
    "more layers": (dict(num_hidden_layers=3), "lacks 9 of the model's parameters"),
    "fewer layers": (dict(num_hidden_layers=1), "tensors the model lacks ['model.layers.1."),
    "wider": (dict(intermediate_size=48), "has shape [64, 32] in the checkpoint and [48, 32]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_checkpoint_of_another_config_is_refused_by_name(saved, case):
    changes, text = BAD[case]
    with pytest.raises(ValueError, match=r"model\.hf_weights") as err:
        load_safetensors_sharded(_model(**changes), saved[1])
    assert text in str(err.value), str(err.value)


def test_a_folder_without_safetensors_and_a_model_left_on_meta_are_refused(saved, tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} holds neither model.safetensors"):
        load_safetensors_sharded(_model(), tmp_path)
    cfg = transformers.LlamaConfig(**HF_TINY)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"still on the meta device .*call model.to_empty"):
        load_safetensors_sharded(model, saved[1])


def test_a_non_persistent_buffer_no_init_recomputes_is_named():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(3), persistent=False)

    model = torch.nn.Sequential(Scaled())
    with pytest.raises(ValueError, match=r"non-persistent buffers \['0.scale'\]"):
        init_buffers(model)
    hf = _model()
    assert init_buffers(hf) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    ref = _model(meta=False)
    assert torch.equal(hf.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
