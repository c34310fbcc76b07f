"""Smoke test of the benchmark script (no timing assertions): it runs, writes JSON and a
plot, and every measured byte count equals its formula."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import ROOT, run

pytestmark = pytest.mark.launcher


def test_benchmark_window_quick(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_window.py"), "--quick"]
    run([*cmd, "--out", str(tmp_path)], timeout=300)
    rows = {
        (r["mode"], r["case"]): r
        for r in json.loads((tmp_path / "benchmark_window.json").read_text())["rows"]
    }
    N = 1024
    for mode in ("ulysses", "ring_zigzag", "ring_contiguous", "hybrid_zigzag"):
        full, win = rows[(mode, "full")], rows[(mode, "window N/8")]
        assert full["work_to_full"] == 1.0 and full["skipped_blocks"] == 0
        # every rank computes at least the window's scores: b * hq * N * (window + 1) / 2
        assert win["scores"] >= 8 * N * (N // 8) // 2
    # zigzag ring, 8 chunks of 128 tokens, window 128: each query chunk sees itself and the
    # chunk before it, 15 chunk pairs; the full causal ring computes 40 (its first step a
    # whole 2x2 block per rank, the others half blocks): 15 / 40
    assert rows[("ring_zigzag", "window N/8")]["work_to_full"] == pytest.approx(0.375)
    # Ulysses: the whole sequence in 128-token pieces, each query piece against itself and
    # the piece before: 15 pairs of the 64 the full (masked) local call computes
    assert rows[("ulysses", "window N/8")]["work_to_full"] == pytest.approx(15 / 64)


def test_benchmark_mixers_small(tmp_path):
    """One mixer layer of each kind at P = 4 against one rank: its per-rank peak near 1/P
    (the weights' gradients, full on every rank, keep it a little above at 1024 tokens),
    and the bytes sent equal the formula. Mamba1's row is left out (its torch scan loops
    over the tokens: minutes under the profiler; tests/distributed/test_plan_hybrid.py checks
    its bytes)."""
    out = tmp_path / "mixers.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_mixers.py"), "--seq", "1024"]
    rows3 = ["short conv (LFM2)", "gated delta net (Qwen3-Next)", "Mamba2 (Bamba)"]
    run([*cmd, "--repeats", "1", "--json", str(out), "--mixers", *rows3], timeout=600)
    rows = json.loads(out.read_text())
    assert [row["mixer"] for row in rows] == rows3
    for row in rows:
        assert row["peak_ratio"] < 0.3, row["mixer"]
        assert row["four"]["bytes_sent"] == row["four"]["bytes_formula"] > 0


def test_benchmark_attention_memory_small(tmp_path):
    """One attention layer at P = 4 against one rank, tiny: the JSON has every row and
    field, the per-rank peaks below one rank's, redo moves 1.5x the
    Ulysses all-to-all bytes and the head chunks none more."""
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_attention_memory.py")]
    run(
        [*cmd, "--seq", "512", "--budget-mb", "5", "--repeats", "1", "--out", str(tmp_path)],
        timeout=900,
    )
    rows = json.loads((tmp_path / "benchmark_attention_memory.json").read_text())["rows"]
    got = {(r["mode"], r["variant"]): r for r in rows}
    assert set(got) == {("one rank", "-")} | {
        (m, v) for m in ("ulysses 4", "hybrid 2x2") for v in ("before", "default", "redo")
    }
    fields = {"peak_mb", "peak_ratio", "time_s", "time_ratio", "sent_bytes", "sent_ratio"}
    for (mode, _), r in got.items():
        assert fields | {"max_len", "max_len_ratio"} <= set(r)
        if mode != "one rank":
            assert 0.1 < r["peak_ratio"] < 1 and r["time_s"] > 0 and r["max_len"] > 0, r
    assert got[("ulysses 4", "redo")]["sent_ratio"] == pytest.approx(1.5)
    assert got[("ulysses 4", "before")]["sent_ratio"] == 1.0


@pytest.mark.slow
def test_benchmark_quick(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "benchmark_attention.py"),
        "--quick",
        "--worlds",
        "1",
        "4",
        "--repeats",
        "1",
        "--seqs",
        "512",
        "--budget-mb",
        "4",
        "--out",
        str(tmp_path),
    ]
    out = run(cmd, timeout=600)
    assert "x peer" in out  # the table
    data = json.loads((tmp_path / "benchmark_attention.json").read_text())
    rows = [r for w in data["worlds"].values() for r in w["rows"]]
    impls = {r["impl"] for r in rows}
    assert {
        "full",
        "deepspeed",
        "ulysses",
        "ring_zigzag",
        "hybrid_zigzag",
        "ring_zigzag_no_overlap",
    } <= impls
    for r in rows:
        assert r["time_s"] > 0 and r["ratio_to_peer"] > 0
        if r["impl"] != "deepspeed":  # the peer's traffic goes through deepspeed.comm
            assert set(r["bytes_fwd_per_rank"]) == {r["bytes_formula"]}, r
    p1, p4 = data["worlds"]["1"], data["worlds"]["4"]
    assert max(p4["max_len_attention"].values()) > p1["max_len_attention"]["full"] > 0
    assert (tmp_path / "benchmark_attention.png").stat().st_size > 1000


@pytest.mark.slow
def test_benchmark_packing_quick(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_packing.py"), "--quick"]
    out = run([*cmd, "--out", str(tmp_path)], timeout=600)
    rows = json.loads((tmp_path / "benchmark_packing.json").read_text())["rows"]
    cases = {(r["mode"], r["case"]) for r in rows}
    for mode in ("ulysses", "ring_zigzag", "hybrid_zigzag"):
        for case in ("unpacked", "packed_1", "packed_8", "packed_64"):
            assert (mode, case) in cases
    for r in rows:
        assert r["time_s"] > 0 and 0 < r["work_fraction"] <= 1
        if r["case"] == "unpacked":
            assert r["ratio_to_unpacked"] == 1.0
    assert "x unpacked" in out
    # padding per document or per row: the row-wise packing pads nothing, the document-wise
    # one pads more as P grows; both timed in every mode
    data = json.loads((tmp_path / "benchmark_packing.json").read_text())
    pad = {(r["P"], r["packing"]): r["padding_fraction"] for r in data["padding"]}
    assert all(pad[(P, "row")] == 0 for P in (4, 16, 64))
    assert 0 < pad[(4, "document")] < pad[(16, "document")] < pad[(64, "document")]
    timed = {(r["mode"], r["packing"]) for r in data["timed"]}
    assert timed == {
        (m, p) for m in ("ulysses", "ring_zigzag", "hybrid_zigzag") for p in ("document", "row")
    }
    assert all(r["real_tokens_per_s"] > 0 for r in data["timed"])


@pytest.mark.slow
def test_benchmark_memory_quick(tmp_path):
    pytest.importorskip("transformers")
    # 4 ranks only (the sequence-parallel search; one process is the same code, a third of
    # the time): every model and feature set gets a length and a speed
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_memory.py"), "--quick"]
    out = run([*cmd, "--worlds", "4", "--out", str(tmp_path)], timeout=600)
    rows = json.loads((tmp_path / "benchmark_memory.json").read_text())["rows"]
    keys = {(r["ranks"], r["model"], r["features"]) for r in rows}
    for ranks in (4,):
        for model in ("reference", "hf"):
            for features in ("none", "tiled", "tiled+ckpt", "tiled+ckpt+offload"):
                assert (ranks, model, features) in keys
    for r in rows:
        assert r["max_len"] > 0 and r["tokens_per_s"] > 0
    assert "max len" in out


@pytest.mark.slow
def test_benchmark_loading_quick(tmp_path):
    """Both loads of the tiny model's checkpoint at 2 ranks run and report their peaks;
    each rank holds its half of the model, and the planner's prediction is beside it (the
    random init is checked by tests/unit/test_loading.py)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_loading.py"), "--quick"]
    run([*cmd, "--world", "2", "--out", str(tmp_path)], timeout=900)
    got = json.loads((tmp_path / "benchmark_loading.json").read_text())
    model = got["checkpoint"]["parameters"] * 2  # bf16
    assert [(r["source"], r["load"]) for r in got["rows"]] == [
        ("hf_weights", "whole"),
        ("hf_weights", "partitioned"),
    ]
    for row in got["rows"]:
        parts = [r["partition"] for r in row["ranks"]]
        assert model <= sum(parts) <= model + 2 * 2**10, (parts, model)  # ZeRO's padding
        assert all(r["peak"] >= r["baseline"] > 0 for r in row["ranks"])
        whole = row["load"] == "whole"
        assert row["predicted_bytes"] >= (model if whole else model // 2)


@pytest.mark.slow
def test_benchmark_hf_trainer_quick(tmp_path):
    """The Trainer three ways (one process, SequenceParallelTrainer, ALST's integration):
    ours equals the one-process losses and eval loss within 1e-5 relative, and evaluates
    on shards; ALST's row is measured (numbers) or says why it did not run (three
    launches)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_hf_trainer.py"), "--quick"]
    out = run([*cmd, "--out", str(tmp_path)], timeout=900)
    rows = {
        r["variant"]: r
        for r in json.loads((tmp_path / "benchmark_hf_trainer.json").read_text())["rows"]
    }
    assert set(rows) == {"reference", "ours z2", "alst z2"}, out[-3000:]
    ref, ours, alst = rows["reference"], rows["ours z2"], rows["alst z2"]
    assert "error" not in ref and "error" not in ours, out[-3000:]
    assert len(ours["loss"]) == len(ref["loss"]) == 4 and ref["loss"][0] != ref["loss"][-1]
    assert ours["loss_rel_diff"] <= 1e-5 and ours["eval_loss_rel_diff"] <= 1e-5
    # 256 tokens per row over 2 ranks, in training and in evaluation
    assert ours["train_row_length"] == ours["eval_row_length"] == 128
    assert ref["eval_row_length"] == 256
    assert all(p > 0 for p in ours["peak_mib_per_rank"]) and ours["step_s"] > 0
    assert "error" in alst or ("loss_rel_diff" in alst and len(alst["peak_mib_per_rank"]) == 2)
    assert "alst z2" in out  # the printed table has ALST's row either way


def test_benchmark_mla_small(tmp_path):
    """The MLA exchange benchmark at 2 ranks, 64 tokens: the latent exchange gives the plain
    one's output and gradients (asserted in the script), each rank's bytes equal the
    formulas, and at DeepSeek-V3's real sizes the latent one sends fewer bytes."""
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_mla.py"), "--world", "2"]
    out = run([*cmd, "--seq", "64", "--out", str(tmp_path)], timeout=300)
    data = json.loads((tmp_path / "benchmark_mla.json").read_text())
    m = data["measured"]
    assert m["bytes_latent"] > 0 and m["peak_plain"] > 0 and m["peak_latent"] > 0
    real = {r["config"]: r for r in data["real"]}
    v3 = real["DeepseekV3Config"]
    assert (v3["hq"], v3["dn"] + v3["dr"], v3["dv"], v3["r"]) == (128, 192, 128, 512)
    assert v3["bytes_latent"] < v3["bytes_plain"]
    assert "latent/plain" in out
