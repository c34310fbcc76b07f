"""The planner against measurements made at test time (independent of its code): the
attention byte counters, the live tensor bytes of a training step, what a DeepSpeed
engine leaves allocated and what its comms logger records, and benchmark_memory.py's
longest-sequence search; then its CLI: fields, ranking, errors.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_plan.py.
"""

from __future__ import annotations

import plan_vs_measured as pvm
import pytest

from tests.unit.test_plan import _exchange_bytes, _longest, _steps, _tiny, _zero
from ulysses_cp.plan.comm import attention_bytes


@pytest.mark.parametrize("world", [1, 2, 4])
def test_attention_bytes_exact_and_activation_within_15_percent(pools, world):
    """Every mode at P = world, both models, no memory features / tiled / tiled +
    checkpointing: the all-to-all + ring bytes equal the counters exactly, the activation
    peak is within 15% of the measured one."""
    for kw, measured in pools(world).run(_steps, world)[0]:
        pred = pvm.predicted_step(**kw)
        assert pred["attention_bytes"] == measured["attention_bytes"], kw
        err = pred["activation"] / measured["activation"] - 1
        assert abs(err) <= 0.15, (kw, pred, measured, f"{err:+.1%}")


@pytest.mark.parametrize("world, kinds", [(2, ("reference", "hf")), (4, ("reference",))])
def test_static_memory_and_zero_bytes_against_deepspeed(pools, world, kinds):
    """ZeRO 1/2/3 over ``world`` ranks: static bytes within 15% of what model, engine and
    two steps leave allocated; collective bytes within 5% of DeepSpeed's comms logger."""
    for stage, kind, measured in pools(world).run(_zero, world, kinds)[0]:
        pred = pvm.predicted_zero(world, stage, kind)
        err = pred["static"] / measured["static"] - 1
        assert abs(err) <= 0.15, (stage, pred, measured, f"{err:+.1%}")
        logged = sum(n for n in measured["logged"].values() if n > 64)  # not the flag bytes
        err = sum(pred["logged"].values()) / logged - 1
        assert abs(err) <= 0.05, (stage, pred, measured, f"{err:+.1%}")


@pytest.mark.slow
def test_longest_sequence_within_one_search_step(pools):
    """benchmark_memory.py's search (measured peaks) and the planner's (predicted peaks)
    land within one step (2P*64 tokens) of each other, at P = 1 and 4 (u2 x r2)."""
    for world, (u, r) in ((1, (1, 1)), (4, (2, 2))):
        cases = [
            dict(u=u, r=r, kind=kind, features=f, budget=4 * 2**20)
            for kind in ("reference", "hf")
            for f in ("none", "tiled+ckpt")
        ]
        for kw, measured in zip(cases, pools(world).run(_longest, cases)[0]):
            pred = pvm.predicted_longest(**kw)
            assert abs(pred - measured) <= 2 * u * r * 64, (kw, pred, measured)


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_attention_bytes_of_each_kv_exchange(pools, exchange):
    """One layer under u2 x r2: the predicted forward + backward bytes equal the counters,
    for the ring and for the all-gather exchange (one dk/dv block fewer in the backward)."""
    shape = _tiny(n_layers=1)
    pred = attention_bytes(shape, seq_len=512, batch=1, ulysses=2, ring=2, kv_exchange=exchange)
    assert pools(4).run(_exchange_bytes, exchange, shape) == [pred["total"]] * 4
