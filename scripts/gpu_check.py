"""Everything a machine with ONE GPU can check, in one command (`scripts/gpu_check.sh`).

Needs only torch (and einops); flash-attn and deepspeed are used when they import and
reported as skipped when they do not. Sections, each a list of rows with ``ok``:

1. ``kernels``: the local kernels on the GPU (backend ``torch``, ``flash_attn`` if it
   imports) against float64 math: dense and packed rows, causal and not, GQA, a head dim
   that needs padding, MLA's values narrower than q/k (192/128), float16/bfloat16 (and
   float32 for ``torch``), forward and backward.
2. ``modes``: Ulysses, ring and hybrid with 4 processes sharing the GPU (gloo moves the
   CUDA tensors; ring steps go through the host), both layouts, dense and packed, against
   float64 attention on the gathered tensors.
3. ``training``: a few steps of ``train.py`` as one process on the GPU (bf16,
   ``attention_backend: auto``, ZeRO-2) when deepspeed imports; the loss must fall.
4. ``torch_native``: ``scripts/cp_example.py`` (PyTorch's ``context_parallel`` example
   through ``ulysses_cp.context_parallel``) under ``torch.distributed.run``, 2 ranks sharing
   the GPU over gloo, bf16, 8K tokens, Ulysses and then the ring; its errors vs SDPA.
5. ``attention``: causal forward+backward of one attention layer at 8K and 32K tokens
   (bf16, hq 32, hkv 8, d 128), raw ``F.scaled_dot_product_attention`` and each backend,
   interleaved: median time, TFLOP/s (causal FLOPs: fwd 2*N^2*hq*d, fwd+bwd 3.5x that, as
   FlashAttention's benchmarks count), the fraction of ``--peak-tflops``, the speed
   relative to SDPA and the CUDA kernel the ``torch`` backend chose.
6. ``model``: transformers, ALST and ulysses_cp training one Llama side by side
   (``scripts/gpu_model.py``: Llama-3-8B's layer sizes, 4 and 32 layers, bf16): step
   time, model TFLOP/s, peak, bytes per token, the planner's peak; ``ok`` rows: the
   losses agree; ``goals`` (reported, never failing the run).

Writes ``OUT/gpu_check.json`` and prints a summary; exits 1 if any row failed.
``--dry-run`` runs the same code on the CPU with small sizes (float32 training, timing at
512 tokens), to check the script itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_model  # noqa: E402
from benchlib import run_ranks, sync  # noqa: E402

import ulysses_cp as ucp  # noqa: E402
from ulysses_cp.kernels import flash_backend  # noqa: E402
from ulysses_cp.kernels.dispatch import local_attention  # noqa: E402
from ulysses_cp.kernels.spec import AttentionSpec  # noqa: E402
from ulysses_cp.modes.ulysses import head_chunk_choices  # noqa: E402

# max |error| / max |reference| allowed, by dtype (float64 reference)
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float64: 1e-10}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def backends() -> list[str]:
    """The backends to check: torch, and each flash-attn (2, 3, 4) that imports here."""
    from ulysses_cp.kernels import flash3_backend, flash4_backend

    found = {
        "flash_attn": flash_backend.import_problem,
        "flash_attn3": flash3_backend.import_problem,
        "flash_attn4": flash4_backend.import_problem,
    }
    return ["torch"] + [name for name, problem in found.items() if problem() is None]


def rel_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [
        ((g.double() - r).abs().max() / r.abs().max().clamp(min=1e-30)).item()
        for g, r in zip(got, ref)
    ]


def packed_bounds(N: int, multiple: int) -> torch.Tensor:
    """Four documents of unequal lengths (multiples of ``multiple``) filling N tokens."""
    unit = N // multiple
    lens = [unit // 2, unit // 4, unit // 8]
    lens.append(unit - sum(lens))
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) * multiple


def inputs(
    N: int, hq: int, hkv: int, d: int, g: torch.Generator, dv: int | None = None
) -> list[torch.Tensor]:
    """q, k, v, dout of one row (batch 1), standard normal, on the CPU; ``dv``: the values'
    head dim where it differs (MLA)."""
    dv = d if dv is None else dv
    shapes = [(1, N, hq, d), (1, N, hkv, d), (1, N, hkv, dv), (1, N, hq, dv)]
    return [torch.randn(s, generator=g) for s in shapes]


def reference(q, k, v, dout, causal, cu=None):
    """float64 math attention: out and the three gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    spec = AttentionSpec(causal=causal)
    out = local_attention(*leaves, spec, backend="math", cu_seqlens=cu)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.double())]


# ---------------------------------------------------------------- 1. local kernels


def kernel_rows(device: torch.device, dry: bool) -> list[dict]:
    rows = []
    N = 256 if dry else 1024
    g = torch.Generator().manual_seed(0)
    # (hq, hkv, d, dv): MHA, GQA, MQA padded to 80, MLA (DeepSeek-V3's q/k 192, values 128)
    cases = [(8, 8, 64, 64), (8, 2, 128, 128), (4, 1, 72, 72), (8, 8, 192, 128)]
    # one input and one float64 reference per case, shared by every backend and dtype (the
    # reference was most of this section's time in the dry run)
    refs: dict[tuple, tuple] = {}
    for backend in backends():
        dtypes = ["bfloat16", "float16"] + (["float32"] if backend == "torch" else [])
        for dname, (hq, hkv, d, dv), causal, packed in itertools.product(
            dtypes, cases, (True, False), (False, True)
        ):
            dtype = DTYPES[dname]
            key = (hq, hkv, d, dv, causal, packed)
            if key not in refs:
                q, k, v, do = inputs(N, hq, hkv, d, g, dv)
                cu = packed_bounds(N, 8) if packed else None
                refs[key] = (q, k, v, do, cu, reference(q, k, v, do, causal, cu))
            q, k, v, do, cu, ref = refs[key]
            leaves = [t.to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
            cud = None if cu is None else cu.to(device)
            spec = AttentionSpec(causal=causal)
            out = local_attention(*leaves, spec, backend=backend, cu_seqlens=cud)
            out.backward(do.to(device, dtype))
            errs = rel_errors([out.detach().cpu()] + [t.grad.cpu() for t in leaves], ref)
            case = dict(backend=backend, dtype=dname, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal)
            rows.append(
                dict(case, packed=packed, err_out_dq_dk_dv=errs, ok=max(errs) <= TOL[dtype])
            )
    return rows


# ---------------------------------------------------------------- 2. modes on 4 ranks


def _mode_body(rank, world, args, device):
    rows = []
    N, hq, hkv, d = (128 if args["dry"] else 2048), 8, 2, 64
    dtype = torch.bfloat16
    for backend in backends():
        for u, r in ((world, 1), (1, world), (2, world // 2)):
            groups = ucp.init_topology(u, r)
            cases = [(*lp, 0) for lp in itertools.product(("zigzag", "contiguous"), (False, True))]
            if u > 1 and 2 in head_chunk_choices(hq, hkv, u, ring=r > 1):
                cases.append(("zigzag", False, 2))  # the default is 1 head chunk: also 2
            for layout, packed, chunks in cases:
                topo = groups.with_options(layout=layout, backend=backend, head_chunks=chunks)
                q, k, v, do = inputs(N, hq, hkv, d, torch.Generator().manual_seed(1))
                cu = packed_bounds(N, 2 * world) if packed else None
                ref = reference(q, k, v, do, True, cu)
                cud = None if cu is None else cu.to(device)

                def shard(t, topo=topo, cud=cud):
                    return ucp.shard_sequence(t.to(device, dtype), topo, cu_seqlens=cud)

                leaves = [shard(t).requires_grad_() for t in (q, k, v)]
                out = ucp.attention(*leaves, topo, causal=True, cu_seqlens=cud)
                out.backward(shard(do))
                got = [
                    ucp.gather_sequence(t.detach(), topo, cu_seqlens=cud).cpu()
                    for t in (out, *(x.grad for x in leaves))
                ]
                errs = rel_errors(got, ref)
                case = dict(backend=backend, mode=topo.mode, ulysses=u, ring=r, layout=layout)
                case["head_chunks"] = chunks
                rows.append(
                    dict(case, packed=packed, err_out_dq_dk_dv=errs, ok=max(errs) <= TOL[dtype])
                )
            groups.destroy()
    return rows


# ---------------------------------------------------------------- 3. training


def training_rows(out_dir: Path, dry: bool) -> list[dict]:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:
        return [dict(skipped=f"deepspeed does not import: {type(exc).__name__}: {exc}")]
    cfg = json.loads((ROOT / "configs" / "tiny_cpu_zero2_u2r2.json").read_text())
    cfg["sequence_parallel"].update(ulysses_degree=1, ring_degree=1)
    cfg["optimizer"]["params"]["torch_adam"] = True  # no fused-Adam build
    cfg["data"]["seq_len"] = 256 if dry else 4096
    cfg["training"] = {"max_steps": 6 if dry else 30, "log_interval": 3, "save_interval": 1000}
    if not dry:
        cfg["bf16"] = {"enabled": True}
    run = out_dir / "train"
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.setdefault("MASTER_PORT", "29517")
    cmd = [sys.executable, str(ROOT / "train.py"), "--deepspeed_config", str(run / "config.json")]
    t = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "--output_dir", str(run), "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    (run / "log.txt").write_text(proc.stdout + proc.stderr)
    metrics = run / "metrics.jsonl"
    losses = (
        [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
        if metrics.exists()
        else []
    )
    ok = proc.returncode == 0 and len(losses) >= 2 and losses[-1] < losses[0]
    return [
        dict(
            returncode=proc.returncode,
            seconds=time.perf_counter() - t,
            losses=losses,
            tail=(proc.stdout + proc.stderr)[-2000:],
            ok=ok,
        )
    ]


# ---------------------------------------------------------------- 4. timing


def torch_native_rows(dry: bool) -> list[dict]:
    """scripts/cp_example.py (PyTorch's context_parallel example through ucp) under
    torch.distributed.run: 2 ranks sharing the GPU over gloo, bf16, Ulysses and ring."""
    rows = []
    for extra in ([], ["--mode", "ring", "--heads", "2"]):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "scripts" / "cp_example.py"),
            "--seq",
            "256" if dry else "8192",
            # the dry run takes the example's default, gloo on a CPU, as a user runs it
            *([] if dry else ["--dist-backend", "gloo"]),
            *extra,
        ]
        t = time.perf_counter()
        # the tree importable in the ranks where the package is not installed
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        lines = [x for x in proc.stdout.splitlines() if "max |error|" in x or " ranks on " in x]
        rows.append(
            dict(
                args=extra,
                returncode=proc.returncode,
                seconds=time.perf_counter() - t,
                report=lines,
                tail=proc.stderr[-1500:],
                ok=proc.returncode == 0,
            )
        )
    return rows


def _sdpa(q, k, v):
    """Raw ``F.scaled_dot_product_attention`` as a user calls it: (b, h, s, d), GQA."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(qh, kh, vh, is_causal=True, enable_gqa=True).transpose(1, 2)


def attention_rows(device: torch.device, dry: bool, peak_tflops: float) -> list[dict]:
    """Each local backend against raw SDPA: causal forward+backward, bf16, hq 32, hkv 8,
    d 128, at 8K and 32K tokens; repeats interleaved (SDPA, then each backend, per round),
    medians; ``vs_sdpa``: SDPA's time over the backend's (1.0: as fast). TFLOP/s count the
    causal FLOPs as FlashAttention's benchmarks do: forward 4 N^2 hq d / 2, backward 2.5x
    the forward."""
    hq, hkv, d = 32, 8, 128
    seqs, repeats = ([512], 1) if dry else ([8192, 32768], 5)
    from ulysses_cp.kernels import torch_backend

    rows = []
    for N in seqs:
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (t.to(device, torch.bfloat16) for t in inputs(N, hq, hkv, d, g))
        fns = {"sdpa": _sdpa}
        for backend in backends():
            fns[backend] = lambda a, b, c, name=backend: local_attention(a, b, c, backend=name)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for rep in range(2 + repeats):  # interleaved rounds; the first two warm up
            for name, fn in fns.items():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                sync(device)
                t0 = time.perf_counter()
                fn(*leaves).backward(do)
                sync(device)
                if rep >= 2:
                    times[name].append(time.perf_counter() - t0)
        flops = 3.5 * 4 * N * N * hq * d / 2
        sdpa = statistics.median(times["sdpa"])
        for name, ts in times.items():
            t = statistics.median(ts)
            row = dict(backend=name, N=N, median_s=t, tflops=flops / t / 1e12, ok=True)
            row.update(fraction_of_peak=row["tflops"] / peak_tflops, vs_sdpa=sdpa / t)
            if name == "torch" and device.type == "cuda":
                row["cuda_kernel"] = torch_backend._kernel(q)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check_results", help="folder for gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, small sizes, no GPU parts")
    p.add_argument("--world", type=int, default=4, help="processes sharing the GPU (modes)")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)"
    )
    sections_all = ["kernels", "modes", "training", "torch_native", "attention", "model"]
    p.add_argument("--only", nargs="+", choices=sections_all)
    parts = list(gpu_model.PARTS)
    p.add_argument("--model-parts", nargs="+", choices=parts, default=parts, help="model section")
    args = p.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        print("gpu_check: no CUDA device: running the dry run (CPU, small sizes)")
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "dry_run": dry,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if not dry else "cpu",
        "flash_attn": flash_backend.import_problem() or flash_backend.interface().version,
        "sections": {},
    }
    sections = {
        "kernels": lambda: kernel_rows(device, dry),
        "modes": lambda: run_ranks(_mode_body, args.world, {"dry": dry}),
        "training": lambda: training_rows(out, dry),
        "torch_native": lambda: torch_native_rows(dry),
        "attention": lambda: attention_rows(device, dry, args.peak_tflops),
        "model": lambda: gpu_model.model_rows(device, dry, args.peak_tflops, args.model_parts),
    }
    failed = []
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        t = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            rows = fn()
        except Exception as exc:  # one broken section must not hide the others
            rows = [dict(error=f"{type(exc).__name__}: {exc}", ok=False)]
        bad = [r for r in rows if r.get("ok") is False]
        failed += [(name, r) for r in bad]
        report["sections"][name] = rows
        print(
            f"gpu_check: {name}: {len(rows)} rows, {len(bad)} failed, "
            f"{time.perf_counter() - t:.0f} s",
            flush=True,
        )
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    for row in report["sections"].get("attention", []):
        print(
            f"attention: {row['backend']:10} N={row['N']:6} {row['median_s'] * 1e3:9.2f} ms "
            f"{row['tflops']:7.1f} TFLOP/s ({row['fraction_of_peak']:.0%} of peak), "
            f"{row['vs_sdpa']:.2f}x SDPA's speed {row.get('cuda_kernel', '')}"
        )
    for line in gpu_model.table(report["sections"].get("model", [])):
        print(line)
    for name, row in failed:
        print(f"FAILED {name}: {row}")
    report["goals"] = [r for r in report["sections"].get("model", []) if r.get("kind") == "goal"]
    report["ok"] = not failed
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(
        f"gpu_check: {'all passed' if not failed else f'{len(failed)} failed'}; "
        f"{out / 'gpu_check.json'}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
