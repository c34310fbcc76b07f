"""SequenceParallelGRPOTrainer (and SequenceParallelRLOOTrainer) against one-process
``trl.GRPOTrainer`` (``trl.RLOOTrainer``) runs (the same tiny model, prompts, reward
functions and global batch, float32, SGD at a large learning rate so that a wrong gradient
scale shows): every training and eval loss and every metric TRL logs (``reward``, ``kl``,
``entropy``, clip ratios, completion lengths, ``num_tokens``) within 1e-5 relative
(tests/launcher/test_dpo.py's comparison). Completions come from a deterministic ``rollout_func``
or from the model's own sampling (``generate``), which must draw the one-process
completions. Each case runs tests/support/grpo_worker.py: torchrun for the sequence-parallel run,
plain python for the reference, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.launcher.test_dpo import _logged, assert_lines_equal
from tests.launcher.test_hf_trainer import U2, U2R2, trainer_assets
from tests.launcher.test_hf_trainer import side_by_side as trainer_side_by_side

pytest.importorskip("trl")
pytest.importorskip("peft")

WORKER = Path(__file__).parents[1] / "support" / "grpo_worker.py"
# every loss TRL 1.16's GRPOTrainer ships but dapo (the default, in the other tests), each
# with options of its own kind: two-sided clipping, the entropy bonus (static and
# adaptive), the bias-corrected KL, per-function normalisation, reward weights,
# sequence-level importance sampling
LOSS_RUNS = [
    {"loss_type": "grpo", "entropy_coef": 0.01, "delta": 1.5},
    {"loss_type": "dr_grpo", "use_bias_correction_kl": True},
    {
        "loss_type": "bnpo",
        "epsilon_high": 0.28,
        "multi_objective_aggregation": "normalize_then_sum",
    },
    {"loss_type": "cispo"},
    {"loss_type": "sapo", "reward_weights": [1.0, 0.5]},
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "vespo", "use_adaptive_entropy": True, "entropy_coef": 0.01},
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama and the word-level tokenizer of tests/launcher/test_hf_trainer.py."""
    return trainer_assets(tmp_path_factory.mktemp("grpo_assets"))


def spec(assets: dict, out: Path, **extra) -> dict:
    """4 completions per prompt, 4 rows a micro-batch, 2 micro-batches a step (one
    generation batch: 2 prompts), each generation used twice (``num_iterations=2``: the
    importance ratios and the clipping are live)."""
    base = {
        "model": assets["llama"],
        "tokenizer": assets["tokenizer"],
        "batch": 4,
        "ga": 2,
        "steps": 3,
        "eval_steps": 3,
        "lr": 0.5,
        "n_train": 16,
        "n_eval": 2,
        "grpo": {"num_iterations": 2},
    }
    return {**base, "out": str(out), **extra}


def side_by_side(tmp_path: Path, ref: dict, sp: dict, nproc: int) -> tuple[dict, dict]:
    return trainer_side_by_side(tmp_path, ref, sp, nproc, worker=WORKER)


def assert_same_logs(ref: dict, sp: dict, *, runs: int = 1) -> None:
    """Every logged loss and TRL metric of each of the SP run's trainings equals the
    one-process run's."""
    assert sp["sp"] and not ref["sp"]
    assert len(ref["histories"]) == len(sp["histories"]) == runs
    for ref_history, sp_history in zip(ref["histories"], sp["histories"], strict=True):
        ref_lines = [_no_timing(h) for h in _logged(ref_history)]
        assert_lines_equal(ref_lines, [_no_timing(h) for h in _logged(sp_history)])
        assert {"reward", "kl", "entropy", "num_tokens"} <= ref_lines[0].keys()
        assert ref_lines[0]["loss"] != ref_lines[2]["loss"]
        assert all("attention_comm_bytes_per_step" in h for h in sp_history if "loss" in h)


def _no_timing(line: dict) -> dict:
    return {k: v for k, v in line.items() if k not in ("step_time", "eval_step_time")}


def completions(out: str, rank: int) -> list:
    return json.loads((Path(out) / f"completions_{rank}.json").read_text())


@pytest.mark.launcher
def test_grpo_u2_zero3_rollout_func_equals_one_process(assets, tmp_path):
    """Ulysses 2, ZeRO-3, a ``rollout_func``, the default ``dapo`` loss with truncated
    completions masked and the entropy mask (``top_entropy_quantile``), a reference model
    built by TRL (``beta=0.1``; under ZeRO-3 a partitioned DeepSpeed inference engine):
    losses and metrics equal one process."""
    kw = {
        "grpo": {
            "num_iterations": 2,
            "mask_truncated_completions": True,
            "top_entropy_quantile": 0.5,
        }
    }
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=3, sp=U2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


@pytest.mark.launcher
def test_grpo_seen_failing_with_a_doubled_gradient_scale(assets, tmp_path):
    """The comparison above fails when the SP run's gradient scale is doubled."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, scale=2.0)
    with pytest.raises(AssertionError):
        assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


@pytest.mark.launcher
def test_grpo_u2_zero2_generate_draws_the_one_process_completions(assets, tmp_path):
    """The model's own sampling (``generate``, temperature 0.9): SP rank 0 draws what one
    process draws, the other SP rank trains on the same completions, and losses and
    metrics equal one process."""
    kw = {"rollout": "generate", "grpo": {"num_iterations": 2, "loss_type": "grpo"}}
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))
    drawn = completions(ref["out"], 0)
    # each generation serves 2 steps (num_iterations=2): 2 in 3 steps, and the evaluation's
    assert len(drawn) == 3 * 8
    assert completions(sp["out"], 0) == completions(sp["out"], 1) == drawn


@pytest.mark.launcher
def test_grpo_sp_rank_given_other_completions_trains_on_rank_0s(assets, tmp_path):
    """SP rank 1's ``rollout_func`` returns other completions: rank 0's are broadcast, so
    both ranks train on them and the run equals one process."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, skew=True)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))
    assert completions(sp["out"], 0) == completions(sp["out"], 1)


@pytest.mark.launcher
def test_grpo_seen_failing_when_sp_ranks_keep_their_own_completions(assets, tmp_path):
    """Without the broadcast, SP rank 1 trains on its own completions: the shard's input
    check refuses the step on every rank (no silent mixing of two batches)."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, skew=True, no_broadcast=True)
    with pytest.raises(AssertionError, match="differs between sequence-parallel ranks"):
        side_by_side(tmp_path, ref, sp, nproc=2)


@pytest.mark.launcher
def test_grpo_every_loss_type_u2_zero1(assets, tmp_path):
    """Each of TRL's other loss types (one training each, in one launch), with the options
    of :data:`LOSS_RUNS`: the same losses and metrics as one process."""
    runs = [{"num_iterations": 2, **run} for run in LOSS_RUNS]
    ref = spec(assets, tmp_path / "ref", grpo=runs)
    sp = spec(assets, tmp_path / "sp", zero=1, sp=U2, grpo=runs)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2), runs=len(runs))


@pytest.mark.launcher
def test_grpo_lora_u2_zero0_equals_one_process(assets, tmp_path):
    """A peft LoRA adapter (the KL's reference is the adapter switched off), ZeRO-0."""
    ref = spec(assets, tmp_path / "ref", lora=True)
    sp = spec(assets, tmp_path / "sp", zero=0, sp=U2, lora=True)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


@pytest.mark.launcher
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_grpo_u2_dp2_equals_one_process(assets, tmp_path, zero):
    """Ulysses 2 x data parallel 2 (4 ranks), ZeRO 1-3: each replica generates and scores
    half of the prompt groups, the rewards are gathered over the replicas (not the 4 processes) and
    each replica takes its own advantages; one micro-batch a step (the shuffle inside a
    generation batch is each process's own), whole evaluation batches (n_eval 8)."""
    kw = {"ga": 1, "n_eval": 8, "grpo": {"num_iterations": 2, "scale_rewards": "batch"}}
    ref = spec(assets, tmp_path / "ref", batch=8, **kw)
    sp = spec(assets, tmp_path / "sp", zero=zero, sp=U2, batch=4, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=4))


@pytest.mark.launcher
@pytest.mark.parametrize("degrees", ["u2", "u2r2"])
@pytest.mark.parametrize("policy", ["loaded", "path"])
def test_grpo_trl_reference_under_zero3_without_deepspeed_comm(assets, tmp_path, policy, degrees):
    """As tests/launcher/test_dpo.py's: no ``ucp.init_distributed`` in the script, TRL's reference
    (``beta=0.1``) built under ``zero.Init``, the policy loaded first or given as its
    folder (TRL builds it), "auto" batch sizes."""
    sp_block, nproc = (U2R2, 4) if degrees == "u2r2" else (U2, 2)
    ref = spec(assets, tmp_path / "ref", policy=policy)
    sp = spec(assets, tmp_path / "sp", zero=3, sp=sp_block, bare=True, policy=policy)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=nproc))


@pytest.mark.launcher
@pytest.mark.slow
def test_grpo_u2r2_zero3_generate_equals_one_process(assets, tmp_path):
    """The model's own sampling under hybrid Ulysses 2 x ring 2 and ZeRO-3 (the
    parameters gathered for generation on every rank)."""
    kw = {"rollout": "generate", "grpo": {"num_iterations": 2, "loss_type": "grpo"}}
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=3, sp=U2R2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=4))
    drawn = completions(ref["out"], 0)
    assert all(completions(sp["out"], rank) == drawn for rank in range(4))


@pytest.mark.launcher
def test_rloo_u2_zero2_generate_equals_one_process(assets, tmp_path):
    """``SequenceParallelRLOOTrainer`` against one-process ``trl.RLOOTrainer``: the
    model's own sampling, the leave-one-out baselines and the sequence-level KL penalty
    (``beta=0.1``) in the rewards, Ulysses 2, ZeRO-2."""
    kw = {"trainer": "rloo", "rollout": "generate", "grpo": {"num_iterations": 2}}
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))
    assert completions(sp["out"], 0) == completions(sp["out"], 1) == completions(ref["out"], 0)


@pytest.mark.launcher
def test_rloo_seen_failing_with_a_doubled_gradient_scale(assets, tmp_path):
    kw = {"trainer": "rloo", "rollout": "generate", "grpo": {"num_iterations": 2}}
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, scale=2.0, **kw)
    with pytest.raises(AssertionError):
        assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


# ---------------------------------------------------------------- refusals (no processes)


def grpo_args(**kw) -> SimpleNamespace:
    train = dict(world_size=4, per_device_train_batch_size=2, steps_per_generation=2)
    evals = dict(per_device_eval_batch_size=2, num_generations_eval=None, eval_strategy="steps")
    engines = dict(use_vllm=False, use_transformers_continuous_batching=False)
    base = dict(**train, **evals, **engines, num_generations=4, generation_batch_size=16)
    return SimpleNamespace(**{**base, **kw})
