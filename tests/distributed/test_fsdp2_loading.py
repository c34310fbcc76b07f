"""Hugging Face safetensors into an FSDP2 model built on meta
(``ulysses_cp.training.fsdp2_loading``): 4 gloo ranks, float64.

Tiny Llamas are saved by ``save_pretrained`` (one file, and shards with their index),
with tied embeddings (vocabulary 97: shards of 25, 25, 25 and 22 rows) and untied
(vocabulary 9: 3, 3, 3 and no row on the last rank). Each rank builds the model on meta,
``fully_shard``s it over ``fsdp_mesh``'s ``shard_mesh``, calls ``to_empty`` and loads.
Every parameter gathered whole must equal the saved model's, the logits the saved
model's logits, and the rows each rank read through ``get_slice`` must be exactly its
shard's rows (no whole tensor read: ``get_tensor`` is never called)."""

from __future__ import annotations

import copy

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import HF_TINY

CASES = {"tied": (97, True), "untied": (9, False)}  # vocabulary, tie_word_embeddings
_meshes: dict = {}


def _config(vocab: int, tied: bool):
    import transformers

    return transformers.LlamaConfig(**{**HF_TINY, "vocab_size": vocab}, tie_word_embeddings=tied)


def _save(root, case: str):
    """Save the case's model twice (one file; shards of at most 4 KB) and return it."""
    import transformers

    torch.manual_seed(0)
    cfg = _config(*CASES[case])
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=torch.float64
    )
    model.save_pretrained(root / case / "single", safe_serialization=True)
    model.save_pretrained(root / case / "sharded", safe_serialization=True, max_shard_size="4KB")
    return model


class _Spy:
    """A ``safe_open`` reader that records the box of every ``get_slice`` read and every
    whole ``get_tensor`` read."""

    def __init__(self, reader, log: list) -> None:
        self.reader, self.log = reader, log

    def __enter__(self):
        self.reader.__enter__()
        return self

    def __exit__(self, *exc):
        return self.reader.__exit__(*exc)

    def keys(self):
        return self.reader.keys()

    def get_tensor(self, key):
        self.log.append((key, "whole"))
        return self.reader.get_tensor(key)

    def get_slice(self, key):
        view, log = self.reader.get_slice(key), self.log

        class View:
            def get_shape(self):
                return view.get_shape()

            def __getitem__(self, box):
                log.append((key, tuple((s.start, s.stop) for s in box)))
                return view[box]

        return View()


def _load(rank, root: str, case: str, kind: str, ids: torch.Tensor) -> dict:
    import safetensors
    import transformers
    from torch.distributed.fsdp import fully_shard

    from ulysses_cp.training.fsdp2_loading import load_safetensors_sharded

    if "mesh" not in _meshes:
        _meshes["mesh"] = ucp.fsdp_mesh(4, 1, 1, backend="math").shard_mesh
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(_config(*CASES[case])), attn_implementation="sdpa", dtype=torch.float64
        )
    for layer in model.model.layers:
        fully_shard(layer, mesh=_meshes["mesh"])
    fully_shard(model, mesh=_meshes["mesh"])
    model.to_empty(device="cpu")
    log: list = []
    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _Spy(real(*a, **k), log)
    try:
        n = load_safetensors_sharded(model, f"{root}/{case}/{kind}")
    finally:
        safetensors.safe_open = real
    weights = {k: p.detach().full_tensor() for k, p in model.named_parameters()}
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return dict(n=n, weights=weights, buffers=buffers, logits=logits, log=log, tied=tied)


def _rows(n: int, rank: int, world: int = 4) -> tuple[int, int]:
    """Rank ``rank``'s rows of a dim of ``n`` rows cut by ``torch.chunk`` (as FSDP2 does):
    chunks of ceil(n / world), the last ones shorter or empty."""
    size = -(-n // world)
    return min(rank * size, n), min((rank + 1) * size, n)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_reads_its_rows_and_the_model_equals_the_saved_one(pools, tmp_path, case):
    pytest.importorskip("transformers")
    ref = _save(tmp_path, case)
    ids = torch.randint(CASES[case][0], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_logits = ref(input_ids=ids).logits
    want = dict(ref.named_parameters())
    assert len(list((tmp_path / case / "sharded").glob("*.safetensors"))) > 2
    for kind in ("single", "sharded"):
        results = pools(4).run(_load, str(tmp_path), case, kind, ids)
        for rank, res in enumerate(results):
            assert res["tied"] is CASES[case][1]
            assert res["n"] == len(want), (kind, res["n"])  # a tied pair is one tensor
            assert res["weights"].keys() == want.keys()
            for name, w in want.items():
                assert torch.equal(res["weights"][name], w), f"{kind}: {name}"
            for name, b in ref.named_buffers():  # inv_freq, recomputed
                assert torch.equal(res["buffers"][name], b), f"{kind}: {name}"
            torch.testing.assert_close(res["logits"], want_logits, rtol=1e-12, atol=1e-12)
            assert all(box != "whole" for _, box in res["log"])  # never a whole tensor
            rows = {key: box[0] for key, box in res["log"]}  # dim 0: the shard's rows
            for key, (start, stop) in rows.items():
                assert (start, stop) == _rows(want[key].shape[0], rank), (kind, key, rank)
            empty = {k for k, w in want.items() if _rows(w.shape[0], rank)[0] == w.shape[0]}
            assert rows.keys() == set(want) - empty  # an empty shard reads nothing
