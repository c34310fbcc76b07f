"""Cost of packed rows (``cu_seqlens``) against the unpacked path, per mode.

On 4 spawned ranks (gloo on CPU, NCCL with a GPU per rank, gloo when ranks share a GPU;
``scripts/benchlib.py``) it times causal attention forward+backward on one row of N tokens:
unpacked, and packed as 1, 8 and 64 equal documents, interleaved, medians over repeats.
``x unpacked`` is the time ratio to the unpacked row measured in the same run; ``work`` is
the fraction of the causal score matrix a packing leaves to compute (sum L_d^2 / N^2), the
speed-up an ideal varlen kernel would show.

    python scripts/benchmark_packing.py --quick     # < 1 min on 2 cores
    python scripts/benchmark_packing.py             # the docs/benchmarks.md table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import barrier, run_ranks, sync

import ulysses_cp as ucp

HQ, HKV, D = 8, 4, 64
MODES = {"ulysses": (4, 1), "ring_zigzag": (1, 4), "hybrid_zigzag": (2, 2)}


def cases(N: int) -> dict[str, torch.Tensor | None]:
    out = {"unpacked": None}
    for n_docs in (1, 8, 64):
        out[f"packed_{n_docs}"] = torch.arange(0, N + 1, N // n_docs, dtype=torch.int32)
    return out


def work_fraction(cu: torch.Tensor | None, N: int) -> float:
    if cu is None:
        return 1.0
    lens = (cu[1:] - cu[:-1]).double()
    return float((lens * (lens + 1)).sum() / (N * (N + 1)))


def worker(rank, world, args, device):
    topos = {m: ucp.init_topology(u, r) for m, (u, r) in MODES.items()}
    rows = []
    for N in args.seqs:
        g = torch.Generator().manual_seed(0)
        s_l = N // world
        shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
        inputs = [torch.randn(s, generator=g).to(device) for s in shapes]
        times = {(m, c): [] for m in MODES for c in cases(N)}
        for rep in range(args.warmup + args.repeats):
            for (mode, case), acc in times.items():  # interleaved: same noise for all
                cu = cases(N)[case]
                q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs))
                barrier(device)
                t0 = time.perf_counter()
                ucp.attention(q, k, v, topos[mode], backend=args.backend, cu_seqlens=cu).backward(
                    dout
                )
                sync(device)
                barrier(device)
                if rep >= args.warmup:
                    acc.append(time.perf_counter() - t0)
        for mode in MODES:
            base = statistics.median(times[(mode, "unpacked")])
            for case, cu in cases(N).items():
                t = statistics.median(times[(mode, case)])
                rows.append(
                    {
                        "mode": mode,
                        "N": N,
                        "case": case,
                        "time_s": t,
                        "ratio_to_unpacked": t / base,
                        "work_fraction": work_fraction(cu, N),
                    }
                )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sweep for CI (< 1 min)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", default="torch", choices=list(ucp.BACKENDS))
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = p.parse_args()
    if args.quick:
        args.seqs, args.repeats = [1024], 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_ranks(worker, 4, args)
    print(f"{'mode':<15}{'N':>7}  {'case':<11}{'ms':>9}{'x unpacked':>12}{'work':>7}")
    for r in rows:
        print(
            f"{r['mode']:<15}{r['N']:>7}  {r['case']:<11}{r['time_s'] * 1e3:>9.1f}"
            f"{r['ratio_to_unpacked']:>12.2f}{r['work_fraction']:>7.3f}"
        )
    (out / "benchmark_packing.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"json: {out / 'benchmark_packing.json'}")


if __name__ == "__main__":
    main()
