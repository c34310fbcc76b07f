"""The planner's attention memory (``plan.memory.attention_activation``) against what one
attention layer holds: the kept head-sharded copies or none (``redo_all_to_all``), and the
peak of one forward+backward, measured two ways:

- the table of docs/benchmarks.md ("Targets", N = 8192, profiler allocation events, so
  kernel scratch and the lifetimes of communication buffers count): a unit test;
- live tensor bytes (``scripts/profiling.py``'s ``LiveBytes``, what the planner counts) of
  the same layer at N = 2048 on 4 ranks: a distributed test."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

import ulysses_cp as ucp
from tests.helpers import ROOT, topology
from ulysses_cp.plan.memory import activation_bytes, attention_activation, attention_layer_peak
from ulysses_cp.plan.shapes import ModelShape

MiB = 2**20
HQ, HKV, D = 8, 4, 64  # scripts/benchmark_attention_memory.py's layer, float32
LAYER = ModelShape(family="reference", vocab=0, dim=HQ * D, layers=1, hq=HQ, hkv=HKV,
                   head_dim=D, ffn=0, params=0, layer_params=0, dtype_bytes=4)  # fmt: skip
MODES = {"ulysses 4": (4, 1), "hybrid 2x2": (2, 2)}
# variant: (head chunks, redo); "default" resolves to 2 chunks at N = 8192 in both modes
VARIANTS = {"before": (1, False), "default": (2, False), "redo": (2, True)}


def _predicted(mode: str, variant: str, N: int) -> int:
    (u, r), (c, redo) = MODES[mode], VARIANTS[variant]
    return attention_layer_peak(LAYER, seq_len=N, batch=1, ulysses=u, ring=r, head_chunks=c,
                                redo=redo)  # fmt: skip


def test_kept_copies_are_saved_and_redo_saves_none():
    kw = dict(s_local=2048, batch=1, ulysses=4, ring=1, head_chunks=2)
    kept, redo = (attention_activation(LAYER, **kw, redo=flag) for flag in (False, True))
    q, k = 2048 * HQ * D * 4, 2048 * HKV * D * 4  # the rank's q (and output), k (and v)
    assert kept["kept"] == 2 * q + 2 * k  # as many bytes as the caller's q, k, v, out
    # in a model the caller's q, k, v go (the copies replace them), the output stays
    assert kept["saved"] == q and redo["saved"] == redo["kept"] == 0
    # redo: all layers' saved bytes go, one layer's working set does not
    deep = [activation_bytes(LAYER, seq_len=8192, batch=1, ulysses=4, ring=1, head_chunks=2,
                             redo=flag)["layers"] for flag in (False, True)]  # fmt: skip
    assert deep[0] - deep[1] == kept["saved"]
    # ring only: no all-to-all, nothing kept; redo changes nothing
    ring = [attention_activation(LAYER, s_local=2048, batch=1, ulysses=1, ring=4, redo=flag)
            for flag in (False, True)]  # fmt: skip
    assert ring[0] == ring[1] and ring[0]["saved"] == ring[0]["kept"] == 0


def test_replicated_kv_is_kept_at_its_replicated_width():
    mqa = replace(LAYER, hkv=2)  # 2 kv heads over 4 ranks: each replicated twice
    got = attention_activation(mqa, s_local=1024, batch=1, ulysses=4, ring=1, head_chunks=2)
    q, k, k_rep = (1024 * h * D * 4 for h in (HQ, 2, 4))
    assert got["kept"] == 2 * q + 2 * k_rep and got["saved"] == q + 2 * (k_rep - k)


def _live_peak(rank: int, topo, N: int) -> int:
    """The benchmark's layer at N tokens: live tensor bytes of one forward+backward, plus
    its inputs."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from profiling import peak_memory

    g = torch.Generator().manual_seed(rank)
    s_l = N // topo.sp_world_size
    shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
    ins = [torch.randn(s, generator=g) for s in shapes]
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(ins))

    def step():
        ucp.attention(q, k, v, topo, backend="torch").backward(dout)

    return peak_memory(step, scratch=False) + sum(t.numel() * t.element_size() for t in ins)


def _live_peaks(rank: int, N: int) -> dict:
    """:func:`_live_peak` for every mode and variant."""
    return {
        f"{mode}/{variant}": _live_peak(
            rank, topology(u, r, "zigzag", head_chunks=c, redo_all_to_all=redo), N
        )
        for mode, (u, r) in MODES.items()
        for variant, (c, redo) in VARIANTS.items()
    }


@pytest.mark.distributed
def test_one_layer_peak_against_live_bytes(pools):
    N = 2048
    per_rank = pools(4).run(_live_peaks, N)
    for mode in MODES:
        for variant in VARIANTS:
            measured = max(p[f"{mode}/{variant}"] for p in per_rank)
            predicted = _predicted(mode, variant, N)
            assert abs(predicted - measured) <= 0.10 * measured, (mode, variant, predicted,
                                                                   measured)  # fmt: skip
