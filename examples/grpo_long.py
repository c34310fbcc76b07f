"""RL training (GRPO) with TRL under sequence parallelism: prompts from a local JSONL, a
local model and tokenizer, completions sampled from the model, two reward functions.

One process (no sequence parallelism; the reference)::

    python examples/grpo_long.py --model_path M --tokenizer_path T --data prompts.jsonl \\
        --output_dir out

Sequence parallel on 2 ranks (Ulysses 2, ZeRO-2), either launcher (README, "Hugging Face
Trainer and TRL")::

    accelerate launch --config_file examples/accelerate_config.yaml examples/grpo_long.py ...
    deepspeed --num_gpus 2 examples/grpo_long.py --deepspeed examples/ds_zero2_u2.json ...

``--data``: one JSON object a line with a ``"prompt"`` string (other keys are ignored, so
the ``pairs.jsonl`` of ``examples/make_tiny_assets.py`` serves). Each prompt gets
``--num_generations`` completions of at most ``--max_completion_length`` tokens, sampled
by the model (``generate``, temperature ``--temperature``); the rewards are
:func:`overlap_reward` (the share of the completion's words found in the prompt) and
:func:`length_reward` (a penalty for the words beyond ``--target_words``). The DeepSpeed
JSON's ``"sequence_parallel"`` block turns sequence parallelism on
(:class:`ulysses_cp.integrations.hf_trainer.SequenceParallelGRPOTrainer`): SP rank 0 of
each replica samples and its completions are shared; each prompt + completion row, and the
reference model's forward (``--beta`` > 0), are split over the ranks. Prints the Trainer's
log lines, then the training losses; writes them to ``OUTPUT_DIR/train_losses.json`` and
the model (a plain Hugging Face folder) to ``OUTPUT_DIR/final``.

On GPUs, for long reasoning traces: a real checkpoint, ``--bf16``,
``--max_completion_length 32768`` (or more: the planner, ``python -m ulysses_cp.plan``,
says what fits a prompt + completion row), ``--num_generations 8``, the
``"sequence_parallel"`` block's degrees set to the GPUs that share a sequence, ZeRO-3 for
models that do not fit whole on one GPU; the defaults here are sized for a CPU check.
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


def read_prompts(path: Path) -> list[dict]:
    """The prompts of a JSONL file, ``{"prompt": "..."}`` a line."""
    prompts = []
    for n, row in jsonl_rows(path, "prompts"):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise InputError(
                f'{path} line {n}: every line is {{"prompt": "..."}} (a string), got '
                f"{str(row)[:80]!r}"
            )
        prompts.append({"prompt": row["prompt"]})
    return prompts


def overlap_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """The share of each completion's words that its prompt contains (0 for an empty one)."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        seen, words = set(prompt.split()), completion.split()
        out.append(sum(w in seen for w in words) / len(words) if words else 0.0)
    return out


def length_reward(completions: list[str], target_words: int, **kwargs) -> list[float]:
    """-0.1 for each word beyond ``target_words``."""
    return [-0.1 * max(len(c.split()) - target_words, 0) for c in completions]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_args(p, data='JSONL, {"prompt": "..."} a line')
    p.add_argument("--max_completion_length", type=int, default=32, help="tokens (32)")
    p.add_argument("--num_generations", type=int, default=4, help="completions a prompt (4)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0)")
    p.add_argument("--target_words", type=int, default=8, help="length_reward's target (8)")
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (10)")
    p.add_argument("--batch_size", type=int, default=4, help="completions a micro-batch (4)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference)")
    p.add_argument("--loss_type", default="dapo", help="a TRL GRPO loss type (dapo)")
    optimizer_args(p, learning_rate=1e-6)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> list[float]:
    prompts = read_prompts(args.data)  # every rank, before any collective
    ds_path = deepspeed_config(args.deepspeed)
    model_path, tokenizer_path = local_folders(args)
    import functools

    import datasets
    import torch
    import transformers
    from trl import GRPOConfig

    from ulysses_cp.integrations.hf_trainer import SequenceParallelGRPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    config = GRPOConfig(
        output_dir=str(args.output_dir),
        max_completion_length=args.max_completion_length,
        num_generations=args.num_generations,
        temperature=args.temperature,
        beta=args.beta,
        loss_type=args.loss_type,
        **training_options(args, ds_path),
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    # after the GRPOConfig: under ZeRO-3 the policy and the reference are built partitioned
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    length = functools.partial(length_reward, target_words=args.target_words)
    length.__name__ = "length_reward"  # type: ignore[attr-defined]  # TRL logs it by name
    trainer = SequenceParallelGRPOTrainer(
        model=model,
        reward_funcs=[overlap_reward, length],
        args=config,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    return train_and_save(trainer, tokenizer, args, f"GRPO on {len(prompts)} prompts")


def main() -> None:
    run_example(train, parse_args())


if __name__ == "__main__":
    main()
