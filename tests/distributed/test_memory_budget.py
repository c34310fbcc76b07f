"""``"model": {"memory_budget_gb": x}``: the per-rank budget that sizes ``"auto"`` tiles
(``core/tiles.py``). The rule keeps each tile within its share of the budget for any
budget and vocabulary, the run, the Hugging Face wrapper and the planner all take it, and
a 4-rank run (Ulysses 2 x ring 2) is exact at a small budget (many tiles) and a large one
(one tile), against one process of transformers' own model.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_memory_budget.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_memory_budget import GIB, _budget_case


@pytest.mark.parametrize(
    "budget_gb, loss_tiles, mlp_tiles",
    [
        # 2**18 B: loss tiles of 2**14 B = 8 tokens of 256 float64 logits, 32 / 8 = 4;
        # MLP tiles of 2**13 B = 8 tokens of a (tokens, 128) float64 intermediate: 4
        (2**18 / GIB, 4, 4),
        (1.0, 1, 1),  # one tile each
    ],
)
def test_hf_u2r2_exact_at_a_small_and_a_large_budget(pools, budget_gb, loss_tiles, mlp_tiles):
    for rel_loss, worst_grad, seen in pools(4).run(_budget_case, budget_gb):
        # counted from the 32 local tokens (the global 128 would give 16 tiles); every
        # MLP call (2 layers) and the loss
        assert seen == {"loss": [loss_tiles], "mlp": [mlp_tiles] * 2}, seen
        assert rel_loss <= 1e-10 and worst_grad <= 1e-6, (rel_loss, worst_grad)
