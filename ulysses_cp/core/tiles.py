"""How many sequence tiles the tiled MLP and the tiled loss run in: the one rule that the
run (reference decoder, Hugging Face models, plain and tiled loss) and the planner share.

``"model": {"tiled_mlp": n | "auto", "tiled_loss": n | "auto"}``: an integer ``n > 1``
is that many tiles, ``0`` or ``1`` is untiled, and ``"auto"`` sizes every tile to a byte
budget, as DeepSpeed's ALST does (its tiled MLP takes about ``hidden`` tokens per tile,
its tiled logits loss about 1 GiB of fp32 logits per tile):

- loss: a tile's fp32 logits (``tokens x vocab x 4`` bytes; 8 for float64 models) hold at
  most :data:`LOSS_TILE_BYTES` (1 GiB), so the loss and its two gradients of one tile
  stay near 3 GiB at any sequence length;
- MLP: a tile's ``(tokens, ffn)`` intermediate in the model's dtype holds at most
  :data:`MLP_TILE_BYTES` (128 MiB: about 4.7K tokens for Llama-3-8B in bf16, near
  ALST's ``hidden`` = 4096 tokens per tile).

With a per-rank memory budget (``"model": {"memory_budget_gb": x}``, resolved into
:class:`AutoTiles` by :func:`with_budget`), a tile holds at most a share of it, so a small
budget tiles finely and a large one coarsely (the caps above still hold):

- loss: ``budget / LOSS_SHARE`` (1/16: a tile's logits and their two gradients near 3/16);
- MLP: ``budget / MLP_SHARE`` (1/32).

``tiles = ceil(tokens / floor(cap / (width * element_bytes)))`` with ``tokens`` the
batch's tokens on this rank (``b * s_local``), so even the largest piece fits the cap.
The local length is the same on every rank (the sequence is sharded evenly), so every
rank runs the same number of tiles and ZeRO-3's parameter gathers stay in step. Short
sequences resolve to 1: untiled. On CPU a run without a budget says which tiles it
assumed; on a GPU the run's budget defaults to its free memory at start less a margin.

Resolved once. :func:`plan_tiles` is the one reader of the model block's budget: it turns
the block (train.py's, the Trainer's, the planner's) into a :class:`TilePlan`, once, when
the model is built, and the layers read that plan (the reference decoder's and the Hugging
Face MLPs, the loss, the Trainer's log-prob head), never the block's budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "LOSS_SHARE",
    "LOSS_TILE_BYTES",
    "MLP_SHARE",
    "MLP_TILE_BYTES",
    "AutoTiles",
    "TileBlock",
    "TileKind",
    "TilePlan",
    "TileSetting",
    "check_memory_budget",
    "check_tiles",
    "device_memory",
    "gpu_budget_gb",
    "is_auto",
    "plan_tiles",
    "resolve_tiles",
    "tile_bytes",
    "with_budget",
]

TileKind = Literal["loss", "mlp"]

LOSS_TILE_BYTES = 2**30  # fp32 logits of one loss tile
MLP_TILE_BYTES = 2**27  # the (tokens, ffn) intermediate of one MLP tile, model dtype
LOSS_SHARE = 16  # under a budget: one loss tile's logits hold at most budget / 16
MLP_SHARE = 32  # one MLP tile's intermediate at most budget / 32


@dataclass(frozen=True)
class AutoTiles:
    """``"auto"`` under a per-rank memory budget of ``budget_bytes``."""

    budget_bytes: int

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(
                f"model.memory_budget_gb must be > 0 (the bytes a rank may use), got "
                f"{self.budget_bytes / 2**30:g} GiB"
            )


TileSetting = int | str | AutoTiles  # a count, "auto", or "auto" under a budget


def is_auto(setting: object) -> bool:
    """``"auto"``, with or without a budget."""
    return isinstance(setting, AutoTiles) or (isinstance(setting, str) and setting == "auto")


def with_budget(setting: TileSetting, budget_gb: float | None) -> TileSetting:
    """``setting`` with the run's budget: ``"auto"`` becomes :class:`AutoTiles` when
    ``budget_gb`` (GiB per rank) is given; a count, or no budget, stays as it is."""
    if budget_gb is None or not is_auto(setting):
        return setting
    return AutoTiles(int(budget_gb * 2**30))


GPU_MARGIN_GIB = 2.0  # left free of a GPU's free memory when the budget is derived
GPU_MARGIN_SHARE = 0.1  # ... or this share of the GPU's memory, whichever is more


def check_memory_budget(budget: float | None) -> None:
    """``model.memory_budget_gb``: None or a positive number of GiB (train.py's model block
    and the Trainer subclasses' alike)."""
    if budget is not None and not budget > 0:
        raise ValueError(
            f"model.memory_budget_gb must be the GiB > 0 each rank may use (it sizes the "
            f'"auto" tiles), got {budget!r}; for example "memory_budget_gb": 16'
        )


def gpu_budget_gb(free_bytes: int, total_bytes: int) -> float:
    """The budget a run on a GPU takes without ``memory_budget_gb``: its free memory at
    start less the larger of :data:`GPU_MARGIN_GIB` and :data:`GPU_MARGIN_SHARE` of its
    memory (at least 1 GiB); the planner takes it with the whole GPU free."""
    margin = max(GPU_MARGIN_GIB * 2**30, GPU_MARGIN_SHARE * total_bytes)
    return max(free_bytes - margin, 2**30) / 2**30


def tile_bytes(kind: TileKind, budget_bytes: int | None = None) -> int:
    """The most bytes one ``kind`` tile holds: the fixed cap, or a share of the budget
    when that is smaller."""
    if kind == "loss":
        cap, share = LOSS_TILE_BYTES, LOSS_SHARE
    elif kind == "mlp":
        cap, share = MLP_TILE_BYTES, MLP_SHARE
    else:
        raise ValueError(f"tile kind must be 'loss' or 'mlp', got {kind!r}")
    return cap if budget_bytes is None else max(1, min(cap, budget_bytes // share))


def check_tiles(setting: object, name: str) -> None:
    """A ``ValueError`` naming ``name``, the value and the fix unless ``setting`` is
    ``"auto"`` (or :class:`AutoTiles`) or an integer >= 0."""
    if is_auto(setting):
        return
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return
    raise ValueError(
        f'{name} must be "auto" (tiles sized by bytes) or a number of tiles >= 0 '
        f'(0 or 1: untiled), got {setting!r}; for example {name.split(".")[-1]}: "auto"'
    )


def resolve_tiles(
    setting: TileSetting, kind: TileKind, *, tokens: int, width: int, element_bytes: int
) -> int:
    """The number of tiles (1: untiled) for ``setting`` (a count, ``"auto"`` or
    :class:`AutoTiles`) over ``tokens`` tokens (``b * s_local``). ``width``: the
    vocabulary (``kind="loss"``) or the MLP's intermediate width (``"mlp"``);
    ``element_bytes``: the model's dtype size (the loss's logits are fp32 at least)."""
    check_tiles(setting, f"model.tiled_{kind}")
    if isinstance(setting, AutoTiles):
        budget: int | None = setting.budget_bytes
    elif setting == "auto":
        budget = None
    else:
        return max(1, int(setting))
    per_token = width * (max(4, element_bytes) if kind == "loss" else element_bytes)
    # whole tokens per tile, so the largest piece (ceil(tokens / tiles)) fits the cap too
    per_tile = max(1, tile_bytes(kind, budget) // max(1, per_token))
    return max(1, -(-tokens // per_tile))


@dataclass(frozen=True)
class TilePlan:
    """The run's tiles, resolved once when the model is built (:func:`plan_tiles`).

    ``mlp`` (the tiled MLP) and ``loss`` (the LM head + loss): a count (0 or 1: untiled),
    ``"auto"`` (tiles under the fixed caps) or :class:`AutoTiles` (under the budget; a
    plan given ``budget_bytes`` turns its ``"auto"`` settings into these).
    ``budget_bytes``: the per-rank budget (None: the caps alone); ``source``: the line
    that says where it came from (None when no tile is ``"auto"``)."""

    mlp: TileSetting = 0
    loss: TileSetting = 0
    budget_bytes: int | None = None
    source: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_tiles(self.mlp, "model.tiled_mlp")
        check_tiles(self.loss, "model.tiled_loss")
        if self.budget_bytes is not None:
            AutoTiles(self.budget_bytes)  # > 0, or the error naming the budget
            object.__setattr__(self, "mlp", self.under_budget(self.mlp))
            object.__setattr__(self, "loss", self.under_budget(self.loss))

    @property
    def tiles_mlp(self) -> bool:
        """Whether the MLPs are wrapped to run in tiles (a count > 1, or ``"auto"``)."""
        return is_auto(self.mlp) or int(self.mlp) > 1  # type: ignore[arg-type]

    def under_budget(self, setting: TileSetting) -> TileSetting:
        """``setting`` (tiles a caller chooses per call: a loss's ``"auto"``, the Trainer's
        log-prob head) under this plan's budget: ``"auto"`` becomes :class:`AutoTiles`."""
        if self.budget_bytes is None or not is_auto(setting):
            return setting
        return AutoTiles(self.budget_bytes)


class TileBlock(Protocol):
    """What :func:`plan_tiles` reads of a ``"model"`` block (``config.ModelConfig``,
    ``config.HFModelConfig``)."""

    @property
    def tiled_mlp(self) -> int | str: ...
    @property
    def tiled_loss(self) -> int | str: ...
    @property
    def memory_budget_gb(self) -> float | None: ...


def device_memory() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the current GPU, or None without one."""
    import torch

    return torch.cuda.mem_get_info() if torch.cuda.is_available() else None


def plan_tiles(
    block: TileBlock,
    *,
    gpu_memory: tuple[int, int] | None = None,
    default_bytes: int | None = None,
) -> TilePlan:
    """The one resolution of a ``"model"`` block's tiles and budget into a :class:`TilePlan`.

    The budget is ``model.memory_budget_gb`` as written; else ``default_bytes`` (the
    planner's, for the GPU it plans for); else with ``gpu_memory`` (``(free, total)`` at
    start: :func:`device_memory`) the GPU's free memory less the larger of 2 GiB and 10%
    of its memory (:func:`gpu_budget_gb`); else (CPU) none, and ``source`` says which
    tiles that gives. No ``"auto"`` tile: no budget is needed, none is taken."""
    mlp, loss, given = block.tiled_mlp, block.tiled_loss, block.memory_budget_gb
    check_memory_budget(given)
    if not (is_auto(mlp) or is_auto(loss)):
        return TilePlan(mlp, loss)
    if given is not None:
        line = f'"auto" tiles sized for a budget of {given:g} GiB per rank'
        return TilePlan(mlp, loss, budget_bytes=int(given * 2**30), source=line)
    if default_bytes is not None:
        line = f'"auto" tiles sized for a budget of {default_bytes / 2**30:.1f} GiB per rank'
        return TilePlan(mlp, loss, budget_bytes=int(default_bytes), source=line)
    if gpu_memory is not None:
        free, total = gpu_memory
        budget = gpu_budget_gb(free, total)
        line = (
            f'"auto" tiles sized for a budget of {budget:.1f} GiB per rank: the GPU\'s free '
            f"memory at start ({free / 2**30:.1f} GiB) less a margin; set "
            f"model.memory_budget_gb to choose it"
        )
        return TilePlan(mlp, loss, budget_bytes=int(budget * 2**30), source=line)
    line = (
        f'"auto" tiles without model.memory_budget_gb: loss tiles of up to '
        f"{LOSS_TILE_BYTES // 2**20} MiB of logits and MLP tiles of up to "
        f"{MLP_TILE_BYTES // 2**20} MiB (sized for a large GPU); on this CPU set "
        f'"memory_budget_gb" to the memory each rank may use for tiles sized to it'
    )
    return TilePlan(mlp, loss, source=line)
