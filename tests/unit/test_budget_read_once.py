"""The per-rank memory budget is resolved once (``core.tiles.plan_tiles`` into a
``TilePlan``) and every layer reads the plan: ``memory_budget_gb`` appears in at most 3
modules of the package (the config's declaration, the resolver, and the planner's input
may be a third), not threaded through the layers, the Trainer and the planner."""

from __future__ import annotations

from tests.support.helpers import ROOT

PACKAGE = ROOT / "ulysses_cp"
MOST = 3


def readers() -> list[str]:
    """The package's modules whose text names ``memory_budget_gb``."""
    return sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "memory_budget_gb" in p.read_text()
    )


def test_memory_budget_is_read_in_at_most_three_modules():
    found = readers()
    assert len(found) <= MOST, (
        f"memory_budget_gb is read in {len(found)} modules ({found}); resolve it once "
        f"(core.tiles.plan_tiles) and hand the layers the TilePlan"
    )
    assert "core/tiles.py" in found  # the resolver: the test would pass vacuously otherwise
