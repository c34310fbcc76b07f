"""Supervised fine-tuning with TRL under sequence parallelism: chat data from a local JSONL,
packed rows, a local model and tokenizer.

One process (no sequence parallelism; the reference)::

    python examples/hf_trainer_sft.py --model_path M --tokenizer_path T --data chats.jsonl \\
        --output_dir out

Sequence parallel on 2 ranks (Ulysses 2, ZeRO-2), either launcher (README, "Hugging Face
Trainer and TRL")::

    accelerate launch --config_file examples/accelerate_config.yaml examples/hf_trainer_sft.py ...
    deepspeed --num_gpus 2 examples/hf_trainer_sft.py --deepspeed examples/ds_zero2_u2.json ...

``--data``: one JSON object a line, ``{"messages": [{"role": "user", "content": "..."},
...]}``; TRL applies the tokenizer's chat template, so the tokenizer needs one. Chats are
packed into rows of at most ``--max_length`` tokens (TRL's ``packing=True``, best-fit
decreasing; a longer chat is truncated) and the rows of a batch into one row, position ids
restarting per chat. The DeepSpeed JSON's ``"sequence_parallel"`` block turns sequence
parallelism on (:class:`ulysses_cp.integrations.hf_trainer.SequenceParallelSFTTrainer`);
with ``"packing": "row"`` there, chats of any length cross rank borders and only the row is
padded. Prints the Trainer's log lines, then the training losses; writes them to
``OUTPUT_DIR/train_losses.json`` and the model (a plain Hugging Face folder) to
``OUTPUT_DIR/final``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ulysses_cp.core.log import configure_logging, quiet_third_party
from ulysses_cp.core.process import exit_process


class InputError(ValueError):
    """Bad input named with the fix; every rank finds it before any collective."""


def jsonl_rows(path: Path, what: str) -> list[tuple[int, object]]:
    """``(line number, value)`` of each non-blank line of a JSONL file (also the DPO
    example's); ``what`` names the file's content in the errors."""
    if not path.is_file():
        raise InputError(f"--data {path}: no such file (a JSONL of {what}, one a line)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {n}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not rows:
        raise InputError(f"--data {path}: no {what} in the file")
    return rows


def read_chats(path: Path) -> list[dict]:
    """The chats of a JSONL file, each ``{"messages": [{"role", "content"}, ...]}``."""
    chats = []
    for n, row in jsonl_rows(path, "chats"):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise InputError(
                f'{path} line {n}: no "messages" list; every line is {{"messages": [{{"role": '
                f'"user", "content": "..."}}, ...]}}'
            )
        for i, m in enumerate(messages):
            ok = isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))
            if not ok:
                want = 'string "role" and "content"'
                raise InputError(f"{path} line {n}: message {i} must have {want}, got {m!r}")
        chats.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages]})
    return chats


def local_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """``--model_path`` and ``--tokenizer_path`` (default: the model's), which must be local
    folders; then torch.distributed is started under a launcher (gloo on CPU, nccl on
    GPUs), before the Trainer's state."""
    model_path = Path(args.model_path)
    tokenizer_path = Path(args.tokenizer_path or args.model_path)
    for what, folder in (("--model_path", model_path), ("--tokenizer_path", tokenizer_path)):
        if not folder.is_dir():
            raise InputError(f"{what} {folder}: no such folder (a local Hugging Face folder)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import ulysses_cp as ucp

        ucp.init_distributed()
    return model_path, tokenizer_path


def deepspeed_config(given: str | None) -> str | None:
    """The DeepSpeed JSON: ``--deepspeed``, else the one ``accelerate launch`` was given
    (its config's ``deepspeed_config_file``), else None (no DeepSpeed)."""
    from_accelerate = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if given and from_accelerate and Path(given).resolve() != Path(from_accelerate).resolve():
        raise InputError(
            f"--deepspeed {given} and the Accelerate config's deepspeed_config_file "
            f"{from_accelerate} differ: give one of them"
        )
    path = given or from_accelerate
    if path is not None and not Path(path).is_file():
        raise InputError(f"DeepSpeed config {path}: no such file")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_args(
        p,
        data='JSONL, {"messages": [...]} a line',
        tokenizer="a local tokenizer with a chat template (model's)",
    )
    p.add_argument("--max_length", type=int, default=256, help="tokens per packed row (256)")
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (10)")
    p.add_argument("--batch_size", type=int, default=1, help="packed rows per batch (1)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    optimizer_args(p, learning_rate=1e-4)
    return p.parse_args(argv)


def run_args(
    p: argparse.ArgumentParser,
    *,
    data: str,
    tokenizer: str = "a local tokenizer (default: the model's)",
) -> None:
    """The model, data, DeepSpeed and output options (also the DPO and GRPO examples')."""
    p.add_argument("--model_path", required=True, help="a local causal LM folder")
    p.add_argument("--tokenizer_path", help=tokenizer)
    p.add_argument("--data", required=True, type=Path, help=data)
    p.add_argument("--deepspeed", help="DeepSpeed JSON; its sequence_parallel block turns SP on")
    p.add_argument("--output_dir", required=True, type=Path)


def optimizer_args(p: argparse.ArgumentParser, *, learning_rate: float) -> None:
    """The optimizer, precision and seed options (also the DPO and GRPO examples')."""
    p.add_argument("--optim", default="adamw_torch", help="a TrainingArguments optim (adamw_torch)")
    p.add_argument("--learning_rate", type=float, default=learning_rate)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="0: no clipping (1.0)")
    p.add_argument("--bf16", action="store_true", help="train in bfloat16 (default float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed's


def train(args: argparse.Namespace) -> list[float]:
    chats = read_chats(args.data)  # every rank, before any collective
    ds_path = deepspeed_config(args.deepspeed)
    model_path, tokenizer_path = local_folders(args)
    import datasets
    import torch
    import transformers
    from trl import SFTConfig

    from ulysses_cp.integrations.hf_trainer import SequenceParallelSFTTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    if not tokenizer.chat_template:
        raise InputError(
            f"the tokenizer in {tokenizer_path} has no chat_template: TRL formats the "
            f"messages with it; add one to its tokenizer_config.json"
        )
    config = SFTConfig(
        output_dir=str(args.output_dir),
        max_length=args.max_length,
        packing=True,  # best-fit rows, flattened per batch, positions restarting per chat
        **training_options(args, ds_path),
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    trainer = SequenceParallelSFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(chats),
        processing_class=tokenizer,
    )
    return train_and_save(trainer, tokenizer, args, f"training on {len(chats)} chats")


def training_options(args: argparse.Namespace, ds_path: str | None) -> dict:
    """The TrainingArguments both examples take from the command line (bf16 given
    explicitly: SFTConfig's own default is True)."""
    import torch

    return dict(
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        optim=args.optim,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=args.max_grad_norm,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        deepspeed=ds_path,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        disable_tqdm=True,  # one printed line of logs per step
    )


def train_and_save(trainer, tokenizer, args: argparse.Namespace, what: str) -> list[float]:
    """Say which run this is, train, save the model and tokenizer to ``OUTPUT_DIR/final``
    and the training losses to ``OUTPUT_DIR/train_losses.json`` (also the TRL examples')."""
    sp = trainer.sequence_parallel
    if trainer.is_world_process_zero():
        t = None if sp is None else sp.topo
        where = (
            "one process (no sequence_parallel block)"
            if t is None
            else f"sequence parallel: Ulysses {t.ulysses_degree} x ring {t.ring_degree}, "
            f"{t.dp_degree} data-parallel replica(s), layout {t.layout}, packing "
            f"{t.options.packing}"
        )
        print(f"{what} from {args.data}: {where}", flush=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(str(args.output_dir / "final"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir / "final")
        (args.output_dir / "train_losses.json").write_text(json.dumps(losses))
        print("training losses: " + " ".join(f"{x:.6f}" for x in losses), flush=True)
    return losses


def run_example(train: Callable[[argparse.Namespace], object], args: argparse.Namespace) -> None:
    """An example's ``train(args)`` (also the TRL examples'): the package's log lines from
    rank 0; bad input as one line naming the script, exit status 1; a finished run leaves
    by :func:`ulysses_cp.core.process.exit_process`, without the interpreter's teardown,
    where gloo's threads once aborted a finished rank ("terminate called without an active
    exception"); the third-party warnings a user can do nothing about are hidden
    (:func:`ulysses_cp.core.log.quiet_third_party`)."""
    configure_logging()
    quiet_third_party()
    try:
        train(args)
    except InputError as exc:
        sys.exit(f"{Path(sys.argv[0]).name}: {exc}")
    exit_process()


def main() -> None:
    run_example(train, parse_args())


if __name__ == "__main__":
    main()
