"""What the torch backend's CPU flash kernel allocates: its backward's peak is its three
gradients and its scratch, with the output gradient taken in the caller's
``(b, s, h, d)`` layout (a head-major copy of it made the kernel copy it once more:
2 tensors more at the peak, measured)."""

import sys
from pathlib import Path

import torch

from ulysses_cp.kernels import torch_backend
from ulysses_cp.kernels.spec import Scores

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from profiling import peak_memory


def test_cpu_backward_peak_is_its_gradients():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2048, 4, 32, generator=g) for _ in range(4))
    how = Scores(True, 32**-0.5)
    out, lse = torch_backend.forward(q, k, v, how)
    one = q.numel() * q.element_size()  # 1 MiB
    peak = peak_memory(lambda: torch_backend.backward(dout, q, k, v, out, lse, how))
    # dq, dk, dv (3 MiB) and the kernel's scratch (about 1 MiB here): 4.03 MiB measured;
    # with a head-major copy of dO 6.03 MiB
    assert peak <= 4.5 * one, peak / one


def test_ring_merge_in_place_makes_no_copy_of_the_output():
    """The ring's forward merges each block into its fp32 accumulators in place: what the
    merge allocates is a few (b, h, s) rows, never an (b, s, h, d) temporary (it made two
    before); the result equals the out-of-place :func:`merge`."""
    from ulysses_cp.modes.ring import merge, merge_

    g = torch.Generator().manual_seed(0)
    out, out_b = (torch.randn(1, 512, 4, 64, generator=g) for _ in range(2))
    lse, lse_b = (torch.randn(1, 4, 512, generator=g) for _ in range(2))
    want_o, want_l = merge(out, lse, out_b, lse_b)
    acc, acc_l = out.clone(), lse.clone()
    peak = peak_memory(
        lambda: merge_(acc[:, :256], acc_l[:, :, :256], out_b[:, :256], lse_b[:, :, :256]),
        scratch=False,
    )
    merge_(acc[:, 256:], acc_l[:, :, 256:], out_b[:, 256:], lse_b[:, :, 256:])
    assert peak < out.numel() * out.element_size() // 8, peak
    torch.testing.assert_close(acc, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_l, want_l, rtol=1e-6, atol=1e-6)
