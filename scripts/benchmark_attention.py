"""Benchmark the sequence-parallel modes side by side with DeepSpeed-Ulysses.

For each world size P (spawned ranks: gloo on CPU, NCCL with a GPU per rank, gloo when ranks
share a GPU; ``scripts/benchlib.py``) and sequence length N it runs causal attention
forward+backward for every implementation, interleaved, after a warm-up, and reports medians
over repeats and the ratio to DeepSpeed's ``DistributedAttention`` wrapped around the same
local kernel, measured in the same run. Per rank: bytes sent (counters) beside the formulas,
peak memory (separate run), and the spread of per-rank kernel time (load balance; CUDA
events on GPUs). Then the longest sequence each mode fits in a per-rank memory budget, for
one attention layer and for the reference model.

FLOPs convention (causal-aware, as flash-attn counts): forward 4*b*N^2*hq*d/2 for causal,
forward+backward 3.5x forward.

    python scripts/benchmark_attention.py --quick        # < 3 min on 2 cores
    python scripts/benchmark_attention.py                # the docs/benchmarks/attention.md table
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
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import barrier, gather_floats, max_over_ranks, parse_args, run_ranks, sync
from profiling import longest_fitting, peak_memory

import ulysses_cp as ucp
import ulysses_cp.modes.ring as ring_mod
from ulysses_cp.kernels.dispatch import KernelCall, local_attention
from ulysses_cp.kernels.spec import AttentionSpec
from ulysses_cp.modes.ulysses import head_chunk_choices
from ulysses_cp.plan.comm import forward_comm_bytes

HQ, HKV, D = 8, 4, 64
ONLY: list[str] = []  # --only


def impls(P: int) -> dict[str, tuple[int, int, str, dict]]:
    """name -> (ulysses, ring, layout, extra)."""
    if P == 1:
        return {"full": (1, 1, "contiguous", {})}
    out = {
        "deepspeed": (P, 1, "contiguous", {"peer": True}),
        "ulysses": (P, 1, "contiguous", {"head_chunks": 1}),
        "ulysses_chunked": (P, 1, "contiguous", {"head_chunks": 2}),
        "ulysses_nocheck": (P, 1, "contiguous", {"check_inputs": False, "head_chunks": 1}),
        "ulysses_zigzag": (P, 1, "zigzag", {"head_chunks": 2}),
        "ring_contiguous": (1, P, "contiguous", {}),
        "ring_zigzag": (1, P, "zigzag", {}),
        "ring_zigzag_no_overlap": (1, P, "zigzag", {"overlap": False}),
        "ring_allgather": (1, P, "zigzag", {"kv_exchange": "allgather"}),
    }
    most = max(head_chunk_choices(HQ, HKV, P))
    if most > 2:
        out[f"ulysses_chunked{most}"] = (P, 1, "contiguous", {"head_chunks": most})
    if P >= 4:
        out["hybrid_zigzag"] = (2, P // 2, "zigzag", {})
        out["hybrid_allgather"] = (2, P // 2, "zigzag", {"kv_exchange": "allgather"})
    if ONLY:  # --only: these rows (and the peer, whose time the ratios divide by)
        out = {n: spec for n, spec in out.items() if n in ONLY or n == "deepspeed"}
    return out


# options of the run (RunOptions fields) that a row may set
OPTIONS = ("check_inputs", "head_chunks", "kv_exchange")


def formula(N: int, u: int, r: int, nbytes: int) -> int:
    """Forward bytes sent per rank (all-to-all + ring), b = 1."""
    return sum(
        forward_comm_bytes(
            batch=1,
            seq_len=N,
            hq=HQ,
            hkv=HKV,
            head_dim=D,
            ulysses_degree=u,
            ring_degree=r,
            bytes_per_element=nbytes,
        )
    )


def attention_fn(topos: dict, name: str, spec, backend: str):
    u, r, layout, extra = spec
    # this variant's choices (the check_inputs variant measures the check's cost)
    choices = dict(layout=layout, backend=backend) | {k: extra[k] for k in OPTIONS if k in extra}
    topo = topos[(u, r)].with_options(**choices)
    if extra.get("peer"):
        from deepspeed.sequence.layer import DistributedAttention

        def local(q, k, v, *args, **kwargs):
            return local_attention(q, k, v, backend=backend)

        peer = DistributedAttention(local, topo.ulysses_group, scatter_idx=2, gather_idx=1)
        return lambda q, k, v: peer(q, k, v, batch_dim_idx=0)
    if "overlap" in extra:
        ring = ring_mod.Ring(topo.ring_group, layout, overlap=extra["overlap"])
        call = KernelCall(AttentionSpec(causal=True), backend)
        return lambda q, k, v: ring_mod.ring_attention(q, k, v, ring=ring, call=call)
    return ucp.Attention(topo)


class KernelClock:
    """Time spent in the local kernels on this rank (load balance), via the ring module's
    and the local wrapper's primitives. CPU: host time around each call. CUDA: the calls
    only queue kernels, so CUDA events on the current stream around each call; read
    ``seconds`` after the work is synchronised."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._orig = {}

    @property
    def seconds(self) -> float:
        if not self._cuda:
            return self._host
        total_ms = 0.0
        for start, end in self._events:
            end.synchronize()
            total_ms += start.elapsed_time(end)
        return total_ms / 1e3

    def _timed(self, f):
        if self._cuda:

            def timed_cuda(*a, **kw):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                try:
                    return f(*a, **kw)
                finally:
                    end.record()
                    self._events.append((start, end))

            return timed_cuda

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                self._host += time.perf_counter() - t

        return timed

    def __enter__(self):
        import ulysses_cp.kernels.dispatch as kernels

        for mod, names in (
            (ring_mod, ("attn_forward", "attn_backward")),
            (kernels, ("attn_forward", "attn_backward")),
        ):
            for n in names:
                f = getattr(mod, n)
                self._orig[(mod, n)] = f
                setattr(mod, n, self._timed(f))
        return self

    def __exit__(self, *exc):
        for (mod, n), f in self._orig.items():
            setattr(mod, n, f)


def run_once(fn, inputs):
    q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs))
    fn(q, k, v).backward(dout)


def make_inputs(N: int, topo, layout: str, dtype, device):
    g = torch.Generator().manual_seed(0)
    s_l = N // topo.sp_world_size
    shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def bench_lengths(args, topos, P, device, dtype) -> list[dict]:
    rows = []
    names = impls(P)
    fns = {n: attention_fn(topos, n, spec, args.backend) for n, spec in names.items()}
    for N in args.seqs:
        inputs = {
            n: make_inputs(N, topos[(s[0], s[1])], s[2], dtype, device) for n, s in names.items()
        }
        times = {n: [] for n in names}
        kernel = {n: [] for n in names}
        for rep in range(args.warmup + args.repeats):
            for n in names:  # interleaved: every implementation sees the same machine state
                barrier(device)
                with KernelClock(device) as clock:
                    t = time.perf_counter()
                    run_once(fns[n], inputs[n])
                    sync(device)
                    dt = time.perf_counter() - t
                if rep >= args.warmup:
                    times[n].append(dt)
                    kernel[n].append(clock.seconds)
        for n, (u, r, layout, _) in names.items():
            ucp.comm_stats.reset()
            q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs[n]))
            peak = peak_memory(
                lambda fn=fns[n], q=q, k=k, v=v, d=dout: fn(q, k, v).backward(d), device
            )
            sent = ucp.comm_stats.total(phase="forward")
            own = sum(t.numel() * t.element_size() for t in inputs[n])
            ranks = gather_floats(
                [statistics.median(times[n]), statistics.median(kernel[n]), peak + own, sent],
                device,
            )
            time_s, kernel_s, peak_b, sent_b = (list(col) for col in zip(*ranks))
            flops = 4 * N * N * HQ * D / 2 * 3.5
            t_med = max(time_s)
            rows.append(
                {
                    "P": P,
                    "N": N,
                    "impl": n,
                    "ulysses": u,
                    "ring": r,
                    "layout": layout,
                    "time_s": t_med,
                    "tflops": flops / t_med / 1e12,
                    "kernel_s_per_rank": kernel_s,
                    "balance_max_over_min": (
                        max(kernel_s) / min(kernel_s) if min(kernel_s) > 0 else float("inf")
                    ),
                    "peak_mem_mb_per_rank": [b / 2**20 for b in peak_b],
                    "bytes_fwd_per_rank": sent_b,
                    "bytes_formula": formula(N, u, r, inputs[n][0].element_size()),
                }
            )
    peer = {row["N"]: row["time_s"] for row in rows if row["impl"] in ("deepspeed", "full")}
    for row in rows:
        row["ratio_to_peer"] = row["time_s"] / peer[row["N"]]
    return rows


def max_length(args, topos, P, device, dtype, what: str) -> dict:
    """Longest N (a multiple of 2P*64) whose per-rank peak fits ``args.budget_mb``."""
    from ulysses_cp.config import ModelConfig
    from ulysses_cp.models.decoder import Decoder
    from ulysses_cp.run_blocks import DataConfig
    from ulysses_cp.training.data import KVRecall, global_batch

    budget = args.budget_mb * 2**20
    out = {}
    for name, (u, r, layout, extra) in impls(P).items():
        if {"peer", "overlap", "check_inputs"} & set(extra):
            continue  # the peer and the variants that only measure a cost: skip
        options = {k: extra[k] for k in OPTIONS if k in extra}
        topo = topos[(u, r)].with_options(layout=layout, backend=args.backend, **options)
        if what == "model" and u > 1:
            heads = ModelConfig().n_heads, ModelConfig().n_kv_heads
            if options.get("head_chunks", 0) not in [0, *head_chunk_choices(*heads, u, r > 1)]:
                out[name] = None  # the model's heads do not take this chunk count
                continue

        def peak_at(N, topo=topo, spec=(u, r, layout, extra), name=name):
            layout = spec[2]
            if what == "attention":
                fn = attention_fn(topos, name, spec, args.backend)
                ins = make_inputs(N, topo, layout, dtype, device)
                own = sum(t.numel() * t.element_size() for t in ins)
                q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(ins))
                p = peak_memory(lambda: fn(q, k, v).backward(dout), device) + own
            else:
                torch.manual_seed(0)
                model = Decoder(
                    ModelConfig(),
                    ucp.Attention(topo),
                ).to(device)
                data = KVRecall(DataConfig(seq_len=N))
                full = global_batch(
                    data, step=0, micro_step=0, grad_accum=1, micro_batch=1, dp_rank=0, dp_degree=1
                )
                local = {k_: t.to(device) for k_, t in ucp.shard_batch(full, topo, layout).items()}

                def step():
                    logits = model(local["input_ids"], local["position_ids"], local["batch"])
                    ucp.sequence_parallel_cross_entropy(
                        logits, local["shift_labels"], topo
                    ).backward()

                p = peak_memory(step, device)
            return max_over_ranks(p, device)

        out[name] = longest_fitting(peak_at, 2 * P * 64, budget)
    return out


def worker(rank, world, args, device):
    import deepspeed

    global HQ, HKV, ONLY
    HQ, HKV = args.heads
    ONLY = args.only

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    topos = {
        (u, r): ucp.init_topology(u, r)
        for u, r, _, _ in {(s[0], s[1], 0, 0) for s in impls(world).values()}
    }
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    res = {"rows": bench_lengths(args, topos, world, device, dtype)}
    if not args.skip_max_len:
        res["max_len_attention"] = max_length(args, topos, world, device, dtype, "attention")
        res["max_len_model"] = max_length(args, topos, world, device, dtype, "model")
    return res


def print_table(rows):
    head = (
        f"{'P':>2} {'N':>6} {'impl':24} {'time ms':>9} {'x peer':>7} {'balance':>8} "
        f"{'MB/rank':>8} {'bytes/rank':>11} {'formula':>11}"
    )
    print(head)
    for r in rows:
        sent = int(max(r["bytes_fwd_per_rank"]))
        shown = "n/a" if r["impl"] == "deepspeed" else str(sent)
        print(
            f"{r['P']:>2} {r['N']:>6} {r['impl']:24} {r['time_s'] * 1e3:9.1f} "
            f"{r['ratio_to_peer']:7.2f} {r['balance_max_over_min']:8.2f} "
            f"{max(r['peak_mem_mb_per_rank']):8.1f} {shown:>11} {r['bytes_formula']:>11}"
        )


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["P"], r["impl"]) for r in rows}):
        sel = [r for r in rows if (r["P"], r["impl"]) == key]
        label = f"P={key[0]} {key[1]}"
        axes[0].plot([r["N"] for r in sel], [r["time_s"] * 1e3 for r in sel], "o-", label=label)
        axes[1].plot(
            [r["N"] for r in sel], [max(r["peak_mem_mb_per_rank"]) for r in sel], "o-", label=label
        )
    for ax, title in zip(axes, ("fwd+bwd time (ms, median)", "peak memory per rank (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(title)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    global HQ, HKV, ONLY
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sweep for CI (< 3 min)")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget-mb", type=float, default=32.0, help="per-rank memory budget")
    p.add_argument("--backend", default="torch", choices=list(ucp.BACKENDS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-max-len", action="store_true")
    p.add_argument(
        "--heads",
        type=int,
        nargs=2,
        default=[HQ, HKV],
        metavar=("HQ", "HKV"),
        help="query and kv heads (head dim 64)",
    )
    p.add_argument("--only", nargs="+", default=[], help="run only these rows (P > 1)")
    p.add_argument("--out", default="bench_results", help="folder for JSON and PNG")
    args = parse_args(p, seqs=[512, 1024], repeats=3, budget_mb=8.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    HQ, HKV = args.heads
    ONLY = args.only
    results = {"args": vars(args), "worlds": {}}
    for world in args.worlds:
        print(f"--- P = {world}", flush=True)
        results["worlds"][world] = run_ranks(worker, world, args)
    rows = [r for w in results["worlds"].values() for r in w["rows"]]
    print_table(rows)
    for kind in ("max_len_attention", "max_len_model"):
        print(
            f"{kind} (budget {args.budget_mb} MB/rank): "
            + ", ".join(f"P={w}: {res.get(kind)}" for w, res in results["worlds"].items())
        )
    (out / "benchmark_attention.json").write_text(json.dumps(results, indent=1))
    print(f"json: {out / 'benchmark_attention.json'}")
    plot(rows, out / "benchmark_attention.png")


if __name__ == "__main__":
    main()
