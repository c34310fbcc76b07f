"""Peak host memory per rank while a Hugging Face model loads under ZeRO-3: the whole-model
load (each rank builds the whole model, then DeepSpeed partitions it) against the
partitioned load (``ulysses_cp.training.loading``: built under ``zero.Init``, each rank
reading only its slice of each safetensors tensor).

It writes a local checkpoint once (a Llama config, random weights, several safetensors
shard files), then at ``--world`` ranks loads it both ways (and, with ``--random``, builds
the same config from a seed both ways). Per rank it reads the resident set size (RSS)
after start-up (imports, process group: the baseline), resets the kernel's high-water
mark (``/proc/self/clear_refs``), loads, and reads the high-water mark (``VmHWM``): the
load's peak is ``VmHWM - baseline``. The whole load here is ``from_pretrained`` (or
``from_config``) then ``deepspeed.zero.Init(module=...)``, what ``ucp.initialize`` does
with a whole model; the guard's probe is not part of either measurement. Linux only.

    python scripts/benchmark_loading.py            # ~350M parameters, bf16, 4 ranks
    python scripts/benchmark_loading.py --quick    # a tiny model, for a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import gather_floats, run_ranks

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def llama_config(args) -> dict:
    return dict(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def write_checkpoint(args) -> dict:
    """The checkpoint folder (reused when it holds this config): config.json and shards."""
    import transformers

    from ulysses_cp.models import hf

    folder = Path(args.ckpt)
    fields = llama_config(args)
    stamp = folder / "bench_config.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == {**fields, "dtype": args.dtype}):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            hf.load_config(dict(fields)), dtype=hf.DTYPES[args.dtype]
        )
        model.save_pretrained(folder, max_shard_size=f"{args.shard_mb}MB")
        (folder / "model_config.json").write_text(json.dumps(fields))
        stamp.write_text(json.dumps({**fields, "dtype": args.dtype}))
        del model
        gc.collect()
    shards = sorted(folder.glob("*.safetensors"))
    params = sum(_numel(s) for s in shards)
    return {
        "folder": str(folder),
        "parameters": params,
        "model_bytes": sum(s.stat().st_size for s in shards),
        "shards": len(shards),
        "largest_shard_bytes": max(s.stat().st_size for s in shards),
    }


def _numel(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        total = 0
        for key in f.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= d
            total += n
        return total


def _run_config(args, weights: str | None) -> dict:
    model = {"hf_config": str(Path(args.ckpt) / "model_config.json"), "dtype": args.dtype}
    if weights:
        model["hf_weights"] = weights
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": args.dtype == "bfloat16"},
        "sequence_parallel": {"ulysses_degree": args.world, "ring_degree": 1},
        "model": model,
    }


def _warm_up() -> None:
    """Import what either load imports on first use, so the baseline holds it."""
    import deepspeed.runtime.zero.partition_parameters  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers
    import transformers.models.llama.modeling_llama

    transformers.AutoModelForCausalLM  # noqa: B018  (the lazy module resolves here)


def _load(rank, world, job, device):
    """One rank: baseline RSS, then the load's high-water mark (module docstring)."""
    import ulysses_cp as ucp
    from ulysses_cp.config import RunConfig
    from ulysses_cp.models import hf
    from ulysses_cp.training import engine, loading

    args, how, weights = job
    ucp.init_distributed()
    run = RunConfig.load(_run_config(args, weights))
    topo = ucp.topology_from_config(run)
    mc = run.model
    _warm_up()
    gc.collect()
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    torch.manual_seed(0)
    if how == "partitioned":
        model = loading.build_partitioned(run, topo, backend="torch")
    else:
        hf.register_attention(topo, backend="torch")
        whole = hf.from_config(
            hf.load_config(mc.hf_config), dtype=hf.DTYPES[mc.dtype], hf_weights=mc.hf_weights
        )
        model = hf.wrap(whole, topo, mc)
        mpu = engine.SequenceParallelMPU(topo)
        ds_config, dtype = engine.deepspeed_part(run), run.deepspeed.dtype
        engine._partition_over_all_ranks(model, mpu, ds_config, dtype)
    seconds = time.perf_counter() - start
    peak, after = _status("VmHWM"), _status("VmRSS")
    local = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    rows = gather_floats([baseline, peak, after, local, seconds], device)
    return [dict(zip(("baseline", "peak", "after", "partition", "seconds"), r)) for r in rows]


def _predicted(args, how: str, weights, ckpt: dict) -> int:
    """The planner's host bytes of this load (``ulysses_cp/plan/host.py``)."""
    from ulysses_cp.config import RunConfig
    from ulysses_cp.plan.host import host_bytes
    from ulysses_cp.plan.shapes import model_shape

    run = RunConfig.load(_run_config(args, weights))
    shape = model_shape(run.model, dtype_bytes=2 if args.dtype == "bfloat16" else 4)
    shape = replace(shape, weights_file_bytes=ckpt["largest_shard_bytes"] if weights else 0)
    parted = how == "partitioned"
    return host_bytes(shape, zero_stage=3, world=args.world, tokens=0, partitioned_load=parted)[
        "load"
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--shard-mb", type=int, default=100)
    p.add_argument("--random", action="store_true", help="also build from a seed both ways")
    p.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--loads", default="whole,partitioned", help="which loads to measure")
    p.add_argument("--ckpt", default=None, help="checkpoint folder (default OUT/loading_ckpt)")
    p.add_argument("--out", default=str(ROOT / "bench_results"))
    args = p.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab, args.shard_mb = 64, 128, 2, 512, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.ckpt = args.ckpt or str(out / ("loading_ckpt_quick" if args.quick else "loading_ckpt"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ckpt = write_checkpoint(args)
    cases = [("hf_weights", "whole", ckpt["folder"]), ("hf_weights", "partitioned", ckpt["folder"])]
    if args.random:
        cases += [("random init", "whole", None), ("random init", "partitioned", None)]
    cases = [c for c in cases if c[1] in args.loads.split(",")]
    rows = []
    for source, how, weights in cases:
        gc.collect()
        per_rank = run_ranks(_load, args.world, (args, how, weights))
        rows.append(
            {
                "source": source,
                "load": how,
                "ranks": per_rank,
                "predicted_bytes": _predicted(args, how, weights, ckpt),
            }
        )
    budget = ckpt["model_bytes"] / args.world + ckpt["largest_shard_bytes"]
    result = {
        "checkpoint": ckpt,
        "world": args.world,
        "dtype": args.dtype,
        "rows": rows,
        "budget_bytes": budget,
        "device": "cpu",
    }
    (out / "benchmark_loading.json").write_text(json.dumps(result, indent=1))
    print(table(result))


def table(result: dict) -> str:
    ck = result["checkpoint"]
    lines = [
        f"model: {ck['parameters'] / 1e6:.0f}M parameters, {ck['model_bytes'] / MIB:.0f} MiB in "
        f"{result['dtype']}, {ck['shards']} shard files (largest "
        f"{ck['largest_shard_bytes'] / MIB:.0f} MiB); {result['world']} ranks, ZeRO-3, CPU",
        f"budget per rank (1/world of the model + one shard file): "
        f"{result['budget_bytes'] / MIB:.0f} MiB",
        "",
        "| source | load | peak - baseline per rank (MiB, max over ranks) | ranks' peaks (MiB) "
        "| partition (MiB) | predicted (MiB) | baseline (MiB) | seconds | within budget |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in result["rows"]:
        ranks = row["ranks"]
        grow = [r["peak"] - r["baseline"] for r in ranks]
        worst = max(grow)
        lines.append(
            f"| {row['source']} | {row['load']} | {worst / MIB:.0f} | "
            f"{', '.join(f'{g / MIB:.0f}' for g in grow)} | {ranks[0]['partition'] / MIB:.0f} | "
            f"{row['predicted_bytes'] / MIB:.0f} | "
            f"{max(r['baseline'] for r in ranks) / MIB:.0f} | "
            f"{max(r['seconds'] for r in ranks):.1f} | "
            f"{'yes' if worst <= result['budget_bytes'] else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
