"""Which decoder layers keep their checkpointed input on CPU: the one rule that the run
(reference decoder, Hugging Face models) and the planner share.

``"model": {"activation_checkpointing": true, "offload_activations": ...}``: ``true``
offloads the input of every decoder layer, ``false`` (or ``0``) none, and an integer ``n``
the inputs of the first ``n`` layers; the last layers keep theirs on the device, where the
backward needs them first. A partial count is for a host that cannot take them all: the
planner (``python -m ulysses_cp.plan``) says how many fit.
"""

from __future__ import annotations

__all__ = ["OffloadSetting", "check_offload", "offloaded_layers"]

OffloadSetting = bool | int


def check_offload(setting: OffloadSetting, checkpointing: bool) -> None:
    """``ValueError`` for a negative count, or offload without checkpointing."""
    if not isinstance(setting, bool) and setting < 0:
        raise ValueError(
            f"model.offload_activations must be true, false or a number of layers >= 0, "
            f"got {setting}"
        )
    if setting and not checkpointing:
        raise ValueError(
            "model.offload_activations moves the checkpointed layer inputs to CPU: it needs "
            "model.activation_checkpointing: true"
        )


def offloaded_layers(setting: OffloadSetting, layers: int) -> int:
    """How many of the first ``layers`` decoder layers offload their input; a count above
    ``layers`` is refused naming both."""
    if isinstance(setting, bool):
        return layers if setting else 0
    if not 0 <= setting <= layers:
        raise ValueError(
            f"model.offload_activations: {setting} layers asked for, the model has {layers} "
            f"decoder layers; use at most {layers} (or true for all)"
        )
    return setting
