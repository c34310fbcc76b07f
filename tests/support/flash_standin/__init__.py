"""CPU stand-ins for the ``flash_attn`` package (flash-attention 2), releases 2.6.0, 2.7.4, 2.8.3,
and for FlashAttention-3 (module ``flash_attn_interface``: 3.0.0b1, 3.0.0) and FlashAttention-4
(module ``flash_attn.cute``: 4.0.0b18, 4.0.0b27); ``fa34.py`` holds the kernels of the last two.
Each FA3/FA4 folder carries a ``.dist-info`` so ``importlib.metadata`` reports its version.

A stand-in is a ``flash_attn`` package whose ``flash_attn_interface`` copies, exactly, that
release's four internal functions (``_flash_attn_forward``, ``_flash_attn_varlen_forward``,
``_flash_attn_backward``, ``_flash_attn_varlen_backward``): parameter names, order, defaults,
type hints, return tuples, and for 2.7/2.8 the ``torch.library.custom_op`` wrapping with
``register_fake`` (exposed as ``_wrapped_*`` too). The CUDA extension is replaced by a shim with
the extension's positional argument lists and return values, over the pure-PyTorch kernels in
``kernels.py`` (same layouts, masks, lse conventions and input checks/messages as the C++).

Not modelled: the ``is_cuda`` device checks (we run on CPU; 2.7/2.8 ops register for
``device_types="cpu"``), dropout, ALiBi, paged KV (``block_table``), ``seqused_k``,
``leftpad_k``, ``out_``, the public ``flash_attn_func`` family and the kv-cache API.

    fa = use("2.7.4")                 # custom ops, as on torch 2.4-2.9
    fa = use("2.7.4", wrap="plain")   # plain functions, as on torch >= 2.10 (string compare)
    fa3 = use("3.0.0")                # the flash_attn_interface module
    fa4 = use("4.0.0b27")             # the flash_attn.cute.interface module
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from tests.support.flash_standin import kernels

VERSIONS = ("2.6.0", "2.7.4", "2.8.3")
VERSIONS3 = ("3.0.0b1", "3.0.0")
VERSIONS4 = ("4.0.0b18", "4.0.0b27")
WRAPS = ("custom_op", "plain")
_HERE = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = {
    v: os.path.join(_HERE, "v" + v.replace(".", "_")) for v in VERSIONS + VERSIONS3 + VERSIONS4
}
_MODULES = {"3": "flash_attn_interface", "4": "flash_attn.cute.interface"}


def unuse() -> None:
    """Forget any imported ``flash_attn`` and take the stand-in folders off ``sys.path``."""
    ours = ("flash_attn", "flash_attn_interface")
    for name in [n for n in sys.modules if n in ours or n.startswith("flash_attn.")]:
        del sys.modules[name]
    folders = set(_FOLDERS.values())
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in folders]
    importlib.invalidate_caches()


def use(version: str, wrap: str = "custom_op") -> ModuleType:
    """Import and return the stand-in ``flash_attn`` of ``version`` (a fresh import).

    ``wrap`` (2.7.4 / 2.8.3; 2.6.0 has no wrapping): ``"custom_op"`` is what the release does on
    torch 2.4-2.9, ``"plain"`` what it does on torch >= 2.10, where its
    ``torch.__version__ >= "2.4.0"`` string comparison is False.
    """
    if version not in _FOLDERS:
        raise ValueError(f"no stand-in for flash-attn {version!r}; have {tuple(_FOLDERS)}")
    if wrap not in WRAPS:
        raise ValueError(f"wrap must be one of {WRAPS}, got {wrap!r}")
    unuse()
    sys.path.insert(0, _FOLDERS[version])
    kernels.WRAP = wrap
    return importlib.import_module(_MODULES.get(version[0], "flash_attn"))
