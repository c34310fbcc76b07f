"""A Hugging Face model built partitioned under ZeRO-3 (``training/loading.py``) equals the
whole-model build: the same parameters (gathered) and the same first step, from a sharded
safetensors checkpoint and from a seed, and the same generator state after the build.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_loading.py.
"""

from __future__ import annotations

import pytest

from tests.support.helpers import run_config, tiny_llama_weights

pytest.importorskip("transformers")


@pytest.mark.launcher
def test_train_py_loads_partitioned_trains_saves_and_resumes(tmp_path):
    """train.py under ZeRO-3 from a safetensors checkpoint: the first loss of a ZeRO-2
    run (whole load), a checkpoint with its portable state, and a resume."""
    from tests.support.helpers import LAUNCH, launch, metrics, write_config

    model = tiny_llama_weights(tmp_path)
    short = dict(training={"max_steps": 2, "log_interval": 1})
    losses = {}
    for stage in (2, 3):
        cfg = run_config(2, 1, stage, **{**LAUNCH, "model": model}, **short)
        path = write_config(tmp_path, cfg, f"zero{stage}")
        launch(path, tmp_path / f"run{stage}")
        losses[stage] = [r["loss"] for r in metrics(tmp_path / f"run{stage}")]
    assert losses[3][0] == pytest.approx(losses[2][0], rel=1e-6, abs=1e-6)
    assert (tmp_path / "run3" / "step2" / "portable.pt").is_file()
    launch(tmp_path / "zero3.json", tmp_path / "run3", "--max_steps", "3", "--resume")
    assert [r["step"] for r in metrics(tmp_path / "run3")] == [1, 2, 3]
