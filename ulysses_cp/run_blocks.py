"""The ``"data"``, ``"eval"`` and ``"training"`` blocks of a run's config, as dataclasses.

Each field is one key of its block, and its docstring is the key's entry in the generated
config reference. ``ulysses_cp.config.RunConfig`` parses these blocks with the others
(``ulysses_cp.schema.from_block``: unknown keys and wrong types refused); each block's
``check()`` adds the rules between its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .core.offload import check_offload
from .core.tiles import check_memory_budget, check_tiles
from .schema import at_least, from_block

__all__ = [
    "NOT_UNDER_TRAINER",
    "DataConfig",
    "EvalConfig",
    "OnNonfinite",
    "Task",
    "TrainerModelConfig",
    "TrainingConfig",
]

Task = Literal["kv_recall", "text", "dataset"]
OnNonfinite = Literal["skip", "stop"]


# ---------------------------------------------------------------- data


@dataclass
class DataConfig:
    """The ``"data"`` block: what the run trains on, and how rows are built."""

    task: Task = "kv_recall"
    """The samples. `"kv_recall"` is the built-in synthetic task: no files, vocabulary 256.
    `"text"` reads `files` as bytes (vocabulary 256). `"dataset"` tokenizes `files` with
    `tokenizer`: your own corpus."""
    seq_len: int = 512
    """Tokens per row, before sequence parallelism splits it. It must be a multiple of
    `2 * sp` under the zigzag layout, or of `sp` under the contiguous one."""
    seed: int = 1234
    """Seeds the samples: the kv_recall draws and the order rows are read in."""
    files: list[str] = field(default_factory=list)
    """Input files, relative to the config's folder. Task `"text"`: `.txt` (whole file) and
    `.jsonl` (a `"text"` field per line). Task `"dataset"`: `.jsonl`, `.json`, `.parquet`,
    `.arrow`, or a folder written by `save_to_disk`."""
    n_pairs: int = 4
    """kv_recall: key/value bindings at the start of each sequence. At most `n_keys`."""
    n_queries: int = 48
    """kv_recall: queries at the end of each sequence; only their answers carry targets."""
    n_keys: int = 4
    """kv_recall: distinct keys."""
    n_values: int = 8
    """kv_recall: distinct values. The loss starts near `ln(n_values)`, 2.08 for 8."""
    packing: bool = False
    """Fill each row with several documents, attention kept inside each. Turn it on for
    corpora of short documents; `"sequence_parallel"`'s `packing` picks how rows split."""
    min_doc_len: int = 32
    """Packed kv_recall: the shortest document, in tokens. At least `n_pairs + 3`."""
    max_doc_len: int = 128
    """Packed kv_recall: the longest document, in tokens. At most `seq_len`."""
    pack_multiple: int = 16
    """Packed rows: each document is padded at its end to a multiple of this. Under
    `"sequence_parallel"` `packing: "document"` it must be a multiple of `2 * sp`
    (zigzag) or `sp`. Under `packing: "row"`, set 1: no padding."""
    tokenizer: str = ""
    """Task `"dataset"`: a local tokenizer folder (`save_pretrained`) or a
    `tokenizer.json`. A folder brings its chat template and EOS token."""
    text_field: str = "text"
    """Task `"dataset"`: each record's field with the text. A list of chat messages there is
    rendered with the tokenizer's chat template."""
    eos_token: str = ""
    """Task `"dataset"`: the token that ends each document. Empty: the tokenizer's own EOS.
    Set it for a bare `tokenizer.json`, which names none."""
    cache_dir: str = ""
    """Task `"dataset"`: where the token cache is built. Empty: `~/.cache/ulysses_cp/tokens`.
    On several nodes, use a folder every rank sees."""
    tokenize_workers: int = 0
    """Task `"dataset"`: processes that tokenize on the first run. 0: one for inputs under
    64 MB, else one per core, at most 16."""

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
    """The ``"eval"`` block: held-out loss during training (``training/evaluate.py``).
    Task ``"dataset"`` only."""

    files: list[str] = field(default_factory=list)
    """Held-out files, tokenized like `data.files` into a cache of their own. Give these or
    `fraction`, not both."""
    fraction: float = 0.0
    """The held-out share of `data.files`' documents, taken from the end (0.05: the last
    5%). Training reads the others. 0: none."""
    interval: int = 0
    """Evaluate every this many steps, and after the last. 0 (the default) turns evaluation
    off."""
    batches: int = 1
    """Micro batches per evaluation, on each data-parallel replica. Each costs one forward
    and no backward."""

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
    """The ``"training"`` block: the run's length, logging, checkpoints and failure rules."""

    max_steps: int = 100
    """The run's length in optimizer steps. `--max_steps` overrides it."""
    log_interval: int = 10
    """Steps between log lines and `metrics.jsonl` rows. At least 1."""
    save_interval: int = 0
    """Steps between checkpoints. 0: save at the end only."""
    seed: int = 0
    """The run's seed. A random init of the model draws from it."""
    on_nonfinite: OnNonfinite = "skip"
    """What a non-finite loss or gradient does. `"skip"` drops that update and goes on.
    `"stop"` saves the state from before the step and exits with code 3."""
    check_gradients: bool = True
    """Look for non-finite reduced gradients before every update. It reads each gradient
    once and adds one tiny all-reduce; turn it off only when that shows in the step time."""
    save_on_signal: bool = True
    """On SIGTERM or SIGINT, save at the end of the step and exit 0. Keep it on under a
    scheduler that preempts jobs."""
    portable_checkpoint: bool = True
    """Also write `portable.pt`: full fp32 parameters and optimizer state on rank 0's CPU.
    It lets a run resume on another number of ranks or ZeRO stage. Turn it off when those
    copies do not fit rank 0's CPU memory."""

    @classmethod
    def from_dict(cls, cfg: dict | None) -> TrainingConfig:
        return from_block(cls, cfg, "training")

    def check(self) -> None:
        for n in ("max_steps", "log_interval", "save_interval", "seed"):
            if getattr(self, n) < 0:
                raise ValueError(f"training.{n} must be an integer >= 0, got {getattr(self, n)!r}")
        if self.log_interval < 1:
            raise ValueError(f"training.log_interval must be >= 1, got {self.log_interval}")


# ---------------------------------------------------------------- the Trainer's model


# train.py's model keys about building the model or its loss: the Trainer trains the model
# it is handed, through that model's forward and logits (its log-prob head tiles "auto")
NOT_UNDER_TRAINER = ("hf_config", "hf_weights", "dtype", "compile", "tiled_loss", "fused_loss")


@dataclass(frozen=True)
class TrainerModelConfig:
    """The ``"model"`` block of a Hugging Face Trainer run's DeepSpeed JSON. The Trainer
    trains the model it is given, so only the memory features of train.py's block apply
    (``models.recipe.adopt``); the keys that build the model or its loss are refused."""

    lean_norms: bool = True
    """RMSNorms keep only their input for the backward and recompute the rest, as in
    train.py's Hugging Face block."""
    memory_budget_gb: float | None = None
    """GiB per rank that sizes `"auto"` tiles (the tiled MLP, the fused log-prob head).
    `null`: the GPU's free memory at start less a margin; on a CPU, the fixed caps."""
    tiled_mlp: int | Literal["auto"] = 0
    """Run each MLP in this many pieces of the sequence (`"auto"`: sized by bytes); 0 or 1:
    whole. The parameters keep their names, so the saved model loads as the plain one."""
    activation_checkpointing: bool = False
    """Checkpoint every decoder layer. Not beside `TrainingArguments(gradient_checkpointing=
    True)`, which checkpoints them already."""
    offload_activations: bool | int = False
    """With activation_checkpointing: keep the checkpointed layer inputs on the CPU, for
    every layer (`true`) or the first this many."""

    @classmethod
    def from_dict(cls, block: dict | None) -> TrainerModelConfig:
        if block is not None and not isinstance(block, dict):
            raise ValueError(f"the DeepSpeed config's model must be an object, got {block!r}")
        taken = list(cls.__dataclass_fields__)
        other = sorted(k for k in block or {} if k in NOT_UNDER_TRAINER)
        if other:
            raise ValueError(
                f"under SequenceParallelTrainer the DeepSpeed config's model block takes only "
                f"{', '.join(taken)}; it also has {other}, which train.py reads but the Trainer "
                f"does not (it trains the model it is given, through its own forward and "
                f"logits): remove them"
            )
        return from_block(cls, block, "model")

    def check(self) -> None:
        check_tiles(self.tiled_mlp, "model.tiled_mlp")
        check_memory_budget(self.memory_budget_gb)
        check_offload(self.offload_activations, self.activation_checkpointing)
