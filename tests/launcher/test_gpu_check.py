"""`scripts/gpu_check.sh --dry-run` runs every section end to end on the CPU (small sizes),
with a flash-attn stand-in on the path so that the flash_attn rows run too; the `model`
section's dry run in this process (`scripts/gpu_model.py`), its checks and goals.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_gpu_check.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import ROOT, run


@pytest.mark.slow
@pytest.mark.launcher
def test_gpu_check_dry_run_passes_every_section(tmp_path):
    standin = ROOT / "tests" / "support" / "flash_standin" / "v2_8_3"
    # the interpreter running the tests (the script's default is the repository's .venv)
    env = dict(OUT=str(tmp_path), PYTHONPATH=f"{standin}:{ROOT}", PYTHON=sys.executable)
    # a second run into the same folder: the training section starts afresh there
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    # the model section's deep part: its shallow part runs in the unit tier, in process
    # (tests/unit/test_gpu_check.py), on the same code
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--model-parts", "deep"]
    run(cmd, env=env)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["dry_run"] and report["flash_attn"] == "2.8.3"
    sections = report["sections"]
    for name in ("kernels", "modes"):
        assert {row["backend"] for row in sections[name]} == {"torch", "flash_attn"}, name
    assert {row["backend"] for row in sections["attention"]} == {"sdpa", "torch", "flash_attn"}
    assert all(row["vs_sdpa"] > 0 for row in sections["attention"])
    # 2 backends x 2 dtypes x 4 shapes (MLA's among them) x causal x packed, + float32 for torch
    assert len(sections["kernels"]) == 2 * 2 * 4 * 2 * 2 + 4 * 2 * 2
    assert {row["dv"] for row in sections["kernels"] if row["d"] == 192} == {128}
    modes = {
        (row["backend"], row["mode"], row["layout"], row["packed"]) for row in sections["modes"]
    }
    assert len(modes) == 2 * 3 * 2 * 2
    (train,) = sections["training"]
    assert train["ok"] and train["returncode"] == 0 and train["losses"][-1] < train["losses"][0]
    # scripts/cp_example.py under torch.distributed.run as docs/pytorch.md runs it (the
    # example's one launcher test): Ulysses (its default for 8 heads), then the ring
    native = sections["torch_native"]
    assert [row["report"][0].split(" over ")[0] for row in native] == ["ulysses", "ring"]
    assert native[0]["report"][0].startswith("ulysses over 2 ranks on cpu, torch.float32")
    assert all(sum(" ok" in x for x in row["report"]) == 4 for row in native), native
    assert all(row["ok"] for rows in sections.values() for row in rows if "ok" in row)
    model = sections["model"]
    assert {(r["part"], r["variant"]) for r in model if r["kind"] == "step"} == {
        ("deep", v) for v in ("hf", "alst", "ours")
    }
    assert [r["kind"] for r in report["goals"]] == ["goal"] * len(report["goals"]) != []
