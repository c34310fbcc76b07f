"""Fine-tuning a vision-language model (Qwen2.5-VL or Qwen3-VL) on local images under
sequence parallelism, with the Hugging Face Trainer.

One process (no sequence parallelism; the reference)::

    python examples/vlm_sft.py --model_path M --data captions.jsonl --output_dir out

Sequence parallel on 2 ranks (Ulysses 2, ZeRO-2)::

    deepspeed --num_gpus 2 examples/vlm_sft.py --deepspeed examples/ds_zero2_u2.json ...

``--data``: one JSON object a line, ``{"image": "images/cat.png", "prompt": "...",
"answer": "..."}``, the image path relative to the JSONL's folder. Each row is the image's
placeholder tokens (vision start, one image token per merged patch, vision end), the
prompt and the answer, then the end-of-sequence token; only the answer and the end are
trained on. The model folder holds the model and its image processor
(``preprocessor_config.json``); the tokenizer comes from ``--tokenizer_path`` (default: the
model's folder). Rows of a batch are padded at the end.

Under the DeepSpeed config's ``"sequence_parallel"`` block
(:class:`ulysses_cp.integrations.hf_trainer.SequenceParallelTrainer`) every rank runs the
vision tower on the batch's whole images, and the language model runs on this rank's share
of the merged sequence (docs/models/vlm.md). Prints the Trainer's log
lines, then the training losses; writes them to ``OUTPUT_DIR/train_losses.json`` and the
model to ``OUTPUT_DIR/final``. ``python examples/make_tiny_assets.py DIR --vlm`` writes a
tiny model, four images and their captions to try it on.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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

FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # their image placeholders and image processors


def read_captions(path: Path) -> list[dict]:
    """The rows of the JSONL, each image path checked (relative to the file's folder)."""
    rows = []
    for n, row in jsonl_rows(path, "image captions"):
        ok = isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("image", "answer"))
        if not ok or not isinstance(row.get("prompt", ""), str):
            raise InputError(
                f'{path} line {n}: every line is {{"image": "path.png", "prompt": "...", '
                f'"answer": "..."}} (strings; the prompt may be left out)'
            )
        image = path.parent / row["image"]
        if not image.is_file():
            raise InputError(f"{path} line {n}: image {image}: no such file")
        rows.append({"image": image, "prompt": row.get("prompt", ""), "answer": row["answer"]})
    return rows


def encode(rows: list[dict], tokenizer, processor, config) -> list[dict]:
    """Each row's tokens, labels (the answer's and the end's), pixels and patch grid."""
    from PIL import Image

    start, image_id = config.vision_start_token_id, config.image_token_id
    end = getattr(config, "vision_end_token_id", None)
    merge = processor.merge_size**2
    out = []
    for row in rows:
        with Image.open(row["image"]) as img:
            pixels = processor(images=[img.convert("RGB")], return_tensors="pt")
        grid = pixels["image_grid_thw"]
        tokens = int(grid.prod()) // merge
        image = [start, *[image_id] * tokens, *([end] if end is not None else [])]
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        answer = [*answer, tokenizer.eos_token_id]
        ids = [*image, *prompt, *answer]
        labels = [-100] * (len(ids) - len(answer)) + answer
        out.append(
            {
                "input_ids": ids,
                "labels": labels,
                "pixel_values": pixels["pixel_values"],
                "image_grid_thw": grid,
            }
        )
    return out


def collate(pad_id: int, image_id: int):
    """The batch: rows padded at the end (mask and ignored labels), every image's pixels
    and grid concatenated, and the image tokens marked (``mm_token_type_ids``)."""
    import torch

    def collate_rows(rows: list[dict]) -> dict:
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), pad_id)
        labels = torch.full((len(rows), n), -100)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k], labels[i, :k], mask[i, :k] = (
                torch.tensor(r["input_ids"]),
                torch.tensor(r["labels"]),
                1,
            )
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "pixel_values": torch.cat([torch.as_tensor(r["pixel_values"]) for r in rows]),
            "image_grid_thw": torch.cat([torch.as_tensor(r["image_grid_thw"]) for r in rows]),
            "mm_token_type_ids": (ids == image_id).int(),
        }

    return collate_rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_args(p, data='JSONL, {"image": ..., "prompt": ..., "answer": ...} a line')
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (10)")
    p.add_argument("--batch_size", type=int, default=2, help="rows per batch (2)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument(
        "--trainer",
        choices=("trainer", "sft"),
        default="trainer",
        help="SequenceParallelTrainer (trainer) or TRL's SequenceParallelSFTTrainer (sft)",
    )
    optimizer_args(p, learning_rate=1e-4)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> list[float]:
    rows = read_captions(args.data)  # every rank, before any collective
    ds_path = deepspeed_config(args.deepspeed)
    model_path, tokenizer_path = local_folders(args)
    import torch
    import transformers

    from ulysses_cp.integrations.hf_trainer import SequenceParallelTrainer

    config = transformers.AutoConfig.from_pretrained(model_path)
    if config.model_type not in FAMILIES:
        raise InputError(
            f"--model_path {model_path} is a {config.model_type!r} model; this example builds "
            f"the image placeholders of {list(FAMILIES)}"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    processor = transformers.AutoImageProcessor.from_pretrained(model_path)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    options = dict(
        output_dir=str(args.output_dir),
        remove_unused_columns=False,  # the images' columns reach the collator
        **training_options(args, ds_path),
    )
    rows_in = encode(rows, tokenizer, processor, config)
    collator = collate(tokenizer.pad_token_id, config.image_token_id)
    if args.trainer == "sft":  # TRL's SFTTrainer on the tokenized rows, with their images
        import datasets
        from trl import SFTConfig

        from ulysses_cp.integrations.hf_trainer import SequenceParallelSFTTrainer

        trainer: Any = SequenceParallelSFTTrainer(
            model=model,
            args=SFTConfig(max_length=None, **options),
            train_dataset=datasets.Dataset.from_list(rows_in),
            processing_class=tokenizer,
            data_collator=collator,
        )
    else:
        trainer = SequenceParallelTrainer(
            model=model,
            args=transformers.TrainingArguments(**options),
            train_dataset=rows_in,
            data_collator=collator,
        )
    return train_and_save(trainer, tokenizer, args, f"training on {len(rows)} images")


def main() -> None:
    run_example(train, parse_args())


if __name__ == "__main__":
    main()
