"""Which phase of a training step holds its memory peak, and how high it is.

:func:`~.memory.activation_bytes` gives the activations at their largest and the parts
they are made of; the parameters' gradients are another share that grows while the
activations shrink. Three moments of one micro step (bytes per rank, above what stays
allocated the whole time):

- ``loss``: the end of the forward, every layer's kept tensors (or checkpointed inputs),
  the final norm's and the loss's working set (activation_bytes' total when the loss
  holds it);
- ``backward``: a layer's backward with every layer's kept tensors still alive (the last
  layer is the first to run), the gradient into it, the LM head's weight gradient made
  by then, and the layer's backward at its largest (its recomputed forward, its own
  gradients);
- ``backward_end``: the first layer's backward at its largest with every gradient but
  the embedding's made, or after it every gradient (and a tied embedding's own
  gradient before it is added to the head's).

Between them the bytes move linearly (a layer's kept tensors go, its gradients come), so
the peak is the largest of the three. ``grads``: the gradient bytes made and released
inside the step, the model's own ``.grad`` tensors of one step (set to None before it),
as a plain PyTorch step or the GPU comparison (``scripts/gpu_model.py``) runs it; checked
against the live bytes of bf16 steps on CPU by ``scripts/plan_phases.py`` (docs/planner.md).
Under DeepSpeed the planner keeps the gradients with the static bytes (alive at every
moment): ZeRO-3's partition and reduce buffer are, and for ZeRO 0-2 the optimizer step
adds working memory of its own beside them (``plan_phases.py``'s ``zero1`` column), which
this model does not count.
"""

from __future__ import annotations

from .shapes import ModelShape

__all__ = ["step_phases"]


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
        "loss": act["total"],
        "backward": act["layers"] + act["after_top"] + head + act["in_layers"],
        "backward_end": max(
            grads - later + into + act["in_layers"],
            grads + into + (head if shape.tied_head else 0),
        ),
    }
    phase = max(phases, key=lambda k: phases[k])
    return {**phases, "peak": phases[phase], "phase": phase}
