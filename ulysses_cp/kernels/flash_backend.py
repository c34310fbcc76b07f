"""flash-attn 2 adapter (imported lazily on first use): flash-attn 2.6, 2.7 and 2.8.

We call flash-attn's internal ``_flash_attn_forward/_backward`` (and the varlen pair)
because they return and take the log-sum-exp that ring attention merges. Their contract
changed between releases; every difference below was read from each release's
``flash_attn/flash_attn_interface.py`` and is pinned by ``tests/unit/test_flash_contract.py``
against stand-ins that copy those interfaces:

============  =====================================  ======================================
              2.6.x                                  2.7.x and 2.8.x
============  =====================================  ======================================
window        ``window_size=(left, right)``          ``window_size_left``, ``_right``
forward       8-tuple: out, q, k, v, out_padded,     4-tuple: out, lse, S_dmask, rng_state
returns       lse, S_dmask, rng_state
wrapping      plain functions                        ``torch.library.custom_op`` when the
                                                     release's own check passes (torch 2.4
                                                     to 2.9): ``inspect.signature`` then
                                                     reads ``(*args, **kwargs)``, so the
                                                     parameters come from the op's schema
varlen fwd    2.6.0: ``block_table`` required        defaults, and ``zero_tensors``
============  =====================================  ======================================

Every call passes keywords by name for exactly the parameters the installed function
takes. An argument that changes the result (q/k/v, the scale, causal, the window, a
softcap that is not 0) must be taken or the call is refused naming the version; neutral
ones (dropout 0, no alibi, no paged KV...) are passed where taken. The lse that comes back
is checked for its documented shape, so a convention we have not seen fails loudly.

Layout ``(b, s, h, d)``, GQA native, lse ``(b, h, s)`` fp32 (varlen ``(h, total)``).
flash-attn needs a head dim that is a multiple of 8: we pad with zeros (which changes no
score; the scale is passed explicitly) and slice the result. Tensors are handed over as
they are: flash-attn itself rejects what it cannot run (CPU tensors, float32).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from . import math_backend
from .flash_common import (
    Cu,
    Fn,
    Found,
    call_by_name,
    cu_args,
    flash_window,
    forward_results,
    pad8,
    parameters,
)
from .spec import Scores

__all__ = [
    "SUPPORTED",
    "Interface",
    "backward",
    "forward",
    "import_problem",
    "interface",
    "reset",
    "varlen_backward",
    "varlen_forward",
]

SUPPORTED = "2.6, 2.7 and 2.8"

# neutral values of the arguments we do not use; passed wherever the function takes them
_NEUTRAL = {
    "dropout_p": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "deterministic": False,
    "rng_state": None,
    "block_table": None,
    "leftpad_k": None,
    "seqused_k": None,
    "zero_tensors": False,
}


@dataclass(frozen=True)
class Interface:
    version: str
    forward: Fn
    backward: Fn
    varlen_forward: Fn
    varlen_backward: Fn


def import_problem() -> str | None:
    """Why flash-attn 2 cannot be used here, or None when it imports."""
    return _FOUND.problem()


def interface() -> Interface:
    """The installed flash-attn's four internal functions; ``ValueError`` if unusable."""
    return _FOUND.get()


def reset() -> None:
    """Forget what was found (after installing or swapping flash-attn)."""
    _FOUND.reset()


def _load() -> Interface:
    if importlib.util.find_spec("flash_attn") is None:
        hint = ""
        if importlib.util.find_spec("flash_attn_interface") is not None:
            hint = (
                " (a FlashAttention-3 `flash_attn_interface` module is installed: use "
                "backend='flash_attn3' for it)"
            )
        raise ValueError(
            f"backend 'flash_attn' needs flash-attn, which is not installed{hint}; install "
            f"flash-attn {SUPPORTED.replace(' and ', ' or ')} (`pip install .[gpu]`) or use "
            f"backend='torch'"
        )
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fai
    except Exception as exc:  # a broken install: built for another torch/CUDA, ABI...
        raise ValueError(
            f"flash-attn is installed but does not import ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]}); it was probably built for another torch or CUDA: "
            f"reinstall it, or use backend='torch'"
        ) from exc
    version = str(getattr(flash_attn, "__version__", "unknown"))
    major_minor = version.split(".")[:2]
    if not (major_minor[:1] == ["2"] and major_minor[1:2] in (["6"], ["7"], ["8"])):
        raise ValueError(
            f"flash-attn {version} is installed; ulysses_cp supports flash-attn {SUPPORTED} "
            f"(their internal functions are what ring attention needs); install one of "
            f"those or use backend='torch'"
        )
    fns = {}
    for key, name in (
        ("forward", "_flash_attn_forward"),
        ("backward", "_flash_attn_backward"),
        ("varlen_forward", "_flash_attn_varlen_forward"),
        ("varlen_backward", "_flash_attn_varlen_backward"),
    ):
        fn = getattr(fai, name, None)
        params = None if fn is None else parameters(fn)
        if fn is None or params is None:
            raise ValueError(
                f"flash-attn {version}: flash_attn_interface.{name} is missing or its "
                f"parameters cannot be read; ulysses_cp supports flash-attn {SUPPORTED}"
            )
        fns[key] = Fn(name, fn, params)
    return Interface(version, **fns)


_FOUND: Found[Interface] = Found(_load)


def _call(f: Fn, version: str, values: dict, window: tuple[int, int], softcap: float):
    hint = f"; supported: flash-attn {SUPPORTED}"
    return call_by_name(f, f"flash-attn {version}", values, window, softcap, _NEUTRAL, hint)


def _forward_results(res, version: str, name: str, shape: tuple[int, ...]):
    """2.6 returns an 8-tuple (lse 6th), 2.7/2.8 a 4-tuple (lse 2nd)."""
    return forward_results(res, f"flash-attn {version}", name, {8: 5, 4: 1}, shape)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    window = flash_window(how.band, q.shape[1], k.shape[1])
    if window is None:  # a band flash-attn cannot express: the exact math path
        return math_backend.forward(q, k, v, how)
    fa = interface()
    b, s, h, d = q.shape
    values = dict(q=pad8(q), k=pad8(k), v=pad8(v), softmax_scale=how.scale, causal=how.causal)
    res = _call(fa.forward, fa.version, values, window, how.softcap)
    out, lse = _forward_results(res, fa.version, fa.forward.name, (b, h, s))
    return out[..., :d], lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    how: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = flash_window(how.band, q.shape[1], k.shape[1])
    if window is None:
        return math_backend.backward(dout, q, k, v, out, lse, how)
    fa = interface()
    d = q.shape[-1]
    qp, kp, vp = pad8(q), pad8(k), pad8(v)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    values = dict(
        dout=pad8(dout.to(q.dtype)),
        q=qp,
        k=kp,
        v=vp,
        out=pad8(out.to(q.dtype)),
        softmax_lse=lse.float().contiguous(),  # read by raw layout: must be dense
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=how.scale,
        causal=how.causal,
    )
    _call(fa.backward, fa.version, values, window, how.softcap)  # writes into dq, dk, dv
    return dq[..., :d], dk[..., :d], dv[..., :d]


# ---------------------------------------------------------------- packed rows (varlen)
# q (1, tq, hq, d) -> flash-attn's (tq, hq, d); lse (hq, tq) -> (1, hq, tq)


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Cu, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    window = flash_window(how.band, 1, 1)  # documents are square: sk - sq = 0 in each
    assert window is not None, f"band {how.band} needs the diagonal visible in packed rows"
    fa = interface()
    tq, h, d = q.shape[1:]
    values = dict(
        q=pad8(q[0]),
        k=pad8(k[0]),
        v=pad8(v[0]),
        softmax_scale=how.scale,
        causal=how.causal,
        **cu_args(cu, q.device),
    )
    res = _call(fa.varlen_forward, fa.version, values, window, how.softcap)
    out, lse = _forward_results(res, fa.version, fa.varlen_forward.name, (h, tq))
    return out[None, ..., :d], lse[None]


def varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: Cu,
    how: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = flash_window(how.band, 1, 1)
    assert window is not None, f"band {how.band} needs the diagonal visible in packed rows"
    fa = interface()
    d = q.shape[-1]
    qp, kp, vp = pad8(q[0]), pad8(k[0]), pad8(v[0])
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    values = dict(
        dout=pad8(dout[0].to(q.dtype)),
        q=qp,
        k=kp,
        v=vp,
        out=pad8(out[0].to(q.dtype)),
        softmax_lse=lse[0].float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=how.scale,
        causal=how.causal,
        **cu_args(cu, q.device),
    )
    _call(fa.varlen_backward, fa.version, values, window, how.softcap)
    return dq[None, ..., :d], dk[None, ..., :d], dv[None, ..., :d]
