"""Which phase of a training step holds its memory peak, and how high it is.

:func:`~.memory.activation_bytes` gives the activations at their largest and the parts
they are made of; the parameters' gradients are another share that grows while the
activations shrink. Three moments of one micro step (bytes per rank, above what stays
allocated the whole time):

- ``loss``: the end of the forward, every layer's kept tensors (or checkpointed inputs),
  the final norm's and the loss's working set;
- ``backward``: a layer's backward with every layer's kept tensors still alive (the last
  layer is the first to run), the gradient into it, the LM head's weight gradient made
  by then, and the layer's backward at its largest (its recomputed forward, its own
  gradients);
- ``backward_end``: the first layer's backward at its largest with every gradient but
  the embedding's made, or after it every gradient (and a tied embedding's own
  gradient before it is added to the head's).

Between them the bytes move linearly (a layer's kept tensors go, its gradients come), so
the peak is the largest of the three. ``grads``: the gradient bytes made and released
inside the step: the model's own ``.grad`` tensors of one step (set to None before it),
as a plain PyTorch step or the GPU comparison (``scripts/gpu_model.py``) runs it.

Under DeepSpeed (:func:`deepspeed_peak`), ZeRO 0-2 without gradient accumulation: the
parameters, the fp32 master copy and Adam's moments stay allocated; the bf16 gradients
come in the backward with ZeRO's copy of them for the reduction (ZeRO 0/1 a flat one of
all of them, ZeRO-2 its partition) and, for ZeRO-1/2, its reduce bucket
(``reduce_bucket_size`` elements, 1 GB in bf16 by default), and are released by the
optimizer step, which then makes its fp32 gradient partition (plus the optimizer's own
temporaries: none for DeepSpeed's FusedAdam on a GPU, two fp32 tensors the partition's
size for torch's Adam).
ZeRO-3 keeps its gradient partition and reduce buffer, and gradients accumulated over
micro steps stay from one micro step to the next: then the gradients are alive at every
moment, with the static bytes. All measured on CPU against the live bytes of bf16 steps
(``scripts/plan_phases.py``, docs/benchmarks/planner.md).
"""

from __future__ import annotations

from .shapes import ModelShape

__all__ = ["PHASE_NAMES", "deepspeed_peak", "step_phases"]

FP32 = 4
# the moments of a step, as the planner says where its peak falls
PHASE_NAMES = {
    "loss": "the loss (the end of the forward)",
    "backward": "the layers' backward",
    "backward_end": "the end of the backward (every gradient made)",
    "optimizer_step": "the optimizer step",
}


def step_phases(shape: ModelShape, act: dict, *, tokens: int, grads: int) -> dict:
    """The three moments' bytes (module docstring), ``peak`` and ``phase`` (the moment that
    holds it). ``act``: :func:`~.memory.activation_bytes`' result for this run; ``tokens``:
    the tokens this rank holds in the micro batch; ``grads``: the gradient bytes made and
    released inside the step (0 where they stay allocated)."""
    B, D = shape.dtype_bytes, shape.dim
    head = shape.vocab * D * B if grads else 0  # the LM head's weight gradient
    into = tokens * D * B  # the gradient flowing into a layer
    # the first layer's backward runs before the embedding's gradient exists (an untied
    # embedding's is its own tensor; the layer's own gradients are made inside it); after
    # it, the embedding's backward makes that gradient (tied: a new tensor, then added)
    later = 0 if shape.tied_head else head
    phases = {
        "loss": act["layers"] + act["at_loss"],
        "backward": act["layers"] + act["after_top"] + head + act["in_layers"],
        "backward_end": max(
            grads - later + into + act["in_layers"],
            grads + into + (head if shape.tied_head else 0),
        ),
    }
    phase = max(phases, key=lambda k: phases[k])
    return {**phases, "peak": phases[phase], "phase": phase}


def deepspeed_peak(
    shape: ModelShape,
    act: dict,
    static: dict[str, int],
    *,
    zero: dict[str, int],
    tokens: int,
    optimizer_temp_bytes: int = 0,
) -> dict:
    """The step's peak per rank under DeepSpeed: ``persistent`` (allocated the whole
    step), the backward's :func:`step_phases`, ``optimizer_step`` and ``peak``/``phase``.
    ``static``: :func:`~.memory.static_bytes`; ``zero``: ``stage``, ``world``,
    ``micro_steps``, ``offload_optimizer`` (0/1); ``optimizer_temp_bytes``: the
    optimizer's temporaries per element of the rank's partition (module docstring)."""
    stage, world = zero["stage"], max(1, zero["world"])
    grads = static["grads"]
    transient = stage < 3 and zero["micro_steps"] == 1
    persistent = sum(static.values()) - (grads if transient else 0)
    copy = (grads if stage < 2 else -(-grads // world)) if transient else 0
    if transient and stage > 0:  # ZeRO-1/2's reduce bucket, made in the backward
        copy += zero.get("bucket", 0)
    phases = step_phases(shape, act, tokens=tokens, grads=grads + copy if transient else 0)
    part = shape.params if stage == 0 else -(-shape.params // world)
    step = 0 if zero["offload_optimizer"] else part * (FP32 + optimizer_temp_bytes)
    phase = "optimizer_step" if step > phases["peak"] else phases["phase"]
    return {
        "persistent": persistent,
        "phases": {**{k: phases[k] for k in ("loss", "backward", "backward_end")}},
        "optimizer_step": step,
        "phase": phase,
        "peak": persistent + max(step, phases["peak"]),
    }
