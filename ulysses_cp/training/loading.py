"""Hugging Face models built partitioned under ZeRO-3: no rank ever holds the whole model.

Under ZeRO stage 3 (:func:`partitioned_build` applies) the model is constructed inside
``deepspeed.zero.Init`` over every rank (the group ZeRO shards over, as
``engine._partition_over_all_ranks`` does for a model built whole). Each module's
parameters exist in full only while its own ``__init__`` runs; then each rank keeps its
slice. Then either:

- **random init** gives the numbers a whole-model build gives for the same seed (on CPU):
  the constructors draw from torch's generator in the same order on every rank, and
  transformers' ``initialize_weights`` pass runs in its own order (children first) on
  the partitions, every rank drawing each parameter's whole stream in bounded row blocks
  and keeping its slice (``partitioned_init.py``), so every rank's generator stays in
  step. On GPU the constructors run on the GPU (zero.Init's device), so the numbers come
  from the CUDA generator: deterministic and the same on every rank, but not the CPU
  numbers of a ZeRO 0-2 run with that seed;
- **``hf_weights``** (a folder of safetensors files, one file or shards with their
  ``model.safetensors.index.json``) is read tensor by tensor, and of each tensor only the
  rows that hold this rank's slice (:func:`stream_weights`): a rank reads about 1/world of
  the checkpoint. Construction skips the random init (transformers' ``no_init_weights``).

Peak host memory per rank during the load: its slice of the model plus the largest
module while its constructor runs (random init) or a few rows (streaming), measured by
``scripts/benchmark_loading.py`` (``docs/benchmarks/loading.md``).

The guard and probe of :class:`~ulysses_cp.models.hf.HFCausalLM` need the weights, so a
partitioned model is probed by :func:`~ulysses_cp.training.engine.initialize` right after
``deepspeed.initialize``, when ZeRO-3 fetches each module's weights as it runs.

A checkpoint whose tensor names are not the model's parameter names (families whose
checkpoints transformers converts while loading), ``.bin`` checkpoints and ZeRO++'s
secondary partitions (``zero_hpz_partition_size > 1``) are loaded the old way (whole,
then partitioned), with a warning that says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from pathlib import Path
from typing import Any

import torch

from ..config import HFModelConfig, RunConfig
from ..core.log import get_logger
from ..core.tiles import TilePlan
from ..core.topology import Topology
from ..deepspeed_block import DeepSpeedSettings, with_train_dtype
from ..models import hf
from .engine import SequenceParallelMPU, deepspeed_part
from .partitioned_init import partitioned_initialize, slice_bounds

__all__ = [
    "build_partitioned",
    "check_shape",
    "checkpoint_files",
    "match_checkpoint",
    "partitioned_build",
    "stream_weights",
]

log = get_logger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def partitioned_build(run: RunConfig) -> bool:
    """Whether ``run`` builds its Hugging Face model partitioned: ZeRO stage 3."""
    return isinstance(run.model, HFModelConfig) and run.deepspeed.zero_stage == 3


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a local checkpoint folder (sharded with its
    index, or one ``model.safetensors``); empty when the folder has neither."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE).is_file():
        with safe_open(folder / SINGLE, framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE)
    return {}


def _train_dtype(settings: DeepSpeedSettings, dtype: torch.dtype) -> torch.dtype:
    """The dtype DeepSpeed trains in: bf16/fp16 when enabled, else the model's."""
    if settings.dtype in ("bfloat16", "float16"):
        return getattr(torch, settings.dtype)
    return dtype


def _release_freed() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). A module's whole parameters are freed once partitioned, but the
    allocator keeps such holes between the partitions that follow: measured here, a
    350M-parameter random init peaked at 654 MiB per rank without this and about half
    that with it, at 4 ranks."""
    global _trim
    if _trim is None:
        libc = ctypes.util.find_library("c")
        _trim = getattr(ctypes.CDLL(libc), "malloc_trim", False) if libc else False
    if _trim:
        _trim(0)


_trim: Any = None


def _zero_init(run: RunConfig, topo: Topology, dtype: torch.dtype):
    """``deepspeed.zero.Init`` over every rank, creating tensors in the model's dtype."""
    import deepspeed

    mpu = SequenceParallelMPU(topo)
    # zero.Init takes its dtype from the config's bf16/fp16 blocks when given none (its
    # ``dtype=`` argument is overridden by the accelerator's choice on CPU, deepspeed 0.19.8)
    ds_config = with_train_dtype(deepspeed_part(run), str(dtype).removeprefix("torch."))
    init = deepspeed.zero.Init(
        data_parallel_group=mpu.get_sequence_data_parallel_group(),
        config_dict_or_path=ds_config,
        mpu=mpu,
        mem_efficient_linear=False,  # F.linear stays torch's: the numbers of a ZeRO 0-2 run
    )
    partition = init._post_init_method  # run after each module's __init__

    def partition_and_release(module: torch.nn.Module) -> None:
        partition(module)
        _release_freed()

    init._post_init_method = partition_and_release
    return init


def _own_initializers(model: torch.nn.Module) -> list[str]:
    """Classes in the model that override ``initialize_weights`` (it would run on empty
    partitions)."""
    from transformers.modeling_utils import PreTrainedModel

    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, PreTrainedModel)
            and type(m).initialize_weights is not PreTrainedModel.initialize_weights
        }
    )


def _streamable(folder: Path, model_names: set[str], run: RunConfig) -> str | None:
    """Why the checkpoint cannot be streamed into partitions (None: it can)."""
    if run.deepspeed.zero_hpz_partition_size > 1:
        return "zero_hpz_partition_size > 1 keeps secondary partitions this loader does not fill"
    files = checkpoint_files(folder)
    if not files:
        return f"no {SINGLE} or {INDEX} in {folder}"
    missing = sorted(model_names - set(files))
    if missing:
        return f"the checkpoint's tensor names differ from the model's (missing: {missing[:4]})"
    return None


def _param_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def check_shape(key: str, stored: Any, model: Any) -> None:
    """Tensor ``key``'s shape in the checkpoint against the model's: a ``ValueError`` that
    names both and the fix when they differ."""
    if list(stored) != list(model):
        raise ValueError(
            f"model.hf_weights: {key} has shape {list(stored)} in the checkpoint and "
            f"{list(model)} in the model: the config (model.hf_config) does not "
            f"match the weights; use the config.json saved with them"
        )


def _read_slice(reader: Any, key: str, param: Any) -> torch.Tensor | None:
    """This rank's flat slice of tensor ``key`` (only the rows that hold it are read), or
    None when the slice lies wholly in the padding past the tensor's end. ``param``: a
    ZeRO-3 parameter (``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_process_group``)."""
    view = reader.get_slice(key)
    shape = tuple(view.get_shape())
    check_shape(key, shape, param.ds_shape)
    numel = int(param.ds_numel)
    start, end = slice_bounds(param)
    if start >= end:
        return None
    if len(shape) < 2:
        return reader.get_tensor(key).reshape(-1)[start:end]
    row = numel // shape[0]
    first, last = start // row, -(-end // row)
    rows = view[first:last]  # (last - first, *shape[1:]): the rows holding the slice
    return rows.reshape(-1)[start - first * row : end - first * row]


def match_checkpoint(
    model: torch.nn.Module, files: dict[str, Path], folder: str | Path
) -> dict[Path, list[tuple[str, Any]]]:
    """Safetensors file -> (tensor name, the parameter or buffer of ``model`` it fills).
    A parameter is found under any of its names (tied weights: one of them suffices, as
    Hugging Face saves one); a buffer only when the checkpoint has it. ``files``:
    :func:`checkpoint_files` of ``folder``. Raises ``ValueError`` naming the parameters
    the checkpoint lacks."""
    params = {id(p): p for p in model.parameters()}
    todo: dict[Path, list[tuple[str, Any]]] = {}
    missing = []
    for pid, aliases in _param_names(model).items():
        key = next((a for a in aliases if a in files), None)
        if key is None:
            missing.append(aliases[0])
        else:
            todo.setdefault(files[key], []).append((key, params[pid]))
    for name, buf in model.named_buffers():
        if name in files:
            todo.setdefault(files[name], []).append((name, buf))
    if missing:
        raise ValueError(
            f"model.hf_weights: {folder} lacks {len(missing)} of the model's parameters "
            f"({missing[:6]}): save the weights with save_pretrained from this config"
        )
    return todo


def stream_weights(model: torch.nn.Module, folder: str | Path) -> int:
    """Fill the ZeRO-3 partitions (and persistent buffers) of ``model`` from the
    safetensors checkpoint in ``folder``: each rank reads only its slice of each
    tensor. Returns how many tensors were read. Raises ``ValueError`` naming the
    tensors the checkpoint lacks or whose shape differs."""
    from safetensors import safe_open

    todo = match_checkpoint(model, checkpoint_files(folder), folder)
    read = 0
    with torch.no_grad():
        for file, entries in sorted(todo.items()):
            with safe_open(file, framework="pt") as reader:
                for key, target in entries:
                    _fill(reader, key, target)
                    read += 1
            _release_freed()
    return read


def _fill(reader: Any, key: str, target: Any) -> None:
    if hasattr(target, "ds_id"):
        part = _read_slice(reader, key, target)
        if part is not None:
            target.ds_tensor.narrow(0, 0, part.numel()).copy_(part)
        return
    full = reader.get_tensor(key)
    if full.shape != target.shape:
        raise ValueError(
            f"model.hf_weights: {key} has shape {list(full.shape)} in the checkpoint and "
            f"{list(target.shape)} in the model: use the config.json saved with the weights"
        )
    target.copy_(full)


def _cast_partitions(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's bf16/fp16 for a model built in another dtype: each partition cast, as
    ``model.to(dtype)`` would before partitioning (the same rounding)."""
    p: Any
    for p in model.parameters():
        if p.dtype != dtype and hasattr(p, "ds_id"):
            p.ds_tensor.data = p.ds_tensor.data.to(dtype)
            p.data = torch.empty(0, dtype=dtype, device=p.data.device)


def build_partitioned(
    run: RunConfig,
    topo: Topology,
    *,
    backend: str | None = None,
    layout: str | None = None,
    tiles: TilePlan | None = None,
) -> torch.nn.Module:
    """The run's Hugging Face model (``run.model``) built under ZeRO-3 without a whole
    copy on any rank (module docstring), wrapped as :class:`~ulysses_cp.models.hf.HFCausalLM`
    and not yet probed (:func:`~ulysses_cp.training.engine.initialize` probes it). Falls
    back to :func:`ulysses_cp.models.hf.build_model` (whole, then partitioned), with a
    warning, for checkpoints it cannot stream. ``tiles``: the run's tile plan (None: the
    block's)."""
    from transformers import initialization

    mc = run.model
    assert isinstance(mc, HFModelConfig)
    hf.transformers_module()  # a clear error without transformers
    hf.register_attention(topo, backend=backend, layout=layout)
    config = hf.load_config(mc.hf_config)
    dtype = hf.DTYPES[mc.dtype]
    folder = Path(mc.hf_weights) if mc.hf_weights else None
    if folder is not None and not folder.is_dir():
        raise ValueError(f"model.hf_weights: {folder} is not a local folder")
    init = (
        partitioned_initialize(_release_freed)
        if folder is None
        else initialization.no_init_weights()
    )
    with _zero_init(run, topo, dtype), init:
        model = hf.from_config(config, dtype=dtype)
    if folder is not None:
        model.tie_weights()  # no_init_weights skipped post_init's tying
        names = {n for n, _ in model.named_parameters()}
        why = _streamable(folder, names, run)
        if why is not None:
            log.warning(f"model.hf_weights: loading whole on every rank: {why}")
            del model
            return hf.build_model(topo, mc, backend=backend, layout=layout, tiles=tiles)
        stream_weights(model, folder)
        model.eval()  # as from_pretrained returns it
    elif own := _own_initializers(model):
        raise ValueError(
            f"{own} override initialize_weights, which would run on empty ZeRO-3 "
            f"partitions; build this model with ZeRO stage 0-2, or give model.hf_weights"
        )
    _cast_partitions(model, _train_dtype(run.deepspeed, dtype))
    return hf.wrap(model, topo, mc, layout=layout, tiles=tiles)
