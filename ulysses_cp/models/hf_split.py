"""The split test: is a module per-token on this call?

A module called on a sequence of ``n`` tokens (every sequence-shaped argument: hidden
states, position ids, rotary tables, cut the same way) must give, run on the first ``k``
tokens and on the rest apart, the two halves of its whole-sequence output. Per-token
modules (projections, MLPs, MoE blocks, norms, rotary tables) pass; a convolution, scan,
recurrence, token shift or sequence statistic changes the first tokens of the second half
and fails, as does a module that cannot run on part of the sequence.
(:mod:`~ulysses_cp.models.hf_guard` runs it on every module it cannot otherwise place.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["PER_TOKEN", "is_activation", "seq_dim", "split_test", "tolerance", "worst_token"]

PER_TOKEN: tuple[type, ...] = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Dropout,
    nn.Identity,
)
# relative tolerances: rounding of one dtype, far below what a shard-border error gives
# (float64 models still take routers, norms or kernels in float32: ~1e-7 here)
_TOL = {torch.float64: 1e-5, torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def tolerance(dtype: torch.dtype) -> float:
    return _TOL.get(dtype, 0.25)


def is_activation(module: nn.Module) -> bool:
    mod = type(module).__module__
    if isinstance(module, nn.MultiheadAttention):
        return False
    return mod.startswith("torch.nn.modules.activation") or mod.startswith(
        "transformers.activations"
    )


def seq_dim(t: Any, n: int) -> int | None:
    """The sequence dimension of ``t``: the first of its leading three dimensions of
    length ``n`` (``(b=1, n, ...)``, ``(n, ...)`` flattened tokens, ``(3, b, n, ...)``
    M-RoPE positions); ``n`` equals no size of the model (:func:`_probe_length`)."""
    if not isinstance(t, torch.Tensor):
        return None
    for i, size in enumerate(t.shape[:3]):
        if size == n:
            return i
    return None


def _cut(value: Any, n: int, part: slice) -> Any:
    """``value`` with every sequence-shaped tensor (inside tuples, lists, dicts) cut."""
    dim = seq_dim(value, n)
    if dim is not None:
        return value[(slice(None),) * dim + (part,)]
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, n, part) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, n, part) for k, v in value.items()}
    return value


def _first_seq(out: Any, n: int) -> tuple[torch.Tensor, int] | None:
    if seq_dim(out, n) is not None:
        return out, int(seq_dim(out, n))  # type: ignore[arg-type]
    if isinstance(out, (tuple, list)):
        for v in out:
            found = _first_seq(v, n)
            if found is not None:
                return found
    return None


def _sees_tokens(value: Any, n: int) -> bool:
    if seq_dim(value, n) is not None:
        return True
    if isinstance(value, (tuple, list)):
        return any(_sees_tokens(v, n) for v in value)
    if isinstance(value, dict):
        return any(_sees_tokens(v, n) for v in value.values())
    return False


@torch.no_grad()
def split_test(module: nn.Module, args: tuple, kwargs: dict, n: int) -> str | None:
    """None if ``module`` is per-token on this call (the whole output equals the outputs
    of the first ``k`` tokens and of the rest, run apart); else why not."""
    if not _sees_tokens((args, kwargs), n):
        return None  # sees no token: mixes none
    k = max(1, (3 * n) // 8)
    try:
        whole = _first_seq(module(*args, **kwargs), n)
        parts = [
            _first_seq(module(*_cut(args, n, s), **_cut(kwargs, n, s)), s.stop - s.start)
            for s in (slice(0, k), slice(k, n))
        ]
    except Exception as exc:  # it cannot run on part of the sequence: not per-token
        return f"cannot run on part of the sequence ({type(exc).__name__}: {exc})"[:300]
    if whole is None or parts[0] is None or parts[1] is None:
        return "returns no tensor with the sequence dimension to check"
    (w, dim), (a, _), (b, _) = whole, parts[0], parts[1]
    try:
        got = torch.cat([a, b], dim=dim)
    except RuntimeError:
        got = a.new_empty(0)  # parts whose shapes do not join along the sequence
    if got.shape != w.shape:
        return (
            f"changes output shape when the sequence is cut: {tuple(got.shape)} vs {tuple(w.shape)}"
        )
    scale = w.abs().max().double().clamp_min(1e-30)
    err = float((got - w).abs().max().double() / scale)
    if err > tolerance(w.dtype):
        where = worst_token(got - w, dim)
        return (
            f"mixes tokens: run on tokens {k}..{n - 1} apart from tokens 0..{k - 1} its "
            f"output differs by {err:.2g} (relative; first at token {where}), so on one "
            f"rank's shard it would silently compute something else"
        )
    return None


def worst_token(diff: torch.Tensor, dim: int) -> int:
    """The token (index along ``dim``) with the largest absolute entry of ``diff``."""
    return int(diff.abs().movedim(dim, 0).reshape(diff.shape[dim], -1).amax(1).argmax())
