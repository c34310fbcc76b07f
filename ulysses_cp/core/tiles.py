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

``tiles = ceil(tokens * width * element_bytes / budget)`` with ``tokens`` the batch's
tokens on this rank (``b * s_local``): the local length is the same on every rank (the
sequence is sharded evenly), so every rank runs the same number of tiles and ZeRO-3's
parameter gathers stay in step. Short sequences resolve to 1: untiled.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "LOSS_TILE_BYTES",
    "MLP_TILE_BYTES",
    "TileKind",
    "TileSetting",
    "check_tiles",
    "resolve_tiles",
]

TileSetting = int | str  # a count, or "auto"
TileKind = Literal["loss", "mlp"]

LOSS_TILE_BYTES = 2**30  # fp32 logits of one loss tile
MLP_TILE_BYTES = 2**27  # the (tokens, ffn) intermediate of one MLP tile, model dtype


def check_tiles(setting: object, name: str) -> None:
    """A ``ValueError`` naming ``name``, the value and the fix unless ``setting`` is
    ``"auto"`` or an integer >= 0."""
    if setting == "auto" and isinstance(setting, str):
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
    """The number of tiles (1: untiled) for ``setting`` over ``tokens`` tokens (``b *
    s_local``). ``width``: the vocabulary (``kind="loss"``) or the MLP's intermediate
    width (``"mlp"``); ``element_bytes``: the model's dtype size (the loss's logits are
    fp32 at least)."""
    check_tiles(setting, f"model.tiled_{kind}")
    if setting != "auto":
        return max(1, int(setting))
    if kind == "loss":
        per_token, budget = width * max(4, element_bytes), LOSS_TILE_BYTES
    elif kind == "mlp":
        per_token, budget = width * element_bytes, MLP_TILE_BYTES
    else:
        raise ValueError(f"tile kind must be 'loss' or 'mlp', got {kind!r}")
    return max(1, -(-tokens * per_token // budget))
