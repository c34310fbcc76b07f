"""ALST memory features change nothing but memory: tiled MLP, tiled LM head + loss and
activation checkpointing (with CPU offload) give the untiled loss and update under ZeRO."""

from __future__ import annotations

import os

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import run_config, sgd_engine_and_batch, topology_for
from ulysses_cp.config import HFModelConfig, ModelConfig
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.models.memory import TiledMLP, tiled_cross_entropy

FEATURES = dict(tiled_mlp=3, tiled_loss=4, activation_checkpointing=True, offload_activations=True)
OFF = dict(tiled_mlp=0, tiled_loss=0, activation_checkpointing=False, offload_activations=False)


def _step(rank, kind, stage, features):
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    cfg = run_config(2, 2, stage)
    topo = topology_for(cfg)
    torch.manual_seed(0)
    tiled_loss = features["tiled_loss"]
    if kind == "hf":
        from ulysses_cp.models import hf

        mc = HFModelConfig(hf_config="configs/hf/tiny_llama.json", **features)
        model = hf.build_model(topo, mc, backend="torch")
    else:
        mc = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, **features)
        model = Decoder(mc, ucp.Attention(topo, backend="torch"))
    engine, local = sgd_engine_and_batch(model, cfg, topo)
    args = (local["input_ids"], local["position_ids"], local["batch"])
    if tiled_loss > 1:
        hidden = engine(*args, return_hidden=True)
        loss = tiled_cross_entropy(
            hidden, engine.module.head, local["shift_labels"], topo, chunks=tiled_loss
        )
    else:
        loss = ucp.sequence_parallel_cross_entropy(engine(*args), local["shift_labels"], topo)
    engine.backward(loss)
    engine.step()
    tiled = sum(isinstance(m, TiledMLP) for m in engine.module.modules())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return loss.item(), [p.detach().clone() for p in params], tiled


def test_tiled_pieces_match_untiled_without_processes():
    topo = ucp.init_topology(1, 1)
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    head = torch.nn.Linear(8, 11)
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(11, (2, 13))
    labels[0, :5] = -100
    mlp, head = mlp.double(), head.double()
    results = []
    for chunks in (1, 4):
        for p in (*mlp.parameters(), *head.parameters()):
            p.grad = None
        x.grad = None
        h = TiledMLP(mlp, chunks)(x)
        loss = tiled_cross_entropy(h, head, labels, topo, chunks=chunks)
        loss.backward()
        results.append([loss.detach(), x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_class", ["LlamaRMSNorm", "Olmo2RMSNorm", "GemmaRMSNorm"])
def test_tiled_loss_folds_a_lean_final_norm(norm_class):
    """``hidden = final_norm(x)`` with a lean norm: the tiled loss runs the norm again per
    piece on its part of ``x``, so after the forward nothing keeps ``hidden`` (the plain
    norm's output is kept by the pieces' checkpoints); loss and the gradients of ``x``,
    the norm's weight and the head equal the plain norm's, tiled the same way."""
    import importlib
    import weakref

    pytest.importorskip("transformers")
    from ulysses_cp.models.lean_norm import lean_norms

    family = {"LlamaRMSNorm": "llama", "Olmo2RMSNorm": "olmo2", "GemmaRMSNorm": "gemma"}
    mod = importlib.import_module(
        f"transformers.models.{family[norm_class]}.modeling_{family[norm_class]}"
    )
    topo = ucp.init_topology(1, 1)
    torch.manual_seed(1)
    norms = [getattr(mod, norm_class)(8, eps=1e-6) for _ in range(2)]
    for n in norms:
        with torch.no_grad():
            n.weight.uniform_(-0.5, 1.5, generator=torch.Generator().manual_seed(2))
    assert list(lean_norms(torch.nn.ModuleDict({"norm": norms[1]}))) == ["norm"]
    head = torch.nn.Linear(8, 11)
    base = torch.randn(2, 13, 8, requires_grad=True)
    labels = torch.randint(11, (2, 13))
    labels[0, :5] = -100
    results = []
    for norm in norms:
        base.grad = None
        for p in (*head.parameters(), norm.weight):
            p.grad = None
        hidden = norm(base * 1.0)
        loss = tiled_cross_entropy(hidden, head, labels, topo, chunks=3, fold_norm=True)
        kept = weakref.ref(hidden)
        del hidden
        alive = kept() is not None
        (2.5 * loss).backward()
        grads = [base.grad, norm.weight.grad, *(p.grad for p in head.parameters())]
        results.append([loss.detach(), *grads, alive])
    assert results[0][-1] and not results[1][-1]  # kept by the plain norm's pieces only
    for plain, lean in zip(results[0][:-1], results[1][:-1]):
        torch.testing.assert_close(lean, plain, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_runs_a_lean_norm_before_it_per_piece():
    """``mlp(norm(h))`` with a lean norm and a tiled MLP: each piece runs the norm on its
    part of ``h``, so after the forward nothing keeps the norm's output (with the plain
    norm the pieces' checkpoints keep it); output and the gradients of ``h``, the norm's
    weight and the MLP equal the plain norm's."""
    import weakref

    transformers = pytest.importorskip("transformers")
    from ulysses_cp.models.lean_norm import lean_norms

    torch.manual_seed(3)
    norms = [transformers.models.llama.modeling_llama.LlamaRMSNorm(8) for _ in range(2)]
    for n in norms:
        with torch.no_grad():
            n.weight.uniform_(-0.5, 1.5, generator=torch.Generator().manual_seed(4))
    assert list(lean_norms(torch.nn.ModuleDict({"norm": norms[1]}))) == ["norm"]
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    tiled = TiledMLP(mlp, 3)
    base = torch.randn(2, 13, 8, requires_grad=True)
    g = torch.randn(2, 13, 8)
    results = []
    for norm in norms:
        base.grad = None
        for p in (*mlp.parameters(), norm.weight):
            p.grad = None
        h = base * 1.0  # the residual stream (kept by the caller, as a decoder layer does)
        normed = norm(h)
        out = tiled(normed)
        kept = weakref.ref(normed)
        del normed
        alive = kept() is not None
        out.backward(g)
        grads = [base.grad, norm.weight.grad, *(p.grad for p in mlp.parameters())]
        results.append([out.detach(), *grads, alive])
        del h
    assert results[0][-1] and not results[1][-1]  # kept by the plain norm's pieces only
    for plain, lean in zip(results[0][:-1], results[1][:-1]):
        torch.testing.assert_close(lean, plain, rtol=1e-5, atol=1e-6)
