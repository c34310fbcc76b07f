"""``"engine": "fsdp2"``: PyTorch's ``fully_shard`` behind the part of DeepSpeed's engine
interface the trainer, the checkpoints and the non-finite checks use.

:func:`fsdp2_initialize` shards a built model over ``fsdp_mesh(...).shard_mesh`` (each
decoder layer, then the root) and returns an :class:`FSDP2Engine`. The config's DeepSpeed
part maps as ``training.fsdp2_settings`` reads it: ZeRO-3 reshards the parameters after
the forward (``reshard_after_forward=True``); ZeRO 0, 1 and 2 keep them gathered from the
forward to the backward (False). Parameters, gradients and optimizer state are sharded
over every rank at every stage: ZeRO-0 and ZeRO-1 under FSDP2 still shard the parameters.
``bf16`` computes in bfloat16 and reduces gradients in float32 (``MixedPrecisionPolicy``),
the sharded parameters and the optimizer state staying float32.

A Hugging Face model with ``hf_weights`` is built on meta (``models.recipe.build_on_meta``), then
sharded, allocated and filled rank by rank from the safetensors (``fsdp2_loading``), then
probed.

Gradients: FSDP2 divides the reduce-scattered gradient by ``dp * sp``; the topology's
``grad_scale`` is ``sp`` (``integrations.fsdp2``), so the sum over the sequence ranks and
the mean over the replicas come out as one process's. Gradient accumulation as
DeepSpeed's: each micro step's loss is divided by the number of micro steps; gradients
accumulate unreduced (``set_requires_gradient_sync(False)``) and are reduce-scattered
once, in the boundary micro step's backward.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..core.log import get_logger
from ..core.process import one_process_rendezvous
from ..core.protocols import Engine
from ..core.topology import Topology
from ..core.zero_comm import fsdp2_wire_bytes
from ..integrations.fsdp2 import FSDPMesh, fsdp_mesh
from . import fsdp2_settings as settings

__all__ = [
    "FSDP2Engine",
    "FSDP2Settings",
    "clip_full_norm",
    "fsdp2_initialize",
    "fsdp2_mesh",
    "init_process_group",
    "shard",
    "wire_bytes_per_step",
]

log = get_logger(__name__)


def init_process_group(timeout_s: float | None = None) -> None:
    """``torch.distributed`` without DeepSpeed: nccl on CUDA (each rank on its
    ``LOCAL_RANK``'s GPU), gloo on CPU; a process no launcher started is a world of one. A
    group already initialised is kept."""
    if dist.is_initialized():
        return
    one_process_rendezvous()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(backend="nccl" if cuda else "gloo", **kwargs)


def fsdp2_mesh(run: RunConfig) -> FSDPMesh:
    """The run's mesh and topology (``grad_scale`` = sp, set by ``fsdp_mesh``) from its
    ``"sequence_parallel"`` block; data parallel takes the rest of the world."""
    sp = run.sequence_parallel
    options = {k: v for k, v in asdict(sp.options).items() if k != "grad_scale"}
    return fsdp_mesh(None, sp.ulysses_degree, sp.ring_degree, **options)


@dataclass(frozen=True)
class FSDP2Settings:
    """What the engine takes from the config: the ZeRO stage asked for, the batch
    sizes, the clipping norm (0: none), the data-parallel degree and the train dtype."""

    zero_stage: int
    micro_batch: int
    micro_steps: int
    clipping: float
    dp: int
    dtype: str = "float32"

    @classmethod
    def of(cls, run: RunConfig, dp: int) -> FSDP2Settings:
        ds = run.deepspeed
        clip = settings.clipping(run)
        return cls(ds.zero_stage, ds.micro_batch, ds.micro_steps, clip, dp, ds.dtype)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the first ``ModuleList`` named ``layers`` (the reference
    decoder's, a Hugging Face model's ``model.layers``)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    raise ValueError(f"{type(model).__name__} has no ModuleList named 'layers' to shard")


def shard(model: nn.Module, fm: FSDPMesh, *, zero_stage: int, dtype: str) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over ``fm.shard_mesh``; ZeRO-3
    reshards after the forward; ``dtype`` ``"bfloat16"`` computes in bfloat16 and
    reduces in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mesh=fm.shard_mesh, mp_policy=mp, reshard_after_forward=zero_stage == 3)
    for layer in _layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDP2Engine:
    """The DeepSpeed engine's interface over a ``fully_shard``-ed model: ``module``,
    ``device``, the call, ``backward`` (accumulating), ``step`` (clipping, optimizer,
    scheduler and ``zero_grad`` at the boundary), the batch sizes, ``get_lr``, the
    counters and ``save_checkpoint``/``load_checkpoint`` (``torch.distributed.checkpoint``,
    any world size on load)."""

    reshards = True  # training.checkpoint: no world-size check, no portable.pt

    def __init__(self, module: nn.Module, optimizer, lr_scheduler, *, cfg: FSDP2Settings):
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.cfg = cfg
        self.device = next(module.parameters()).device
        self.micro_steps = self.global_steps = self.global_samples = 0
        self.topology: Topology | None = None  # set by fsdp2_initialize

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.micro_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.cfg.micro_batch

    def zero_optimization_stage(self) -> int:
        """The stage the config asked for (its FSDP2 meaning: the module docstring)."""
        return self.cfg.zero_stage

    def fp16_enabled(self) -> bool:
        return False

    @property
    def compute_dtype(self) -> str:
        """The dtype the layers compute in: bfloat16 under ``bf16``, else the parameters'."""
        if self.cfg.dtype == "bfloat16":
            return "bfloat16"
        return str(next(self.module.parameters()).dtype).removeprefix("torch.")

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.cfg.micro_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` over the micro steps; FSDP2 reduces only at the boundary."""
        sync = self.module.set_requires_gradient_sync  # what fully_shard adds to the root
        sync(self.is_gradient_accumulation_boundary())  # type: ignore[operator]
        (loss / self.cfg.micro_steps).backward()

    def step(self) -> None:
        """At the boundary: clip, update, advance the scheduler, zero the gradients."""
        if self.is_gradient_accumulation_boundary():
            if self.cfg.clipping > 0:
                clip_full_norm(list(self.module.parameters()), self.cfg.clipping)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1
            self.global_samples += self.cfg.micro_batch * self.cfg.micro_steps * self.cfg.dp
        self.micro_steps += 1

    def local_gradients(self) -> list[torch.Tensor]:
        """This rank's shard of every reduced gradient (after the boundary's backward)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return [g.to_local() for g in grads]  # type: ignore[attr-defined]

    def _counters(self) -> dict[str, int]:
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
        }

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, **_: Any) -> None:
        """The model, optimizer and scheduler as ``torch.distributed.checkpoint`` shards in
        ``save_dir/tag``, with ``client_state`` and the counters."""
        from ..integrations.dcp_checkpoint import save_sharded

        extra = {"client_state": client_state, **self._counters()}
        folder = Path(save_dir) / tag
        save_sharded(self.module, self.optimizer, folder, scheduler=self.lr_scheduler, extra=extra)

    def load_checkpoint(self, load_dir: str, tag: str, **_: Any) -> tuple[str, dict]:
        """Load ``load_dir/tag`` (written on any number of ranks); ``(path, client_state)``."""
        from ..integrations.dcp_checkpoint import load_sharded

        folder = Path(load_dir) / tag
        extra = load_sharded(self.module, self.optimizer, folder, scheduler=self.lr_scheduler)
        for key in self._counters():
            setattr(self, key, int(extra[key]))
        return str(folder), extra["client_state"]


def clip_full_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip sharded gradients by the norm of the whole gradient, as one process would:
    each shard's norm is combined over the mesh (``full_tensor``) before scaling."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def fsdp2_initialize(run: RunConfig, model: nn.Module, fm: FSDPMesh) -> Engine:
    """Shard ``model`` (built with ``fm.topology``) by the run's ZeRO stage and dtype, and
    build the optimizer and scheduler of its config over the shards."""
    ds = run.deepspeed
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model.to(device)
    shard(model, fm, zero_stage=ds.zero_stage, dtype=ds.dtype)
    if on_meta:  # build_on_meta's model: each rank fills its own shards
        _fill_and_probe(model, run, device)
    assert ds.optimizer is not None  # check_fsdp2 refused a config without one
    optimizer = settings.make_optimizer(ds.optimizer, model.parameters())
    scheduler = settings.make_scheduler(ds.scheduler, optimizer)
    engine = FSDP2Engine(model, optimizer, scheduler, cfg=FSDP2Settings.of(run, fm.dp))
    engine.topology = fm.topology
    topo = fm.topology
    log.info(
        f"FSDP2 engine ready: ZeRO-{ds.zero_stage} as reshard_after_forward="
        f"{ds.zero_stage == 3}, {ds.dtype}, {topo.mode} u{topo.ulysses_degree} "
        f"r{topo.ring_degree} dp{topo.dp_degree}, sharded over {topo.world_size} ranks"
    )
    return engine


def _fill_and_probe(model: nn.Module, run: RunConfig, device: torch.device) -> None:
    """Allocate the shards, read each rank's rows of the checkpoint, then run the
    Hugging Face probe with every FSDP2 module gathered (it calls the inner model and
    compares weights across the sequence ranks: plain tensors, not shards). The probe
    holds a whole copy per rank while it runs, then the shards are restored."""
    from .fsdp2_loading import load_safetensors_sharded

    reshard = run.deepspeed.zero_stage == 3  # as shard() set it
    folder = getattr(run.model, "hf_weights", None)
    assert folder, "build_on_meta builds only a model with hf_weights"
    model.to_empty(device=device)
    n = load_safetensors_sharded(model, folder)
    log.info(f"model.hf_weights: {n} tensors read, each rank its own rows")
    probe: Any = getattr(model, "probe", None)
    if not (getattr(model, "needs_probe", False) and callable(probe)):
        return
    sharded: list[Any] = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    # the root's lazy init first (FSDP2 runs it at the root's first forward): a layer
    # unsharded before it would take itself for a root. No public call does it alone.
    sharded[0]._get_fsdp_state()._lazy_init()
    for m in sharded:  # gathered for the whole probe: it calls modules one by one
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        probe()
    finally:
        for m in sharded:
            m.set_reshard_after_forward(reshard, recurse=False)
            m.reshard()
    log.info("the Hugging Face probe passed on the loaded weights")


def wire_bytes_per_step(engine: FSDP2Engine, params: int) -> int:
    """Bytes this rank sends per step in FSDP2's collectives
    (:func:`~ulysses_cp.core.zero_comm.fsdp2_wire_bytes`): every ``fully_shard`` call,
    the root's too, is given ``reshard_after_forward``, so nothing is kept (``kept_params``
    0); bf16 gathers in bfloat16 and reduces in float32."""
    element = next(engine.module.parameters()).element_size()
    bf16 = engine.cfg.dtype == "bfloat16"
    return fsdp2_wire_bytes(
        reshard_after_forward=engine.cfg.zero_stage == 3,
        params=params,
        param_bytes=2 if bf16 else element,
        reduce_bytes=4 if bf16 else element,
        world=dist.get_world_size(),
        micro_steps=engine.cfg.micro_steps,
    )
