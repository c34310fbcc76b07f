"""One GRPOTrainer (or RLOOTrainer) run for tests/launcher/test_grpo.py, started by torchrun (the
sequence-parallel runs, ``SequenceParallelGRPOTrainer``) or plain python (the one-process
reference: TRL's own ``GRPOTrainer``, no DeepSpeed config). Argument: a JSON file with
the run's settings; writes ``<out>/result.json`` (the log history: losses and TRL's
metrics) and, on every rank, ``<out>/completions_<rank>.json`` (the completion ids each
rank trained on).

Spec keys: those of tests/support/dpo_worker.py's runs (``model``, ``tokenizer``, ``out``,
``batch``, ``ga``, ``steps``, ``eval_steps``, ``lr``, ``n_train``, ``n_eval``, ``zero``,
``sp``, ``lora``, ``scale``, ``policy``, ``bare``) and ``trainer`` (``"grpo"``, the
default, or ``"rloo"``: TRL's ``RLOOTrainer``), ``rollout`` (``"func"``: a deterministic
``rollout_func``, the default; ``"generate"``: the model's own sampling), ``grpo``
(GRPOConfig keywords: ``loss_type``, ``beta``, ``num_iterations``, ...), ``skew`` (SP rank
1's ``rollout_func`` returns other completions; with ``generate``, SP rank 1's rows end
after 2 tokens), ``no_broadcast`` (the SP ranks keep their
own completions and rewards: the seen-failing check of the broadcast)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.* importable

EOS = 1


def prompt_rows(n: int, seed: int) -> list[dict]:
    """Prompts of 2 to 7 words ``t3`` .. ``t95`` (so the batch's rows pad on the left)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 8, (1,), generator=g))
        rows.append(
            {"prompt": " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (k,), generator=g))}
        )
    return rows


def rollout(skew: bool, max_len: int):
    """A ``rollout_func``: for each prompt (repeated num_generations times in the batch) a
    completion drawn from its own generator, seeded by the prompt, which of its repeats it
    is and the step (so a run over data-parallel replicas draws the one-process
    completions): 1 to ``max_len`` tokens, some ending in EOS, some truncated."""

    def rollout_func(prompts: list, trainer) -> dict:
        tok = trainer.processing_class
        prompt_ids, completion_ids = [], []
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            repeat = prompts[:i].count(prompt)
            seed = (
                sum(ids) * 131 + repeat * 7 + trainer.state.global_step * 1009 + (99 if skew else 0)
            )
            g = torch.Generator().manual_seed(seed)
            n = int(torch.randint(1, max_len + 1, (1,), generator=g))
            completion = torch.randint(3, 96, (n,), generator=g).tolist()
            if n < max_len or repeat % 3 == 0:
                completion[-1] = EOS
            prompt_ids.append(ids)
            completion_ids.append(completion)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout_func


def reward_small_words(completions: list[str], **kwargs) -> list[float]:
    """The share of words below t50."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) < 50 for w in words) / max(len(words), 1))
    return out


def reward_length(completions: list[str], **kwargs) -> list[float]:
    return [0.1 * len(text.split()) for text in completions]


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    sp = spec.get("sp")
    rank = int(os.environ.get("RANK", "0"))
    if sp is not None and not spec.get("bare"):
        import ulysses_cp as ucp

        ucp.init_distributed()
    runs = spec.get("grpo", {})
    trained = [
        train(spec, settings, rank) for settings in (runs if isinstance(runs, list) else [runs])
    ]
    histories = [history for history, _ in trained]
    if rank == 0:
        result = {"sp": sp is not None, "history": histories[0], "histories": histories}
        result["params"] = [params for _, params in trained]
        (out / "result.json").write_text(json.dumps(result))


def train(spec: dict, settings: dict, rank: int) -> tuple[list[dict], dict]:
    """One training run with GRPOConfig ``settings`` (``trainer`` among them: this run's
    kind, else the spec's): its log history and :func:`param_digest`."""
    import datasets
    import transformers
    import trl

    from tests.support.hf_trainer_worker import lora_config, make_trainer, training_arguments

    out, sp = Path(spec["out"]), spec.get("sp")
    grpo = {
        "beta": 0.1,
        "num_generations": 4,
        "max_completion_length": 8,
        "temperature": 0.9,
        **settings,
    }
    # "rloo": TRL's RLOOTrainer (the same arguments)
    kind = grpo.pop("trainer", spec.get("trainer", "grpo"))
    config_class = trl.RLOOConfig if kind == "rloo" else trl.GRPOConfig

    def policy():
        return transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], dtype=torch.float32, attn_implementation="sdpa"
        )

    # bare: the Trainer's Accelerate starts torch.distributed (on CPU without DeepSpeed's
    # comm), so the script loads its policy before the config
    model = policy() if spec.get("bare") and spec.get("policy") != "path" else None
    args = config_class(**training_arguments({"lr": 1.0, **spec}), **grpo)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(spec["tokenizer"])
    if spec.get("policy") == "path":  # TRL builds it (partitioned under ZeRO-3)
        model = spec["model"]
    elif model is None:  # after the config: under ZeRO-3 built partitioned
        model = policy()
    peft_config = lora_config(spec)
    train_rows = datasets.Dataset.from_list(prompt_rows(spec["n_train"], 1))
    evals = datasets.Dataset.from_list(prompt_rows(spec["n_eval"], 2))
    rollout_func = None
    sp_rank = rank % (sp["ulysses_degree"] * sp.get("ring_degree", 1)) if sp else 0
    if spec.get("rollout", "func") == "func":
        rollout_func = rollout(
            bool(spec.get("skew")) and sp_rank == 1, grpo["max_completion_length"]
        )
    if sp is None:  # the reference: TRL's own class
        trainer_class = trl.RLOOTrainer if kind == "rloo" else trl.GRPOTrainer
    else:
        import ulysses_cp.integrations.hf_trainer as ours_module

        name = "RLOO" if kind == "rloo" else "GRPO"
        trainer_class = getattr(ours_module, f"SequenceParallel{name}Trainer")

        if spec.get("no_broadcast"):
            import ulysses_cp.integrations.hf_trainer.rollouts as ours

            ours.broadcast_from_sp_root = lambda obj, topo: obj
    extra = {} if rollout_func is None else {"rollout_func": rollout_func}  # RLOO has none
    extra.update(processing_class=tok, peft_config=peft_config)
    rewards = [reward_small_words, reward_length]
    trainer = make_trainer(
        trainer_class, spec, model, args, train_rows, evals, reward_funcs=rewards, **extra
    )
    if spec.get("skew") and sp_rank == 1 and rollout_func is None:
        # generate: SP rank 1's rows end after 2 tokens, so it finishes before rank 0
        trainer.generation_config.max_new_tokens = 2
    seen: list[list[int]] = []
    score = trainer._generate_and_score_completions

    def recorded(inputs):
        batch = score(inputs)
        seen.extend(batch["completion_ids"].tolist())
        return batch

    trainer._generate_and_score_completions = recorded
    trainer.train()
    (out / f"completions_{rank}.json").write_text(json.dumps(seen))
    return trainer.state.log_history, param_digest(trainer.model)


def param_digest(model) -> dict[str, list[float]]:
    """Each parameter's norm and its dot with a fixed random tensor (float64; FSDP2's
    shards gathered whole, collective): what the final weights are, to compare runs."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        full = full.detach().double()
        g = torch.Generator().manual_seed(len(out))
        probe = torch.randn(full.shape, generator=g, dtype=torch.float64)
        out[name] = [float(full.norm()), float((full * probe).sum())]
    return out


if __name__ == "__main__":
    main(sys.argv[1])
