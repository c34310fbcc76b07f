"""The all-to-all puts every element where it belongs, and counts its bytes.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_comm.py.
"""

from __future__ import annotations


def test_traffic_set_aside_is_not_counted():
    from ulysses_cp.core.comm import CommStats

    s = CommStats()
    s.add("all_to_all", "forward", 100)
    with s.set_aside():
        s.add("all_to_all", "forward", 7)
        s.add("ring", "backward", 5)
        assert s.total() == 112  # counted inside the block, as ever
    assert s.total() == 100 and s.calls[("all_to_all", "forward")] == 1
    assert ("ring", "backward") not in s.bytes
