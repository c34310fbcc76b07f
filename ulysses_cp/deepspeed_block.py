"""The DeepSpeed settings a run reads, parsed once from DeepSpeed's own keys.

The config file's DeepSpeed part stays DeepSpeed's: its keys keep their names and places
(``zero_optimization.stage``, ``bf16.enabled``...), keys this module does not read are
left to DeepSpeed, and the whole dict is handed to ``deepspeed.initialize`` unchanged
(``ulysses_cp.training.engine.deepspeed_part``). :class:`DeepSpeedSettings` holds the few
values ulysses_cp itself acts on (the gradient scale, ZeRO-3's partitioned build, the
planner, the bytes logged per step), each read here and nowhere else. A value of the wrong
type is refused naming its key; ``"auto"`` (the Hugging Face Trainer fills it in) reads as
null. No torch here: train.py parses its config before importing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["DeepSpeedSettings", "TrainDtype", "with_train_dtype"]

TrainDtype = Literal["float32", "bfloat16", "float16", "auto"]
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class DeepSpeedSettings:
    """Not a block of ours: the DeepSpeed keys ulysses_cp reads, under their DeepSpeed
    names. Every other DeepSpeed key is DeepSpeed's alone."""

    zero_stage: int = 0
    """`zero_optimization.stage`: 0 to 3. Under 3 the gradient scale is the SP degree (its
    reduce-scatter averages over the SP ranks too), and a Hugging Face model is built
    partitioned."""
    reduce_scatter: bool = True
    """`zero_optimization.reduce_scatter`. With `false`, ZeRO-3 all-reduces instead and
    the gradient scale is 1."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """`zero_optimization.offload_optimizer.device`: where the optimizer state lives. The
    planner counts it on the host when not `"none"`."""
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    """`zero_optimization.offload_param.device`: where ZeRO-3 keeps the parameters."""
    reduce_bucket_size: float | None = 5e8
    """`zero_optimization.reduce_bucket_size`, in elements. `null`: `"auto"`."""
    stage3_max_live_parameters: float | None = 1e9
    """`zero_optimization.stage3_max_live_parameters`: the parameters ZeRO-3 keeps
    gathered. `null`: `"auto"`."""
    stage3_param_persistence_threshold: float | None = 1e5
    """`zero_optimization.stage3_param_persistence_threshold`: parameters this small stay
    whole on every rank. `null`: `"auto"`."""
    zero_hpz_partition_size: int = 1
    """`zero_optimization.zero_hpz_partition_size`. Above 1, a Hugging Face checkpoint is
    not streamed into ZeRO-3's partitions."""
    dtype: TrainDtype = "float32"
    """The dtype DeepSpeed trains in: `"bfloat16"` when `bf16.enabled`, `"float16"` when
    `fp16.enabled`, else `"float32"` (the model's own). `"auto"`: the Trainer decides."""
    train_micro_batch_size_per_gpu: int | None = None
    """`train_micro_batch_size_per_gpu`. `null`: absent or `"auto"` (one row)."""
    gradient_accumulation_steps: int | None = None
    """`gradient_accumulation_steps`. `null`: absent or `"auto"` (one step)."""
    optimizer: dict | None = None
    """The `optimizer` block as written (`type`, `params`). On a CPU an Adam or AdamW block
    runs as `torch.optim.AdamW`."""
    gradient_clipping: float | None = 0.0
    """`gradient_clipping`: the largest norm of the whole gradient (0: no clipping).
    `null`: `"auto"`."""
    scheduler: dict | None = None
    """The `scheduler` block as written (`type`, `params`). Under `"engine": "fsdp2"`
    WarmupLR, WarmupDecayLR and WarmupCosineLR run as a torch `LambdaLR` that gives
    DeepSpeed's learning rate at every step."""
    written: tuple[str, ...] = ()
    """The keys of the file's DeepSpeed part as written: the top-level ones, and those of
    `zero_optimization`, `bf16` and `fp16` dotted (`zero_optimization.stage`). Under
    `"engine": "fsdp2"` each one without an FSDP2 meaning is refused by name."""

    @classmethod
    def from_dict(cls, config: dict) -> DeepSpeedSettings:
        """The settings of a DeepSpeed config dict (DeepSpeed's defaults where absent)."""
        zero = _object(config, "zero_optimization")
        values: dict[str, Any] = {
            "zero_stage": _number(zero, "stage", int, 0, where="zero_optimization"),
            "reduce_scatter": _flag(zero, "reduce_scatter", True),
            "offload_optimizer": _device(zero, "offload_optimizer"),
            "offload_param": _device(zero, "offload_param"),
            "zero_hpz_partition_size": _number(
                zero, "zero_hpz_partition_size", int, 1, where="zero_optimization"
            ),
            "dtype": _dtype(config),
            "optimizer": _object(config, "optimizer") or None,
            "scheduler": _object(config, "scheduler") or None,
            "gradient_clipping": _number(config, "gradient_clipping", float, 0.0, where=""),
            "written": _written(config),
        }
        for key, default in (
            ("reduce_bucket_size", 5e8),
            ("stage3_max_live_parameters", 1e9),
            ("stage3_param_persistence_threshold", 1e5),
        ):
            values[key] = _number(zero, key, float, default, where="zero_optimization")
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            values[key] = _number(config, key, int, None, where="")
        value = cls(**values)
        if value.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_optimization.stage must be 0, 1, 2 or 3, got {value.zero_stage}"
            )
        return value

    @property
    def micro_batch(self) -> int:
        """Rows per micro-step (1 where absent or ``"auto"``)."""
        return self.train_micro_batch_size_per_gpu or 1

    @property
    def micro_steps(self) -> int:
        """Micro-steps per optimizer step (1 where absent or ``"auto"``)."""
        return self.gradient_accumulation_steps or 1

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer in ("cpu", "nvme")


def with_train_dtype(ds_config: dict, dtype: str) -> dict:
    """A copy of a DeepSpeed dict handed to DeepSpeed whose ``bf16``/``fp16`` blocks say
    ``dtype`` (``"bfloat16"``, ``"float16"`` or another: neither), their other keys kept."""
    out = dict(ds_config)
    for key, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        out[key] = {**(ds_config.get(key) or {}), "enabled": dtype == name}
    return out


def _written(config: dict) -> tuple[str, ...]:
    inner = [
        f"{block}.{key}"
        for block in ("zero_optimization", "bf16", "fp16")
        for key in _object(config, block)
    ]
    # keys starting with "_" are comments (``schema.check_top_level_keys``), not settings
    return (*(k for k in config if not str(k).startswith("_")), *inner)


def _object(config: dict, key: str) -> dict:
    block = config.get(key)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise ValueError(f"the DeepSpeed config's {key} must be an object, got {block!r}")
    return block


def _flag(block: dict, key: str, default: bool) -> bool:
    value = block.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"zero_optimization.{key} must be true or false, got {value!r}")
    return value


def _number(block: dict, key: str, kind: type, default: Any, *, where: str) -> Any:
    """An integer (``kind`` int) or number; ``"auto"`` and absent give ``default`` for the
    batch keys, None (``"auto"``) for ZeRO's sizes."""
    name = f"{where}.{key}" if where else key
    value = block.get(key)
    if value is None:
        return default
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f'{name} must be a number or "auto", got {value!r}')
    if kind is int and value != int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return kind(value)


def _device(zero: dict, key: str) -> str:
    device = _object(zero, key).get("device", "none") if zero.get(key) is not None else "none"
    if device not in OFFLOAD_DEVICES:
        raise ValueError(
            f"zero_optimization.{key}.device must be one of {list(OFFLOAD_DEVICES)}, got {device!r}"
        )
    return device


def _dtype(config: dict) -> TrainDtype:
    for key, name in (("bf16", "bfloat16"), ("fp16", "float16")):
        enabled = _object(config, key).get("enabled", False)
        if enabled == "auto":
            return "auto"
        if enabled:
            return name  # type: ignore[return-value]
    return "float32"
