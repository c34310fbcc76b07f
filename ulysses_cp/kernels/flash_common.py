"""What the flash-attn adapters share (FlashAttention-2, -3 and -4): reading an internal
function's parameters, calling it by name, the window, head-dim padding and packed rows.

Every adapter calls a library's *internal* functions (those that return and take the
log-sum-exp ring attention merges). Their parameters change between releases, so each call
passes keywords for exactly the parameters the installed function takes
(:func:`call_by_name`): an argument that changes the result must be taken or the call is
refused naming the release; neutral ones (dropout 0, no paged KV...) are passed where taken.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from ..core.derived import once
from . import math_backend
from .spec import Band, Scores

__all__ = [
    "Cu",
    "Fn",
    "Found",
    "Library",
    "call_by_name",
    "cu_args",
    "dist_version",
    "flash_window",
    "forward_results",
    "lib_backward",
    "lib_forward",
    "pad8",
    "parameters",
]

# q (1, tq, hq, d) -> the libraries' (tq, hq, d); lse (hq, tq) -> (1, hq, tq)
Cu = tuple[torch.Tensor, torch.Tensor]  # (cu_seqlens_q, cu_seqlens_k)

T = TypeVar("T")


class Found(Generic[T]):
    """A library looked for once, on first use: ``load()`` returns it or raises
    ``ValueError`` saying why it cannot be used; :meth:`reset` looks again (after
    installing or swapping it)."""

    def __init__(self, load: Callable[[], T]) -> None:
        self._load = load
        self._result: tuple[T | None, str | None] | None = None

    def _probe(self) -> tuple[T | None, str | None]:
        if self._result is None:
            try:
                self._result = (self._load(), None)
            except ValueError as exc:
                self._result = (None, str(exc))
        return self._result

    def problem(self) -> str | None:
        """Why it cannot be used here, or None when it can."""
        return self._probe()[1]

    def get(self) -> T:
        """The library; ``ValueError`` naming the problem when it cannot be used."""
        found, problem = self._probe()
        if problem is not None or found is None:
            raise ValueError(problem)
        return found

    def reset(self) -> None:
        self._result = None


# one meaning, another name: FA3's backward says ``is_causal``, FA4's backward ``lse``
_ALIASES = {"causal": "is_causal", "softmax_lse": "lse"}


@dataclass(frozen=True)
class Fn:
    """One internal function and its parameters (name -> has a default)."""

    name: str
    fn: Callable
    params: dict[str, bool]


def parameters(fn: Callable) -> dict[str, bool] | None:
    """Parameter names (in order) -> whether each has a default. A ``torch.library``
    custom op (``CustomOpDef``) or an ``OpOverload(Packet)`` is read from its schema, since
    its Python signature is ``(*args, **kwargs)``; None when neither says anything."""
    overload = getattr(fn, "_opoverload", None)  # CustomOpDef
    if overload is None and hasattr(fn, "default"):  # OpOverloadPacket
        overload = fn.default
    schema = getattr(overload if overload is not None else fn, "_schema", None)
    if schema is not None:
        return {a.name: a.has_default_value() for a in schema.arguments}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None
    return {n: p.default is not inspect.Parameter.empty for n, p in sig.parameters.items()}


def dist_version(*dists: str) -> str | None:
    """The installed version of the first of these distributions found, or None."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def call_by_name(
    f: Fn,
    label: str,
    values: dict,
    window: tuple[int | None, int | None],
    softcap: float,
    neutral: dict,
    hint: str = "",
):
    """Call ``f`` with keywords for exactly the parameters it takes.

    ``values``: what must reach the kernel (refused by name when not taken); ``window``:
    ``(left, right)``, passed as ``window_size`` where the release takes a tuple, else as
    ``window_size_left/right``; a ``softcap`` of 0 may be dropped; ``neutral``: values of
    arguments we do not use, passed where taken. ``label`` names the release in errors,
    ``hint`` ends them."""
    values = dict(values, softcap=softcap)
    if "window_size" in f.params:
        values["window_size"] = window
    else:
        values["window_size_left"], values["window_size_right"] = window
    for ours, theirs in _ALIASES.items():
        if ours in values and ours not in f.params and theirs in f.params:
            values[theirs] = values.pop(ours)
    required = [n for n in values if n != "softcap" or softcap != 0.0]
    dropped = [n for n in required if n not in f.params]
    if dropped:
        raise ValueError(
            f"{label}: {f.name} does not take {sorted(set(dropped))}, which ulysses_cp "
            f"must pass for a right result{hint}"
        )
    kwargs = {}
    for name, has_default in f.params.items():
        if name in values:
            kwargs[name] = values[name]
        elif name in neutral:
            kwargs[name] = neutral[name]
        elif not has_default:
            raise ValueError(
                f"{label}: {f.name} requires argument {name!r}, which ulysses_cp does not "
                f"know{hint}"
            )
    return f.fn(**kwargs)


def forward_results(
    res, label: str, name: str, lse_at: dict[int, int], lse_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from a forward's return tuple: ``lse_at`` maps each tuple length a
    release returns to where its lse is; the lse must have ``lse_shape``, float32."""
    n = len(res) if isinstance(res, (tuple, list)) else None
    if n not in lse_at:
        got = n if n is not None else type(res).__name__
        known = " or ".join(str(k) for k in sorted(lse_at))
        raise ValueError(
            f"{label}: {name} returned {got} values; ulysses_cp knows tuples of {known}"
        )
    lse = res[lse_at[n]]
    if not isinstance(lse, torch.Tensor) or (tuple(lse.shape), lse.dtype) != (
        lse_shape,
        torch.float32,
    ):
        what = f"{tuple(lse.shape)} {lse.dtype}" if isinstance(lse, torch.Tensor) else lse
        raise ValueError(
            f"{label}: {name} returned an lse of {what}, expected {lse_shape} float32; "
            f"this release's convention is unknown"
        )
    return res[0], lse


def pad8(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the head dim to a multiple of 8 (the kernels' alignment); contiguous."""
    pad = -x.shape[-1] % 8
    return (F.pad(x, (0, pad)) if pad else x).contiguous()


_FULL = (-1, -1)  # "no window"


def flash_window(band: Band | None, sq: int, sk: int) -> tuple[int, int] | None:
    """flash-attn's ``(window_left, window_right)`` for a band of visible diagonals
    (``lo <= j - i <= hi``; see :data:`~.spec.Band`), or None when it cannot be expressed.
    FlashAttention-2, -3 and -4 align the window to the bottom-right corner: key j is
    visible to query i when ``i + sk - sq - left <= j <= i + sk - sq + right``, -1
    unbounded."""
    if band is None:
        return _FULL
    lo, hi = band
    left = -1 if lo is None else (sk - sq) - lo
    right = -1 if hi is None else hi - (sk - sq)
    if (lo is not None and left < 0) or (hi is not None and right < 0):
        return None
    return left, right


def cu_args(cu: Cu, device: torch.device) -> dict:
    """``cu_seqlens_q/k`` (int32) and ``max_seqlen_q/k``, once per batch
    (``derived.once``): the longest documents are a host sync."""
    return once(cu, ("flash cu", str(device)), lambda: _cu_values(*cu, device))


def _cu_values(cu_q, cu_k, device: torch.device) -> dict:
    lens_q, lens_k = (c.diff().max().item() for c in (cu_q, cu_k))
    return dict(
        cu_seqlens_q=cu_q.to(device=device, dtype=torch.int32).contiguous(),
        cu_seqlens_k=cu_k.to(device=device, dtype=torch.int32).contiguous(),
        max_seqlen_q=int(lens_q),
        max_seqlen_k=int(lens_k),
    )


# ------------------------------------------- FlashAttention-3 and -4: one call, dense or packed
@dataclass(frozen=True)
class Library:
    """An installed FlashAttention-3 or -4: its internal forward and backward (each takes
    dense ``(b, s, h, d)`` rows, or packed ``(total, h, d)`` rows with ``cu_seqlens``) and
    how this release is called. ``lse_at``: forward tuple length -> where its lse is;
    ``unbounded``: how a window side says "no limit" (-1 or None); ``forward_values``: what
    the forward must be given besides q/k/v (FA4: ``return_lse=True``); ``neutral``:
    values of arguments we do not use; ``hint`` ends every error."""

    label: str
    forward: Fn
    backward: Fn
    lse_at: dict[int, int]
    unbounded: int | None
    forward_values: dict
    neutral: dict
    hint: str


def _window(lib: Library, band: Band | None, sq: int, sk: int):
    w = flash_window(band, sq, sk)
    return None if w is None else tuple(lib.unbounded if x < 0 else x for x in w)


def _packed(x: torch.Tensor, cu: Cu | None) -> torch.Tensor:
    """(b, s, h, d) dense as it is; packed rows (1, total, h, d) -> (total, h, d)."""
    return pad8(x if cu is None else x[0])


def _window_of(lib: Library, how: Scores, q, k, cu: Cu | None):
    """The call's window; None for a band the library cannot express (dense blocks: the
    math path runs instead; packed documents are square and always see their diagonal)."""
    window = _window(lib, how.band, *((1, 1) if cu is not None else (q.shape[1], k.shape[1])))
    assert window is not None or cu is None, f"band {how.band}: packed rows need the diagonal"
    return window


def lib_forward(
    lib: Library, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores, cu=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, s, hq, dv), lse (b, hq, s))`` from the library's forward (a band it
    cannot express: the math backend). ``cu``: packed rows (batch 1): documents are square
    blocks, the library's lse ``(hq, total)`` comes back ``(1, hq, total)``."""
    window = _window_of(lib, how, q, k, cu)
    if window is None:
        return math_backend.forward(q, k, v, how)
    b, s, h, _ = q.shape
    values = dict(
        q=_packed(q, cu),
        k=_packed(k, cu),
        v=_packed(v, cu),
        softmax_scale=how.scale,
        causal=how.causal,
        **lib.forward_values,
        **({} if cu is None else cu_args(cu, q.device)),
    )
    res = call_by_name(lib.forward, lib.label, values, window, how.softcap, lib.neutral, lib.hint)
    shape = (b, h, s) if cu is None else (h, s)
    out, lse = forward_results(res, lib.label, lib.forward.name, lib.lse_at, shape)
    out = out[..., : v.shape[-1]]
    return (out, lse) if cu is None else (out[None], lse[None])


def lib_backward(lib: Library, saved: tuple, how: Scores, cu: Cu | None = None):
    """``(dq, dk, dv)`` at the inputs' widths from ``saved = (dout, q, k, v, out, lse)``,
    written by the library's backward into buffers we give it (a band it cannot express:
    the math backend)."""
    dout, q, k, v, out, lse = saved
    window = _window_of(lib, how, q, k, cu)
    if window is None:
        return math_backend.backward(dout, q, k, v, out, lse, how)
    qp, kp, vp = (_packed(t, cu) for t in (q, k, v))
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    values = dict(
        dout=_packed(dout.to(q.dtype), cu),
        q=qp,
        k=kp,
        v=vp,
        out=_packed(out.to(q.dtype), cu),
        softmax_lse=(lse if cu is None else lse[0]).float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=how.scale,
        causal=how.causal,
        **({} if cu is None else cu_args(cu, q.device)),
    )
    call_by_name(lib.backward, lib.label, values, window, how.softcap, lib.neutral, lib.hint)
    grads = (dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]])
    return grads if cu is None else tuple(g[None] for g in grads)
