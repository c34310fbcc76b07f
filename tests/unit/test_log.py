"""Logging (ulysses_cp.core.log): the library adds no handler; the entry points'
configure_logging prints rank 0's lines, and every rank's from an all_ranks logger."""

from __future__ import annotations

import io
import logging
import warnings

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


# the third-party notices as their packages word them (torch 2.13, transformers 5.24,
# accelerate, DeepSpeed 0.19.8), each hidden by quiet_third_party
HIDDEN_WARNINGS = [
    (
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead.",
    ),
    (
        FutureWarning,
        "`gradient_checkpointing` is deprecated and will be removed in v6. Use "
        "`activation_checkpointing` instead.",
    ),
    (
        FutureWarning,
        "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
        "`is_activation_checkpointing` instead.",
    ),
    (
        UserWarning,
        "OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at 1 to improve oob performance.",
    ),
]


@pytest.fixture
def deepspeed_logger():
    """DeepSpeed's logger (by name, as DeepSpeed makes it) into a buffer; its filters
    restored after the test."""
    logger = logging.getLogger("DeepSpeed")
    filters, propagate = list(logger.filters), logger.propagate
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logger.addHandler(handler)
    logger.propagate = False
    yield logger, buffer
    logger.removeHandler(handler)
    logger.filters[:] = filters
    logger.propagate = propagate


def test_quiet_third_party_hides_only_the_listed_notices(deepspeed_logger):
    """Each listed warning and DeepSpeed's "untested optimizer" line is hidden; a warning
    or a DeepSpeed line that is not listed still prints (the same category, the same
    words around it)."""
    logger, buffer = deepspeed_logger
    kept = [
        (FutureWarning, "`torch.distributed.all_gather` is deprecated"),
        (UserWarning, "OMP_NUM_THREADS is unset"),
        (FutureWarning, "`use_cache` is deprecated and will be removed in v6."),
    ]
    with warnings.catch_warnings(record=True) as caught:  # the filters are restored after
        warnings.simplefilter("always")
        ucp_log.quiet_third_party()
        ucp_log.quiet_third_party()  # idempotent: one filter on the logger
        for category, message in HIDDEN_WARNINGS + kept:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in caught] == [message for _, message in kept]
    logger.warning("**** You are using ZeRO with an untested optimizer, proceed with caution ****")
    logger.warning("Unable to find hostfile, will proceed with training with local resources")
    assert buffer.getvalue().splitlines() == [
        "Unable to find hostfile, will proceed with training with local resources"
    ]
    assert sum(isinstance(f, ucp_log._DropLines) for f in logger.filters) == 1
