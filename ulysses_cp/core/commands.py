"""What the entry points' command lines share: the program's name as the user typed it,
and help that states every option's default.

No torch here: the entry points parse their arguments before any heavy import.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["DefaultsHelp", "program_name"]


def program_name(module: str) -> str:
    """The command as the user typed it, for ``usage:`` lines: ``python -m ulysses_cp.X``
    when run as a module, the console script's name (``ulysses-cp-plan``) or a script's
    file name when run as one, else ``python -m <module>`` (a call from other code).

    Args:
        module: the entry point's module (``"ulysses_cp.plan"``).
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.split(".")[0] == "ulysses_cp":
        return f"python -m {spec.name.removesuffix('.__main__')}"
    typed = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if typed.startswith("ulysses-cp-") or (typed.endswith(".py") and typed != "__main__.py"):
        return typed
    return f"python -m {module}"


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with ``(default: X)`` after every optional option that has a value by
    default, unless its help already says what the default is (a default of None means
    "from the config" or "none": its help says which)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.required
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
            or "default" in text
        ):
            return text
        return super()._get_help_string(action)
