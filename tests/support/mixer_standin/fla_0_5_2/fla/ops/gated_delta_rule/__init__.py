from .chunk import chunk_gated_delta_rule, chunk_gdn

__all__ = ["chunk_gated_delta_rule", "chunk_gdn"]
