"""Step time of the reference decoder with compiled layers (``"model": {"compile": true}``)
against eager, per mode, at P = 4.

On 4 spawned ranks (gloo on CPU, NCCL with a GPU per rank; ``scripts/benchlib.py``) it
builds the decoder twice with the same weights, once eager and once with every layer under
``torch.compile`` (inductor), and times one training step without the optimizer (forward,
sequence-parallel loss, backward) on one row of N tokens, the two models interleaved,
medians over repeats. ``first step`` is the compiled model's first step (the compile
itself: dynamo, AOT autograd and inductor, forward and backward), measured once. ``x
eager`` is the compiled median over the eager median, from the same run. It also reads the
all-to-all and ring byte counters of one step of each model (they must agree).

    python scripts/benchmark_compile.py --quick     # a few minutes on 2 cores
    python scripts/benchmark_compile.py             # the docs/benchmarks/compile.md table
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
from ulysses_cp.config import ModelConfig
from ulysses_cp.models.compiled import compile_layers
from ulysses_cp.models.decoder import Decoder

MODES = {"ulysses": (4, 1), "ring": (1, 4), "hybrid": (2, 2)}


def _step(model, topo, ids, device) -> float:
    local = ucp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    barrier(device)
    t0 = time.perf_counter()
    logits = model(local["input_ids"], local["position_ids"], batch=local["batch"])
    ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo).backward()
    sync(device)
    barrier(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def worker(rank, world, args, device):
    cfg = ModelConfig(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=2 * args.dim,
    )
    rows = []
    for mode, (u, r) in MODES.items():
        topo = ucp.init_topology(u, r, layout="zigzag", backend=args.backend)
        torch._dynamo.reset()
        models = {}
        for name in ("eager", "compiled"):
            torch.manual_seed(0)
            models[name] = Decoder(cfg, ucp.Attention(topo)).to(device)
        compile_layers(models["compiled"])
        ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        comm = {}
        for name, model in models.items():  # the first step: the compile, and the bytes
            ucp.comm_stats.reset()
            first = _step(model, topo, ids, device)
            comm[name] = ucp.comm_stats.total("all_to_all") + ucp.comm_stats.total("ring")
            if name == "compiled":
                first_compiled = first
        times: dict[str, list[float]] = {name: [] for name in models}
        for rep in range(args.warmup + args.repeats):
            for name, model in models.items():  # interleaved: the same noise for both
                t = _step(model, topo, ids, device)
                if rep >= args.warmup:
                    times[name].append(t)
        eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
        rows.append(
            dict(
                mode=mode,
                u=u,
                r=r,
                N=args.seq,
                eager_s=eager,
                compiled_s=compiled,
                ratio=compiled / eager,
                first_compiled_step_s=first_compiled,
                comm_bytes_eager=comm["eager"],
                comm_bytes_compiled=comm["compiled"],
            )
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model and sequence")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", default="torch", choices=list(ucp.BACKENDS))
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = p.parse_args()
    if args.quick:
        args.seq, args.dim, args.layers, args.repeats = 256, 64, 2, 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_ranks(worker, 4, args)
    print(
        f"reference decoder dim {args.dim}, {args.layers} layers, 8/4 heads, N = {args.seq}, "
        f"P = 4, backend {args.backend}, float32; step = forward + loss + backward"
    )
    print(
        f"{'mode':<9}{'u x r':>6}{'eager ms':>10}{'compiled ms':>13}{'x eager':>9}"
        f"{'first compiled step s':>23}{'comm bytes eager / compiled':>30}"
    )
    for r in rows:
        print(
            f"{r['mode']:<9}{r['u']:>4}x{r['r']}{r['eager_s'] * 1e3:>10.1f}"
            f"{r['compiled_s'] * 1e3:>13.1f}{r['ratio']:>9.2f}"
            f"{r['first_compiled_step_s']:>23.1f}"
            f"{r['comm_bytes_eager']:>15,} / {r['comm_bytes_compiled']:,}"
        )
    (out / "benchmark_compile.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"json: {out / 'benchmark_compile.json'}")


if __name__ == "__main__":
    main()
