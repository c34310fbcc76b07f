"""Rank-aware logging: library code logs through here, never bare ``print``."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

__all__ = [
    "get_logger",
]


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record.rank = rank
        return self.all_ranks or rank == 0


def get_logger(name: str = "ulysses_cp", *, all_ranks: bool = False) -> logging.Logger:
    """A logger that prints ``[rank N]`` lines; by default only rank 0 prints."""
    logger = logging.getLogger(f"{name}{'.all' if all_ranks else ''}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
        handler.addFilter(_RankFilter(all_ranks))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
