"""The log-prob primitive (ulysses_cp/models/log_probs.py) against plain float64 autograd
through ``log_softmax`` (one process, whole rows): values of every output and the
gradients of a loss that weighs log-probs and entropies; under sequence parallelism a
DPO-style loss of the gathered values, whose SP-summed gradients equal one process.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_log_probs.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_log_probs import S, _sp_case


@pytest.mark.parametrize("u,r,layout", [(2, 1, "zigzag"), (1, 2, "contiguous"), (2, 2, "zigzag")])
def test_sequence_log_probs_exact_against_one_process(pools, u, r, layout):
    for results, ref_loss, (rh, rw), counts, true_counts, shape in pools(u * r).run(
        _sp_case, u, r, layout, False
    ):
        assert shape == (4, S)
        torch.testing.assert_close(counts, true_counts)
        for loss, gh, gw in results:
            assert loss == pytest.approx(ref_loss, rel=1e-12)
            torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


def test_sequence_log_probs_seen_failing_with_a_doubled_scale(pools):
    """The check above fails when the gradient carries twice the run's scale."""
    results, _, (rh, _), *_ = pools(2).run(_sp_case, 2, 1, "zigzag", True)[0]
    for _, gh, _ in results:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
