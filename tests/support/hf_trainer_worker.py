"""One Trainer / SFTTrainer run for tests/launcher/test_hf_trainer.py, started by torchrun (the
sequence-parallel runs) or plain python (the one-process reference). Argument: a JSON
file with the run's settings; writes ``<out>/result.json`` (training and eval losses).

Optional spec keys: ``zero`` (DeepSpeed stage), ``sp`` (the sequence_parallel block),
``fsdp`` (FSDP2 instead of DeepSpeed: the block in a file given as
``sequence_parallel_config=``),
``lora`` (peft LoRA on q/v), ``save`` (save_model's folder: the adapter under LoRA),
``model_block`` (the DeepSpeed config's ``"model"`` block), ``ragged`` (Trainer rows of
different lengths, padded on the right by the collator), ``predict`` (``trainer.predict``
on the eval rows after training: the predictions' shape and values), ``batches`` (every rank
writes ``<out>/batches_<rank>.json``: the row sums of its first epoch's training batches,
to see which data each rank gets), ``optim`` / ``scheduler`` / ``warmup_steps`` (the
``TrainingArguments``' optimizer, scheduler type and warmup; default SGD at a constant
rate), ``save_steps`` (checkpoints every so many steps), ``resume`` (a checkpoint folder
for ``train(resume_from_checkpoint=...)``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def rows(n: int, length: int, vocab: int, seed: int, ragged: bool = False) -> list[dict]:
    """``n`` rows of ``length`` tokens; ``ragged``: of ``length / 2 .. length`` tokens
    (a batch pads them on the right: an attention mask with zeros)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    cut = torch.randint(length // 2, length + 1, (n,), generator=g) if ragged else [length] * n
    return [{"input_ids": r[:k].tolist(), "labels": r[:k].tolist()} for r, k in zip(ids, cut)]


def documents(n: int, vocab: int, seed: int, multiple: int) -> list[dict]:
    """Tokenised documents of lengths that are multiples of ``multiple`` (a packed row's
    documents split over the ranks without padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = multiple * int(torch.randint(1, 5, (1,), generator=g))
        out.append({"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist()})
    return out


def deepspeed_config(spec: dict) -> dict | None:
    """The DeepSpeed JSON of a spec: ZeRO ``zero`` (None: no DeepSpeed), the
    ``sequence_parallel`` block ``sp`` (torch attention backend) and the ``model`` block
    ``model_block`` when given (also tests/support/dpo_worker.py's)."""
    if spec.get("zero") is None:
        return None
    ds_config = {
        # ZeRO-3: save_model gathers the partitions into one 16-bit state dict
        "zero_optimization": {
            "stage": spec["zero"],
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    if spec.get("sp") is not None:
        ds_config["sequence_parallel"] = {**spec["sp"], "attention_backend": "torch"}
    if spec.get("model_block") is not None:
        ds_config["model"] = spec["model_block"]
    return ds_config


def fsdp_options(spec: dict) -> tuple[dict, dict]:
    """The ``TrainingArguments`` and the trainer keywords of an FSDP2 spec (``fsdp``): FSDP2
    on, and the sequence_parallel (and model) block written to ``<out>/sp.json`` for
    ``sequence_parallel_config=`` (also tests/support/dpo_worker.py's); empty otherwise."""
    if not spec.get("fsdp"):
        return {}, {}
    block = {"sequence_parallel": {**spec["sp"], "attention_backend": "torch"}}
    if spec.get("model_block") is not None:
        block["model"] = spec["model_block"]
    path = Path(spec["out"]) / f"sp_{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(block))
    args = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    return args, {"sequence_parallel_config": str(path)}


def training_arguments(spec: dict) -> dict:
    """The TrainingArguments every run of a spec shares (also tests/support/dpo_worker.py's):
    SGD at a constant rate with no clipping, float32, one log line a step, one evaluation
    at ``eval_steps``, nothing saved, DeepSpeed as :func:`deepspeed_config` says."""
    return dict(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["ga"],
        max_steps=spec["steps"],
        learning_rate=spec.get("lr", 0.5),
        optim=spec.get("optim", "sgd"),
        lr_scheduler_type=spec.get("scheduler", "constant"),
        warmup_steps=spec.get("warmup_steps", 0),
        max_grad_norm=0.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=spec["eval_steps"],
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        bf16=False,  # SFTConfig's default is True; these runs compare float32 losses
        deepspeed=deepspeed_config(spec),
        dataloader_drop_last=False,
        disable_tqdm=True,
        **fsdp_options(spec)[0],
    )


def lora_config(spec: dict):
    """The peft LoRA config of a spec with ``lora`` (r 4 on q/v), else None; torch's
    generator seeded first, so the adapter starts from the same weights in every run (also
    the DPO and GRPO workers')."""
    if not spec.get("lora"):
        return None
    import peft
    import transformers

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    transformers.set_seed(0)
    return config


def scale_gradients(trainer, spec: dict) -> None:
    """The seen-failing check of the DPO and GRPO workers: a sequence-parallel run's
    gradient scale multiplied by the spec's ``scale``."""
    run = getattr(trainer, "sequence_parallel", None)
    if spec.get("scale") and run is not None:
        run.topo = run.topo.with_options(grad_scale=run.topo.grad_scale * spec["scale"])


def make_trainer(trainer_class, spec: dict, model, args, train, evals, **extra):
    """``trainer_class`` on ``model`` and the train and eval datasets (every worker's), its
    gradient scale set by :func:`scale_gradients`."""
    extra = {**extra, **fsdp_options(spec)[1]}
    trainer = trainer_class(
        model=model, args=args, train_dataset=train, eval_dataset=evals, **extra
    )
    scale_gradients(trainer, spec)
    return trainer


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    sp = spec.get("sp")  # {"ulysses_degree": u, "ring_degree": r} or None
    if sp is not None:
        import ulysses_cp as ucp

        ucp.init_distributed()
    import datasets
    import transformers

    common = training_arguments(spec)
    if spec.get("wandb"):  # report to wandb (the test sets WANDB_MODE=offline, WANDB_DIR)
        common["report_to"] = ["wandb"]
    if spec.get("save_steps"):  # checkpoints every save_steps steps
        common.update(save_strategy="steps", save_steps=spec["save_steps"])
    vocab = spec["vocab"]
    if spec["trainer"] == "sft":
        from trl import SFTConfig

        args = SFTConfig(
            **common,
            packing=True,
            max_length=spec["max_length"],
            dataset_text_field="text",
            completion_only_loss=False,
        )
        multiple = spec["multiple"]
        train = datasets.Dataset.from_list(documents(spec["n_train"], vocab, 1, multiple))
        evals = datasets.Dataset.from_list(documents(spec["n_eval"], vocab, 2, multiple))
    else:
        args = transformers.TrainingArguments(**common)
        ragged = bool(spec.get("ragged"))
        train = datasets.Dataset.from_list(rows(spec["n_train"], spec["length"], vocab, 1, ragged))
        evals = datasets.Dataset.from_list(rows(spec["n_eval"], spec["length"], vocab, 2, ragged))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    lora = lora_config(spec)
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, lora)
    from ulysses_cp.integrations.hf_trainer import (
        SequenceParallelSFTTrainer,
        SequenceParallelTrainer,
    )

    if spec["trainer"] == "sft":
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(spec["tokenizer"])
        trainer = make_trainer(
            SequenceParallelSFTTrainer, spec, model, args, train, evals, processing_class=tok
        )
    else:
        collator = transformers.default_data_collator
        if spec.get("ragged"):  # right padding: labels -100, an attention mask
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(spec["tokenizer"])
            collator = transformers.DataCollatorForSeq2Seq(tok, padding="longest")
        trainer = make_trainer(
            SequenceParallelTrainer, spec, model, args, train, evals, data_collator=collator
        )
    sent = count_fsdp2_bytes(trainer)
    trainer.train(resume_from_checkpoint=spec.get("resume"))  # a checkpoint folder or None
    history = trainer.state.log_history
    result = {
        "loss": [h["loss"] for h in history if "loss" in h],
        "eval_loss": [h["eval_loss"] for h in history if "eval_loss" in h],
        "sp": trainer.sequence_parallel is not None,
        # the model fully_shard-ed (FSDP2), and over how many ranks
        "fsdp2_ranks": fsdp2_ranks(trainer.model),
        # the RMSNorms that took the lean forward (models/lean_norm.py)
        "lean_norms": sum("_lean_forms" in vars(m) for m in model.modules()),
        # the model block's memory features as the recipe applied them (models/recipe.py)
        "tiled_mlps": sum("_ucp_tiled" in vars(m) for m in model.modules()),
        "checkpointed": checkpointed_layers(model),
        "history": history,
        "fsdp2_sent": sent,
    }
    if spec.get("wandb") and int(os.environ.get("RANK", "0")) == 0:
        import wandb

        result["wandb_run_id"] = wandb.run.id if wandb.run is not None else None
    if spec.get("predict"):  # after the evaluation above: transformers' second loop
        pred = trainer.predict(evals)
        result["predict"] = {
            "shape": list(pred.predictions.shape),
            "logits": pred.predictions.tolist(),
        }
    if spec.get("save"):
        trainer.save_model(spec["save"])
    rank = int(os.environ.get("RANK", "0"))
    if spec.get("batches"):
        seen = [b["input_ids"].sum(dim=1).tolist() for b in trainer.get_train_dataloader()]
        (out / f"batches_{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))


def count_fsdp2_bytes(trainer) -> dict[str, int]:
    """Bytes this rank sends in FSDP2's collectives inside the training steps (the
    all-gathers: ``(n-1)`` times the input; the reduce-scatters: ``(n-1)`` times the
    output; tests/distributed/test_plan_fsdp2.py's count), filled in as training runs."""
    import torch.distributed as dist

    sent = {"all_gather": 0, "reduce_scatter": 0}
    if not trainer.args.fsdp or not dist.is_initialized():
        return sent
    n, inside = dist.get_world_size(), [False]
    names = {  # what FSDP2 calls (torch >= 2.13: the *_single names)
        "all_gather": "all_gather_single"
        if hasattr(dist, "all_gather_single")
        else "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor",
    }
    for op, name in names.items():
        real = getattr(dist, name)

        def counted(output, input, *args, _op=op, _real=real, **kwargs):
            if inside[0]:
                t = input if _op == "all_gather" else output
                sent[_op] += (n - 1) * t.numel() * t.element_size()
            return _real(output, input, *args, **kwargs)

        setattr(dist, name, counted)
    step = trainer.training_step

    def training_step(*args, **kwargs):
        inside[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False

    trainer.training_step = training_step
    return sent


def fsdp2_ranks(model) -> int:
    """The size of the shard group of a model sharded by ``fully_shard`` (0: not sharded)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not params or len(params) != len(list(model.parameters())):
        return 0
    return params[0].device_mesh.size()


def checkpointed_layers(model) -> dict[str, int]:
    """Decoder layers whose forward runs under the package's activation checkpointing
    (``models.memory.checkpointed_layer``), and how many of them offload their input."""
    import functools

    seen = [
        vars(m)["forward"]
        for m in model.modules()
        if isinstance(vars(m).get("forward"), functools.partial)
        and vars(m)["forward"].func.__name__ == "checkpointed_layer"
    ]
    return {"layers": len(seen), "offloaded": sum(bool(f.args[1]) for f in seen)}


if __name__ == "__main__":
    main(sys.argv[1])
