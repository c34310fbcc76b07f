"""Preference training (DPO) with TRL under sequence parallelism: pairs from a local JSONL,
a local model and tokenizer; the reference model is the starting policy.

One process (no sequence parallelism; the reference)::

    python examples/dpo_long.py --model_path M --tokenizer_path T --data pairs.jsonl \\
        --output_dir out

Sequence parallel on 2 ranks (Ulysses 2, ZeRO-2), either launcher (README, "Hugging Face
Trainer and TRL")::

    accelerate launch --config_file examples/accelerate_config.yaml examples/dpo_long.py ...
    deepspeed --num_gpus 2 examples/dpo_long.py --deepspeed examples/ds_zero2_u2.json ...

``--data``: one JSON object a line, ``{"prompt": "...", "chosen": "...", "rejected":
"..."}`` (TRL's standard preference format). Each pair becomes two rows, prompt + chosen
and prompt + rejected, of at most ``--max_length`` tokens. The DeepSpeed JSON's
``"sequence_parallel"`` block turns sequence parallelism on
(:class:`ulysses_cp.integrations.hf_trainer.SequenceParallelDPOTrainer`): both rows of a
pair, and the reference model's forward, are split over the ranks. Prints the Trainer's log
lines, then the training losses; writes them to ``OUTPUT_DIR/train_losses.json`` and the
model (a plain Hugging Face folder) to ``OUTPUT_DIR/final``.

On GPUs, for long pairs: a real checkpoint, ``--bf16``, ``--max_length 65536`` (or more:
the planner, ``python -m ulysses_cp.plan``, says what fits), the ``"sequence_parallel"``
block's degrees set to the GPUs that share a sequence, ZeRO-3 for models that do not fit
whole on one GPU; the defaults here are sized for a CPU check.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_trainer_sft import (
    InputError,
    deepspeed_config,
    jsonl_rows,
    local_folders,
    optimizer_args,
    run_args,
    run_example,
    train_and_save,
    training_options,
)

KEYS = ("prompt", "chosen", "rejected")


def read_pairs(path: Path) -> list[dict]:
    """The preference pairs of a JSONL file, each ``{"prompt", "chosen", "rejected"}``."""
    pairs = []
    for n, row in jsonl_rows(path, "preference pairs"):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in KEYS):
            raise InputError(
                f'{path} line {n}: every line is {{"prompt": "...", "chosen": "...", '
                f'"rejected": "..."}} (strings), got {str(row)[:80]!r}'
            )
        pairs.append({k: row[k] for k in KEYS})
    return pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_args(p, data="JSONL, prompt/chosen/rejected")
    p.add_argument("--max_length", type=int, default=256, help="tokens per row (256)")
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (10)")
    p.add_argument("--batch_size", type=int, default=1, help="pairs per batch (1)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta (0.1)")
    p.add_argument("--loss_type", default="sigmoid", help="a TRL DPO loss type (sigmoid)")
    optimizer_args(p, learning_rate=1e-6)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> list[float]:
    pairs = read_pairs(args.data)  # every rank, before any collective
    ds_path = deepspeed_config(args.deepspeed)
    model_path, tokenizer_path = local_folders(args)
    import datasets
    import torch
    import transformers
    from trl import DPOConfig

    from ulysses_cp.integrations.hf_trainer import SequenceParallelDPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    config = DPOConfig(
        output_dir=str(args.output_dir),
        max_length=args.max_length,
        beta=args.beta,
        loss_type=[args.loss_type],
        **training_options(args, ds_path),
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    # after the DPOConfig: under ZeRO-3 the policy and the reference are built partitioned
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    trainer = SequenceParallelDPOTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=tokenizer,
    )
    return train_and_save(trainer, tokenizer, args, f"DPO on {len(pairs)} pairs")


def main() -> None:
    run_example(train, parse_args())


if __name__ == "__main__":
    main()
