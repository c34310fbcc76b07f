"""Rank-aware logging: library code logs through here, never bare ``print``.

The library adds no handler (standard practice for a library): its loggers live under
``ulysses_cp`` and print only where the application configures logging. The package's
entry points (``ulysses_cp.train``, the planner, the attention check) call
:func:`configure_logging`, which prints ``[rank N] message`` lines on stdout from rank 0
only, and from every rank for the loggers made with ``all_ranks=True``. Nothing here
imports torch (the training entry point configures logging before it imports torch).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = [
    "configure_logging",
    "get_logger",
]

ROOT = "ulysses_cp"
# the attribute that marks a record from an ``all_ranks`` logger
_ALL_RANKS = "ucp_all_ranks"


def _rank() -> int:
    """This process's global rank once torch.distributed is initialised, else 0 (torch
    not imported means no process group)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class _MarkAllRanks(logging.Filter):
    """On an ``all_ranks`` logger: its records pass the handler's rank filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, _ALL_RANKS, True)
        return True


class _RankFilter(logging.Filter):
    """On :func:`configure_logging`'s handler: rank 0's records, and every rank's from an
    ``all_ranks`` logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank = _rank()
        return rank == 0 or getattr(record, _ALL_RANKS, False)


def get_logger(name: str = ROOT, *, all_ranks: bool = False) -> logging.Logger:
    """The logger ``name`` under ``ulysses_cp`` (``"train"`` is ``ulysses_cp.train``).

    Args:
        name: a module's ``__name__`` or a short name.
        all_ranks: where :func:`configure_logging` set up the output, every rank prints
            this logger's lines (by default only rank 0 does).

    Returns:
        The logger; it has no handler of its own.
    """
    if name != ROOT and not name.startswith(f"{ROOT}."):
        name = f"{ROOT}.{name}"
    logger = logging.getLogger(f"{name}.all" if all_ranks else name)
    if all_ranks and not any(isinstance(f, _MarkAllRanks) for f in logger.filters):
        logger.addFilter(_MarkAllRanks())
    return logger


def configure_logging(level: int = logging.INFO, stream: TextIO | None = None) -> logging.Logger:
    """The entry points' logging: ``[rank N] message`` lines on stdout at ``level`` and
    above, from rank 0 only (every rank for ``all_ranks`` loggers). Idempotent.

    Args:
        level: the lowest level printed.
        stream: where the lines go (default ``sys.stdout``); a second call keeps the first
            call's stream.

    Returns:
        The package's root logger (``ulysses_cp``).
    """
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(f, _RankFilter) for h in logger.handlers for f in h.filters):
        handler = logging.StreamHandler(sys.stdout if stream is None else stream)
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
    logger.propagate = False  # the entry point owns the process: one line per message
    return logger
