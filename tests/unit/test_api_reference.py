"""The generated API reference (mkdocs.yml's mkdocstrings, ``scripts/api_reference.py``):
Sphinx roles in the docstrings become links, defaults written as expressions show their
values, module attributes are not listed. The unit tests read the package as the site
does (griffe with the extension); the launcher test builds the site."""

from __future__ import annotations

import re
import sys
from unittest import mock

import pytest

from tests.support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import api_reference

griffe = pytest.importorskip("griffe")
HIDDEN = ("ulysses_cp.training.checkpoint.log", "ulysses_cp.training.checkpoint.LATEST")


@pytest.fixture(scope="module")
def package():
    extensions = griffe.load_extensions(api_reference.SiteDocstrings)
    # griffe asks git for the source links (a process): the site shows none (show_source off)
    with mock.patch.object(griffe.GitInfo, "from_package", return_value=None):
        return griffe.load("ulysses_cp", search_paths=[str(ROOT)], extensions=extensions)


def test_no_docstring_keeps_a_role_and_some_become_links(package):
    texts = [o.docstring.value for o in api_reference.walk(package) if o.docstring is not None]
    assert [t for t in texts if api_reference.ROLE.search(t)] == []
    links = [x for t in texts for x in re.findall(r'<autoref identifier="([\w.]+)"', t)]
    assert len(links) > 20, links
    assert "ulysses_cp.core.options.RunOptions" in links  # ~ulysses_cp.core.options.RunOptions
    assert "ulysses_cp.kernels.dispatch.attn_forward" in links  # a name of the module


def test_defaults_are_values_and_module_attributes_are_gone(package):
    defaults = {p.name: p.default for p in package["core.topology.init_topology"].parameters}
    assert defaults["layout"] == "'zigzag'" and defaults["head_chunks"] == "0", defaults
    checkpoint = package["training.checkpoint"]
    assert "log" not in checkpoint.members and "LATEST" not in checkpoint.members
    assert "save" in checkpoint.members and "SaveHook" in checkpoint.members
