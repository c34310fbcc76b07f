"""Host (CPU) memory per rank: what offloading puts there during training, and the load.

The GPU plan (:mod:`.memory`) moves some bytes off the device; they land here. Per rank,
with ``part = ceil(psi / n)`` parameters in the rank's ZeRO partition (``n``: all ranks):

- ``optimizer`` (``offload_optimizer``, as DeepSpeed 0.19 allocates it, measured by
  ``tests/unit/test_plan_host.py``): the fp32 master partition and its fp32 gradient (4 + 4
  bytes per element), Adam's two fp32 moments (8); ZeRO-3 also keeps its flat gradient
  partition buffer in the gradient-accumulation dtype (the model's: ``B``) on the host,
  16 + B bytes per element in all;
- ``activations`` (``offload_activations`` with checkpointing): the input of every
  offloaded decoder layer of the micro-batch (all of them, or the first ``n``),
  ``offloaded_layers * dim * B`` per token the rank holds;
- ``load``: the peak while the model is built and its weights read, before training.
  Partitioned (ZeRO-3 Hugging Face models, ``training/loading.py``): the rank's slice
  ``psi * B / n`` plus the largest piece held whole meanwhile: the largest safetensors
  shard file read (``hf_weights``) or the largest module initialized in full (random
  init). Otherwise every rank builds the whole model, ``psi * B``, plus the same piece.
  ``scripts/benchmark_loading.py`` measures both (``docs/benchmarks/loading.md``).

``peak`` is the larger of the load and the training step's host bytes (the load ends
before the optimizer exists). Pinned buffers DeepSpeed keeps for the copies, the Python
process itself, data loading and the allocator's slack are not counted: they are about
the same with and without offload.
"""

from __future__ import annotations

from .shapes import ModelShape

__all__ = ["host_bytes"]

FP32 = 4


def host_bytes(
    shape: ModelShape,
    *,
    zero_stage: int,
    world: int,
    tokens: int,
    offload_optimizer: bool = False,
    partitioned_load: bool = False,
) -> dict[str, int]:
    """Host bytes per rank: ``optimizer``, ``activations``, ``training`` (their sum),
    ``load`` and ``peak``. ``tokens``: tokens this rank holds in one micro-batch. The
    piece held whole while loading: ``shape.weights_file_bytes`` (the largest shard file)
    when known, else the largest module (embedding or a layer)."""
    psi, B, n = shape.params, shape.dtype_bytes, max(1, world)
    part = psi if zero_stage == 0 else -(-psi // n)
    optimizer = 0
    if offload_optimizer:
        optimizer = part * (4 * FP32 + (B if zero_stage == 3 else 0))
    activations = shape.offloaded_layers * shape.dim * B * tokens
    piece = shape.weights_file_bytes or max(shape.layer_params, shape.vocab * shape.dim) * B
    built = -(-psi * B // n) if partitioned_load else psi * B
    load = built + piece
    training = optimizer + activations
    return {
        "optimizer": optimizer,
        "activations": activations,
        "training": training,
        "load": load,
        "peak": max(load, training),
    }
