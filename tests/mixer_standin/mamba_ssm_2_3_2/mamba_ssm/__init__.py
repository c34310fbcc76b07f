"""Stand-in for mamba-ssm 2.3.2.post1 (``tests.mixer_standin``): only
``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``."""

__version__ = "2.3.2.post1"
