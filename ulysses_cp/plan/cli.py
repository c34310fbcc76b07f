"""``python -m ulysses_cp.plan`` and ``ulysses-cp-plan``: the planner's command line (``--help``
lists the options).

Prints a table (the config as written, then the candidates that fit, ranked as ``--goal``
asks: by the longest sequence that fits, the default, or by the predicted step time) and
writes JSON with ``config``, ``candidates``, ``chosen`` and ``goal``; ``--write-config``
writes the config with the chosen plan's settings (``plan/write.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from ..config import ENGINES, RunConfig
from ..core.commands import DefaultsHelp, program_name
from ..core.log import configure_logging
from ..core.sharding import sequence_multiple
from ..core.topology import validate_degrees
from ..modes.ulysses import kv_replication
from .phases import PHASE_NAMES
from .ranking import GOALS, changes, rank, versus
from .search import GiB, Hardware, Run, ZeroKnobs, candidates, filled, longest, predict, usable
from .shapes import model_shape
from .write import write_config
from .written import base_run, describe

__all__ = ["breakdown", "main", "parse_args", "plan", "plan_for_launch", "table"]

DESCRIPTION = """Predict a run's memory, communication and step time before launch, for the
config as written and for every valid alternative; --write-config writes the chosen one."""

KEYS = (
    "peak_bytes_per_rank",
    "static_bytes_per_rank",
    "activation_bytes_per_rank",
    "comm_bytes_per_step_per_rank",
)


def _dtype_bytes(run: RunConfig) -> int | None:
    """2 when DeepSpeed trains in bf16 or fp16, else None (the model's own dtype)."""
    return 2 if run.deepspeed.dtype in ("bfloat16", "float16") else None


def plan(
    run_config: RunConfig,
    *,
    world: int,
    hw: Hardware,
    seq_len: int | None = None,
    seq_step: int = 1024,
    max_candidates: int | None = None,
    goal: str = "longest",
    engine: str | None = None,
) -> dict:
    """The planner's JSON for a loaded config (see the module docstring); ``goal`` orders
    ``candidates`` and picks ``chosen`` (:data:`~ulysses_cp.plan.ranking.GOALS`);
    ``engine`` (``--engine``) plans under that engine instead of the config's."""
    if goal not in GOALS:
        raise ValueError(f"--goal {goal!r}: choose one of {', '.join(GOALS)}")
    shape = model_shape(run_config.model, dtype_bytes=_dtype_bytes(run_config))
    base = base_run(run_config, engine)
    N = seq_len or run_config.data.seq_len
    validate_degrees(world, base.ulysses, base.ring)
    kv_replication(shape.hq, shape.hkv, base.ulysses)
    m = sequence_multiple(base.sp, base.layout)
    if N % m:
        raise ValueError(
            f"--seq-len {N} must be a multiple of {m} for u{base.ulysses} x r{base.ring} in "
            f"the {base.layout!r} layout; try {N // m * m or m} or {(N // m + 1) * m}"
        )
    batch, gas = run_config.deepspeed.micro_batch, run_config.deepspeed.micro_steps
    knobs = ZeroKnobs.from_settings(run_config.deepspeed)
    budget = usable(hw.gpu_mem_gb * GiB)  # the headroom the run keeps
    shape = replace(shape, weights_file_bytes=_largest_weights_file(run_config.model))
    if shape.budget_bytes is None:  # "auto" tiles as the run on such a GPU sizes them
        shape = replace(shape, budget_bytes=int(budget))

    def at(r: Run, n: int) -> dict:
        return predict(
            shape, r, seq_len=n, batch=batch, micro_steps=gas, world=world, hw=hw, zero_knobs=knobs
        )

    def one(r: Run) -> dict:
        pred = at(r, N)
        unit = math.lcm(sequence_multiple(r.sp, r.layout), seq_step)
        peak = lambda n: filled(at(r, n), hw)  # noqa: E731
        return {
            **describe(r),
            "fits": filled(pred, hw) <= budget,
            "max_seq_len": longest(peak, unit, budget),
            **pred,
        }

    written = one(base)
    longest_n = written["max_seq_len"]
    at_longest = None
    if longest_n:
        at_longest = {
            "seq_len": longest_n,
            "tokens_per_rank": batch * longest_n // base.sp,
            **at(base, longest_n),
        }
    split = _offload_split(base, shape.layers, written["max_seq_len"], one)
    runs = candidates(shape, base, world=world, seq_len=N)
    if split:  # the config as written with the count of offloaded layers named above
        n = replace(base, offload_activations=split["offload_activations"])
        runs += [n] if n not in runs else []
    cands = rank([one(r) for r in runs], goal)[:max_candidates]
    chosen = next((c for c in cands if c["fits"]), None)
    return {
        "goal": goal,
        "ranked_by": GOALS[goal].format(n=N),
        "inputs": {
            "deepspeed_config": str(run_config.path),
            "engine": base.engine,
            "world": world,
            "seq_len": N,
            "micro_batch": batch,
            "gradient_accumulation_steps": gas,
            "model_params": shape.params,
            "dtype_bytes": shape.dtype_bytes,
        },
        "hardware": asdict(hw),
        "config": written,
        "config_at_max_seq_len": at_longest,
        "offload_split": split,
        "candidates": cands,
        "chosen": chosen,
        "chosen_is_config": chosen is not None and not changes(written, chosen),
    }


def _offload_split(base: Run, layers: int, written: int, one) -> dict | None:
    """With checkpointing: the count of offloaded layer inputs (``offload_activations: n``,
    the first ``n`` layers) that reaches the longest sequence, the fewest layers among
    equals (the least host traffic), when it beats the config as written; else None."""
    if not base.activation_checkpointing:
        return None
    best = None
    for n in range(layers + 1):
        got = one(replace(base, offload_activations=n))["max_seq_len"]
        if got > written and (best is None or got > best["max_seq_len"]):
            best = {"offload_activations": n, "layers": layers, "max_seq_len": got}
    return best


def _largest_weights_file(mc) -> int:
    """Bytes of the largest safetensors file the load of ``model.hf_weights`` reads (the
    files its index names, or its one file; 0: none)."""
    folder = getattr(mc, "hf_weights", None)
    if not folder or not Path(folder).is_dir():
        return 0
    from ..training.loading import checkpoint_files

    files = set(checkpoint_files(folder).values())
    return max((f.stat().st_size for f in files), default=0)


def _row(c: dict, unit: int) -> str:
    def _gib(n: float) -> str:
        return f"{n / unit:.1f}"

    off, mem = c["offload_activations"], "-"
    if c["activation_checkpointing"]:  # ckpt+offN: the first N layers' inputs offloaded
        mem = "ckpt+off" if off is True else f"ckpt+off{off}" if off else "ckpt"
    auto = "auto" in (c["tiled_mlp"], c["tiled_loss"])  # "a": counts resolved at seq_len
    tiled = f"{c['tiles']['mlp']}/{c['tiles']['loss']}"
    tiled = f"a{tiled}" if auto else tiled if max(c["tiles"].values()) > 1 else "-"
    chunks = f"c{c['head_chunks']}" + ("r" if c["redo_all_to_all"] else "")  # r: redo_all_to_all
    return (
        f"u{c['ulysses_degree']:<3}r{c['ring_degree']:<3} {c['layout']:<10} z{c['zero_stage']} "
        f"{chunks:<4} {mem:<10} {tiled:<9} {_gib(c['static_bytes_per_rank']):>8} "
        f"{_gib(c['activation_bytes_per_rank']):>8} {_gib(c['peak_bytes_per_rank']):>8} "
        f"{_gib(c['host_bytes_per_rank']):>8} {c['intra_node_bytes'] / 1e9:>8.3g} "
        f"{c['inter_node_bytes'] / 1e9:>8.3g} "
        f"{c['predicted_step_s']:>8.3g} {'yes' if c['fits'] else 'no':>4} {c['max_seq_len']:>9}"
    )


def table(result: dict, top: int = 10) -> str:
    """The readable table: the config as written, then the best ``top`` that fit."""
    i, hw = result["inputs"], result["hardware"]
    unit, name = (GiB, "GiB") if result["config"]["peak_bytes_per_rank"] >= GiB else (2**20, "MiB")
    head = (
        f"{'split':<9} {'layout':<10} {'zero':<4} {'chk':<4} {'act mem':<10} {'tiles m/l':<9} "
        f"{'static':>8} {'activ.':>8} {'peak':>8} {'host':>8} {'intra GB':>8} {'inter GB':>8} "
        f"{'step s':>8} {'fits':>4} {'max seq':>9}"
    )
    fit, seen = [], set()
    for c in result["candidates"]:  # head chunks that change nothing predicted: listed once
        key = tuple(c[k] for k in c if k != "head_chunks" and not isinstance(c[k], dict))
        if c["fits"] and key not in seen:
            seen.add(key)
            fit.append(c)
    lines = [
        f"PREDICTED, not measured. plan: {i['deepspeed_config']}  engine {i['engine']}  "
        f"world {i['world']} "
        f"({hw['gpus_per_node']} per node), "
        f"seq_len {i['seq_len']}, {i['model_params'] / 1e9:.3g}B params, "
        f"{hw['gpu_mem_gb']:g} GiB per GPU, {hw['host_mem_gb']:g} GiB host per node; "
        f"memory in {name} per rank, GB per step per rank",
        head,
        "as written:",
        _row(result["config"], unit),
        f"best of {len(fit)} that fit (of {len(result['candidates'])} candidates), ranked by "
        f"{result['ranked_by']} (--goal {result['goal']}):",
        *[_row(c, unit) for c in fit[:top]],
        *versus(result),
    ]
    if result["chosen"] is None:
        lines.append(
            "nothing fits: more GPUs, a shorter --seq-len, more --gpu-mem-gb or --host-mem-gb"
        )
    if result.get("config_at_max_seq_len"):
        lines += breakdown(result["config_at_max_seq_len"])
    split = result.get("offload_split")
    if split:
        lines.append(
            f'"offload_activations": {split["offload_activations"]} (the inputs of the first '
            f"{split['offload_activations']} of {split['layers']} layers on the host, the rest "
            f"on the GPU) reaches {split['max_seq_len']} tokens, against "
            f"{result['config']['max_seq_len']} as written"
        )
    lines.append(
        "every number above is a prediction of the planner's cost model "
        "(docs/planner/cost-model.md), not a measurement"
    )
    return "\n".join(lines)


def breakdown(p: dict) -> list[str]:
    """What the predicted peak of the config as written holds at its longest sequence."""
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    st, act, tp = p["static_parts"], p["activation_parts"], p["activation_parts"]["transient_parts"]
    t, host = p["tokens_per_rank"], p["host_parts"]
    return [
        f"predicted peak of the config as written at its longest sequence, {p['seq_len']} "
        f"tokens (tiles mlp/loss {p['tiles']['mlp']}/{p['tiles']['loss']}): "
        f"{g(p['peak_bytes_per_rank'])} GiB per rank, parts in GiB:",
        f"  static {g(p['static_bytes_per_rank'])}: "
        + ", ".join(f"{k} {g(v)}" for k, v in st.items()),
        f"  activation {g(act['total'])}: kept by the layers {g(act['layers'])}, top of the "
        f"stack {g(act['top'])}, largest transient {g(act['transient'])} of "
        + ", ".join(f"{k} {g(v)}" for k, v in tp.items()),
        f"  ({t} tokens per rank: {act['total'] / max(t, 1) / 1024:.1f} KiB of activation "
        "per token)",
        f"  the peak falls in {PHASE_NAMES[p['peak_phase']]} (GiB above the "
        f"{g(p['phases']['persistent'])} allocated throughout: "
        + ", ".join(f"{k} {g(v)}" for k, v in p["phases"]["phases"].items())
        + f", optimizer_step {g(p['phases']['optimizer_step'])})",
        f"  host memory per rank {g(p['host_bytes_per_rank'])} GiB: the larger of loading "
        f"{g(host['load'])} and training {g(host['training'])} (offloaded optimizer "
        f"{g(host['optimizer'])}, offloaded activations {g(host['activations'])})",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    hw = Hardware()
    p = argparse.ArgumentParser(
        prog=program_name("ulysses_cp.plan"), description=DESCRIPTION, formatter_class=DefaultsHelp
    )
    p.add_argument("--deepspeed_config", required=True, help="the run's config JSON")
    p.add_argument("--world", type=int, required=True, help="total ranks (GPUs)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: min(world, 8)")
    p.add_argument("--gpu-mem-gb", type=float, default=hw.gpu_mem_gb, help="GiB per GPU")
    p.add_argument(
        "--host-mem-gb",
        type=float,
        default=hw.host_mem_gb,
        help="GiB of host memory per node (offloaded optimizer and activations)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="plan under this engine (fsdp2: ZeRO-3 reshards after forward, 0-2 do not); "
        'default: the config\'s "engine"',
    )
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's data.seq_len")
    p.add_argument("--seq-step", type=int, default=1024, help="search step of max_seq_len")
    p.add_argument(
        "--goal",
        choices=tuple(GOALS),
        default="longest",
        help="rank the candidates that fit by the longest sequence that fits (default) or by "
        "the predicted step time at --seq-len (fastest)",
    )
    p.add_argument("--peak-tflops", type=float, default=hw.peak_tflops, help="GPU's peak TFLOP/s")
    p.add_argument("--mfu", type=float, default=hw.mfu, help="the fraction of it a step reaches")
    p.add_argument("--intra-gbs", type=float, default=hw.intra_gbs, help="GB/s inside a node")
    p.add_argument("--inter-gbs", type=float, default=hw.inter_gbs, help="GB/s across nodes")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", help="write the full plan here")
    p.add_argument(
        "--write-config",
        metavar="OUT.json",
        help="write the config with the chosen plan's settings (for train.py as it is)",
    )
    return p.parse_args(argv)


def hardware(args: argparse.Namespace) -> Hardware:
    per_node = args.gpus_per_node or min(args.world, 8)
    if per_node < 1 or args.world % per_node:
        raise ValueError(
            f"--world {args.world} must be a whole number of nodes of --gpus-per-node "
            f"{per_node}; e.g. --world {max(1, args.world // per_node) * per_node}"
        )
    names = {f.name for f in fields(Hardware)}
    vals = {k.replace("-", "_"): v for k, v in vars(args).items()}
    return Hardware(
        **{k: vals[k] for k in names if k in vals and k != "gpus_per_node"}, gpus_per_node=per_node
    )


def plan_for_launch(run_config: RunConfig, env: dict[str, str]) -> str:
    """``train.py --plan``: the table for the run the launcher would start (``WORLD_SIZE``
    and ranks per node from its environment, else one rank per sequence-parallel rank on
    one node; GPU memory from the device, else the default)."""
    sp = run_config.sequence_parallel
    world = int(env.get("WORLD_SIZE", sp.ulysses_degree * sp.ring_degree))
    per_node = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or min(world, 8))
    mem = Hardware().gpu_mem_gb
    import torch

    if torch.cuda.is_available():
        mem = torch.cuda.get_device_properties(0).total_memory / GiB
    hw = Hardware(gpu_mem_gb=mem, gpus_per_node=min(per_node, world))
    return table(plan(run_config, world=world, hw=hw))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        if args.world < 1:
            raise ValueError(f"--world must be >= 1, got {args.world}")
        if not Path(args.deepspeed_config).is_file():
            raise ValueError(f"--deepspeed_config {args.deepspeed_config}: no such file")
        run = RunConfig.load(args.deepspeed_config)
        result = plan(
            run,
            world=args.world,
            hw=hardware(args),
            seq_len=args.seq_len,
            seq_step=args.seq_step,
            goal=args.goal,
            engine=args.engine,
        )
        written = write_config(result, run, args.write_config) if args.write_config else ""
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table(result, args.top))
    if written:
        print(written)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"json: {args.json}")
    return result


def console() -> None:
    """The ``ulysses-cp-plan`` console script: :func:`main` (its result is printed; the exit
    status is 0, not the returned dict; logging configured as by the other entry points)."""
    configure_logging()
    main()
