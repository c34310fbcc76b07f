"""What a config file may hold, checked with the key and the numbers in every message.

:func:`from_block` turns one JSON object (a block) into its dataclass: unknown keys are
refused with the valid ones, and every value's type is checked against the field's
annotation (``int``, ``float``, ``bool``, ``str``, ``Literal`` choices, lists, ``X | None``)
with a message naming the key; the dataclass's ``check()`` adds the rules between fields.
:func:`check_top_level_keys` refuses top-level keys that are neither our blocks nor
DeepSpeed's (DeepSpeed would drop a misspelled block silently). :data:`PATH_FIELDS` are the
fields that name files, resolved against the config file's folder (:func:`resolve_paths`).
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar, get_args, get_origin

__all__ = [
    "DEEPSPEED_KEYS",
    "PATH_FIELDS",
    "at_least",
    "block_values",
    "check_top_level_keys",
    "from_block",
    "known_top_level_keys",
    "resolve_paths",
]

T = TypeVar("T")


def _describe(hint) -> str:
    origin = get_origin(hint)
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is dict:
        return "an object"
    if hint is type(None):
        return "null"
    if origin is Literal:
        return f"one of {list(get_args(hint))}"
    if origin is list:
        return f"a list of {_describe(get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(hint))
    return str(hint)


def _fits(value, hint) -> bool:
    origin = get_origin(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, get_args(hint)[0]) for v in value)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in get_args(hint))
    return True  # an annotation this checker does not know: the block's check() decides


def from_block(cls: type[T], block: dict | None, name: str) -> T:
    """``cls(**block)``: ``ValueError`` naming unknown keys (and the valid ones), or a value
    whose type does not fit its field's annotation (naming the key, the type, the value)."""
    value = cls(**block_values(block, typing.get_type_hints(cls), name))
    check = getattr(value, "check", None)
    if check is not None:
        check()
    return value


def block_values(block: dict | None, hints: dict, name: str) -> dict:
    """A copy of a block (``{}`` for None) whose keys are in ``hints`` and whose values fit
    their annotations there; ``ValueError`` naming an unknown key (with the closest valid
    ones and all of them) or a value of the wrong type (the key, the type, the value)."""
    if block is not None and not isinstance(block, dict):
        raise ValueError(f'the "{name}" block must be a JSON object, got {block!r}')
    block = dict(block or {})
    known = sorted(hints)
    unknown = sorted(set(block) - set(known))
    if unknown:
        close = [(_closest(k, known), k) for k in unknown]
        means = ", ".join(f"{' or '.join(map(repr, c))} for {k!r}" for c, k in close if c)
        hint = f" (did you mean {means}?)" if means else ""
        raise ValueError(
            f'unknown keys in the "{name}" block: {unknown}{hint}; valid keys: {known}'
        )
    for key, value in block.items():
        if not _fits(value, hints[key]):
            raise ValueError(f"{name}.{key} must be {_describe(hints[key])}, got {value!r}")
    return block


def at_least(block: str, obj, names: tuple[str, ...], low: int) -> None:
    for n in names:
        if getattr(obj, n) < low:
            raise ValueError(f"{block}.{n} must be >= {low}, got {getattr(obj, n)!r}")


# DeepSpeed's documented top-level blocks and keys (deepspeed 0.19); the string constants of
# deepspeed.runtime.constants are added when deepspeed imports (see known_top_level_keys)
DEEPSPEED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "amp",
    "torch_autocast",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "flops_profiler",
    "activation_checkpointing",
    "sparse_attention",
    "data_efficiency",
    "curriculum_learning",
    "tensorboard",
    "csv_monitor",
    "wandb",
    "comet",
    "comms_logger",
    "autotuning",
    "elasticity",
    "communication_data_type",
    "data_types",
    "checkpoint",
    "aio",
    "nebula",
    "compression_training",
    "pipeline",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "weight_quantization",
    "hybrid_engine",
    "compile",
    "data_parallel_size",
    "sequence_parallel_size",
    "disable_allgather",
    "dataloader_drop_last",
    "seq_parallel_communication_data_type",
    "gradient_allreduce_op",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "use_node_local_storage",
    "load_universal",
    "graph_harvesting",
    "timers",
    "tensor_parallel",
    "vocabulary_size",
    "disable_python_gc",
)


def known_top_level_keys(ours: tuple[str, ...]) -> set[str]:
    """Top-level keys a config may hold: ``ours`` (our blocks) and DeepSpeed's."""
    return {*ours, *DEEPSPEED_KEYS, *_deepspeed_constants()}


@functools.cache
def _deepspeed_constants() -> frozenset[str]:
    """The string constants of the installed ``deepspeed/runtime/constants.py`` (the
    config keys DeepSpeed reads), read from its source: importing DeepSpeed to parse a
    config would take seconds and print its accelerator warning. Empty when there is no
    DeepSpeed (the documented list alone)."""
    spec = importlib.util.find_spec("deepspeed")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    try:
        tree = ast.parse((Path(folders[0]) / "runtime" / "constants.py").read_text())
    except (IndexError, OSError, SyntaxError):
        return frozenset()
    consts = {  # class-level string constants, read through ``Class.NAME`` too
        f"{c.name}.{t.id}": n.value.value
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for n in c.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    keys = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            text = consts.get(f"{value.value.id}.{value.attr}")
        else:
            text = value.value if isinstance(value, ast.Constant) else None
        upper = any(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
        if upper and isinstance(text, str) and text.isidentifier():
            keys.add(text)
    return frozenset(keys)


def _closest(key: object, known) -> list[str]:
    """The (at most two) known keys closest to a misspelt one."""
    return difflib.get_close_matches(str(key), sorted(known), n=2, cutoff=0.6)


def check_top_level_keys(config: dict, ours: tuple[str, ...], source: str) -> None:
    """DeepSpeed ignores top-level keys it does not know, so a misspelled block (say
    ``"sequence_paralel"``) would silently train without it: refuse unknown keys, with the
    closest known ones. Keys starting with ``_`` are left alone (comments)."""
    known = known_top_level_keys(ours)
    unknown = sorted(k for k in config if k not in known and not str(k).startswith("_"))
    if unknown:
        hints = []
        for key in unknown:
            close = _closest(key, known)
            hints.append(
                f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
            )
        raise ValueError(
            f"unknown top-level key(s) in {source}: {', '.join(hints)}. DeepSpeed would ignore "
            f"them silently; fix the spelling, or start a key with '_' to keep it as a comment"
        )


PATH_FIELDS = (
    ("model", "hf_config"),
    ("model", "hf_weights"),
    ("data", "files"),
    ("data", "tokenizer"),
    ("data", "cache_dir"),
    ("eval", "files"),
)


def resolve_paths(config: dict, base: Path) -> dict:
    """Relative file paths in our blocks (``model.hf_config``, ``model.hf_weights``,
    ``data.files``, ``data.tokenizer``, ``data.cache_dir``, ``eval.files``) made relative
    to ``base``, the config file's folder, so that a config means the same files from
    whatever folder the run starts in."""
    for block, key in PATH_FIELDS:
        value = config.get(block, {}).get(key) if isinstance(config.get(block), dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            config[block][key] = str(base / value)
        elif isinstance(value, list):
            config[block][key] = [
                str(base / v) if isinstance(v, str) and not Path(v).is_absolute() else v
                for v in value
            ]
    return config
