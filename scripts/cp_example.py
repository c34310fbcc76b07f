"""PyTorch's context-parallel example with one import changed, checked against full attention.

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/cp_example.py

The example of PyTorch's docs (``torch.distributed.tensor.experimental.context_parallel``)
imports ``context_parallel`` from ``ulysses_cp`` instead: q/k/v are leaves that require
grad (which torch 2.13's own version refuses on entering: "cannot resize variables that
require grad"). Device and dtype follow the machine: one CUDA GPU per rank with NCCL and
bfloat16 (``--dist-backend gloo``: ranks may share a GPU), else CPU with gloo and float32.
``--heads``/``--seq``/``--mode``: the mode follows the mesh and the head count (Ulysses
when the heads split over the ranks, else the ring).

Rank 0 prints the output's and the summed gradients' largest error relative to full
attention computed by PyTorch's own SDPA on one rank (in float64 on CPU), and exits 1 when
one is above the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from ulysses_cp import context_parallel, context_parallel_unshard  # the one changed import

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mode", choices=["ulysses", "ring"], default=None)
    ap.add_argument(
        "--dist-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="default: nccl with CUDA, else gloo (gloo lets several ranks share one GPU)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(args.dist_backend or ("nccl" if cuda else "gloo"))
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))

    g = torch.Generator().manual_seed(0)  # the same full q, k, v on every rank
    full = [torch.randn(2, args.heads, args.seq, 64, generator=g) for _ in range(3)]
    qkv = [t.to(device, dtype, copy=True).requires_grad_() for t in full]

    # --- the example, as PyTorch's docs write it ---
    with (
        sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        context_parallel(mesh, buffers=tuple(qkv), buffer_seq_dims=(2, 2, 2), mode=args.mode) as cp,
    ):
        output = F.scaled_dot_product_attention(*qkv, is_causal=True)
    output.float().square().mean().backward()
    # ---

    out = context_parallel_unshard(mesh, [output.detach()], [2])[0]
    grads = [t.grad.float() for t in qkv]
    for grad in grads:  # each rank holds its contribution; the sum is the full gradient
        dist.all_reduce(grad)
    ok = True
    if dist.get_rank() == 0:
        ref = [t.to(dtype).double().requires_grad_() for t in full]  # the same rounded values
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
        idx = torch.arange(args.seq)
        chunks = idx.chunk(2 * world)  # the zigzag shards: chunks i and 2P-1-i on rank i
        shards = [torch.cat([chunks[i], chunks[2 * world - 1 - i]]) for i in range(world)]
        sum(ref_out[:, :, s].float().square().mean() for s in shards).backward()
        tol = TOLERANCE[dtype]
        print(
            f"{cp.calls[0][0]} over {world} ranks on {device}, {dtype}, "
            f"{args.heads} heads, {args.seq} tokens (tolerance {tol:.0e}):"
        )
        for name, got, want in [
            ("output", out, ref_out.detach()),
            *((f"d{n}", g_, r.grad) for n, g_, r in zip("qkv", grads, ref)),
        ]:
            err = float((got.double().cpu() - want).abs().max() / want.abs().max())
            ok &= err <= tol
            print(
                f"  {name:6s} max |error| / max |full| = {err:.1e} {'ok' if err <= tol else 'FAIL'}"
            )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
