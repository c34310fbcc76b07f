"""ulysses_cp against DeepSpeed's ALST (``deepspeed.runtime.sequence_parallel.ulysses_sp``)
on a Hugging Face Llama, side by side in one run, as a user of each would run it.

Model: Llama, hidden 256, 4 layers, 8 heads, 2 kv heads, MLP 1024, vocabulary 32000,
float32, random weights (seed 0), the same weights for every variant. P ranks (default 4)
of Ulysses on this machine's CPU (gloo). Variants:

- ``alst``: ``UlyssesSPAttentionHF.register_with_transformers`` over ``sdpa``, contiguous
  shards of the full-sequence ``shift_labels``, the tutorial's loss (per-rank mean, then a
  differentiable all-gather and the token-weighted mean).
- ``alst_mem``: plus ALST's memory features as its tutorial and ArcticTraining use them:
  ``TiledMLP`` on every MLP (``ceil(s_local / hidden)`` shards), the model's activation
  checkpointing (``gradient_checkpointing_enable``, non-reentrant), and the LM head + loss
  through ``sequence_tiled_compute`` (recomputed in backward: ALST's exact loss).
- ``alst_defaults``: ``alst_mem`` with ALST's own loss-tile rule (1 GiB of fp32 logits
  per tile, one tile at every length here): ALST at its defaults.
- ``alst_fused``: ``alst_mem`` with ``TiledFusedLogitsLoss`` (loss gradients in the forward).
- ``ours``: ``HFCausalLM`` with ulysses_cp attention and ``sequence_parallel_cross_entropy``.
- ``ours_mem``: ``tiled_mlp`` and ``tiled_loss`` with the SAME tile counts as ALST's, layer
  activation checkpointing, and ``fused_loss`` (``ulysses_cp/models/fused_loss.py``):
  ours tuned by hand.
- ``ours_tiled``: ``ours_mem`` without ``fused_loss`` (the tiled loss, recomputed).
- ``ours_plain_norms``: ``ours_mem`` with ``lean_norms`` off (transformers' own RMSNorm).
- ``ours_defaults``: the documented defaults, nothing set by hand: ``tiled_mlp: "auto"``,
  ``tiled_loss: "auto"``, activation checkpointing, ``fused_loss``, lean norms, no
  ``memory_budget_gb`` (on a CPU the tiles then take the caps for a large GPU).
- ``ours_budget``: ``ours_defaults`` with ``memory_budget_gb`` = ``--budget-mb`` (the
  tiles sized from the run's budget).

Every row prints its setting (``SETTINGS``). Loss tiles of ``alst_mem`` and the tuned
variants: ``--loss-tile-mb`` (default 8 MiB) of fp32 logits per tile, the same rule for
both sides.

Measured: correctness at ``--check-len`` (loss and every gradient against one process:
the same model with ``sdpa`` on the full sequence, float32; ours: the gradients summed
over the ranks, DeepSpeed's reduction; ALST: summed and divided by P, the average that
its ZeRO-3 reduction takes, since its loss gives each rank P times its share); the step
time at each ``--time-len`` (forward, loss, backward; median of interleaved repeats, the
slowest rank); the
per-rank peak (``scripts/profiling.py``, ``scratch=False``: every tensor the step
creates, gradients included, weights not), the activation slope (peak growth per 1K
tokens between two lengths) and the longest length whose per-rank peak stays within
``--budget-mb`` (``longest_fitting``: multiples of 2P*64).

    python scripts/benchmark_hf.py --quick     # ~2 min on 2 cores
    python scripts/benchmark_hf.py             # the docs/benchmarks/alst.md table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import barrier, gather_floats, max_over_ranks, parse_args, run_ranks, sync
from profiling import longest_fitting, peak_memory

import ulysses_cp as ucp

CONFIG = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1 << 18,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)
SETTINGS = {  # each variant and the setting it stands for (printed and in the JSON)
    "alst": "ALST, attention only (no memory feature)",
    "alst_defaults": "ALST at its defaults (its 1 GiB loss tiles)",
    "alst_mem": "ALST tuned as its tutorial (--loss-tile-mb)",
    "alst_fused": "ALST tuned, TiledFusedLogitsLoss",
    "ours": "ours, no memory feature",
    "ours_defaults": "ours at the documented defaults, no budget",
    "ours_budget": "ours at the documented defaults + budget",
    "ours_mem": "ours tuned by hand (ALST's tile counts)",
    "ours_tiled": "ours tuned, tiled loss not fused",
    "ours_plain_norms": "ours tuned, transformers' norms",
}
VARIANTS = tuple(SETTINGS)
# the variants whose longest length is searched
MEMORY = ("alst_defaults", "alst_mem", "ours_defaults", "ours_budget", "ours_mem")
ALST_LOSS_TILE_MB = 1024.0  # ALST's own rule: 1 GiB of fp32 logits per loss tile


def tiles(s_local: int, args, loss_tile_mb: float | None = None) -> tuple[int, int]:
    """(MLP tiles, loss tiles) at ``s_local`` tokens per rank, for both sides: ALST's MLP
    rule (``ceil(s_local / hidden)``) and ``--loss-tile-mb`` (or ``loss_tile_mb``) of fp32
    logits per tile."""
    mlp = math.ceil(s_local / CONFIG["hidden_size"])
    tile_mb = args.loss_tile_mb if loss_tile_mb is None else loss_tile_mb
    loss = math.ceil(s_local * CONFIG["vocab_size"] * 4 / (tile_mb * 2**20))
    return max(1, mlp), max(1, loss)


def batch_of(N: int, device) -> dict:
    g = torch.Generator().manual_seed(N)
    ids = torch.randint(CONFIG["vocab_size"], (1, N), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


# ---------------------------------------------------------------- ALST, as its tutorial


def alst_tiled_mlp_forward(self, x):
    """ALST's ``TiledMLP`` docstring recipe for ``LlamaMLP.forward`` (per instance)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]), device=x.device)
    torch.distributed.all_reduce(shards, op=torch.distributed.ReduceOp.MAX)
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp_forward, self, x, int(shards.item()), params)


class Alst:
    """One ALST variant: the model and its loss, as ALST's tutorial writes them."""

    def __init__(self, name, state, mpu, args, device):
        import transformers

        self.name, self.args, self.mpu = name, args, mpu
        cfg = transformers.AutoConfig.for_model(**CONFIG)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        model.load_state_dict(state)
        if name != "alst":
            for layer in model.model.layers:
                layer.mlp.forward = types.MethodType(alst_tiled_mlp_forward, layer.mlp)
            model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model = model.to(device).train()
        self.group = mpu.get_sequence_parallel_group()
        self.P, self.rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()

    def loss(self, full: dict) -> torch.Tensor:
        N = full["input_ids"].shape[1]
        s = N // self.P
        part = slice(self.rank * s, (self.rank + 1) * s)
        shift = F.pad(full["labels"], (0, 1), value=-100)[:, 1:]  # shifted on the full row
        ids, labels = full["input_ids"][:, part], shift[:, part]
        pos = torch.arange(N, device=ids.device)[None, part]
        model = self.model
        if self.name == "alst":
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        else:
            hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False)[0]
            loss_sum = self.tiled_loss(hidden, labels)
        good = (labels != -100).sum()
        loss = loss_sum / good.clamp(min=1)
        # the tutorial: every rank's loss and token count, then the weighted mean
        losses = torch.distributed.nn.functional.all_gather(loss, group=self.group)
        goods = [torch.zeros_like(good) for _ in range(self.P)]
        torch.distributed.all_gather(goods, good, group=self.group)
        total = sum(losses[r] * goods[r] for r in range(self.P))
        return total / sum(goods)

    def tiled_loss(self, hidden, labels):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import (
            TiledFusedLogitsLoss,
            sequence_tiled_compute,
        )

        lm_head = self.model.lm_head
        own = ALST_LOSS_TILE_MB if self.name == "alst_defaults" else None
        shards = tiles(hidden.shape[1], self.args, own)[1]

        def loss_fn(self, x, y):
            logits = self.lm_head(x).float()
            return F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )

        if self.name == "alst_fused":
            return TiledFusedLogitsLoss.apply(
                loss_fn, self.model, hidden, labels, None, shards, [lm_head.weight], "sum"
            )
        return sequence_tiled_compute(
            loss_fn,
            hidden.shape[1],
            shards,
            {"x": hidden, "y": labels},
            {"self": self.model},
            "x",
            [lm_head.weight],
            0,
            "sum",
        )

    def grads(self) -> dict:
        """Each parameter's gradient as ALST's ZeRO-3 reduction leaves it (sum / P)."""
        return _reduced(self.model, self.group, 1 / self.P)


# ---------------------------------------------------------------- ulysses_cp


class Ours:
    def __init__(self, name, state, topo, args, device):
        from ulysses_cp.config import HFModelConfig
        from ulysses_cp.models import hf

        self.name, self.topo, self.args = name, topo, args
        mem = name != "ours"
        hf.register_attention(topo, backend="torch")
        model = hf.from_config(hf.load_config(dict(CONFIG)))
        model.load_state_dict(state)
        # the documented defaults: "auto" tiles, from memory_budget_gb when one is given
        self.auto = name in ("ours_defaults", "ours_budget")
        mc = HFModelConfig(
            hf_config=dict(CONFIG),
            tiled_mlp="auto" if self.auto else 2 if mem else 0,
            activation_checkpointing=mem,
            lean_norms=name != "ours_plain_norms",
            memory_budget_gb=args.budget_mb / 1024 if name == "ours_budget" else None,
        )
        self.model = hf.wrap(model, topo, mc).to(device).train()
        self.model.probe()
        self.mem, self.fused = mem, name not in ("ours", "ours_tiled")

    def loss(self, full: dict) -> torch.Tensor:
        from ulysses_cp.models.memory import TiledMLP

        local = ucp.shard_batch(full, self.topo)
        n_mlp, n_loss = tiles(local["input_ids"].shape[1], self.args)
        if not self.auto:
            for m in self.model.modules():
                if isinstance(m, TiledMLP):
                    m.chunks = n_mlp  # ALST's count at this length
        return self.model.loss(
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            self.topo,
            batch=local["batch"],
            tiled_loss="auto" if self.auto else n_loss if self.mem else 0,
            fused_loss=self.fused,
        )

    def grads(self) -> dict:
        return _reduced(self.model.model, self.topo.sp_group, 1.0)


def _reduced(model, group, factor: float) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        torch.distributed.all_reduce(g, group=group)
        name = name.removeprefix("model.model.").removeprefix("model.")
        out[name.replace(".mlp.mlp.", ".mlp.")] = g * factor  # our TiledMLP's inner MLP
    return out


# ---------------------------------------------------------------- measuring


def reference(state, N: int, device):
    """Loss and gradients of the same model on the whole sequence in one process."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**CONFIG), attn_implementation="sdpa"
    )
    model.load_state_dict(state)
    model.to(device)
    full = batch_of(N, device)
    logits = model(input_ids=full["input_ids"], use_cache=False).logits.float()
    loss = F.cross_entropy(logits[0, :-1], full["input_ids"][0, 1:])
    loss.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads


def check(variant, ref_loss, ref_grads, N, device) -> dict:
    variant.model.zero_grad(set_to_none=True)
    loss = variant.loss(batch_of(N, device))
    loss.backward()
    grads = variant.grads()
    variant.model.zero_grad(set_to_none=True)
    errs = {
        name: ((grads[name] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
        for name, g in ref_grads.items()
    }
    head, ref_head = grads["lm_head.weight"], ref_grads["lm_head.weight"]
    return {
        "loss_rel_err": abs(loss.item() - ref_loss) / abs(ref_loss),
        "grad_rel_err": max(errs.values()),
        "lm_head_rel_err": errs["lm_head.weight"],
        "lm_head_ratio": (head.norm() / ref_head.norm()).item(),
    }


def step_fn(variant, N: int, device):
    full = batch_of(N, device)

    def step():
        variant.loss(full).backward()
        variant.model.zero_grad(set_to_none=True)

    return step


def peak_at(variant, N: int, device) -> float:
    return max_over_ranks(peak_memory(step_fn(variant, N, device), device, scratch=False), device)


def worker(rank, world, args, device):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    ucp.init_distributed()  # DeepSpeed imported quietly on CPU; torch.distributed is up
    deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl")
    torch.manual_seed(0)
    import transformers

    seed_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**CONFIG)
    )
    state = seed_model.state_dict()
    ref_loss, ref_grads = reference(state, args.check_len, device)  # before ALST's patch
    topo = ucp.init_topology(world, 1, backend="torch")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=seed_model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=world,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    del seed_model
    variants = {}
    for name in args.variants:
        cls = Alst if name.startswith("alst") else Ours
        variants[name] = cls(name, state, mpu if cls is Alst else topo, args, device)
    rows = {name: {"variant": name} for name in variants}
    for name, v in variants.items():
        rows[name].update(check(v, ref_loss, ref_grads, args.check_len, device))
        if rank == 0:
            r = rows[name]
            print(
                f"{name:<11} loss err {r['loss_rel_err']:.1e} grad err {r['grad_rel_err']:.1e} "
                f"lm_head x {r['lm_head_ratio']:.3f}",
                flush=True,
            )
    for N in args.time_len:  # each length: the variants' steps interleaved
        steps = {name: step_fn(v, N, device) for name, v in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.repeats + 1):
            for name, step in steps.items():
                barrier(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                dt = max_over_ranks(time.perf_counter() - t0, device)
                if rep:
                    times[name].append(dt)
        for name in variants:
            rows[name].setdefault("step_s_at", {})[str(N)] = statistics.median(times[name])
    unit = 2 * world * 64
    for name, v in variants.items():
        row = rows[name]
        row["setting"] = SETTINGS[name]
        row["time_len"] = args.time_len[0]
        row["step_s"] = row["step_s_at"][str(args.time_len[0])]
        a, b = args.slope_lens
        pa, pb = peak_at(v, a, device), peak_at(v, b, device)
        row["peak_mib_at"] = {str(a): pa / 2**20, str(b): pb / 2**20}
        row["peak_mib"] = pb / 2**20  # at the longer length
        row["slope_mib_per_1k"] = (pb - pa) / (b - a) * 1024 / 2**20
        if name in MEMORY or args.search_all:
            row["max_len"] = longest_fitting(
                lambda n, v=v: peak_at(v, n, device), unit, args.budget_mb * 2**20
            )
        if rank == 0:
            print(f"{name:<11} done", flush=True)
    gather_floats([0], device)  # every rank is done before rank 0 returns
    return list(rows.values())


def ratios(rows: list[dict]) -> None:
    """Each ours row against its ALST counterpart (the exact one for the memory rows;
    ``ours_plain_norms`` against ``ours_mem``, the lean norms' effect)."""
    by = {r["variant"]: r for r in rows}
    peer = {
        "ours": "alst",
        "ours_mem": "alst_mem",
        "ours_budget": "alst_mem",
        "ours_defaults": "alst_mem",
        "alst_defaults": "alst_mem",
        "ours_tiled": "alst_mem",
        "ours_plain_norms": "ours_mem",
        "alst_fused": "alst_mem",
    }
    for r in rows:
        p = by.get(peer.get(r["variant"], ""))
        if p is None:
            continue
        r["peer"] = p["variant"]
        r["time_x_peer"] = r["step_s"] / p["step_s"]
        r["time_x_peer_at"] = {n: t / p["step_s_at"][n] for n, t in r["step_s_at"].items()}
        r["peak_x_peer"] = r["peak_mib"] / p["peak_mib"]
        if "max_len" in r and p.get("max_len"):
            r["max_len_x_peer"] = r["max_len"] / p["max_len"]


def table(rows: list[dict]) -> str:
    """The rows as printed: each with its setting, the step time at every timed length and
    its ratio to the peer (``x``), the peak, the slope and the longest length."""
    lens = list(rows[0]["step_s_at"])
    head = f"{'variant':<17}{'setting':<46}{'loss err':>9}{'grad err':>9}{'lm_head x':>10}"
    head += "".join(f"{'s @' + n:>10}{'x':>6}" for n in lens)
    head += f"{'peak MiB':>10}{'MiB/1K':>8}{'max N':>8}{'x':>6}"
    lines = [head]
    for r in rows:
        line = f"{r['variant']:<17}{r['setting']:<46}{r['loss_rel_err']:>9.1e}"
        line += f"{r['grad_rel_err']:>9.1e}{r['lm_head_ratio']:>10.3f}"
        for n in lens:
            x = r.get("time_x_peer_at", {}).get(n)
            line += f"{r['step_s_at'][n]:>10.3f}" + (f"{x:>6.2f}" if x else f"{'-':>6}")
        x = r.get("max_len_x_peer")
        line += f"{r['peak_mib']:>10.1f}{r['slope_mib_per_1k']:>8.2f}{r.get('max_len', '-'):>8}"
        lines.append(line + (f"{x:>6.2f}" if x else f"{'-':>6}"))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, 15+ min here)")
    p.add_argument("--world", type=int, default=4, help="ranks (Ulysses degree)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--check-len", type=int, default=1024, help="length of the correctness check")
    p.add_argument(
        "--time-len", type=int, nargs="+", default=[8192], help="lengths of the timed steps"
    )
    p.add_argument("--slope-lens", type=int, nargs=2, default=[4096, 8192])
    p.add_argument("--budget-mb", type=float, default=192.0, help="per-rank memory cap")
    p.add_argument("--loss-tile-mb", type=float, default=8.0, help="fp32 logits per loss tile")
    p.add_argument("--search-all", action="store_true", help="longest length of every variant")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = parse_args(  # --quick: these as defaults
        p,
        check_len=256,
        time_len=[512],
        slope_lens=[512, 1024],
        budget_mb=96.0,
        repeats=1,
        loss_tile_mb=4.0,
    )
    rows = run_ranks(worker, args.world, args)
    ratios(rows)
    print(f"\nP = {args.world} (Ulysses), CPU; per-rank budget {args.budget_mb} MiB")
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark_hf.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"json: {out / 'benchmark_hf.json'}")


if __name__ == "__main__":
    main()
