"""Per-rank memory of a training step: static (parameters, gradients, optimizer state) and
the activation peak, in bytes.

Static, ZeRO over all ``n`` ranks (DeepSpeed partitions over data x sequence parallel),
as DeepSpeed 0.19 allocates it with this package's mpu (measured, see
docs/planner.md): parameters ``psi * B`` (ZeRO-3: the ``psi * B / n`` partition, plus the
persistent small tensors whole, plus one gathered layer); gradients ``psi * B`` (ZeRO-1
and ZeRO-2 alike: with the sequence-parallel mpu ZeRO-2 all-reduces whole gradients;
ZeRO-3: the ``psi * B / n`` partition plus its flat reduce buffer of exactly
``reduce_bucket_size`` elements, default 5e8); the fp32 master copy ``4 psi / n`` (kept
even for fp32 models) and Adam's two fp32 moments ``8 psi / n`` (ZeRO 0: not divided), on
the host instead with ``offload_optimizer``.

Activations, per token this rank holds (``s_l = N / P``), calibrated against the live
tensor bytes of a training step on CPU (``scripts/plan_vs_measured.py``): the tensors one
decoder layer saves for backward, times the layers (checkpointing: the layer input only,
on the host with offload), plus the final norm and loss, plus the largest transient of the
step (the loss backward, a tiled MLP piece, a recomputed layer, attention staging).
:func:`attention_activation` is the one place that knows the attention modes. Hybrid
models: every layer is counted as an attention layer saves (an approximation for the
mixer layers), and a mixer's exchange buffers (its input channels sent, received and
reordered) join the step's transients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.tiles import resolve_tiles
from ..modes.ulysses import kv_replication
from .shapes import ModelShape

__all__ = ["Memory", "activation_bytes", "attention_activation", "static_bytes", "tile_counts"]

FP32 = 4


@dataclass(frozen=True)
class Memory:
    static: int
    activation: int
    parts: dict

    @property
    def peak(self) -> int:
        return self.static + self.activation


def static_bytes(
    shape: ModelShape,
    *,
    zero_stage: int,
    world: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    reduce_bucket_size: float = 5e8,
    persistence_threshold: float = 1e5,
) -> dict[str, int]:
    """Bytes per rank of parameters, gradients, fp32 master copy and Adam moments."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    psi, B, n = shape.params, shape.dtype_bytes, world
    part = psi if zero_stage == 0 else -(-psi // n)
    params, grads = psi * B, psi * B
    if zero_stage == 3:
        kept = shape.persistent(persistence_threshold)
        gathered = 0 if kept == psi else shape.layer_params * B  # one layer at a time
        params = 0 if offload_param else part * B + kept * B + gathered
        grads = part * B + int(reduce_bucket_size) * B
    master = 0 if zero_stage == 0 and B == FP32 else part * FP32
    moments = 2 * part * FP32
    if offload_optimizer:
        master = moments = 0
    return {"params": params, "grads": grads, "master": master, "optimizer": moments}


def attention_activation(
    shape: ModelShape, *, s_local: int, batch: int, ulysses: int, ring: int,
    head_chunks: int = 1, kv_exchange: str = "ring",
) -> dict[str, int]:  # fmt: skip
    """Attention's share of one layer: ``saved`` (kept for backward, every layer) and
    ``staging`` (alive only inside the call: all-to-all send/receive/reorder buffers, ring
    blocks in flight and fp32 accumulators), in bytes.

    Ulysses stages about twice the local q/k/v/out (the packed send buffer, the received
    one, the reordered copy); with ``head_chunks`` c the all-to-all runs a head chunk at a
    time and the staging shrinks by c, the saved tensors do not; so does the ring's inside
    (hybrid mode: its kv blocks and fp32 accumulators, a chunk of heads at a time).
    Replicated kv heads
    (fewer kv heads than the degree) are saved head-sharded at their replicated width."""
    B, t = shape.dtype_bytes, batch * s_local
    Q, K, d = shape.q_width, shape.kv_width, shape.head_dim
    u, r = ulysses, ring
    saved = staging = 0
    if u > 1:
        k_rep = shape.hkv * kv_replication(shape.hq, shape.hkv, u) * d
        saved += 2 * (k_rep - K) * t * B
        staging += 2 * (Q + 2 * k_rep) * t * B // max(1, head_chunks)
        K = k_rep // u * u  # the ring below sees the replicated heads
    if r > 1:
        # heads this rank attends after the all-to-all: Q/u and K/u over u*s_l tokens
        kv_block = 2 * K * t * B  # (2, b, s_l * u, hk / u, d)
        blocks = r if kv_exchange == "allgather" else 2  # the one in flight and ours
        accum = (Q + 2 * K) * t * FP32 + shape.hq * t * FP32  # dq, dk, dv (or out, lse)
        # with head chunks the ring runs a chunk of heads at a time: its blocks and
        # accumulators shrink with them (hybrid counts are multiples of the kv chunks)
        ring_staging = (blocks * kv_block + accum + 2 * K * t * FP32) // max(1, head_chunks)
        staging = max(staging, ring_staging)
    return {"saved": saved, "staging": staging}


def tile_counts(shape: ModelShape, t: int) -> dict[str, int]:
    """The MLP and loss tiles the run uses for ``t`` tokens on a rank (``"auto"`` by the
    run's own rule, ``core.tiles.resolve_tiles``; 1: untiled)."""
    B = shape.dtype_bytes
    return {
        "mlp": resolve_tiles(shape.tiled_mlp, "mlp", tokens=t, width=shape.ffn, element_bytes=B),
        "loss": resolve_tiles(
            shape.tiled_loss, "loss", tokens=t, width=shape.vocab, element_bytes=B
        ),
    }


def _layer_saved(shape: ModelShape, t: int, mlp_tiles: int) -> int:
    """Bytes one decoder layer saves for backward, local attention (measured: the
    reference decoder keeps the fused qkv output, the roped q/k and a contiguous copy of
    the attention output; the Hugging Face Llama the roped q/k, v and the output)."""
    B, D, Q, K, F = shape.dtype_bytes, shape.dim, shape.q_width, shape.kv_width, shape.ffn
    q_coef, k_coef, rope = (3, 3, 4 * shape.head_dim) if shape.family == "reference" else (2, 2, 0)
    mlp = 0 if mlp_tiles > 1 else 4 * F
    return t * (B * (6 * D + q_coef * Q + k_coef * K + mlp) + FP32 * (rope + shape.hq + 2))


def activation_bytes(
    shape: ModelShape, *, seq_len: int, batch: int, ulysses: int, ring: int,
    head_chunks: int = 1, kv_exchange: str = "ring",
) -> dict[str, Any]:  # fmt: skip
    """The activation peak of one training step on one rank, and its parts (bytes):
    ``layers`` (what every layer keeps), ``top`` (final norm), ``transient`` (the largest
    of ``transient_parts``: the loss of one tile, and the recomputed layer with its
    backward under checkpointing, else a tiled MLP piece or the attention staging)."""
    P = ulysses * ring
    t = batch * (seq_len // P)
    B, D, V, F = shape.dtype_bytes, shape.dim, shape.vocab, shape.ffn
    attn = attention_activation(
        shape, s_local=seq_len // P, batch=batch, ulysses=ulysses, ring=ring,
        head_chunks=head_chunks, kv_exchange=kv_exchange,
    )  # fmt: skip
    tiles = tile_counts(shape, t)
    layer = _layer_saved(shape, t, tiles["mlp"]) + attn["saved"]
    rope_top = 2 * shape.head_dim * FP32 * t if shape.family == "hf" else 0
    top = t * (3 * D * B + FP32) + rope_top  # final norm: input, normalised, output
    c_loss = tiles["loss"]
    loss = 3 * V * FP32 * t // c_loss  # fp32 log-softmax, and two gradients of it
    c_mlp = tiles["mlp"]
    mlp = (5 * F * B * t // c_mlp + 2 * D * B * t) if c_mlp > 1 else 0  # one piece again
    for m in shape.mixers:  # the send, receive and natural-order copies of a mixer's input
        staging = 3 * t * m.channels(P)[0] * B
        attn = {**attn, "staging": max(attn["staging"], staging)}
    if shape.activation_checkpointing:
        kept = 0 if shape.offload_activations else D * B * t  # the layer input
        layers = shape.layers * kept
        # the loss backward, or the last layer recomputed and its attention backward
        grads = (2 * shape.q_width + shape.kv_width) * B * t
        parts = {"loss": loss, "recomputed_layer": layer,
                 "layer_backward": max(grads, attn["staging"])}  # fmt: skip
        transient = max(loss, layer + max(grads, attn["staging"]))
    else:
        layers = shape.layers * layer
        parts = {"loss": loss, "mlp_tile": mlp, "attention_staging": attn["staging"]}
        transient = max(loss, mlp, attn["staging"])
    return {"layers": layers, "top": top, "transient": transient,
            "total": layers + top + transient, "transient_parts": parts}  # fmt: skip
