"""``python -m ulysses_cp.plan``: see :mod:`ulysses_cp.plan.cli`."""

from .cli import console

console()
