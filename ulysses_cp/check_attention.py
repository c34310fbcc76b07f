"""Run distributed attention on N CPU ranks (gloo) against full float64 attention.

Prints, per mode and layout: max errors of out/dq/dk/dv and the bytes each rank sent,
measured by the counters beside the formula. Writes the same as JSON with --json.

    python -m ulysses_cp.check_attention               # 4 ranks, every mode that fits
    python -m ulysses_cp.check_attention --world 2 --seq 2048 --dtype float64

Also the ``ulysses-cp-check`` console script and ``python scripts/check_attention.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .core.comm import stats as comm_stats
from .core.commands import DefaultsHelp, program_name
from .core.log import configure_logging, get_logger
from .core.options import BACKENDS, Layout
from .core.sharding import gather_sequence, sequence_multiple, shard_sequence
from .core.topology import init_topology
from .kernels.dispatch import local_attention
from .modes.attention import attention
from .plan.comm import forward_comm_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def modes(world: int) -> list[tuple[int, int]]:
    """(ulysses, ring) degrees that use all ranks: Ulysses, ring, and every hybrid split."""
    hybrids = [(u, world // u) for u in range(2, world) if world % u == 0]
    return [(world, 1), (1, world), *hybrids]


def formula_bytes(args, u: int, r: int, nbytes: int) -> list[int]:
    """Per rank, forward: [all-to-all, ring] bytes by the planner's ``forward_comm_bytes``."""
    return list(
        forward_comm_bytes(
            batch=args.batch,
            seq_len=args.seq,
            hq=args.heads,
            hkv=args.kv_heads,
            head_dim=args.head_dim,
            ulysses_degree=u,
            ring_degree=r,
            bytes_per_element=nbytes,
        )
    )


def run_case(args, u: int, r: int, layout: Layout) -> dict:
    topo = init_topology(u, r, layout=layout, backend=args.backend)
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    shape_q = (args.batch, args.seq, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, generator=g, dtype=torch.float64)
    k = torch.randn(shape_kv, generator=g, dtype=torch.float64)
    v = torch.randn(shape_kv, generator=g, dtype=torch.float64)
    dout = torch.randn(shape_q, generator=g, dtype=torch.float64)
    local = [shard_sequence(t, topo).to(dtype).requires_grad_() for t in (q, k, v)]
    comm_stats.reset()
    out = attention(local[0], local[1], local[2], topo, causal=True)
    sent = [comm_stats.total(op, "forward") for op in ("all_to_all", "ring")]
    out.backward(shard_sequence(dout, topo).to(dtype))
    grads = [x.grad for x in local]
    assert all(g is not None for g in grads)
    got = [gather_sequence(t.detach(), topo).double() for t in (out, *grads) if t is not None]
    refs = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = local_attention(refs[0], refs[1], refs[2], backend="math")
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, refs, dout)]
    errs = {n: (a - b).abs().max().item() for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    sent_all = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sent_all, torch.tensor(sent))
    topo.destroy()
    nbytes = torch.tensor([], dtype=dtype).element_size()
    return {
        "mode": topo.mode,
        "ulysses": u,
        "ring": r,
        "layout": layout,
        **errs,
        "bytes_sent_per_rank": [x.tolist() for x in sent_all],
        "bytes_formula": formula_bytes(args, u, r, nbytes),
    }


def worker(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    configure_logging()  # a spawned process: rank 0's lines on stdout
    log = get_logger()
    try:
        rows = []
        log.info(
            f"{'mode':8} {'u':>2} {'r':>2} {'layout':10} {'max|out|':>9} {'max|dq|':>9} "
            f"{'max|dk|':>9} {'max|dv|':>9} {'a2a B/rank':>11} {'formula':>11} "
            f"{'ring B/rank':>11} {'formula':>11}"
        )
        for u, r in modes(args.world):
            layouts: tuple[Layout, ...] = ("zigzag", "contiguous")
            for layout in layouts:
                row = run_case(args, u, r, layout)
                rows.append(row)
                (a2a, ring), (fa, fr) = row["bytes_sent_per_rank"][0], row["bytes_formula"]
                log.info(
                    f"{row['mode']:8} {u:>2} {r:>2} {layout:10} {row['out']:9.2e} "
                    f"{row['dq']:9.2e} {row['dk']:9.2e} {row['dv']:9.2e} "
                    f"{a2a:>11} {fa:>11} {ring:>11} {fr:>11}"
                )
        ok = all(
            sent == row["bytes_formula"] for row in rows for sent in row["bytes_sent_per_rank"]
        )
        log.info(f"measured bytes equal the formulas on every rank: {ok}")
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        if not ok:
            raise SystemExit("measured bytes differ from the formulas")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog=program_name("ulysses_cp.check_attention"),
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--world", type=int, default=4, help="number of CPU ranks")
    p.add_argument("--seq", type=int, default=1024, help="full sequence length")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64, help="dimension per head")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="inputs' dtype")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto", help="local kernel")
    p.add_argument("--json", help="write the results to this JSON file")
    args = p.parse_args(argv)
    m = sequence_multiple(args.world, "zigzag")
    if args.seq % m:
        p.error(f"--seq {args.seq} must be a multiple of {m} (2 x --world) for zigzag")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.world)


if __name__ == "__main__":
    main()
