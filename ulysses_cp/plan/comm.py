"""Bytes one rank sends per training step: attention (all-to-all and ring, forward and
backward), hybrid models' token mixers (their all-to-alls, counted with the attention's)
and ZeRO's collectives, split into intra-node and inter-node bytes.

Attention, per layer and micro batch (:func:`forward_comm_bytes` gives the forward, the
formulas of ``docs/library/modes.md``, "Communication"; the tests compare the counters with
their own copy): the backward all-to-all moves the same bytes as the forward (the
gradients of q/k/v and of the output go the other way); the ring's backward passes each kv
block on ``r - 1`` times (model dtype) and each dk/dv accumulator ``r`` times in fp32
(fp64 for fp64 models), so ``ring_bwd = ring_fwd * (1 + r/(r-1) * acc/B)``; with
``kv_exchange="allgather"`` the backward gathers the kv again and sends ``r - 1`` dk/dv
shares, ``ring_fwd * (1 + acc/B)``.
These are the counters of ``ulysses_cp.core.comm.stats`` that ``metrics.jsonl``'s
``attention_comm_bytes_per_step`` sums (its ``comm_bytes_per_step`` adds ZeRO's bytes
below, as the plan's ``comm_bytes_per_step_per_rank`` does).

ZeRO (the formula's home is ``ulysses_cp.core.zero_comm``, which the run logs with),
as DeepSpeed issues it (message bytes as its comms logger records them): ZeRO-1/2
all-reduce the gradients (``psi * B``; ZeRO-1 once per step, ZeRO-2 every micro batch) and
all-gather the updated parameter partitions after the step (``psi * B / n`` per rank);
ZeRO-3 all-gathers the parameters for the forward (and again for the backward when the
model has more than ``stage3_max_live_parameters``) and reduce-scatters the gradients
(``psi * B``) every micro batch. Bytes on the wire per rank (ring algorithms):
all-reduce ``2 (n-1)/n S``, all-gather ``(n-1) p``, reduce-scatter ``(n-1)/n S``.

Intra/inter: an all-to-all's bytes go to each peer equally, so they split by where the
peers live; a ring (attention ring, ZeRO's ring collectives) runs at its slowest hop, so
all its bytes count as inter-node when its group spans nodes.
"""

from __future__ import annotations

from ..core.topology import plan_groups
from ..core.zero_comm import zero_collectives
from ..modes.ulysses import kv_replication
from .shapes import ModelShape

__all__ = ["attention_bytes", "forward_comm_bytes", "mixer_bytes", "split_nodes", "zero_bytes"]


def forward_comm_bytes(
    *,
    batch: int,
    seq_len: int,
    hq: int,
    hkv: int,
    head_dim: int | tuple[int, int],
    ulysses_degree: int,
    ring_degree: int,
    bytes_per_element: int,
) -> tuple[int, int]:
    """Bytes one rank sends in one forward attention call, by formula.

    All-to-all over u ranks: ``b * (N/P) * (hq + hkv_sent) * (d + dv) * (u-1)/u * B`` (q, k,
    v out and the output back); KV ring over r ranks: ``b * (N/r) * (hkv_sent/u) * (d + dv)
    * (r-1) * B``; ``hkv_sent`` is ``hkv`` times its replication for u, ``dv`` the values'
    head dim (MLA's; ``d`` otherwise). The byte counters equal these (tested).

    Args:
        batch: ``b``.
        seq_len: The full length ``N``.
        hq: Query heads.
        hkv: Key/value heads.
        head_dim: ``d``, or ``(d, dv)``: the q/k and the values' head dims (MLA).
        ulysses_degree: ``u``.
        ring_degree: ``r``.
        bytes_per_element: ``B``.

    Returns:
        ``(all_to_all, ring)`` bytes.
    """
    u, r = ulysses_degree, ring_degree
    b, N, B = batch, seq_len, bytes_per_element
    d, dv = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    w = d + dv  # a q/output or k/v pair, per head
    hkv_sent = hkv * kv_replication(hq, hkv, u)
    a2a = b * (N // (u * r)) * (hq + hkv_sent) * w * (u - 1) // u * B
    ring = b * (N // r) * (hkv_sent // u) * w * (r - 1) * B
    return a2a, ring


def attention_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    batch: int,
    ulysses: int,
    ring: int,
    micro_steps: int = 1,
    kv_exchange: str = "ring",
    redo: bool = False,
) -> dict[str, int]:
    """All-to-all and ring bytes this rank sends in one step (every layer, forward and
    backward, ``micro_steps`` micro batches), as ``ulysses_cp.core.comm.stats`` counts.
    Activation checkpointing runs every layer's forward, and its attention traffic, again
    in backward. ``redo`` (``redo_all_to_all``): the backward moves q, the output and the
    kv again with the output gradient, the forward's all-to-all bytes once more
    (``all_to_all_redo``)."""
    B = shape.dtype_bytes
    a2a, ring_fwd = forward_comm_bytes(
        batch=batch,
        seq_len=seq_len,
        hq=shape.hq,
        hkv=shape.hkv,
        head_dim=(shape.head_dim, shape.dv),
        ulysses_degree=ulysses,
        ring_degree=ring,
        bytes_per_element=B,
    )
    acc = 8 if B == 8 else 4  # the dk/dv accumulators' dtype
    shares = ring if kv_exchange == "ring" else ring - 1  # dk/dv blocks sent in backward
    ring_bwd = ring_fwd + (ring_fwd // (ring - 1) * shares * acc // B if ring > 1 else 0)
    n = shape.n_attention * micro_steps
    redo_bytes = a2a * n if redo and ulysses > 1 else 0
    fwd = 2 if shape.activation_checkpointing else 1  # the recomputed forward
    mixer = mixer_bytes(shape, seq_len=seq_len, batch=batch, sp=ulysses * ring) * micro_steps
    return {
        "all_to_all": (fwd + 1) * a2a * n + mixer,
        "all_to_all_redo": redo_bytes,
        "ring_forward": fwd * ring_fwd * n,
        "ring_backward": ring_bwd * n,
        "mixers": mixer,
        "total": ((fwd + 1) * a2a + fwd * ring_fwd + ring_bwd) * n + mixer + redo_bytes,
    }


def mixer_bytes(shape: ModelShape, *, seq_len: int, batch: int, sp: int) -> int:
    """Bytes one rank sends per micro batch for the hybrid token mixers (all-to-alls over
    the whole SP group): per mixer layer, ``b * s_local * (to + back) * (P-1)/P * B`` in
    forward and again in backward (and in the recomputed forward with checkpointing); and
    Mamba1's all-reduce of ``b * s * reduced`` numbers in float32 at least, of which a
    ring all-reduce sends ``2 (P-1)/P``, as often."""
    if sp == 1:
        return 0
    runs = 3 if shape.activation_checkpointing else 2
    t, total = batch * (seq_len // sp), 0
    wide = max(shape.dtype_bytes, 4)
    for m in shape.mixers:
        to, back = m.channels(sp)
        total += m.count * runs * (t * (to + back) * (sp - 1) // sp) * shape.dtype_bytes
        total += m.count * runs * (2 * (sp - 1) * batch * seq_len * m.reduced // sp) * wide
    return total


def zero_bytes(
    shape: ModelShape,
    *,
    stage: int,
    world: int,
    micro_steps: int = 1,
    max_live_parameters: float = 1e9,
) -> dict[str, dict[str, int]]:
    """ZeRO's collectives per step: ``{op: {"logged": message bytes, "wire": bytes this
    rank sends}}`` (empty with one rank: nothing to reduce), by the rule the run logs
    (``core.zero_comm``)."""
    return zero_collectives(
        params=shape.params,
        element_bytes=shape.dtype_bytes,
        stage=stage,
        world=world,
        micro_steps=micro_steps,
        max_live_parameters=max_live_parameters,
    )


def split_nodes(
    *,
    world: int,
    gpus_per_node: int,
    ulysses: int,
    ring: int,
    attention: dict[str, int],
    zero: dict[str, dict[str, int]],
) -> dict[str, int]:
    """``{"intra": bytes, "inter": bytes}`` per step for rank 0 (the rank layout makes
    every rank's groups alike), from the groups ``plan_groups`` builds."""
    plan = plan_groups(world, ulysses, ring)
    node = [r // gpus_per_node for r in range(world)]
    mine = lambda groups: next(g for g in groups if 0 in g)  # noqa: E731
    intra = inter = 0
    mixers = attention.get("mixers", 0)  # all-to-alls over the whole SP group
    ulysses_sent = attention["all_to_all"] - mixers + attention.get("all_to_all_redo", 0)
    for group, sent in ((mine(plan.ulysses_groups), ulysses_sent), (mine(plan.sp_groups), mixers)):
        if len(group) > 1:
            off = sum(node[r] != node[0] for r in group)  # peers on other nodes
            inter += sent * off // (len(group) - 1)
            intra += sent - sent * off // (len(group) - 1)
    ring_bytes = attention["ring_forward"] + attention["ring_backward"]
    r_group = mine(plan.ring_groups)
    if len({node[r] for r in r_group}) > 1:
        inter += ring_bytes
    else:
        intra += ring_bytes
    z = sum(v["wire"] for v in zero.values())
    if world > gpus_per_node:
        inter += z
    else:
        intra += z
    return {"intra": intra, "inter": inter}
