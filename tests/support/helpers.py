"""What the tests share: deterministic inputs, the one float64 reference, the one shard ->
attend -> gather runner, tiny models, process groups, the one run-config builder and the
one way to start programs (train.py under the deepspeed launcher, torchrun, scripts)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import ulysses_cp as ucp
from tests.support.distributed import COLLECTIVE_TIMEOUT_S, WorkerError
from ulysses_cp.config import ModelConfig, RunConfig
from ulysses_cp.training.engine import run_options

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "train.py"
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import free_port  # noqa: E402  (one home: the scripts' launcher helpers)

TOL64 = dict(rtol=1e-10, atol=1e-10)
TINY = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
# the tiny Hugging Face configs of the HF tests (4 heads, 2 kv heads, vocabulary 96)
HF_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_dropout=0.0,
)

# ---------------------------------------------------------------- attention


def make_qkv(
    seed: int,
    b: int,
    s: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype = torch.float64,
    dv: int | None = None,
):
    """Full q, k, v, dout, identical on every rank for the same seed; ``dv``: the values'
    (and so the output's) head dim where it is not q's and k's (MLA)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, hq, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def sinks_for(hq: int) -> torch.Tensor:
    """The sink logits the tests use, one per query head."""
    return torch.linspace(-1.0, 2.0, hq, dtype=torch.float64)


def reference(
    q,
    k,
    v,
    dout,
    causal=True,
    *,
    softmax_scale=None,
    softcap=0.0,
    sinks=None,
    bounds=None,
    window=(-1, -1),
):
    """Full attention ``(b, s, h, d)`` in float64, written here independently of
    ulysses_cp's kernels: an explicit (causal, windowed, block-diagonal for packed
    ``bounds``) mask, ``softcap * tanh(s / softcap)`` on the scores, the sinks as one more
    column of logits whose value vector is zero, ``torch.softmax``, and autograd for the
    gradients. ``dout``: the output gradient, or a function of the output giving the loss.
    Returns ``[out, dq, dk, dv, dsinks]`` (``dsinks`` None without sinks)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sk = None if sinks is None else sinks.detach().double().requires_grad_()
    hq, n = q.shape[2], q.shape[1]
    kk, vv = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))  # head i: kv i // g
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    mask = torch.ones(n, n, dtype=torch.bool)
    if bounds is not None:
        doc = torch.zeros(n, dtype=torch.long)
        for i, (a, b) in enumerate(zip(list(bounds)[:-1], list(bounds)[1:])):
            doc[a:b] = i
        mask &= doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(n, n, dtype=torch.bool).tril()
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if window[0] >= 0:  # flash-attn's sliding window
        mask &= j >= i - window[0]
    if window[1] >= 0:
        mask &= j <= i + window[1]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sk is not None:  # one more logit per head, value zero
        scores = torch.cat([scores, sk.view(1, hq, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
        vv = torch.cat([vv, torch.zeros_like(vv[:, :1])], dim=1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
    inputs = (q, k, v) if sk is None else (q, k, v, sk)
    if callable(dout):
        grads = torch.autograd.grad(dout(out), inputs)
    else:
        grads = torch.autograd.grad(out, inputs, dout.double())
    return [out.detach(), *grads] if sk is not None else [out.detach(), *grads, None]


def sdpa_attention(q, k, v, causal: bool = True):
    """Single-process attention through PyTorch's SDPA (an independent reference for model
    tests): ``(b, s, h, d)`` in and out, GQA by head counts."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2)


def sharded_run(q, k, v, dout, topo, *, sinks=None, cu_seqlens=None, **attention_kwargs):
    """The one shard -> attend -> gather runner: every rank shards the same full tensors
    (in ``layout=`` when given, document-wise with ``cu_seqlens``), runs ``ucp.attention``
    and its backward, gathers. Returns ``[out, dq, dk, dv, dsinks]`` (``dsinks``: this
    rank's share of the sinks' gradient, None without sinks)."""
    kw = dict(layout=attention_kwargs.get("layout"), cu_seqlens=cu_seqlens)
    ql, kl, vl = (ucp.shard_sequence(t, topo, **kw).detach().requires_grad_() for t in (q, k, v))
    sk = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = ucp.attention(ql, kl, vl, topo, sinks=sk, cu_seqlens=cu_seqlens, **attention_kwargs)
    out.backward(ucp.shard_sequence(dout, topo, **kw))
    got = [ucp.gather_sequence(t, topo, **kw).detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    return [*got, None if sk is None else sk.grad]


def attend_case(
    rank,
    u,
    r,
    layout="zigzag",
    *,
    seed,
    hq,
    hkv,
    bounds=None,
    sinks=False,
    options=None,
    widths=None,
    **kw,
):
    """A pool task: the case's full tensors (``case_inputs``) through :func:`sharded_run`
    on ``topology(u, r, layout, **options)``; ``kw`` go to ``ucp.attention``; ``widths``:
    ``(d, dv)``, q/k's and v's head dims. Returns ``(got, bytes sent by op)``."""
    topo = topology(u, r, layout, **(options or {}))
    q, k, v, dout = case_inputs(seed, hq, hkv, bounds, *(widths or ()))
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    ucp.comm_stats.reset()
    got = sharded_run(
        q, k, v, dout, topo, sinks=sinks_for(hq) if sinks else None, cu_seqlens=cu, **kw
    )
    return got, ucp.comm_stats.snapshot()


def case_inputs(seed: int, hq: int, hkv: int, bounds=None, d: int = 8, dv: int | None = None):
    """A case's full q, k, v, dout: batch 2 x 32 tokens, or one packed row of ``bounds``;
    head dim ``d``, the values' ``dv`` (None: ``d``)."""
    s = 32 if bounds is None else bounds[-1]
    return make_qkv(seed=seed, b=1 if bounds else 2, s=s, hq=hq, hkv=hkv, d=d, dv=dv)


def check_case(results, *, seed, hq, hkv, bounds=None, sinks=False, widths=None, tol=TOL64, **math):
    """Every rank's gathered output and gradients of :func:`attend_case` against the float64
    reference (``math``: ``causal``, ``softcap``, ``window``...); the sinks' gradient summed
    over the ranks (each rank holds its share)."""
    q, k, v, dout = case_inputs(seed, hq, hkv, bounds, *(widths or ()))
    ref = reference(q, k, v, dout, bounds=bounds, sinks=sinks_for(hq) if sinks else None, **math)
    for got, _ in results:
        for name, g, x in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
            torch.testing.assert_close(g, x, **tol, msg=lambda m, n=name: f"{n}: {m}")
    if sinks:
        torch.testing.assert_close(sum(got[4] for got, _ in results), ref[4], **tol)


MATH = ("causal", "softmax_scale", "softcap", "window")  # attention keywords the reference takes


CASE = ("seed", "hq", "hkv", "bounds", "sinks", "widths")  # attend_case's case keywords


def attend_and_check(pools, u, r, layout="zigzag", *, options=None, **kw):
    """:func:`attend_case` on ``u * r`` pool ranks, every result checked (:func:`check_case`)
    with the math keywords of ``kw``; the results, for more checks. ``kw``: the case's
    keywords (``seed``, ``hq``, ``hkv`` required; ``bounds``, ``sinks``, ``widths``: ``(d,
    dv)`` for values of their own head dim) and ``ucp.attention``'s."""
    case = {key: kw.pop(key) for key in CASE if key in kw}
    results = pools(u * r).run(attend_case, u, r, layout, **case, options=options, **kw)
    check_case(results, **case, **{k: v for k, v in kw.items() if k in MATH})
    return results


# ---------------------------------------------------------------- groups and configs

_TOPOS: dict = {}


def offloaded_inputs(out: torch.Tensor) -> list[torch.Tensor]:
    """The input every offloaded checkpoint in ``out``'s graph keeps on CPU."""
    kept, seen, todo = [], set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == "_OffloadedCheckpointBackward":
            assert fn.x_cpu.device.type == "cpu"
            kept.append(fn.x_cpu)
        todo += [f for f, _ in fn.next_functions]
    return kept


def small_bucket_config(src: str | Path, folder: Path, bucket: int = 100_000) -> str:
    """``src`` with ZeRO's ``reduce_bucket_size`` at ``bucket`` elements, written into
    ``folder``: the planner counts ZeRO-1/2's reduce bucket (5e8 elements by default, more
    than the tiny GPUs planning tests ask for)."""
    raw = json.loads(Path(src).read_text())
    raw.setdefault("zero_optimization", {})["reduce_bucket_size"] = bucket
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = Path(folder) / Path(src).name
    out.write_text(json.dumps(raw))
    return str(out)


def topology(u: int, r: int, layout: str = "zigzag", **options):
    """One set of process groups per degrees per process (group creation is collective and
    slow), with the run's ``layout`` and other ``options`` (``RunOptions`` fields)."""
    if (u, r) not in _TOPOS:
        _TOPOS[(u, r)] = ucp.init_topology(u, r, timeout_s=COLLECTIVE_TIMEOUT_S)
    return _TOPOS[(u, r)].with_options(layout=layout, **options)


def assert_refused_on_every_rank(pools, n: int, fn, text: str) -> None:
    """``fn`` run on ``n`` ranks fails on every one of them with ``text`` in its error."""
    with pytest.raises(WorkerError) as err:
        pools(n).run(fn)
    assert str(err.value).count(text) == n


def topology_for(config: dict):
    """The cached groups of :func:`topology` with the run's choices of ``config`` (what
    ``ucp.topology_from_config`` gives, without creating new groups per engine)."""
    run = RunConfig.load(config)
    sp = run.sequence_parallel
    return topology(sp.ulysses_degree, sp.ring_degree, **asdict(run_options(run)))


# what the launcher tests train: a tiny decoder on kv_recall, AdamW, 2 CPU ranks
LAUNCH = dict(
    micro_batch=2,
    gradient_clipping=1.0,
    optimizer={"type": "AdamW", "params": {"lr": 1e-2}},
    model={"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
    data={"task": "kv_recall", "seq_len": 64, "n_queries": 8},
)


def run_config(
    u: int = 2,
    r: int = 1,
    stage: int = 2,
    *,
    micro_batch: int = 1,
    backend: str = "torch",
    sp: dict | None = None,
    **blocks,
) -> dict:
    """The one run-config builder: DeepSpeed's batch and ZeRO keys and our
    ``sequence_parallel`` block (degrees, backend, and ``sp``), then ``blocks`` (a dict
    updates the block of its name, None drops it, anything else sets the key). The
    defaults are what in-process tests step once: SGD from the test and no gradient
    clipping (clipping at a norm below the gradient's would hide a gradient off by a
    constant factor); ``**LAUNCH`` adds what a launcher run trains."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "sequence_parallel": {
            "ulysses_degree": u,
            "ring_degree": r,
            "attention_backend": backend,
            **(sp or {}),
        },
    }
    for key, value in copy.deepcopy(blocks).items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def tiny_llama_weights(folder: Path, seed: int = 5) -> dict:
    """A tiny HF Llama (configs/hf/tiny_llama.json) drawn with ``seed`` and saved as
    sharded safetensors in ``folder``; returns the ``"model"`` block that loads it."""
    import transformers

    from ulysses_cp.models import hf

    fields = json.loads((ROOT / "configs" / "hf" / "tiny_llama.json").read_text())
    (folder / "config.json").write_text(json.dumps(fields))
    torch.manual_seed(seed)
    saved = transformers.AutoModelForCausalLM.from_config(hf.load_config(dict(fields)))
    saved.save_pretrained(folder / "weights", max_shard_size="100KB")
    return {"hf_config": str(folder / "config.json"), "hf_weights": str(folder / "weights")}


def write_config(folder: Path, cfg: dict, name: str = "cfg") -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


# ---------------------------------------------------------------- programs


def deepspeed_cmd(
    cfg_path: Path,
    out: Path,
    *extra: str,
    num_gpus: int = 2,
    script: Path = TRAIN,
    launcher: tuple[str, ...] = (),
) -> list[str]:
    """``train.py`` (or ``script``) under DeepSpeed's launcher; ``launcher``: its options
    (a hostfile, a node rank...) instead of ``--num_gpus`` and a free port."""
    opts = launcher or ("--num_gpus", str(num_gpus), "--master_port", str(free_port()))
    args = ("--deepspeed_config", str(cfg_path), "--output_dir", str(out), *extra)
    return [sys.executable, "-m", "deepspeed.launcher.runner", *opts, str(script), *args]


def torchrun_cmd(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    port = ("--master-port", str(free_port()))
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *port]
    return [*run, str(script), *args]


def start(cmd: list[str], *, env: dict | None = None) -> subprocess.Popen:
    """The one way tests start a program: in the repository, WANDB offline, this package
    first on the path, stdout and stderr together."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """``(returncode, output)`` of each program, in order; one that outlives ``timeout``
    (counted from this call) is killed and fails the test."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                pytest.fail(f"{p.args[:4]} did not exit within {timeout} s:\n{out[-3000:]}")
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 600, ok: bool = True) -> str:
    """One program to its end: its output. ``ok``: it must exit 0; ``ok=False``: it must
    fail (else the test fails, showing the output's end)."""
    code, out = finish([start(cmd, env=env)], timeout)[0]
    assert (code == 0) is ok, f"exit code {code}:\n{out[-6000:]}"
    return out


def launch(
    cfg_path: Path,
    out: Path,
    *extra: str,
    env: dict | None = None,
    ok: bool = True,
    num_gpus: int = 2,
    script: Path = TRAIN,
) -> str:
    """``train.py`` (or ``script``) on ``num_gpus`` ranks to its end, each rank in the
    environment DeepSpeed's launcher gives it, forked from the tests' pre-imported process
    (tests/support/zygote.py; the launcher itself is run by test_entry_points.py and
    test_multinode.py): the ranks' output. ``ok``: every rank must exit 0; ``ok=False``:
    one must fail (else the test fails, showing the output's end)."""
    from tests.support.zygote import start_ranks, wait_ranks

    args = ("--deepspeed_config", str(cfg_path), "--output_dir", str(out), *extra)
    logs = out.parent / f"{out.name}_logs"
    ranks = start_ranks(script, *args, nproc=num_gpus, logs=logs, env=env, launcher="deepspeed")
    wait_ranks([ranks], timeout=600)
    text = ranks.output()
    assert all(c == 0 for c in ranks.codes) is ok, f"exit codes {ranks.codes}:\n{text[-6000:]}"
    return text


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# DeepSpeed refuses fp16 where its accelerator cannot run it: on a CPU, one without fp16
# support in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported(), e.g. no AVX512-FP16)
needs_fp16 = pytest.mark.skipif(
    not _fp16_supported(),
    reason="DeepSpeed refuses fp16 on this device (a CPU without oneDNN fp16 support)",
)


# ---------------------------------------------------------------- models


def hf_pair(cfg, topo, backend="math", reference_attention="sdpa", dtype=torch.float64):
    """(model through ``ucp.attention``, single-process reference with transformers' own
    ``reference_attention``): the same Hugging Face config, the same weights."""
    import transformers

    from ulysses_cp.models import hf

    hf.register_attention(topo, backend=backend)
    torch.manual_seed(0)
    sp = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="ulysses_cp", dtype=dtype
    )
    ref = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation=reference_attention, dtype=dtype
    )
    ref.load_state_dict(sp.state_dict())
    return sp, ref


HF_TOL = dict(rtol=1e-9, atol=1e-10)  # a float64 HF model under SP against one process


def assert_same_loss_and_grads(loss, ref_loss, grads: dict) -> None:
    """The SP loss and every parameter's gradient (``{name: (grad, want)}``, as
    :func:`hf_loss_and_grads` returns them) equal the one-process model's (``HF_TOL``)."""
    torch.testing.assert_close(loss, ref_loss, **HF_TOL)
    for name, (grad, want) in grads.items():
        torch.testing.assert_close(grad, want, **HF_TOL, msg=lambda m, n=name: f"{n}: {m}")


def hf_loss_and_grads(sp, ref, topo, ids: torch.Tensor, dtype=torch.float64, **loss_kwargs):
    """The SP model's loss of ``ids`` (sharded by ``ucp.shard_batch``) and the reference's
    (one process, the whole rows), both backward: ``(loss, ref_loss, grads)`` with
    ``grads[name] = (SP gradient summed over the SP ranks, reference gradient)``.
    ``loss_kwargs``: options of ``HFCausalLM.loss`` (``tiled_loss``, ``fused_loss``)."""
    logits = ref(input_ids=ids).logits.to(dtype)  # transformers' own loss casts to float32
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    ref_loss.backward()
    batch = {"input_ids": ids, "labels": ids}
    return _sp_loss_and_grads(sp, ref, topo, batch, ref_loss, **loss_kwargs)


def hf_packed_loss_and_grads(sp, ref, topo, docs: list[torch.Tensor]):
    """As :func:`hf_loss_and_grads` for ``docs`` packed in one row under SP (the run's
    packing: every document padded to the layout's multiple, or only the row), against
    each document run alone by the reference (the mean over all targets)."""
    m = ucp.sequence_multiple(topo.sp_world_size, topo.layout)
    each = dict(row_multiple=m) if topo.options.packing == "row" else dict(multiple=m)
    row = ucp.pack_documents(docs, **each)
    total = sum(
        torch.nn.functional.cross_entropy(
            ref(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum"
        )
        for d in docs
    )
    ref_loss = total / sum(len(d) - 1 for d in docs)
    ref_loss.backward()
    return _sp_loss_and_grads(sp, ref, topo, row, ref_loss)


def shard_loss(model, local: dict, topo, **loss_kwargs) -> torch.Tensor:
    """``model.loss`` (an ``HFCausalLM``) on this rank's ``local`` shard of a batch."""
    args = (local["input_ids"], local["position_ids"], local["shift_labels"], topo)
    return model.loss(*args, batch=local["batch"], **loss_kwargs)


def _sp_loss_and_grads(sp, ref, topo, batch: dict, ref_loss: torch.Tensor, **loss_kwargs):
    import torch.distributed as dist

    from ulysses_cp.models import hf

    loss = shard_loss(hf.HFCausalLM(sp), ucp.shard_batch(batch, topo), topo, **loss_kwargs)
    loss.backward()
    grads = {}
    for (name, p), q in zip(sp.named_parameters(), ref.parameters()):
        grad = torch.zeros_like(q) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)  # SP ranks' shares sum to the gradient
        grads[name] = (grad, torch.zeros_like(q) if q.grad is None else q.grad)
    return loss, ref_loss, grads


def sgd_engine_and_batch(model: torch.nn.Module, cfg: dict, topo) -> tuple[object, dict]:
    """``model`` under DeepSpeed with SGD (lr 0.5), and this rank's shard of one KV-recall
    row of 128 tokens (the same row on every rank): a one-step test's starting point."""
    from ulysses_cp.run_blocks import DataConfig
    from ulysses_cp.training.data import KVRecall, global_batch

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = ucp.initialize(model=model, config=cfg, topo=topo, optimizer=opt)
    data = KVRecall(DataConfig(seq_len=128, n_queries=16))
    full = global_batch(
        data, step=0, micro_step=0, grad_accum=1, micro_batch=1, dp_rank=0, dp_degree=1
    )
    return engine, ucp.shard_batch(full, topo)
