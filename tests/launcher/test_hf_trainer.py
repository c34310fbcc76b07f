"""SequenceParallelTrainer / SequenceParallelSFTTrainer against one-process runs of their
parents (transformers' sdpa attention, the same global batch, float32, SGD so a wrong
gradient scale shows): training and eval losses within 1e-5 relative; the saved folder is
a plain Hugging Face model. Each case runs tests/support/hf_trainer_worker.py: torchrun for the
sequence-parallel run, plain python for the reference, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import HF_TINY
from tests.support.zygote import finish_ranks, start_ranks

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("peft")

WORKER = Path(__file__).parents[1] / "support" / "hf_trainer_worker.py"
RTOL = 1e-5
U2 = {"ulysses_degree": 2, "ring_degree": 1}
U2R2 = {"ulysses_degree": 2, "ring_degree": 2}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    return trainer_assets(tmp_path_factory.mktemp("hf_trainer_assets"))


def trainer_assets(root: Path) -> dict[str, str]:
    """A tiny Llama, a tiny Qwen3, a tiny Qwen3-MoE and Mixtral (4 experts, top-2, their
    load-balancing loss on at coefficient 0.5; ``qwen3_moe_rl`` with it off in the config;
    saved, so every run starts from the same weights) and a word-level tokenizer of their
    96 tokens, in ``root`` (also tests/launcher/test_dpo.py's)."""
    import tokenizers
    import transformers

    moe = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_experts_per_tok=2)
    out = {}
    for name, cfg in (
        ("llama", transformers.LlamaConfig(**HF_TINY)),
        ("qwen3", transformers.Qwen3Config(**HF_TINY, head_dim=8)),
        (
            "qwen3_moe",
            transformers.Qwen3MoeConfig(
                **HF_TINY, **moe, head_dim=8, num_experts=4, moe_intermediate_size=32
            ),
        ),
        ("mixtral", transformers.MixtralConfig(**HF_TINY, **moe, num_local_experts=4)),
        (  # its config without router logits: transformers' generate fails with them on;
            # TRL's RL trainers ask for them per call
            "qwen3_moe_rl",
            transformers.Qwen3MoeConfig(
                **HF_TINY,
                **{**moe, "output_router_logits": False},
                head_dim=8,
                num_experts=4,
                moe_intermediate_size=32,
            ),
        ),
    ):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / name)
        out[name] = str(root / name)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, 96)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(root / "tokenizer")
    out["tokenizer"] = str(root / "tokenizer")
    return out


def spec(kind: str, model: str, assets: dict, out: Path, **extra) -> dict:
    base = {
        "trainer": kind,
        "model": assets[model],
        "tokenizer": assets["tokenizer"],
        "vocab": 96,
        "batch": 2,
        "ga": 2,
        "steps": 3,
        "eval_steps": 3,
        "lr": 2.0,
    }
    if kind == "sft":  # packed rows of documents whose lengths split over 4 ranks (zigzag)
        base.update(n_train=40, n_eval=8, max_length=32, multiple=8)
    else:
        base.update(n_train=24, n_eval=4, length=32)
    return {**base, "out": str(out), **extra}


def ref_and_sp(
    kind: str, model: str, assets: dict, tmp_path: Path, sp_only: dict, *, save=False, **both
) -> tuple[dict, dict]:
    """The specs of the reference and of the SP run (with ``sp_only``), both with ``both``,
    out in ``tmp_path``'s ref/ and sp/; ``save``: each saves its model to ref_model/, sp_model/."""
    specs = []
    for name, extra in (("ref", {}), ("sp", sp_only)):
        saved = {"save": str(tmp_path / f"{name}_model")} if save else {}
        specs.append(spec(kind, model, assets, tmp_path / name, **both, **saved, **extra))
    return specs[0], specs[1]


def side_by_side(
    tmp_path: Path, ref: dict, sp: dict, nproc: int, worker: Path = WORKER
) -> tuple[dict, dict]:
    """The reference (one process) and the sequence-parallel run of ``worker`` (also
    tests/support/dpo_worker.py), at the same time."""
    paths = []
    for name, s in (("ref", ref), ("sp", sp)):
        Path(s["out"]).mkdir(parents=True, exist_ok=True)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(s))
        paths.append(path)
    runs = [
        start_ranks(worker, str(paths[0]), nproc=1, logs=tmp_path / "logs", name="ref"),
        start_ranks(worker, str(paths[1]), nproc=nproc, logs=tmp_path / "logs", name="sp"),
    ]
    finish_ranks(runs)
    ref_result = json.loads((Path(ref["out"]) / "result.json").read_text())
    sp_result = json.loads((Path(sp["out"]) / "result.json").read_text())
    return ref_result, sp_result


def assert_same_losses(ref: dict, sp: dict) -> None:
    assert sp["sp"] and not ref["sp"]
    assert len(sp["loss"]) == len(ref["loss"]) == 3 and len(sp["eval_loss"]) == 1
    torch.testing.assert_close(
        torch.tensor(sp["loss"]), torch.tensor(ref["loss"]), rtol=RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(sp["eval_loss"]), torch.tensor(ref["eval_loss"]), rtol=RTOL, atol=0
    )
    assert ref["loss"][0] != ref["loss"][-1]  # the steps changed the model


# the tiny Llama's RMSNorms: two per decoder layer and the final one
LLAMA_NORMS = 2 * HF_TINY["num_hidden_layers"] + 1


def assert_lean_norms(sp: dict, ref: dict, *, taken: int) -> None:
    """``taken`` RMSNorms of the SP run had the lean forward (so the losses above were
    compared with them); the plain Trainer's had none."""
    assert sp["lean_norms"] == taken, sp["lean_norms"]
    assert ref["lean_norms"] == 0


def assert_plain_folders(ref_dir: Path, sp_dir: Path) -> None:
    """The SP run's saved folder is a plain transformers model with the reference's logits."""
    import transformers

    text = (sp_dir / "config.json").read_text()
    assert "ulysses" not in text, text
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        for d in (ref_dir, sp_dir)
    ]
    assert models[1].config._attn_implementation != "ulysses_cp"
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_logits, sp_logits = (m(input_ids=ids).logits for m in models)
    torch.testing.assert_close(sp_logits, ref_logits, rtol=1e-4, atol=1e-5)


def assert_same_predictions(ref: dict, sp: dict) -> None:
    """``trainer.predict`` after an evaluation returns every row once (the second loop of
    transformers), with the one-process logits."""
    got, want = sp["predict"], ref["predict"]
    assert got["shape"] == want["shape"], (got["shape"], want["shape"])
    torch.testing.assert_close(
        torch.tensor(got["logits"]), torch.tensor(want["logits"]), rtol=1e-4, atol=1e-5
    )


def test_trainer_u2_zero2_equals_one_process(assets, tmp_path):
    """Trainer, tiny Llama, Ulysses 2, ZeRO-2, gradient accumulation 2: losses, eval loss,
    ``predict`` after the evaluation and the saved folder equal one process."""
    sp_only = dict(zero=2, sp=U2)
    ref, sp = ref_and_sp("trainer", "llama", assets, tmp_path, sp_only, save=True, predict=True)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2)
    assert_same_losses(ref_result, sp_result)
    assert_same_predictions(ref_result, sp_result)
    assert_lean_norms(sp_result, ref_result, taken=LLAMA_NORMS)
    assert_plain_folders(tmp_path / "ref_model", tmp_path / "sp_model")


def test_sft_packed_u2_zero2_equals_one_process(assets, tmp_path):
    """TRL SFTTrainer with packing=True (position ids restarting per document), tiny
    Qwen3, Ulysses 2, ZeRO-2: losses and eval loss equal one process."""
    sp_only = dict(zero=2, sp=U2, model_block={"lean_norms": False})
    ref, sp = ref_and_sp("sft", "qwen3", assets, tmp_path, sp_only)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2)
    assert_same_losses(ref_result, sp_result)
    assert_lean_norms(sp_result, ref_result, taken=0)  # switched off in the DeepSpeed JSON


def assert_data_parallel_batches(out: Path, *, world: int, sp_size: int, rows: int) -> None:
    """The SP ranks of a replica read the same batches, the replicas distinct ones, and
    together every row once (``batches_<rank>.json``: row sums of each rank's batches)."""
    seen = [json.loads((out / f"batches_{r}.json").read_text()) for r in range(world)]
    replicas = [seen[d * sp_size] for d in range(world // sp_size)]
    for r in range(world):
        assert seen[r] == replicas[r // sp_size], f"rank {r} of replica {r // sp_size}"
    flat = [sorted(x for batch in rep for x in batch) for rep in replicas]
    assert sum(len(f) for f in flat) == rows
    for a in range(len(flat)):
        for b in range(a + 1, len(flat)):
            assert flat[a] != flat[b], f"replicas {a} and {b} read the same rows"


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_trainer_qwen3_u2_dp2_equals_one_process(assets, tmp_path, zero):
    """Trainer, tiny Qwen3, Ulysses 2 x data parallel 2 (4 ranks), ZeRO 1-3: each replica
    takes one row per micro-batch, so the global batch is the one-process run's two rows
    x gradient accumulation 2; the replicas read distinct rows, the SP ranks the same."""
    sp_only = dict(zero=zero, batch=1, batches=True, sp=U2)
    ref, sp = ref_and_sp("trainer", "qwen3", assets, tmp_path, sp_only, predict=True)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=4)
    assert_same_losses(ref_result, sp_result)
    assert_same_predictions(ref_result, sp_result)
    assert_data_parallel_batches(tmp_path / "sp", world=4, sp_size=2, rows=24)


def assert_plain_adapters(base: str, ref_dir: Path, sp_dir: Path, tmp_path: Path) -> None:
    """The SP run's saved LoRA adapter loads with plain peft on the plain base model and
    gives the reference adapter's logits; merged and saved, it is a plain transformers
    model with the same logits."""
    import peft
    import transformers

    assert "ulysses" not in (sp_dir / "adapter_config.json").read_text()
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    logits = []
    for d in (ref_dir, sp_dir):
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(plain, d)
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    with torch.no_grad(), model.disable_adapter():  # the adapter changed the model
        assert not torch.allclose(model(input_ids=ids).logits, logits[1], atol=1e-4)
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, logits[1], rtol=1e-4, atol=1e-5)


def test_trainer_lora_u2_zero0_equals_one_process(assets, tmp_path):
    """Trainer, tiny Llama with a peft LoRA adapter (q, v), Ulysses 2, ZeRO-0: losses and
    eval loss equal one process; the saved adapter loads plainly (and merges) with the
    one-process adapter's logits."""
    lora_case(assets, tmp_path, "llama", zero=0, sp=U2)


def lora_case(assets: dict, tmp_path: Path, model: str, *, zero: int, sp: dict) -> None:
    """A Trainer run with a LoRA adapter against one process: losses, and the adapters."""
    sp_only = dict(zero=zero, sp=sp)
    ref, run = ref_and_sp("trainer", model, assets, tmp_path, sp_only, save=True, lora=True)
    nproc = sp["ulysses_degree"] * sp["ring_degree"]
    assert_same_losses(*side_by_side(tmp_path, ref, run, nproc=nproc))
    assert_plain_adapters(assets[model], tmp_path / "ref_model", tmp_path / "sp_model", tmp_path)


@pytest.mark.slow
def test_sft_llama_u2r2_zero3_equals_one_process(assets, tmp_path):
    """TRL SFTTrainer (packed), tiny Llama, hybrid Ulysses 2 x ring 2 (4 ranks), ZeRO-3:
    the model is built partitioned (TrainingArguments before from_pretrained) and probed
    under ZeRO-3 (its lean norms taken); losses and eval loss equal one-process SFTTrainer,
    and the gathered saved folder is a plain transformers model with the reference's
    logits. (The plain Trainer's hybrid ZeRO-3 path is the same wrapper: its own 4-rank
    case was cut from the suite's time.)"""
    ref, sp = ref_and_sp("sft", "llama", assets, tmp_path, dict(zero=3, sp=U2R2), save=True)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=4)
    assert_same_losses(ref_result, sp_result)
    assert_lean_norms(sp_result, ref_result, taken=LLAMA_NORMS)  # probed on ZeRO-3 partitions
    assert_plain_folders(tmp_path / "ref_model", tmp_path / "sp_model")


@pytest.mark.slow
def test_trainer_qwen3_lora_u2_zero3_equals_one_process(assets, tmp_path):
    """Trainer, tiny Qwen3 with a peft LoRA adapter, Ulysses 2, ZeRO-3 (base model built
    partitioned, adapter added after): losses and eval loss equal one process; the
    gathered adapter loads plainly with the one-process adapter's logits."""
    lora_case(assets, tmp_path, "qwen3", zero=3, sp=U2)
