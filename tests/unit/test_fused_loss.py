"""``"fused_loss": true``: the LM head's and the loss's gradients computed in the forward
give the loss and EVERY gradient (the head's weight and bias included) of the plain
autograd loss, with a logit scale and a softcap, in one process, under SP (Ulysses 2 and
hybrid 2 x 2, against a one-process transformers model) and under ZeRO 1-3."""

from __future__ import annotations

import os

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import (
    HF_TINY,
    hf_loss_and_grads,
    hf_pair,
    run_config,
    sgd_engine_and_batch,
    topology,
    topology_for,
)
from ulysses_cp.config import HFModelConfig, ModelConfig
from ulysses_cp.models.fused_loss import fused_cross_entropy
from ulysses_cp.models.hf_head import HeadTransform, LMHead
from ulysses_cp.models.lean_norm import lean_norms
from ulysses_cp.models.lean_norm import norm_backward as lean_norm_backward

TOL = dict(rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("transform", [HeadTransform(), HeadTransform(0.7, 3.0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunks", [1, 3])
def test_fused_equals_plain_autograd(transform, bias, chunks):
    """Float64, one process: loss and the gradients of the input, the weight and the bias
    equal ``cross_entropy(transform(linear(x)))`` by autograd, with an incoming gradient of
    2.5 (a weight gradient that ignores it, as ALST's does, is off by 2.5)."""
    topo = ucp.init_topology(1, 1)
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 11, bias=bias).double()
    head = LMHead(linear, transform)
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(11, (2, 13))
    labels[0, :5] = -100
    results = []
    for fused in (False, True):
        x.grad = None
        linear.zero_grad(set_to_none=True)
        if fused:
            loss = fused_cross_entropy(x, head, labels, topo, chunks=chunks)
        else:
            loss = ucp.sequence_parallel_cross_entropy(head(x), labels, topo)
        (2.5 * loss).backward()
        results.append([loss.detach(), x.grad, *(p.grad for p in linear.parameters())])
    assert len(results[1]) == (4 if bias else 3)
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # evaluation: the value alone
        value = fused_cross_entropy(x, head, labels, topo, chunks=chunks)
    torch.testing.assert_close(value, results[0][0], rtol=1e-12, atol=1e-12)


NORMS = [  # transformers' RMSNorm of each lean form (models/lean_norm.py)
    ("llama", "LlamaRMSNorm"),
    ("olmo2", "Olmo2RMSNorm"),
    ("gemma", "GemmaRMSNorm"),
]


def _final_norm(module: str, cls: str, width: int) -> torch.nn.Module:
    import importlib

    C = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    norm = C(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return norm


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("module,cls", NORMS, ids=[n[0] for n in NORMS])
def test_fused_folds_a_lean_final_norm(module, cls, chunks, monkeypatch):
    """``hidden = final_norm(x)`` with a lean norm: the fused loss takes the norm's backward
    into its forward (once per piece) and keeps ``d x`` only. Loss and the gradients of
    ``x``, the norm's weight and the head's weight and bias equal plain autograd through
    the family's own norm (float32, as the norms compute; a logit scale and softcap,
    incoming gradient 2.5), and nothing keeps ``x`` once the loss is computed (the plain
    norm's node does)."""
    import weakref

    from ulysses_cp.models import fused_loss

    topo = ucp.init_topology(1, 1)
    torch.manual_seed(0)
    own = _final_norm(module, cls, 8)
    lean = _final_norm(module, cls, 8)
    assert list(lean_norms(torch.nn.ModuleDict({"norm": lean}))) == ["norm"]
    linear = torch.nn.Linear(8, 11, bias=True)
    head = LMHead(linear, HeadTransform(0.7, 3.0))
    base = torch.randn(2, 13, 8, requires_grad=True)
    labels = torch.randint(11, (2, 13))
    labels[0, :5] = -100
    folds = []
    monkeypatch.setattr(
        fused_loss,
        "norm_backward",
        lambda *a, **k: folds.append(1) or lean_norm_backward(*a, **k),
    )
    results, kept = [], []
    for fused, norm in ((False, own), (True, lean)):
        base.grad = None
        for p in (*linear.parameters(), norm.weight):
            p.grad = None
        x = base * 1.0  # the last layer's output: nothing but the norm keeps it
        if fused:
            loss = fused_cross_entropy(norm(x), head, labels, topo, chunks=chunks, fold_norm=True)
        else:
            loss = ucp.sequence_parallel_cross_entropy(head(norm(x)), labels, topo)
        kept.append(weakref.ref(x))
        del x
        alive = kept[-1]() is not None
        (2.5 * loss).backward()
        grads = (base.grad, norm.weight.grad, *(p.grad for p in linear.parameters()))
        results.append([loss.detach(), *grads, alive])
    assert len(folds) == chunks  # folded, one piece at a time
    assert results[0][-1] and not results[1][-1]  # x kept by the plain norm only
    for plain, fused in zip(results[0][:-1], results[1][:-1]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_a_head_that_is_not_one_linear_is_refused():
    topo = ucp.init_topology(1, 1)
    head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 7))
    with pytest.raises(ValueError, match=r'Sequential.*"fused_loss": false'):
        fused_cross_entropy(torch.randn(1, 4, 4), head, torch.zeros(1, 4).long(), topo)


def test_fused_loss_is_a_model_option():
    assert ModelConfig.from_dict({"fused_loss": True}).fused_loss
    assert HFModelConfig.from_dict({"hf_config": "x", "fused_loss": True}).fused_loss
    with pytest.raises(ValueError, match="fused_loss"):
        ModelConfig.from_dict({"fused_loss": "yes"})


# ---------------------------------------------------------------- against one process

transformers = pytest.importorskip("transformers")
# a logit scale (Cohere: logit_scale after lm_head) and a final softcap (Gemma 2, whose
# LM head is tied to the embeddings)
HEADS = {
    "cohere": ("CohereConfig", dict(logit_scale=0.25)),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None),
    ),
}


def _fused_equals_one_process(rank, u, r, family):
    topo = topology(u, r, "zigzag")
    cls, extra = HEADS[family]
    cfg = getattr(transformers, cls)(**{**HF_TINY, **extra})
    sp, ref = hf_pair(cfg, topo, reference_attention="eager")
    # Gemma 2's final norm is lean here, so the fused loss folds its backward in
    folded = "model.norm" in lean_norms(sp)
    ids = torch.randint(96, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, ref_loss, grads = hf_loss_and_grads(sp, ref, topo, ids, fused_loss=True, tiled_loss=3)
    worst = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for name, (grad, want) in grads.items():
        worst[name] = (grad - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    return worst, sorted(grads), folded


# ---------------------------------------------------------------- under ZeRO


def _zero_step(rank, stage, fused):
    import deepspeed

    from ulysses_cp.models import hf

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(2, 2, stage)
    topo = topology_for(cfg)
    torch.manual_seed(0)
    mc = HFModelConfig(hf_config="configs/hf/tiny_llama.json", tiled_mlp=2, fused_loss=fused)
    model = hf.build_model(topo, mc, backend="torch")
    engine, local = sgd_engine_and_batch(model, cfg, topo)
    loss = engine.module.loss(
        local["input_ids"],
        local["position_ids"],
        local["shift_labels"],
        topo,
        batch=local["batch"],
        tiled_loss=4 if fused else 0,
        fused_loss=fused,
    )
    engine.backward(loss)
    engine.step()
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        return loss.item(), {n: p.detach().clone() for n, p in params}
