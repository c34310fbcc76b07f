"""``"model": {"compile": true}``: each decoder layer under ``torch.compile`` (CPU inductor,
float32) gives the eager loss and, per parameter, the eager gradients (nonzero) under
Ulysses, ring and hybrid, for the reference decoder and a tiny Hugging Face Llama; a
Ulysses layer is one graph (no break), ring and hybrid break exactly around the ring call;
the all-to-all byte counters count a compiled step as an eager one. Compiling is slow on
two CPU cores: one test per mode, both models in it."""

from __future__ import annotations

import re

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import ROOT
from ulysses_cp.config import model_config

TINY_LLAMA = str(ROOT / "configs" / "hf" / "tiny_llama.json")
_TOPOS: dict = {}


def _attention_fullgraph(rank: int) -> bool:
    """The Ulysses attention call compiles with ``fullgraph=True`` (no graph break) and
    equals eager, gradients included; ranks with different local lengths get the same
    ``ValueError`` from the in-graph check, every rank."""
    topo = _topology(2, 1)
    compiled = compiled_equals_eager(rank, topo, [(2, 8, h, 8) for h in (4, 2, 2)], keep=True)
    s = 8 if rank == 0 else 16
    q, k, v = (torch.randn(1, s, h, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match=r"q local seq: rank 0 8, rank 1 16"):
        compiled(q, k, v)
    return True


def test_ulysses_attention_compiles_in_one_graph_and_checks_every_rank(pools):
    assert pools(2).run(_attention_fullgraph) == [True, True]


def compiled_equals_eager(rank: int, topo, shapes, *, keep: bool = False):
    """``ucp.attention`` compiled with ``fullgraph=True`` on random q, k, v of ``shapes``
    equals eager, output and gradients, all nonzero (also tests/distributed/test_mla_widths.py's).
    Returns the compiled output, or with ``keep`` the compiled function."""

    def attend(q, k, v):
        return ucp.attention(q, k, v, topo)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(shape, generator=g) for shape in shapes)
    outs = {}
    for name, fn in (("eager", attend), ("compiled", compiled)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.square().sum().backward()
        outs[name] = [out, *(t.grad for t in leaves)]
    for got, want in zip(outs["compiled"], outs["eager"]):
        torch.testing.assert_close(got, want)
        assert got.abs().sum() > 0
    return compiled if keep else outs["compiled"][0]


def _topology(u: int, r: int):
    # own groups with a long timeout: the ranks compile at their own pace before the first
    # collective inside a compiled layer
    if (u, r) not in _TOPOS:
        _TOPOS[(u, r)] = ucp.init_topology(u, r, timeout_s=900)
    return _TOPOS[(u, r)].with_options(layout="zigzag", backend="math")


def _build(which: str, topo, compiled: bool):
    from ulysses_cp.training.build import build_model

    block = {"compile": compiled, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2}
    if which == "hf":
        block = {"hf_config": TINY_LLAMA, "compile": compiled}
    torch.manual_seed(0)
    return build_model(model_config(block), topo)


def _loss(model, which: str, topo, ids: torch.Tensor) -> torch.Tensor:
    local = ucp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    if which == "hf":
        args = (local["input_ids"], local["position_ids"], local["shift_labels"], topo)
        return model.loss(*args, batch=local["batch"])
    logits = model(local["input_ids"], local["position_ids"], batch=local["batch"])
    return ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)


def _steps(model, which: str, topo, steps: int = 2):
    """Per step: (loss, {name: gradient}, all-to-all bytes); fresh ids each step."""
    out = []
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
        model.zero_grad(set_to_none=True)
        ucp.comm_stats.reset()
        loss = _loss(model, which, topo, ids)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads, ucp.comm_stats.total("all_to_all")))
    return out


def _compare(rank: int, u: int, r: int, models: tuple[str, ...]) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    topo = _topology(u, r)
    found = {}
    for which in models:
        eager = _steps(_build(which, topo, False), which, topo)
        compiled = _steps(_build(which, topo, True), which, topo)
        for (loss, grads, a2a), (closs, cgrads, ca2a) in zip(eager, compiled):
            torch.testing.assert_close(closs, loss, rtol=1e-5, atol=1e-6)
            assert set(cgrads) == set(grads), (sorted(grads), sorted(cgrads))
            for name, g in grads.items():
                torch.testing.assert_close(cgrads[name], g, rtol=1e-4, atol=1e-6, msg=name)
                assert cgrads[name].abs().sum() > 0, f"{which}: zero gradient for {name}"
            assert ca2a == a2a, (which, ca2a, a2a)
        found[which] = (len(grads), eager[0][2])
    # each break's reason names the function it skipped (addresses vary per process)
    found["graph breaks"] = {
        re.sub(r" at 0x[0-9a-f]+", "", reason): n for reason, n in counters["graph_break"].items()
    }
    found["unique graphs"] = counters["stats"]["unique_graphs"]
    return found


def _run(pools, u: int, r: int, models: tuple[str, ...] = ("decoder", "hf")) -> dict:
    """Eager against compiled for ``models`` at ``u`` x ``r``. The Hugging Face model's
    compiled layers wrap the same attention call as the decoder's: the Ulysses test runs
    both; ring and hybrid run the decoder (their graph breaks are the attention's own)."""
    results = pools(u * r).run(_compare, u, r, models, timeout=1800)
    return results[0]


@pytest.mark.slow
def test_compiled_layers_ulysses_one_graph(pools):
    found = _run(pools, 2, 1)
    assert found["graph breaks"] == {}, found
    assert found["unique graphs"] == 2, found  # one per model: no recompiles
    assert found["decoder"][1] > 0 and found["hf"][1] > 0, found  # all-to-all bytes counted


@pytest.mark.slow
def test_compiled_layers_ring(pools):
    found = _run(pools, 1, 2, ("decoder",))
    breaks = found["graph breaks"]
    assert breaks and all("ring_attention" in reason for reason in breaks), breaks


@pytest.mark.slow
def test_compiled_layers_hybrid(pools):
    found = _run(pools, 2, 2, ("decoder",))
    breaks = found["graph breaks"]  # the hybrid attention as a whole, eager
    assert breaks and all("chunked_attention" in reason for reason in breaks), [
        reason.splitlines()[:2] for reason in breaks
    ]
    assert found["decoder"][1] > 0, found
