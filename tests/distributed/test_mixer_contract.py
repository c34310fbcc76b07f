"""The hybrid mixers' adapters against the kernel packages' contracts, pinned on CPU.

A pool of 4 ranks starts with the stand-ins of ``tests/support/mixer_standin`` (causal-conv1d 1.6.1,
mamba-ssm 2.3.2.post1, fla 0.5.2) importable, so transformers binds them as it would the
real packages on a GPU machine; the adapters of LFM2, Qwen3-Next and Bamba then call them
under sequence parallelism (Ulysses 2 x ring 2 on rows and on a packed row; Ulysses 2 with
data parallel 2 on a packed row) and every call meets the release's checks. Loss and
SP-summed gradients equal the one-process model on transformers' own torch path (the same
weights, float32: causal-conv1d takes no float64).
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
import torch.distributed as dist

import ulysses_cp as ucp
from tests.distributed.test_hf_mixers import bamba, jamba, kimi_linear, lfm2, qwen3_next, zamba
from tests.support import mixer_standin
from tests.support.distributed import DistPool
from tests.support.helpers import shard_loss, topology
from tests.support.hf_zoo import wake_zero_params_

transformers = pytest.importorskip("transformers")
from ulysses_cp.models import hf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # its own 4-rank pool
FAMILIES = {
    "lfm2": lfm2,
    "qwen3_next": qwen3_next,
    "bamba": bamba,
    "zamba": zamba,
    "kimi_linear": kimi_linear,
    "jamba": jamba,
}
# the family's kernel functions (transformers' wrappers; ``__wrapped__``: its torch path)
WRAPPERS = (
    "causal_conv1d_fn",
    "mamba2_chunk_scan",
    "torch_chunk_gated_delta_rule",
    "mamba_selective_scan",
    "chunk_kimi_delta_attention",
)
SCAN = {
    "lfm2": None,
    "qwen3_next": "chunk_gated_delta_rule",
    "bamba": "mamba_chunk_scan_combined",
    "zamba": "selective_scan_fn",  # once per head
    "jamba": "selective_scan_fn",
    "kimi_linear": "chunk_kda",
}
# float32, relative to the loss and to each gradient's largest entry. The gated delta rule's
# decay parameters sum per-token terms that cancel: transformers' float32 torch path is off
# by ~3e-4 from the stand-in's float64 (and by 3.5e-5 from itself with the heads split)
TOL = {None: 2e-5, "A_log": 1e-3, "dt_bias": 1e-3}


@pytest.fixture(scope="module")
def standin_pool():
    """4 ranks started with the stand-ins first on sys.path (a new pool after a failure)."""
    live: list[DistPool] = []

    def get() -> DistPool:
        if not live or not live[-1].healthy:
            with mixer_standin.on_path():
                live.append(DistPool(4))
        return live[-1]

    yield get
    for pool in live:
        pool.close()


@contextlib.contextmanager
def torch_path(model):
    """The family's kernel functions swapped for transformers' torch versions meanwhile."""
    module = sys.modules[type(model).__module__]
    saved = {name: getattr(module, name) for name in WRAPPERS if hasattr(module, name)}
    for name, fn in saved.items():
        setattr(module, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _run(rank, family, u, r, packed):
    from tests.support.mixer_standin import kernels

    assert set(mixer_standin.installed().values()) <= set(mixer_standin.FOLDERS.values())
    topo = topology(u, r)
    hf.register_attention(topo, backend="math")
    cfg, kw = FAMILIES[family](), {"dtype": torch.float32}
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    sp = auto.from_config(copy.deepcopy(cfg), attn_implementation="ulysses_cp", **kw)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", **kw)
    if family == "zamba":  # its x_proj starts at zero: B = C = 0 would hide the scan
        with torch.no_grad():
            wake_zero_params_(sp, std=0.5)
    ref.load_state_dict(sp.state_dict())
    g = torch.Generator().manual_seed(2)
    if packed:
        docs = [torch.randint(96, (n,), generator=g) for n in (13, 32, 8)]
        batch = ucp.pack_documents(docs, multiple=ucp.sequence_multiple(u * r, "zigzag"))
    else:
        docs = list(torch.randint(96, (2, 64), generator=g))
        batch = {"input_ids": torch.stack(docs), "labels": torch.stack(docs)}
    local = hf.shard_batch(batch, topo)
    model = hf.HFCausalLM(sp)
    model.probe()  # the start-up probe calls the kernels too (no gradients)
    kernels.CALLS.clear()
    loss = shard_loss(model, local, topo)
    loss.backward()
    calls = dict(kernels.CALLS)
    with torch_path(ref):
        logits = [ref(input_ids=d[None], use_cache=False).logits[0, :-1] for d in docs]
        targets = torch.cat([d[1:] for d in docs])
        want = torch.nn.functional.cross_entropy(torch.cat(logits), targets)
        want.backward()
    assert dict(kernels.CALLS) == calls, "the reference reached a stand-in"
    errors = {"loss": abs(loss.item() - want.item()) / abs(want.item())}
    for (name, p), q in zip(sp.named_parameters(), ref.parameters()):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)
        ref_grad = torch.zeros_like(q) if q.grad is None else q.grad
        errors[name] = (
            (grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-30)
        ).item()
    return calls, errors


CASES = [(2, 2, False), (2, 2, True), (2, 1, True)]


@pytest.mark.parametrize(
    "family,u,r,packed",
    [(f, *case) for f in FAMILIES if f != "jamba" for case in CASES] + [("jamba", 2, 2, False)],
    ids=str,
)
def test_adapters_meet_the_kernel_contracts(standin_pool, family, u, r, packed):
    """Jamba's layers refuse packed rows (tests/distributed/test_hf_mixers.py)."""
    P = u * r
    # the conv's x: a channel-last view of the exchanged channels where causal-conv1d takes
    # it (channels and row stride multiples of 8: LFM2's D/P = 8 or 16, Qwen3-Next's 64 + 8
    # at P = 2, Zamba's and Jamba's 64/P), else a channel-first copy (Qwen3-Next 32 + 4,
    # Bamba 32 + 2 or 48 + 4)
    last = family in ("lfm2", "zamba", "jamba") or (family, P) == ("qwen3_next", 2)
    layout = "channel_last" if last else "channel_first"
    for calls, errors in standin_pool().run(_run, family, u, r, packed):
        conv = calls.get("causal_conv1d_fn", 0)
        assert conv and calls.get(f"causal_conv1d_fn:{layout}") == conv, calls
        assert calls.get("causal_conv1d_fn.backward") == conv, calls
        scans = conv * (4 // P if family == "zamba" else 1)  # Zamba: a scan per head
        if SCAN[family] is not None:
            assert calls.get(SCAN[family]) == scans == calls.get(SCAN[family] + ".backward"), calls
        for name, err in errors.items():
            assert err < TOL.get(name.rsplit(".", 1)[-1], TOL[None]), (name, err)
