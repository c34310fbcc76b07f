"""An FSDP2 run's static memory, collectives and peak per rank (``"engine": "fsdp2"``).

What the planner assumes, as ``torch.distributed.fsdp.fully_shard`` (torch 2.13) runs a
model wrapped layer by layer and then as a whole (the root: embedding, final norm, LM
head), over all ``n = dp * sp`` ranks (the flattened mesh of
``ulysses_cp.integrations.fsdp2``):

- Sharded: parameters, gradients and Adam's two moments, ``ceil(psi / n)`` elements a
  rank, in the master dtype ``M``: float32 when the config trains in bf16 or fp16 (the
  ``MixedPrecisionPolicy`` keeps the sharded parameters in float32, and they are the
  optimizer's parameters: no separate master copy), else the model's own dtype.
- Unsharded, in the compute dtype ``B`` (``param_dtype``): ``reshard_after_forward=True``
  (ZeRO-3 in the config) holds one layer and the next one, prefetched (FSDP2 prefetches
  one layer ahead by default), two layers' worth; ``False`` (ZeRO 0, 1 or 2) keeps every
  layer's from its forward to its backward. The root's stay unsharded from the forward
  to the end of the backward either way (gathered at its forward and at its backward).
- In the backward: a unit's unsharded gradient (``B``) and its copy in the reduce dtype
  ``R`` (float32 under bf16) as the reduce-scatter's input, for the largest unit (a layer
  or the root), beside the sharded gradients. The sharded gradients stay until the next
  step's ``zero_grad``, with gradient accumulation too (FSDP2 reduce-scatters every
  micro batch and adds into them).
- No optimizer offload (DeepSpeed's ``offload_optimizer`` has no meaning here: refused).

The collectives are ``ulysses_cp.core.zero_comm.fsdp2_collectives``: the rule the run logs
and the distributed test checks against what torch sends.
"""

from __future__ import annotations

from ..core.zero_comm import fsdp2_collectives
from .phases import step_phases
from .shapes import ModelShape

__all__ = ["fsdp2_bytes", "fsdp2_dtypes", "fsdp2_peak", "fsdp2_static_bytes", "root_params"]

FP32 = 4


def fsdp2_dtypes(shape: ModelShape) -> tuple[int, int, int]:
    """``(B, M, R)``: bytes of an element unsharded (compute), sharded (master: float32
    under mixed precision, a compute dtype under 4 bytes) and in the reduce-scatter."""
    B = shape.dtype_bytes
    wide = max(B, FP32)
    return B, wide, wide


def root_params(shape: ModelShape) -> int:
    """The root unit's parameters: the embedding, the LM head unless tied, the final norm."""
    return min(shape.params, shape.vocab * shape.dim * (1 if shape.tied_head else 2) + shape.dim)


def fsdp2_static_bytes(
    shape: ModelShape, *, reshard_after_forward: bool, world: int
) -> dict[str, int]:
    """Bytes per rank (module docstring): ``params`` (the unsharded copies in use),
    ``grads`` (sharded, and a unit's unsharded gradient with its reduce-scatter input),
    ``master`` (the sharded parameters) and ``optimizer`` (Adam's moments)."""
    B, M, R = fsdp2_dtypes(shape)
    part = -(-shape.params // max(1, world))
    root = root_params(shape)
    layers = 2 if reshard_after_forward else shape.layers  # in use (and prefetched)
    unit = max(shape.layer_params, root)
    return {
        "params": (root + min(layers, shape.layers) * shape.layer_params) * B,
        "grads": part * M + unit * (B + R),
        "master": part * M,
        "optimizer": 2 * part * M,
    }


def fsdp2_bytes(
    shape: ModelShape, *, reshard_after_forward: bool, world: int, micro_steps: int = 1
) -> dict[str, dict[str, int]]:
    """FSDP2's collectives per step for this model, every unit (the root too) gathered
    again in backward when ``reshard_after_forward`` (as an explicit value on every
    ``fully_shard`` call gives; left at ``None`` the root's are not)."""
    B, _, R = fsdp2_dtypes(shape)
    return fsdp2_collectives(
        params=shape.params,
        param_bytes=B,
        reduce_bytes=R,
        world=world,
        reshard_after_forward=reshard_after_forward,
        micro_steps=micro_steps,
    )


def fsdp2_peak(shape: ModelShape, act: dict, static: dict[str, int], *, tokens: int) -> dict:
    """The step's peak per rank under FSDP2, in :func:`~.phases.deepspeed_peak`'s form:
    everything in ``static`` allocated throughout (the unsharded parameters and a unit's
    gradient at their largest), the activations' moments of :func:`~.phases.step_phases`
    on top, and the optimizer step's float32 temporaries (none counted: torch's fused or
    foreach AdamW on the sharded tensors)."""
    phases = step_phases(shape, act, tokens=tokens, grads=0)
    persistent = sum(static.values())
    return {
        "persistent": persistent,
        "phases": {k: phases[k] for k in ("loss", "backward", "backward_end")},
        "optimizer_step": 0,
        "phase": phases["phase"],
        "peak": persistent + phases["peak"],
    }
