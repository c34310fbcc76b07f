"""A run's config: the file read and checked once, every block of ours as a dataclass.

A config file is a DeepSpeed JSON plus our blocks: ``"sequence_parallel"``, ``"model"``
(the reference decoder, or a Hugging Face model when it has ``hf_config``), ``"data"``,
``"eval"`` and ``"training"`` (the last three declared in ``ulysses_cp.run_blocks``).
Each field's docstring is its key's entry in the generated config reference.
:meth:`RunConfig.load` reads the file (:func:`read_config`: JSON syntax errors with the
line, unknown top-level keys, relative paths resolved against the file's folder) and parses
every block (``ulysses_cp.schema.from_block``: unknown keys and values of the wrong type
refused naming the key; each block's ``check()`` adds the rules between fields; from a
file, the error names the file and the key's line), and the DeepSpeed keys a run acts on
(``ulysses_cp.deepspeed_block.DeepSpeedSettings``: ``run.deepspeed``). The Hugging Face
Trainer subclasses load their DeepSpeed JSON here too (``trainer=True``).
Everything after takes the parsed :class:`RunConfig`; the DeepSpeed part is handed on
unchanged (``ulysses_cp.training.engine.deepspeed_part``), and nothing else reads ``raw``
but the tracker's copy and the planner's writer (``tests/test_one_config.py``). A leaf of
the import graph but for ``core``, ``schema``, ``run_blocks`` and ``deepspeed_block``: the
head and vocabulary counts of a Hugging Face config are asked from ``ulysses_cp.models.hf``
by the code that needs them.
"""

from __future__ import annotations

import copy
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from .core.offload import check_offload, offloaded_layers
from .core.options import CONFIG_KEYS, RunOptions
from .core.tiles import check_memory_budget, check_tiles
from .deepspeed_block import DeepSpeedSettings
from .run_blocks import DataConfig, EvalConfig, TrainerModelConfig, TrainingConfig
from .schema import at_least, block_values, check_top_level_keys, from_block, resolve_paths

__all__ = [
    "ENGINES",
    "OUR_BLOCKS",
    "OUR_KEYS",
    "HFDtype",
    "HFModelConfig",
    "ModelConfig",
    "RunConfig",
    "SequenceParallelConfig",
    "check_memory_options",
    "model_config",
    "read_config",
]

OUR_BLOCKS = ("sequence_parallel", "model", "data", "eval", "training")
# "engine": which engine train.py runs the config under (a string, not a block)
ENGINES = ("deepspeed", "fsdp2")
OUR_KEYS = (*OUR_BLOCKS, "engine")

HFDtype = Literal["float32", "bfloat16", "float64"]


# ---------------------------------------------------------------- the file


def read_config(config: str | Path | dict) -> dict:
    """A DeepSpeed JSON config (path or dict), deep-copied and checked for unknown top-level
    keys; a JSON syntax error names the file, line and column. From a file, relative paths
    in our blocks resolve against the file's folder (:func:`resolve_paths`)."""
    if isinstance(config, dict):
        config = copy.deepcopy(config)
        check_top_level_keys(config, OUR_KEYS, "the config")
        return config
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"DeepSpeed config not found: {path}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: a DeepSpeed config is a JSON object, got {type(config).__name__}"
        )
    check_top_level_keys(config, OUR_KEYS, str(path))
    return resolve_paths(config, path.parent)


# ---------------------------------------------------------------- sequence_parallel


@dataclass
class SequenceParallelConfig:
    """The ``"sequence_parallel"`` block: the degrees, the collective timeout and the run's
    options, whose keys and types are :class:`~ulysses_cp.core.options.RunOptions`' fields
    (``CONFIG_KEYS``: ``attention_backend`` for ``backend``; ``grad_scale`` follows the
    ZeRO stage, see ``ulysses_cp.training.engine.run_options``)."""

    ulysses_degree: int = 1
    """Ranks in each Ulysses (all-to-all) group. It must divide the query heads, and divide
    the KV heads or be a multiple of them. Keep it within a node. 1: no Ulysses."""
    ring_degree: int = 1
    """Ranks in each ring group, which pass KV blocks around. It takes any head count and
    overlaps its transfers with compute. Use it across nodes or past the head limit."""
    collective_timeout_s: float = 1800.0
    """Seconds any collective may wait. A dead or hung peer then ends the run with a message
    naming the op and the group. Raise it only if a healthy collective can wait longer."""
    options: RunOptions = field(default_factory=RunOptions)
    """Not a key: the block's other keys, parsed as
    :class:`~ulysses_cp.core.options.RunOptions`."""

    @classmethod
    def from_dict(cls, cfg: dict | None) -> SequenceParallelConfig:
        own, options = typing.get_type_hints(cls), typing.get_type_hints(RunOptions)
        del own["options"]
        keys = own | {key: options[name] for key, name in CONFIG_KEYS.items()}
        block = block_values(cfg, keys, "sequence_parallel")
        try:
            chosen = RunOptions(**{CONFIG_KEYS[k]: v for k, v in block.items() if k in CONFIG_KEYS})
        except ValueError as exc:  # a value of the right type out of its range
            raise ValueError(f"sequence_parallel.{exc}") from None
        value = cls(**{k: v for k, v in block.items() if k in own}, options=chosen)
        value.check()
        return value

    def check(self) -> None:
        for n in ("ulysses_degree", "ring_degree"):
            if getattr(self, n) < 1:
                raise ValueError(
                    f"sequence_parallel.{n} must be a positive integer, got {getattr(self, n)!r}"
                )
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"sequence_parallel.collective_timeout_s must be a positive number of "
                f"seconds, got {self.collective_timeout_s!r}"
            )


# ---------------------------------------------------------------- model


def check_memory_options(block: ModelConfig | HFModelConfig) -> None:
    """The ALST switches shared by the reference decoder and Hugging Face models."""
    for n in ("tiled_mlp", "tiled_loss"):
        check_tiles(getattr(block, n), f"model.{n}")
    check_memory_budget(block.memory_budget_gb)
    check_offload(block.offload_activations, block.activation_checkpointing)


@dataclass
class ModelConfig:
    """The ``"model"`` block for the reference decoder (``ulysses_cp.models.decoder.Decoder``):
    a Llama-style decoder with RMSNorm, RoPE, SwiGLU and grouped-query attention."""

    vocab_size: int = 256
    """Token ids the model embeds and predicts. 256 fits tasks `"kv_recall"` and `"text"`;
    task `"dataset"` needs the tokenizer's vocabulary or more."""
    dim: int = 128
    """The hidden size. It must split into `n_heads` heads of even size."""
    n_layers: int = 2
    """Decoder layers."""
    n_heads: int = 4
    """Query heads. `ulysses_degree` must divide them."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention). `n_heads` must be a multiple of them."""
    ffn_dim: int = 256
    """The SwiGLU MLP's inner width."""
    rope_theta: float = 10000.0
    """The RoPE base frequency."""
    norm_eps: float = 1e-5
    """The RMSNorm epsilon."""
    activation_checkpointing: bool = False
    """Recompute each layer in the backward, its all-to-alls and ring passes too. It keeps
    one hidden state per layer instead of all its activations. Turn it on for long
    sequences."""
    offload_activations: bool | int = False
    """Keep the checkpointed layer inputs on the CPU until the backward. It needs
    `activation_checkpointing`. `true`: every layer. `false` or 0: none. An integer `n`:
    the first `n` layers. Use a count when the host cannot hold every layer's input."""
    tiled_mlp: int | Literal["auto"] = 0
    """Run each MLP on this many pieces of the local sequence, under checkpointing. Its
    `(s, ffn)` intermediates then exist for one piece at a time. 0 or 1: untiled.
    `"auto"`: at most 128 MiB of intermediate a tile (less under `memory_budget_gb`)."""
    tiled_loss: int | Literal["auto"] = 0
    """Run the LM head and the loss on this many pieces; no full fp32 logits exist. 0 or 1:
    untiled. `"auto"`: at most 1 GiB of logits a tile (less under `memory_budget_gb`)."""
    memory_budget_gb: float | None = None
    """GiB per rank that sizes the `"auto"` tiles: a loss tile holds at most 1/16 of it,
    an MLP tile 1/32. `null`: the GPU's free memory at start, less max(2 GiB, 10%); on a
    CPU, the fixed caps alone."""
    fused_loss: bool = False
    """Compute the LM head's and the loss's gradients in the forward, tile by tile. Nothing
    of the head is recomputed. It holds the head's fp32 weight gradient whole through the
    backward, so it is off by default."""
    compile: bool = False
    """`torch.compile` each decoder layer (`ulysses_cp/models/compiled.py`). The first
    steps are slower while it compiles."""

    @classmethod
    def from_dict(cls, cfg: dict | None) -> ModelConfig:
        return from_block(cls, cfg, "model")

    def check(self) -> None:
        check_memory_options(self)
        at_least("model", self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"), 1)
        offloaded_layers(self.offload_activations, self.n_layers)
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(
                f"model: dim ({self.dim}) must split into n_heads ({self.n_heads}) "
                f"heads of even size and n_heads must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class HFModelConfig:
    """The ``"model"`` block for a Hugging Face model (``hf_config`` present)."""

    hf_config: str | dict = ""
    """The model's transformers config: a local `config.json` or its folder, relative to
    the config file's. Or the fields inline, with `model_type`. Its presence makes the
    block a Hugging Face one."""
    hf_weights: str | None = None
    """A local folder of weights (`from_pretrained`). `null`: a random init from
    `training.seed`. Nothing is downloaded."""
    dtype: HFDtype = "float32"
    """The dtype the model is built in: `"float32"`, `"bfloat16"` or `"float64"`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward. Turn it on for long sequences."""
    offload_activations: bool | int = False
    """Keep the checkpointed layer inputs on the CPU until the backward; as in the reference
    decoder's block. `true`: every layer. An integer `n`: the first `n` layers."""
    tiled_mlp: int | Literal["auto"] = 0
    """Run each MLP on this many pieces of the local sequence. 0 or 1: untiled. `"auto"`:
    sized by bytes, as in the reference decoder's block."""
    tiled_loss: int | Literal["auto"] = 0
    """Run the LM head and the loss on this many pieces; no full logits exist. 0 or 1:
    untiled. `"auto"`: sized by bytes."""
    memory_budget_gb: float | None = None
    """GiB per rank that sizes the `"auto"` tiles. `null`: the GPU's free memory at start,
    or the fixed caps on a CPU."""
    fused_loss: bool = False
    """Compute the LM head's and the loss's gradients in the forward. The head must be one
    `nn.Linear`. Off by default: it holds the head's fp32 weight gradient whole."""
    lean_norms: bool = True
    """RMSNorms keep only their input for the backward and recompute the rest
    (`ulysses_cp/models/lean_norm.py`). The output is the family's own to the bit. Set
    `false` to run the family's own norm code."""
    compile: bool = False
    """`torch.compile` each decoder layer (`ulysses_cp/models/compiled.py`)."""

    @classmethod
    def from_dict(cls, block: dict | None) -> HFModelConfig:
        return from_block(cls, block, "model")

    def check(self) -> None:
        if not self.hf_config:
            raise ValueError("model.hf_config must name a local config.json or hold fields")
        check_memory_options(self)


def model_config(block: dict | None) -> ModelConfig | HFModelConfig:
    """The ``"model"`` block: a Hugging Face model when it names ``hf_config``."""
    if block and "hf_config" in block:
        return HFModelConfig.from_dict(block)
    return ModelConfig.from_dict(block)


# ---------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class RunConfig:
    """A config file read once: our blocks and the DeepSpeed settings we read parsed, and
    the whole dict (``raw``: paths resolved, unknown top-level keys refused), which only
    the DeepSpeed hand-off (``training.engine.deepspeed_part``) and the tracker's copy of
    the file read."""

    raw: dict
    sequence_parallel: SequenceParallelConfig
    model: ModelConfig | HFModelConfig
    data: DataConfig
    training: TrainingConfig
    eval: EvalConfig = field(default_factory=EvalConfig)
    path: Path | None = None
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    trainer_model: TrainerModelConfig | None = None
    engine: str = "deepspeed"
    """The top-level ``"engine"`` key: ``"deepspeed"`` (the default) or ``"fsdp2"``
    (PyTorch's ``fully_shard`` under ``torchrun``; see docs/fsdp2/index.md)."""

    @classmethod
    def load(cls, config: RunConfig | str | Path | dict, *, trainer: bool = False) -> RunConfig:
        """Read and parse a config file (path) or dict; a ``RunConfig`` is returned as is.
        From a file, an error in a block names the file and the line of the key.
        ``trainer``: the DeepSpeed JSON of a Hugging Face Trainer run, whose ``"model"``
        block is :class:`~ulysses_cp.run_blocks.TrainerModelConfig` (``trainer_model``)."""
        if isinstance(config, RunConfig):
            return config
        raw = read_config(config)

        def parse(name: str, parser: Callable, *args):
            try:
                return parser(*args)
            except ValueError as exc:
                if isinstance(config, dict):
                    raise
                line = _line_of(Path(config).read_text(), name, str(exc))
                raise ValueError(f"{config}:{line}: {exc}") from None

        if trainer:
            for name in ("sequence_parallel", "model"):
                if raw.get(name) is not None and not isinstance(raw[name], dict):
                    got = raw[name]
                    raise ValueError(
                        f"the DeepSpeed config's {name} must be an object, got {got!r}"
                    )
        data = parse("data", DataConfig.from_dict, raw.get("data"))
        ev = parse("eval", EvalConfig.from_dict, raw.get("eval"))
        if ev.enabled and data.task != "dataset":
            msg = (
                f'the "eval" block evaluates held-out tokenized data: it needs data.task '
                f'"dataset", got {data.task!r} (set eval.interval to 0 or drop the block)'
            )
            parse("eval", _raise, msg)
        block = raw.get("model")
        return cls(
            raw=raw,
            sequence_parallel=parse(
                "sequence_parallel", SequenceParallelConfig.from_dict, raw.get("sequence_parallel")
            ),
            model=ModelConfig() if trainer else parse("model", model_config, block),
            trainer_model=parse("model", TrainerModelConfig.from_dict, block) if trainer else None,
            data=data,
            training=parse("training", TrainingConfig.from_dict, raw.get("training")),
            eval=ev,
            path=None if isinstance(config, dict) else Path(config),
            deepspeed=parse("zero_optimization", DeepSpeedSettings.from_dict, raw),
            engine=parse("engine", _engine, raw.get("engine", "deepspeed")),
        )

    @property
    def deepspeed_keys(self) -> tuple[str, ...]:
        """The file's top-level keys that are DeepSpeed's, as written: ours and the ``_``
        comments left out (what ``"engine": "fsdp2"`` and the Trainer under FSDP2 refuse)."""
        return tuple(k for k in self.deepspeed.written if "." not in k and k not in OUR_KEYS)

    def block(self, name: str) -> dict | None:
        """A copy of one of our blocks as written (None when absent), for a log of the run."""
        if name not in OUR_BLOCKS:
            raise ValueError(f"{name!r} is not one of our blocks {OUR_BLOCKS}")
        return copy.deepcopy(self.raw.get(name))

    def without_optimizer(self) -> RunConfig:
        """This config with no DeepSpeed ``optimizer`` block (the caller builds the optimizer
        and hands it to DeepSpeed, which then must accept it)."""
        raw = {k: v for k, v in self.raw.items() if k != "optimizer"}
        raw["zero_allow_untested_optimizer"] = True
        return replace(self, raw=raw, deepspeed=replace(self.deepspeed, optimizer=None))


def _engine(value: object) -> str:
    if value not in ENGINES:
        raise ValueError(f'"engine" must be one of {list(ENGINES)}, got {value!r}')
    return str(value)


def _raise(message: str) -> None:
    raise ValueError(message)


def _line_of(text: str, block: str, message: str) -> int:
    """The line of the file ``text`` an error about ``block`` points at: the first key the
    message names (quoted, or as ``block.key``) found after the block's own key, else the
    block's key, else line 1."""
    start = re.search(rf'"{re.escape(block)}"\s*:', text)
    if start is None:
        return 1
    names = [n for pair in re.findall(r"'(\w+)'|\w+\.(\w+)", message) for n in pair if n]
    for name in names:
        hit = re.compile(rf'"{re.escape(name)}"\s*:').search(text, start.start())
        if hit is not None:
            return text.count("\n", 0, hit.start()) + 1
    return text.count("\n", 0, start.start()) + 1
