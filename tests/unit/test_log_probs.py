"""The log-prob primitive (ulysses_cp/models/log_probs.py) against plain float64 autograd
through ``log_softmax`` (one process, whole rows): values of every output and the
gradients of a loss that weighs log-probs and entropies; under sequence parallelism a
DPO-style loss of the gathered values, whose SP-summed gradients equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.helpers import topology
from ulysses_cp.models.hf_head import HeadTransform, LMHead
from ulysses_cp.models.log_probs import (
    kl_to_reference,
    sequence_log_probs,
    sequence_sums,
    token_log_probs,
)

V, D = 40, 12


def _head(transform: HeadTransform, bias: bool = True) -> LMHead:
    torch.manual_seed(3)
    linear = torch.nn.Linear(D, V, bias=bias, dtype=torch.float64)
    return LMHead(linear, transform)


def _reference(hidden, head: LMHead, labels, temperature: float):
    """Every output from the full logits (the definition)."""
    z = head.transform.apply(head.linear(hidden).double()) / temperature
    logp = F.log_softmax(z, dim=-1)
    valid = labels != -100
    target = labels.clamp(min=0)
    out = {
        "log_probs": logp.gather(-1, target[..., None]).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logp, dim=-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == target,
    }
    return {k: v.masked_fill(~valid, 0) for k, v in out.items()}


def _objective(out: dict) -> torch.Tensor:
    """A loss that weighs every token differently (so a wrong per-token gradient shows)."""
    w = torch.linspace(0.5, 2.0, out["log_probs"].numel(), dtype=torch.float64)
    w = w.view(out["log_probs"].shape)
    return (w * out["log_probs"]).sum() + 0.3 * (w.flip(-1) * out["entropy"]).sum()


CASES = [
    (HeadTransform(), 1.0, 1),
    (HeadTransform(scale=0.5), 0.7, 3),
    (HeadTransform(scale=2.0, softcap=3.0), 1.3, 4),
]


@pytest.mark.parametrize("transform,temperature,tiles", CASES)
def test_token_log_probs_against_log_softmax(transform, temperature, tiles):
    head = _head(transform)
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (2, 9))
    labels[0, 2] = labels[1, 8] = -100
    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    out = token_log_probs(hidden, head, labels, temperature=temperature, tiles=tiles, outputs=names)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = _reference(ref_hidden, head, labels, temperature)
    for name in names:
        torch.testing.assert_close(out[name], ref[name], rtol=1e-12, atol=1e-12)
    assert out["log_probs"][0, 2] == 0 and out["entropy"][1, 8] == 0
    grads = torch.autograd.grad(_objective(out), [hidden, head.linear.weight, head.linear.bias])
    ref_grads = torch.autograd.grad(
        _objective(ref), [ref_hidden, head.linear.weight, head.linear.bias]
    )
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_token_log_probs_refusals():
    head = _head(HeadTransform())
    hidden = torch.randn(1, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="must include 'log_probs'"):
        token_log_probs(hidden, head, torch.zeros(1, 4, dtype=torch.long), outputs=("entropy",))
    with pytest.raises(ValueError, match="agree in"):
        token_log_probs(hidden, head, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(hidden, head, torch.zeros(1, 4, dtype=torch.long), temperature=0)


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(kl_to_reference(lp, ref, kind="k1"), lp - ref)
    torch.testing.assert_close(kl_to_reference(lp, ref, kind="k2"), (lp - ref) ** 2 / 2)
    torch.testing.assert_close(kl_to_reference(lp, ref), torch.exp(ref - lp) - (ref - lp) - 1)
    with pytest.raises(ValueError, match="k3"):
        kl_to_reference(lp, ref, kind="k4")  # type: ignore[arg-type]


# ---------------------------------------------------------------- under sequence parallelism

S = 16


def _dpo_like(chosen: torch.Tensor, rejected: torch.Tensor, ref_margin: float) -> torch.Tensor:
    return -F.logsigmoid(0.7 * (chosen - rejected - ref_margin)).mean()


def _sp_case(rank, u, r, layout, scale_bug):
    """DPO-style loss from the gathered log-probs and from the sequence sums, on a shard
    of hidden states; returns (losses, SP-summed grads, reference losses, grads)."""
    import torch.distributed as dist

    P = u * r  # the Trainer's grad_scale: DeepSpeed averages over the SP ranks too
    topo = topology(u, r, layout, grad_scale=float(2 * P if scale_bug else P))
    head = _head(HeadTransform(softcap=4.0))
    torch.manual_seed(1)
    hidden = torch.randn(4, S, D, dtype=torch.float64)  # rows: 2 chosen, then 2 rejected
    ids = torch.randint(0, V, (4, S))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt
    labels[1, 12:] = -100  # a shorter completion (end padding)
    # one process: the whole rows, shifted labels
    shift = torch.cat([labels[:, 1:], torch.full((4, 1), -100)], dim=1)
    h_ref = hidden.clone().requires_grad_(True)
    ref = token_log_probs(h_ref, head, shift)["log_probs"].sum(1)
    ref_loss = _dpo_like(ref[:2], ref[2:], 0.1)
    ref_grads = torch.autograd.grad(ref_loss, [h_ref, head.linear.weight])
    # sequence parallel: this rank's tokens
    local = ucp.shard_batch({"input_ids": ids, "labels": labels}, topo)
    idx = ucp.shard_sequence(torch.arange(S)[None], topo, dim=1)[0]
    h = hidden[:, idx].clone().requires_grad_(True)
    out = sequence_log_probs(h, head, local["shift_labels"], topo)["log_probs"]
    gathered = out.sum(1)
    loss_a = _dpo_like(gathered[:2], gathered[2:], 0.1)
    ga = torch.autograd.grad(loss_a, [h, head.linear.weight])
    lp = token_log_probs(h, head, local["shift_labels"])["log_probs"]
    sums, counts = sequence_sums(lp, local["shift_labels"] != -100, topo)
    loss_b = _dpo_like(sums[:2], sums[2:], 0.1)
    gb = torch.autograd.grad(loss_b, [h, head.linear.weight])
    results = []
    for loss, (gh, gw) in ((loss_a, ga), (loss_b, gb)):
        full_h = torch.zeros_like(hidden)
        full_h[:, idx] = gh / P
        gw = gw / P
        dist.all_reduce(full_h, group=topo.sp_group)
        dist.all_reduce(gw, group=topo.sp_group)
        results.append((loss.item(), full_h, gw))
    true_counts = (shift != -100).sum(1).double()
    return results, ref_loss.item(), ref_grads, counts, true_counts, out.shape
