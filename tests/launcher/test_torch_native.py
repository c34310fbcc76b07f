"""ulysses_cp.context_parallel: PyTorch's experimental context_parallel call, our modes.

The launcher-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_torch_native.py.
"""

from __future__ import annotations

import pytest


@pytest.mark.launcher
def test_the_example_script_runs_under_the_launcher(tmp_path):
    from tests.support.helpers import run, torchrun_cmd

    out = run(torchrun_cmd("scripts/cp_example.py", "--seq", "256"), timeout=300)
    assert "ulysses over 2 ranks on cpu, torch.float32" in out
    assert out.count(" ok") == 4, out
