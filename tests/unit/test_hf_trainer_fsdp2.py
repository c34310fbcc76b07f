"""The refusals of the Trainer subclasses' FSDP2 path (ulysses_cp/integrations/hf_trainer/
fsdp.py), with no processes: Accelerate's ParallelismConfig sizes beside our degrees, the
FSDP settings this path does not apply, the file given as sequence_parallel_config=, and
the sharded checkpoint state (a round trip; a model-only checkpoint refused on resume)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulysses_cp.config import RunConfig
from ulysses_cp.integrations.hf_trainer.fsdp import (
    check_fsdp_arguments,
    check_parallelism_config,
)
from ulysses_cp.integrations.hf_trainer.fsdp_checkpoint import (
    SHARDED,
    check_sharded,
    load_sharded_state,
    save_sharded_state,
)
from ulysses_cp.integrations.hf_trainer.mixin import _fsdp_run_config

RUN = RunConfig.load({"sequence_parallel": {"ulysses_degree": 2}}, trainer=True)


def pc(**sizes):
    """A stand-in for accelerate's ParallelismConfig (its size attributes)."""
    base = dict(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1)
    return SimpleNamespace(**{**base, **sizes})


def args(**kw):
    base = dict(fsdp=True, fsdp_config={"version": 2}, save_strategy="no", save_only_model=False)
    base["load_best_model_at_end"] = False
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("config", [None, pc(), pc(dp_shard_size=4)])
def test_parallelism_config_consistent_with_ours_is_honoured(config):
    check_parallelism_config(config, 4, 2, 1)  # no error


@pytest.mark.parametrize(
    "sizes, words",
    [
        ({"cp_size": 2}, ["cp_size=2", "ulysses(2) * ring(1) = 2", "set cp_size=1"]),
        ({"sp_size": 2}, ["sp_size=2", "set sp_size=1"]),
        ({"tp_size": 2}, ["tp_size=2", "tensor parallelism"]),
        ({"dp_replicate_size": 2}, ["dp_replicate_size=2", "HSDP", "dp_shard_size=4"]),
        ({"dp_shard_size": 2}, ["dp_shard_size=2", "on 4 ranks", "must be 4"]),
    ],
)
def test_parallelism_config_refused_by_name(sizes, words):
    with pytest.raises(ValueError) as err:
        check_parallelism_config(pc(**sizes), 4, 2, 1)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize(
    "given, words",
    [
        ({"fsdp": None}, ["fsdp=", "deepspeed= JSON"]),
        ({"fsdp_config": {"version": 1}}, ['"version"] is 1', "FSDP2 only"]),
        ({"fsdp_config": {"version": 2, "cpu_offload": True}}, ["cpu_offload"]),
        (
            {"fsdp_config": {"version": 2, "activation_checkpointing": True}},
            ["activation_checkpointing", "model block"],
        ),
        (
            {"save_strategy": "steps", "load_best_model_at_end": True},
            ["load_best_model_at_end=True", "from_pretrained"],
        ),
    ],
)
def test_fsdp_arguments_refused_by_name(given, words):
    with pytest.raises(ValueError) as err:
        check_fsdp_arguments(args(**given), RUN)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_fsdp_arguments_accepted():
    check_fsdp_arguments(args(), RUN)
    check_fsdp_arguments(args(save_strategy="steps", save_only_model=True), RUN)
    check_fsdp_arguments(args(save_strategy="steps"), RUN)  # with the optimizer's state


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_state_round_trip_and_a_model_only_checkpoint_refused(tmp_path):
    """The model's and AdamW's state come back exactly (one process, DCP without a process
    group); a checkpoint folder without the shards (save_only_model=True) is refused by
    name on resume."""

    def setup(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = setup(0)
    for _ in range(2):
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    save_sharded_state(model, opt, tmp_path / "checkpoint-2" / SHARDED)
    model2, opt2 = setup(1)
    load_sharded_state(model2, SimpleNamespace(optimizer=opt2), tmp_path / "checkpoint-2" / SHARDED)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k]), k
    (tmp_path / "checkpoint-4").mkdir()  # the gathered model alone
    with pytest.raises(ValueError, match=r"checkpoint-4 has no sharded .*save_only_model=False"):
        check_sharded(tmp_path / "checkpoint-4" / SHARDED)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization"),
        # not one of the settings we read: accepted without a word before (seen passing)
        ({"steps_per_print": 5, "_comment": "kept"}, "steps_per_print"),
    ],
)
def test_deepspeed_keys_in_the_fsdp_file_are_refused_by_name(extra, named):
    run = RunConfig.load(
        {"sequence_parallel": {"ulysses_degree": 2}, "engine": "fsdp2", **extra}, trainer=True
    )
    with pytest.raises(ValueError, match=rf"has DeepSpeed settings \({named}\): FSDP2"):
        check_fsdp_arguments(args(), run)


def test_the_file_is_read_through_the_one_door(tmp_path):
    """A typo in the file is reported as train.py reports it (file, line, did-you-mean);
    a file without the block, and a DeepSpeed JSON beside it, are refused."""
    path = tmp_path / "sp.json"
    path.write_text('{\n  "sequence_parallel": {\n    "ulysses_degre": 2\n  }\n}\n')
    with pytest.raises(ValueError, match=r"sp\.json:3:.*ulysses_degree"):
        _fsdp_run_config(None, str(path))
    path.write_text('{"model": {"lean_norms": false}}')
    with pytest.raises(ValueError, match="has no sequence_parallel block"):
        _fsdp_run_config(None, str(path))
    with pytest.raises(ValueError, match=r"both TrainingArguments\(deepspeed=\.\.\.\)"):
        _fsdp_run_config(args(deepspeed={"zero_optimization": {}}), RUN)


def rollout_args(**kw):
    """A stand-in for GRPOConfig under FSDP2 (the fields the rollout mixin reads first)."""
    base = dict(
        world_size=4,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        per_device_eval_batch_size=2,
        num_generations_eval=None,
        eval_strategy="steps",
        use_vllm=False,
        use_transformers_continuous_batching=False,
        num_generations=4,
        generation_batch_size=16,
        deepspeed=None,
        output_dir="out",
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("name", ["SequenceParallelGRPOTrainer", "SequenceParallelRLOOTrainer"])
def test_rollout_trainers_read_the_fsdp2_file(name):
    """Under FSDP2 the rollout trainers read the block of ``sequence_parallel_config=``:
    the generation batch counts the replicas, and vLLM and a batch that does not split
    into whole prompt groups are refused by name, before anything is built."""
    pytest.importorskip("trl")
    from ulysses_cp.integrations import hf_trainer

    cls = getattr(hf_trainer, name)
    block = {"sequence_parallel": {"ulysses_degree": 2}}
    with pytest.raises(ValueError, match="use_vllm=True is not supported"):
        cls(model=None, args=rollout_args(use_vllm=True), sequence_parallel_config=block)
    with pytest.raises(
        ValueError, match=r"\(1\) x dp replicas \(2\) x steps_per_generation \(1\) = 2"
    ):
        small = rollout_args(per_device_train_batch_size=1, steps_per_generation=1)
        cls(model=None, args=small, sequence_parallel_config=block)
    given = rollout_args(model_init=None)
    # the rollout checks pass; the mixin then refuses these arguments (no fsdp=) by name
    with pytest.raises(ValueError, match="is the sequence-parallel file of an FSDP2 run"):
        cls(model=None, args=given, sequence_parallel_config=block)
    assert given.generation_batch_size == 2 * 2 * 2  # the replicas' rows, not the processes'


def test_fsdp2_bytes_per_step_by_hand():
    """FSDP2's bytes per step for the Trainer (metrics.fsdp2_bytes_per_step) against the
    count by hand: on 2 ranks each rank sends its half of the gathered parameters and of
    the reduced gradients; gathered forward and backward (reshard_after_forward) every
    micro step, reduced once a step; bf16 gathers 2 bytes an element and reduces 4."""
    import torch

    from ulysses_cp.integrations.hf_trainer.metrics import fsdp2_bytes_per_step

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3, bias=False))
    half = -(-(110 + 30) // 2)  # a rank's share, padded up
    kw = dict(world=2, micro_steps=3)
    got = fsdp2_bytes_per_step(model, reshard_after_forward=True, bf16=False, **kw)
    assert got == 3 * 2 * half * 4 + half * 4
    got = fsdp2_bytes_per_step(model, reshard_after_forward=False, bf16=False, **kw)
    assert got == 3 * half * 4 + half * 4
    got = fsdp2_bytes_per_step(model, reshard_after_forward=True, bf16=True, **kw)
    assert got == 3 * 2 * half * 2 + half * 4
    one = dict(reshard_after_forward=True, bf16=False, micro_steps=3)
    assert fsdp2_bytes_per_step(model, world=1, **one) == 0
    model[1].weight.requires_grad_(False)  # frozen (LoRA): the formula does not apply
    assert fsdp2_bytes_per_step(model, reshard_after_forward=True, bf16=False, **kw) is None
