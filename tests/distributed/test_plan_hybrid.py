"""The planner knows hybrid models: which layers attend, which mix tokens with an adapter
(how many channels their all-to-alls carry), and the bytes of a training step, equal to
the counters of a step measured here (tiny Qwen3-Next, Bamba, Jamba and Kimi Linear, the
shipped configs)."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import ROOT, topology
from ulysses_cp.config import HFModelConfig
from ulysses_cp.core.comm import stats
from ulysses_cp.plan.comm import attention_bytes
from ulysses_cp.plan.shapes import model_shape

pytest.importorskip("transformers")
CONFIGS = {
    name: str(ROOT / "configs" / "hf" / f"tiny_{name}.json")
    for name in ("qwen3_next", "bamba", "jamba", "kimi_linear")
}


def _measured(rank, name, u, r):
    from ulysses_cp.models import hf

    topo = topology(u, r)
    mc = HFModelConfig(hf_config=CONFIGS[name])
    torch.manual_seed(0)  # the same weights on every rank
    model = hf.build_model(topo, mc, backend="math")
    ids = torch.randint(200, (1, 256), generator=torch.Generator().manual_seed(0))
    local = hf.shard_batch({"input_ids": ids, "labels": ids}, topo)
    stats.reset()
    loss = model.loss(
        local["input_ids"], local["position_ids"], local["shift_labels"], topo, batch=local["batch"]
    )
    loss.backward()
    return stats.total("all_to_all") + stats.total("ring") + stats.total("mixer_all_reduce")


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)], ids=str)
@pytest.mark.parametrize("name", ["qwen3_next", "bamba", "jamba", "kimi_linear"])
def test_hybrid_step_bytes_equal_the_plan(pools, name, u, r):
    shape = model_shape(HFModelConfig(hf_config=CONFIGS[name]))
    want = attention_bytes(shape, seq_len=256, batch=1, ulysses=u, ring=r)["total"]
    assert set(pools(4).run(_measured, name, u, r)) == {want}
