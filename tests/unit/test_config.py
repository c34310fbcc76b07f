"""Every config block is declared in ulysses_cp.config and parsed once: unknown keys and
values of the wrong type are refused naming the key; the DeepSpeed part is never changed."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.helpers import ROOT
from ulysses_cp.config import (
    DataConfig,
    EvalConfig,
    HFModelConfig,
    ModelConfig,
    RunConfig,
    SequenceParallelConfig,
    TrainingConfig,
    model_config,
)
from ulysses_cp.training.build import cpu_optimizer

SP, M, HF, D, T = SequenceParallelConfig, ModelConfig, HFModelConfig, DataConfig, TrainingConfig
E = EvalConfig
CASES = [
    (SP, {"ring_degree": True}, "sequence_parallel.ring_degree must be an integer, got True"),
    (SP, {"check_inputs": "yes"}, "check_inputs must be true or false, got 'yes'"),
    (SP, {"collective_timeout_s": "60"}, "collective_timeout_s must be a number, got '60'"),
    (SP, {"layout": "ring"}, "layout must be one of ['zigzag', 'contiguous'], got 'ring'"),
    (M, {"dim": 12.5}, "model.dim must be an integer, got 12.5"),
    (M, {"tiled_mlp": -1}, 'model.tiled_mlp must be "auto" (tiles sized by bytes) or a num'),
    (M, {"tiled_loss": "Auto"}, "model.tiled_loss must be an integer or one of ['auto'], got"),
    (HF, {"hf_config": "x", "tiled_loss": -2}, 'got -2; for example tiled_loss: "auto"'),
    (HF, {"hf_config": 3}, "model.hf_config must be a string or an object, got 3"),
    (HF, {"hf_config": "x", "dtype": "half"}, "model.dtype must be one of"),
    (D, {"files": ["a.txt", 2]}, "data.files must be a list of strings, got ['a.txt', 2]"),
    (D, {"task": "wiki"}, "data.task must be one of ['kv_recall', 'text', 'dataset'], got 'wiki'"),
    (D, {"tokenize_workers": -1}, "data.tokenize_workers must be >= 0"),
    (E, {"fraction": "0.1"}, "eval.fraction must be a number, got '0.1'"),
    (E, {"fraction": 0.1, "files": ["a.jsonl"]}, "give eval.files (held-out files) or eval.fra"),
    (E, {"interval": 10, "batches": 0}, "eval.batches must be >= 1, got 0"),
    (T, {"max_steps": "10"}, "training.max_steps must be an integer, got '10'"),
    (T, {"on_nonfinite": "ignore"}, "training.on_nonfinite must be one of ['skip', 'stop']"),
    (T, {"log_interval": 0}, "training.log_interval must be >= 1"),
]


@pytest.mark.parametrize("cls, block, message", CASES)
def test_a_value_of_the_wrong_type_names_its_key(cls, block, message):
    with pytest.raises(ValueError) as err:
        cls.from_dict(block)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("cls", "block", "message"),
    [
        (T, {"max_stesp": 3}, "['max_stesp'] (did you mean 'max_steps' for 'max_stesp'?)"),
        (SP, {"ulyses_degree": 2, "rng_degree": 2}, "'ring_degree' for 'rng_degree'"),
        (M, {"qqq": 1}, "unknown keys in the \"model\" block: ['qqq']; valid keys:"),
    ],
)
def test_a_misspelt_key_inside_a_block_gets_the_closest_ones(cls, block, message):
    """A block's unknown key is named with the closest valid ones (none when none is
    close), as a misspelt top-level key is."""
    with pytest.raises(ValueError) as err:
        cls.from_dict(block)
    assert message in str(err.value)
    assert "valid keys" in str(err.value)


def test_a_block_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match='the "training" block must be a JSON object'):
        TrainingConfig.from_dict([1, 2])


def test_a_shipped_config_parses_once_into_every_block():
    run = RunConfig.load(ROOT / "configs" / "tiny_cpu_hf_llama_u2r2.json")
    assert isinstance(run.model, HFModelConfig) and run.model.hf_config.endswith("tiny_llama.json")
    assert (run.sequence_parallel.ulysses_degree, run.sequence_parallel.ring_degree) == (2, 2)
    assert run.raw["sequence_parallel"]["ulysses_degree"] == 2
    assert isinstance(model_config({"dim": 64, "n_heads": 4}), ModelConfig)


def test_the_deepspeed_config_is_never_changed():
    """The CPU optimizer swap returns a new config; the one given keeps its blocks."""
    run = RunConfig.load(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json")
    before = copy.deepcopy(run.raw)
    optimizer, swapped = cpu_optimizer(run, torch.nn.Linear(2, 2))
    assert run.raw == before
    if optimizer is not None:  # CPU: torch's AdamW, the block removed from the copy only
        assert "optimizer" not in swapped.raw and "optimizer" in run.raw


def test_deepspeeds_keys_are_read_without_importing_it():
    """The top-level keys DeepSpeed knows, read from its constants' source, are those the
    imported module holds (a config is parsed without importing DeepSpeed)."""
    import deepspeed.runtime.constants as ds_constants

    from ulysses_cp.schema import _deepspeed_constants

    names = vars(ds_constants).items()
    imported = {v for n, v in names if n.isupper() and isinstance(v, str) and v.isidentifier()}
    assert set(_deepspeed_constants()) == imported and len(imported) > 50


def test_engine_key_is_read_and_checked():
    from ulysses_cp.config import RunConfig

    assert RunConfig.load({}).engine == "deepspeed"
    assert RunConfig.load({"engine": "fsdp2"}).engine == "fsdp2"
    with pytest.raises(
        ValueError, match=r"\"engine\" must be one of \['deepspeed', 'fsdp2'\], got 'fsdp'"
    ):
        RunConfig.load({"engine": "fsdp"})
    from ulysses_cp.training.engine import deepspeed_part

    assert "engine" not in deepspeed_part(
        RunConfig.load({"engine": "fsdp2", "gradient_clipping": 1.0})
    )
