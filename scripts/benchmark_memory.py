"""Longest trainable sequence under a per-rank memory cap, with and without the ALST memory
features, for the reference decoder and a tiny Hugging Face Llama, on 1 and 4 ranks.

For each (ranks, model, features) it searches the longest sequence (multiples of 2P*64)
whose training step (forward, SP loss, backward; no optimizer) keeps each rank's peak
allocation within ``--budget-mb`` (CPU: the live bytes of every tensor the step creates,
``scripts/profiling.py`` with ``scratch=False``; CUDA: ``max_memory_allocated``), then
times steps at a common length (tokens/s, median of repeats, interleaved). 4 ranks run
hybrid Ulysses 2 x ring 2, zigzag. Features: ``none``; ``tiled`` (MLP in 4 pieces, LM
head + loss in 4 pieces); ``tiled+ckpt`` (plus activation checkpointing);
``tiled+ckpt+offload`` (checkpointed layer inputs on CPU: on a CPU machine they stay in
the same memory, so expect no gain here).

    python scripts/benchmark_memory.py --quick    # ~1 min on 2 cores (a 4 MB budget)
    python scripts/benchmark_memory.py            # the docs/benchmarks/memory.md table
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
from benchlib import barrier, max_over_ranks, parse_args, run_ranks, sync
from profiling import longest_fitting, peak_memory

import ulysses_cp as ucp
from ulysses_cp.config import HFModelConfig, ModelConfig
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.models.memory import LossPlan, lm_loss
from ulysses_cp.run_blocks import DataConfig
from ulysses_cp.training.data import KVRecall, global_batch

ROOT = Path(__file__).resolve().parent.parent

FEATURES = {
    "none": dict(
        tiled_mlp=0, tiled_loss=0, activation_checkpointing=False, offload_activations=False
    ),
    "tiled": dict(
        tiled_mlp=4, tiled_loss=4, activation_checkpointing=False, offload_activations=False
    ),
    "tiled+ckpt": dict(
        tiled_mlp=4, tiled_loss=4, activation_checkpointing=True, offload_activations=False
    ),
    "tiled+ckpt+offload": dict(
        tiled_mlp=4, tiled_loss=4, activation_checkpointing=True, offload_activations=True
    ),
}


def build(kind: str, features: dict, topo, device):
    torch.manual_seed(0)
    if kind == "hf":
        from ulysses_cp.models import hf

        hf_config = str(ROOT / "configs" / "hf" / "tiny_llama.json")
        model = hf.build_model(topo, HFModelConfig(hf_config=hf_config, **features))
    else:
        model = Decoder(
            ModelConfig(**features),
            ucp.Attention(topo),
        )
    return model.to(device).train()


def step_fn(model, features: dict, topo, N: int, device):
    full = global_batch(
        KVRecall(DataConfig(seq_len=N)),
        step=0,
        micro_step=0,
        grad_accum=1,
        micro_batch=1,
        dp_rank=0,
        dp_degree=1,
    )
    local = {k: t.to(device) for k, t in ucp.shard_batch(full, topo).items()}

    def step():
        # the models' own loss path (what train.py runs): tiled when tiled_loss > 1
        loss = lm_loss(
            model,
            model.head,
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            topo,
            batch=local["batch"],
            plan=LossPlan(features["tiled_loss"]),
        )
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def worker(rank, world, args, device):
    degrees = (2, 2) if world == 4 else (1, 1)
    topo = ucp.init_topology(*degrees, backend="torch")
    unit, budget = 2 * world * 64, args.budget_mb * 2**20
    rows = []
    for kind in args.models:
        for name, features in FEATURES.items():
            model = build(kind, features, topo, device)

            def peak_at(N, model=model, features=features):
                step = step_fn(model, features, topo, N, device)
                return max_over_ranks(peak_memory(step, device, scratch=False), device)

            n_max = longest_fitting(peak_at, unit, budget)
            rows.append({"ranks": world, "model": kind, "features": name, "max_len": n_max})
            if rank == 0:
                print(f"P={world} {kind:<9} {name:<20} max_len {n_max}", flush=True)
        # tokens/s of every feature set at one length, interleaved
        N = args.time_len * world
        steps = {
            name: step_fn(build(kind, f, topo, device), f, topo, N, device)
            for name, f in FEATURES.items()
        }
        times = {name: [] for name in FEATURES}
        for rep in range(args.repeats + 1):
            for name, step in steps.items():
                barrier(device)
                t0 = time.perf_counter()
                step()
                sync(device)  # CUDA: the step only queued its kernels
                dt = max_over_ranks(time.perf_counter() - t0, device)
                if rep:
                    times[name].append(dt)
        for row in rows:
            if row["model"] == kind:
                row["time_len"] = N
                row["tokens_per_s"] = N / statistics.median(times[row["features"]])
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4 MB budget, one repeat (~1 min)")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 4], choices=[1, 4])
    p.add_argument("--models", nargs="+", default=["reference", "hf"], choices=["reference", "hf"])
    p.add_argument("--budget-mb", type=float, default=48.0, help="per-rank memory cap")
    p.add_argument("--time-len", type=int, default=2048, help="tokens per rank for tokens/s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = parse_args(p, budget_mb=4.0, time_len=256, repeats=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in args.worlds:
        rows += run_ranks(worker, world, args)
    print(f"\nper-rank budget {args.budget_mb} MB")
    print(f"{'ranks':>5}  {'model':<10}{'features':<21}{'max len':>9}{'x none':>8}{'tok/s':>9}")
    for r in rows:
        base = next(
            x["max_len"]
            for x in rows
            if (x["ranks"], x["model"], x["features"]) == (r["ranks"], r["model"], "none")
        )
        r["ratio_to_none"] = r["max_len"] / base if base else None
        ratio = f"{r['ratio_to_none']:.2f}" if base else "-"
        print(
            f"{r['ranks']:>5}  {r['model']:<10}{r['features']:<21}{r['max_len']:>9}"
            f"{ratio:>8}{r['tokens_per_s']:>9.0f}"
        )
    (out / "benchmark_memory.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"json: {out / 'benchmark_memory.json'}")


if __name__ == "__main__":
    main()
