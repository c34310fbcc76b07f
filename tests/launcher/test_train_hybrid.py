"""train.py on the shipped hybrid configs (a tiny Qwen3-Next: gated delta nets and
attention; a tiny Bamba: Mamba2 and attention) under Ulysses 2 x ring 2 gives the losses
of the same run in one process (float32, the same global batch: one data-parallel rank)."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import ROOT, launch, metrics

pytestmark = [pytest.mark.launcher, pytest.mark.slow]


def _run(tmp_path, name: str, degrees: tuple[int, int], gpus: int) -> list[float]:
    cfg = json.loads((ROOT / "configs" / f"tiny_cpu_hf_{name}_u2r2.json").read_text())
    cfg["model"]["hf_config"] = str(ROOT / "configs" / cfg["model"]["hf_config"])
    cfg["sequence_parallel"].update(ulysses_degree=degrees[0], ring_degree=degrees[1])
    cfg["data"]["seq_len"] = 128
    cfg["training"] = {"max_steps": 3, "log_interval": 1, "save_interval": 0}
    path = tmp_path / f"{name}_{gpus}.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / f"run_{name}_{gpus}"
    launch(path, out, num_gpus=gpus)
    return [row["loss"] for row in metrics(out)]


@pytest.mark.parametrize("name", ["qwen3next", "bamba"])
def test_hybrid_model_trains_with_the_one_process_losses(tmp_path, name):
    sp = _run(tmp_path, name, (2, 2), 4)
    one = _run(tmp_path, name, (1, 1), 1)
    assert len(sp) == len(one) == 3
    assert sp == pytest.approx(one, rel=1e-4), (sp, one)
