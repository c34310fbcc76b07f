"""``python -m ulysses_cp.plan ... --write-config OUT.json``: the config as written with
the chosen plan's settings; planned again, the written config is the plan it was chosen
as (the same longest sequence); ``train.py`` trains with it as it is; when no plan fits,
nothing is written and the error says why.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan_write.py.
"""

from __future__ import annotations

import pytest

from tests.support.helpers import launch, metrics
from tests.unit.test_plan_write import _write


@pytest.mark.launcher
def test_train_py_trains_with_the_written_config(tmp_path, capsys):
    """The written file as it is (``--max_steps 2``): it trains on 4 ranks."""
    _write(tmp_path, capsys)
    launch(tmp_path / "planned.json", tmp_path / "run", "--max_steps", "2", num_gpus=4)
    steps = [m["step"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps and steps[-1] == 2, steps
