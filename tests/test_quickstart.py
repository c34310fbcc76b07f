"""The README's Quick start block runs as written (torchrun, 2 CPU ranks) and its result
equals full attention."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_code() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs_and_matches_full_attention(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    res = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    found = re.search(r"ulysses over 2 ranks: max \|out - full\| = (\S+)", res.stdout)
    assert found, res.stdout[-2000:]
    assert float(found.group(1)) < 1e-5
