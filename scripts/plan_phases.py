"""The planner's step peak (``ulysses_cp.plan.phases``) against the live bytes of a bf16
training step on CPU (``scripts/profiling.py``'s ``LiveBytes``), per phase.

    python scripts/plan_phases.py            # ~1 min on 2 idle cores: docs/benchmarks/planner.md
    python scripts/plan_phases.py --quick    # two shapes
    python scripts/plan_phases.py --shapes 3 --no-plain --default-bucket 1  # the launcher test

``--default-bucket N`` adds the first N shapes again at DeepSpeed's own reduce bucket
(5e8 elements, 1 GB in bf16), in the same process; ``--no-plain`` leaves out the plain
step (tests/unit/test_plan_phases.py measures it in process).

Model: a Hugging Face Llama with Llama-3-8B's proportions scaled down (hidden 256, 8/2
heads, MLP 3.5x, vocabulary 31x the hidden size), bf16, one process, at the documented
defaults (tiles "auto", activation checkpointing, fused loss, lean norms). ``plain``:
the step as transformers' users run it (gradients set to None before, ``loss.backward()``),
its peak above the weights, gradients included: what the GPU comparison measures with
``torch.cuda.max_memory_allocated``. ``zero1``: the same step through DeepSpeed ZeRO-1
(bf16, one rank, no gradient accumulation), the peak of the second step above what was
allocated before it (the static bytes: parameters, master copy, moments). Shallow models
at long lengths peak in the loss, deep ones at short lengths at the end of the backward.
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
from profiling import LiveBytes

import ulysses_cp as ucp
from ulysses_cp.config import HFModelConfig
from ulysses_cp.models import hf
from ulysses_cp.plan.memory import activation_bytes, static_bytes
from ulysses_cp.plan.phases import deepspeed_peak, step_phases
from ulysses_cp.plan.shapes import model_shape

MiB = 2**20
# (layers, tokens, memory_budget_gb): the loss's phase, the end of the backward, tiles
# DeepSpeed's gradient bucket (elements; its default 5e8 is 1 GB in bf16, made in the backward)
REDUCE_BUCKET = 100_000
DEEPSPEED_BUCKET = 500_000_000
SHAPES = [(2, 4096, None), (2, 4096, 0.05), (16, 512, None), (16, 2048, 0.05), (8, 1024, None)]


def block(layers: int, budget: float | None) -> HFModelConfig:
    cfg = dict(
        model_type="llama",
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=896,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8016,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )
    return HFModelConfig(
        hf_config=cfg,
        dtype="bfloat16",
        tiled_mlp="auto",
        tiled_loss="auto",
        activation_checkpointing=True,
        fused_loss=True,
        lean_norms=True,
        memory_budget_gb=budget,
    )


def _model(mc: HFModelConfig, topo):
    hf.register_attention(topo, backend="torch")
    torch.manual_seed(0)
    model = hf.from_config(hf.load_config(dict(mc.hf_config)), dtype=torch.bfloat16)
    return hf.wrap(model, topo, mc).train()


def _step(model, topo, n: int, backward) -> None:
    ids = torch.randint(8016, (1, n), generator=torch.Generator().manual_seed(n))
    local = ucp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    loss = model.loss(
        local["input_ids"],
        local["position_ids"],
        local["shift_labels"],
        topo,
        batch=local["batch"],
        tiled_loss="auto",
        fused_loss=True,
    )
    backward(loss)


def measure_plain(layers: int, n: int, budget: float | None) -> int:
    """Peak live bytes of one plain step above the weights, gradients included."""
    topo = ucp.init_topology(1, 1)
    model = _model(block(layers, budget), topo)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        _step(model, topo, n, lambda loss: loss.backward())
    return live.peak


def measure_zero(
    stage: int, layers: int, n: int, budget: float | None, bucket: int = REDUCE_BUCKET
) -> int:
    """Peak live bytes of DeepSpeed's second step (forward, backward, optimizer step)
    above what was live before it, ZeRO ``stage``, torch's AdamW (one rank; needs
    ``torch.distributed`` started, world size 1)."""
    run = ucp.RunConfig.load(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
            "sequence_parallel": {"ulysses_degree": 1, "attention_backend": "torch"},
        }
    )
    topo = ucp.topology_from_config(run)
    model = _model(block(layers, budget), topo)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ucp.initialize(model=model, config=run, topo=topo, optimizer=opt)

    def backward(loss):
        engine.backward(loss)
        engine.step()

    _step(engine.module, topo, n, backward)
    with LiveBytes() as live:
        _step(engine.module, topo, n, backward)
    return live.peak


def predicted(layers: int, n: int, budget: float | None) -> dict:
    """The plain step's phases (``step_phases``: the model's own gradients)."""
    shape = model_shape(block(layers, budget))
    act = activation_bytes(shape, seq_len=n, batch=1, ulysses=1, ring=1)
    return step_phases(shape, act, tokens=n, grads=shape.params * shape.dtype_bytes)


def predicted_zero(
    stage: int, layers: int, n: int, budget: float | None, bucket: int = REDUCE_BUCKET
) -> int:
    """DeepSpeed's step above its persistent bytes (``deepspeed_peak``, torch's Adam)."""
    shape = model_shape(block(layers, budget))
    act = activation_bytes(shape, seq_len=n, batch=1, ulysses=1, ring=1)
    static = static_bytes(shape, zero_stage=stage, world=1, reduce_bucket_size=bucket)
    zero = {"stage": stage, "world": 1, "micro_steps": 1, "offload_optimizer": 0}
    zero["bucket"] = bucket * shape.dtype_bytes
    pred = deepspeed_peak(shape, act, static, zero=zero, tokens=n, optimizer_temp_bytes=8)
    return pred["peak"] - pred["persistent"]


def rows(shapes, zero1: bool, bucket: int = REDUCE_BUCKET, plain: bool = True) -> list[dict]:
    out = []
    for layers, n, budget in shapes:
        pred = predicted(layers, n, budget)
        row = {"layers": layers, "N": n, "budget_gb": budget, "phase": pred["phase"]}
        row |= {"predicted": pred["peak"], "bucket": bucket}
        if plain:
            row["plain"] = measure_plain(layers, n, budget)
        if zero1:
            for stage in (1, 2):
                row[f"zero{stage}"] = measure_zero(stage, layers, n, budget, bucket)
                row[f"zero{stage}_predicted"] = predicted_zero(stage, layers, n, budget, bucket)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes, no DeepSpeed")
    p.add_argument("--out", default="bench_results", help="folder for plan_phases.json")
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes")
    p.add_argument(
        "--bucket",
        type=int,
        default=REDUCE_BUCKET,
        help="DeepSpeed's reduce_bucket_size in elements (its own default: 500000000)",
    )
    p.add_argument(
        "--default-bucket",
        type=int,
        default=0,
        metavar="N",
        help=f"then the first N shapes at DeepSpeed's default bucket ({DEEPSPEED_BUCKET})",
    )
    p.add_argument("--no-plain", action="store_true", help="DeepSpeed's steps only")
    args = p.parse_args()
    zero1 = not args.quick
    if not zero1 and (args.no_plain or args.default_bucket):
        p.error("--no-plain and --default-bucket measure DeepSpeed's steps: drop --quick")
    if zero1:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        torch.distributed.init_process_group("gloo")
    plain = not args.no_plain
    table = rows(SHAPES[::2] if args.quick else SHAPES[: args.shapes], zero1, args.bucket, plain)
    if args.default_bucket:
        table += rows(SHAPES[: args.default_bucket], zero1, DEEPSPEED_BUCKET, plain)
    print(
        f"{'layers':>6} {'N':>6} {'budget':>6} {'bucket':>9} {'phase':>13} {'predicted':>9}"
        "  measured (MiB, pred/meas)"
    )
    for r in table:
        got = ""
        if "plain" in r:
            got = f"plain {r['plain'] / MiB:.1f} ({r['predicted'] / r['plain']:.3f})"
        for k in ("zero1", "zero2"):
            if k in r:
                got += f"  {k} {r[k] / MiB:.1f} ({r[k + '_predicted'] / r[k]:.3f})"
        print(
            f"{r['layers']:>6} {r['N']:>6} {r['budget_gb'] or '-':>6} {r['bucket']:>9}"
            f" {r['phase']:>13}"
            f" {r['predicted'] / MiB:>9.1f}  {got}"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "plan_phases.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
