"""CPU stand-ins for the kernel packages of transformers' hybrid token mixers: causal-conv1d
1.6.1 (``causal_conv1d_fn``), mamba-ssm 2.3.2.post1 (``selective_scan_fn``,
``mamba_chunk_scan_combined``), flash-linear-attention 0.5.2 (``chunk_gated_delta_rule``;
0.5.0 is the first release with the grouped value heads transformers 5 passes it; and
``chunk_kda``, Kimi Delta Attention).

Each folder here holds one package release with the real import path and the function's exact
parameter list (what transformers' ``use_kernel_func_from_hub_with_fallback`` reads to filter
keyword arguments), the release's input checks and messages, and a pure-torch float64
computation inside (``kernels.py``, which counts the calls). transformers binds a family's
kernel functions when it imports the family's modeling module, so the stand-ins must be
importable before that: in a fresh process (``on_path`` around starting it: spawned
processes inherit ``sys.path``), or with ``use``/``unuse`` around tests that import the
stand-ins themselves and no modeling module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

RELEASES = {"causal_conv1d": "1.6.1", "mamba_ssm": "2.3.2.post1", "fla": "0.5.2"}
_HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = {
    "causal_conv1d": os.path.join(_HERE, "causal_conv1d_1_6_1"),
    "mamba_ssm": os.path.join(_HERE, "mamba_ssm_2_3_2"),
    "fla": os.path.join(_HERE, "fla_0_5_2"),
}


def unuse() -> None:
    """Forget the imported stand-ins and take their folders off ``sys.path``."""
    for name in [n for n in sys.modules if n.split(".")[0] in RELEASES]:
        del sys.modules[name]
    folders = set(FOLDERS.values())
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in folders]
    importlib.invalidate_caches()


def use() -> dict:
    """Import the stand-ins (fresh): ``{package: module}``."""
    unuse()
    sys.path[:0] = list(FOLDERS.values())
    return {name: importlib.import_module(name) for name in RELEASES}


@contextlib.contextmanager
def on_path() -> Iterator[None]:
    """The stand-in folders first on ``sys.path`` meanwhile (imports nothing)."""
    unuse()
    sys.path[:0] = list(FOLDERS.values())
    try:
        yield
    finally:
        unuse()


def installed() -> dict[str, str]:
    """The imported kernel packages and the folder each came from, for a process to check
    that transformers bound the stand-ins: ``{package: folder}``."""
    out = {}
    for name in RELEASES:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
    return out
