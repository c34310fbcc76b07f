"""``"model": {"compile": true}``: ``torch.compile`` per decoder layer (torchtitan's way).

Each layer of the reference decoder (``Decoder.layers``) or of a Hugging Face model
(``model.model.layers``) is compiled in place (``nn.Module.compile``: parameter names and
checkpoints are unchanged), so the identical layers share one compiled graph and the
embedding, head and loss stay eager. The attention inside is traced: under
``torch.compile`` the Ulysses all-to-all and the cross-rank input check are custom ops
(:mod:`ulysses_cp.core.compiled_comm`, :func:`ulysses_cp.modes.checks.checked_in_graph`),
so a Ulysses layer is one graph with no break. Ring attention's send/recv are not
traceable: in ring and hybrid modes the graph breaks around the ring call, which runs
eagerly (its all-to-alls around it, in hybrid mode, are traced).
"""

from __future__ import annotations

import torch.nn as nn

__all__ = [
    "compile_layers",
]


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer of ``model`` in place (inductor, the default backend);
    returns how many. ``model``: a ``Decoder`` or an ``HFCausalLM``."""
    layers = getattr(model, "decoder_layers", None)
    found = list(layers()) if callable(layers) else list(getattr(model, "layers", []))
    if not found:
        raise ValueError(
            f"model.compile: found no decoder layers in {type(model).__name__} (looked for "
            f"decoder_layers() and .layers); set compile to false for this model"
        )
    for layer in found:
        layer.compile()
    return len(found)
