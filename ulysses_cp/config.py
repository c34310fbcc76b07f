"""Config blocks as dataclasses: one place that rejects unknown keys."""

from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

T = TypeVar("T")


def from_block(cls: type[T], block: dict | None, name: str) -> T:
    """``cls(**block)``, or ``ValueError`` naming the unknown keys and the valid ones."""
    block = dict(block or {})
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(block) - set(known))
    if unknown:
        raise ValueError(f'unknown keys in the "{name}" block: {unknown}; valid keys: {known}')
    return cls(**block)
