"""``"fused_loss": true``: the LM head's and the loss's gradients computed in the forward
give the loss and EVERY gradient (the head's weight and bias included) of the plain
autograd loss, with a logit scale and a softcap, in one process, under SP (Ulysses 2 and
hybrid 2 x 2, against a one-process transformers model) and under ZeRO 1-3.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_fused_loss.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_fused_loss import HEADS, _fused_equals_one_process, _zero_step


@pytest.mark.parametrize("u,r", [(2, 1), (2, 2)], ids=lambda x: str(x))
@pytest.mark.parametrize("family", list(HEADS))
def test_fused_loss_under_sp_equals_one_process(pools, family, u, r):
    """Loss and every gradient (lm_head's weight, tied or not, included), summed over the
    SP ranks, equal transformers' own model in one process; eager attention takes its
    softmax in float32, so the bound is 1e-5 of each gradient's largest entry (a 2x
    gradient is off by 1)."""
    for worst, names, folded in pools(u * r).run(_fused_equals_one_process, u, r, family):
        assert folded == (family == "gemma2")  # Cohere's LayerNorm is no RMSNorm
        assert any("embed" in n for n in names)
        bad = {name: err for name, err in worst.items() if err > 1e-5}
        assert not bad, bad


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fused_loss_gives_the_plain_update_under_zero(pools, stage):
    """One SGD step (its update scales with the gradient) with the fused loss equals the
    plain loss's, every parameter, lm_head's weight included."""
    plain = pools(4).run(_zero_step, stage, False)
    fused = pools(4).run(_zero_step, stage, True)
    for (loss_a, params_a), (loss_b, params_b) in zip(plain, fused):
        assert abs(loss_a - loss_b) < 1e-6, (loss_a, loss_b)
        assert "model.lm_head.weight" in params_a or "lm_head.weight" in params_a
        for name, a in params_a.items():
            err = (a - params_b[name]).abs().max().item()
            assert err < 1e-6, f"{name}: updated parameters differ by {err}"
