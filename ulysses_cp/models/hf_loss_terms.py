"""Exact or refused, for loss terms: what a family's causal-LM ``forward`` adds to the
cross-entropy, read from its source.

A transformers model's ``*ForCausalLM.forward`` may add terms to ``loss`` after the
token cross-entropy: the MoE router's load-balancing loss (``loss +=
self.router_aux_loss_coef * aux_loss`` when ``output_router_logits``), Bamba's z-loss, ...
Under sequence parallelism the forward runs without labels on a shard, so every such term
must be computed by this package over the whole sequence, or the model is refused. The
parse below finds each statement of ``forward`` that changes ``loss`` after it is first
computed, and decides:

- **the load-balancing loss**: ``aux_loss = load_balancing_loss_func(router_logits,
  num_experts, top_k, attention_mask)`` with the body Mixtral, Qwen3-MoE, OLMoE, GPT-OSS
  and 27 other families share (checked numerically against
  :func:`~ulysses_cp.models.router_loss.load_balancing_loss` once per function): its
  ``num_experts``, ``top_k`` and coefficient are read as the forward reads them, and
  whether it is on (the ``output_router_logits`` the forward falls back to);
- **a term behind a condition that is false** for this model (``if self.z_loss_coefficient
  > 0`` with the coefficient 0): nothing is added, nothing to compute;
- **anything else**: refused, naming the statement, on every rank (the decision depends on
  the class and the config alone, the same on every rank).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.log import get_logger
from ..core.topology import Topology
from .router_loss import load_balancing_loss

__all__ = ["RouterAux", "router_aux"]

log = get_logger(__name__)
# the parameters of the load-balancing loss this package computes over the whole sequence
_SIGNATURE = ("gate_logits", "num_experts", "top_k", "attention_mask")
_CHECKED: dict[Callable, bool] = {}
_OFF = (
    "turn it off (output_router_logits=False in the model's config; TRL's trainers: "
    "router_aux_loss_coef=0.0) or train with sequence parallelism 1"
)


@dataclass(frozen=True)
class RouterAux:
    """A family's load-balancing loss, as its forward computes it: ``num_experts``,
    ``top_k``, the coefficient ``coef`` its forward multiplies the loss by, and
    ``enabled``: whether its forward adds it (``output_router_logits`` on in its config)."""

    num_experts: int
    top_k: int
    coef: float
    enabled: bool
    family: str  # the causal-LM class, for messages

    def loss(
        self,
        router_logits: Any,
        topo: Topology | None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The whole sequence's load-balancing loss (without the coefficient)."""
        return load_balancing_loss(
            tuple(router_logits),
            num_experts=self.num_experts,
            top_k=self.top_k,
            topo=topo,
            token_mask=token_mask,
        )


class _Unknown(Exception):
    """An expression that cannot be evaluated from the model alone."""


def _value(node: ast.AST, model: Any) -> Any:
    """Evaluate an expression of constants and attribute chains on ``self`` (the model),
    compared or negated; anything else raises :class:`_Unknown`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return model
    if isinstance(node, ast.Attribute):
        owner = _value(node.value, model)
        if not hasattr(owner, node.attr):
            raise _Unknown
        return getattr(owner, node.attr)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _value(node.operand, model)
    if isinstance(node, ast.BoolOp):
        values = [bool(_value(v, model)) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = _value(node.left, model), _value(node.comparators[0], model)
        ops: dict[type, Callable[[Any, Any], bool]] = {
            ast.Gt: lambda x, y: x > y,
            ast.GtE: lambda x, y: x >= y,
            ast.Lt: lambda x, y: x < y,
            ast.LtE: lambda x, y: x <= y,
            ast.Eq: lambda x, y: x == y,
            ast.NotEq: lambda x, y: x != y,
            ast.Is: lambda x, y: x is y,
            ast.IsNot: lambda x, y: x is not y,
        }
        op = ops.get(type(node.ops[0]))
        if op is None:
            raise _Unknown
        return op(a, b)
    raise _Unknown


def _forward_tree(cls: type) -> tuple[ast.FunctionDef, Callable] | None:
    """The parsed ``forward`` of ``cls`` and the function; None without source."""
    fn = inspect.unwrap(cls.forward)  # type: ignore[attr-defined]
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    return node, fn  # type: ignore[return-value]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _loss_updates(tree: ast.FunctionDef) -> list[tuple[ast.stmt, list[ast.expr]]]:
    """The statements that change ``loss`` after it is first computed (``loss += x``,
    ``loss = loss + x``, ...), each with the tests of the ``if`` blocks around it."""
    found: list[tuple[ast.stmt, list[ast.expr]]] = []

    def visit(body: list[ast.stmt], tests: list[ast.expr]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.AugAssign):
                changes = _is_loss(stmt.target)
            elif isinstance(stmt, ast.Assign):
                changes = any(_is_loss(t) for t in stmt.targets) and "loss" in _names(stmt.value)
            else:
                changes = False
            if changes:
                found.append((stmt, tests))
            if isinstance(stmt, ast.If):
                visit(stmt.body, [*tests, stmt.test])
                visit(stmt.orelse, [*tests, ast.UnaryOp(op=ast.Not(), operand=stmt.test)])
            elif isinstance(stmt, ast.With | ast.For | ast.While | ast.Try):
                visit(stmt.body, tests)

    visit(tree.body, [])
    return found


def _is_loss(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and target.id == "loss"


def _off(tests: list[ast.expr], model: Any) -> bool:
    """Some test around the statement is false for this model (the term is never added)."""
    for test in tests:
        try:
            if not _value(test, model):
                return True
        except _Unknown:
            continue
    return False


def _assignment(tree: ast.FunctionDef, name: str, kind: type = ast.AST) -> ast.Assign | None:
    """The first ``name = <kind>`` of the function (``aux_loss = None`` comes first)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, kind)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ):
            return node
    return None


def _enabled(tree: ast.FunctionDef, model: Any) -> bool:
    """The ``output_router_logits`` the forward falls back to without the argument."""
    node = _assignment(tree, "output_router_logits", ast.IfExp)
    if node is not None and isinstance(node.value, ast.IfExp):
        try:
            return bool(_value(node.value.orelse, model))
        except _Unknown:
            pass
    return bool(getattr(model.config.get_text_config(), "output_router_logits", False))


def _coefficient(stmt: ast.stmt, model: Any) -> float:
    """The factor of ``aux_loss`` in ``loss += coef * aux_loss...`` (1 without one)."""
    value = stmt.value if isinstance(stmt, ast.AugAssign | ast.Assign) else None
    for node in ast.walk(value) if value is not None else ():
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for side, other in ((node.left, node.right), (node.right, node.left)):
                if "aux_loss" in _names(other) and "aux_loss" not in _names(side):
                    return float(_value(side, model))
    return 1.0


def _same_formula(fn: Callable) -> bool:
    """``fn`` (a family's ``load_balancing_loss_func``) gives our whole-sequence loss on
    one process, with and without a padding mask (random logits: 3 layers, 2 x 5 tokens)."""
    if fn not in _CHECKED:
        g = torch.Generator().manual_seed(0)
        E, K, b, s = 6, 2, 2, 5
        logits = tuple(torch.randn(b * s, E, generator=g) for _ in range(3))
        mask = torch.ones(b, s)
        mask[1, 3:] = 0
        ok = True
        for m in (None, mask):
            want = load_balancing_loss(logits, num_experts=E, top_k=K, token_mask=m)
            try:
                got = torch.as_tensor(fn(logits, E, K, m), dtype=torch.float32)
            except Exception:  # any failure: not the formula we compute
                ok = False
                break
            ok = ok and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-7))
        _CHECKED[fn] = ok
    return _CHECKED[fn]


def _router_term(
    tree: ast.FunctionDef, fn: Callable, stmt: ast.stmt, model: Any, family: str
) -> RouterAux | None:
    """The load-balancing term added by ``stmt``, or a refusal."""
    node = _assignment(tree, "aux_loss", ast.Call)
    call = node.value if node is not None else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        raise ValueError(f"{family}.forward adds an aux_loss that is not a function call")
    func = fn.__globals__.get(call.func.id)
    params = tuple(inspect.signature(func).parameters) if callable(func) else ()
    enabled = _enabled(tree, model)
    if params != _SIGNATURE or not (func is not None and _same_formula(func)):
        if not enabled:
            return None
        raise ValueError(
            f"{family} adds a router loss ({call.func.id} with parameters {list(params)}) "
            f"that is not the load-balancing loss ulysses_cp computes over the whole "
            f"sequence; {_OFF}"
        )
    args: list[ast.expr] = list(call.args) + [ast.Constant(None)] * (4 - len(call.args))
    for kw in call.keywords:
        if kw.arg in _SIGNATURE:
            args[_SIGNATURE.index(kw.arg)] = kw.value
    try:
        experts, top_k = int(_value(args[1], model)), int(_value(args[2], model))
        coef = _coefficient(stmt, model)
    except (_Unknown, TypeError):
        if not enabled:
            return None
        raise ValueError(
            f"{family}.forward calls {call.func.id} with arguments read from more than the "
            f"model ({ast.unparse(call)}): its load-balancing loss cannot be reproduced; {_OFF}"
        ) from None
    return RouterAux(experts, top_k, coef, enabled, family)


def router_aux(model: Any) -> RouterAux | None:
    """The load-balancing loss ``model``'s forward adds (None: no loss term beyond the
    cross-entropy, or none on for this config).

    Raises:
        ValueError: The forward adds a term this package does not compute for this
            config, named (the same on every rank).
    """
    family = type(model).__name__
    parsed = _forward_tree(type(model))
    if parsed is None:
        log.warning(f"{family}.forward has no source to read: its loss terms are not checked")
        return None
    tree, fn = parsed
    router = None
    for stmt, tests in _loss_updates(tree):
        if "aux_loss" in _names(stmt):
            router = _router_term(tree, fn, stmt, model, family)
            continue
        if _off(tests, model):
            continue
        raise ValueError(
            f"{family}.forward adds a loss term that ulysses_cp does not compute under "
            f"sequence parallelism: `{ast.unparse(stmt)}`; turn it off in the model's config "
            f"(the condition around it: "
            f"{' and '.join(ast.unparse(t) for t in tests) or 'none, always on'}) or train "
            f"with sequence parallelism 1"
        )
    return router
