"""The planner's attention memory (``plan.memory.attention_activation``) against what one
attention layer holds: the kept head-sharded copies or none (``redo_all_to_all``), by
their formulas (unit tests), and the peak of one forward+backward of
``scripts/benchmark_attention_memory.py``'s layer at N = 2048 on 4 ranks, in live tensor
bytes (``scripts/profiling.py``'s ``LiveBytes``, what the planner counts): a distributed
test. The profiler's peaks (kernel scratch, communication buffers) vary by run and are
compared in ``scripts/plan_vs_measured.py --attention`` (docs/benchmarks/planner.md)."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from tests.support.helpers import ROOT, topology
from ulysses_cp.plan.memory import activation_bytes, attention_activation, attention_layer_peak

sys.path.insert(0, str(ROOT / "scripts"))
import plan_vs_measured as pvm
from benchmark_attention_memory import HKV, HQ, D, make_step
from profiling import peak_memory

LAYER = pvm.attention_shape()  # the benchmark's layer, float32
MODES = pvm.ATTENTION_MODES
# variant: (head chunks, redo); "default" resolves to 2 chunks at N = 8192 in both modes
VARIANTS = {"before": (1, False), "default": (2, False), "redo": (2, True)}


def _predicted(mode: str, variant: str, N: int) -> int:
    (u, r), (c, redo) = MODES[mode], VARIANTS[variant]
    return attention_layer_peak(
        LAYER, seq_len=N, batch=1, ulysses=u, ring=r, head_chunks=c, redo=redo
    )


def test_kept_copies_are_saved_and_redo_saves_none():
    kw = dict(s_local=2048, batch=1, ulysses=4, ring=1, head_chunks=2)
    kept, redo = (attention_activation(LAYER, **kw, redo=flag) for flag in (False, True))
    q, k = 2048 * HQ * D * 4, 2048 * HKV * D * 4  # the rank's q (and output), k (and v)
    assert kept["kept"] == 2 * q + 2 * k  # as many bytes as the caller's q, k, v, out
    # in a model the caller's q, k, v go (the copies replace them), the output stays
    assert kept["saved"] == q and redo["saved"] == redo["kept"] == 0
    # redo: all layers' saved bytes go, one layer's working set does not
    deep = [
        activation_bytes(LAYER, seq_len=8192, batch=1, ulysses=4, ring=1, head_chunks=2, redo=flag)[
            "layers"
        ]
        for flag in (False, True)
    ]
    assert deep[0] - deep[1] == kept["saved"]
    # ring only: no all-to-all, nothing kept; redo changes nothing
    ring = [
        attention_activation(LAYER, s_local=2048, batch=1, ulysses=1, ring=4, redo=flag)
        for flag in (False, True)
    ]
    assert ring[0] == ring[1] and ring[0]["saved"] == ring[0]["kept"] == 0


def test_replicated_kv_is_kept_at_its_replicated_width():
    mqa = replace(LAYER, hkv=2)  # 2 kv heads over 4 ranks: each replicated twice
    got = attention_activation(mqa, s_local=1024, batch=1, ulysses=4, ring=1, head_chunks=2)
    q, k, k_rep = (1024 * h * D * 4 for h in (HQ, 2, 4))
    assert got["kept"] == 2 * q + 2 * k_rep and got["saved"] == q + 2 * (k_rep - k)


def _live_peak(rank: int, topo, N: int) -> int:
    """The benchmark's layer at N tokens: live tensor bytes of one forward+backward, plus
    its inputs."""
    step, own = make_step(topo, N, torch.device("cpu"))
    return peak_memory(step, scratch=False) + own


def _live_peaks(rank: int, N: int) -> dict:
    """:func:`_live_peak` for every mode and variant."""
    return {
        f"{mode}/{variant}": _live_peak(
            rank, topology(u, r, "zigzag", head_chunks=c, redo_all_to_all=redo), N
        )
        for mode, (u, r) in MODES.items()
        for variant, (c, redo) in VARIANTS.items()
    }
