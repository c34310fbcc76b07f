"""TRL's fused-head call under sequence parallelism (ulysses_cp/integrations/hf_trainer/
log_prob_head.py) against TRL's own fused head on one process: rows padded on the right
(DPO) and on the left (RL prompts), every per-token output, the loss's gradients summed
over the SP ranks, and the full logits of a plain call."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.helpers import HF_TINY, topology

pytest.importorskip("trl")

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _batch() -> dict:
    """Four rows of 14 tokens: right padding (2 rows), left padding (2 rows: prompts of
    different lengths), labels on the completion only."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 96, (4, 14), generator=g)
    mask = torch.ones(4, 14, dtype=torch.long)
    mask[0, 11:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    mask[3, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :7] = -100  # the prompt (and the left padding)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _weights(shape) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, shape.numel()).view(shape)


def _case(rank, u, r, left_aligned):
    from ulysses_cp.integrations.hf_trainer import log_prob_head

    kept = log_prob_head._left_aligned
    if not left_aligned:  # the check below fails without moving left padding
        log_prob_head._left_aligned = lambda batch: None  # type: ignore[assignment]
    try:
        return _compare(u, r)
    finally:
        log_prob_head._left_aligned = kept


def _compare(u, r):
    import torch.distributed as dist
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    from ulysses_cp.config import SequenceParallelConfig
    from ulysses_cp.integrations.hf_trainer import log_prob_head
    from ulysses_cp.integrations.hf_trainer.run import SequenceParallelRun

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**HF_TINY)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = copy.deepcopy(ref)
    add_fused_lm_head(ref, outputs=OUTPUTS)
    batch = _batch()
    want = ref(**batch, use_cache=False, fused_lm_head=True)
    loss = (_weights(want.log_probs.shape) * want.log_probs).sum() + want.entropy.sum()
    loss.backward()
    with torch.no_grad():
        plain = {k: v for k, v in batch.items() if k != "labels"}
        want_logits = type(ref).forward(ref, **plain).logits  # the model's own forward

    run = SequenceParallelRun(topo=topology(u, r), config=SequenceParallelConfig())
    run.attach(model, lean=False)
    run.probe()
    log_prob_head.install(model, run, run.wrapper)
    got = model(**batch, use_cache=False, fused_lm_head=True)
    sp_loss = (_weights(got.log_probs.shape) * got.log_probs).sum() + got.entropy.sum()
    sp_loss.backward()
    grads = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g, group=run.topo.sp_group)  # the SP ranks' shares
        grads[name] = (g, q.grad)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    outs = {n: (getattr(got, n).detach(), getattr(want, n).detach()) for n in OUTPUTS}
    return (
        outs,
        (sp_loss.item(), loss.item()),
        grads,
        (logits, want_logits, batch["attention_mask"]),
    )


@pytest.mark.parametrize("u,r", [(2, 1), (2, 2)])
def test_fused_head_call_equals_trl_on_one_process(pools, u, r):
    for outs, (sp_loss, ref_loss), grads, (logits, want, mask) in pools(u * r).run(
        _case, u, r, True
    ):
        for name, (got, ref) in outs.items():
            assert got.shape == ref.shape == (4, 13), name
            if name == "is_top1":
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got.float(), ref.float(), rtol=1e-5, atol=1e-5)
        assert sp_loss == pytest.approx(ref_loss, rel=1e-5)
        for name, (g, q) in grads.items():
            torch.testing.assert_close(g, q, rtol=1e-4, atol=1e-6, msg=name)
        real = mask.bool()
        torch.testing.assert_close(logits[real], want[real], rtol=1e-5, atol=1e-5)


def test_left_padding_is_refused_without_moving_it(pools):
    """Without moving left padding to the row's end, the shard refuses the batch."""
    with pytest.raises(Exception, match="end \\(right\\) padding only"):
        pools(2).run(_case, 2, 1, False)
