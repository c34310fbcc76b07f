"""Per-rank memory of a training step: static (parameters, gradients, optimizer state) and
the activation peak, in bytes.

Static, ZeRO over all ``n`` ranks (DeepSpeed partitions over data x sequence parallel),
as DeepSpeed 0.19 allocates it with this package's mpu (measured:
docs/benchmarks/planner.md): parameters ``psi * B`` (ZeRO-3: the ``psi * B / n`` partition, plus the
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
:func:`attention_activation` is the one place that knows the attention modes: what
Ulysses keeps for the backward beyond the layer's own tensors (none with
``redo_all_to_all``) and the attention call's working set. Hybrid
models: every layer is counted as an attention layer saves (an approximation for the
mixer layers), and a mixer's exchange buffers (its input channels sent, received and
reordered) join the step's transients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.tiles import TilePlan, resolve_tiles
from ..modes.ulysses import kv_replication
from .shapes import ModelShape

__all__ = [
    "Memory",
    "activation_bytes",
    "attention_activation",
    "attention_layer_peak",
    "static_bytes",
    "tile_counts",
]

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
    shape: ModelShape,
    *,
    s_local: int,
    batch: int,
    ulysses: int,
    ring: int,
    head_chunks: int = 1,
    kv_exchange: str = "ring",
    redo: bool = False,
) -> dict[str, int]:
    """Attention's share of one layer beyond what :func:`_layer_saved` counts (the caller's
    q, k, v, output and lse, as local attention saves them), in bytes: ``kept`` (the
    head-sharded copies kept from the forward to the backward), ``saved`` (what they add
    to a model's layer: the caller's q, k, v, saved by nothing else, go when the copies
    replace them; the output stays, the output projection's input) and ``staging`` (the
    peak of the working set inside the call, on top of ``kept``).

    Ulysses runs as ``modes/chunked.py`` does, in ``head_chunks`` c chunks of heads. Sizes
    in bytes of the rank's tokens: a chunk's head-sharded q (or output, or output gradient)
    ``qc = Q/c``; its kv chunk ``kc`` per tensor (k at its replicated width over the kv
    chunks, ``min(c, kv heads per rank)``; several query chunks may share one).

    - kept (the default): ``kept`` = every chunk's head-sharded q, k, v and output, as
      many bytes as the caller's q, k (replicated width), v and output; ``saved`` = the
      output's copy and the kv replication, ``Q + 2 (Kr - K)``.
    - redo (``redo_all_to_all``): ``kept`` = ``saved`` = 0 (it saves the caller's q, k,
      v and out, as local attention does); the
      backward fetches dO, q, out and the kv chunk in one message (``3 qc + 2 kc``), alive
      twice while it is unpacked (received buffer and copies), then once under the inner
      backward; replicated k/v (fewer kv heads than the degree) are rebuilt for it.

    ``staging``: the backward, chunk by chunk, at its largest: the kept copies not yet
    freed (each chunk's after its use, a kv chunk's after its last query chunk), the
    gradient pieces already sent back, the kv chunk's dk/dv so far, the chunk's dO, and
    the inner backward: the local kernel's contiguous dO and its dq, dk, dv (``2 qc + 2
    kc``), or in hybrid mode the ring's (kv blocks ours and in flight, all ``r`` under
    ``"allgather"``; fp32 accumulators dq and dk/dv; one block's contiguous dO and kernel
    gradients, released before the next block's exist); and the end, where the pieces
    are put together. The forward's working set (one chunk's inbound and outbound
    all-to-all buffers, the ring's fp32 output) is smaller and is not counted. Ring only:
    nothing kept, staging the ring's over all heads. Checked against measured peaks of one
    layer (``scripts/plan_vs_measured.py --attention``, ``tests/unit/test_plan_attention.py``)."""
    B, t = shape.dtype_bytes, batch * s_local
    acc = 8 if B == 8 else FP32  # the ring's accumulators
    u, r = ulysses, ring
    Q = shape.q_width * t * B  # the rank's q (or output, or dO) in bytes
    rep = kv_replication(shape.hq, shape.hkv, u) if u > 1 else 1
    Kr = shape.kv_width * rep * t * B  # k (or v) at its replicated width
    c = max(1, head_chunks) if u > 1 else 1
    ck = min(c, shape.hkv * rep // u) if u > 1 else 1
    qc, kc = Q // c, Kr // ck
    if r > 1:
        blocks = r if kv_exchange == "allgather" else 2  # ours and the one in flight
        dkv = (r if kv_exchange == "allgather" else 1) * 2 * kc * acc // B
        inner = blocks * 2 * kc + dkv + qc * acc // B + qc + 2 * kc
    else:
        inner = 2 * qc + 2 * kc
    if u == 1:
        return {"saved": 0, "kept": 0, "staging": inner}
    per_kv = c // ck
    kept = 0 if redo else 2 * Q + 2 * Kr
    # in a model the caller's q, k, v live only in the attention's saved tensors (the
    # layer's own count has them) and go when kept copies replace them; its output stays
    # (the output projection's input): kept adds the output's copy and the replication
    saved = 0 if redo else Q + 2 * (Kr - shape.kv_width * t * B)
    peak = 2 * Q + 4 * Kr  # the end: the gradient pieces and the tensors put together
    for i in range(c):
        new_kv = i % per_kv == 0
        done = i * qc + i // per_kv * 2 * kc  # gradient pieces sent back
        kv_acc = 0 if new_kv else 2 * kc  # this kv chunk's dk/dv of earlier query chunks
        if redo:
            fetched = 3 * qc + 2 * kc * new_kv
            held = (0 if new_kv else 2 * kc) + (2 * Kr if rep > 1 else 0)
            live = held + max(2 * fetched, fetched + inner)
        else:
            live = (c - i) * 2 * qc + (ck - i // per_kv) * 2 * kc + qc + inner
        peak = max(peak, live + done + kv_acc)
    return {"saved": saved, "kept": kept, "staging": peak - kept}


def attention_layer_peak(
    shape: ModelShape,
    *,
    seq_len: int,
    batch: int,
    ulysses: int,
    ring: int,
    head_chunks: int = 1,
    kv_exchange: str = "ring",
    redo: bool = False,
) -> int:
    """The per-rank peak of one attention layer's forward and backward, inputs included:
    the caller's q, k, v and output gradient, the output, its lse, and
    :func:`attention_activation`'s ``saved`` and ``staging`` (what
    ``scripts/benchmark_attention_memory.py`` measures)."""
    s_l = seq_len // (ulysses * ring)
    t, B = batch * s_l, shape.dtype_bytes
    own = (3 * shape.q_width + 2 * shape.kv_width) * t * B + shape.hq * t * FP32
    attn = attention_activation(
        shape,
        s_local=s_l,
        batch=batch,
        ulysses=ulysses,
        ring=ring,
        head_chunks=head_chunks,
        kv_exchange=kv_exchange,
        redo=redo,
    )
    return own + attn["kept"] + attn["staging"]


def tile_counts(shape: ModelShape, t: int) -> dict[str, int]:
    """The MLP and loss tiles the run uses for ``t`` tokens on a rank (``"auto"`` by the
    run's own rule, ``core.tiles.resolve_tiles``, under the model block's
    budget, ``shape.budget_bytes``; 1: untiled)."""
    B, tiles = shape.dtype_bytes, TilePlan(shape.tiled_mlp, shape.tiled_loss, shape.budget_bytes)
    return {
        "mlp": resolve_tiles(tiles.mlp, "mlp", tokens=t, width=shape.ffn, element_bytes=B),
        "loss": resolve_tiles(tiles.loss, "loss", tokens=t, width=shape.vocab, element_bytes=B),
    }


def _mlp_norm_fold(shape: ModelShape, mlp_tiles: int) -> int:
    """1 when the tiled MLP's pieces run the lean norm before it (its output is never kept
    whole: ``models.memory.TiledMLP``), else 0."""
    return 1 if shape.lean_norms and mlp_tiles > 1 else 0


def _layer_saved(shape: ModelShape, t: int, mlp_tiles: int) -> int:
    """Bytes one decoder layer saves for backward, local attention (measured: the
    reference decoder keeps the fused qkv output, the roped q/k and a contiguous copy of
    the attention output; the Hugging Face Llama the roped q/k, v and the output)."""
    B, D, Q, K, F = shape.dtype_bytes, shape.dim, shape.q_width, shape.kv_width, shape.ffn
    q_coef, k_coef, rope = (3, 3, 4 * shape.head_dim) if shape.family == "reference" else (2, 2, 0)
    mlp = 0 if mlp_tiles > 1 else 4 * F
    # lean norms keep no normalised copy (2 norms), and the second one's output is not
    # kept when the MLP's pieces run it
    hidden = (4 if shape.lean_norms else 6) - _mlp_norm_fold(shape, mlp_tiles)
    return t * (B * (hidden * D + q_coef * Q + k_coef * K + mlp) + FP32 * (rope + shape.hq + 2))


def activation_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    batch: int,
    ulysses: int,
    ring: int,
    head_chunks: int = 1,
    kv_exchange: str = "ring",
    redo: bool = False,
) -> dict[str, Any]:
    """The activation peak of one training step on one rank, and its parts (bytes):
    ``layers`` (what every layer keeps), ``top`` (the final norm's tensors at the peak:
    its input and output in the loss's phase, the gradient into the last layer after it),
    ``transient`` (the largest of ``transient_parts`` with its ``top``: the loss of one
    tile, and the recomputed layer with its backward under checkpointing, else a tiled MLP
    piece or the attention staging)."""
    P = ulysses * ring
    t = batch * (seq_len // P)
    B, D, F = shape.dtype_bytes, shape.dim, shape.ffn
    attn = attention_activation(
        shape,
        s_local=seq_len // P,
        batch=batch,
        ulysses=ulysses,
        ring=ring,
        head_chunks=head_chunks,
        kv_exchange=kv_exchange,
        redo=redo,
    )
    tiles = tile_counts(shape, t)
    layer = _layer_saved(shape, t, tiles["mlp"]) + attn["saved"]
    rope_top = 2 * shape.head_dim * FP32 * t if shape.family == "hf" else 0
    lean = 1 if shape.lean_norms else 0  # a lean norm keeps no normalised copy
    c_loss = tiles["loss"]
    if lean and c_loss > 1:  # lm_loss's tiled loss runs the lean final norm per piece
        top = t * D * B + rope_top
    else:  # final norm: input, output (and the normalised copy), rstd
        top = t * ((3 - lean) * D * B + FP32) + rope_top
    # after the final norm's backward: the gradient into the last layer (and the rotary
    # tables), what the layers' backward meets instead of ``top``
    after_top = t * D * B + rope_top
    loss = _loss_transient(shape, t, c_loss)
    c_mlp = tiles["mlp"]
    mlp = (5 * F * B * t // c_mlp + 2 * D * B * t) if c_mlp > 1 else 0  # one piece again
    for m in shape.mixers:  # the send, receive and natural-order copies of a mixer's input
        # (and Mamba1's partial sums and their all-reduced copy, float32, whole sequence)
        staging = 3 * t * m.channels(P)[0] * B + 2 * P * t * m.reduced * max(B, FP32)
        attn = {**attn, "staging": max(attn["staging"], staging)}
    if shape.activation_checkpointing:
        # the layer input, on the host for the offloaded layers
        layers = (shape.layers - shape.offloaded_layers) * D * B * t
        # the loss backward, or the last layer recomputed and its attention backward
        grads = (2 * shape.q_width + shape.kv_width) * B * t
        parts = {
            "loss": loss,
            "recomputed_layer": layer,
            "layer_backward": max(grads, attn["staging"]),
        }
        # by the attention's backward the layer's MLP half is done: its saved tensors
        # (the MLP's intermediates when untiled, the second norm's input and output and
        # the MLP output: about half of the layer's hidden-size tensors) are gone, so the
        # attention's working set meets the layer less them; the gradients' term stays
        # whole (matched at P = 1, where there is no staging: tests/unit/test_plan.py)
        fold = _mlp_norm_fold(shape, tiles["mlp"])  # the MLP's pieces run the second norm
        after = ((3 - lean - fold) * D + (0 if tiles["mlp"] > 1 else 4 * F)) * B * t
        in_layers = max(layer + grads, layer + attn["staging"] - after)
        if c_mlp > 1:  # a tiled MLP's piece recomputed and its backward, inside the
            # recomputed layer (its saved tensors all alive; measured: the peak at P = 1)
            in_layers = max(in_layers, layer + mlp)
        else:  # the MLP's backward: the gradients of its two intermediates beside them
            in_layers = max(in_layers, layer + 2 * F * B * t)
    else:
        layers = shape.layers * layer
        parts = {"loss": loss, "mlp_tile": mlp, "attention_staging": attn["staging"]}
        in_layers = max(mlp, attn["staging"])
    # the peak is in the loss (the final norm's tensors alive) or in the layers' backward
    # (they are gone by then): ``top`` is the final norm's share at whichever is larger
    at_loss = top + loss  # the loss's phase (the final norm's tensors alive)
    if top + loss >= after_top + in_layers:
        transient = loss
    else:
        top, transient = after_top, in_layers
    return {
        "layers": layers,
        "top": top,
        "transient": transient,
        "total": layers + top + transient,
        "transient_parts": parts,
        "in_layers": in_layers,  # the layers' backward at its largest (the phases' model)
        "after_top": after_top,
        "at_loss": at_loss,
    }


def _loss_transient(shape: ModelShape, t: int, tiles: int) -> int:
    """The loss's largest working set over ``t`` tokens in ``tiles`` pieces. Autograd's
    loss: the fp32 log-softmax of a piece and two gradients of it. The fused loss
    (``models/fused_loss.py``): a piece's logits in the model's dtype and in fp32 (then
    its gradient, in place, and that rounded to the model's dtype), the weight's gradient
    (an fp32 accumulator over several pieces, and each piece's GEMM result in the
    weight's dtype beside it), the hidden states' gradient, kept for the backward, and a
    piece's share of it (through the lean final norm when that is folded in)."""
    B, V, D = shape.dtype_bytes, shape.vocab, shape.dim
    if not shape.fused_loss:
        return 3 * V * FP32 * t // tiles
    acc = V * D * FP32 if tiles > 1 else 0
    gemm = V * D * B if tiles == 1 or B != FP32 else 0  # fp32 weights: added in place
    # a piece's d hidden; with a lean final norm folded in, its backward in fp32 (two
    # tensors of the piece) and d x in the model's dtype beside it
    piece = (2 * FP32 + 2 * B if shape.lean_norms else B) * D * t // tiles
    return (FP32 + B) * V * t // tiles + acc + gemm + t * D * B + piece
