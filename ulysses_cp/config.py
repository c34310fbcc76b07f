"""Every block of a run's config, declared in one place and parsed once.

A config file is a DeepSpeed JSON plus our blocks: ``"sequence_parallel"``, ``"model"``
(the reference decoder, or a Hugging Face model when it has ``hf_config``), ``"data"``,
``"eval"`` and ``"training"``. :func:`from_block` turns a block into its dataclass: unknown keys are
refused with the valid ones, and every value's type is checked against the field's
annotation (``int``, ``float``, ``bool``, ``str``, ``Literal`` choices, lists, ``X | None``)
with a message naming the key. Each block's ``check()`` adds the rules between fields.
:meth:`RunConfig.load` reads the file once and parses every block; the DeepSpeed part is
handed on unchanged (``ucp.engine.deepspeed_part``).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, TypeVar, get_args, get_origin

from .core.options import KVExchange
from .core.sharding import Layout
from .kernels.dispatch import Backend

__all__ = [
    "DataConfig",
    "EvalConfig",
    "HFDtype",
    "HFModelConfig",
    "ModelConfig",
    "OnNonfinite",
    "RunConfig",
    "SequenceParallelConfig",
    "Task",
    "TrainingConfig",
    "check_memory_options",
    "from_block",
    "model_config",
]

T = TypeVar("T")

Task = Literal["kv_recall", "text", "dataset"]
HFDtype = Literal["float32", "bfloat16", "float64"]
OnNonfinite = Literal["skip", "stop"]


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
    if block is not None and not isinstance(block, dict):
        raise ValueError(f'the "{name}" block must be a JSON object, got {block!r}')
    block = dict(block or {})
    known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(block) - set(known))
    if unknown:
        raise ValueError(f'unknown keys in the "{name}" block: {unknown}; valid keys: {known}')
    hints = typing.get_type_hints(cls)
    for key, value in block.items():
        if not _fits(value, hints[key]):
            raise ValueError(f"{name}.{key} must be {_describe(hints[key])}, got {value!r}")
    value = cls(**block)
    check = getattr(value, "check", None)
    if check is not None:
        check()
    return value


def _at_least(block: str, obj, names: tuple[str, ...], low: int) -> None:
    for n in names:
        if getattr(obj, n) < low:
            raise ValueError(f"{block}.{n} must be >= {low}, got {getattr(obj, n)!r}")


# ---------------------------------------------------------------- sequence_parallel


@dataclass
class SequenceParallelConfig:
    ulysses_degree: int = 1
    ring_degree: int = 1
    layout: Layout = "zigzag"
    attention_backend: Backend = "auto"
    check_inputs: bool = True  # compare input shapes across SP ranks before communicating
    kv_exchange: KVExchange = "ring"  # KV inside a ring group: p2p ring steps or all-gather
    head_chunks: int = 0  # Ulysses all-to-all in this many head chunks; 0: the documented rule
    collective_timeout_s: float = 1800.0  # a dead or hung peer ends the run after this

    @classmethod
    def from_dict(cls, cfg: dict | None) -> SequenceParallelConfig:
        return from_block(cls, cfg, "sequence_parallel")

    def check(self) -> None:
        for n in ("ulysses_degree", "ring_degree"):
            if getattr(self, n) < 1:
                raise ValueError(
                    f"sequence_parallel.{n} must be a positive integer, got {getattr(self, n)!r}"
                )
        if self.head_chunks < 0:
            raise ValueError(
                f"sequence_parallel.head_chunks must be an integer >= 0 (0: automatic), got "
                f"{self.head_chunks!r}"
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
        if getattr(block, n) < 0:
            raise ValueError(
                f"model.{n} must be a number of pieces >= 0, got {getattr(block, n)!r}"
            )
    if block.offload_activations and not block.activation_checkpointing:
        raise ValueError(
            "model.offload_activations moves the checkpointed layer inputs to CPU: it needs "
            "model.activation_checkpointing: true"
        )


@dataclass
class ModelConfig:
    """The reference decoder (``ulysses_cp.model.Decoder``)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = False
    offload_activations: bool = False  # checkpointed layer inputs wait on CPU (needs the above)
    tiled_mlp: int = 0  # > 1: the MLP runs in this many sequence pieces (ulysses_cp.memory)
    tiled_loss: int = 0  # > 1: LM head + loss in this many pieces, no full logits

    @classmethod
    def from_dict(cls, cfg: dict | None) -> ModelConfig:
        return from_block(cls, cfg, "model")

    def check(self) -> None:
        check_memory_options(self)
        _at_least("model", self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"), 1)
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

    hf_config: str | dict = ""  # local config.json / folder, or inline fields + model_type
    hf_weights: str | None = None  # local folder for from_pretrained; None: random init
    dtype: HFDtype = "float32"
    activation_checkpointing: bool = False
    offload_activations: bool = False
    tiled_mlp: int = 0
    tiled_loss: int = 0

    @classmethod
    def from_dict(cls, block: dict | None) -> HFModelConfig:
        return from_block(cls, block, "model")

    def check(self) -> None:
        if not self.hf_config:
            raise ValueError("model.hf_config must name a local config.json or hold fields")
        check_memory_options(self)

    def vocab_size(self) -> int:
        from .models.hf import load_config

        return load_config(self.hf_config).vocab_size

    def heads(self) -> tuple[int, int]:
        """(query heads, kv heads) from the transformers config, for validation."""
        from .models.hf import load_config

        cfg = load_config(self.hf_config)
        hq = cfg.num_attention_heads
        return hq, getattr(cfg, "num_key_value_heads", None) or hq


def model_config(block: dict | None) -> ModelConfig | HFModelConfig:
    """The ``"model"`` block: a Hugging Face model when it names ``hf_config``."""
    if block and "hf_config" in block:
        return HFModelConfig.from_dict(block)
    return ModelConfig.from_dict(block)


# ---------------------------------------------------------------- data


@dataclass
class DataConfig:
    task: Task = "kv_recall"
    seq_len: int = 512
    seed: int = 1234
    files: list[str] = field(default_factory=list)  # text task
    n_pairs: int = 4  # kv_recall: bindings at the start
    n_queries: int = 48  # kv_recall: queries at the end
    n_keys: int = 4
    n_values: int = 8
    packing: bool = False  # several documents per row, attention kept inside each
    min_doc_len: int = 32  # packed kv_recall document lengths
    max_doc_len: int = 128
    pack_multiple: int = 16  # documents padded to this (a multiple of 2 * SP degree)
    # task "dataset": tokenized files (training/corpus.py)
    tokenizer: str = ""  # a local tokenizer folder or tokenizer.json
    text_field: str = "text"  # a string, or a list of chat messages (the chat template)
    eos_token: str = ""  # "": the tokenizer's own EOS token
    cache_dir: str = ""  # "": ~/.cache/ulysses_cp/tokens
    tokenize_workers: int = 0  # tokenizing processes; 0: 1 under 64 MB of input, else 1/core

    @classmethod
    def from_dict(cls, cfg: dict | None) -> DataConfig:
        return from_block(cls, cfg, "data")

    def check(self) -> None:
        _at_least("data", self, ("seq_len",), 1)
        if self.task == "text" and not self.files:
            raise ValueError("data.task 'text' needs data.files: a list of .txt/.jsonl paths")
        if self.task == "dataset":
            if not self.files:
                raise ValueError(
                    "data.task 'dataset' needs data.files: .jsonl/.json/.parquet/.arrow files "
                    "or a folder written by datasets' save_to_disk"
                )
            if not self.tokenizer:
                raise ValueError(
                    "data.task 'dataset' needs data.tokenizer: a local tokenizer folder "
                    "(tokenizer.json + tokenizer_config.json) or a tokenizer.json file"
                )
            if not self.text_field:
                raise ValueError("data.text_field must name the records' text (or messages) field")
        if self.tokenize_workers < 0:
            raise ValueError(
                f"data.tokenize_workers must be >= 0 (0: one per CPU core), got "
                f"{self.tokenize_workers}"
            )
        if self.packing:
            if self.pack_multiple < 1 or self.seq_len % self.pack_multiple:
                raise ValueError(
                    f"data.seq_len {self.seq_len} must be a multiple of data.pack_multiple "
                    f"{self.pack_multiple} (>= 1) when packing"
                )
            if self.task == "kv_recall" and not (
                self.n_pairs + 3 <= self.min_doc_len <= self.max_doc_len <= self.seq_len
            ):
                raise ValueError(
                    f"packed kv_recall needs n_pairs + 3 <= min_doc_len <= max_doc_len <= "
                    f"seq_len, got {self.n_pairs + 3}, {self.min_doc_len}, "
                    f"{self.max_doc_len}, {self.seq_len}"
                )
        if self.task == "kv_recall":
            need = 1 + self.n_pairs + 2 * self.n_queries
            if self.seq_len < need and not self.packing:
                raise ValueError(
                    f"kv_recall needs seq_len >= 1 + 2*n_pairs + 2*n_queries = "
                    f"{need}, got {self.seq_len}"
                )
            n_k, n_v = self.n_keys, self.n_values
            if self.n_pairs > n_k or 18 + n_k * (n_v + 1) + n_v > 256:
                raise ValueError(
                    f"kv_recall needs n_pairs <= n_keys and 18 + n_keys + n_values "
                    f"+ n_keys*n_values <= 256, got n_pairs {self.n_pairs}, n_keys "
                    f"{n_k}, n_values {n_v}"
                )


# ---------------------------------------------------------------- eval


@dataclass
class EvalConfig:
    """Held-out loss during training (``training/evaluate.py``); task ``"dataset"`` only."""

    files: list[str] = field(default_factory=list)  # held-out files, tokenized like data.files
    fraction: float = 0.0  # or: this fraction of data.files' documents (the last ones)
    interval: int = 0  # evaluate every this many steps (and after the last); 0: never
    batches: int = 1  # micro batches per evaluation, per data-parallel replica

    @classmethod
    def from_dict(cls, cfg: dict | None) -> EvalConfig:
        return from_block(cls, cfg, "eval")

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def check(self) -> None:
        _at_least("eval", self, ("interval",), 0)
        _at_least("eval", self, ("batches",), 1)
        if self.files and self.fraction:
            raise ValueError(
                f"eval: give eval.files (held-out files) or eval.fraction (a share of "
                f"data.files), not both; got {len(self.files)} file(s) and fraction "
                f"{self.fraction}"
            )
        if self.fraction and not 0 < self.fraction < 1:
            raise ValueError(
                f"eval.fraction must be between 0 and 1 (exclusive), got {self.fraction}"
            )
        if self.enabled and not (self.files or self.fraction):
            raise ValueError(
                f"eval.interval {self.interval} needs held-out data: eval.files (a list of "
                f"paths) or eval.fraction (for example 0.05 of data.files' documents)"
            )


# ---------------------------------------------------------------- training


@dataclass
class TrainingConfig:
    max_steps: int = 100
    log_interval: int = 10
    save_interval: int = 0  # 0: save at the end only
    seed: int = 0
    on_nonfinite: OnNonfinite = "skip"  # non-finite loss or gradients: skip the step or stop
    check_gradients: bool = True  # look for non-finite gradients before every update
    save_on_signal: bool = True  # SIGTERM/SIGINT: save at the end of the step, exit 0
    portable_checkpoint: bool = True  # also save portable.pt (resume on other world sizes)

    @classmethod
    def from_dict(cls, cfg: dict | None) -> TrainingConfig:
        return from_block(cls, cfg, "training")

    def check(self) -> None:
        for n in ("max_steps", "log_interval", "save_interval", "seed"):
            if getattr(self, n) < 0:
                raise ValueError(f"training.{n} must be an integer >= 0, got {getattr(self, n)!r}")
        if self.log_interval < 1:
            raise ValueError(f"training.log_interval must be >= 1, got {self.log_interval}")


# ---------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class RunConfig:
    """A config file read once: our blocks parsed, and the whole dict (``raw``: paths
    resolved, unknown top-level keys refused) for DeepSpeed and the tracker."""

    raw: dict
    sequence_parallel: SequenceParallelConfig
    model: ModelConfig | HFModelConfig
    data: DataConfig
    training: TrainingConfig
    eval: EvalConfig = field(default_factory=EvalConfig)
    path: Path | None = None

    @classmethod
    def load(cls, config: str | Path | dict) -> RunConfig:
        from .training.engine import load_config

        raw = load_config(config)
        data = DataConfig.from_dict(raw.get("data"))
        ev = EvalConfig.from_dict(raw.get("eval"))
        if ev.enabled and data.task != "dataset":
            raise ValueError(
                f'the "eval" block evaluates held-out tokenized data: it needs data.task '
                f'"dataset", got {data.task!r} (set eval.interval to 0 or drop the block)'
            )
        return cls(
            raw=raw,
            sequence_parallel=SequenceParallelConfig.from_dict(raw.get("sequence_parallel")),
            model=model_config(raw.get("model")),
            data=data,
            training=TrainingConfig.from_dict(raw.get("training")),
            eval=ev,
            path=None if isinstance(config, dict) else Path(config),
        )
