"""Hybrid token mixers under sequence parallelism: the channel exchange, packed documents
(each starts a fresh state), refusals of head counts that do not split, and the bytes.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf_mixers.py.
"""

from __future__ import annotations

from ulysses_cp.models.hf_mixers import mixer_degrees


def test_mixer_degrees():
    assert mixer_degrees({"heads": 8, "groups": 2}, 8) == [1, 2, 4, 8]
    assert mixer_degrees({"channels": 12}, 12) == [1, 2, 3, 4, 6, 12]
    assert mixer_degrees({"key heads": 2, "value heads": 8}, 8) == [1, 2]
