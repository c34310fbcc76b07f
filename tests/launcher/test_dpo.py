"""SequenceParallelDPOTrainer against one-process ``trl.DPOTrainer`` runs (the same tiny
models, data and global batch, float32, SGD at a large learning rate so that a wrong
gradient scale shows): every training and eval loss and every metric TRL logs
(``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``,
``num_tokens``) within 1e-5 relative (1e-5 absolute for values under 1). Each case runs
tests/support/dpo_worker.py: torchrun for the sequence-parallel run, plain python for the
reference, side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.test_hf_trainer import U2, U2R2, trainer_assets
from tests.launcher.test_hf_trainer import side_by_side as trainer_side_by_side

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("peft")

WORKER = Path(__file__).parents[1] / "support" / "dpo_worker.py"
RTOL = 1e-5
# what this package adds to a training log line, and timings: not compared
OURS = {
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "peak_mem_mb",
    "attention_comm_bytes_per_step",
    "comm_bytes_per_step",
}
# every loss TRL 1.16's DPOTrainer ships
LOSS_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama and the word-level tokenizer of tests/launcher/test_hf_trainer.py."""
    return trainer_assets(tmp_path_factory.mktemp("dpo_assets"))


def spec(assets: dict, out: Path, **extra) -> dict:
    base = {
        "model": assets["llama"],
        "tokenizer": assets["tokenizer"],
        "batch": 2,
        "ga": 2,
        "steps": 3,
        "eval_steps": 3,
        "lr": 1.0,
        "n_train": 16,
        "n_eval": 4,
    }
    return {**base, "out": str(out), **extra}


def side_by_side(tmp_path: Path, ref: dict, sp: dict, nproc: int) -> tuple[dict, dict]:
    return trainer_side_by_side(tmp_path, ref, sp, nproc, worker=WORKER)


def _logged(history: list[dict]) -> list[dict]:
    """The training and eval log lines, without timings and this package's metrics."""

    def kept(key: str) -> bool:
        timing = "runtime" in key or "per_second" in key
        return key not in OURS and key not in ("learning_rate", "epoch") and not timing

    lines = [h for h in history if "loss" in h or "eval_loss" in h]
    return [{k: v for k, v in h.items() if kept(k)} for h in lines]


def assert_lines_equal(ref_lines: list[dict], sp_lines: list[dict]) -> None:
    """3 training log lines and 1 evaluation's on each side, with the same keys and every
    value within 1e-5 relative, or 1e-5 absolute for values under 1 (also the GRPO
    tests')."""
    assert len(ref_lines) == len(sp_lines) == 4  # 3 training lines, 1 evaluation
    for step, (a, b) in enumerate(zip(ref_lines, sp_lines, strict=True)):
        # grad_norm: DeepSpeed's ZeRO-0 engine under LoRA reports none
        assert a.keys() - {"grad_norm"} == b.keys() - {"grad_norm"}, sorted(a.keys() ^ b.keys())
        for key, want in a.items():
            if key not in b:
                continue
            if want is None:  # TRL logs None for a metric with no value (GRPO): on both sides
                assert b[key] is None, (step, key, b[key])
                continue
            # abs: a difference of two O(1) float32 values (rewards/margins) is exact to
            # their precision, not to its own
            assert b[key] == pytest.approx(want, rel=RTOL, abs=RTOL), (step, key, b[key], want)


def assert_same_logs(ref: dict, sp: dict) -> None:
    """Every logged loss and TRL metric of the SP run equals the one-process run's."""
    assert sp["sp"] and not ref["sp"]
    ref_lines, sp_lines = _logged(ref["history"]), _logged(sp["history"])
    assert_lines_equal(ref_lines, sp_lines)
    assert {"rewards/margins", "logps/chosen", "entropy", "num_tokens"} <= ref_lines[0].keys()
    losses = [h["loss"] for h in ref_lines[:3]]
    assert losses[0] != losses[-1]  # the steps changed the model
    sp_metrics = [h for h in sp["history"] if "loss" in h]
    assert all("attention_comm_bytes_per_step" in h for h in sp_metrics)


def test_dpo_u2_zero2_equals_one_process(assets, tmp_path):
    """Ulysses 2, ZeRO-2, gradient accumulation 2, the reference built by TRL from the
    policy's path: losses and metrics equal one process."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_dpo_seen_failing_with_a_doubled_gradient_scale(assets, tmp_path):
    """The comparison above fails when the SP run's gradient scale is doubled."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, scale=2.0)
    with pytest.raises(AssertionError):
        assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_dpo_every_loss_type_u2_zero1(assets, tmp_path):
    """All of TRL's loss types at once (weighted sum), a reference model given as
    ``ref_model``, longer completions: the same losses and metrics as one process."""
    kw = dict(loss_type=LOSS_TYPES, label_smoothing=0.1, ref="given", long=True, lr=0.01)
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=1, sp=U2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_dpo_weighting_ld_alpha_and_js_divergence_u2_zero2(assets, tmp_path):
    """WPO weights (``log_sum_sq_probs``), LD-DPO's ``ld_alpha`` (per-token masks of the
    shared and the tail part of the completions) and the Jensen-Shannon f-divergence:
    TRL's code on the gathered per-token values, the same as one process."""
    kw = dict(use_weighting=True, ld_alpha=0.5, f_divergence="js_divergence", long=True)
    ref = spec(assets, tmp_path / "ref", **kw)
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, **kw)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_dpo_lora_u2_zero0_equals_one_process(assets, tmp_path):
    """A peft LoRA adapter (the reference is the adapter switched off), ZeRO-0."""
    ref = spec(assets, tmp_path / "ref", lora=True)
    sp = spec(assets, tmp_path / "sp", zero=0, sp=U2, lora=True)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_dpo_precomputed_reference_u2_zero2(assets, tmp_path):
    """``precompute_ref_log_probs=True``: the reference log-probs computed before
    training, the same as one process's."""
    ref = spec(assets, tmp_path / "ref", precompute=True)
    sp = spec(assets, tmp_path / "sp", zero=2, sp=U2, precompute=True)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_dpo_u2_dp2_equals_one_process(assets, tmp_path, zero):
    """Ulysses 2 x data parallel 2 (4 ranks), ZeRO 1-3: each replica takes one pair per
    micro-batch, the one-process run two. ZeRO-3 at half the rate: its reduce-scatter sums
    in another order, and at lr 1.0 that float32 noise reaches 2e-5 by the evaluation."""
    lr = 0.5 if zero == 3 else 1.0
    ref = spec(assets, tmp_path / "ref", lr=lr)
    sp = spec(assets, tmp_path / "sp", zero=zero, sp=U2, batch=1, lr=lr)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=4))


@pytest.mark.slow
def test_dpo_u2r2_zero3_equals_one_process(assets, tmp_path):
    """Hybrid Ulysses 2 x ring 2 (4 ranks), ZeRO-3: the policy and TRL's reference
    model built partitioned, the reference a DeepSpeed inference engine."""
    ref = spec(assets, tmp_path / "ref")
    sp = spec(assets, tmp_path / "sp", zero=3, sp=U2R2)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=4))


def test_dpo_lora_u2_zero3_equals_one_process(assets, tmp_path):
    """LoRA under ZeRO-3 (the base model partitioned; the reference is the adapter
    switched off)."""
    ref = spec(assets, tmp_path / "ref", lora=True)
    sp = spec(assets, tmp_path / "sp", zero=3, sp=U2, lora=True)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=2))


@pytest.mark.parametrize("degrees", ["u2", "u2r2"])
@pytest.mark.parametrize("policy", ["loaded", "path"])
def test_dpo_trl_reference_under_zero3_without_deepspeed_comm(assets, tmp_path, policy, degrees):
    """The usual script: no ``ucp.init_distributed``, so the Trainer's Accelerate starts
    torch.distributed (on CPU without DeepSpeed's comm); ``ref_model=None`` (TRL builds
    the reference under ZeRO-3's ``zero.Init``), ``"auto"`` batch sizes, gradient
    accumulation 1; the policy loaded before the config, or given as its folder (TRL
    builds it too). DeepSpeed counted one process there and refused the "auto" batch
    sizes (``8 != 2 * 1 * 1``) until the trainers bind its comm first."""
    sp_block, nproc = (U2R2, 4) if degrees == "u2r2" else (U2, 2)
    ref = spec(assets, tmp_path / "ref", ga=1, policy=policy)
    sp = spec(assets, tmp_path / "sp", zero=3, sp=sp_block, ga=1, bare=True, policy=policy)
    assert_same_logs(*side_by_side(tmp_path, ref, sp, nproc=nproc))
