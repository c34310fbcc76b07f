"""The benchmark scripts on GPUs: every bookkeeping collective and CUDA sync goes through
``scripts/benchlib.py`` (tensors on the rank's device, the rank's own GPU), checked
statically; benchlib's choice of device and backend per rank; its helpers on gloo ranks.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_scripts_devices.py.
"""

from __future__ import annotations

from tests.unit.test_scripts_devices import _helpers_on_rank


def test_helpers_on_two_gloo_ranks(pools):
    out = pools(2).run(_helpers_on_rank)
    for res in out:
        assert res["gathered"] == [[0.0, 2.0**40, 0.5], [1.0, 2.0**40 + 1, 0.5]]
        assert res["max"] == 10.0
