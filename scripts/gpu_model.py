"""``scripts/gpu_check.py``'s ``model`` section: one Hugging Face Llama trained three ways on
one device, side by side (P = 1, the same weights, the same tokens).

- ``hf``: transformers as a user runs it: ``attn_implementation="sdpa"``, gradient
  checkpointing (non-reentrant), ``model(input_ids, labels=input_ids).loss``, backward.
- ``alst``: DeepSpeed's ALST pieces at their defaults
  (``deepspeed.runtime.sequence_parallel.ulysses_sp``): ``TiledMLP`` on every MLP
  (``ceil(seq / hidden)`` tiles, its docstring's rule), gradient checkpointing, and the LM
  head + loss through ``sequence_tiled_compute`` in tiles of 1 GiB of fp32 logits. When
  deepspeed does not import, its rows say ``skipped`` and why.
- ``ours``: ulysses_cp at its documented defaults, as a user wraps a transformers model
  (``models.hf.wrap`` of an ``HFModelConfig``): ``tiled_mlp``/``tiled_loss`` ``"auto"``,
  activation checkpointing, ``fused_loss``, lean norms, attention backend ``"auto"``, no
  ``memory_budget_gb``; beside it the planner's peak (``plan.phases.step_phases``: the
  step's largest moment, gradients included).

Two parts (``--model-parts``): ``shallow``, Llama-3-8B's layer sizes (hidden 4096, 32/8
heads, head dim 128, MLP 14336, vocabulary 128256) with 4 layers at 8K, 32K and 256K
tokens, and ``deep``, all 32 layers at 4K, 8K and 16K; bfloat16. ``--dry-run``: float32 on
the CPU, hidden 64, vocabulary 512, 2 and 3 layers, 256/512/1024 tokens.

Per variant and length, repeats interleaved (hf, alst, ours per round) after one warm-up
step each at the part's first length: the median step time, the model TFLOP/s
(``core.flops.model_flops``: no recompute counted) and their fraction of
``--peak-tflops``, the loss, and the peak: on a GPU ``max_memory_allocated`` during the
step minus what was allocated before it (the weights: the bf16 gradients are freed before
each step, so the peak includes them); on the CPU the live bytes of every tensor the step
makes (``profiling.LiveBytes``), in one more untimed step. An out-of-memory step is
recorded as ``oom`` and freed. Then per variant ``bytes_per_token`` (the peak's slope
between the first two lengths) and ``longest_n`` (the second length's peak extrapolated
along that slope to the device's total memory less the variant's own weights); ``check``
rows (the three losses at the first length agree, ``ok``), and ``goal`` rows (``met``
true/false: reported, never failing the run).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
import types

import torch
import torch.nn.functional as F
from benchlib import sync
from profiling import peak_memory

import ulysses_cp as ucp
from ulysses_cp.core.flops import model_flops

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
# part -> ((layers, lengths) on a GPU, (layers, lengths) in the dry run)
PARTS = {
    "shallow": ((4, (8192, 32768, 262144)), (2, (256, 512, 1024))),
    "deep": ((32, (4096, 8192, 16384)), (3, (256, 512, 1024))),
}
VARIANTS = ("hf", "alst", "ours")
# max |loss - hf's loss| / hf's loss at the first length
LOSS_TOL = {"bfloat16": 5e-3, "float32": 1e-4}
ALST_LOSS_TILE_BYTES = 2**30  # ALST's loss tiles: 1 GiB of fp32 logits each


def llama_config(dims: dict, layers: int) -> dict:
    return dict(
        model_type="llama",
        num_hidden_layers=layers,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        rope_theta=500000.0,
        **dims,
    )


def matmul_params(cfg: dict) -> int:
    """The Llama's ``nn.Linear`` weights: q, k, v, o, gate, up, down per layer, and the LM
    head (the input embedding is a lookup)."""
    d, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // hq
    layer = 2 * d * hq * hd + 2 * d * hkv * hd + 3 * d * cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * layer + cfg["vocab_size"] * d


def step_flops(cfg: dict, N: int) -> float:
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    return model_flops(
        matmul_params=matmul_params(cfg),
        attention_layers=cfg["num_hidden_layers"],
        hq=cfg["num_attention_heads"],
        head_dim=hd,
        seq_len=N,
    )


def _transformers_model(cfg: dict, device, dtype, attn: str):
    import transformers

    tcfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            tcfg, attn_implementation=attn, dtype=dtype
        )


class HF:
    def __init__(self, cfg, device, dtype, state=None):
        torch.manual_seed(0)
        self.model = _transformers_model(cfg, device, dtype, "sdpa")
        self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.train()

    def step(self, ids):
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss


def _alst_mlp_forward(self, x):
    """TiledMLP as its docstring patches ``LlamaMLP.forward`` (one process: no all-reduce
    of the tile count)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    tiles = math.ceil(x.shape[-2] / x.shape[-1])
    weights = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp, self, x, tiles, weights)


def _alst_loss(self, x, y):
    logits = self.lm_head(x).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


class Alst:
    def __init__(self, cfg, device, dtype, state):
        try:  # else the rows say skipped, and why
            import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401
        except Exception as exc:  # a broken install raises more than ImportError
            raise ImportError(f"deepspeed: {type(exc).__name__}: {exc}") from exc

        self.model = _transformers_model(cfg, device, dtype, "sdpa")
        self.model.load_state_dict(state)
        for layer in self.model.model.layers:
            layer.mlp.forward = types.MethodType(_alst_mlp_forward, layer.mlp)
        self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.train()

    def step(self, ids):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

        labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
        hidden = self.model.model(input_ids=ids, use_cache=False)[0]
        s, vocab = hidden.shape[1], self.model.config.vocab_size
        tiles = max(1, math.ceil(s * vocab * 4 / ALST_LOSS_TILE_BYTES))
        head = [self.model.lm_head.weight]
        kw = {"x": hidden, "y": labels}
        total = sequence_tiled_compute(
            _alst_loss, s, tiles, kw, {"self": self.model}, "x", head, 0, "sum"
        )
        loss = total / (labels != -100).sum()
        loss.backward()
        return loss


class Ours:
    def __init__(self, cfg, device, dtype, state):
        from ulysses_cp.config import HFModelConfig
        from ulysses_cp.models import hf
        from ulysses_cp.plan.shapes import model_shape

        self.topo = ucp.init_topology(1, 1)  # attention backend: the default, "auto"
        self.mc = HFModelConfig(
            hf_config=dict(cfg),
            dtype=str(dtype).removeprefix("torch."),
            activation_checkpointing=True,
            tiled_mlp="auto",
            tiled_loss="auto",
            fused_loss=True,
        )  # lean_norms: on by default
        hf.register_attention(self.topo)
        with torch.device(device):
            model = hf.from_config(hf.load_config(dict(cfg)), dtype=dtype)
        model.load_state_dict(state)
        self.model = hf.wrap(model, self.topo, self.mc).train()
        self.shape = model_shape(self.mc)

    def step(self, ids):
        local = ucp.shard_batch({"input_ids": ids, "labels": ids}, self.topo)
        loss = self.model.loss(
            local["input_ids"],
            local["position_ids"],
            local["shift_labels"],
            self.topo,
            batch=local["batch"],
            tiled_loss=self.mc.tiled_loss,
            fused_loss=self.mc.fused_loss,
        )
        loss.backward()
        return loss

    def predicted(self, N: int) -> int:
        """The planner's peak above the weights: the step's phases with the gradients
        (``plan.phases.step_phases``: the loss, the layers' backward, the end of it)."""
        from ulysses_cp.plan.memory import activation_bytes
        from ulysses_cp.plan.phases import step_phases

        act = activation_bytes(self.shape, seq_len=N, batch=1, ulysses=1, ring=1)
        grads = self.shape.params * self.shape.dtype_bytes
        return step_phases(self.shape, act, tokens=N, grads=grads)["peak"]


def repeats(N: int, dry: bool) -> int:
    """Timed steps per variant and length (interleaved): few, to fit about 4 minutes."""
    return 2 if dry else (3 if N <= 8192 else 2 if N <= 32768 else 1)


def one_step(v, ids, device, track: bool) -> tuple[float, float, int | None]:
    """(loss, seconds, peak bytes above what was allocated before or None)."""
    v.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    box = {}

    def run():
        box["loss"] = v.step(ids).item()

    sync(device)
    t0 = time.perf_counter()
    peak = peak_memory(run, device, scratch=False) if track else run()
    sec = time.perf_counter() - t0
    v.model.zero_grad(set_to_none=True)
    return box["loss"], sec, peak


def _free(v, device) -> None:
    v.model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(live: dict, N: int, vocab: int, device, dry: bool) -> dict[str, dict]:
    """Each live variant's result at ``N`` tokens: repeats interleaved, then (CPU) one
    tracked step for the peak. A variant that ran out of memory leaves ``live``."""
    g = torch.Generator().manual_seed(N)
    ids = torch.randint(vocab, (1, N), generator=g).to(device)
    out: dict[str, dict] = {name: {"times": [], "peak": 0} for name in live}
    on_gpu = device.type == "cuda"
    for rep in range(repeats(N, dry) + (0 if on_gpu else 1)):
        timed = on_gpu or rep < repeats(N, dry)
        for name, v in list(live.items()):
            oom = None
            try:
                loss, sec, peak = one_step(v, ids, device, track=on_gpu or not timed)
            except torch.OutOfMemoryError as exc:
                oom = str(exc).splitlines()[0][:200]
            if oom is not None:
                out[name] = {"oom": oom}
                del live[name]
                _free(v, device)
                continue
            out[name]["loss"] = loss
            out[name]["peak"] = max(out[name]["peak"], peak or 0)
            if timed:
                out[name]["times"].append(sec)
    return out


def part_rows(part: str, device, dry: bool, peak_tflops: float) -> list[dict]:
    layers, lengths = PARTS[part][1 if dry else 0]
    cfg = llama_config(TINY if dry else LLAMA3_8B, layers)
    dtype = torch.float32 if dry else torch.bfloat16
    head = dict(kind="step", part=part, layers=layers)
    live: dict = {}
    rows: list[dict] = []
    for name, cls in zip(VARIANTS, (HF, Alst, Ours)):
        state = live["hf"].model.state_dict() if live else None
        try:
            live[name] = cls(cfg, device, dtype, state)
        except ImportError as exc:  # deepspeed (alst) or transformers missing
            reason = f"does not import: {type(exc).__name__}: {exc}"
            rows += [dict(head, variant=name, N=N, skipped=reason) for N in lengths]
    weights = {
        name: sum(p.numel() * p.element_size() for p in v.model.parameters())
        for name, v in live.items()
    }
    built = dict(live)
    warm = torch.randint(cfg["vocab_size"], (1, lengths[0])).to(device)
    for v in built.values():  # warm-up (ours: its start-up probe runs here)
        one_step(v, warm, device, False)
    for N in lengths:
        results = measure(live, N, cfg["vocab_size"], device, dry)
        flops = step_flops(cfg, N)
        for name, r in results.items():
            row = dict(head, variant=name, N=N)
            if "oom" in r:
                rows.append(dict(row, oom=r["oom"]))
                continue
            sec = statistics.median(r["times"])
            row.update(step_s=sec, loss=r["loss"], peak_bytes=r["peak"], model_flops=flops)
            row.update(tflops=flops / sec / 1e12, fraction_of_peak=flops / sec / 1e12 / peak_tflops)
            if name == "ours":
                row["planner_bytes"] = built["ours"].predicted(N)
                row["predicted_over_measured"] = row["planner_bytes"] / max(r["peak"], 1)
            rows.append(row)
    total = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    rows += memory_rows(rows, weights, total)
    if "ours" in built:
        built["ours"].topo.destroy()
    live.clear()
    built.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    add_ratios(rows)
    rows += loss_checks(rows, LOSS_TOL["float32" if dry else "bfloat16"])
    return rows


def _by(rows: list[dict], kind: str) -> dict[tuple, dict]:
    """Rows of ``kind`` keyed by (part, variant, N) (memory rows: N None)."""
    return {(r["part"], r["variant"], r.get("N")): r for r in rows if r.get("kind") == kind}


def memory_rows(rows: list[dict], weights: dict[str, int], total: int) -> list[dict]:
    """Per variant: the peak's slope between the first two lengths and the longest length
    that slope reaches on ``total`` bytes less the variant's weights."""
    out = []
    steps = _by(rows, "step")
    for part, name in dict.fromkeys((p, v) for p, v, _ in steps):
        got = sorted(
            (N, r["peak_bytes"])
            for (p, v, N), r in steps.items()
            if (p, v) == (part, name)
            if "peak_bytes" in r
        )
        row = dict(kind="memory", part=part, variant=name)
        if len(got) < 2 or got[1][1] <= got[0][1]:
            out.append(dict(row, bytes_per_token=None, longest_n=None))
            continue
        (n0, p0), (n1, p1) = got[:2]
        slope = (p1 - p0) / (n1 - n0)
        room = total - weights[name] - p1
        out.append(dict(row, bytes_per_token=slope, longest_n=int(n1 + room / slope)))
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def add_ratios(rows: list[dict]) -> None:
    """ours over alst and over hf: step time (step rows), bytes per token (memory rows)."""
    steps, mem = _by(rows, "step"), _by(rows, "memory")
    for (part, name, N), r in steps.items():
        if name == "ours" and "step_s" in r:
            for other in ("alst", "hf"):
                o = steps.get((part, other, N), {})
                r[f"ours_over_{other}_s"] = _ratio(r["step_s"], o.get("step_s"))
    for (part, name, _), r in mem.items():
        if name == "ours":
            alst = mem.get((part, "alst", None), {})
            r["ours_over_alst_bytes_per_token"] = _ratio(
                r["bytes_per_token"], alst.get("bytes_per_token")
            )


def loss_checks(rows: list[dict], tol: float) -> list[dict]:
    """Per part, at its first length: the largest |loss - hf's| / |hf's| of the others."""
    out = []
    steps = _by(rows, "step")
    for part in dict.fromkeys(p for p, _, _ in steps):
        N = min(n for p, _, n in steps if p == part)
        losses = {
            v: r["loss"] for (p, v, n), r in steps.items() if (p, n) == (part, N) if "loss" in r
        }
        row = dict(kind="check", part=part, N=N, check="losses agree", losses=losses, tol=tol)
        if "hf" not in losses or len(losses) < 2:
            out.append(dict(row, max_rel_diff=None, ok=False))
            continue
        diff = max(abs(x - losses["hf"]) / abs(losses["hf"]) for x in losses.values())
        out.append(dict(row, max_rel_diff=diff, ok=math.isfinite(diff) and diff <= tol))
    return out


def goals(rows: list[dict]) -> list[dict]:
    """The speed and memory goals (``met``: true/false, None where a side has no number)."""
    steps, mem = _by(rows, "step"), _by(rows, "memory")
    out = []

    def goal(part, N, what, value, target, lower=True):
        met = None if value is None else (value <= target if lower else value >= target)
        out.append(dict(kind="goal", part=part, N=N, goal=what, value=value, met=met))

    for (part, name, N), r in steps.items():
        if name != "ours":
            continue
        goal(part, N, "ours' step <= 1.0x ALST's", r.get("ours_over_alst_s"), 1.0)
        alst, hf = steps.get((part, "alst", N), {}), steps.get((part, "hf", N), {})
        if part == "deep":
            value = _ratio(r.get("peak_bytes"), alst.get("peak_bytes"))
            goal(part, N, "ours' peak <= ALST's", value, 1.0)
        elif N in sorted(n for p, v, n in steps if (p, v) == (part, "ours"))[:2]:
            value = _ratio(r.get("tflops"), hf.get("tflops"))
            goal(part, N, "ours' model TFLOP/s >= 0.9x transformers'", value, 0.9, lower=False)
    for (part, name, _), r in mem.items():
        if name == "ours" and part == "shallow":
            value = r.get("ours_over_alst_bytes_per_token")
            goal(part, None, "ours' bytes per token <= 0.5x ALST's", value, 0.5)
    return out


def model_rows(device, dry: bool, peak_tflops: float, parts=tuple(PARTS)) -> list[dict]:
    """The section: every part's rows, then the goals."""
    rows: list[dict] = []
    for part in parts:
        rows += part_rows(part, device, dry, peak_tflops)
    return rows + goals(rows)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    """A compact summary of the section's rows."""
    lines = []
    for r in rows:
        kind, where = r.get("kind"), f"{r.get('part', '')}:{r.get('variant', '')}"
        if kind == "step" and "step_s" in r:
            extra = ""
            if r["variant"] == "ours":
                extra = (
                    f" x{_fmt(r['ours_over_alst_s'], '.2f')} ALST"
                    f" x{_fmt(r['ours_over_hf_s'], '.2f')} hf"
                    f", planner {r['planner_bytes'] / 2**30:.2f} GiB"
                )
            lines.append(
                f"model {where:14} N={r['N']:7} {r['step_s']:8.3f} s {r['tflops']:7.1f} TFLOP/s "
                f"({r['fraction_of_peak']:.0%}) peak {r['peak_bytes'] / 2**30:7.2f} GiB "
                f"loss {r['loss']:.5f}{extra}"
            )
        elif kind == "step":
            lines.append(
                f"model {where:14} N={r['N']:7} {'oom' if 'oom' in r else r.get('skipped')}"
            )
        elif kind == "memory":
            bpt, n = r["bytes_per_token"], r["longest_n"]
            lines.append(f"model {where:14} {_fmt(bpt, '.0f')} B/token, longest ~{_fmt(n, 'd')}")
        elif kind == "check":
            lines.append(
                f"model {r['part']}: losses at N={r['N']} within "
                f"{_fmt(r['max_rel_diff'], '.1e')} ok={r['ok']}"
            )
        elif kind == "goal":
            lines.append(
                f"goal  {r['part']} N={r['N']}: {r['goal']}: "
                f"{_fmt(r['value'], '.2f')} met={r['met']}"
            )
    return lines
