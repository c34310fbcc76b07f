"""Stand-in for flash-linear-attention 0.5.2 (``tests.support.mixer_standin``): only
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and ``fla.ops.kda.chunk_kda`` (the release
also exports both from the package root; transformers finds them by either path)."""

__version__ = "0.5.2"
