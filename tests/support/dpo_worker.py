"""One DPOTrainer run for tests/launcher/test_dpo.py, started by torchrun (the sequence-parallel
runs, ``SequenceParallelDPOTrainer``) or plain python (the one-process reference: TRL's own
``DPOTrainer``, no DeepSpeed config). Argument: a JSON file with the run's settings; writes
``<out>/result.json`` (the log history: losses and TRL's metrics).

Spec keys: ``model``, ``tokenizer``, ``out``, ``batch``, ``ga``, ``steps``, ``eval_steps``,
``lr``, ``n_train``, ``n_eval``; optional ``zero`` (DeepSpeed stage), ``sp`` (the
sequence_parallel block), ``lora`` (peft LoRA on q/v: the reference is the adapter off),
``loss_type`` (a list, TRL's names), ``ref`` (``"path"``: TRL builds the reference from
the policy's path, the default; ``"given"``: a second model passed as ``ref_model``),
``precompute`` (``precompute_ref_log_probs``), ``use_weighting``, ``ld_alpha``,
``f_divergence`` (DPOConfig's ``f_divergence_type``), ``policy`` (``"path"``: the policy
given as its folder, built by TRL), ``bare`` (the script does not start torch.distributed
itself: the Trainer's Accelerate does), ``scale`` (multiplies the run's gradient
scale: the seen-failing check), ``long`` (longer completions)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def preference_rows(n: int, seed: int, long: bool = False) -> list[dict]:
    """Prompts and two completions of words ``t3`` .. ``t95`` with lengths that differ
    (so rows pad at the end, and chosen and rejected differ in length)."""
    g = torch.Generator().manual_seed(seed)

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (k,), generator=g))

    hi = 24 if long else 10
    return [
        {"prompt": words(3, 9), "chosen": words(2, hi), "rejected": words(2, hi)} for _ in range(n)
    ]


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.* importable


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    sp = spec.get("sp")
    if sp is not None and not spec.get("bare"):
        import ulysses_cp as ucp

        ucp.init_distributed()
    import datasets
    import transformers
    from trl import DPOConfig

    from tests.support.hf_trainer_worker import lora_config, make_trainer, training_arguments

    def policy():
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], dtype=torch.float32, attn_implementation="sdpa"
        )

    # bare: nothing starts torch.distributed before the config (the Trainer's Accelerate
    # does, on CPU without DeepSpeed's comm), so the script loads its policy first
    model = policy() if spec.get("bare") and spec.get("policy") != "path" else None
    args = DPOConfig(
        **training_arguments({"lr": 1.0, **spec}),
        beta=0.5,
        loss_type=spec.get("loss_type", ["sigmoid"]),
        precompute_ref_log_probs=spec.get("precompute", False),
        label_smoothing=spec.get("label_smoothing", 0.0),
        use_weighting=spec.get("use_weighting", False),
        ld_alpha=spec.get("ld_alpha"),
        f_divergence_type=spec.get("f_divergence", "reverse_kl"),
    )
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(spec["tokenizer"])
    if spec.get("policy") == "path":  # TRL builds it (partitioned under ZeRO-3)
        model = spec["model"]
    elif model is None:  # after the TrainingArguments: under ZeRO-3 built partitioned
        model = policy()
    ref_model = None
    if spec.get("ref") == "given":
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], dtype=torch.float32, attn_implementation="sdpa"
        )
    peft_config = lora_config(spec)
    long = spec.get("long", False)
    train = datasets.Dataset.from_list(preference_rows(spec["n_train"], 1, long))
    evals = datasets.Dataset.from_list(preference_rows(spec["n_eval"], 2, long))
    if spec.get("precompute"):
        # TRL caches the reference log-probs next to the dataset's files, which an
        # in-memory dataset keeps in a temporary folder of each process: save and load
        rank = int(os.environ.get("RANK", "0"))
        for name, ds in (("train", train), ("eval", evals)):
            if rank == 0:
                ds.save_to_disk(out / f"data_{name}")
        if sp is not None:
            import torch.distributed as dist

            dist.barrier()
        train, evals = (datasets.load_from_disk(out / f"data_{n}") for n in ("train", "eval"))
    if sp is None:  # the reference: TRL's own class
        from trl import DPOTrainer as trainer_class
    else:
        from ulysses_cp.integrations.hf_trainer import (
            SequenceParallelDPOTrainer as trainer_class,
        )
    extra = dict(ref_model=ref_model, processing_class=tok, peft_config=peft_config)
    trainer = make_trainer(trainer_class, spec, model, args, train, evals, **extra)
    trainer.train()
    sp_run = getattr(trainer, "sequence_parallel", None)
    result = {"sp": sp_run is not None, "history": trainer.state.log_history}
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
