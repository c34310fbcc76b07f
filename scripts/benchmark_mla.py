"""MLA under Ulysses: the plain exchange (k and v expanded per head, then the all-to-all)
against a latent exchange (all-gather the compressed latent, expand this rank's heads
locally), bytes sent and peak memory per rank, measured, then at real sizes.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, LongCat-Flash) computes per
token a latent ``c`` of ``kv_lora_rank`` numbers and one RoPE key ``k_pe`` of
``qk_rope_head_dim``; ``kv_b_proj`` expands ``c`` to every head's k (``qk_nope_head_dim``)
and v (``v_head_dim``). The plain exchange (what ``ucp.attention`` does for a model that
expands first) moves q, k, v and the output per head; the latent one moves q and the
output per head and the latent once per token, so every rank expands its own heads for the
whole sequence (the same FLOPs as expanding every head for its own tokens).

1. Measured (CPU, float64, gloo): one MLA attention (DeepSeek-V3's proportions, widths
   / 16) on ``--world`` ranks, forward and backward both ways; the latent output must equal
   the plain one, the bytes each rank sends must equal the formulas, and the peak is the
   live bytes of every tensor the step creates (``scripts/profiling.py``).
2. At real sizes, from the formulas step 1 checked: forward bytes per rank and layer, and
   what each keeps for the backward, for transformers' default configs.

    python scripts/benchmark_mla.py --quick       # 256 tokens, a few seconds here
    python scripts/benchmark_mla.py                # docs/benchmarks/mla.md (about 10 s here)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import parse_args, run_ranks
from profiling import peak_memory

import ulysses_cp as ucp
from ulysses_cp.core.comm import stats
from ulysses_cp.kernels.dispatch import local_attention

# DeepSeek-V3's attention at 1/16 of its widths (128 heads -> 8): q/k 8 + 4, v 8, latent 32
TINY = dict(hidden=64, hq=8, dn=8, dr=4, dv=8, r=32)
REAL = ["DeepseekV3Config", "LongcatFlashConfig", "MiniCPM3Config", "Glm4MoeLiteConfig"]
LATENT = "mla_latent"  # the latent exchange's bytes in ucp.comm_stats


def _count(x: torch.Tensor, copies: float) -> None:
    """This rank's forward bytes of the latent exchange, counted as ``mla_latent``."""
    stats.add(LATENT, "forward", int(x.numel() * x.element_size() * copies))


def bytes_forward(w: dict, N: int, P: int, B: int, b: int = 1) -> tuple[int, int]:
    """Per rank and layer, forward (the backward moves the same), for ``b`` rows of ``N``
    tokens: ``(plain, latent)``.
    Plain: q, k, v out and the output back, ``(N/P) * 2 hq * (d + dv) * (P-1)/P * B``
    (hkv = hq: MLA expands every head). Latent: q out and the output back, and this rank's
    latent and RoPE key to each other rank, ``(N/P) * (r + dr) * (P-1) * B``."""
    n, hq, d, dv = b * N // P, w["hq"], w["dn"] + w["dr"], w["dv"]
    per_head = n * hq * (d + dv) * (P - 1) // P * B
    return 2 * per_head, per_head + n * (w["r"] + w["dr"]) * (P - 1) * B


def kept(w: dict, N: int, P: int, B: int) -> tuple[int, int]:
    """What each keeps for the backward beyond its own shard: plain, the head-sharded k and
    v (``N * hq/P * (d + dv)``); latent, the same k and v expanded here, and the gathered
    latent (``N * (r + dr)``)."""
    kv = N * w["hq"] // P * (w["dn"] + w["dr"] + w["dv"]) * B
    return kv, kv + N * (w["r"] + w["dr"]) * B


class _Gather(torch.autograd.Function):
    """All-gather along the sequence; backward: each rank's share of every gradient back to
    its owner and summed (an all-to-all: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        _count(x, len(parts) - 1)  # to each other rank
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        P = dist.get_world_size()
        send = torch.stack(g.chunk(P, dim=1)).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send)
        return got.sum(0)


def _weights(w: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hq, D = w["hq"], w["hidden"]

    def rand(*shape):
        return (
            torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5
        ).requires_grad_()

    return dict(
        q=rand(D, hq * (w["dn"] + w["dr"])),
        kv_a=rand(D, w["r"] + w["dr"]),
        kv_b=rand(w["r"], hq * (w["dn"] + w["dv"])),
    )


def _to_heads(x: torch.Tensor, P: int) -> torch.Tensor:
    """(b, n, h, e) sequence-sharded -> (b, n P, h/P, e) head-sharded (contiguous layout)."""
    b, n, h, e = x.shape
    send = x.unflatten(2, (P, h // P)).permute(2, 0, 1, 3, 4).contiguous()
    _count(send, (P - 1) / P)
    got = all_to_all_single(torch.empty_like(send), send)  # (P: source = sequence chunk, ...)
    return got.permute(1, 0, 2, 3, 4).reshape(b, P * n, h // P, e)


def _to_sequence(x: torch.Tensor, P: int) -> torch.Tensor:
    """Inverse of :func:`_to_heads`."""
    b, N, hl, e = x.shape
    send = x.unflatten(1, (P, N // P)).permute(1, 0, 2, 3, 4).contiguous()
    _count(send, (P - 1) / P)
    got = all_to_all_single(torch.empty_like(send), send)  # (P: source = head block, ...)
    return got.permute(1, 2, 0, 3, 4).reshape(b, N // P, P * hl, e)


def _project(x, W, w):
    """q (b, n, hq, d), the latent (b, n, r) and the RoPE key (b, n, dr) of tokens x."""
    q = (x @ W["q"]).unflatten(-1, (w["hq"], w["dn"] + w["dr"]))
    c, k_pe = (x @ W["kv_a"]).split([w["r"], w["dr"]], dim=-1)
    return q, c, k_pe


def _expand(c, k_pe, kv_b, heads: int, w):
    """k (b, n, heads, d) and v (b, n, heads, dv) of the latent, for ``kv_b``'s heads."""
    k_nope, v = (c @ kv_b).unflatten(-1, (heads, w["dn"] + w["dv"])).split([w["dn"], w["dv"]], -1)
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
    return k, v


def plain(x, W, w, topo):
    q, c, k_pe = _project(x, W, w)
    k, v = _expand(c, k_pe, W["kv_b"], w["hq"], w)
    return ucp.attention(q, k, v, topo, backend="math")


def latent(x, W, w, topo):
    P, rank = topo.sp_world_size, topo.sp_rank
    q, c, k_pe = _project(x, W, w)
    c_all, pe_all = _Gather.apply(torch.cat([c, k_pe], -1)).split([w["r"], w["dr"]], -1)
    hl = w["hq"] // P  # this rank's heads: [rank * hl, (rank + 1) * hl)
    kv_b = W["kv_b"].unflatten(1, (w["hq"], -1))[:, rank * hl : (rank + 1) * hl].flatten(1)
    k, v = _expand(c_all, pe_all, kv_b, hl, w)
    out = local_attention(_to_heads(q, P), k, v, backend="math")
    return _to_sequence(out, P)


def worker(rank, world, args, device):
    torch.set_num_threads(1)
    topo = ucp.init_topology(world, 1, layout="contiguous")
    w, N = TINY, args.seq
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(2, N, w["hidden"], generator=g, dtype=torch.float64)
    dout_full = torch.randn(2, N, w["hq"], w["dv"], generator=g, dtype=torch.float64)
    x, dout = (t.chunk(world, dim=1)[rank] for t in (x_full, dout_full))
    results = {}
    for name, fn in (("plain", plain), ("latent", latent)):
        W = _weights(w)
        xl = x.clone().requires_grad_()
        got = {}

        def step(fn=fn, W=W, xl=xl, got=got):
            out = fn(xl, W, w, topo)
            (out * dout).sum().backward()
            got["out"] = out.detach()

        ucp.comm_stats.reset()
        peak = peak_memory(step, scratch=False)
        grads = [xl.grad, *(W[k].grad for k in ("q", "kv_a", "kv_b"))]
        sent = ucp.comm_stats.total(LATENT if name == "latent" else "all_to_all", "forward")
        results[name] = dict(peak=peak, out=got["out"], grads=grads, sent=sent)
    # the weights' gradients: plain has every head from this rank's tokens, latent this
    # rank's heads from every token (kv_b) -- equal once summed over the ranks
    for i in (1, 2, 3):
        for name in results:
            dist.all_reduce(results[name]["grads"][i])
    torch.testing.assert_close(results["latent"]["out"], results["plain"]["out"])
    for a, b in zip(results["latent"]["grads"], results["plain"]["grads"]):
        torch.testing.assert_close(a, b)
    formula = bytes_forward(w, N, world, 8, b=2)
    sent = (results["plain"]["sent"], results["latent"]["sent"])
    assert sent == formula, (sent, formula)
    return dict(
        peak_plain=results["plain"]["peak"],
        peak_latent=results["latent"]["peak"],
        bytes_plain=sent[0],
        bytes_latent=sent[1],
    )


def real_rows(N: int, P: int, B: int) -> list[dict]:
    import transformers

    rows = []
    for name in REAL:
        cfg = getattr(transformers, name)()
        w = dict(
            hq=cfg.num_attention_heads,
            dn=cfg.qk_nope_head_dim,
            dr=cfg.qk_rope_head_dim,
            dv=cfg.v_head_dim,
            r=cfg.kv_lora_rank,
        )
        (bp, bl), (kp, kl) = bytes_forward(w, N, P, B), kept(w, N, P, B)
        rows.append(
            dict(config=name, **w, bytes_plain=bp, bytes_latent=bl, kept_plain=kp, kept_latent=kl)
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256 tokens")
    p.add_argument("--world", type=int, default=4, help="ranks = Ulysses degree (measured)")
    p.add_argument("--seq", type=int, default=1024, help="tokens (measured)")
    p.add_argument("--real-seq", type=int, default=131072, help="tokens (real sizes)")
    p.add_argument("--real-world", type=int, default=8, help="Ulysses degree (real sizes)")
    p.add_argument("--out", default="bench_results", help="folder for the JSON")
    args = parse_args(p, seq=256)
    measured = run_ranks(worker, args.world, args)
    m = measured
    print(
        f"measured: P = {args.world}, N = {args.seq}, float64, DeepSeek-V3's widths / 16;"
        " the latent output and gradients equal the plain ones"
    )
    print(f"{'':>8}{'bytes fwd':>12}{'peak':>12}")
    for kind in ("plain", "latent"):
        print(f"{kind:>8}{m['bytes_' + kind]:>12,}{m['peak_' + kind]:>12,}")
    print(
        f"{'latent/plain':>8}{m['bytes_latent'] / m['bytes_plain']:>12.2f}"
        f"{m['peak_latent'] / m['peak_plain']:>12.2f}"
    )
    N, P = args.real_seq, args.real_world
    rows = real_rows(N, P, 2)
    print(f"\nreal sizes: N = {N:,}, Ulysses {P}, bf16, per rank and layer (GiB)")
    print(
        f"{'config':<20}{'heads':>6}{'qk/v':>8}{'latent':>8}{'fwd plain':>11}{'latent':>9}"
        f"{'x':>6}{'kept plain':>12}{'latent':>9}{'x':>6}"
    )
    gib = 2**30
    for r in rows:
        print(
            f"{r['config']:<20}{r['hq']:>6}{str(r['dn'] + r['dr']) + '/' + str(r['dv']):>8}"
            f"{r['r'] + r['dr']:>8}{r['bytes_plain'] / gib:>11.3f}{r['bytes_latent'] / gib:>9.3f}"
            f"{r['bytes_latent'] / r['bytes_plain']:>6.2f}{r['kept_plain'] / gib:>12.3f}"
            f"{r['kept_latent'] / gib:>9.3f}{r['kept_latent'] / r['kept_plain']:>6.2f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"args": vars(args), "measured": m, "real": rows}
    (out / "benchmark_mla.json").write_text(json.dumps(data, indent=1))
    print(f"json: {out / 'benchmark_mla.json'}")


if __name__ == "__main__":
    main()
