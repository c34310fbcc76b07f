"""What the planner ranks its candidates by (``--goal``), and the chosen candidate
against the config as written, in numbers."""

from __future__ import annotations

import json
from dataclasses import fields

from .search import Run

__all__ = ["GOALS", "SETTINGS", "changes", "rank", "versus"]

#: What each ``--goal`` ranks the candidates that fit by (``{n}``: the planned length).
GOALS = {
    "longest": "the longest sequence that fits (max seq), ties by the shorter predicted step",
    "fastest": "the shortest predicted step at seq_len {n}, ties by the longer max seq",
}

#: The keys of a candidate that say how it runs (the rest are its predictions).
SETTINGS = (
    "ulysses_degree",
    "ring_degree",
    *(f.name for f in fields(Run) if f.name not in ("ulysses", "ring", "extra")),
)


def rank(cands: list[dict], goal: str) -> list[dict]:
    """``cands`` (with ``fits``, ``max_seq_len`` and ``predicted_step_s``) in the order
    ``goal`` asks (:data:`GOALS`), those that fit at the planned length first.

    Raises:
        ValueError: ``goal`` is not one of :data:`GOALS`.
    """
    if goal == "longest":
        return sorted(
            cands, key=lambda c: (not c["fits"], -c["max_seq_len"], c["predicted_step_s"])
        )
    if goal == "fastest":
        return sorted(
            cands, key=lambda c: (not c["fits"], c["predicted_step_s"], -c["max_seq_len"])
        )
    raise ValueError(f"--goal {goal!r}: choose one of {', '.join(GOALS)}")


def changes(written: dict, c: dict) -> list[str]:
    """The :data:`SETTINGS` in which candidate ``c`` differs from the config as written."""
    return [k for k in SETTINGS if c[k] != written[k]]


def versus(result: dict) -> list[str]:
    """The table's lines on the chosen candidate against the config as written: the
    settings that differ, the longest sequence each fits and their predicted steps."""
    w, c, goal = result["config"], result["chosen"], result["goal"]
    if c is None:
        return []
    diff = changes(w, c)
    if not diff:
        return [f"chosen (--goal {goal}): the config as written, {w['max_seq_len']:,} tokens"]
    settings = ", ".join(f"{k} {json.dumps(c[k])} (as written {json.dumps(w[k])})" for k in diff)
    return [
        f"chosen (--goal {goal}), the first row above, differs from the config as written in "
        f"{settings}: it fits {c['max_seq_len']:,} tokens where the config as written fits "
        f"{w['max_seq_len']:,}; predicted step at seq_len {result['inputs']['seq_len']:,}: "
        f"{c['predicted_step_s']:.3g} s, as written {w['predicted_step_s']:.3g} s"
    ]
