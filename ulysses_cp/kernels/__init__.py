"""Local attention kernels behind one signature (``dispatch``) and their backends:
``math_backend`` (pure PyTorch), ``torch_backend`` (torch's fused kernels) and
``flash_backend`` (flash-attn 2.6-2.8)."""

from .dispatch import (
    BACKENDS,
    Backend,
    Kernel,
    SavedAttention,
    attn_backward,
    attn_forward,
    default_scale,
    flash_attn_unusable,
    local_attention,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Kernel",
    "SavedAttention",
    "attn_backward",
    "attn_forward",
    "default_scale",
    "flash_attn_unusable",
    "local_attention",
    "resolve_backend",
]
