"""`scripts/gpu_check.sh --dry-run` runs every section end to end on the CPU (small sizes),
with a flash-attn stand-in on the path so that the flash_attn rows run too; the `model`
section's dry run in this process (`scripts/gpu_model.py`), its checks and goals."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch

from tests.support.helpers import ROOT
from ulysses_cp.core.flops import model_flops

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_model


@pytest.fixture(scope="module")
def shallow_rows():
    """The model section's dry run, its shallow part only (2 layers, float32, CPU)."""
    return gpu_model.model_rows(torch.device("cpu"), True, 989.0, parts=("shallow",))


def _linear_weights(layers: int) -> int:
    """nn.Linear weights of the dry run's Llama, counted on the built model."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**gpu_model.llama_config(gpu_model.TINY, layers))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_model_dry_run_rows_times_flops_and_losses(shallow_rows):
    steps = [r for r in shallow_rows if r["kind"] == "step"]
    layers, lengths = gpu_model.PARTS["shallow"][1]
    assert {(r["variant"], r["N"]) for r in steps} == {
        (v, N) for v in ("hf", "alst", "ours") for N in lengths
    }
    linear = _linear_weights(layers)
    tiny = gpu_model.TINY
    for r in steps:
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0 and math.isfinite(r["loss"])
        flops = model_flops(
            matmul_params=linear,
            attention_layers=layers,
            hq=tiny["num_attention_heads"],
            head_dim=tiny["hidden_size"] // tiny["num_attention_heads"],
            seq_len=r["N"],
        )
        assert r["model_flops"] == flops
        assert r["tflops"] * r["step_s"] * 1e12 == pytest.approx(flops, rel=1e-9)
        assert r["peak_bytes"] > 0
    ours = [r for r in steps if r["variant"] == "ours"]
    assert all(0.5 < r["predicted_over_measured"] < 2 for r in ours), ours
    assert all(r["ours_over_alst_s"] > 0 and r["ours_over_hf_s"] > 0 for r in ours)
    memory = {r["variant"]: r for r in shallow_rows if r["kind"] == "memory"}
    assert all(memory[v]["bytes_per_token"] > 0 for v in ("hf", "alst", "ours"))
    (check,) = [r for r in shallow_rows if r["kind"] == "check"]
    assert check["ok"] and set(check["losses"]) == {"hf", "alst", "ours"}
    assert check["max_rel_diff"] <= gpu_model.LOSS_TOL["float32"]
    goals = [r for r in shallow_rows if r["kind"] == "goal"]
    assert {g["goal"] for g in goals} == {
        "ours' step <= 1.0x ALST's",
        "ours' model TFLOP/s >= 0.9x transformers'",
        "ours' bytes per token <= 0.5x ALST's",
    }
    assert all(g["met"] in (True, False) and "ok" not in g for g in goals)
    assert len(gpu_model.table(shallow_rows)) == len(shallow_rows)


def test_model_loss_check_catches_a_loss_that_disagrees(shallow_rows):
    rows = copy.deepcopy([r for r in shallow_rows if r["kind"] == "step"])
    tol = gpu_model.LOSS_TOL["float32"]
    assert [c["ok"] for c in gpu_model.loss_checks(rows, tol)] == [True]
    first = min(r["N"] for r in rows)
    (ours,) = [r for r in rows if r["variant"] == "ours" and r["N"] == first]
    ours["loss"] *= 1 + 10 * tol
    (check,) = gpu_model.loss_checks(rows, tol)
    assert not check["ok"] and check["max_rel_diff"] == pytest.approx(10 * tol, rel=1e-3)


def _step(part, variant, N, **kw):
    return dict(kind="step", part=part, variant=variant, N=N, **kw)


def test_model_goals_met_and_missed():
    rows = [
        _step("deep", "alst", 8, step_s=1.0, peak_bytes=100),
        _step("deep", "ours", 8, step_s=0.9, peak_bytes=101),
        _step("shallow", "hf", 8, step_s=1.0, tflops=10.0),
        _step("shallow", "alst", 8, step_s=1.0),
        _step("shallow", "ours", 8, step_s=1.2, tflops=9.5),
        dict(kind="memory", part="shallow", variant="alst", bytes_per_token=100.0),
        dict(kind="memory", part="shallow", variant="ours", bytes_per_token=49.0),
    ]
    gpu_model.add_ratios(rows)
    met = {(g["part"], g["goal"]): g["met"] for g in gpu_model.goals(rows)}
    assert met == {
        ("deep", "ours' step <= 1.0x ALST's"): True,
        ("deep", "ours' peak <= ALST's"): False,
        ("shallow", "ours' step <= 1.0x ALST's"): False,
        ("shallow", "ours' model TFLOP/s >= 0.9x transformers'"): True,
        ("shallow", "ours' bytes per token <= 0.5x ALST's"): True,
    }


class _OutOfMemoryAbove:
    """A variant whose step runs out of memory above ``limit`` tokens."""

    def __init__(self, limit):
        self.model, self.limit = torch.nn.Linear(2, 2), limit

    def step(self, ids):
        if ids.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        loss = self.model(torch.ones(ids.shape[1], 2)).sum()
        loss.backward()
        return loss


def test_model_out_of_memory_is_recorded_and_the_variant_dropped():
    live = {"hf": _OutOfMemoryAbove(64), "ours": _OutOfMemoryAbove(1 << 20)}
    out = gpu_model.measure(live, 128, 16, torch.device("cpu"), True)
    assert out["hf"] == {"oom": "CUDA out of memory. Tried to allocate 9 GiB"}
    assert list(live) == ["ours"] and len(out["ours"]["times"]) == gpu_model.repeats(128, True)
