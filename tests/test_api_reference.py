"""The generated API reference (mkdocs.yml's mkdocstrings, ``scripts/api_reference.py``):
Sphinx roles in the docstrings become links, defaults written as expressions show their
values, module attributes are not listed. The unit tests read the package as the site
does (griffe with the extension); the launcher test builds the site."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.helpers import ROOT

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


@pytest.mark.launcher
def test_the_built_site_shows_links_not_roles(tmp_path):
    site = tmp_path / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, check=True, timeout=600
    )
    pages = {p: p.read_text() for p in (site / "reference").rglob("*.html")}
    assert len(pages) >= 8, sorted(pages)
    # a role renders as ":func:<code>x</code>" (its backticks read as code)
    role = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):(?:`|<code>)")
    roles = {p.parent.name: role.findall(t) for p, t in pages.items()}
    assert {k: v for k, v in roles.items() if v} == {}
    html = "".join(pages.values())
    assert len(re.findall(r'<a class="autorefs autorefs-internal"', html)) > 20
    assert not [h for h in HIDDEN if f'id="{h}"' in html]
    topology = html[html.index('id="ulysses_cp.core.topology.init_topology"') :][:3000]
    assert "zigzag" in topology and "_DEFAULT" not in topology
