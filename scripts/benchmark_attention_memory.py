"""Per-rank memory of one attention layer at P = 4 against one rank, side by side in one
run: peak, bytes sent, step time and the longest N under a budget.

One causal attention layer, forward+backward (b=1, hq=8, hkv=4, d=64, float32, torch
backend), every rank building its local q, k, v, dout; peak = those inputs plus the
peak of what forward+backward allocates on top (CPU: ``torch.profiler`` allocation
events, ``scripts/profiling.py`` with ``scratch=True``, the method of
``benchmark_attention.py``; CUDA: ``max_memory_allocated``), slowest rank. Rows:

- ``before``: one head chunk (``head_chunks: 1``; what ``0`` resolved to before issue 27);
- ``default``: the default options (``head_chunks: 0`` now resolves by its byte rule);
- ``redo``: the defaults plus ``redo_all_to_all: true``;
- ``ideal``: one rank's peak / 4.

in Ulysses 4 and hybrid 2x2 (zigzag: the default layout). Bytes: what each rank sent in
one step (forward + backward, ``ucp.comm_stats``); ``time_ratio``: the step time over the
``before`` row's in the same mode (medians of ``--repeats``). Longest N: multiples of 2P*64 whose
peak fits ``--budget-mb`` (doubling, then bisection).

    python scripts/benchmark_attention_memory.py            # docs/benchmarks/layer_memory.md
    python scripts/benchmark_attention_memory.py --quick    # N 2048, 8 MB budget
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import barrier, max_over_ranks, run_ranks, sync
from profiling import longest_fitting, peak_memory

import ulysses_cp as ucp

HQ, HKV, D = 8, 4, 64
VARIANTS = {
    "before": {"head_chunks": 1},
    "default": {},
    "redo": {"redo_all_to_all": True},
}


def make_step(topo, N: int, device):
    """One forward+backward of the layer at N tokens; returns (step, bytes of the inputs)."""
    g = torch.Generator().manual_seed(0)
    s_l = N // topo.sp_world_size
    shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
    ins = [torch.randn(s, generator=g).to(device) for s in shapes]
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(ins))
    attn = ucp.Attention(topo)

    def step():
        attn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    return step, sum(t.numel() * t.element_size() for t in ins)


def measure(topo, args, device) -> dict:
    step, own = make_step(topo, args.seq, device)
    step()  # warm-up (and the first call's checks)
    ucp.comm_stats.reset()
    step()
    sent = ucp.comm_stats.snapshot()
    times = []
    for _ in range(args.repeats):
        barrier(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(max_over_ranks(time.perf_counter() - t0, device))
    peak = max_over_ranks(peak_memory(step, device) + own, device)

    def peak_at(n):
        s, o = make_step(topo, n, device)
        return max_over_ranks(peak_memory(s, device) + o, device)

    unit = 2 * topo.sp_world_size * 64
    longest = longest_fitting(peak_at, unit, args.budget_mb * 2**20) if args.budget_mb else None
    return {
        "peak_mb": peak / 2**20,
        "time_s": statistics.median(times),
        "sent_bytes": sum(sent.values()) - sent.get("all_gather/input check", 0),
        "sent_parts": sent,
        "max_len": longest,
    }


def worker(rank, world, args, device):
    rows = []
    if world == 1:
        topo = ucp.init_topology(1, 1, backend="torch")
        return [{"mode": "one rank", "variant": "-", **measure(topo, args, device)}]
    for mode, (u, r) in (("ulysses 4", (4, 1)), ("hybrid 2x2", (2, 2))):
        base = ucp.init_topology(u, r, backend="torch")
        for name, options in VARIANTS.items():
            topo = base.with_options(**options)
            row = {"mode": mode, "variant": name, **measure(topo, args, device)}
            rows.append(row)
            if rank == 0:
                print(f"{mode:<11} {name:<8} {row['peak_mb']:7.1f} MB  max_len {row['max_len']}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N 2048, 8 MB budget, 1 repeat")
    p.add_argument("--seq", type=int, default=8192, help="tokens in the layer (all ranks)")
    p.add_argument("--budget-mb", type=float, default=32.0, help="0: no max-length search")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = p.parse_args()
    if args.quick:
        args.seq, args.budget_mb, args.repeats = 2048, 8.0, 1
    rows = run_ranks(worker, 1, args) + run_ranks(worker, 4, args)
    one = rows[0]
    keep = {r["mode"]: r for r in rows if r["variant"] == "default"}
    first = {r["mode"]: r for r in rows if r["variant"] == "before"}
    print(f"\nN = {args.seq}, per-rank budget {args.budget_mb} MB (longest N)")
    print(
        f"{'mode':<11} {'variant':<8} {'peak MB':>8} {'x 1 rank':>9} {'sent MB':>8} "
        f"{'x default':>9} {'time s':>7} {'x before':>8} {'max N':>7} {'x 1 rank':>8}"
    )
    for r in rows:
        r["peak_ratio"] = r["peak_mb"] / one["peak_mb"]
        ref = keep.get(r["mode"])
        r["sent_ratio"] = r["sent_bytes"] / ref["sent_bytes"] if ref else None
        # step time against one head chunk in the same mode, measured in the same run
        r["time_ratio"] = r["time_s"] / first[r["mode"]]["time_s"] if r["mode"] in first else None
        r["max_len_ratio"] = r["max_len"] / one["max_len"] if one["max_len"] else None
        sent = f"{r['sent_ratio']:.2f}" if r["sent_ratio"] else "-"
        longest = f"{r['max_len_ratio']:.2f}" if r["max_len_ratio"] else "-"
        print(
            f"{r['mode']:<11} {r['variant']:<8} {r['peak_mb']:8.1f} {r['peak_ratio']:9.3f} "
            f"{r['sent_bytes'] / 2**20:8.2f} {sent:>9} {r['time_s']:7.2f} "
            f"{r['time_ratio'] or 0:8.2f} "
            f"{r['max_len'] or 0:>7} {longest:>8}"
        )
    print(f"ideal: {one['peak_mb'] / 4:.1f} MB (0.250)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "benchmark_attention_memory.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"json: {path}")


if __name__ == "__main__":
    main()
