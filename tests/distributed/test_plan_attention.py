"""The planner's attention memory (``plan.memory.attention_activation``) against what one
attention layer holds: the kept head-sharded copies or none (``redo_all_to_all``), by
their formulas (unit tests), and the peak of one forward+backward of
``scripts/benchmark_attention_memory.py``'s layer at N = 2048 on 4 ranks, in live tensor
bytes (``scripts/profiling.py``'s ``LiveBytes``, what the planner counts): a distributed
test. The profiler's peaks (kernel scratch, communication buffers) vary by run and are
compared in ``scripts/plan_vs_measured.py --attention`` (docs/benchmarks/planner.md).

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan_attention.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_plan_attention import MODES, VARIANTS, _live_peaks, _predicted


@pytest.mark.distributed
def test_one_layer_peak_against_live_bytes(pools):
    N = 2048
    per_rank = pools(4).run(_live_peaks, N)
    for mode in MODES:
        for variant in VARIANTS:
            measured = max(p[f"{mode}/{variant}"] for p in per_rank)
            predicted = _predicted(mode, variant, N)
            assert abs(predicted - measured) <= 0.10 * measured, (
                mode,
                variant,
                predicted,
                measured,
            )
