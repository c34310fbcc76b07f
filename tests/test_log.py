"""Logging (ulysses_cp.core.log): the library adds no handler; the entry points'
configure_logging prints rank 0's lines, and every rank's from an all_ranks logger."""

from __future__ import annotations

import io
import logging

import pytest

import ulysses_cp  # noqa: F401  (the import itself must add no handler)
from ulysses_cp.core import log as ucp_log
from ulysses_cp.core.log import configure_logging, get_logger


def _ours() -> list[logging.Logger]:
    named = logging.Logger.manager.loggerDict.items()
    loggers = [v for k, v in named if k.startswith("ulysses_cp") and isinstance(v, logging.Logger)]
    return [logging.getLogger("ulysses_cp"), *loggers]


def _streams(logger: logging.Logger) -> list[logging.Handler]:
    """Plain stream handlers (pytest's capture handlers are subclasses)."""
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]


def test_the_library_adds_no_handler():
    """Importing the package and making its loggers installs nothing: no stream handler on
    any ``ulysses_cp`` logger or on the root."""
    get_logger("train")
    get_logger("train.ranks", all_ranks=True)
    get_logger(__name__)
    assert [(lg.name, _streams(lg)) for lg in _ours() if _streams(lg)] == []
    assert _streams(logging.getLogger()) == []
    assert get_logger("train").name == "ulysses_cp.train"  # under the package's logger


@pytest.fixture
def printed():
    """configure_logging for one test, into a buffer; undone after it."""
    root = logging.getLogger("ulysses_cp")
    level, propagate = root.level, root.propagate
    buffer = io.StringIO()
    configure_logging(stream=buffer)
    configure_logging()  # idempotent: still one handler, the first stream
    yield buffer
    for handler in _streams(root):
        root.removeHandler(handler)
    root.setLevel(level)
    root.propagate = propagate


def test_configure_logging_prints_rank_zero_and_all_ranks_loggers(printed, monkeypatch):
    assert len(_streams(logging.getLogger("ulysses_cp"))) == 1
    get_logger("train").info("step 1")
    get_logger("train.ranks", all_ranks=True).error("failed here")
    monkeypatch.setattr(ucp_log, "_rank", lambda: 1)
    get_logger("train").info("step 2")  # rank 1: only all_ranks loggers print
    get_logger("train.ranks", all_ranks=True).error("failed there")
    lines = printed.getvalue().splitlines()
    assert lines == ["[rank 0] step 1", "[rank 0] failed here", "[rank 1] failed there"]
