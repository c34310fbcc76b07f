"""DPO and GRPO memory at length: ulysses_cp's ``SequenceParallelDPOTrainer`` (or
``SequenceParallelGRPOTrainer``, ``--objective grpo``) on P ranks (Ulysses P, ZeRO-2,
torchrun, gloo, CPU) against plain TRL ``DPOTrainer`` (``GRPOTrainer``) in one process,
side by side.

Variants: ``reference`` (plain ``DPOTrainer``, transformers' sdpa attention: on CPU with
TRL's padding mask that is the math kernel, which keeps ``s x s`` scores), ``ours_1`` (our
trainer on one rank, a 1 x 1 topology: no split, but our attention kernel and tiled head)
and ``ours`` (P ranks): ``ours`` against ``ours_1`` is what splitting the sequence saves,
against ``reference`` what a user switching trainers sees.

The run: a Llama (hidden 128, 2 layers, 4 heads, 2 kv heads, MLP 256, vocabulary 256,
float32, seed-0 weights saved once), one preference pair per step (a prompt of a quarter
of ``--length`` tokens, chosen and rejected completions of the rest: two rows of
``--length`` tokens), the reference model built by TRL from the policy's path, SGD, 2
steps. Measured per run: the per-rank peak of the second step's ``training_step``
(``scripts/profiling.py`` ``LiveBytes``: every tensor the policy's and the reference's
forwards and the backward create, gradients included, weights not), and the two training
losses (their largest relative difference from the reference's says the runs are the same
computation).

``--objective grpo``: one GRPO update a step, one prompt of a quarter of ``--length``
tokens and 8 completions of the rest (8 rows of ``--length`` tokens; a deterministic
``rollout_func`` stands in for sampling, so every variant trains on the same rows), the
reference model built by TRL (``beta=0.1``), ``num_iterations=1``; the peak covers the
step's scoring (the reference's log-probs) and its update.

Two measurements:

1. the per-rank peak at ``--length`` (default 2048 tokens a row: 4096 a pair);
2. the longest row under ``--budget-mib`` per rank, for each variant: lengths doubled from
   ``--start`` until the peak passes the budget, then halved steps down to ``--step``.

    python scripts/benchmark_dpo.py --quick --out bench_results   # a few minutes
    python scripts/benchmark_dpo.py --out bench_results
    python scripts/benchmark_dpo.py --objective grpo --length 1024 --budget-mib 128 \
        --out bench_results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import free_port  # noqa: E402
from benchmark_hf_trainer import MODEL, launch, measured  # noqa: E402

# ours_1: the same trainer on one rank (a 1 x 1 topology): what the kernels and the tiled
# head save without splitting the sequence, beside what P ranks save
VARIANTS = ("reference", "ours_1", "ours")


def pair_rows(n: int, length: int, seed: int) -> list[dict]:
    """``n`` pairs of words ``t0`` .. ``t255`` (one token each): rows of ``length`` tokens
    with the end-of-text token TRL adds."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt, answer = length // 4, length - length // 4 - 1

    def text(k: int) -> str:
        return " ".join(
            f"t{int(i)}" for i in torch.randint(3, MODEL["vocab_size"], (k,), generator=g)
        )

    return [
        {"prompt": text(prompt), "chosen": text(answer), "rejected": text(answer)} for _ in range(n)
    ]


GENERATIONS = 8  # completions a prompt in the GRPO runs


def prompt_rows(n: int, length: int, seed: int) -> list[dict]:
    """``n`` prompts of a quarter of ``length`` words (GRPO)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MODEL["vocab_size"], (n, length // 4), generator=g)
    return [{"prompt": " ".join(f"t{int(i)}" for i in row)} for row in ids]


def fixed_rollout(length: int):
    """A ``rollout_func``: each prompt's completion fills its row to ``length`` tokens,
    drawn from a generator seeded by the row's place (the same in every variant)."""

    def rollout_func(prompts: list, trainer) -> dict:
        import torch

        tok = trainer.processing_class
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = []
        for i, ids in enumerate(prompt_ids):
            g = torch.Generator().manual_seed(trainer.state.global_step * 1009 + i)
            completions.append(
                torch.randint(3, MODEL["vocab_size"], (length - len(ids),), generator=g).tolist()
            )
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    return rollout_func


def distinct_words(completions: list[str], **kwargs) -> list[float]:
    """The GRPO runs' reward (it varies inside a group, so the advantages are not 0)."""
    return [float(len(set(c.split()))) for c in completions]


def save_assets(folder: Path) -> None:
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder / "model")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"t{i}": i for i in range(3, MODEL["vocab_size"])})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(folder / "tokenizer")


def worker(spec: dict) -> None:
    import torch

    variant, P = spec["variant"], spec["world"]
    ours = variant.startswith("ours")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    if variant != "reference":
        import ulysses_cp as ucp

        ucp.init_distributed()
    import datasets
    import transformers

    ds = None
    if ours:
        ds = {
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "sequence_parallel": {
                "ulysses_degree": P,
                "ring_degree": 1,
                "attention_backend": "torch",
            },
        }
    steps, grpo = 2, spec.get("objective") == "grpo"
    common = dict(
        output_dir=spec["out"],
        per_device_train_batch_size=GENERATIONS if grpo else 1,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        bf16=False,
        deepspeed=ds,
        disable_tqdm=True,
        beta=0.1,
    )
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(spec["tokenizer"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    record: dict = {"micro": 0, "memory_micro": steps, "step_s": {}}
    if grpo:
        from trl import GRPOConfig, GRPOTrainer

        from ulysses_cp.integrations.hf_trainer import SequenceParallelGRPOTrainer

        parent = SequenceParallelGRPOTrainer if ours else GRPOTrainer
        args = GRPOConfig(
            **common, num_generations=GENERATIONS, max_completion_length=spec["length"]
        )
        train = datasets.Dataset.from_list(prompt_rows(steps, spec["length"], 1))
        trainer = measured(parent)(
            model=model,
            reward_funcs=[distinct_words],
            args=args,
            train_dataset=train,
            processing_class=tok,
            rollout_func=fixed_rollout(spec["length"]),
        )
    else:
        from trl import DPOConfig, DPOTrainer

        from ulysses_cp.integrations.hf_trainer import SequenceParallelDPOTrainer

        parent = SequenceParallelDPOTrainer if ours else DPOTrainer
        args = DPOConfig(**common, max_length=None)
        train = datasets.Dataset.from_list(pair_rows(steps, spec["length"], 1))
        trainer = measured(parent)(
            model=model, args=args, train_dataset=train, processing_class=tok
        )
    trainer.record = record
    trainer.train()
    record["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rank = int(os.environ.get("RANK", "0"))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(record))


def peak(variant: str, length: int, args, tmp: Path) -> dict:
    """One run at ``length``: per-rank peaks (MiB) and the losses, or an error."""
    folder = tmp / f"{variant}_{length}_{time.monotonic_ns()}"
    spec = {
        "variant": variant,
        "world": args.world if variant == "ours" else 1,
        "length": length,
        "model": str(tmp / "model"),
        "tokenizer": str(tmp / "tokenizer"),
        "out": str(folder),
        "port": free_port(),
        "objective": args.objective,
    }
    t0 = time.perf_counter()
    run = launch(spec, tmp, args.timeout, str(Path(__file__).resolve()))
    if "error" in run:
        print(f"{variant:<9} {length:>7} tokens: did not run: {run['error']}", flush=True)
        return {"error": run["error"], "tail": run["tail"]}
    peaks = [r["peak_bytes"] / 2**20 for r in run["ranks"]]
    print(
        f"{variant:<9} {length:>7} tokens: peak {max(peaks):8.2f} MiB per rank "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return {"peak_mib_per_rank": peaks, "loss": run["ranks"][0]["loss"]}


def longest(variant: str, args, tmp: Path) -> dict:
    """The longest row (a multiple of ``--step``) whose peak fits ``--budget-mib``."""
    fits, over, probes = 0, None, []
    length = args.start
    while over is None and length <= args.max_length:
        r = peak(variant, length, args, tmp)
        probes.append({"length": length, **r})
        if "error" in r or max(r["peak_mib_per_rank"]) > args.budget_mib:
            over = length
        else:
            fits, length = length, length * 2
    while over is not None and over - fits > args.step:
        length = (fits + over) // 2 // args.step * args.step
        if length in (fits, over):
            break
        r = peak(variant, length, args, tmp)
        probes.append({"length": length, **r})
        if "error" in r or max(r["peak_mib_per_rank"]) > args.budget_mib:
            over = length
        else:
            fits = length
    return {"longest": fits, "capped": over is None, "probes": probes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument(
        "--objective",
        choices=("dpo", "grpo"),
        default="dpo",
        help="dpo: one pair a step; grpo: one prompt and 8 completions (dpo)",
    )
    p.add_argument("--quick", action="store_true", help="1024 tokens; budget search skipped")
    p.add_argument("--world", type=int, default=4, help="ranks of ours = Ulysses degree (P)")
    p.add_argument("--length", type=int, default=2048, help="tokens per row (a pair: two)")
    p.add_argument("--budget-mib", type=float, default=64.0, help="per-rank budget of the search")
    p.add_argument("--start", type=int, default=512, help="first length of the search")
    p.add_argument("--step", type=int, default=256, help="the search's resolution")
    p.add_argument("--max-length", type=int, default=65536, help="the search stops here")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        import torch.distributed as dist

        if dist.is_initialized():  # leave without the interpreter's teardown (benchlib.py)
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.quick:
        args.length = 1024
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "worker"}}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        save_assets(tmp)
        at = {v: peak(v, args.length, args, tmp) for v in VARIANTS}
        result["at_length"] = at
        if not args.quick:
            result["longest"] = {v: longest(v, args, tmp) for v in VARIANTS}
    head = f"{'variant':<10}{'row tokens':>11}{'peak MiB/rank':>15}{'x ref':>7}{'loss diff':>11}"
    what = (
        "GRPO, one prompt and 8 completions a step (8 rows)"
        if args.objective == "grpo"
        else "DPO, one pair a step (two rows)"
    )
    lines = [f"{what}, CPU, gloo; ours: Ulysses {args.world}, ZeRO-2", head]
    ref = at["reference"]
    for v in VARIANTS:
        r = at[v]
        if "error" in r:
            lines.append(f"{v:<10}  did not run: {r['error']}")
            continue
        top = max(r["peak_mib_per_rank"])
        ratio = top / max(ref["peak_mib_per_rank"]) if "error" not in ref else float("nan")
        diff = 0.0
        if "error" not in ref:
            diff = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"], strict=True))
        lines.append(f"{v:<10}{args.length:>11}{top:>15.2f}{ratio:>7.2f}{diff:>11.1e}")
    if "longest" in result:
        lines.append(f"longest row under {args.budget_mib:g} MiB per rank (step {args.step}):")
        for v in VARIANTS:
            lg = result["longest"][v]
            cap = " (search cap)" if lg["capped"] else ""
            lines.append(f"  {v:<10}{lg['longest']:>8} tokens{cap}")
        found = {v: result["longest"][v]["longest"] for v in VARIANTS}
        for base in ("reference", "ours_1"):
            if found[base]:
                lines.append(f"  ours / {base}: {found['ours'] / found[base]:.2f}x")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"benchmark_{args.objective}.json"
    (out / name).write_text(json.dumps(result))
    print(f"json: {out / name}")


if __name__ == "__main__":
    main()
