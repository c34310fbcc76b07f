"""``ucp.fsdp_mesh`` without processes: it says how to start, and keeps the gradient
scale its own (tests/distributed/test_fsdp2.py runs it on 4 ranks)."""

from __future__ import annotations

import pytest

import ulysses_cp as ucp


def test_without_torch_distributed_it_says_how_to_start():
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        ucp.fsdp_mesh(ulysses=2)
    with pytest.raises(ValueError, match="fsdp_mesh sets grad_scale itself"):
        ucp.fsdp_mesh(ulysses=2, grad_scale=2.0)
