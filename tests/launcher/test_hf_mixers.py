"""Hybrid token mixers under sequence parallelism: the channel exchange, packed documents
(each starts a fresh state), refusals of head counts that do not split, and the bytes.

The launcher-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf_mixers.py.
"""

from __future__ import annotations

import pytest


@pytest.mark.launcher
def test_the_real_proportions_table_is_the_scripts():
    """docs/reference/families.md's rows of scripts/mixer_degrees.py for two families are what the
    script prints now (Zamba: 2 heads, P <= 2; Mamba: channels and the all-reduce)."""
    import subprocess
    import sys

    from tests.support.helpers import ROOT

    script = ROOT / "scripts" / "mixer_degrees.py"
    out = subprocess.run(
        [sys.executable, str(script), "MambaConfig", "ZambaConfig"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| Mamba") or "Zamba" in line]
    assert len(rows) == 2 and "| 1, 2 |" in rows[1], out
    page = (ROOT / "docs" / "reference" / "families.md").read_text()
    for line in rows:
        assert line in page, line
