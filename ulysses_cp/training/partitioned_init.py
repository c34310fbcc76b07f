"""transformers' random-init pass on ZeRO-3 partitions, with no parameter whole on a rank.

``PreTrainedModel.initialize_weights`` (run by each model's ``post_init``) visits modules
children first and calls the model's ``_initialize_weights`` on each. Under
``deepspeed.zero.Init`` a parameter is already partitioned then (``param.data`` is empty,
``param.ds_tensor`` holds this rank's flat slice). :func:`partitioned_initialize` runs the
same pass, on every rank, in the same order, with each partitioned parameter the call may
touch (the module's own and its direct children's) standing as a meta tensor of its full
shape (:class:`_Replay`, at torch's dispatch level):

- ``normal_``, ``uniform_``, ``zero_`` and ``fill_`` on such a parameter (what
  ``torch.nn.init``'s ``normal_``, ``uniform_``, ``kaiming_uniform_``, ``zeros_``,
  ``ones_``, ``constant_`` and transformers' guarded versions of them end in) draw the whole
  tensor from the generator, ``ROW_BLOCK_BYTES`` of rows at a time, and keep the rows'
  overlap with this rank's slice. Every rank draws the whole stream, so the generator ends
  where a whole build leaves it and no rank waits for another;
- anything else that would read or write such a parameter's values (a row view, ``.data``,
  an init that computes on the tensor or skips meta tensors, e.g. ``trunc_normal_``) raises
  inside the mode; the generator is then rewound and that module's call re-run on gathered
  parameters, the whole module on every rank (exact; its memory as before), with a warning
  naming the op.

Why the blocks equal one call (torch's CPU kernels, checked by ``tests/unit/test_loading.py``):
``uniform_`` draws element by element, so any split gives the same numbers; ``normal_`` on
a contiguous tensor of n >= 16 elements draws n uniforms, turns each group of 16 into
normals (Box-Muller), and, when 16 does not divide n, draws 16 more for the last 16
elements. Blocks whose sizes are multiples of 16, with a last block of at least 16
elements, therefore reproduce it; :func:`row_blocks` cuts them so.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.log import get_logger

__all__ = ["ROW_BLOCK_BYTES", "partitioned_initialize", "row_blocks", "slice_bounds"]

log = get_logger(__name__)
ROW_BLOCK_BYTES = 4 * 2**20  # the most one drawn block of rows holds
_NORMAL_GROUP = 16  # torch's CPU normal_ turns uniforms into normals 16 at a time
aten = torch.ops.aten
_DRAWS = {aten.normal_.default, aten.uniform_.default}
_FILLS = {aten.zero_.default, aten.fill_.Scalar}
_META_GETTERS: dict[Any, str] = {
    getattr(torch.Tensor, name).__get__: name for name in ("is_meta", "device")
}


def slice_bounds(param: Any) -> tuple[int, int]:
    """``[start, end)``: the flat elements of ZeRO-3 parameter ``param`` that this rank's
    partition holds (``end <= start`` when it lies wholly in the padding)."""
    size = int(param.ds_tensor.ds_numel)  # the partition, padded to equal sizes
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, min(start + size, int(param.ds_numel))


def row_blocks(shape: tuple[int, ...], elem_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """``[first, last)`` row ranges covering ``shape[0]`` rows (a 0-d or 1-d tensor: its
    elements), each at most ``block_bytes`` where a row allows, whose element counts are
    multiples of 16 but for the last, which holds at least 16 (module docstring)."""
    rows = shape[0] if shape else 1
    row = math.prod(shape[1:]) if shape else 1
    if rows * row < _NORMAL_GROUP:
        return [(0, rows)]
    step = _NORMAL_GROUP // math.gcd(row, _NORMAL_GROUP)  # rows per 16-element multiple
    per = max(step, block_bytes // max(1, row * elem_bytes) // step * step)
    bounds = [(r, min(r + per, rows)) for r in range(0, rows, per)]
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * row < _NORMAL_GROUP:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


def _draw(param: Any, func: Callable, args: tuple, kwargs: dict) -> None:
    """``func`` (``Tensor.normal_`` / ``uniform_``) on the whole of ``param``, drawn in row
    blocks; this rank's slice of the result goes into ``param.ds_tensor``."""
    shape = tuple(param.ds_shape)
    own, (start, end) = param.ds_tensor, slice_bounds(param)
    row = math.prod(shape[1:]) if shape else 1
    for first, last in row_blocks(shape, own.element_size(), ROW_BLOCK_BYTES):
        block = torch.empty((last - first, *shape[1:]), dtype=own.dtype, device=own.device)
        func(block, *args, **kwargs)  # the generator advances as over the whole tensor
        lo, hi = max(start, first * row), min(end, last * row)
        if lo < hi:  # the block's overlap with this rank's slice
            flat = block.reshape(-1)
            own.narrow(0, lo - start, hi - lo).copy_(flat[lo - first * row : hi - first * row])


def _fill(param: Any, func: Callable, args: tuple, kwargs: dict) -> None:
    start, end = slice_bounds(param)
    if start < end:
        func(param.ds_tensor.narrow(0, 0, end - start), *args, **kwargs)


class _Unsupported(Exception):
    """An init call used a stood-in parameter other than by a draw or fill."""


class _Replay(TorchDispatchMode):
    """While one init call runs: draws and fills on the stood-in parameters go to their
    partitions (module docstring); any other op given a meta tensor raises
    :class:`_Unsupported`. Shape, dim and dtype are no ops here: the meta tensors answer."""

    def __init__(self, params: dict[int, Any]) -> None:
        super().__init__()
        self.params = params  # id(stand-in) -> the partitioned parameter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.params.get(id(args[0])) if args else None
        if target is not None and func in _DRAWS:
            _draw(target, func, args[1:], kwargs)
            return args[0]
        if target is not None and func in _FILLS:
            _fill(target, func, args[1:], kwargs)
            return args[0]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.is_meta or hasattr(t, "ds_id") for t in tensors):
            # values made from, or put into, a stand-in, or a partitioned parameter the
            # call was not given (of a module deeper down)
            raise _Unsupported(str(func))
        return func(*args, **kwargs)


class _NoMetaChecks(TorchFunctionMode):
    """torch.nn.init's ``trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_``
    return a meta tensor untouched (no draws): asking a stand-in ``is_meta`` or its
    ``device`` raises :class:`_Unsupported` instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _META_GETTERS and args and args[0].is_meta:
            raise _Unsupported(f"Tensor.{_META_GETTERS[func]}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _stand_in(modules: list[torch.nn.Module]) -> Iterator[dict[int, Any]]:
    """The partitioned parameters of ``modules`` (their own) replaced, for the duration, by
    parameters holding meta tensors of their full shape (a tied parameter by one stand-in).
    Yields id(stand-in) -> the partitioned parameter."""
    stand: dict[int, Any] = {}
    swapped = []
    p: Any
    for m in modules:
        for name, p in m._parameters.items():
            if p is None or not hasattr(p, "ds_id"):
                continue
            if id(p) not in stand:
                meta = torch.empty(tuple(p.ds_shape), dtype=p.ds_tensor.dtype, device="meta")
                stand[id(p)] = torch.nn.Parameter(meta, requires_grad=p.requires_grad)
                if hasattr(p, "_is_hf_initialized"):
                    stand[id(p)]._is_hf_initialized = p._is_hf_initialized
            swapped.append((m, name, p))
            m._parameters[name] = stand[id(p)]
    try:
        yield {id(stand[id(p)]): p for _, _, p in swapped}
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


def _call_on_partitions(module: torch.nn.Module, fn, custom: bool, modules: list[Any]) -> None:
    """``fn(module, custom)`` with the partitioned parameters of ``modules`` drawn into
    their partitions; on an op the blocks cannot replay, rewind the generator and run it
    on gathered parameters. Off the CPU (zero.Init on an accelerator) the call always
    runs gathered: other generators' kernels draw differently in blocks than in one call."""
    import deepspeed

    params = list({id(p): p for m in modules for p in m.parameters(recurse=False)}.values())
    params = [p for p in params if hasattr(p, "ds_id")]
    if all(p.ds_tensor.device.type == "cpu" for p in params):
        rng = torch.get_rng_state()
        try:
            with _stand_in(modules) as stand, _NoMetaChecks(), _Replay(stand):
                fn(module, custom)
            return
        except _Unsupported as op:
            log.warning(
                f"{type(module).__name__}: its init uses {op} on a parameter; initialized "
                f"on the gathered (whole) module instead, on every rank"
            )
        torch.set_rng_state(rng)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        fn(module, custom)


def _apply(module: torch.nn.Module, fn, custom: bool, release: Callable[[], None]) -> None:
    """transformers' ``smart_apply``: children first; a sub-model brings its own init."""
    from transformers.modeling_utils import PreTrainedModel

    for child in module.children():
        if isinstance(child, PreTrainedModel):
            _apply(child, child._initialize_weights, custom, release)
        else:
            _apply(child, fn, custom, release)
    standard = getattr(fn, "__func__", None) is PreTrainedModel._initialize_weights
    if standard and getattr(module, "_is_hf_initialized", False):
        return  # fn would return at once
    # what fn may touch: the module's own parameters and its direct children's
    modules = [module] + [c for c in module.children() if not isinstance(c, PreTrainedModel)]
    _call_on_partitions(module, fn, custom, modules)
    release()


@contextlib.contextmanager
def partitioned_initialize(release: Callable[[], None] = lambda: None) -> Iterator[None]:
    """``PreTrainedModel.initialize_weights`` run on ZeRO-3 partitions for the duration
    (module docstring); ``release()`` after each module's call (hand freed pages back)."""
    from transformers import initialization
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.initialize_weights

    def initialize_weights(self) -> None:
        with torch.no_grad(), initialization.guard_torch_init_functions():
            _apply(self, self._initialize_weights, self.is_custom_code(), release)

    PreTrainedModel.initialize_weights = initialize_weights
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights = original
