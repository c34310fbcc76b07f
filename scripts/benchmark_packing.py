"""Cost of packed rows (``cu_seqlens``) against the unpacked path, per mode, and the
padding that the row-wise packing saves.

On 4 spawned ranks (gloo on CPU, NCCL with a GPU per rank, gloo when ranks share a GPU;
``scripts/benchlib.py``) it times causal attention forward+backward on one row of N tokens:
unpacked, and packed as 1, 8 and 64 equal documents, interleaved, medians over repeats.
``x unpacked`` is the time ratio to the unpacked row measured in the same run; ``work`` is
the fraction of the causal score matrix a packing leaves to compute (sum L_d^2 / N^2), the
speed-up an ideal varlen kernel would show.

Padding: documents drawn from a log-normal length distribution (median ``--doc-median``
tokens, sigma ``--doc-sigma``; web text and SFT data have such a long tail) are packed into
rows of N tokens twice, by ``core.varlen.pack_row``: ``document`` packing pads every
document to ``sequence_multiple(P, "zigzag")`` (what the document-wise layout needs),
``row`` packing pads nothing (the row-wise layout; the last document is cut to fill the
row). The padding fraction is counted for P = 4 .. 256 (arithmetic, no processes). At
P = 4 the same documents are timed in both packings in every mode (interleaved, medians):
the document-wise rows of N tokens, and their documents unpadded in the row-wise packing
(a row of N minus the padding, rounded up to the multiple). ``real tok/s`` counts only real
tokens, the training throughput that padding takes away; ``x document`` is its ratio to the
document-wise packing measured in the same run.

    python scripts/benchmark_packing.py --quick     # about 2 min on 2 cores
    python scripts/benchmark_packing.py             # the docs/benchmarks/packing.md tables
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import barrier, run_ranks, sync

import ulysses_cp as ucp
from ulysses_cp.core.varlen import pack_row

HQ, HKV, D = 8, 4, 64
MODES = {"ulysses": (4, 1), "ring_zigzag": (1, 4), "hybrid_zigzag": (2, 2)}
PACKINGS = ("document", "row")
WORLD = 4


def doc_lengths(seed: int, median: float, sigma: float):
    """An endless stream of document lengths, log-normal, at least 1 token."""
    g = torch.Generator().manual_seed(seed)
    while True:
        draw = torch.randn(1024, generator=g, dtype=torch.float64) * sigma
        yield from (max(1, round(median * float(x))) for x in draw.exp())


def packed_rows(N: int, multiple: int, n_rows: int, lengths, lengths_too: bool = False):
    """``n_rows`` rows of N tokens from the ``lengths`` stream, each document padded to
    ``multiple`` (``core.varlen.pack_row``): ``[(cu_seqlens, real tokens)]``, or with
    ``lengths_too`` ``[(cu_seqlens, [real length of each document])]``."""
    pending = [next(lengths)]
    rows = [_one_row(N, multiple, pending, lengths) for _ in range(n_rows)]
    return rows if lengths_too else [(cu, sum(lens)) for cu, lens in rows]


def _one_row(N: int, multiple: int, pending: list[int], lengths) -> tuple[torch.Tensor, list]:
    real: list[int] = []

    def take(n: int):
        real.append(n)
        t = torch.zeros(n, dtype=torch.long)
        return t, t

    def draw(room: int):
        n = pending[0]
        if n + (-n % multiple) > room:
            return None
        pending[0] = next(lengths)
        return take(n)

    def last(room: int):  # the next document cut to fill the row
        pending[0] = next(lengths)
        return take(room)

    return pack_row(N, multiple, draw, last)["cu_seqlens"], real


def padding_table(args) -> list[dict]:
    """Padding of both packings for P = 4 .. 256 (zigzag), the same document stream."""
    out = []
    for N in args.seqs:
        for P in (4, 16, 64, 256):
            m = ucp.sequence_multiple(P, "zigzag")
            if N % m:
                continue
            for packing in PACKINGS:
                stream = doc_lengths(args.seed, args.doc_median, args.doc_sigma)
                rows = packed_rows(N, m if packing == "document" else 1, args.rows, stream)
                real = sum(n for _, n in rows)
                out.append(
                    {
                        "N": N,
                        "P": P,
                        "packing": packing,
                        "rows": len(rows),
                        "padding_tokens": len(rows) * N - real,
                        "padding_fraction": 1 - real / (len(rows) * N),
                        "docs_per_row": sum(len(cu) - 1 for cu, _ in rows) / len(rows),
                    }
                )
    return out


def cases(N: int) -> dict[str, torch.Tensor | None]:
    out = {"unpacked": None}
    for n_docs in (1, 8, 64):
        out[f"packed_{n_docs}"] = torch.arange(0, N + 1, N // n_docs, dtype=torch.int32)
    return out


def work_fraction(cu: torch.Tensor | None, N: int) -> float:
    if cu is None:
        return 1.0
    lens = (cu[1:] - cu[:-1]).double()
    return float((lens * (lens + 1)).sum() / (N * (N + 1)))


def _step(q, k, v, dout, topo, backend, cu) -> float:
    """Seconds of one forward+backward of every rank (barriers around it)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    barrier(q.device)
    t0 = time.perf_counter()
    ucp.attention(q, k, v, topo, backend=backend, cu_seqlens=cu).backward(dout)
    sync(q.device)
    barrier(q.device)
    return time.perf_counter() - t0


def padding_worker(topos, args, device) -> list[dict]:
    """The same documents timed in both packings (P = 4) in every mode, interleaved, medians
    per row: document-wise rows of N tokens (each document padded to the layout's multiple)
    against their documents unpadded in the row-wise packing (a row of N minus the padding,
    rounded up to the multiple)."""
    out = []
    m = ucp.sequence_multiple(WORLD, "zigzag")
    for N in args.seqs:
        stream = doc_lengths(args.seed, args.doc_median, args.doc_sigma)
        docs = packed_rows(N, m, args.timed_rows, stream, lengths_too=True)
        cus = {"document": [], "row": []}
        for cu, lens in docs:
            cus["document"].append(cu)
            row = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            row[-1] += -int(row[-1]) % m  # the row's end padded (joins the last document)
            cus["row"].append(row)
        g = torch.Generator().manual_seed(0)
        inputs = {}
        for p in PACKINGS:
            for i, cu in enumerate(cus[p]):
                s_l = int(cu[-1]) // WORLD
                shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
                qkvd = [torch.randn(s, generator=g).to(device) for s in shapes]
                inputs[(p, i)] = (*qkvd, cu.to(device))
        times = {(mode, p, i): [] for mode in MODES for p, i in inputs}
        for rep in range(args.warmup + args.repeats):
            for mode, p, i in times:  # interleaved: the same noise for both packings
                topo = topos[mode].with_options(packing=p)
                q, k, v, dout, cu = inputs[(p, i)]
                t = _step(q, k, v, dout, topo, args.backend, cu)
                if rep >= args.warmup:
                    times[(mode, p, i)].append(t)
        real = sum(sum(lens) for _, lens in docs)
        for mode in MODES:
            for p in PACKINGS:
                n = len(cus[p])
                t = sum(statistics.median(times[(mode, p, i)]) for i in range(n))
                tokens = sum(int(cu[-1]) for cu in cus[p])
                work = sum(work_fraction(cu, int(cu[-1])) * int(cu[-1]) ** 2 for cu in cus[p])
                out.append(
                    {
                        "mode": mode,
                        "N": N,
                        "packing": p,
                        "rows": n,
                        "row_tokens": tokens,
                        "real_tokens": real,
                        "padding_fraction": 1 - real / tokens,
                        "time_per_row_s": t / n,
                        "real_tokens_per_s": real / t,
                        "causal_work": work,
                    }
                )
    return out


def worker(rank, world, args, device):
    topos = {m: ucp.init_topology(u, r) for m, (u, r) in MODES.items()}
    if args.padding_only:
        return {"rows": [], "timed": padding_worker(topos, args, device)}
    rows = []
    for N in args.seqs:
        g = torch.Generator().manual_seed(0)
        s_l = N // world
        shapes = [(1, s_l, HQ, D), (1, s_l, HKV, D), (1, s_l, HKV, D), (1, s_l, HQ, D)]
        inputs = [torch.randn(s, generator=g).to(device) for s in shapes]
        times = {(m, c): [] for m in MODES for c in cases(N)}
        for rep in range(args.warmup + args.repeats):
            for (mode, case), acc in times.items():  # interleaved: same noise for all
                cu = cases(N)[case]
                q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs))
                barrier(device)
                t0 = time.perf_counter()
                ucp.attention(q, k, v, topos[mode], backend=args.backend, cu_seqlens=cu).backward(
                    dout
                )
                sync(device)
                barrier(device)
                if rep >= args.warmup:
                    acc.append(time.perf_counter() - t0)
        for mode in MODES:
            base = statistics.median(times[(mode, "unpacked")])
            for case, cu in cases(N).items():
                t = statistics.median(times[(mode, case)])
                rows.append(
                    {
                        "mode": mode,
                        "N": N,
                        "case": case,
                        "time_s": t,
                        "ratio_to_unpacked": t / base,
                        "work_fraction": work_fraction(cu, N),
                    }
                )
    return {"rows": rows, "timed": padding_worker(topos, args, device)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sweep for CI (~2 min)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", default="torch", choices=list(ucp.BACKENDS))
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    p.add_argument("--doc-median", type=float, default=400.0, help="median document length")
    p.add_argument("--doc-sigma", type=float, default=1.2, help="log-normal sigma of lengths")
    p.add_argument("--rows", type=int, default=256, help="rows counted for the padding table")
    p.add_argument("--timed-rows", type=int, default=2, help="rows timed per packing and mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padding-only", action="store_true", help="skip the unpacked-cost table")
    args = p.parse_args()
    if args.quick:
        args.seqs, args.repeats, args.rows, args.timed_rows = [1024], 2, 64, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    got = run_ranks(worker, WORLD, args)
    rows, timed, padding = got["rows"], got["timed"], padding_table(args)
    if rows:
        print(f"{'mode':<15}{'N':>7}  {'case':<11}{'ms':>9}{'x unpacked':>12}{'work':>7}")
    for r in rows:
        print(
            f"{r['mode']:<15}{r['N']:>7}  {r['case']:<11}{r['time_s'] * 1e3:>9.1f}"
            f"{r['ratio_to_unpacked']:>12.2f}{r['work_fraction']:>7.3f}"
        )
    print(
        f"\npadding, {args.rows} rows, log-normal documents (median {args.doc_median:g}, "
        f"sigma {args.doc_sigma:g}), zigzag"
    )
    print(f"{'N':>7}{'P':>6}  {'packing':<10}{'padding':>10}{'fraction':>10}{'docs/row':>10}")
    for r in padding:
        print(
            f"{r['N']:>7}{r['P']:>6}  {r['packing']:<10}{r['padding_tokens']:>10}"
            f"{r['padding_fraction']:>10.4f}{r['docs_per_row']:>10.1f}"
        )
    print(
        f"\nthe same documents timed at P = {WORLD} in both packings: {args.timed_rows} rows, "
        f"medians of {args.repeats}"
    )
    print(
        f"{'mode':<15}{'N':>7}  {'packing':<10}{'tokens':>8}{'ms/row':>9}{'padding':>9}"
        f"{'real tok/s':>12}{'x document':>12}"
    )
    base = {(r["mode"], r["N"]): r for r in timed if r["packing"] == "document"}
    for r in timed:
        r["tokens_per_s_to_document"] = (
            r["real_tokens_per_s"] / base[(r["mode"], r["N"])]["real_tokens_per_s"]
        )
        print(
            f"{r['mode']:<15}{r['N']:>7}  {r['packing']:<10}{r['row_tokens']:>8}"
            f"{r['time_per_row_s'] * 1e3:>9.1f}{r['padding_fraction']:>9.4f}"
            f"{r['real_tokens_per_s']:>12.0f}{r['tokens_per_s_to_document']:>12.3f}"
        )
    result = {"args": vars(args), "rows": rows, "padding": padding, "timed": timed}
    (out / "benchmark_packing.json").write_text(json.dumps(result))
    print(f"json: {out / 'benchmark_packing.json'}")


if __name__ == "__main__":
    main()
