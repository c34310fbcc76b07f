"""Task "dataset": local files tokenized by a local tokenizer into a cached memory map;
windows and packed rows; held-out evaluation under sequence parallelism.

The distributed-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_dataset.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.unit import test_dataset as unit_tier
from tests.unit.test_dataset import _built_corpus, _eval_under_sp

data = unit_tier.data  # the corpus fixture, shared with the unit tier


@pytest.mark.parametrize("u,r,packing", [(2, 2, False), (2, 2, True), (2, 1, True)])
def test_eval_loss_under_sp_equals_the_single_process_loss(pools, data, tmp_path, u, r, packing):
    args = ([str(data["jsonl"])], str(data["tok"]), str(tmp_path / "cache"), u, r, packing, 3, 2)
    results = pools(4).run(_eval_under_sp, *args)
    for got, want, count in results:
        assert got["eval_tokens"] == count > 0
        assert got["eval_loss"] == pytest.approx(want, rel=1e-9)
        assert got["eval_ppl"] == pytest.approx(math.exp(want), rel=1e-9)
    assert len({json.dumps(g, sort_keys=True) for g, _, _ in results}) == 1  # every rank
    caches = list((tmp_path / "cache").iterdir())
    assert len(caches) == 1 and (caches[0] / "meta.json").is_file()  # built once


@pytest.mark.distributed
def test_tokenizing_processes_give_the_same_ids(data, tmp_path):
    _built_corpus(data, data["parquet"], tmp_path / "cache", workers=2)
