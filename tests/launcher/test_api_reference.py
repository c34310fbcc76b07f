"""The generated API reference (mkdocs.yml's mkdocstrings, ``scripts/api_reference.py``):
Sphinx roles in the docstrings become links, defaults written as expressions show their
values, module attributes are not listed. The unit tests read the package as the site
does (griffe with the extension); the launcher test builds the site.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_api_reference.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import ROOT
from tests.unit.test_api_reference import HIDDEN


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
