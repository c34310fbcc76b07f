"""The family sweep: every decoder family transformers 5 ships (tests/support/hf_zoo.py), built tiny
and random, under hybrid sequence parallelism 2 x 2 (the all-to-all and the ring), is
either exact (the one-process loss and, summed over the SP ranks, the one-process
gradients, float64 where the family runs in it) or refused on every rank with the same
message. Anything else fails: a silently wrong family, a crash, or a refusal on some ranks
only. ``VERDICTS`` pins which way each family goes (docs/reference/families.md is this table), so a
family that changes sides is seen; the families the issue names run in every mode.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf_sweep.py.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_hf_sweep import EXACT, MOE, NAMED, transformers
from tests.support.helpers import ROOT
from tests.support.hf_zoo import (
    FAMILIES,
    tiny_config,
    with_router_loss,
)

pytestmark = pytest.mark.slow


def test_the_family_table_in_the_docs_is_the_sweeps():
    """docs/reference/families.md has one row per family: exact exactly for EXACT."""
    rows = {}
    for line in (ROOT / "docs" / "reference" / "families.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == set(FAMILIES)
    assert {f for f, verdict in rows.items() if verdict == "exact"} == EXACT
    assert set(NAMED) <= EXACT


def test_the_moe_table_in_the_docs_is_the_sweeps():
    """docs/reference/families.md's MoE table has one row per MoE family: exact with the loss
    computed over the whole sequence exactly when the family is exact and its forward adds
    one, refused exactly when the sweep refuses it."""
    from ulysses_cp.models.hf_loss_terms import router_aux

    VERDICTS = ("exact", "refused")
    rows = {}
    for line in (ROOT / "docs" / "reference" / "families.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[1].startswith(VERDICTS):
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == set(MOE)
    for family, status in rows.items():
        model = transformers.AutoModelForCausalLM.from_config(with_router_loss(tiny_config(family)))
        try:
            adds = router_aux(model) is not None
        except ValueError:
            adds = None  # a loss term refused
        if family not in EXACT:
            assert status.startswith("refused"), (family, status)
        else:
            want = "exact, over the whole sequence" if adds else "exact: its forward adds none"
            assert status == want, (family, status)
