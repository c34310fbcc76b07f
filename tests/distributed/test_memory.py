"""ALST memory features change nothing but memory: tiled MLP, tiled LM head + loss and
activation checkpointing (with CPU offload) give the untiled loss and update under ZeRO.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_memory.py.
"""

from __future__ import annotations

import pytest

from tests.unit.test_memory import FEATURES, OFF, _step


@pytest.mark.parametrize("kind", ["reference", "hf"])
@pytest.mark.parametrize("stage", [2, 3])
def test_memory_features_give_the_untiled_loss_and_update(pools, kind, stage):
    if kind == "hf":
        pytest.importorskip("transformers")
    plain = pools(4).run(_step, kind, stage, OFF)
    saved = pools(4).run(_step, kind, stage, FEATURES)
    for (loss_a, params_a, n_a), (loss_b, params_b, n_b) in zip(plain, saved):
        assert n_a == 0 and n_b == 2  # the features really were on (2 layers)
        assert abs(loss_a - loss_b) < 1e-6, (loss_a, loss_b)
        err = max((a - b).abs().max().item() for a, b in zip(params_a, params_b))
        assert err < 1e-6, f"updated parameters differ by {err}"
