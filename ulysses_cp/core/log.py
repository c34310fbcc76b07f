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
import warnings
from typing import TextIO

__all__ = [
    "configure_logging",
    "get_logger",
    "quiet_third_party",
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


# Third-party notices a user can do nothing about, as (warning category, message regex
# matched at the message's start): torch deprecates a collective that DeepSpeed's ZeRO
# calls; transformers renames ``gradient_checkpointing`` and TRL and the Trainer still use
# the old names; accelerate says it set OMP_NUM_THREADS (our own "CPU threads" line says
# what the rank runs)
THIRD_PARTY_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r".*`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"`\w*gradient_checkpointing\w*` is deprecated and will be removed"),
    (UserWarning, r"OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 1"),
)
# DeepSpeed's logger (named "DeepSpeed"): its notice for an optimizer outside its ZeRO list,
# e.g. torch's SGD, that it runs all the same
THIRD_PARTY_LOG_LINES = {"DeepSpeed": ("You are using ZeRO with an untested optimizer",)}


class _DropLines(logging.Filter):
    """On a third-party logger: drops the records whose message contains one of ``parts``."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def quiet_third_party() -> None:
    """Hides the third-party warnings and log lines a user can do nothing about
    (:data:`THIRD_PARTY_WARNINGS`, :data:`THIRD_PARTY_LOG_LINES`), in this process; every
    other warning still prints. The one place they are listed: ``ulysses_cp.train``, the
    examples and the ``Trainer`` subclasses call it. Imports nothing heavy (a logger's
    filter stays when the package that logs is imported later). Idempotent."""
    for category, message in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, parts in THIRD_PARTY_LOG_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(parts))
