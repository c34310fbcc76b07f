"""The Quick start block of docs/library/index.md (the README links to it) runs as written
(torchrun, 2 CPU ranks) and its result equals full attention."""

from __future__ import annotations

import re

import pytest

from tests.support.helpers import ROOT, run, torchrun_cmd

pytestmark = pytest.mark.launcher


def quickstart_code() -> str:
    page = (ROOT / "docs" / "library" / "index.md").read_text()
    section = page[page.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_runs_and_matches_full_attention(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    out = run(torchrun_cmd(script), timeout=300)
    found = re.search(r"ulysses over 2 ranks: max \|out - full\| = (\S+)", out)
    assert found, out[-2000:]
    assert float(found.group(1)) < 1e-5
