"""The package's folders: imports point down only, and the module paths from before the
folders still import (as the very same module objects)."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from ulysses_cp.moved import MOVED

PKG = ROOT / "ulysses_cp"
# A layer may import from the layers after it in this list, never from those before it
# (plan: the planner, above everything it predicts).
LAYERS = ["plan", "training", "integrations", "models", "modes", "kernels", "core"]
ALLOWED_UP = {("models/hf.py", "training.data")}  # shard_batch for a Hugging Face batch


def _imports(path: Path, pkg: Path) -> list[str]:
    """Dotted names (relative to the package) of every intra-package import in ``path``."""
    parts = path.relative_to(pkg).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("ulysses_cp"):
                mod = node.module.removeprefix("ulysses_cp").lstrip(".")
            else:
                continue
            out += [f"{mod}.{a.name}".lstrip(".") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [
                a.name.removeprefix("ulysses_cp.") for a in node.names if "ulysses_cp." in a.name
            ]
    return out


def upward_imports(pkg: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        layer = rel.split("/")[0]
        if layer not in LAYERS:
            continue
        for name in _imports(path, pkg):
            target = name.split(".")[0]
            up = target in LAYERS and LAYERS.index(target) < LAYERS.index(layer)
            if up and not any(rel == f and name.startswith(t) for f, t in ALLOWED_UP):
                bad.append(f"{rel} imports {name}")
    return bad


def test_imports_point_down_only():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text("from ..modes.ring import merge\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "y.py").write_text("import ulysses_cp.training.data\n")
    found = upward_imports(tmp_path)
    assert found == ["core/x.py imports modes.ring.merge", "kernels/y.py imports training.data"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_are_the_new_modules(old):
    new = importlib.import_module(f"ulysses_cp.{MOVED[old]}")
    assert importlib.import_module(f"ulysses_cp.{old}") is new
    assert new.__spec__.name == f"ulysses_cp.{MOVED[old]}"
    assert Path(new.__file__).is_relative_to(PKG)


def test_old_paths_in_a_fresh_interpreter():
    """Every spelling a user may have written, in a process that imported nothing yet;
    ``ulysses_cp.attention`` stays the function even after its module is imported by name."""
    code = (
        "import ulysses_cp, ulysses_cp.ring\n"
        "from ulysses_cp.ring import merge\n"
        "from ulysses_cp import trainer\n"
        "import ulysses_cp.hf as hf\n"
        "from ulysses_cp.attention import validate_qkv\n"
        "from ulysses_cp.model import Decoder\n"
        "import ulysses_cp.modes.ring as r, ulysses_cp.models.hf as h\n"
        "assert ulysses_cp.ring is r and merge is r.merge and hf is h\n"
        "assert trainer.__name__ == 'ulysses_cp.training.trainer'\n"
        "assert Decoder.__module__ == 'ulysses_cp.models.decoder'\n"
        "assert callable(ulysses_cp.attention) and not isinstance(ulysses_cp.attention, type(r))\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_unknown_old_path_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ulysses_cp.no_such_module")
