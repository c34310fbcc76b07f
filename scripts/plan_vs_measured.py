"""The planner's predictions next to measurements on CPU, per rank: attention bytes (the
counters ``metrics.jsonl`` sums), activation and static memory (the live bytes of every
tensor allocated, ``scripts/profiling.py``'s ``LiveBytes``), ZeRO's collective bytes
(DeepSpeed's comms logger) and the longest sequence under a memory cap
(``scripts/benchmark_memory.py``'s search).

    python scripts/plan_vs_measured.py     # ~2 min on 2 idle cores; docs/benchmarks/planner.md
    python scripts/plan_vs_measured.py --quick    # P = 1, 2 only
    python scripts/plan_vs_measured.py --attention   # one attention layer, N 4096 and 8192

Models: the reference decoder and the tiny Hugging Face Llama of benchmark_memory.py (2
layers); P = 1, 2, 4 ranks as ulysses, ring and hybrid; memory features none / tiled (MLP
and loss in 4 pieces) / tiled+ckpt; ZeRO 1/2/3. Activation = the step's peak of live
bytes (forward, SP loss, backward; exactly linear in the length, so the parameter
gradients are not alive at the peak); static = what model, DeepSpeed engine and two
optimizer steps leave allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import max_over_ranks, run_ranks
from benchmark_attention_memory import HKV, HQ, VARIANTS, D, make_step
from benchmark_memory import FEATURES, build, step_fn
from profiling import LiveBytes, longest_fitting, peak_memory

import ulysses_cp as ucp
from ulysses_cp.config import HFModelConfig, ModelConfig
from ulysses_cp.core.comm import stats
from ulysses_cp.modes.ulysses import resolve_head_chunks
from ulysses_cp.plan.comm import attention_bytes, zero_bytes
from ulysses_cp.plan.memory import activation_bytes, attention_layer_peak, static_bytes
from ulysses_cp.plan.search import longest
from ulysses_cp.plan.shapes import ModelShape, model_shape

ROOT = Path(__file__).resolve().parent.parent
HF_TINY = str(ROOT / "configs" / "hf" / "tiny_llama.json")
SPLITS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4), (2, 2)]}
TOKENS_PER_RANK = 1024
# DeepSpeed's gradient bucket (elements): its default 5e8 would be 2 GB per rank on CPU
REDUCE_BUCKET = 1_000_000
ATTENTION_MODES = {"ulysses 4": (4, 1), "hybrid 2x2": (2, 2)}


def shape_of(kind: str, features: str):
    f = {k: v for k, v in FEATURES[features].items()}
    mc = ModelConfig(**f) if kind == "reference" else HFModelConfig(hf_config=HF_TINY, **f)
    return model_shape(mc)


# ---------------------------------------------------------------- measurements (per rank)


def measure_step(rank: int, u: int, r: int, kind: str, features: str, N: int) -> dict:
    """One training step of ``kind`` with ``features`` at length ``N`` on u x r ranks:
    peak live bytes, and the attention bytes sent."""
    device = torch.device("cpu")
    topo = ucp.init_topology(u, r, backend="torch")
    try:
        model = build(kind, FEATURES[features], topo, device)
        step = step_fn(model, FEATURES[features], topo, N, device)
        step()  # warm: the first call builds cached plans
        stats.reset()
        peak = peak_memory(step, device, scratch=False)
        sent = stats.total("all_to_all") + stats.total("ring")
        return {"activation": max_over_ranks(peak, device), "attention_bytes": sent}
    finally:
        topo.destroy()


def measure_longest(rank: int, u: int, r: int, kind: str, features: str, budget: float) -> int:
    """benchmark_memory.py's search: the longest multiple of 2P*64 within ``budget`` bytes
    of step peak (live bytes, parameter gradients included) on the busiest rank."""
    device = torch.device("cpu")
    topo = ucp.init_topology(u, r, backend="torch")
    try:
        model = build(kind, FEATURES[features], topo, device)

        def peak_at(n):
            step = step_fn(model, FEATURES[features], topo, n, device)
            return max_over_ranks(peak_memory(step, device, scratch=False), device)

        return longest_fitting(peak_at, 2 * u * r * 64, budget)
    finally:
        topo.destroy()


def measure_zero(rank: int, world: int, stage: int, kind: str) -> dict:
    """Static bytes (what model, engine and two steps leave allocated) and the comms
    logger's bytes per op of the second step, ZeRO ``stage`` over ``world`` ranks (u =
    world, ring 1)."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import deepspeed.comm as dcomm

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
        "sequence_parallel": {"ulysses_degree": world, "attention_backend": "torch"},
    }
    run = ucp.RunConfig.load(cfg)
    topo = ucp.topology_from_config(run)
    N = 64 * world
    with LiveBytes() as live:
        model = build(kind, FEATURES["none"], topo, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = ucp.initialize(model=model, config=run, topo=topo, optimizer=opt)
        step = step_fn(engine, FEATURES["none"], topo, N, torch.device("cpu"))
        logged: dict[str, int] = {}
        for i in range(2):
            dcomm.comms_logger.comms_dict.clear()
            engine.zero_grad()
            _train_step(engine, topo, N)
            if i == 1:
                for op, sizes in dcomm.comms_logger.comms_dict.items():
                    logged[op] = sum(size * v[0] for size, v in sizes.items())
        del step
        static = live.live
    engine.destroy()
    topo.destroy()
    return {"static": max_over_ranks(static, torch.device("cpu")), "logged": logged}


def _train_step(engine, topo, N: int) -> None:
    from ulysses_cp.run_blocks import DataConfig
    from ulysses_cp.training.data import KVRecall, global_batch

    full = global_batch(
        KVRecall(DataConfig(seq_len=N)),
        step=0,
        micro_step=0,
        grad_accum=1,
        micro_batch=1,
        dp_rank=0,
        dp_degree=1,
    )
    local = ucp.shard_batch(full, topo)
    loss = ucp.sequence_parallel_cross_entropy(
        engine(local["input_ids"], local["position_ids"], local["batch"]),
        local["shift_labels"],
        topo,
    )
    engine.backward(loss)
    engine.step()


def measure_attention(rank, world, args, device) -> list[dict]:
    """benchmark_attention_memory.py's layer (its inputs included) at every N of
    ``args``: the peak per rank by the profiler (kernel scratch seen, as the benchmark) and
    by live tensor bytes, slowest rank, for Ulysses 4 and hybrid 2x2 in its variants."""
    rows = []
    for mode, (u, r) in ATTENTION_MODES.items():
        base = ucp.init_topology(u, r, backend="torch")
        for name, options in VARIANTS.items():
            topo = base.with_options(**options)
            for N in args["seqs"]:
                step, own = make_step(topo, N, device)
                step()  # warm: the first call's checks
                prof = peak_memory(step, device) + own
                live = peak_memory(step, device, scratch=False) + own
                rows.append(
                    {
                        "mode": mode,
                        "variant": name,
                        "N": N,
                        "profiler": max_over_ranks(prof, device),
                        "live": max_over_ranks(live, device),
                    }
                )
        base.destroy()
    return rows


# ---------------------------------------------------------------- predictions


def predicted_step(u: int, r: int, kind: str, features: str, N: int) -> dict:
    shape = shape_of(kind, features)
    act = activation_bytes(shape, seq_len=N, batch=1, ulysses=u, ring=r)["total"]
    attn = attention_bytes(shape, seq_len=N, batch=1, ulysses=u, ring=r)["total"]
    return {"activation": act, "attention_bytes": attn}


def attention_shape() -> ModelShape:
    """benchmark_attention_memory.py's layer as the planner sees it (float32)."""
    return ModelShape(
        family="reference",
        vocab=0,
        dim=HQ * D,
        layers=1,
        hq=HQ,
        hkv=HKV,
        head_dim=D,
        ffn=0,
        params=0,
        layer_params=0,
        dtype_bytes=4,
    )


def predicted_attention(mode: str, variant: str, N: int) -> int:
    """The planner's peak of that layer, with the head chunks the run resolves."""
    u, r = ATTENTION_MODES[mode]
    options = VARIANTS[variant]
    shape = attention_shape()
    head = (N // r) * D * shape.dtype_bytes  # one head-sharded query head (b = 1)
    chunks = resolve_head_chunks(options.get("head_chunks", 0), HQ, HKV, u, r > 1, head)
    return attention_layer_peak(
        shape,
        seq_len=N,
        batch=1,
        ulysses=u,
        ring=r,
        head_chunks=chunks,
        redo=options.get("redo_all_to_all", False),
    )


def attention_table(seqs: list[int], out: Path) -> None:
    """Measure the layer on 4 ranks and print it next to the planner's peak."""
    rows = run_ranks(measure_attention, 4, {"seqs": seqs})
    print(
        f"{'mode':<11} {'variant':<8} {'N':>6} {'planner MB':>11} {'profiler MB':>12} "
        f"{'error':>7} {'live MB':>8} {'error':>7}"
    )
    for row in rows:
        row["predicted"] = predicted_attention(row["mode"], row["variant"], row["N"])
        p, m, live = (row[k] / 2**20 for k in ("predicted", "profiler", "live"))
        err, err_live = (p - m) / m * 100, (p - live) / live * 100
        print(
            f"{row['mode']:<11} {row['variant']:<8} {row['N']:>6} {p:>11.1f} {m:>12.1f} "
            f"{err:>6.1f}% {live:>8.1f} {err_live:>6.1f}%"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_measured_attention.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"json: {out / 'plan_vs_measured_attention.json'}")


def predicted_zero(world: int, stage: int, kind: str) -> dict:
    shape = shape_of(kind, "none")
    static = sum(
        static_bytes(
            shape, zero_stage=stage, world=world, reduce_bucket_size=REDUCE_BUCKET
        ).values()
    )
    logged = {k: v["logged"] for k, v in zero_bytes(shape, stage=stage, world=world).items()}
    return {"static": static, "logged": logged}


def predicted_longest(u: int, r: int, kind: str, features: str, budget: float) -> int:
    shape = shape_of(kind, features)

    def peak(n):
        return activation_bytes(shape, seq_len=n, batch=1, ulysses=u, ring=r)["total"]

    return longest(peak, 2 * u * r * 64, budget)


# ---------------------------------------------------------------- the run


def _ranks_body(rank, world, args, device):
    out = []
    for job, kw in args["jobs"]:
        value = {"step": measure_step, "longest": measure_longest, "zero": measure_zero}[job](
            rank, **kw
        )
        out.append([job, kw, value])
    return out


def jobs_for(world: int, quick: bool) -> list:
    jobs: list = []
    for u, r in SPLITS[world]:
        for kind in ("reference", "hf"):
            for features in ("none", "tiled", "tiled+ckpt"):
                N = TOKENS_PER_RANK * world
                jobs.append(["step", dict(u=u, r=r, kind=kind, features=features, N=N)])
    if world > 1:
        for kind in ("reference", "hf"):
            for stage in (1, 2, 3):
                jobs.append(["zero", dict(world=world, stage=stage, kind=kind)])
    if not quick and world in (1, 4):
        for kind in ("reference", "hf"):
            for features in ("none", "tiled+ckpt"):
                u, r = SPLITS[world][-1]
                jobs.append(
                    ["longest", dict(u=u, r=r, kind=kind, features=features, budget=8 * 2**20)]
                )
    return jobs


def compare(job: str, kw: dict, measured) -> list[dict]:
    """Rows ``{what, case, predicted, measured, error}`` for one measurement."""
    case = " ".join(f"{k}={v}" for k, v in kw.items() if k != "budget")
    rows = []
    if job == "step":
        pred = predicted_step(**kw)
        for key in ("activation", "attention_bytes"):
            rows.append(
                {"what": key, "case": case, "predicted": pred[key], "measured": measured[key]}
            )
    elif job == "zero":
        pred = predicted_zero(**kw)
        rows.append(
            {
                "what": "static",
                "case": case,
                "predicted": pred["static"],
                "measured": measured["static"],
            }
        )
        big = {op: n for op, n in measured["logged"].items() if n > 64}  # not the flag bytes
        rows.append(
            {
                "what": "zero_bytes",
                "case": case,
                "predicted": sum(pred["logged"].values()),
                "measured": sum(big.values()),
                "ops": big,
            }
        )
    else:
        pred = predicted_longest(**kw)
        rows.append(
            {
                "what": "longest_seq",
                "case": case,
                "predicted": pred,
                "measured": measured,
                "step": 2 * kw["u"] * kw["r"] * 64,
            }
        )
    for row in rows:
        m = row["measured"]
        row["error"] = (row["predicted"] - m) / m if m else 0.0
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="P = 1, 2 only, no length search")
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    p.add_argument(
        "--attention",
        action="store_true",
        help="only one attention layer against the planner's peak, at --seqs",
    )
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    args = p.parse_args()
    if args.attention:
        attention_table(args.seqs, Path(args.out))
        return
    rows = []
    for world in (1, 2) if args.quick else (1, 2, 4):
        done = run_ranks(_ranks_body, world, {"jobs": jobs_for(world, args.quick)})
        for job, kw, measured in done:
            rows += compare(job, kw, measured)
    print(f"{'what':<16}{'case':<58}{'predicted':>12}{'measured':>12}{'error':>8}")
    for r in rows:
        print(
            f"{r['what']:<16}{r['case']:<58}{r['predicted']:>12}{int(r['measured']):>12}"
            f"{r['error'] * 100:>7.1f}%"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_measured.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"json: {out / 'plan_vs_measured.json'}")


if __name__ == "__main__":
    main()
