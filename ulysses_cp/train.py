"""Long-sequence training under the deepspeed launcher (the package's training entry point).

    deepspeed --num_gpus N --module ulysses_cp.train --deepspeed_config configs/NAME.json \
        [--output_dir DIR] [--max_steps K] [--resume [auto]] [--overwrite]

Also ``deepspeed train.py ...`` (the repository's shim), ``python -m ulysses_cp.train``
(one process) and the ``ulysses-cp-train`` console script. A config with ``"engine":
"fsdp2"`` runs under PyTorch's ``fully_shard`` instead of DeepSpeed (``torchrun
--nproc-per-node N train.py --deepspeed_config ...``; docs/training/fsdp2.md). The JSON is
a DeepSpeed config plus our blocks: "sequence_parallel" (degrees, layout, attention
backend), "model" (the reference decoder or a Hugging Face model), "data" (task, seq_len,
files) and "training" (steps, intervals, reliability). See docs/training/index.md. This
module only wires the library together: the loop is ulysses_cp.training.trainer, the
pieces it builds are ulysses_cp.training.build. :func:`main` checks the config with light
modules only; :func:`train` imports torch (and DeepSpeed, under its engine).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

# only light modules above the config check (no torch, no DeepSpeed): a typo in the JSON
# is reported in the time Python takes to start, on every rank, before any heavy import
from ulysses_cp.config import RunConfig
from ulysses_cp.core.commands import DefaultsHelp, program_name
from ulysses_cp.core.log import configure_logging, get_logger, quiet_third_party
from ulysses_cp.core.process import launched, set_cpu_threads
from ulysses_cp.run_blocks import TrainingConfig

if TYPE_CHECKING:
    from ulysses_cp.training.trainer import Hooks

log = get_logger("train")
log_all = get_logger("train.ranks", all_ranks=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=program_name("ulysses_cp.train"),
        description="Long-sequence training with sequence parallelism (Ulysses, ring, hybrid) "
        'under DeepSpeed (or FSDP2: the config\'s "engine"); one process without a launcher, '
        "N ranks under deepspeed or torchrun.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument(
        "--deepspeed_config",
        required=True,
        help='the run\'s JSON: DeepSpeed\'s keys with our blocks (also under "engine": "fsdp2")',
    )
    p.add_argument("--output_dir", help="metrics and checkpoints (default: runs/<config name>)")
    p.add_argument(
        "--max_steps", type=int, default=None, help="default: the config's training.max_steps"
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        choices=["yes", "auto"],
        help="continue from the latest checkpoint in the output folder (an error if there is "
        "none); '--resume auto': resume when there is one, else start at step 0 (default: "
        "start at step 0 in a new folder)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output folder that already holds a run (refused otherwise)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the planner's memory/communication/step-time table for this run "
        "(python -m ulysses_cp.plan for more options) and exit without training",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense peak TFLOP/s in the run's dtype, the MFU's denominator "
        "(default: the datasheet figure of the GPU found, ulysses_cp.core.flops.PEAK_TFLOPS; "
        "on a CPU, an unknown GPU or in float32 the log has no MFU without it)",
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    args = parse_args(argv)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    configure_logging()  # the library adds no handler: rank 0's lines on stdout
    quiet_third_party()  # e.g. DeepSpeed's use of a collective torch deprecates
    # every config error is raised here, identically on every rank, before any collective
    run = RunConfig.load(args.deepspeed_config)
    tc = run.training
    if args.max_steps is not None:
        tc = replace(tc, max_steps=args.max_steps)
    if args.plan:  # before any process group: every rank would print the same
        from ulysses_cp.plan.cli import plan_for_launch

        if os.environ.get("RANK", "0") == "0":
            print(plan_for_launch(run, dict(os.environ)), flush=True)
        return
    check_launcher(run, args.deepspeed_config)
    train(args, run, tc, hooks)


def check_launcher(run: RunConfig, config: str) -> None:
    """Without a launcher this is one process (``train`` makes it a world of one): a
    config whose degrees need more is refused here, before torch is imported, with the
    commands that start enough ranks."""
    sp = run.sequence_parallel
    need = sp.ulysses_degree * sp.ring_degree
    if need == 1 or launched():
        return
    rest = f"-m ulysses_cp.train --deepspeed_config {config} ..."
    raise ValueError(
        f"ulysses_degree({sp.ulysses_degree}) x ring_degree({sp.ring_degree}) = {need} "
        f"ranks, but this is WORLD_SIZE(1): one process started without a launcher; start "
        f"{need} (or a multiple of {need}) with `deepspeed --num_gpus {need} --module "
        f"ulysses_cp.train --deepspeed_config {config} ...` or `torchrun --nproc-per-node "
        f"{need} {rest}`"
    )


def train(
    args: argparse.Namespace, run: RunConfig, tc: TrainingConfig, hooks: Hooks | None = None
) -> None:
    """The run, once its config has passed :meth:`RunConfig.load` (``tc``: its training
    block with the command line's overrides): the process group, the data, the model and
    the engine, then the training loop. Imports torch and DeepSpeed."""
    import torch
    import torch.distributed as dist

    from ulysses_cp.core.metrics import topology_info
    from ulysses_cp.core.zero_comm import full_numel, zero_wire_bytes
    from ulysses_cp.models.memory import LossPlan
    from ulysses_cp.plan.nodes import describe, gather_groups
    from ulysses_cp.training import checkpoint
    from ulysses_cp.training.build import (
        build_model,
        check_output_dir,
        cpu_optimizer,
        tile_plan,
        validate,
    )
    from ulysses_cp.training.data import make_datasets
    from ulysses_cp.training.engine import initialize, topology_from_config
    from ulysses_cp.training.evaluate import Evaluator
    from ulysses_cp.training.tracking import RUN_ID_KEY, Tracker
    from ulysses_cp.training.trainer import Trainer, TrainingStopped

    dc = run.data
    fsdp2 = run.engine == "fsdp2"
    start_processes(run)
    set_cpu_threads(log)  # after the process group: rank 0 logs the choice
    validate(run)
    tiles = tile_plan(run.model)  # the budget and the tiles, resolved once
    if tiles.source:
        log.info(tiles.source)
    out = Path(args.output_dir or Path("runs") / Path(args.deepspeed_config).stem)
    resuming = check_output_dir(out, args.resume, args.overwrite)
    # missing or short data files fail here, before the engine; task "dataset" tokenizes
    # its files once (rank 0, with a progress bar) into a cache every rank maps
    dataset, held_out = make_datasets(dc, run.eval)
    fm = None
    if fsdp2:
        from ulysses_cp.training.fsdp2_engine import fsdp2_mesh

        fm = fsdp2_mesh(run)  # the topology's grad_scale is sp: FSDP2 divides by dp x sp
    topo = fm.topology if fm is not None else topology_from_config(run)
    line, warning = describe(gather_groups(topo))  # the groups as built, node by node
    log.info(line)
    if warning:
        log.warning(warning)

    torch.manual_seed(tc.seed)
    mc = run.model
    model = build_model(mc, topo, run, tiles=tiles)  # under fsdp2, hf_weights: on meta
    n_params = full_numel(model.parameters())  # every parameter once, at full size
    if fm is not None:
        from ulysses_cp.training.fsdp2_engine import fsdp2_initialize, wire_bytes_per_step

        engine = fsdp2_initialize(run, model, fm)
        zero_bytes = wire_bytes_per_step(engine, n_params)
    else:
        optimizer, ds_run = cpu_optimizer(run, model)
        engine = initialize(model=model, config=ds_run, topo=topo, optimizer=optimizer)
        zero_bytes = zero_wire_bytes(
            stage=ds_run.deepspeed.zero_stage,
            max_live_parameters=ds_run.deepspeed.stage3_max_live_parameters,
            params=n_params,
            world=topo.world_size,
            element_bytes=next(engine.module.parameters()).element_size(),
            micro_steps=engine.gradient_accumulation_steps(),
        )
    trainer_speed = speed_counts(model, engine, args.peak_tflops)
    info = topology_info(topo)
    evaluator = None
    if held_out is not None:
        micro = engine.train_micro_batch_size_per_gpu()
        evaluator = Evaluator(held_out, run.eval, topo, micro_batch=micro, device=engine.device)
    plan = LossPlan(tiles.loss, mc.fused_loss)
    trainer = Trainer(
        engine, topo, dataset, tc=tc, out=out, loss_plan=plan, hooks=hooks, evaluator=evaluator
    )
    trainer.flop_shape, trainer.peak_tflops = trainer_speed
    trainer.zero_bytes_per_step = zero_bytes
    start, run_id = 0, None
    if resuming:
        run_id = checkpoint.latest_meta(out).get(RUN_ID_KEY)  # continue its wandb run
        tag = checkpoint.latest_tag(out)
        start = checkpoint.load(engine, out, zero_loss=trainer.zero_loss) or 0
        log.info(f"resumed from {out / str(tag)} at step {start}")
    elif args.resume == "auto":
        log.info(f"--resume auto: no checkpoint in {out}, starting at step 0")
    trainer.tracker = tracker = Tracker(
        output_dir=out,
        config=run.raw,
        topo_info=info,
        is_main=dist.get_rank() == 0,
        resume=resuming,
        start_step=start,
        run_id=run_id,
    )
    log.info(
        f"training {n_params / 1e6:.2f}M params, "
        f"{info}, seq_len {dc.seq_len}, steps {start}..{tc.max_steps}, output {out}"
    )
    try:
        state = trainer.run(start)
    except TrainingStopped as stop:
        log.error(str(stop))
        tracker.finish({"stopped": str(stop)})
        sys.exit(stop.exit_code)
    except Exception as exc:
        # every rank says where it failed (a dead peer shows up as a CollectiveError naming
        # the op and group); the process exits non-zero so the launcher stops the rest
        log_all.error(f"training failed: {type(exc).__name__}: {exc}")
        raise
    first, last = (state.losses[0], state.losses[-1]) if state.losses else (None, None)
    summary = {"first_loss": first, "last_loss": last, "steps": state.step}
    if state.evals:
        summary["eval_loss"] = state.evals[-1]["eval_loss"]
    tracker.finish(summary)
    log.info(f"done: {summary}, metrics in {out / 'metrics.jsonl'}")
    dist.barrier()


def start_processes(run: RunConfig) -> None:
    """The process group of the run's engine: DeepSpeed's (``training.engine``), or for
    ``"engine": "fsdp2"`` torch's own (gloo on CPU, nccl on CUDA), once the config has
    passed the FSDP2 refusals (config only: every rank, before any collective). Either
    engine runs under torchrun or DeepSpeed's launcher (both set RANK and WORLD_SIZE)."""
    timeout_s = run.sequence_parallel.collective_timeout_s
    if run.engine == "fsdp2":
        from ulysses_cp.training.fsdp2_engine import init_process_group
        from ulysses_cp.training.fsdp2_settings import check_fsdp2

        check_fsdp2(run)
        init_process_group(timeout_s=timeout_s)
    else:
        from ulysses_cp.training.engine import init_distributed

        init_distributed(timeout_s=timeout_s)


def speed_counts(model, engine, peak_tflops: float | None) -> tuple:
    """``(FlopShape or None, peak TFLOP/s or None)`` for the trainer's model TFLOP/s and
    MFU: the shape of the model built (``models.flop_count``), the peak as given, else the
    table's for the GPU and the parameters' dtype (``core.flops.device_peak_tflops``); a
    line says which, or why either is left out."""
    import torch

    from ulysses_cp.core.flops import device_peak_tflops
    from ulysses_cp.models.flop_count import flop_shape

    try:
        shape = flop_shape(model)
    except ValueError as exc:
        log.warning(f"model TFLOP/s and MFU left out of the log: {exc}")
        return None, None
    # the dtype the matmuls run in: FSDP2 under bf16 keeps float32 shards, computes in bf16
    dtype = getattr(engine, "compute_dtype", None) or str(
        next(engine.module.parameters()).dtype
    ).removeprefix("torch.")
    if peak_tflops is not None:
        where = "--peak-tflops"
    elif engine.device.type != "cuda":
        where = f"no MFU on {engine.device.type} (no peak; --peak-tflops sets one)"
    else:
        name = torch.cuda.get_device_name(engine.device)
        peak_tflops = device_peak_tflops(name, dtype)
        where = (
            f"the {name}'s dense {dtype} datasheet figure"
            if peak_tflops
            else f"no MFU: no {dtype} peak for the {name} in the table (--peak-tflops sets one)"
        )
    peak = f"{peak_tflops:g} TFLOP/s peak, " if peak_tflops else ""
    log.info(
        f"model FLOPs: {shape.matmul_params / 1e6:.2f}M matmul params per token, "
        f"{shape.attention_layers} attention layers; {peak}{where}"
    )
    return shape, peak_tflops


def run_main(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    """``main`` with user errors (config, data, paths, degrees, layout...), raised
    identically on every rank before anything trains, as one line from rank 0 and exit
    code 2, not a traceback per rank."""
    try:
        main(argv, hooks)
    except ValueError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    run_main()
