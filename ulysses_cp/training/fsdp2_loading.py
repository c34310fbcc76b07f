"""Hugging Face safetensors weights into a model sharded by FSDP2, each rank reading its rows.

The model is built on the meta device, ``fully_shard``ed and given storage with
``to_empty(device=...)``; :func:`load_safetensors_sharded` then fills it. Each parameter
is a DTensor (``Shard(0)`` over the FSDP mesh): a rank reads, through safetensors'
``get_slice``, only the box of the tensor its local shard holds (the rows
``[offset, offset + local rows)``; the last ranks may hold fewer rows, or none), so no
rank ever holds a whole copy of the model. Plain tensors (buffers, parameters left
unsharded) are read whole.

The names are those of the outermost Hugging Face model inside ``model`` (the model
itself, or ``HFCausalLM``'s ``.model``): what ``save_pretrained`` writes. The rules are
the ZeRO-3 loader's (``loading.py``): a tied parameter needs one of its names in the
checkpoint (Hugging Face leaves out ``lm_head.weight`` when it is tied to the
embeddings), a parameter under none of its names is an error, a shape that differs is an
error. Two more, since ``to_empty`` leaves every tensor uninitialised: a checkpoint
tensor the model lacks is an error, and so is a persistent buffer the checkpoint lacks.

Non-persistent buffers (rotary embeddings' ``inv_freq``) are in no checkpoint:
:func:`init_buffers` recomputes them with the owning Hugging Face model's
``_init_weights`` (transformers 5 recomputes rotary buffers there from the config).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .loading import check_shape, checkpoint_files, match_checkpoint

__all__ = ["init_buffers", "load_safetensors_sharded"]


def _hf_root(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost ``transformers.PreTrainedModel`` in ``model`` (``model`` when none)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return model
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


def _owners(model: torch.nn.Module) -> dict[str, Any]:
    """Module name -> the innermost ``PreTrainedModel`` holding it (absent: none)."""
    from transformers import PreTrainedModel

    owners: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            owners[name] = module
            continue
        parent = name.rpartition(".")[0] if "." in name else ""
        if name and parent in owners:
            owners[name] = owners[parent]
    return owners


def init_buffers(model: torch.nn.Module) -> list[str]:
    """Recompute every non-persistent floating-point buffer of ``model`` (after
    ``to_empty``, they hold garbage) by the owning Hugging Face model's ``_init_weights``
    on the module that holds it. Run it before the parameters are loaded: ``_init_weights``
    may draw a module's own parameters too, which the load then overwrites. Returns the
    buffers' names.

    Raises:
        ValueError: a buffer that no ``_init_weights`` wrote (checked by filling it with
            NaN first), naming it: recompute it before training.
    """
    pending = {
        (mod_name, buf_name): module
        for mod_name, module in model.named_modules()
        for buf_name, buf in module.named_buffers(recurse=False)  # in registration order
        if buf_name in module._non_persistent_buffers_set and buf.is_floating_point()
    }
    try:
        owners = _owners(model)
    except ImportError:  # pragma: no cover
        owners = {}
    done: set[str] = set()
    with torch.no_grad():
        for (_, buf_name), module in pending.items():
            getattr(module, buf_name).fill_(float("nan"))
        for (mod_name, _), module in pending.items():
            if mod_name in owners and mod_name not in done:
                owners[mod_name]._init_weights(module)
                done.add(mod_name)
    names = [f"{m}.{b}" if m else b for m, b in pending]
    left = [n for n, (key, module) in zip(names, pending.items()) if _unset(module, key[1])]
    if left:
        raise ValueError(
            f"init_buffers: no Hugging Face _init_weights recomputes the non-persistent "
            f"buffers {left} after to_empty; set them yourself before training (for a "
            f"module of your own: its constructor's formula)"
        )
    return names


def _unset(module: torch.nn.Module, name: str) -> bool:
    buf = getattr(module, name)
    return bool(torch.isnan(buf).any())


def _local_box(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of a DTensor's local shard: the box it reads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [p for p in param.placements if type(p) not in (Shard, Replicate)]
    if odd:
        raise ValueError(
            f"load_safetensors_sharded reads Shard and Replicate placements, not {odd}: "
            f"load before any other parallelism is applied, or load whole"
        )
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    assert tuple(local.shape) == tuple(shape), (local.shape, shape)
    return tuple(shape), tuple(offset)


def _read_box(reader: Any, key: str, target: Any) -> torch.Tensor | None:
    """The part of tensor ``key`` that ``target`` holds on this rank (None: nothing),
    read from the file through ``get_slice``; a shape that differs is a ``ValueError``."""
    from torch.distributed.tensor import DTensor

    view = reader.get_slice(key)
    check_shape(key, view.get_shape(), target.shape)
    if not isinstance(target, DTensor):
        return reader.get_tensor(key)
    local, offset = _local_box(target)
    if 0 in local:
        return None
    if not list(target.shape):  # a 0-d tensor: nothing to slice
        return reader.get_tensor(key)
    return view[tuple(slice(o, o + n) for o, n in zip(offset, local))]


def load_safetensors_sharded(model: torch.nn.Module, folder: str | Path) -> int:
    """Fill ``model`` (built on meta, ``fully_shard``ed, ``to_empty``'d) from the
    safetensors checkpoint in ``folder`` (``model.safetensors``, or shards with their
    ``model.safetensors.index.json``): each DTensor parameter's local shard from its own
    rows, plain tensors whole, cast to the dtype each has in the model; then
    :func:`init_buffers`. Every rank calls it; it runs no collective of its own.
    Returns how many tensors were read.

    Raises:
        ValueError: tensors still on the meta device (``to_empty`` not called), or
            outside the Hugging Face model inside ``model``;
            ``folder`` holds no safetensors checkpoint; tensors the checkpoint
            lacks (parameters, persistent buffers) or has beyond the model's, or a shape
            that differs, naming them.
    """
    from safetensors import safe_open

    root = _hf_root(model)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"load_safetensors_sharded: {len(meta)} tensors are still on the meta device "
            f"({meta[:4]}): call model.to_empty(device=...) after fully_shard, then load"
        )
    init_buffers(model)
    files = checkpoint_files(folder)
    if not files:
        raise ValueError(
            f"model.hf_weights: {folder} holds neither model.safetensors nor "
            f"model.safetensors.index.json: save the weights with "
            f"save_pretrained(safe_serialization=True)"
        )
    inside = {id(t) for t in [*root.parameters(), *root.buffers()]}
    outside = [
        n
        for n, t in [*model.named_parameters(), *_persistent_buffers(model)]
        if id(t) not in inside
    ]
    if outside:
        raise ValueError(
            f"load_safetensors_sharded: {outside[:6]} lie outside the Hugging Face model "
            f"the checkpoint is for ({type(root).__name__}); no file fills them"
        )
    todo = match_checkpoint(root, files, folder)
    known = {n for n, _ in root.named_parameters(remove_duplicate=False)}
    persistent = {n for n, _ in _persistent_buffers(root)}
    extra = sorted(set(files) - known - {n for n, _ in root.named_buffers()})
    lacking = sorted(persistent - set(files))
    if extra or lacking:
        raise ValueError(
            f"model.hf_weights: {folder} does not match the model: tensors the model lacks "
            f"{extra[:6]} ({len(extra)}), persistent buffers the checkpoint lacks "
            f"{lacking[:6]} ({len(lacking)}); use the config.json saved with the weights"
        )
    read = 0
    with torch.no_grad():
        for file, entries in sorted(todo.items()):
            with safe_open(file, framework="pt") as reader:
                for key, target in entries:
                    part = _read_box(reader, key, target)
                    if part is not None:
                        local = target.to_local() if hasattr(target, "to_local") else target
                        local.copy_(part.to(local.dtype))
                    read += 1
    return read


def _persistent_buffers(model: torch.nn.Module):
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf
