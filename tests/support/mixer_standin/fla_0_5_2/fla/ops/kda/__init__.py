from .chunk import chunk_kda

__all__ = ["chunk_kda"]
