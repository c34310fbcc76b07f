"""The README's main job as written (its command from README.md, "The two commands"), run
for 2 steps: at most 8 lines before the first step's line, and none of the DeepSpeed
launcher's notices that the command's settings remove (the accelerator probe's "Setting
accelerator to CPU", the launcher's INFO lines)."""

from __future__ import annotations

import re
import shlex
import sys

import pytest

from tests.support.helpers import ROOT, free_port, run

pytestmark = pytest.mark.launcher

FIRST_SCREEN = 8  # lines before the first step's line, at most
GONE = ("Setting accelerator to CPU", "[INFO] [launch.py", "[INFO] [runner.py")


def readme_main_job() -> tuple[dict[str, str], list[str]]:
    """The README's main-job command after ``bash scripts/setup.sh &&``: its environment
    settings and its words."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "train.py --deepspeed_config" in x)
    words = shlex.split(line.split("&&", 1)[1])
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    return env, [w for w in words if w.split("=", 1)[0] not in env]


def test_readme_main_job_first_screen(tmp_path):
    env, words = readme_main_job()
    assert words[0] == ".venv/bin/deepspeed" and "train.py" in words, words
    # the venv's launcher as this interpreter runs it, on a free port, 2 steps
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port())]
    cmd += [*words[1:], "--max_steps", "2", "--output_dir", str(tmp_path / "run")]
    out = run(cmd, env=env, timeout=600)
    lines = out.splitlines()
    first = next(i for i, x in enumerate(lines) if re.search(r"\] step +\d+ +loss", x))
    assert first <= FIRST_SCREEN, "\n".join(lines[: first + 1])
    assert [x for x in lines if any(g in x for g in GONE)] == []


def test_training_imports_leave_torch_dynamo_out():
    """What train.py imports before its first line (the package's training modules, torch
    and DeepSpeed) does not import torch._dynamo (2.4 s of every rank's start on a CPU;
    a torch optimizer imports it later, when it is built)."""
    code = (
        "import sys, deepspeed, ulysses_cp.train\n"
        "from ulysses_cp.training import build, data, engine, evaluate, trainer\n"
        "from ulysses_cp.modes import attention\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    out = run([sys.executable, "-c", code], env={"DS_ACCELERATOR": "cpu"}, timeout=300)
    assert out.strip().splitlines()[-1] == "no dynamo", out[-2000:]
