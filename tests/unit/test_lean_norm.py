"""Lean RMSNorm (``ulysses_cp.models.lean_norm``): the output equals transformers' own norm
to the bit, the gradients equal its autograd's, only the input and ``rstd`` are kept for
backward, and a norm of another form keeps its own forward."""

import copy
import importlib

import pytest
import torch
import torch.nn as nn

from ulysses_cp.models.lean_norm import lean_norms

FAMILIES = [  # (module, class, the form it takes in bf16)
    ("llama", "LlamaRMSNorm", "llama"),
    ("olmo2", "Olmo2RMSNorm", "olmo"),
    ("gemma", "GemmaRMSNorm", "gemma"),
]


def norm_of(module: str, cls: str, dtype, width=64) -> nn.Module:
    C = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    norm = C(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return norm


def run(norm, x, g):
    x = x.detach().clone().requires_grad_()
    y = norm(x)
    y.backward(g)
    return y, x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("module,cls,form", FAMILIES)
def test_equals_the_familys_own_norm(module, cls, form, dtype):
    own = norm_of(module, cls, dtype)
    lean = copy.deepcopy(own)
    taken = lean_norms(nn.ModuleDict({"n": lean}))
    assert list(taken) == ["n"]
    if dtype == torch.bfloat16:
        assert taken["n"] == form
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 32, 64, generator=gen).to(dtype)
    g = torch.randn(2, 32, 64, generator=gen).to(dtype)
    y0, dx0, dw0 = run(own, x, g)
    y1, dx1, dw1 = run(lean, x, g)
    assert torch.equal(y0, y1)  # the same operations in the same order
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in ((dx0, dx1), (dw0, dw1)):
        assert a.dtype == b.dtype
        assert ((a.float() - b.float()).abs().max() / a.float().abs().max()).item() <= tol


def saved_bytes(fn, x) -> int:
    """Bytes of the storages autograd keeps for ``fn(x)``'s backward, other than ``x``'s."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() != x.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def test_keeps_only_the_input_and_rstd():
    own = norm_of("llama", "LlamaRMSNorm", torch.float32, width=256)
    lean = copy.deepcopy(own)
    lean_norms(nn.ModuleDict({"n": lean}))
    x = torch.randn(1, 512, 256, requires_grad=True)
    hidden = x.numel() * 4
    # transformers' norm keeps normed (a hidden state) besides x and rstd; ours rstd only
    # (and the weight, which existed before)
    assert saved_bytes(own, x) >= hidden
    assert saved_bytes(lean, x) <= 512 * 4 + 256 * 4


def test_a_cast_after_taking_is_probed_again():
    # in float32 OLMo 2's (weight * normed).to(dtype) equals Llama's form; in bf16 it does not
    own = norm_of("olmo2", "Olmo2RMSNorm", torch.float32)
    lean = copy.deepcopy(own)
    assert lean_norms(nn.ModuleDict({"n": lean})) == {"n": "llama"}
    own, lean = own.bfloat16(), lean.bfloat16()
    x = torch.randn(2, 32, 64).bfloat16()
    assert torch.equal(own(x), lean(x))
    assert lean._lean_forms[(torch.bfloat16, torch.bfloat16)] == "olmo"


class OffsetRMSNorm(nn.Module):
    """An RMSNorm none of the forms matches (an offset after the scale)."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)) + 0.1


def test_another_form_keeps_its_own_forward():
    model = nn.ModuleDict({"a": OffsetRMSNorm(64), "b": nn.LayerNorm(64)})
    assert lean_norms(model) == {}
    assert "forward" not in vars(model["a"])


def test_a_call_by_keyword_runs_the_norms_own_forward():
    own = norm_of("gemma", "GemmaRMSNorm", torch.float32)  # forward(self, x)
    lean = copy.deepcopy(own)
    lean_norms(nn.ModuleDict({"n": lean}))
    x = torch.randn(2, 8, 64, requires_grad=True)
    out = lean(x=x)  # not the probed call: Gemma's own ops
    assert torch.equal(out, own(x=x))
    assert "_RMSNorm" not in type(out.grad_fn).__name__
    assert "_RMSNorm" in type(lean(x).grad_fn).__name__
