"""Old module paths keep working after the package grew folders.

``import ulysses_cp.ring``, ``from ulysses_cp.hf import build_model`` and
``ulysses_cp.data.shard_batch`` give the module at its new home (the same module object,
so there is one copy of its state). Imported lazily: naming ``ulysses_cp.hf`` imports
transformers only when it is used."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    **{m: f"core.{m}" for m in ("comm", "derived", "log", "options", "protocols")},
    **{m: f"core.{m}" for m in ("sharding", "topology", "varlen")},
    **{m: f"kernels.{m}" for m in ("flash_backend", "math_backend", "torch_backend")},
    **{m: f"modes.{m}" for m in ("attention", "ring", "ulysses")},
    **{m: f"models.{m}" for m in ("hf", "loss", "memory")},
    "model": "models.decoder",
    **{m: f"training.{m}" for m in ("build", "checkpoint", "data", "engine")},
    **{m: f"training.{m}" for m in ("nonfinite", "tracking", "trainer")},
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != self.package or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = self.new_home(spec.name)
        # The import system overwrites __spec__ with the alias's spec; exec_module puts
        # the module's own back.
        module.__dict__.setdefault("__moved_spec__", module.__spec__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__dict__.pop("__moved_spec__")

    def new_home(self, fullname: str) -> ModuleType:
        name = fullname.rpartition(".")[2]
        return importlib.import_module(f"{self.package}.{MOVED[name]}")


def install(package: str) -> _OldPaths:
    """Register the finder for ``package``'s old module paths (once)."""
    for finder in sys.meta_path:
        if isinstance(finder, _OldPaths) and finder.package == package:
            return finder
    finder = _OldPaths(package)
    sys.meta_path.append(finder)
    return finder
