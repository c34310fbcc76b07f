"""Long-sequence training under the deepspeed launcher.

    deepspeed --num_gpus N train.py --deepspeed_config configs/NAME.json \
        [--output_dir DIR] [--max_steps K] [--resume]

The JSON is a DeepSpeed config plus our blocks: "sequence_parallel" (degrees, layout,
attention backend), "model" (the reference decoder), "data" (task, seq_len, files) and
"training" (max_steps, log_interval, save_interval). See docs/training.md.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import ulysses_cp as ucp
from ulysses_cp.config import from_block
from ulysses_cp.data import DataConfig, global_batch, make_dataset, shard_batch
from ulysses_cp.log import get_logger
from ulysses_cp.model import Decoder, ModelConfig
from ulysses_cp.tracking import Tracker

log = get_logger("train")


@dataclass
class TrainingConfig:
    max_steps: int = 100
    log_interval: int = 10
    save_interval: int = 0  # 0: save at the end only
    seed: int = 0

    @classmethod
    def from_dict(cls, cfg: dict) -> TrainingConfig:
        return from_block(cls, cfg, "training")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ulysses_cp long-sequence training")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with our blocks")
    p.add_argument(
        "--output_dir", default=None, help="metrics and checkpoints (default runs/<config name>)"
    )
    p.add_argument("--max_steps", type=int, default=None, help="overrides training.max_steps")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return p.parse_args()


def validate(sp: ucp.SequenceParallelConfig, mc: ModelConfig, dc: DataConfig) -> None:
    """Everything that can be checked before any collective, identically on every rank."""
    ucp.validate_degrees(dist.get_world_size(), sp.ulysses_degree, sp.ring_degree)
    ucp.kv_replication(mc.n_heads, mc.n_kv_heads, sp.ulysses_degree)
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
    ucp.init_distributed()
    config = ucp.engine.load_config(args.deepspeed_config)
    original = ucp.engine.load_config(config)  # as written, for the wandb run's config
    mc = ModelConfig.from_dict(config.get("model", {}))
    dc = DataConfig.from_dict(config.get("data", {}))
    tc = TrainingConfig.from_dict(config.get("training", {}))
    if args.max_steps is not None:
        tc.max_steps = args.max_steps
    sp = ucp.SequenceParallelConfig.from_dict(config.get("sequence_parallel"))
    validate(sp, mc, dc)
    out = Path(args.output_dir or Path("runs") / Path(args.deepspeed_config).stem)
    topo = ucp.topology_from_config(config)

    def attn(q, k, v, cu_seqlens=None):
        return ucp.attention(
            q,
            k,
            v,
            topo,
            causal=True,
            layout=sp.layout,
            backend=sp.attention_backend,
            cu_seqlens=cu_seqlens,
        )

    torch.manual_seed(tc.seed)
    model = Decoder(mc, attn)
    optimizer = build_optimizer(config, model)
    engine = ucp.initialize(model=model, config=config, topo=topo, optimizer=optimizer)
    start = 0
    if args.resume:
        path, client = engine.load_checkpoint(str(out))
        if path is None:
            log.info(f"--resume: no checkpoint in {out}, starting at step 0")
        else:
            start = client["step"]
            log.info(f"resumed from {path} at step {start}")
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
        resume=args.resume,
    )
    log.info(
        f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{info}, seq_len {dc.seq_len}, steps {start}..{tc.max_steps}, output {out}"
    )
    losses = train_loop(engine, topo, sp.layout, make_dataset(dc), dc, tc, start, tracker, out)
    if tc.max_steps > start:
        engine.save_checkpoint(
            str(out), tag=f"step{tc.max_steps}", client_state={"step": tc.max_steps}
        )
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": tc.max_steps,
    }
    tracker.finish(summary)
    log.info(f"done: {summary}, metrics in {out / 'metrics.jsonl'}")
    dist.barrier()


def train_loop(engine, topo, layout, dataset, dc, tc, start, tracker, out) -> list[float]:
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = micro * gas * topo.dp_degree * dc.seq_len
    device = engine.device  # inputs and the loss accumulator live where the model does
    losses, acc, since, t0 = [], torch.zeros((), device=device), 0, time.perf_counter()
    ucp.comm_stats.reset()
    for step in range(start, tc.max_steps):
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
            local = {k: t.to(device) for k, t in shard_batch(full, topo, layout).items()}
            logits = engine(local["input_ids"], local["position_ids"], local.get("cu_seqlens"))
            loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
            engine.backward(loss)
            engine.step()
            acc += loss.detach().float() / gas
        done, since = step + 1, since + 1
        if done % tc.log_interval == 0 or done == tc.max_steps:
            dist.all_reduce(acc, group=topo.dp_group)  # mean over data-parallel replicas
            mean_loss = acc.item() / (topo.dp_degree * since)
            dt = time.perf_counter() - t0
            metrics = {
                "loss": mean_loss,
                "lr": engine.get_lr()[0],
                "tokens_per_s": tokens_per_step * since / dt,
                "peak_mem_mb": peak_memory_mb(),
                "comm_bytes_per_step": ucp.comm_stats.total() / since,
            }
            tracker.log(done, metrics)
            log.info(
                f"step {done:5d}  loss {mean_loss:.4f}  lr {metrics['lr']:.2e}  "
                f"tok/s {metrics['tokens_per_s']:.0f}  peak {metrics['peak_mem_mb']:.0f}MB"
            )
            losses.append(mean_loss)
            acc.zero_()
            since = 0
            ucp.comm_stats.reset()
            t0 = time.perf_counter()
        if tc.save_interval and done % tc.save_interval == 0 and done < tc.max_steps:
            engine.save_checkpoint(str(out), tag=f"step{done}", client_state={"step": done})
    return losses


if __name__ == "__main__":
    main()
