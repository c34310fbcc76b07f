"""Stand-in for mamba-ssm 2.3.2.post1 (``tests.support.mixer_standin``): only
``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (also at the root, as the
release imports it there) and ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``."""

__version__ = "2.3.2.post1"

from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

__all__ = ["selective_scan_fn"]
