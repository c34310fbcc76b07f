"""Stand-in for flash-linear-attention 0.5.2 (``tests.mixer_standin``): only
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``."""

__version__ = "0.5.2"
