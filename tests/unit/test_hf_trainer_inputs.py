"""The Trainer integration's input rules that need no process: where the block is read
from, which masks and packed batches are accepted, and the loss's scaling."""

from __future__ import annotations

import json

import pytest
import torch

from ulysses_cp.core.topology import init_topology
from ulysses_cp.integrations.hf_trainer.run import (
    _end_padding_only,
    _packed_bounds,
    model_block_options,
    sequence_parallel_block,
    sequence_parallel_loss,
)

BLOCK = {"ulysses_degree": 2, "ring_degree": 1}


def test_block_from_dict_path_or_none(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "sequence_parallel": BLOCK}))
    assert sequence_parallel_block({"sequence_parallel": BLOCK}) == BLOCK
    assert sequence_parallel_block(str(path)) == BLOCK
    assert sequence_parallel_block({"zero_optimization": {"stage": 2}}) is None
    assert sequence_parallel_block(None) is None
    with pytest.raises(ValueError, match="must be an object"):
        sequence_parallel_block({"sequence_parallel": 2})


def _options(deepspeed) -> tuple[bool, float | None]:
    mc = model_block_options(deepspeed)
    return mc.lean_norms, mc.memory_budget_gb


def test_model_block_options(tmp_path):
    """Lean norms on unless ``"model": {"lean_norms": false}``, the budget as given (None
    by default); train.py's keys about building the model (which the Trainer would skip),
    a non-boolean and a budget that is not a positive number are refused with the key
    named. (The memory features the Trainer now takes: tests/test_trainer_memory.py.)"""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"sequence_parallel": BLOCK, "model": {"lean_norms": False}}))
    assert _options(str(path)) == (False, None)
    assert _options({"sequence_parallel": BLOCK}) == (True, None)
    assert _options({"model": {"memory_budget_gb": 2}}) == (True, 2.0)
    assert _options(None) == (True, None)
    with pytest.raises(ValueError, match=r"takes only .*\['dtype'\]"):
        model_block_options({"model": {"lean_norms": True, "dtype": "bfloat16"}})
    with pytest.raises(ValueError, match="lean_norms must be true or false, got 'no'"):
        model_block_options({"model": {"lean_norms": "no"}})
    for bad in (0, -1):
        with pytest.raises(ValueError, match="memory_budget_gb must be the GiB > 0"):
            model_block_options({"model": {"memory_budget_gb": bad}})
    for bad in ("8", True):  # train.py's model block's message
        with pytest.raises(ValueError, match=r"memory_budget_gb must be a number or null, got"):
            model_block_options({"model": {"memory_budget_gb": bad}})
    with pytest.raises(ValueError, match="model must be an object"):
        model_block_options({"model": 3})


def test_right_padding_drops_targets_left_padding_is_refused():
    labels = torch.arange(6).expand(2, 6).clone()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    out = _end_padding_only(mask, labels)
    assert out[0].tolist() == [0, 1, 2, 3, -100, -100] and out[1].tolist() == list(range(6))
    with pytest.raises(ValueError, match="right"):
        _end_padding_only(torch.tensor([[0, 1, 1, 1, 1, 1]]), labels[:1])


def test_packed_rows_one_per_batch():
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    assert _packed_bounds(pos).tolist() == [0, 4, 8]
    assert _packed_bounds(torch.arange(8)[None]) is None
    with pytest.raises(ValueError, match="one row per batch"):
        _packed_bounds(pos.expand(2, 8))


@pytest.mark.parametrize("num_items", [None, 5.0])
def test_loss_value_and_gradient_scale(num_items):
    """One rank (no communication): the value is the Trainer's (sum / count, times the
    replicas); the gradient is the value's times the run's grad_scale."""
    topo = init_topology(1, 1, grad_scale=3.0)
    logits = torch.randn(1, 4, 7, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 3]])
    loss = sequence_parallel_loss(logits, labels, topo, num_items_in_batch=num_items, value_scale=2)
    ce = torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    want = 2 * ce / (3 if num_items is None else num_items)
    torch.testing.assert_close(loss, want)
    (g,) = torch.autograd.grad(loss, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g, 3 * g_want)


def test_image_batches_of_other_families_and_positions_are_refused():
    """An image batch is padded with its tokens (mm_token_type_ids too, images as they are);
    a family whose image batches are not pinned, position_ids and unknown keys are refused
    naming what to do."""
    from ulysses_cp.models.hf_vision import vision_batch

    ids = torch.arange(6)[None]
    batch = {"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(4, 12)}
    batch["mm_token_type_ids"] = torch.ones_like(ids)
    out = vision_batch(batch, "qwen2_5_vl", 4, ignored=frozenset({"attention_mask"}))
    assert out["input_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 0]]
    assert out["mm_token_type_ids"].tolist() == [[1] * 6 + [0, 0]]
    assert out["pixel_values"] is batch["pixel_values"] and "labels" not in out
    with pytest.raises(ValueError, match=r"'gemma3' is not one.*'qwen3_vl', 'internvl'"):
        vision_batch(batch, "gemma3", 4, ignored=frozenset())
    with pytest.raises(ValueError, match="takes no position_ids"):
        vision_batch({**batch, "position_ids": ids}, "qwen3_vl", 4, ignored=frozenset())
    with pytest.raises(ValueError, match="it also has 'foo'"):
        vision_batch({**batch, "foo": ids}, "qwen3_vl", 4, ignored=frozenset())


def test_the_budget_reaches_the_wrappers():
    """The model block's budget sizes the policy's and a reference model's "auto" log-prob
    tiles (their wrappers'); without one, on CPU, there is none."""
    import transformers

    from tests.support.helpers import HF_TINY
    from ulysses_cp.config import SequenceParallelConfig
    from ulysses_cp.integrations.hf_trainer.run import SequenceParallelRun

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_TINY))

    for given, want in ((0.5, 0.5), (None, None if not torch.cuda.is_available() else "gpu")):
        run = SequenceParallelRun(topo=init_topology(1, 1), config=SequenceParallelConfig())
        block = model_block_options({"model": {"tiled_mlp": "auto", "memory_budget_gb": given}})
        run.attach(llama(), block)
        ref = run.wrap_model(llama())
        got = {run.wrapper.tiles.budget_bytes, ref.tiles.budget_bytes}
        got = {None if b is None else b / 2**30 for b in got}
        assert got == {want} or (want == "gpu" and len(got) == 1), got


def test_the_language_model_hook_runs_once_per_arming():
    """Armed, the hook hands the language model its tokens and the extra arguments once;
    a length other than the armed batch's is refused; disarmed, nothing changes."""
    from ulysses_cp.models.hf_vision import LanguageModelShard

    seen = []

    class LM(torch.nn.Module):
        def forward(self, inputs_embeds=None, position_ids=None, **kwargs):
            seen.append((inputs_embeds.shape[1], position_ids, sorted(kwargs)))

    lm = LM()
    hook = LanguageModelShard(lm, init_topology(1, 1), "zigzag")
    hook.arm(4, {"ucp_batch": 1})
    lm(inputs_embeds=torch.zeros(2, 4, 3))
    assert seen[-1][0] == 4 and seen[-1][1].tolist() == [[0, 1, 2, 3]] * 2
    assert seen[-1][2] == ["ucp_batch"]
    lm(inputs_embeds=torch.zeros(2, 4, 3))  # used up: as given
    assert seen[-1][1] is None and seen[-1][2] == []
    hook.arm(4, {})
    with pytest.raises(ValueError, match="got 6 tokens where the image batch had 4"):
        lm(inputs_embeds=torch.zeros(1, 6, 3))
    hook.arm(4, {})
    hook.disarm()
    lm(inputs_embeds=torch.zeros(1, 6, 3))
    assert seen[-1][0] == 6 and seen[-1][1] is None
