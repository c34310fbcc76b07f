"""Local attention kernels behind one signature (``dispatch``) and their backends:
``math_backend`` (pure PyTorch), ``torch_backend`` (torch's fused kernels) and
``flash_backend`` (flash-attn 2.6-2.8). ``ulysses_cp.kernels`` re-exports ``dispatch``."""

from .dispatch import *  # noqa: F403
from .dispatch import __all__ as __all__
