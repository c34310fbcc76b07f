"""RMSNorm that keeps one tensor for backward instead of two (Hugging Face models).

transformers' RMSNorm runs as plain autograd ops: ``x.pow(2)`` keeps ``x``, and
``weight * normed`` keeps ``normed``, a second activation of ``x``'s size (in float32 for a
bf16 model: twice ``x``'s bytes). The layer that follows keeps the norm's output as well.
:func:`lean_norms` gives each such norm a forward that is the same operations in the same
order (the output equal to the bit) under one autograd function that keeps ``x`` and the
per-token ``rstd`` only and recomputes ``normed`` in backward, one elementwise product
(``model.lean_norms``, default true).
``x`` is the residual stream, which is kept anyway, so each norm's saved activation is
gone: per decoder layer two hidden states in the recomputed layer of a checkpointed model,
and the final norm's ``normed`` kept through the whole backward when the loss is fused.

Which norms: a module whose class name ends in ``RMSNorm``, with one parameter, ``weight``
of one dimension, and an ``eps`` or ``variance_epsilon``. Its own forward is run on a
random input and a random weight (on a stand-in object, no hooks, so ZeRO-3's partitioned
weights are not touched; again for each new pair of input and weight dtypes, e.g. after
DeepSpeed casts the model to bf16) and must equal, to the bit, one of the three forms transformers
uses: ``weight * normed.to(dtype)`` (Llama and most), ``(weight * normed).to(dtype)``
(OLMo 2, GPT-OSS, Helium) or ``(normed * (1 + weight.float())).to(dtype)`` (Gemma). Any
other norm keeps its own forward.

:func:`norm_input` lets a consumer of a lean norm's output recognise it (weak references
left by the lean forward) and run the norm itself on pieces of its input, or take its
backward in (:func:`norm_backward`): the tiled MLP, the tiled and the fused loss
(:mod:`.memory`, :mod:`.fused_loss`).
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["FORMS", "NormInput", "lean_norms", "norm_backward", "norm_input", "rms_norm"]

FORMS = ("llama", "olmo", "gemma")
_MODULE_STATE = {"_parameters", "_buffers", "_modules"}


def _normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def _apply(form: str, normed: torch.Tensor, weight: torch.Tensor, dtype) -> torch.Tensor:
    if form == "llama":
        return weight * normed.to(dtype)
    if form == "olmo":
        return (weight * normed).to(dtype)
    return (normed * (1.0 + weight.float())).to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, form: str):
        normed, rstd = _normed(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.form = form
        return _apply(form, normed, weight, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = norm_backward(g, x, weight, rstd, ctx.form, weight_grad=ctx.needs_input_grad[1])
        return dx, None if dw is None else dw.to(weight.dtype), None, None


def norm_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    form: str,
    *,
    weight_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of :func:`rms_norm` for the output gradient ``g``: ``(dx in x's dtype,
    d weight or None)``, ``d weight`` summed over every dimension but the last, in the
    dtype it is computed in (x's for the Llama form, float32 for the others)."""
    # in place where the operand is ours: the transients are two tensors of x's size
    # (normed and dn), as few as autograd's own backward of the plain norm
    normed = x.to(torch.float32) * rstd
    dims = tuple(range(g.dim() - 1))
    if form == "llama":  # out = weight * normed.to(dtype), in out's dtype
        dw = (g * normed.to(x.dtype)).sum(dims) if weight_grad else None
        dn = (g * weight).to(torch.float32)
    else:  # the product in float32 (weight promoted), then cast
        g32 = g.to(torch.float32)
        dw = (g32 * normed).sum(dims) if weight_grad else None
        dn = g32 * (weight.float() + 1.0 if form == "gemma" else weight.float())
    # dx = rstd * (dn - normed * mean(dn * normed)), the mean as a batched dot product
    dot = torch.matmul(dn.unsqueeze(-2), normed.unsqueeze(-1)).squeeze(-1)
    dx = dn.sub_(normed.mul_(dot.div_(x.shape[-1]))).mul_(rstd)
    return dx.to(x.dtype), dw


@dataclass(frozen=True)
class NormInput:
    """What a lean norm's output came from (:func:`norm_input`): its input ``x``, the
    module (its ``weight`` and ``_lean_eps``) and the form."""

    x: torch.Tensor
    module: nn.Module
    form: str

    def rstd(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token ``rstd`` of ``x`` (a piece of :attr:`x`), as the forward has it."""
        eps: float = self.module._lean_eps  # type: ignore[assignment]
        return _normed(x, eps)[1]


def norm_input(out: torch.Tensor) -> NormInput | None:
    """When ``out`` is the output of the latest call of a lean norm (the lean forward of a
    module given by :func:`lean_norms`, with autograd recording) and that call's input is
    still alive, what it came from; else None. A consumer that computes ``out``'s gradient
    itself can take the norm's backward into its own (:func:`norm_backward`), or run the
    norm again on pieces of ``x``, and keep ``out`` nowhere. Reads no saved tensor (inside
    a checkpointed region that would recompute the region)."""
    if torch.compiler.is_compiling():
        return None
    ref = getattr(out.grad_fn, "norm_module", None)
    module = ref() if ref is not None else None
    last = getattr(module, "_lean_last", None)
    if last is None:
        return None
    out_ref, x_ref, form = last
    x = x_ref()
    if out_ref() is not out or x is None or module is None:
        return None
    return NormInput(x=x, module=module, form=form)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension in one of :data:`FORMS`, keeping ``x`` and
    ``rstd`` for backward only."""
    if form not in FORMS:
        raise ValueError(f"rms_norm form must be one of {FORMS}, got {form!r}")
    return _RMSNorm.apply(x, weight, eps, form)


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def _weight_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(weight, "ds_shape", weight.shape))  # ZeRO-3 keeps the full shape


def _form_of(module: Any, eps: float, dtype: torch.dtype) -> str | None:
    """The form whose output equals ``module``'s own forward to the bit for an input of
    ``dtype`` and the module's weight dtype, or None."""
    weight = module.weight
    (width,) = _weight_shape(weight)
    g = torch.Generator().manual_seed(width)
    probe_w = (torch.rand(width, generator=g) + 0.5).to(weight.dtype)
    x = torch.randn(2, 3, width, generator=g).to(dtype)
    cls: type[nn.Module] = type(module)
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    for key, value in vars(module).items():
        if key not in _MODULE_STATE and not key.startswith("_"):
            stand_in.__dict__[key] = value
    stand_in.weight = nn.Parameter(probe_w, requires_grad=False)
    try:
        with torch.no_grad():
            want = cls.forward(stand_in, x)
    except Exception:  # a forward that needs more than the stand-in has: not ours to take
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return None
    with torch.no_grad():
        normed, _ = _normed(x, eps)
        for form in FORMS:
            got = _apply(form, normed, probe_w, x.dtype)
            if got.dtype == want.dtype and torch.equal(got, want):
                return form
    return None


def _form_for(module: Any, dtype: torch.dtype) -> str | None:
    """The probed form for inputs of ``dtype`` and the weight's dtype now (a model cast
    after :func:`lean_norms`, e.g. by DeepSpeed's bf16, is probed again); None: the
    norm's own forward. Never probes while torch.compile traces."""
    key = (module.weight.dtype, dtype)
    forms: dict[tuple[torch.dtype, torch.dtype], str | None] = module._lean_forms
    if key not in forms:
        if torch.compiler.is_compiling():
            return None
        forms[key] = _form_of(module, module._lean_eps, dtype)
    return forms[key]


def _lean_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
    # only a call with one positional tensor was probed; any other call (a keyword input,
    # more arguments) and a dtype that did not match run the norm's own forward
    form = None
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        form = _form_for(self, args[0].dtype)
    if form is None:
        return type(self).forward(self, *args, **kwargs)
    out = rms_norm(args[0], self.weight, self._lean_eps, form)
    if not torch.compiler.is_compiling() and out.grad_fn is not None:
        # for norm_input (a consumer's fold): weak references only, nothing kept alive
        out.grad_fn.norm_module = weakref.ref(self)  # type: ignore[attr-defined]
        self._lean_last = (weakref.ref(out), weakref.ref(args[0]), form)
    return out


def lean_norms(model: nn.Module) -> dict[str, str]:
    """Give every RMSNorm of ``model`` that matches one of :data:`FORMS` the lean forward
    (see the module docstring); returns ``{module name: form}`` of those taken."""
    taken: dict[str, str] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RMSNorm") or "_lean_forms" in vars(module):
            continue
        params = dict(module.named_parameters(recurse=False))
        eps = _eps(module)
        weight = params.get("weight")
        if eps is None or len(params) != 1 or weight is None or len(_weight_shape(weight)) != 1:
            continue
        if list(module.children()) or list(module.buffers(recurse=False)):
            continue
        form = _form_of(module, eps, module.weight.dtype)
        if form is None:
            continue
        module._lean_eps, module._lean_forms = eps, {(module.weight.dtype,) * 2: form}
        module.forward = types.MethodType(_lean_forward, module)
        taken[name] = form
    return taken
