"""ulysses_cp.context_parallel: PyTorch's experimental context_parallel call, our modes.

References: float64 softmax attention written here on the full tensors (one process), and
the per-rank losses summed over the ranks' shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ulysses_cp as ucp
from tests.support.distributed import WorkerError
from tests.support.helpers import reference as float64_attention
from ulysses_cp.core.sharding import layout_indices

_meshes: dict = {}
SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], sub: tuple[str, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _meshes:  # one mesh per shape in each pool process (groups are collective)
        _meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh = _meshes[key]
    return mesh if sub is None else mesh[sub if len(sub) > 1 else sub[0]]


def _full_qkv(seed: int, b: int, h: int, hkv: int, s: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)]


def reference(q, k, v, causal: bool, scale: float | None, shards: list[torch.Tensor]):
    """Full attention (b, h, s, d) in float64 (``tests.support.helpers.reference``) and the
    gradients of the summed per-rank losses, ``sum_r mean(out[:, :, shard_r] ** 2)``."""

    def loss(out):  # (b, s, h, d): the shard's tokens along dim 1
        return sum(out[:, idx].square().mean() for idx in shards)

    out, *grads, _ = float64_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), loss, causal, softmax_scale=scale
    )
    return tuple(t.transpose(1, 2) for t in (out, *grads))


def _run_example(
    rank,
    shape,
    names,
    sub,
    *,
    hq,
    hkv,
    causal,
    scale,
    seed,
    mode=None,
    dims=None,
    kernel=None,
    gqa=False,
):
    """The issue's example: q/k/v leaves requiring grad, sharded by the context."""
    mesh = _mesh(shape, names, sub)
    dp = 0 if sub is None or "dp" not in names else mesh_dp_rank(shape, names)
    q, k, v = (t.requires_grad_() for t in _full_qkv(seed + dp, 2, hq, hkv, 32, 8))
    ctx_kernel = sdpa_kernel(kernel) if kernel is not None else torch.enable_grad()
    ucp.comm_stats.reset()
    with (
        ctx_kernel,
        ucp.context_parallel(
            mesh, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2), mode=mode, dims=dims
        ) as cp,
    ):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        assert F.scaled_dot_product_attention is not SDPA
    assert F.scaled_dot_product_attention is SDPA
    out.square().mean().backward()
    full = ucp.context_parallel_unshard(mesh, [out.detach()], [2], dims=dims)[0]
    return dict(
        out=out.detach(),
        full=full,
        grads=[t.grad for t in (q, k, v)],
        calls=cp.calls,
        dp=dp,
        bytes=ucp.comm_stats.snapshot(),
    )


def mesh_dp_rank(shape, names) -> int:
    import torch.distributed as dist

    return dist.get_rank() // (shape[1] if names[0] == "dp" else 1)


def _check(results, P, *, hq, hkv, causal, scale, seed, mode, sp_ranks=None):
    by_dp: dict[int, list] = {}
    for i, res in enumerate(results):
        by_dp.setdefault(res["dp"], []).append((i, res))
    for dp, members in by_dp.items():
        q, k, v = _full_qkv(seed + dp, 2, hq, hkv, 32, 8)
        shards = [layout_indices(32, P, s, "zigzag") for s in range(P)]
        out, dq, dk, dv = reference(q, k, v, causal, scale, shards)
        for j, (i, res) in enumerate(members):
            sp = j if sp_ranks is None else sp_ranks[i]
            assert [c[0] for c in res["calls"]] == [mode]
            torch.testing.assert_close(res["out"], out[:, :, shards[sp]], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(res["full"], out, rtol=1e-10, atol=1e-10)
            for got in res["grads"]:
                assert got.shape == (2, got.shape[1], 32, 8)  # the buffer's full shape
        total = [sum(res["grads"][n] for _, res in members) for n in range(3)]
        for got, want in zip(total, (dq, dk, dv)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


CASES = {
    # name: (world, mesh shape, names, sub-mesh, hq, hkv, mode chosen, extra)
    "ulysses P=2": (2, (2,), ("cp",), None, 4, 4, "ulysses", {}),
    "ulysses P=4, GQA": (4, (4,), ("cp",), None, 8, 2, "ulysses", {"gqa": True}),
    "ring P=4 (2 heads do not split over 4)": (4, (4,), ("cp",), None, 2, 2, "ring", {}),
    "ring P=4 by keyword, GQA": (
        4,
        (4,),
        ("cp",),
        None,
        4,
        2,
        "ring",
        {"mode": "ring", "gqa": True},
    ),
    "hybrid (ring, ulysses)": (4, (2, 2), ("ring", "ulysses"), None, 4, 2, "hybrid", {"gqa": True}),
    "hybrid (ulysses, ring)": (4, (2, 2), ("ulysses", "ring"), None, 4, 4, "hybrid", {}),
    "hybrid, dims by keyword": (4, (2, 2), ("a", "b"), None, 2, 2, "hybrid", {"dims": ("b", "a")}),
    "1-D cp beside a dp dim": (4, (2, 2), ("dp", "cp"), ("cp",), 4, 4, "ulysses", {}),
}


@pytest.mark.parametrize("causal,scale", [(True, None), (False, 0.3)])
@pytest.mark.parametrize("case", list(CASES))
def test_modes_match_full_attention(pools, case, causal, scale):
    world, shape, names, sub, hq, hkv, mode, extra = CASES[case]
    results = pools(world).run(
        _run_example, shape, names, sub, hq=hq, hkv=hkv, causal=causal, scale=scale, seed=7, **extra
    )
    P = world // (2 if sub is not None else 1)
    sp_ranks = None
    if len(shape) == 2 and sub is None:  # sp rank = ring index * u + ulysses index
        u_name = extra.get("dims", ("ulysses", "ring"))[0]
        u_axis = names.index(u_name)
        sp_ranks = []
        for rank in range(world):
            a, b = divmod(rank, shape[1])
            ui, ri = (a, b) if u_axis == 0 else (b, a)
            sp_ranks.append(ri * shape[u_axis] + ui)
    _check(
        results, P, hq=hq, hkv=hkv, causal=causal, scale=scale, seed=7, mode=mode, sp_ranks=sp_ranks
    )


def _issue_example(rank, P, dtype):
    """The example of PyTorch's docs as written (torch 2.13's own raises 'cannot resize
    variables that require grad' on entering), in ``dtype``; a float32 loss."""
    mesh = _mesh((P,), ("cp",))
    qkv = [t.to(dtype).requires_grad_() for t in _full_qkv(3, 2, 4, 4, 32, 8)]
    with (
        sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        ucp.context_parallel(mesh, buffers=tuple(qkv), buffer_seq_dims=(2, 2, 2)) as cp,
    ):
        output = F.scaled_dot_product_attention(*qkv, is_causal=True)
    output.float().square().mean().backward()
    full = ucp.context_parallel_unshard(mesh, [output.detach()], [2])[0]
    return dict(out=full, grads=[t.grad for t in qkv], calls=cp.calls)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_example_runs_as_written(pools, P, dtype):
    results = pools(P).run(_issue_example, P, dtype)
    shards = [layout_indices(32, P, s, "zigzag") for s in range(P)]
    # the reference takes the same (rounded) inputs, in float64
    qkv = [t.to(dtype).double() for t in _full_qkv(3, 2, 4, 4, 32, 8)]
    out, *grads = reference(*qkv, True, None, shards)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # measured: 4e-7 and 4.4e-3
    for res in results:
        # FLASH_ATTENTION on CPU -> "auto" -> torch's CPU flash kernel
        assert res["calls"] == [("ulysses", "auto")]
        assert res["out"].dtype == dtype
        assert _relative_error(res["out"], out) < tol
    for n, want in enumerate(grads):
        assert all(res["grads"][n].shape == (2, 4, 32, 8) for res in results)
        got = sum(res["grads"][n].double() for res in results)
        assert _relative_error(got, want) < tol, n


def _titan_style(rank, seed):
    """Buffers without grad (ids, labels, positions) sharded in place; the model's
    parameters get gradients; the output gathered with context_parallel_unshard."""
    mesh = _mesh((4,), ("cp",))
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(50, 32, dtype=torch.float64)
    proj = torch.nn.Linear(32, 96, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 50, (2, 32), generator=g)
    labels = torch.randint(0, 50, (2, 32), generator=g)
    pos = torch.arange(32).expand(2, 32).clone()
    full_ids, full_labels = ids.clone(), labels.clone()
    with ucp.context_parallel(
        mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={labels}
    ):
        inside = dict(ids=ids.clone(), pos=pos.clone())
        q, k, v = proj(emb(ids)).view(2, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # backward inside: the embedding saved the sharded ids, which the exit restores
        out.square().mean().backward()
    full = ucp.context_parallel_unshard(mesh, [out.detach(), inside["pos"]], [2, 1])
    return dict(
        inside=inside,
        ids=ids,
        labels=labels,
        full_ids=full_ids,
        full_labels=full_labels,
        full_out=full[0],
        full_pos=full[1],
        grads=[p.grad for p in (*emb.parameters(), *proj.parameters())],
    )


def test_buffers_without_grad_are_sharded_in_place_and_restored(pools):
    results = pools(4).run(_titan_style, 5)
    torch.manual_seed(5)
    emb = torch.nn.Embedding(50, 32, dtype=torch.float64)
    proj = torch.nn.Linear(32, 96, dtype=torch.float64)
    ids = results[0]["full_ids"]
    q, k, v = proj(emb(ids)).view(2, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    scores = scores.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    shards = [layout_indices(32, 4, s, "zigzag") for s in range(4)]
    sum(out[:, :, idx].square().mean() for idx in shards).backward()
    for r, res in enumerate(results):
        assert torch.equal(res["inside"]["ids"], res["full_ids"][:, shards[r]])
        assert torch.equal(res["inside"]["pos"], torch.arange(32)[shards[r]].expand(2, -1))
        assert torch.equal(res["ids"], res["full_ids"])  # restored on exit
        assert torch.equal(res["labels"], res["full_labels"][:, shards[r]])  # no_restore
        assert torch.equal(res["full_pos"], torch.arange(32).expand(2, 32))
        torch.testing.assert_close(res["full_out"], out.detach(), rtol=1e-10, atol=1e-10)
    want = [p.grad for p in (*emb.parameters(), *proj.parameters())]
    for n, w in enumerate(want):
        torch.testing.assert_close(
            sum(res["grads"][n] for res in results), w, rtol=1e-9, atol=1e-12
        )


def _refused(rank, what):
    mesh = _mesh((2,), ("cp",))
    q, k, v = _full_qkv(1, 1, 2, 2, 16, 8)
    ids = torch.arange(16).view(1, 16)
    kwargs = dict(buffers=[ids], buffer_seq_dims=[1])
    try:
        if what == "odd length":
            with ucp.context_parallel(mesh, buffers=[torch.zeros(1, 14)], buffer_seq_dims=[1]):
                pass
        if what == "dims mismatch":
            with ucp.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1, 2]):
                pass
        if what == "no_restore not a buffer":
            with ucp.context_parallel(mesh, **kwargs, no_restore_buffers={ids.clone()}):
                pass
        if what == "parameter":
            with ucp.context_parallel(
                mesh, buffers=[torch.nn.Parameter(torch.zeros(1, 16))], buffer_seq_dims=[1]
            ):
                pass
        if what == "hybrid on 1-D":
            with ucp.context_parallel(mesh, mode="hybrid"):
                pass
        if what == "ring on 2-D":
            with ucp.context_parallel(_mesh((2, 1), ("ulysses", "ring")), mode="ring"):
                pass
        with ucp.context_parallel(mesh, **kwargs):
            ql, kl, vl = (t[:, :, :8] for t in (q, k, v))
            if what == "mask":
                F.scaled_dot_product_attention(ql, kl, vl, attn_mask=torch.ones(8, 8).bool())
            if what == "dropout":
                F.scaled_dot_product_attention(ql, kl, vl, dropout_p=0.1)
            if what == "gqa without enable_gqa":
                F.scaled_dot_product_attention(ql, kl[:, :1], vl[:, :1])
            if what == "full length":
                F.scaled_dot_product_attention(q, k, v)
            if what == "nested":
                with ucp.context_parallel(mesh):
                    pass
    finally:  # nothing stays patched, and the buffer is whole again
        assert F.scaled_dot_product_attention is SDPA
        assert torch.equal(ids, torch.arange(16).view(1, 16))
    return "no error"


REFUSALS = {
    "odd length": "14 tokens at dim 1: the zigzag layout over 2 ranks needs a multiple of 4",
    "dims mismatch": "1 buffers, 2 seq dims",
    "no_restore not a buffer": "subset of buffers",
    "parameter": "nn.Parameter",
    "mask": r"takes no attn_mask \(got a \(8, 8\) mask\)",
    "dropout": "dropout_p=0.0, got 0.1",
    "gqa without enable_gqa": "query has 2 heads and key/value 1: pass enable_gqa=True",
    "full length": "got query with 16 tokens, the full length",
    "nested": "already active",
    "hybrid on 1-D": "mode='hybrid' does not fit a 1-D mesh",
    "ring on 2-D": "mode='ring' does not fit a 2-D mesh",
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_bad_input_is_refused_on_every_rank(pools, what):
    with pytest.raises(WorkerError, match=REFUSALS[what]) as err:
        pools(2).run(_refused, what)
    assert str(err.value).count("Traceback") == 2  # both ranks raised; none waits


def _math_kernel_is_used(rank):
    mesh = _mesh((2,), ("cp",))
    q, k, v = (t[:, :, :8] for t in _full_qkv(1, 1, 2, 2, 16, 8))
    with sdpa_kernel(SDPBackend.MATH), ucp.context_parallel(mesh) as cp:
        F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), ucp.context_parallel(mesh) as cp2:
        F.scaled_dot_product_attention(q, k, v)
    return cp.calls + cp2.calls


def test_the_chosen_backend_reaches_the_call(pools):
    for calls in pools(2).run(_math_kernel_is_used):
        assert calls == [("ulysses", "math"), ("ulysses", "torch")]


def _rotated(rank, method):
    mesh = _mesh((4,), ("cp",))
    ucp.set_rotate_method(method)
    try:
        qkv = [t.requires_grad_() for t in _full_qkv(4, 2, 2, 2, 32, 8)]
        ucp.comm_stats.reset()
        with ucp.context_parallel(mesh, buffers=qkv, buffer_seq_dims=[2, 2, 2]) as cp:
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        out.square().mean().backward()
        return dict(
            out=out.detach(),
            grads=[t.grad for t in qkv],
            calls=cp.calls,
            bytes=ucp.comm_stats.snapshot(),
        )
    finally:
        ucp.set_rotate_method("alltoall")


@pytest.mark.parametrize("method,op", [("alltoall", "ring"), ("allgather", "kv_allgather")])
def test_rotate_method_picks_the_kv_exchange(pools, method, op):
    results = pools(4).run(_rotated, method)
    shards = [layout_indices(32, 4, s, "zigzag") for s in range(4)]
    out, *grads = reference(*_full_qkv(4, 2, 2, 2, 32, 8), True, None, shards)
    for r, res in enumerate(results):
        assert [c[0] for c in res["calls"]] == ["ring"]  # 2 heads do not split over 4
        assert res["bytes"].get(f"{op}/forward", 0) > 0
        torch.testing.assert_close(res["out"], out[:, :, shards[r]], rtol=1e-10, atol=1e-10)
    for n, want in enumerate(grads):
        got = sum(res["grads"][n] for res in results)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def _build(kind: str):
    """(model, forward(ids, pos) -> logits) with float64 weights from seed 0."""
    torch.manual_seed(0)
    if kind == "decoder":
        from tests.support.helpers import TINY, sdpa_attention
        from ulysses_cp.models.decoder import Decoder

        model = Decoder(TINY, sdpa_attention).double()  # looks up F.sdpa at call time
        return model, lambda ids, pos: model(ids, pos)
    import transformers

    from tests.distributed.test_hf import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float64
    )

    def forward(ids, pos):
        # an all-ones attention_mask: transformers then leaves masking to SDPA's is_causal
        # (without it, a zigzag shard's position ids look like packed documents to it)
        mask = torch.ones_like(ids)
        return model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits

    return model, forward


def _batch(vocab: int):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(vocab, (2, 32), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # shifted, full row
    return ids, labels, torch.arange(32).expand(2, 32).clone()


def _model_under_cp(rank, kind, shape, names, mode):
    """The torchtitan-style step: ids, labels and positions as buffers; each rank's loss is
    its tokens' summed cross-entropy over the global token count, so the losses add up to
    the full loss and the gradients (summed over the CP group) to the full gradient."""
    import torch.distributed as dist

    mesh = _mesh(shape, names)
    model, forward = _build(kind)
    vocab = model.config.vocab_size if kind == "hf" else 256
    ids, labels, pos = _batch(vocab)
    n_tokens = int((labels != -100).sum())
    with ucp.context_parallel(
        mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], mode=mode
    ) as cp:
        logits = forward(ids, pos)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / n_tokens).backward()
    total = (loss / n_tokens).detach()
    dist.all_reduce(total)  # the loss to log: all-reduced over the CP group
    grads = {n: p.grad for n, p in model.named_parameters()}
    return dict(loss=total, grads=grads, calls=cp.calls)


MODEL_CASES = {
    "ulysses 1-D": ((4,), ("cp",), None, "ulysses"),
    "ring 1-D": ((4,), ("cp",), "ring", "ring"),
    "hybrid 2-D": ((2, 2), ("ring", "ulysses"), None, "hybrid"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
@pytest.mark.parametrize("kind", ["decoder", "hf"])
def test_a_model_under_the_context_equals_one_process(pools, kind, case):
    if kind == "hf":
        pytest.importorskip("transformers")
    shape, names, mode, want_mode = MODEL_CASES[case]
    results = pools(4).run(_model_under_cp, kind, shape, names, mode)
    model, forward = _build(kind)
    vocab = model.config.vocab_size if kind == "hf" else 256
    ids, labels, pos = _batch(vocab)
    loss = F.cross_entropy(forward(ids, pos).flatten(0, 1), labels.flatten())
    loss.backward()
    n_layers = 2
    for res in results:
        assert [c[0] for c in res["calls"]] == [want_mode] * n_layers
        torch.testing.assert_close(res["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        got = sum(res["grads"][name] for res in results)
        torch.testing.assert_close(got, p.grad, rtol=1e-8, atol=1e-12, msg=name)
