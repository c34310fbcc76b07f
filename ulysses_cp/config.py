"""A run's config: the file read and checked once, every block of ours as a dataclass.

A config file is a DeepSpeed JSON plus our blocks: ``"sequence_parallel"``, ``"model"``
(the reference decoder, or a Hugging Face model when it has ``hf_config``), ``"data"``,
``"eval"`` and ``"training"``. :meth:`RunConfig.load` reads the file (:func:`read_config`:
JSON syntax errors with the line, unknown top-level keys, relative paths resolved against
the file's folder) and parses every block (``ulysses_cp.schema.from_block``: unknown keys
and values of the wrong type refused naming the key; each block's ``check()`` adds the
rules between fields). Everything after takes the parsed :class:`RunConfig`; the DeepSpeed
part is handed on unchanged (``ulysses_cp.training.engine.deepspeed_part``). A leaf of the
import graph but for ``core.options`` and ``schema``: the head and vocabulary counts of a
Hugging Face config are asked from ``ulysses_cp.models.hf`` by the code that needs them.
"""

from __future__ import annotations

import copy
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .core.offload import check_offload, offloaded_layers
from .core.options import CONFIG_KEYS, RunOptions
from .core.tiles import check_memory_budget, check_tiles
from .schema import at_least, block_values, check_top_level_keys, from_block, resolve_paths

__all__ = [
    "OUR_BLOCKS",
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
    "model_config",
    "read_config",
]

OUR_BLOCKS = ("sequence_parallel", "model", "data", "eval", "training")

Task = Literal["kv_recall", "text", "dataset"]
HFDtype = Literal["float32", "bfloat16", "float64"]
OnNonfinite = Literal["skip", "stop"]


# ---------------------------------------------------------------- the file


def read_config(config: str | Path | dict) -> dict:
    """A DeepSpeed JSON config (path or dict), deep-copied and checked for unknown top-level
    keys; a JSON syntax error names the file, line and column. From a file, relative paths
    in our blocks resolve against the file's folder (:func:`resolve_paths`)."""
    if isinstance(config, dict):
        config = copy.deepcopy(config)
        check_top_level_keys(config, OUR_BLOCKS, "the config")
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
    check_top_level_keys(config, OUR_BLOCKS, str(path))
    return resolve_paths(config, path.parent)


# ---------------------------------------------------------------- sequence_parallel


@dataclass
class SequenceParallelConfig:
    """The ``"sequence_parallel"`` block: the degrees, the collective timeout and the run's
    options, whose keys and types are :class:`~ulysses_cp.core.options.RunOptions`' fields
    (``CONFIG_KEYS``: ``attention_backend`` for ``backend``; ``grad_scale`` follows the
    ZeRO stage, see ``ulysses_cp.training.engine.run_options``)."""

    ulysses_degree: int = 1
    ring_degree: int = 1
    collective_timeout_s: float = 1800.0  # a dead or hung peer ends the run after this
    options: RunOptions = field(default_factory=RunOptions)  # the block's other keys

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
    """The reference decoder (``ulysses_cp.models.decoder.Decoder``)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = False
    # checkpointed layer inputs wait on CPU (needs the above): true (every layer), false,
    # or how many of the first layers do (the rest keep theirs on the device)
    offload_activations: bool | int = False
    # > 1: the MLP in this many sequence pieces (models/memory.py); "auto": sized by bytes
    # (core/tiles.py)
    tiled_mlp: int | Literal["auto"] = 0
    tiled_loss: int | Literal["auto"] = 0  # LM head + loss in pieces, no full logits
    memory_budget_gb: float | None = None  # per rank: sizes "auto" tiles (core/tiles.py)
    fused_loss: bool = False  # LM head + loss gradients computed in the forward
    compile: bool = False  # torch.compile each decoder layer (models/compiled.py)

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

    hf_config: str | dict = ""  # local config.json / folder, or inline fields + model_type
    hf_weights: str | None = None  # local folder for from_pretrained; None: random init
    dtype: HFDtype = "float32"
    activation_checkpointing: bool = False
    offload_activations: bool | int = False  # as in ModelConfig
    tiled_mlp: int | Literal["auto"] = 0
    tiled_loss: int | Literal["auto"] = 0
    memory_budget_gb: float | None = None  # as in ModelConfig
    fused_loss: bool = False
    lean_norms: bool = True  # RMSNorms keep only their input for backward (models/lean_norm.py)
    compile: bool = False  # torch.compile each decoder layer (models/compiled.py)

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
    pack_multiple: int = 16  # documents padded to this (packing "document": a multiple of
    # ucp.sequence_multiple; packing "row": 1, no padding per document)
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
        at_least("data", self, ("seq_len",), 1)
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
        at_least("eval", self, ("interval",), 0)
        at_least("eval", self, ("batches",), 1)
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
    def load(cls, config: RunConfig | str | Path | dict) -> RunConfig:
        """Read and parse a config file (path) or dict; a ``RunConfig`` is returned as is."""
        if isinstance(config, RunConfig):
            return config
        raw = read_config(config)
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
