"""One hybrid token-mixer layer under sequence parallelism: per-rank peak memory and step
time against one rank, and the bytes each rank sends against the formula.

For each mixer (LFM2 short convolution, Qwen3-Next gated delta net, Bamba Mamba2, Jamba
Mamba1) one
layer (the family's module, its sequence-parallel forward) runs forward + backward on
``--seq`` tokens: on 1 rank, and on 4 ranks (hybrid Ulysses 2 x ring 2, zigzag; the mixers
split their heads over all 4). Per-rank peak: the live bytes of every tensor the step
creates (``scripts/profiling.py``, ``scratch=False``; CUDA: ``max_memory_allocated``);
the step time (median of ``--repeats``) goes to the JSON only: 4 ranks on a 2-core machine
do not measure speed. Prints a table and writes JSON (``--json``, default
``bench_results/benchmark_mixers.json``).

    python scripts/benchmark_mixers.py --quick     # ~1 min on 2 cores
    python scripts/benchmark_mixers.py             # the docs/benchmarks/mixers.md table
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import barrier, max_over_ranks, run_ranks, sync
from profiling import peak_memory

import ulysses_cp as ucp
from ulysses_cp.core.comm import stats
from ulysses_cp.models.hf_mixers import install_mixers, mixer_channels, mixer_reduced

HIDDEN = 256
MIXERS = {
    "short conv (LFM2)": (
        "Lfm2Config",
        dict(layer_types=["conv"]),
        "conv",
    ),
    "gated delta net (Qwen3-Next)": (
        "Qwen3NextConfig",
        dict(
            layer_types=["linear_attention"],
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            mlp_only_layers=[0],
        ),
        "linear_attn",
    ),
    "Mamba2 (Bamba)": (
        "BambaConfig",
        dict(
            attn_layer_indices=[],
            mamba_n_heads=16,
            mamba_d_head=32,
            mamba_n_groups=4,
            mamba_d_state=32,
            mamba_chunk_size=64,
        ),
        "mamba",
    ),
    "Mamba1 (Jamba)": (
        "JambaConfig",
        dict(
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=1,
            mamba_d_state=16,
            mamba_dt_rank=16,
            mamba_expand=2,
        ),
        "mamba",
    ),
}


def mixer(name: str, topo):
    """The family's mixer module of layer 0, with its sequence-parallel forward."""
    import transformers

    cls, extra, attr = MIXERS[name]
    cfg = getattr(transformers, cls)(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    module = getattr(model.model.layers[0], attr)
    install_mixers(module, topo)
    return module


def body(rank: int, world: int, args, device):
    u, r = (1, 1) if world == 1 else (2, 2)
    topo = ucp.init_topology(u, r)
    out = {}
    for name in args.mixers:
        module = mixer(name, topo).to(device)
        g = torch.Generator().manual_seed(1)
        full = torch.randn(1, args.seq, HIDDEN, generator=g)
        x = ucp.shard_sequence(full, topo, dim=1).to(device).requires_grad_()

        def step(module=module, x=x):
            y = module(hidden_states=x)
            y.backward(torch.ones_like(y))

        step()  # warm-up
        peak = peak_memory(step, device, scratch=False)
        times = []
        for _ in range(args.repeats):
            barrier(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
        stats.reset()
        step()
        sent = stats.total("all_to_all") + stats.total("mixer_all_reduce")
        to, back = mixer_channels(module, topo.sp_world_size)
        P, s_l = topo.sp_world_size, x.shape[1]
        formula = 2 * s_l * (to + back) * (P - 1) // P * x.element_size()  # fwd + bwd, b = 1
        # Mamba1: the whole sequence's x_proj sums, all-reduced in float32 at least
        wide = max(x.element_size(), 4)
        formula += 2 * (2 * (P - 1) * s_l * P * mixer_reduced(module) // P) * wide
        out[name] = dict(
            peak_bytes=max_over_ranks(float(peak), device),
            step_s=statistics.median(times),
            bytes_sent=max_over_ranks(float(sent), device),
            bytes_formula=formula,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2048 tokens, 2 repeats")
    ap.add_argument(
        "--mixers",
        nargs="+",
        choices=list(MIXERS),
        default=list(MIXERS),
        help="the rows to run (default: all; Mamba1's torch scan is a loop over the tokens, "
        "slow under the memory profiler)",
    )
    ap.add_argument("--json", type=Path, default=Path("bench_results/benchmark_mixers.json"))
    args = ap.parse_args()
    if args.quick:
        args.seq, args.repeats = 2048, 2
    one = run_ranks(body, 1, args)
    four = run_ranks(body, 4, args)
    rows = []
    print(f"one mixer layer, hidden {HIDDEN}, {args.seq} tokens, fwd+bwd (CPU, float32)")
    print(
        f"{'mixer':30s} {'peak 1 rank MB':>15s} {'peak/rank P=4 MB':>17s} {'ratio':>6s} "
        f"{'MB sent/rank':>12s} {'formula MB':>10s}"
    )
    for name in args.mixers:
        a, b = one[name], four[name]
        ratio = b["peak_bytes"] / a["peak_bytes"]
        rows.append(dict(mixer=name, seq=args.seq, one=a, four=b, peak_ratio=ratio))
        print(
            f"{name:30s} {a['peak_bytes'] / 2**20:15.1f} {b['peak_bytes'] / 2**20:17.1f} "
            f"{ratio:6.2f} {b['bytes_sent'] / 2**20:12.2f} "
            f"{b['bytes_formula'] / 2**20:10.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
