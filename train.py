"""Long-sequence training under the deepspeed launcher.

    deepspeed --num_gpus N train.py --deepspeed_config configs/NAME.json \
        [--output_dir DIR] [--max_steps K] [--resume]

The JSON is a DeepSpeed config plus our blocks: "sequence_parallel" (degrees, layout,
attention backend), "model" (the reference decoder), "data" (task, seq_len, files) and
"training" (max_steps, log_interval, save_interval). See docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import ulysses_cp as ucp
from ulysses_cp import checkpoint, faults
from ulysses_cp.config import from_block
from ulysses_cp.data import DataConfig, global_batch, make_dataset, shard_batch
from ulysses_cp.log import get_logger
from ulysses_cp.memory import lm_loss
from ulysses_cp.model import Decoder, ModelConfig
from ulysses_cp.nonfinite import any_rank, gradients_finite, skip_update
from ulysses_cp.tracking import Tracker

log = get_logger("train")
log_all = get_logger("train.ranks", all_ranks=True)


@dataclass
class TrainingConfig:
    max_steps: int = 100
    log_interval: int = 10
    save_interval: int = 0  # 0: save at the end only
    seed: int = 0
    on_nonfinite: str = "skip"  # non-finite loss or gradients: "skip" the step or "stop"
    check_gradients: bool = True  # look for non-finite gradients before every update
    save_on_signal: bool = True  # SIGTERM/SIGINT: save at the end of the step, exit 0
    portable_checkpoint: bool = True  # also save portable.pt (resume on other world sizes)

    @classmethod
    def from_dict(cls, cfg: dict) -> TrainingConfig:
        tc = from_block(cls, cfg, "training")
        for name in ("max_steps", "log_interval", "save_interval", "seed"):
            value = getattr(tc, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"training.{name} must be an integer >= 0, got {value!r}")
        if tc.log_interval < 1:
            raise ValueError(f"training.log_interval must be >= 1, got {tc.log_interval}")
        if tc.on_nonfinite not in ("skip", "stop"):
            raise ValueError(
                f"training.on_nonfinite must be 'skip' or 'stop', got {tc.on_nonfinite!r}"
            )
        for name in ("check_gradients", "save_on_signal", "portable_checkpoint"):
            if not isinstance(getattr(tc, name), bool):
                raise ValueError(f"training.{name} must be true or false")
        return tc


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ulysses_cp long-sequence training")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with our blocks")
    p.add_argument(
        "--output_dir", default=None, help="metrics and checkpoints (default runs/<config name>)"
    )
    p.add_argument("--max_steps", type=int, default=None, help="overrides training.max_steps")
    p.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        choices=["yes", "auto"],
        default=None,
        help="continue from the latest checkpoint in the output folder (an error if there is "
        "none); '--resume auto': resume when there is one, else start at step 0",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output folder that already holds a run (refused otherwise)",
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return p.parse_args()


def check_output_dir(out: Path, resume: str | None, overwrite: bool) -> bool:
    """Whether to resume from ``out``; refuses (before anything is built) a ``--resume``
    with nothing to resume, and a fresh start over an existing run without ``--overwrite``."""
    has_checkpoint = checkpoint.latest_tag(out) is not None
    if resume == "yes" and not has_checkpoint:
        raise ValueError(
            f"--resume: no checkpoint in {out} (no {out / checkpoint.LATEST} naming a complete "
            f"one); check --output_dir, drop --resume to start at step 0, or use --resume auto "
            f"to resume only when a checkpoint exists"
        )
    if resume is None and not overwrite and (has_checkpoint or (out / "metrics.jsonl").exists()):
        raise ValueError(
            f"{out} already holds a run (metrics.jsonl or checkpoints): --resume continues it, "
            f"--overwrite starts afresh there, --output_dir DIR starts a new run elsewhere"
        )
    return resume is not None and has_checkpoint


def validate(sp: ucp.SequenceParallelConfig, mc, dc: DataConfig) -> None:
    """Everything that can be checked before any collective, identically on every rank."""
    ucp.validate_degrees(dist.get_world_size(), sp.ulysses_degree, sp.ring_degree)
    hq, hkv = mc.heads() if hasattr(mc, "heads") else (mc.n_heads, mc.n_kv_heads)
    ucp.kv_replication(hq, hkv, sp.ulysses_degree)
    vocab = mc.vocab_size() if callable(getattr(mc, "vocab_size", None)) else mc.vocab_size
    if vocab < 256:
        raise ValueError(
            f"the model's vocabulary ({vocab}) is smaller than the data's (256 byte/task "
            f"tokens); use vocab_size >= 256"
        )
    m = ucp.sequence_multiple(sp.ulysses_degree * sp.ring_degree, sp.layout)
    if dc.seq_len % m:
        raise ValueError(
            f"data.seq_len {dc.seq_len} must be a multiple of {m} for "
            f"u{sp.ulysses_degree} x r{sp.ring_degree} in the {sp.layout!r} layout"
        )
    if dc.packing and dc.pack_multiple % m:
        raise ValueError(
            f"data.pack_multiple {dc.pack_multiple} must be a multiple of {m}: every packed "
            f"document is split over u{sp.ulysses_degree} x r{sp.ring_degree} ranks in the "
            f"{sp.layout!r} layout"
        )


def build_optimizer(config: dict, model: torch.nn.Module):
    """On CPU an Adam/AdamW block becomes torch.optim.AdamW (DeepSpeed would JIT-compile a
    fused CPU Adam, minutes on 2 cores); on GPU DeepSpeed builds it from the block."""
    block = config.get("optimizer")
    if (
        torch.cuda.is_available()
        or not block
        or block.get("type", "").lower() not in ("adam", "adamw")
    ):
        return None
    params = dict(block.get("params", {}))
    params.pop("torch_adam", None)
    params.pop("adam_w_mode", None)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True
    return torch.optim.AdamW(model.parameters(), **params)


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    args = parse_args()
    # every config error is raised here, identically on every rank, before any collective
    config = ucp.engine.load_config(args.deepspeed_config)
    original = ucp.engine.load_config(config)  # as written, for the wandb run's config
    model_block = config.get("model", {})
    if "hf_config" in model_block:
        from ulysses_cp import hf

        mc = hf.HFModelConfig.from_dict(model_block)
    else:
        mc = ModelConfig.from_dict(model_block)
    dc = DataConfig.from_dict(config.get("data", {}))
    tc = TrainingConfig.from_dict(config.get("training", {}))
    if args.max_steps is not None:
        tc.max_steps = args.max_steps
    sp = ucp.SequenceParallelConfig.from_dict(config.get("sequence_parallel"))
    ucp.init_distributed(timeout_s=sp.collective_timeout_s)
    validate(sp, mc, dc)
    out = Path(args.output_dir or Path("runs") / Path(args.deepspeed_config).stem)
    resuming = check_output_dir(out, args.resume, args.overwrite)
    dataset = make_dataset(dc)  # missing or short data files fail here, before the engine
    topo = ucp.topology_from_config(config)

    torch.manual_seed(tc.seed)
    model = build_model(mc, topo)
    optimizer = build_optimizer(config, model)
    engine = ucp.initialize(model=model, config=config, topo=topo, optimizer=optimizer)
    start = 0
    if resuming:
        start = checkpoint.load(
            engine, out, zero_loss=lambda: zero_loss(engine, topo, dc, mc.tiled_loss)
        )
        log.info(f"resumed from {out / checkpoint.latest_tag(out)} at step {start}")
    elif args.resume == "auto":
        log.info(f"--resume auto: no checkpoint in {out}, starting at step 0")
    info = {
        "world_size": topo.world_size,
        "dp": topo.dp_degree,
        "ulysses": topo.ulysses_degree,
        "ring": topo.ring_degree,
        "mode": topo.mode,
        "layout": sp.layout,
    }
    tracker = Tracker(
        output_dir=out,
        config=original,
        topo_info=info,
        is_main=dist.get_rank() == 0,
        resume=resuming,
        start_step=start,
    )
    log.info(
        f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{info}, seq_len {dc.seq_len}, steps {start}..{tc.max_steps}, output {out}"
    )
    signals = SignalFlag(tc.save_on_signal)
    try:
        losses, end = train_loop(
            engine,
            topo,
            dataset,
            dc,
            tc,
            start,
            tracker,
            out,
            signals,
            mc.tiled_loss,
        )
    except TrainingStopped as stop:
        log.error(str(stop))
        tracker.finish({"stopped": str(stop)})
        sys.exit(stop.exit_code)
    except Exception as exc:
        # every rank says where it failed (a dead peer shows up as a CollectiveError naming
        # the op and group); the process exits non-zero so the launcher stops the rest
        log_all.error(f"training failed: {type(exc).__name__}: {exc}")
        raise
    if end > start and not signals.seen:
        checkpoint.save(engine, out, end, portable=tc.portable_checkpoint)
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": end,
    }
    tracker.finish(summary)
    log.info(f"done: {summary}, metrics in {out / 'metrics.jsonl'}")
    dist.barrier()


def build_model(mc, topo) -> torch.nn.Module:
    """The reference decoder (ModelConfig) or a Hugging Face model (HFModelConfig)."""
    if not isinstance(mc, ModelConfig):
        from ulysses_cp import hf

        return hf.build_model(
            topo,
            hf_config=mc.hf_config,
            hf_weights=mc.hf_weights,
            dtype=hf.DTYPES[mc.dtype],
            tiled_mlp=mc.tiled_mlp,
            activation_checkpointing=mc.activation_checkpointing,
            offload_activations=mc.offload_activations,
        )

    def attn(q, k, v, cu_seqlens=None):  # the run's layout and backend: topo.options
        return ucp.attention(q, k, v, topo, causal=True, cu_seqlens=cu_seqlens)

    return Decoder(mc, attn)


def model_loss(engine, local: dict, topo, tiled_loss: int) -> torch.Tensor:
    """SP cross-entropy of this rank's shard; LM head + loss tiled when tiled_loss > 1."""
    return lm_loss(
        engine,
        engine.module.head,
        local["input_ids"],
        local["position_ids"],
        local["shift_labels"],
        topo,
        cu_seqlens=local.get("cu_seqlens"),
        tiled_loss=tiled_loss,
    )


def ignored_loss(engine, local: dict, topo, tiled_loss: int) -> torch.Tensor:
    """The loss of ``local`` with every label ignored (zero gradient), with the run's
    memory features: under ``tiled_loss`` the full logits are never materialised."""
    ignored = torch.full_like(local["shift_labels"], -100)
    return model_loss(engine, {**local, "shift_labels": ignored}, topo, tiled_loss)


def zero_loss(engine, topo, dc, tiled_loss: int):
    """A loss with zero gradient: one real batch, every label ignored."""
    full = global_batch(
        make_dataset(dc),
        step=0,
        micro_step=0,
        grad_accum=1,
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        dp_rank=topo.dp_rank,
        dp_degree=topo.dp_degree,
    )
    local = {k: t.to(engine.device) for k, t in shard_batch(full, topo).items()}
    return ignored_loss(engine, local, topo, tiled_loss)


class TrainingStopped(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SignalFlag:
    """SIGTERM/SIGINT set a flag; the ranks agree on it at the end of every step, save,
    and leave the loop. A second signal exits at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.raised, self.seen = enabled, False, False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def enabled_and_agreed(self, device) -> bool:
        """True on every rank once any rank has received a signal (one all-reduce)."""
        if self.enabled and any_rank(self.raised, device):
            self.seen = True
        return self.seen

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True
        log_all.warning(f"{signal.Signals(signum).name}: saving at the end of this step")


def train_loop(engine, topo, dataset, dc, tc, start, tracker, out, signals, tiled_loss):
    """Returns (logged losses, the step the loop ended at)."""
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = micro * gas * topo.dp_degree * dc.seq_len
    device = engine.device  # inputs and the loss accumulator live where the model does
    losses, acc, since, t0 = [], torch.zeros((), device=device), 0, time.perf_counter()
    skipped = 0
    ucp.comm_stats.reset()
    for step in range(start, tc.max_steps):
        n = step + 1  # the step being taken, as logged
        faults.point("kill", n)
        faults.point("hang", n)
        bad = None
        for m in range(gas):
            full = global_batch(
                dataset,
                step=step,
                micro_step=m,
                grad_accum=gas,
                micro_batch=micro,
                dp_rank=topo.dp_rank,
                dp_degree=topo.dp_degree,
            )
            local = {k: t.to(device) for k, t in shard_batch(full, topo).items()}
            loss = model_loss(engine, local, topo, tiled_loss)
            loss = faults.corrupt_loss(loss, n)
            if any_rank(not torch.isfinite(loss).item(), device):
                bad = bad or f"non-finite loss at step {n} (micro step {m})"
                handle_nonfinite(engine, tc, bad, out, step)
                # the micro batch contributes nothing: a no-target loss keeps DeepSpeed's
                # backward/step sequence (and its gradient reduction) in line
                loss = None  # frees the bad graph before the second forward
                loss = ignored_loss(engine, local, topo, tiled_loss)
            engine.backward(loss)
            boundary = m == gas - 1
            check = boundary and bad is None and tc.check_gradients
            if check and any_rank(not gradients_finite(engine), device):
                bad = f"non-finite gradients at step {n}"
                handle_nonfinite(engine, tc, bad, out, step)
            if boundary and bad is not None:
                skip_update(engine)
                skipped += 1
                log.warning(f"{bad}: update skipped ({skipped} so far)")
            else:
                engine.step()
                if bad is None:
                    acc += loss.detach().float() / gas
        done, since = n, since + (bad is None)
        if done % tc.log_interval == 0 or done == tc.max_steps:
            dist.all_reduce(acc, group=topo.dp_group)  # mean over data-parallel replicas
            # None when every step since the last log was skipped
            mean_loss = acc.item() / (topo.dp_degree * since) if since else None
            dt = time.perf_counter() - t0
            metrics = {
                "loss": mean_loss,
                "lr": engine.get_lr()[0],
                "tokens_per_s": tokens_per_step * max(since, 1) / dt,
                "peak_mem_mb": peak_memory_mb(),
                "comm_bytes_per_step": ucp.comm_stats.total() / max(since, 1),
                "skipped_steps": skipped,
            }
            tracker.log(done, metrics)
            shown = "skipped" if mean_loss is None else f"{mean_loss:.4f}"
            log.info(
                f"step {done:5d}  loss {shown}  lr {metrics['lr']:.2e}  "
                f"tok/s {metrics['tokens_per_s']:.0f}  peak {metrics['peak_mem_mb']:.0f}MB"
            )
            if mean_loss is not None:
                losses.append(mean_loss)
            acc.zero_()
            since = 0
            ucp.comm_stats.reset()
            t0 = time.perf_counter()
        if signals.enabled_and_agreed(device):
            checkpoint.save(engine, out, done, portable=tc.portable_checkpoint)
            log.info(f"stopped by signal after step {done}; saved {out / f'step{done}'}")
            return losses, done
        if tc.save_interval and done % tc.save_interval == 0 and done < tc.max_steps:
            checkpoint.save(engine, out, done, portable=tc.portable_checkpoint)
    return losses, tc.max_steps


def handle_nonfinite(engine, tc, what: str, out, step: int) -> None:
    """``stop``: save the state before this step's update, then stop (exit code 3)."""
    if tc.on_nonfinite == "stop":
        checkpoint.save(engine, out, step, portable=tc.portable_checkpoint)
        raise TrainingStopped(
            f"{what}; training.on_nonfinite is 'stop': saved {out / f'step{step}'} (the "
            f"state before this step) and stopped. Lower the learning rate or inspect the "
            f"data of this step, then --resume.",
            exit_code=3,
        )


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:
        # A user error (config, data, paths, degrees, layout...): raised identically on every
        # rank, before anything trains. One line from rank 0 and exit code 2, not a
        # traceback per rank.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
