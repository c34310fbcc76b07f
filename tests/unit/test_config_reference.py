"""The config reference (docs/reference/config.md) is generated from the field docstrings:
every key of every block the run config parses has one, as griffe (the site's reader)
sees it, and every block class is rendered on that page under its JSON key."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from unittest import mock

import pytest

from tests.support.helpers import ROOT
from ulysses_cp.config import OUR_KEYS, RunConfig

griffe = pytest.importorskip("griffe")
PAGE = ROOT / "docs" / "reference" / "config.md"


def block_classes(cls: type = RunConfig) -> list[type]:
    """The dataclasses a run config is parsed into, found from ``RunConfig``'s annotations
    down (``X | Y`` and nested blocks such as ``RunOptions`` included), so that a new block
    is covered without a list to keep."""
    found: list[type] = []
    for hint in typing.get_type_hints(cls).values():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        for t in typing.get_args(hint) if union else (hint,):
            if dataclasses.is_dataclass(t) and isinstance(t, type) and t not in found:
                found += [t, *[b for b in block_classes(t) if b not in found]]
    return found


@pytest.fixture(scope="module")
def package():
    # griffe asks git for the source links (a process): the site shows none (show_source off)
    with mock.patch.object(griffe.GitInfo, "from_package", return_value=None):
        return griffe.load("ulysses_cp", search_paths=[str(ROOT)])


def test_the_blocks_are_found_from_the_run_config():
    names = {c.__name__ for c in block_classes()}
    assert names == {
        "SequenceParallelConfig",
        "RunOptions",
        "ModelConfig",
        "HFModelConfig",
        "DataConfig",
        "EvalConfig",
        "TrainingConfig",
        "DeepSpeedSettings",
        "TrainerModelConfig",
    }


@pytest.mark.parametrize("cls", block_classes(), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(package, cls):
    entry = package[f"{cls.__module__.removeprefix('ulysses_cp.')}.{cls.__qualname__}"]
    missing = []
    for f in dataclasses.fields(cls):
        member = entry.members.get(f.name)
        doc = member.docstring if member is not None else None
        if doc is None or not doc.value.strip():
            missing.append(f.name)
    assert missing == [], f"{cls.__name__}: fields without a docstring: {missing}"


def test_every_block_is_rendered_under_its_json_key():
    page = PAGE.read_text()
    rendered = set(re.findall(r"^::: ([\w.]+)", page, re.M))
    expected = {f"{c.__module__}.{c.__qualname__}" for c in block_classes()}
    assert expected <= rendered, sorted(expected - rendered)
    headings = re.findall(r'^## "(\w+)"', page, re.M)
    assert set(headings) == set(OUR_KEYS), headings
