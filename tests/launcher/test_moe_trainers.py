"""MoE models through the Trainer subclasses, against their parents on one process (float32,
SGD): tiny Qwen3-MoE and Mixtral with the load-balancing loss on (coefficient 0.5). The
losses, and TRL's logged ``aux_loss`` where the parent logs it, equal one process: the
term is taken over the whole sequence, padding excluded, and added as each parent adds it
(``Trainer``: in the model's loss; SFT: unscaled, over the accumulation steps; DPO, GRPO,
RLOO: their own ``router_aux_loss_coef``)."""

from __future__ import annotations

import pytest

from tests.launcher.test_dpo import WORKER as DPO_WORKER
from tests.launcher.test_dpo import assert_lines_equal
from tests.launcher.test_dpo import spec as dpo_spec
from tests.launcher.test_grpo import WORKER as GRPO_WORKER
from tests.launcher.test_grpo import assert_same_logs as assert_same_rl_logs
from tests.launcher.test_grpo import spec as grpo_spec
from tests.launcher.test_hf_trainer import (
    U2,
    U2R2,
    assert_same_losses,
    ref_and_sp,
    side_by_side,
    trainer_assets,
)

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    return trainer_assets(tmp_path_factory.mktemp("moe_assets"))


def _aux(history: list[dict]) -> list[float]:
    """The logged aux losses: the training lines', then the evaluation's."""
    return [h[k] for k in ("aux_loss", "eval_aux_loss") for h in history if k in h]


def test_trainer_moe_padded_rows_u2_zero2_equals_one_process(assets, tmp_path):
    """Trainer, Qwen3-MoE, rows of different lengths padded on the right (the padding is
    out of the router statistics on both sides), Ulysses 2, ZeRO-2: losses and eval loss
    (both with the aux term, as the model's own loss has it) equal one process."""
    sp_only = dict(zero=2, sp=U2)
    ref, sp = ref_and_sp("trainer", "qwen3_moe", assets, tmp_path, sp_only, ragged=True)
    assert_same_losses(*side_by_side(tmp_path, ref, sp, nproc=2))


def test_trainer_mixtral_u2r2_zero3_equals_one_process(assets, tmp_path):
    sp_only = dict(zero=3, sp=U2R2)
    ref, sp = ref_and_sp("trainer", "mixtral", assets, tmp_path, sp_only)
    assert_same_losses(*side_by_side(tmp_path, ref, sp, nproc=4))


def test_sft_moe_packed_u2_zero2_equals_one_process(assets, tmp_path):
    """SFTTrainer, packed rows, Qwen3-MoE, Ulysses 2: losses and TRL's ``aux_loss``."""
    sp_only = dict(zero=2, sp=U2, model_block={"lean_norms": False})
    ref, sp = ref_and_sp("sft", "qwen3_moe", assets, tmp_path, sp_only)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2)
    assert_same_losses(ref_result, sp_result)
    want, got = _aux(ref_result["history"]), _aux(sp_result["history"])
    assert len(want) == 4 and got == pytest.approx(want, rel=1e-5)


def test_dpo_moe_u2_zero2_equals_one_process(assets, tmp_path):
    """DPOTrainer, Qwen3-MoE, TRL's reference from the policy's path: every logged value
    (``aux_loss`` included) equals one process."""
    kw = dict(model=assets["qwen3_moe"], lr=0.5)  # lr 1.0: float32 noise near 1e-5 at step 3
    ref = dpo_spec(assets, tmp_path / "ref", **kw)
    sp = dpo_spec(assets, tmp_path / "sp", zero=2, sp=U2, **kw)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2, worker=DPO_WORKER)
    from tests.launcher.test_dpo import _logged

    ref_lines, sp_lines = _logged(ref_result["history"]), _logged(sp_result["history"])
    assert "aux_loss" in ref_lines[0]
    assert_lines_equal(ref_lines, sp_lines)


def test_grpo_moe_u2_zero2_equals_one_process(assets, tmp_path):
    """GRPOTrainer (a ``rollout_func``), Qwen3-MoE: TRL asks for the router logits per call
    (``qwen3_moe_rl``'s config has them off) and adds its coefficient times the aux loss."""
    ref = grpo_spec(assets, tmp_path / "ref", model=assets["qwen3_moe_rl"])
    sp = grpo_spec(assets, tmp_path / "sp", model=assets["qwen3_moe_rl"], zero=2, sp=U2)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2, worker=GRPO_WORKER)
    assert any("aux_loss" in h for h in ref_result["histories"][0])
    assert_same_rl_logs(ref_result, sp_result)


def test_rloo_moe_u2_zero2_equals_one_process(assets, tmp_path):
    kw = dict(model=assets["qwen3_moe_rl"], trainer="rloo", rollout="generate")
    ref = grpo_spec(assets, tmp_path / "ref", **kw)
    sp = grpo_spec(assets, tmp_path / "sp", zero=2, sp=U2, **kw)
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2, worker=GRPO_WORKER)
    assert any("aux_loss" in h for h in ref_result["histories"][0])
    assert_same_rl_logs(ref_result, sp_result)


def test_train_py_moe_u2r2_equals_one_process(tmp_path):
    """train.py's Hugging Face path on a tiny Qwen3-MoE (load-balancing loss at 0.5),
    Ulysses 2 x ring 2, ZeRO-2, SGD, with checkpointed layers, MLP tiles and the fused
    head: each step's loss and ``aux_loss`` in metrics.jsonl equal transformers' own model
    trained in this process on the same batches (cross-entropy + 0.5 x its aux loss)."""
    import torch
    import transformers

    from tests.support.helpers import launch, metrics, run_config, write_config
    from ulysses_cp.config import DataConfig
    from ulysses_cp.training.data import KVRecall, global_batch

    folder = tmp_path / "qwen3_moe"
    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32)
    heads = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    moe = dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    cfg = transformers.Qwen3MoeConfig(**sizes, **heads, **moe, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    data = {"task": "kv_recall", "seq_len": 64, "n_queries": 8}
    model = {"hf_config": str(folder), "hf_weights": str(folder), "tiled_mlp": 2}
    model.update(activation_checkpointing=True, fused_loss=True)
    run = run_config(
        2,
        2,
        2,
        micro_batch=2,
        optimizer={"type": "SGD", "params": {"lr": 0.5}},
        model=model,
        data=data,
        training={"max_steps": 3, "log_interval": 1, "save_interval": 0},
    )
    launch(write_config(tmp_path, run), tmp_path / "run", num_gpus=4)
    rows = metrics(tmp_path / "run")

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = KVRecall(DataConfig(**data))
    want = []
    for step in range(3):
        batch = global_batch(
            dataset, step=step, micro_step=0, grad_accum=1, micro_batch=2, dp_rank=0, dp_degree=1
        )
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        ce = torch.nn.functional.cross_entropy(
            out.logits.float().flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100
        )
        loss = ce + 0.5 * out.aux_loss
        want.append((loss.item(), out.aux_loss.item()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = [(r["loss"], r["aux_loss"]) for r in rows]
    assert len(got) == 3 and want[0][0] != want[-1][0]
    flat = [x for pair in got for x in pair]
    assert flat == pytest.approx([x for pair in want for x in pair], rel=1e-5), (got, want)
