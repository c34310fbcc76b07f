"""Candidates, their predictions, the step-time cost model and the ranking.

Cost model (per rank, per optimizer step; no overlap of compute and communication assumed,
so it errs long):

    step_s = flops / (peak_tflops * 1e12 * mfu) + intra / intra_gbs / 1e9
             + inter / inter_gbs / 1e9 + host / pcie_gbs / 1e9

``flops``: ``6 * (params - embedding) * tokens`` for the matmuls, plus causal attention
``6 * b * N^2 * hq * d * layers / P`` (half the scores; backward twice the forward), times
4/3 under activation checkpointing (one more forward), plus the recomputed forward of
tiled MLP and loss pieces; a contiguous ring's busiest rank does ``2r / (r + 1)`` times the
mean attention work (zigzag balances it). ``host``: offloaded layer inputs (out and back)
and, with ``offload_optimizer``, gradients out and parameters back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from ..core.flops import model_flops
from ..core.sharding import sequence_multiple
from ..core.tiles import gpu_budget_gb
from ..core.topology import validate_degrees
from ..deepspeed_block import DeepSpeedSettings
from ..modes.ulysses import head_chunk_choices, kv_replication, resolve_head_chunks
from .comm import attention_bytes, split_nodes, zero_bytes
from .fsdp2 import fsdp2_bytes, fsdp2_peak, fsdp2_static_bytes
from .host import host_bytes
from .memory import activation_bytes, static_bytes, tile_counts
from .phases import deepspeed_peak
from .shapes import ModelShape

__all__ = ["Hardware", "Run", "ZeroKnobs", "candidates", "longest", "predict"]

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """What the cost model assumes (defaults: an 8-GPU H100/H200 SXM node, 400 Gb/s
    InfiniBand per GPU)."""

    gpu_mem_gb: float = 80.0  # GiB per GPU the run may use
    host_mem_gb: float = 2048.0  # GiB of host memory per node (a DGX H100 has 2 TiB)
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100/H200 SXM: core.flops.PEAK_TFLOPS)
    mfu: float = 0.45  # the fraction of peak the matmuls reach
    intra_gbs: float = 450.0  # NVLink, GB/s per GPU per direction
    inter_gbs: float = 50.0  # 400 Gb/s NIC per GPU
    pcie_gbs: float = 25.0  # host offload


@dataclass(frozen=True)
class ZeroKnobs:
    """The ``zero_optimization`` settings the prediction reads (DeepSpeed's defaults):
    ``stage3_max_live_parameters``, ``reduce_bucket_size``,
    ``stage3_param_persistence_threshold``."""

    max_live_parameters: float = 1e9
    reduce_bucket_size: float = 5e8
    persistence_threshold: float = 1e5
    optimizer_temp_bytes: int = 0  # per partition element: FusedAdam 0, torch's Adam 8

    @classmethod
    def of(cls, zero: dict) -> ZeroKnobs:
        """From a config's ``zero_optimization`` block (parsed by
        :class:`~ulysses_cp.deepspeed_block.DeepSpeedSettings`)."""
        return cls.from_settings(DeepSpeedSettings.from_dict({"zero_optimization": zero}))

    @classmethod
    def from_settings(cls, ds: DeepSpeedSettings) -> ZeroKnobs:
        """From a config's parsed DeepSpeed settings (``"auto"``: DeepSpeed's default)."""
        default = cls()
        return cls(
            max_live_parameters=_or(ds.stage3_max_live_parameters, default.max_live_parameters),
            reduce_bucket_size=_or(ds.reduce_bucket_size, default.reduce_bucket_size),
            persistence_threshold=_or(
                ds.stage3_param_persistence_threshold, default.persistence_threshold
            ),
        )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


@dataclass(frozen=True)
class Run:
    """One way to run: the degrees and every memory option."""

    ulysses: int
    ring: int
    layout: str
    zero_stage: int
    head_chunks: int = 1
    activation_checkpointing: bool = False
    offload_activations: bool | int = False  # every layer, none, or the first n
    tiled_mlp: int | str = 0  # > 1: the MLP in this many pieces; "auto": by bytes
    tiled_loss: int | str = 0  # > 1: LM head + loss in this many pieces; "auto": by bytes
    offload_optimizer: bool = False
    kv_exchange: str = "ring"
    redo_all_to_all: bool = False
    engine: str = "deepspeed"  # or "fsdp2": zero_stage 3 reshards after forward, 0-2 not
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring


def _shape(shape: ModelShape, run: Run) -> ModelShape:
    return replace(
        shape,
        activation_checkpointing=run.activation_checkpointing,
        offload_activations=run.offload_activations,
        tiled_mlp=run.tiled_mlp,
        tiled_loss=run.tiled_loss,
    )


def _flops(shape: ModelShape, run: Run, seq_len: int, batch: int) -> float:
    t = batch * seq_len / run.sp
    dense = 6 * (shape.params - shape.vocab * shape.dim) * t
    attn = model_flops(
        matmul_params=0,
        attention_layers=shape.n_attention,
        hq=shape.hq,
        head_dim=shape.width,
        seq_len=seq_len,
        batch=batch,
        sp=run.sp,
    )
    if run.layout == "contiguous" and run.ring > 1:
        attn *= 2 * run.ring / (run.ring + 1)
    total = dense + attn
    if run.activation_checkpointing:
        total *= 4 / 3
    tiles = tile_counts(shape, batch * seq_len // run.sp)
    if tiles["mlp"] > 1:  # the pieces' forward again in backward
        total += 2 * t * 3 * shape.dim * shape.ffn * shape.layers
    if tiles["loss"] > 1:
        total += 2 * t * shape.vocab * shape.dim
    return total


def predict(
    shape: ModelShape,
    run: Run,
    *,
    seq_len: int,
    batch: int,
    micro_steps: int,
    world: int,
    hw: Hardware,
    zero_knobs: ZeroKnobs = ZeroKnobs(),
) -> dict:
    """Memory, communication and step time of ``run`` for one rank."""
    sh = _shape(shape, run)
    fsdp2 = run.engine == "fsdp2"
    if fsdp2 and run.offload_optimizer:
        raise ValueError(
            "zero_optimization.offload_optimizer is DeepSpeed's: the fsdp2 engine has no "
            'optimizer offload; remove the key, or plan with "engine": "deepspeed"'
        )
    reshard = run.zero_stage == 3  # FSDP2's reshard_after_forward
    static = static_bytes(
        sh,
        zero_stage=run.zero_stage,
        world=world,
        offload_optimizer=run.offload_optimizer,
        reduce_bucket_size=zero_knobs.reduce_bucket_size,
        persistence_threshold=zero_knobs.persistence_threshold,
    )
    if fsdp2:
        static = fsdp2_static_bytes(sh, reshard_after_forward=reshard, world=world)
    chunks = 1  # what the run uses: 0 is the automatic rule
    if run.ulysses > 1:
        head = batch * (seq_len // run.ring) * sh.head_dim * sh.dtype_bytes  # one q head, sharded
        chunks = resolve_head_chunks(
            run.head_chunks, sh.hq, sh.hkv, run.ulysses, run.ring > 1, head
        )
    act = activation_bytes(
        sh,
        seq_len=seq_len,
        batch=batch,
        ulysses=run.ulysses,
        ring=run.ring,
        head_chunks=chunks,
        kv_exchange=run.kv_exchange,
        redo=run.redo_all_to_all,
    )
    attn = attention_bytes(
        sh,
        seq_len=seq_len,
        batch=batch,
        ulysses=run.ulysses,
        ring=run.ring,
        micro_steps=micro_steps,
        kv_exchange=run.kv_exchange,
        redo=run.redo_all_to_all,
    )
    zero = zero_bytes(
        sh,
        stage=run.zero_stage,
        world=world,
        micro_steps=micro_steps,
        max_live_parameters=zero_knobs.max_live_parameters,
    )
    if fsdp2:
        zero = fsdp2_bytes(sh, reshard_after_forward=reshard, world=world, micro_steps=micro_steps)
    nodes = split_nodes(
        world=world,
        gpus_per_node=min(hw.gpus_per_node, world),
        ulysses=run.ulysses,
        ring=run.ring,
        attention=attn,
        zero=zero,
    )
    t = batch * seq_len // run.sp
    host = 2 * sh.offloaded_layers * sh.dim * sh.dtype_bytes * t * micro_steps
    if run.offload_optimizer:
        host += 2 * -(-sh.params // world) * sh.dtype_bytes
    host_mem = host_bytes(
        sh,
        zero_stage=run.zero_stage,
        world=world,
        tokens=t,
        offload_optimizer=run.offload_optimizer,
        partitioned_load=(fsdp2 or run.zero_stage == 3) and sh.family == "hf",
    )
    flops = _flops(sh, run, seq_len, batch) * micro_steps
    step_s = (
        flops / (hw.peak_tflops * 1e12 * hw.mfu)
        + nodes["intra"] / (hw.intra_gbs * 1e9)
        + nodes["inter"] / (hw.inter_gbs * 1e9)
        + host / (hw.pcie_gbs * 1e9)
    )
    s_bytes, a_bytes = sum(static.values()), act["total"]
    zero_run = dict(
        stage=run.zero_stage,
        world=world,
        micro_steps=micro_steps,
        offload_optimizer=int(run.offload_optimizer),
        bucket=int(zero_knobs.reduce_bucket_size) * sh.dtype_bytes,
    )
    phases = deepspeed_peak(
        sh,
        act,
        static,
        zero=zero_run,
        tokens=t,
        optimizer_temp_bytes=zero_knobs.optimizer_temp_bytes,
    )
    if fsdp2:
        phases = fsdp2_peak(sh, act, static, tokens=t)
    return {
        "peak_bytes_per_rank": phases["peak"],
        "peak_phase": phases["phase"],
        "phases": phases,
        "static_bytes_per_rank": s_bytes,
        "activation_bytes_per_rank": a_bytes,
        "host_bytes_per_rank": host_mem["peak"],
        "host_parts": host_mem,
        "comm_bytes_per_step_per_rank": attn["total"] + sum(v["wire"] for v in zero.values()),
        "attention_comm_bytes_per_step": attn["total"],
        "zero_comm_bytes_per_step": {k: v["wire"] for k, v in zero.items()},
        "zero_logged_bytes_per_step": {k: v["logged"] for k, v in zero.items()},
        "intra_node_bytes": nodes["intra"],
        "inter_node_bytes": nodes["inter"],
        "static_parts": static,
        "activation_parts": act,
        "tiles": tile_counts(sh, t),
        "flops_per_step": flops,
        "predicted_step_s": step_s,
    }


def usable(total_bytes: float) -> float:
    """The bytes of ``total_bytes`` a plan may fill: the run's own headroom, as it sizes its
    tile budget on a GPU (``core.tiles.gpu_budget_gb``: the larger of 2 GiB and 10% left
    free), for the GPU and for the host memory of a rank alike. Under 4 GiB (the sizes
    tests plan for on CPU) 10% is left free."""
    if total_bytes < 4 * GiB:
        return 0.9 * total_bytes
    return gpu_budget_gb(int(total_bytes), int(total_bytes)) * GiB


def filled(pred: dict, hw: Hardware) -> float:
    """What a prediction fills of :func:`usable` GPU memory: the GPU peak, or the host
    bytes scaled to it when those fill more of the host memory a rank may use."""
    host_budget = usable(hw.host_mem_gb * GiB / hw.gpus_per_node)
    gpu_budget = usable(hw.gpu_mem_gb * GiB)
    return max(pred["peak_bytes_per_rank"], pred["host_bytes_per_rank"] * gpu_budget / host_budget)


def longest(peak_at, unit: int, budget: float, limit: int = 2**26) -> int:
    """The largest multiple of ``unit`` (up to ``limit``) with ``peak_at(n) <= budget``:
    doubling, then bisection on multiples of ``unit`` (``scripts/profiling.py``'s search,
    so that measured and predicted lengths come from the same steps); 0 if none."""
    lo, hi = 0, unit
    while peak_at(hi) <= budget:
        lo, hi = hi, hi * 2
        if hi > limit:
            return lo
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if peak_at(mid) <= budget else (lo, mid)
    return lo


def candidates(shape: ModelShape, base: Run, *, world: int, seq_len: int) -> list[Run]:
    """``base`` (the config as written) and every valid alternative: every (ulysses, ring)
    whose product divides ``world`` and whose Ulysses degree splits the heads, both layouts
    when there is a ring, ZeRO 1/2/3, head chunks that divide the local heads, no
    checkpointing / checkpointing / checkpointing + offload, untiled / tiles by bytes
    (``"auto"``) / the config's own tile counts, and with a Ulysses degree above 1 the
    head-sharded copies kept or the all-to-all redone in backward (``redo_all_to_all``)."""
    out = [base]
    stages = (2, 3) if base.engine == "fsdp2" else (1, 2, 3)  # FSDP2: ZeRO 1 is 2
    tiles: list[int | str] = [0, "auto"]
    for own in (base.tiled_mlp, base.tiled_loss):
        if own != "auto" and int(own) > 1 and own not in tiles:
            tiles.append(own)
    for sp in (d for d in range(1, world + 1) if world % d == 0):
        for u in (d for d in range(1, sp + 1) if sp % d == 0):
            r = sp // u
            try:
                validate_degrees(world, u, r)
                kv_replication(shape.hq, shape.hkv, u)
            except ValueError:
                continue
            layouts = ("zigzag", "contiguous") if r > 1 else (base.layout,)
            chunks = [c for c in head_chunk_choices(shape.hq, shape.hkv, u, r > 1) if c <= 8]
            mem = ((False, False), (True, False), (True, True))
            redos = (False, True) if u > 1 else (base.redo_all_to_all,)
            for layout, stage, c, (ck, off), tl, redo in itertools.product(
                layouts, stages, chunks, mem, tiles, redos
            ):
                if seq_len % sequence_multiple(sp, layout):
                    continue
                run = Run(
                    u,
                    r,
                    layout,
                    stage,
                    c,
                    ck,
                    off,
                    tl,
                    tl,
                    base.offload_optimizer,
                    base.kv_exchange,
                    redo,
                    base.engine,
                )
                if run != base:
                    out.append(run)
    return out
