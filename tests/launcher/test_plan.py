"""The planner against measurements made at test time (independent of its code): the
attention byte counters, the live tensor bytes of a training step, what a DeepSpeed
engine leaves allocated and what its comms logger records, and benchmark_memory.py's
longest-sequence search; then its CLI: fields, ranking, errors.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import ROOT, run, small_bucket_config


@pytest.mark.launcher
def test_cli_json_and_table(tmp_path):
    out = tmp_path / "plan.json"
    cfg = small_bucket_config(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json", tmp_path)
    args = (
        "--deepspeed_config",
        str(cfg),
        "--world",
        "4",
        "--gpus-per-node",
        "2",
        "--gpu-mem-gb",
        "0.02",
        "--seq-step",
        "16",
        "--json",
        str(out),
    )
    printed = run([sys.executable, "-m", "ulysses_cp.plan", *args], timeout=300)
    assert "as written:" in printed and "best of" in printed
    assert "ranked by the longest sequence that fits (max seq)" in printed  # the default goal
    got = json.loads(out.read_text())
    fields = {
        "peak_bytes_per_rank",
        "static_bytes_per_rank",
        "activation_bytes_per_rank",
        "comm_bytes_per_step_per_rank",
    }
    assert fields <= set(got["config"])
    assert got["config"]["ulysses_degree"] == 2 and got["config"]["zero_stage"] == 2
    assert got["config"]["inter_node_bytes"] > 0  # the ring runs across the two nodes
    extra = {
        "ulysses_degree",
        "ring_degree",
        "layout",
        "zero_stage",
        "fits",
        "max_seq_len",
        "predicted_step_s",
    }
    assert all(fields | extra <= set(c) for c in got["candidates"])
    fit = [c for c in got["candidates"] if c["fits"]]
    assert fit and len(fit) < len(got["candidates"])  # 20 MiB: some do not fit
    assert got["goal"] == "longest"  # both goals: tests/unit/test_plan_goal.py
    assert got["chosen"]["max_seq_len"] == max(c["max_seq_len"] for c in fit)
    for c in got["candidates"]:
        assert c["fits"] == (c["peak_bytes_per_rank"] <= 0.9 * 0.02 * 2**30)  # 10% free
        assert c["max_seq_len"] >= 512 if c["fits"] else c["max_seq_len"] < 512
