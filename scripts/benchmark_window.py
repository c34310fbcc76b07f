"""Sliding-window attention against full causal attention, per mode, at P = 4.

On 4 spawned ranks (gloo on CPU, NCCL with a GPU per rank; ``scripts/benchlib.py``) it
times causal attention forward+backward on one row of N tokens, full and with a window of
N/8 tokens to the left, interleaved, medians over repeats, and reads the work counter
(``work_stats``: score entries the kernels computed, summed over the ranks; blocks the
ring skipped). ``x full`` is the time ratio to full causal attention in the same mode,
measured in the same run.

The ring skips chunk pairs that no query's window reaches; the Ulysses mode cuts the whole
sequence into window-sized pieces and skips the pairs out of reach (block-sparse).
``scores`` counts the score entries of the blocks handed to the kernels (masked entries
included: a fused causal kernel skips part of them itself). ``--backend torch`` (default):
torch's fused CPU kernel, windowed blocks with an additive mask; ``math``: plain PyTorch,
which computes every entry it is given.

    python scripts/benchmark_window.py --quick     # < 1 min on 2 cores
    python scripts/benchmark_window.py             # the docs/benchmarks/windows.md table
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
from benchlib import barrier, gather_floats, run_ranks, sync

import ulysses_cp as ucp
from ulysses_cp.kernels.blocks import work as work_stats

HQ, HKV, D = 8, 4, 64
MODES = {
    "ulysses": (4, 1, "zigzag"),
    "ring_zigzag": (1, 4, "zigzag"),
    "ring_contiguous": (1, 4, "contiguous"),
    "hybrid_zigzag": (2, 2, "zigzag"),
}


def worker(rank, world, args, device):
    topos = {m: ucp.init_topology(u, r, layout=lay) for m, (u, r, lay) in MODES.items()}
    rows = []
    for N in args.seqs:
        windows = {"full": (-1, -1), "window N/8": (N // 8, -1)}
        g = torch.Generator().manual_seed(0)
        s_l = N // world
        shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
        inputs = [torch.randn(s, generator=g).to(device) for s in shapes]
        times = {(m, w): [] for m in MODES for w in windows}
        work = {}
        for rep in range(args.warmup + args.repeats):
            for (mode, name), acc in times.items():  # interleaved: same noise for all
                q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs))
                work_stats.reset()
                barrier(device)
                t0 = time.perf_counter()
                out = ucp.attention(
                    q, k, v, topos[mode], backend=args.backend, window=windows[name]
                )
                out.backward(dout)
                sync(device)
                barrier(device)
                if rep >= args.warmup:
                    acc.append(time.perf_counter() - t0)
                snap = work_stats.snapshot()
                work[(mode, name)] = [
                    float(snap.get("scores/forward", 0)),
                    float(snap.get("skipped/forward", 0)),
                ]
        for mode in MODES:
            base = statistics.median(times[(mode, "full")])
            for name in windows:
                scores, skipped = (sum(x) for x in zip(*gather_floats(work[(mode, name)], device)))
                t = statistics.median(times[(mode, name)])
                rows.append(
                    dict(
                        mode=mode,
                        N=N,
                        case=name,
                        time_s=t,
                        ratio_to_full=t / base,
                        scores=int(scores),
                        skipped_blocks=int(skipped),
                    )
                )
    for mode in MODES:  # work relative to full causal attention, same mode
        full = {r["N"]: r["scores"] for r in rows if r["mode"] == mode and r["case"] == "full"}
        for r in rows:
            if r["mode"] == mode:
                r["work_to_full"] = r["scores"] / full[r["N"]]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sweep for CI (< 1 min)")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096])
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
    print(f"backend {args.backend}, P = 4, causal, window = N/8 tokens to the left")
    print(
        f"{'mode':<17}{'N':>6}  {'case':<11}{'ms':>9}{'x full':>8}{'scores':>13}"
        f"{'x full':>8}{'skipped':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<17}{r['N']:>6}  {r['case']:<11}{r['time_s'] * 1e3:>9.1f}"
            f"{r['ratio_to_full']:>8.2f}{r['scores']:>13,}{r['work_to_full']:>8.3f}"
            f"{r['skipped_blocks']:>9}"
        )
    (out / "benchmark_window.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"json: {out / 'benchmark_window.json'}")


if __name__ == "__main__":
    main()
