"""One tiny Hugging Face ``Trainer`` run three ways, side by side in one invocation: the
plain ``Trainer`` in one process (the reference), ulysses_cp's ``SequenceParallelTrainer``
and DeepSpeed's ALST as transformers and Accelerate switch it on
(``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=P))``), each on P ranks of Ulysses (torchrun, gloo, CPU).

The run: a Llama (hidden 128, 2 layers, 4 heads, 2 kv heads, MLP 256, vocabulary 256,
float32, seed-0 weights saved once so every run starts from them), rows of ``--length``
random tokens with ``position_ids`` (ALST's data-loader adapter requires them) and every
label used, per-device batch 2, gradient accumulation 2 (the same global batch of 4 rows
for all three: one data-parallel replica), SGD at a constant learning rate with no
clipping (a wrong gradient scale changes the losses), ZeRO ``--zero`` for the two
sequence-parallel runs, one evaluation on 4 held-out rows after the last step.

Measured per run: the training losses' largest relative difference from the reference's
and the eval_loss's; the row length the model saw on each rank in training and in
evaluation (P x smaller when that phase is sequence parallel); the optimizer-step time
(the time between consecutive ``on_step_end`` callbacks: fetching the micro-batches,
forward, loss, backward, optimizer, logging; the slowest rank; the first step and the
memory step left out; median over the steps of every repeat, the repeats interleaved:
reference, ours, ALST, reference, ...); the per-rank peak of one micro-batch's
``training_step`` (``scripts/profiling.py`` ``LiveBytes``: every tensor the forward and
backward create, gradients included, weights not; the last micro-batch of the last step).

ALST ran here unchanged: no patch was needed on CPU (gloo). The runs are CPU only
(``use_cpu=True``, ``DS_ACCELERATOR=cpu``).

    python scripts/benchmark_hf_trainer.py --quick --out bench_results   # 5-7 min here
    python scripts/benchmark_hf_trainer.py --out bench_results           # ~38 min here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)
BATCH, GA, N_EVAL = 2, 2, 4
VARIANTS = ("reference", "ours", "alst")


# ---------------------------------------------------------------- one run (a worker)


def rows(n: int, length: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(MODEL["vocab_size"], (n, length), generator=g)
    pos = list(range(length))
    return [{"input_ids": r.tolist(), "labels": r.tolist(), "position_ids": pos} for r in ids]


def measured(parent):
    """``parent`` (a Trainer class) that records step times, one micro-batch's peak and the
    row lengths the model sees (``self.record``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from profiling import LiveBytes

    class Measured(parent):
        def training_step(self, model, inputs, num_items_in_batch=None):
            rec = self.record
            rec["micro"] += 1
            if rec["micro"] != rec["memory_micro"]:
                return super().training_step(model, inputs, num_items_in_batch)
            with LiveBytes() as tracker:
                out = super().training_step(model, inputs, num_items_in_batch)
            rec["peak_bytes"] = tracker.peak
            rec["memory_step"] = self.state.global_step + 1
            return out

    return Measured


def step_timer(record: dict):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if "last" in record:
                record["step_s"][state.global_step] = now - record["last"]
            record["last"] = now

    return StepTimer()


def watch_lengths(model, record: dict) -> None:
    """Record the row length the model's embedding sees, per phase (train / eval)."""

    def hook(module, args):
        phase = "train" if module.training else "eval"
        record[f"{phase}_row_length"] = int(args[0].shape[1])

    model.get_input_embeddings().register_forward_pre_hook(hook)


def worker(spec: dict) -> None:
    import torch

    variant, P = spec["variant"].split()[0], spec["world"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    if variant != "reference":
        import ulysses_cp as ucp

        ucp.init_distributed()
    import datasets
    import transformers

    ds = None
    if variant != "reference":
        zero = {"stage": spec["zero"], "reduce_bucket_size": "auto"}  # hidden^2, not 5e8
        if spec["zero"] == 3:
            zero.update(
                stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto"
            )
        ds = {
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
        }
    extra: dict = {}
    if variant == "ours":
        ds["sequence_parallel"] = {
            "ulysses_degree": P,
            "ring_degree": 1,
            "attention_backend": "torch",
        }
    if variant == "alst":
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        )
        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=P, sp_handler=handler
        )
    steps = spec["steps"]
    args = transformers.TrainingArguments(
        output_dir=spec["out"],
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=GA,
        max_steps=steps,
        learning_rate=spec["lr"],
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=steps,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        bf16=False,
        deepspeed=ds,
        dataloader_drop_last=False,
        disable_tqdm=True,
        **extra,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    record: dict = {"micro": 0, "memory_micro": steps * GA, "step_s": {}}
    watch_lengths(model, record)
    if variant == "ours":
        from ulysses_cp.integrations.hf_trainer import SequenceParallelTrainer as parent
    else:
        parent = transformers.Trainer
    trainer = measured(parent)(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows(BATCH * GA * steps, spec["length"], 1)),
        eval_dataset=datasets.Dataset.from_list(rows(N_EVAL, spec["length"], 2)),
        data_collator=transformers.default_data_collator,
        callbacks=[step_timer(record)],
    )
    trainer.record = record
    trainer.train()
    history = trainer.state.log_history
    record.pop("last", None)
    record.update(
        loss=[h["loss"] for h in history if "loss" in h],
        eval_loss=[h["eval_loss"] for h in history if "eval_loss" in h],
    )
    rank = int(os.environ.get("RANK", "0"))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------- the driver


def launch(spec: dict, tmp: Path, timeout: float, script: str | None = None) -> dict:
    """One run of ``script --worker SPEC`` (default: this script); returns its per-rank
    records, or ``{"error": ...}`` (the output's tail)."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{out.name}.json"
    path.write_text(json.dumps(spec))
    me = [script or str(Path(__file__).resolve()), "--worker", str(path)]
    if spec["variant"] == "reference":
        cmd = [sys.executable, *me]
    else:
        nproc = ["--nproc-per-node", str(spec["world"]), "--master-port", str(spec["port"])]
        cmd = [sys.executable, "-m", "torch.distributed.run", *nproc, *me]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "PYTHONPATH": path}
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = -1, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    ranks = sorted(out.glob("rank*.json"))
    if code != 0 or not ranks:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return {"error": (errors or lines or ["no output"])[-1][:400], "tail": text[-4000:]}
    return {"ranks": [json.loads(p.read_text()) for p in ranks]}


def summarise(variant: str, runs: list[dict], ref: dict | None) -> dict:
    """One table row from a variant's repeats (``ref``: the reference's row)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {"variant": variant, "error": failed[0]["error"], "tail": failed[0]["tail"]}
    first = runs[0]["ranks"]
    loss, eval_loss = first[0]["loss"], first[0]["eval_loss"]
    times = []
    for run in runs:  # per step: the slowest rank
        steps = run["ranks"][0]["step_s"]
        times += [
            max(rank["step_s"][k] for rank in run["ranks"])
            for k in steps
            if int(k) not in (1, run["ranks"][0]["memory_step"])
        ]
    row = {
        "variant": variant,
        "loss": loss,
        "eval_loss": eval_loss,
        "train_row_length": first[0].get("train_row_length"),
        "eval_row_length": first[0].get("eval_row_length"),
        "step_s": statistics.median(times),
        "step_samples": len(times),
        "peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in first],
    }
    if ref is not None and "loss" in ref:
        rel = [abs(a - b) / abs(b) for a, b in zip(loss, ref["loss"], strict=True)]
        row["loss_rel_diff"] = max(rel)
        row["eval_loss_rel_diff"] = abs(eval_loss[0] - ref["eval_loss"][0]) / ref["eval_loss"][0]
        row["time_x_ref"] = row["step_s"] / ref["step_s"]
    return row


def _free_port() -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib import free_port

    return free_port()


def run_all(args) -> list[dict]:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**MODEL)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp / "model")
        names = ["reference"] + [f"{v} z{z}" for z in args.zero for v in args.variants[1:]]
        runs: dict[str, list[dict]] = {v: [] for v in names}
        for rep in range(args.repeats):
            for v in names:
                if runs[v] and "error" in runs[v][0]:
                    continue  # a run that failed once is not repeated
                zero = int(v.split(" z")[1]) if " z" in v else 0
                folder = tmp / f"{v.replace(' ', '_')}{rep}"
                spec = {
                    "variant": v,
                    "world": args.world,
                    "zero": zero,
                    "length": args.length,
                    "steps": args.steps,
                    "lr": args.lr,
                    "model": str(tmp / "model"),
                    "out": str(folder),
                    "port": _free_port(),
                }
                t0 = time.perf_counter()
                runs[v].append(launch(spec, tmp, args.timeout))
                status = runs[v][-1].get("error", "ok")
                print(
                    f"repeat {rep} {v:<9} {time.perf_counter() - t0:6.1f} s  {status}", flush=True
                )
    out, ref = [], None
    for v in names:
        row = summarise(v, runs[v], ref)
        if v == "reference":
            ref = row
        out.append(row)
    return out


def table(rows: list[dict], args) -> str:
    lines = [
        f"P = {args.world} (Ulysses), ZeRO {args.zero} for the sequence-parallel runs; "
        f"length {args.length}, {args.steps} steps, {args.repeats} repeat(s); CPU, gloo",
        f"{'variant':<10}{'loss diff':>11}{'eval diff':>11}{'train len':>10}{'eval len':>9}"
        f"{'step s':>9}{'x ref':>7}  peak MiB per rank",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<10}  did not run: {r['error']}")
            continue
        peaks = " ".join(f"{p:.2f}" for p in r["peak_mib_per_rank"])
        lines.append(
            f"{r['variant']:<10}{r.get('loss_rel_diff', 0.0):>11.1e}"
            f"{r.get('eval_loss_rel_diff', 0.0):>11.1e}{r['train_row_length']:>10}"
            f"{r['eval_row_length']:>9}{r['step_s']:>9.3f}{r.get('time_x_ref', 1.0):>7.2f}  {peaks}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="256 tokens, 4 steps, ZeRO-2, one repeat")
    p.add_argument("--world", type=int, default=2, help="ranks = Ulysses degree (P)")
    p.add_argument(
        "--zero",
        type=int,
        nargs="+",
        default=[2, 3],
        choices=(0, 1, 2, 3),
        help="ZeRO stages of the sequence-parallel runs (each stage: ours, ALST)",
    )
    p.add_argument("--length", type=int, default=1024, help="tokens per row")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    p.add_argument("--lr", type=float, default=1.0, help="SGD learning rate (constant)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each variant")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        # the record is on disk: leave without the interpreter's teardown, where gloo's
        # threads once aborted a finished rank (SIGABRT), as scripts/benchlib.py does
        from ulysses_cp.core.process import exit_process

        exit_process()
    if args.quick:
        args.length, args.steps, args.repeats, args.zero = 256, 4, 1, [2]
    if args.variants[0] != "reference" or len(set(args.variants)) != len(args.variants):
        p.error("the reference must run (first): the differences are taken from it")
    rows = run_all(args)
    print(table(rows, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in vars(args).items() if k != "worker"}
    (out / "benchmark_hf_trainer.json").write_text(json.dumps({"args": kept, "rows": rows}))
    print(f"json: {out / 'benchmark_hf_trainer.json'}")


if __name__ == "__main__":
    main()
