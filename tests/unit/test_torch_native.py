"""ulysses_cp.context_parallel: PyTorch's experimental context_parallel call, our modes.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_torch_native.py.
"""

from __future__ import annotations

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

import ulysses_cp as ucp
from ulysses_cp.integrations import torch_native


def test_sdpa_kernel_maps_to_our_backends():
    assert torch_native.sdpa_backend("cpu") == "auto"
    assert torch_native.sdpa_backend("cpu", default="math") == "math"
    for kernels, want in [
        (SDPBackend.FLASH_ATTENTION, "auto"),
        (SDPBackend.EFFICIENT_ATTENTION, "torch"),
        (SDPBackend.CUDNN_ATTENTION, "torch"),
        (SDPBackend.MATH, "math"),
        ([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], "auto"),
        ([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION], "torch"),
    ]:
        with sdpa_kernel(kernels):
            assert torch_native.sdpa_backend("cpu") == want, kernels
    assert torch_native.sdpa_backend("cpu") == "auto"  # sdpa_kernel restored the flags


def test_rotate_methods():
    with pytest.raises(NotImplementedError, match="'p2p'"):
        ucp.set_rotate_method("p2p")
