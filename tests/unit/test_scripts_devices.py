"""The benchmark scripts on GPUs: every bookkeeping collective and CUDA sync goes through
``scripts/benchlib.py`` (tensors on the rank's device, the rank's own GPU), checked
statically; benchlib's choice of device and backend per rank; its helpers on gloo ranks."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.helpers import ROOT

SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import benchlib  # noqa: E402

# benchlib is where the collectives live; check_attention.py is CPU/gloo only by design
# (see test_check_attention_is_cpu_gloo_only, which keeps that exemption honest).
# cp_example.py is user code on show: its all_reduce of gradients (on the rank's device)
# is part of what it demonstrates; benchmark_hf.py runs DeepSpeed ALST's tutorial code as
# its users write it (TiledMLP's shard count, the loss's all-gathers) and sums the SP
# gradients for its correctness check, all on the model's own tensors (the rank's device)
# benchmark_mla.py: its collectives are the exchange it measures (CPU tensors, gloo only)
EXEMPT = {
    "benchlib.py",
    "check_attention.py",
    "cp_example.py",
    "benchmark_hf.py",
    "benchmark_mla.py",
}

COLLECTIVES = {
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "_all_gather_base",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
}


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def violations(source: str) -> list[str]:
    """Calls of ``torch.distributed`` collectives and bare ``torch.cuda.synchronize()`` in
    ``source``, resolved through its imports (``import torch.distributed as dist``,
    ``from torch.distributed import barrier``, ``from torch import cuda``...)."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}  # local name -> full dotted name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    alias[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    alias[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = alias.get(head, head) + (f".{rest}" if rest else "")
        module, _, fn = full.rpartition(".")
        if module == "torch.distributed" and fn in COLLECTIVES:
            found.append(f"line {node.lineno}: {name}()")
        bare = not node.args and not node.keywords
        none = len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
        if full == "torch.cuda.synchronize" and (bare or (none and node.args[0].value is None)):
            found.append(f"line {node.lineno}: {name}() with no device")
    return found


def script_paths() -> list[Path]:
    return sorted(p for p in SCRIPTS.glob("*.py") if p.name not in EXEMPT)


def test_scripts_are_found():
    names = {p.name for p in script_paths()}
    assert {"benchmark_attention.py", "benchmark_memory.py", "benchmark_packing.py"} <= names


@pytest.mark.parametrize("path", script_paths(), ids=lambda p: p.name)
def test_no_collectives_or_bare_sync_outside_benchlib(path):
    found = violations(path.read_text())
    assert not found, (
        f"{path.name}: use benchlib's gather_floats / max_over_ranks / barrier / sync "
        f"(tensors on the rank's device) instead of: {found}"
    )


def test_checker_sees_every_spelling():
    src = """
import torch
import torch.distributed as dist
import torch.distributed
from torch import distributed as d2, cuda
from torch.distributed import all_reduce as ar, barrier
dist.barrier()
torch.distributed.all_gather(a, b)
d2.all_to_all_single(x, y)
ar(t)
barrier()
dist.send(t, 1)
torch.cuda.synchronize()
cuda.synchronize(None)
"""
    assert len(violations(src)) == 8, violations(src)
    fine = """
import torch
import torch.distributed as dist
from benchlib import barrier
dist.get_backend()
dist.get_world_size()
barrier(device)
torch.cuda.synchronize(device)
torch.cuda.synchronize(device=device)
"""
    assert violations(fine) == []


def test_check_attention_is_cpu_gloo_only():
    """The exemption holds while the attention check (scripts/check_attention.py, a shim of
    ulysses_cp/check_attention.py) starts gloo only and never uses CUDA."""
    tree = ast.parse((SCRIPTS.parent / "ulysses_cp" / "check_attention.py").read_text())
    inits = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (_dotted(n.func) or "").endswith("init_process_group")
    ]
    assert inits
    for call in inits:
        backend = call.args[0] if call.args else None
        assert isinstance(backend, ast.Constant) and backend.value == "gloo"
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert "cuda" not in names and not any(isinstance(c, str) and "cuda" in c for c in consts)


# -- device and backend per rank ----------------------------------------------------------

pick = benchlib.pick_device_and_backend


def test_no_cuda_is_cpu_gloo():
    assert pick(0, 0, 1, 0) == ("cpu", "gloo", False)
    assert pick(3, None, 4, 0) == ("cpu", "gloo", False)


def test_one_gpu_per_rank_is_nccl_on_local_rank():
    for r in range(8):
        assert pick(r, r, 8, 8) == (f"cuda:{r}", "nccl", False)


def test_two_nodes_of_four_use_the_local_rank():
    assert pick(5, 1, 8, 4, local_world=4) == ("cuda:1", "nccl", False)
    for r in range(8):
        assert pick(r, r % 4, 8, 4, local_world=4) == (f"cuda:{r % 4}", "nccl", False)
    # 4 ranks on each 8-GPU machine: the global rank modulo the GPUs would be wrong too
    assert pick(5, 1, 8, 8, local_world=4) == ("cuda:1", "nccl", False)


def test_local_rank_defaults_to_rank():
    assert pick(2, None, 4, 4) == ("cuda:2", "nccl", False)


def test_more_ranks_than_gpus_share_them_over_gloo():
    assert pick(0, 0, 2, 1) == ("cuda:0", "gloo", True)
    assert pick(1, 1, 2, 1) == ("cuda:0", "gloo", True)
    assert [pick(r, r, 8, 4)[0] for r in range(8)] == [f"cuda:{r % 4}" for r in range(8)]
    assert {pick(r, r, 8, 4)[1:] for r in range(8)} == {("gloo", True)}  # all ranks agree


def test_local_rank_outside_the_machine_is_an_error():
    with pytest.raises(ValueError):
        pick(4, 4, 8, 4, local_world=4)


def test_device_id_only_for_nccl_with_peers():
    import torch

    cuda0 = torch.device("cuda", 0)
    assert benchlib.init_kwargs("nccl", 8, cuda0) == {"device_id": cuda0}
    assert benchlib.init_kwargs("nccl", 1, cuda0) == {}
    assert benchlib.init_kwargs("gloo", 2, cuda0) == {}
    assert benchlib.init_kwargs("gloo", 2, torch.device("cpu")) == {}


# -- the helpers on gloo ranks ------------------------------------------------------------


def _helpers_on_rank(rank: int) -> dict:
    import torch

    sys.path.insert(0, str(SCRIPTS))
    import benchlib

    cpu = torch.device("cpu")
    benchlib.barrier(cpu)
    benchlib.sync(cpu)
    return {
        "gathered": benchlib.gather_floats([rank, 2**40 + rank, 0.5], cpu),
        "max": benchlib.max_over_ranks(10.0 - rank, cpu),
    }


def test_live_bytes_counts_what_the_work_allocates():
    """CPU peaks without the profiler: new storages count until freed; in-place ops, views
    and tensors that existed before do not; the backward's tensors count too."""
    import torch
    from profiling import peak_memory

    mb = 2**18  # float32 elements in 1 MiB
    before = torch.zeros(mb)
    assert peak_memory(lambda: before.add_(1).view(-1)[:10].mul_(2), scratch=False) == 0

    def three_then_one():
        kept = [torch.empty(mb) for _ in range(3)]  # 3 MiB live at once
        del kept
        torch.empty(mb)  # 1 MiB, after the others were freed

    assert peak_memory(three_then_one, scratch=False) == 3 * 2**20
    x = torch.ones(mb, requires_grad=True)
    # forward alone: x * x (1 MiB, not saved for backward); the backward adds two 1 MiB
    # gradients of x and their sum: seen only if backward allocations are counted
    assert peak_memory(lambda: (x * x).sum(), scratch=False) < 2**20 + 64
    peak = peak_memory(lambda: (x * x).sum().backward(), scratch=False)
    assert 2 * 2**20 <= peak <= 3 * 2**20 + 64, peak
    assert x.grad is not None and peak_memory(lambda: None, scratch=False) == 0


def test_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice():
    """A launcher's master port: not where the OS picks other runs' outgoing connections'
    ports (a port found free there was taken before the rank bound it: EADDRINUSE in the
    SFT example's test, three launches at once), bindable, and new on every call."""
    low, high = benchlib.ephemeral_ports()
    assert 1024 <= low < high
    ports = [benchlib.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < low for port in ports), [p for p in ports if p >= low][:5]
    assert all(benchlib._bindable(port) for port in ports[-5:])
