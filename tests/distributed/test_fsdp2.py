"""FSDP2 (``fully_shard``) with sequence parallelism through ``ucp.fsdp_mesh``: 4 gloo
ranks, float64, against one process.

Each rank builds the model, ``fully_shard``s it over the mesh the helper gives, runs its
data-parallel replica's rows through ``ucp.attention`` (the reference decoder, a Hugging
Face Llama and Qwen3 through the attention registration) or through
``ucp.context_parallel`` (the drop-in), and backpropagates once. FSDP2's own reduction is
the only one: the gathered gradient (``full_tensor()``) must equal the gradient of one
process with PyTorch's SDPA on every replica's rows (the mean of the replicas' mean
losses). Two broken set-ups must fail that comparison: the sequence-parallel ranks left
out of the sharding group, and a loss scaled twice."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.distributed import WorkerError
from tests.support.helpers import HF_TINY, TINY, sdpa_attention

TOL = dict(rtol=1e-10, atol=1e-10)
ROWS, SEQ = 2, 32  # per data-parallel replica
_meshes: dict = {}


def _fm(dp: int, u: int, r: int):
    """One helper mesh per degrees per pool process (group creation is collective)."""
    if (dp, u, r) not in _meshes:
        _meshes[(dp, u, r)] = ucp.fsdp_mesh(dp, u, r, backend="math")
    return _meshes[(dp, u, r)]


def _hf_config(kind: str):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**HF_TINY)
    return transformers.Qwen3Config(**{**HF_TINY, "head_dim": 16})  # 16 x 4 heads != 32


def _models(kind: str, topo, path: str):
    """(model under test, its layers, one-process SDPA reference) with the same float64
    weights; ``path``: ``"attention"`` (ucp.attention / the HF registration) or
    ``"context_parallel"`` (the drop-in: the model calls SDPA)."""
    torch.manual_seed(0)
    if kind == "decoder":
        from ulysses_cp.models.decoder import Decoder

        attn = ucp.Attention(topo) if path == "attention" else sdpa_attention
        model = Decoder(TINY, attn).double()
        ref = Decoder(TINY, sdpa_attention).double()
        ref.load_state_dict(model.state_dict())
        return model, list(model.layers), ref
    import transformers

    from ulysses_cp.models import hf

    hf.register_attention(topo, backend="math")
    cfg = _hf_config(kind)
    impl = "ulysses_cp" if path == "attention" else "sdpa"
    sp = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.float64
    )
    ref = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float64
    )
    ref.load_state_dict(sp.state_dict())
    if path != "attention":  # the drop-in: the model itself, calling SDPA
        return sp, list(sp.model.layers), ref
    model = hf.HFCausalLM(sp, topo=topo)
    model.probe()  # collective on the SP group: before sharding, as build_model does
    return model, list(sp.model.layers), ref


def _rows(vocab: int, dp: int, seed: int = 2) -> torch.Tensor:
    """The global batch: ``dp`` replicas of ``ROWS`` rows, replica d at rows [d*ROWS, ...)."""
    return torch.randint(vocab, (dp * ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _reference(ref, kind: str, ids: torch.Tensor, dp: int):
    """One process: the mean over the replicas of each replica's token-mean loss."""
    losses = []
    for d in range(dp):
        x = ids[d * ROWS : (d + 1) * ROWS]
        pos = torch.arange(SEQ).expand_as(x)
        logits = ref(x, pos) if kind == "decoder" else ref(input_ids=x).logits
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()))
    loss = sum(losses) / dp
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _step(rank, kind: str, dp: int, u: int, r: int, path: str = "attention", broken=None):
    """One FSDP2 step on this rank; returns its replica's loss, every parameter's full
    gradient (gathered by FSDP) and the reference's. ``broken``: ``"sp left out"`` shards
    over the data-parallel dim only; ``"doubled scale"`` multiplies the loss by 2."""
    from torch.distributed.fsdp import fully_shard

    fm = _fm(dp, u, r)
    topo = fm.topology
    model, layers, ref = _models(kind, topo, path)
    mesh = fm.mesh["dp"] if broken == "sp left out" else fm.shard_mesh
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    vocab = TINY.vocab_size if kind == "decoder" else HF_TINY["vocab_size"]
    ids = _rows(vocab, dp)
    mine = ids[topo.dp_rank * ROWS : (topo.dp_rank + 1) * ROWS]
    factor = 2.0 if broken == "doubled scale" else 1.0
    calls = None  # the drop-in's (mode, backend) per SDPA call
    if path == "attention":
        local = ucp.shard_batch({"input_ids": mine, "labels": mine}, topo)
        args = (local["input_ids"], local["position_ids"])
        if kind == "decoder":
            logits = model(*args, local["batch"])
            loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
        else:
            loss = model.loss(*args, local["shift_labels"], topo, batch=local["batch"])
        (loss * factor).backward()
        replica_loss = loss.detach()
    else:  # the drop-in: a hand-written loss, scaled by the rule
        labels = torch.cat([mine[:, 1:], torch.full_like(mine[:, :1], -100)], dim=1)
        n_tokens = int((labels != -100).sum())  # of the replica's whole rows
        pos = torch.arange(SEQ).expand_as(mine).clone()
        x = mine.clone()
        buffers = dict(buffers=[x, labels, pos], buffer_seq_dims=[1, 1, 1])
        with ucp.context_parallel(fm.cp_mesh, **buffers) as cp:
            if kind == "decoder":
                logits = model(x, pos)
            else:  # all-ones mask: transformers leaves the causal mask to SDPA's is_causal
                mask = torch.ones_like(x)
                out = model(input_ids=x, position_ids=pos, attention_mask=mask, use_cache=False)
                logits = out.logits
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            share = ce / n_tokens
            (share * fm.loss_scale * factor).backward()
        replica_loss = share.detach().clone()
        torch.distributed.all_reduce(replica_loss, group=topo.sp_group)  # for the log only
        calls = [mode for mode, _ in cp.calls]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if kind != "decoder" and path == "attention":  # HFCausalLM(model): "model." first
        grads = {n.removeprefix("model."): g for n, g in grads.items()}
    ref_loss, ref_grads = _reference(ref, kind, ids, dp)
    want = {n: ref_grads[n] for n in grads}
    shards = {p.device_mesh.size() for p in model.parameters()}  # ranks each is sharded over
    return dict(
        loss=replica_loss,
        grads=grads,
        ref_loss=ref_loss,
        ref_grads=want,
        mode=topo.mode,
        shards=shards,
        calls=calls,
    )


def _named(name: str):
    return lambda message: f"{name}: {message}"


def _assert_one_process(results, dp: int) -> None:
    ref_grads = results[0]["ref_grads"]
    assert len(ref_grads) == len(results[0]["grads"]) > 0
    logged = sum(res["loss"] for res in results) / len(results)  # mean over replicas
    torch.testing.assert_close(logged, results[0]["ref_loss"], **TOL)
    for res in results:
        for name, want in ref_grads.items():
            torch.testing.assert_close(res["grads"][name], want, **TOL, msg=_named(name))


LAYOUTS = {"dp2 x u2": (2, 2, 1, "ulysses"), "u2 x r2": (1, 2, 2, "hybrid")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["decoder", "llama", "qwen3"])
def test_fully_shard_with_attention_equals_one_process(pools, kind, layout):
    if kind != "decoder":
        pytest.importorskip("transformers")
    dp, u, r, mode = LAYOUTS[layout]
    results = pools(4).run(_step, kind, dp, u, r)
    assert {res["mode"] for res in results} == {mode}
    assert all(res["shards"] == {4} for res in results)  # over dp x sp: every rank
    _assert_one_process(results, dp)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["decoder", "llama"])
def test_fully_shard_with_the_context_parallel_drop_in_equals_one_process(pools, kind, layout):
    if kind != "decoder":
        pytest.importorskip("transformers")
    dp, u, r, mode = LAYOUTS[layout]
    results = pools(4).run(_step, kind, dp, u, r, "context_parallel")
    assert all(res["shards"] == {4} for res in results)
    assert all(res["calls"] == [mode] * 2 for res in results)  # one call per layer
    _assert_one_process(results, dp)


@pytest.mark.parametrize("broken", ["sp left out", "doubled scale"])
@pytest.mark.parametrize("path", ["attention", "context_parallel"])
def test_a_broken_reduction_or_scale_is_caught(pools, path, broken):
    """The comparison above fails for the two mistakes the rule is about."""
    results = pools(4).run(_step, "decoder", 2, 2, 1, path, broken)
    with pytest.raises(AssertionError):
        _assert_one_process(results, 2)
    if broken == "doubled scale":  # exactly twice the gradient
        for name, want in results[0]["ref_grads"].items():
            got = results[0]["grads"][name]
            torch.testing.assert_close(got, 2 * want, **TOL, msg=_named(name))


def _train(rank, dp: int, u: int, r: int, steps: int):
    """``steps`` SGD steps of the decoder under FSDP2 and of one process, a new global
    batch each step: (the FSDP2 replicas' mean losses, the reference's, both final weights)."""
    from torch.distributed.fsdp import fully_shard

    fm = _fm(dp, u, r)
    topo = fm.topology
    model, layers, ref = _models("decoder", topo, "attention")
    for layer in layers:
        fully_shard(layer, mesh=fm.shard_mesh)
    fully_shard(model, mesh=fm.shard_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for step in range(steps):
        ids = _rows(TINY.vocab_size, dp, seed=10 + step)
        mine = ids[topo.dp_rank * ROWS : (topo.dp_rank + 1) * ROWS]
        local = ucp.shard_batch({"input_ids": mine, "labels": mine}, topo)
        logits = model(local["input_ids"], local["position_ids"], local["batch"])
        loss = ucp.sequence_parallel_cross_entropy(logits, local["shift_labels"], topo)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach() / dp
        torch.distributed.all_reduce(logged, group=topo.dp_group)  # the replicas' mean
        losses.append(logged)
        ref_losses.append(_reference(ref, "decoder", ids, dp)[0])
        ref_opt.step()
        ref_opt.zero_grad()
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return dict(losses=losses, ref_losses=ref_losses, weights=weights, ref=ref.state_dict())


def test_training_steps_under_fully_shard_follow_one_process(pools):
    """Three SGD steps at u2 x r2 and at dp2 x u2: every step's loss and the final weights."""
    for dp, u, r in ((1, 2, 2), (2, 2, 1)):
        for res in pools(4).run(_train, dp, u, r, 3):
            torch.testing.assert_close(
                torch.stack(res["losses"]), torch.stack(res["ref_losses"]), **TOL
            )
            assert res["losses"][2] != res["losses"][0]  # the weights moved
            for name, want in res["ref"].items():
                torch.testing.assert_close(res["weights"][name], want, **TOL, msg=_named(name))


def _mesh_with(rank, dp, u, r):
    ucp.fsdp_mesh(dp, u if u != "by rank" else 1 + rank % 2, r)


BAD_SIZES = {
    "product": ((3, 2, 1), "dp(3) * ulysses(2) * ring(1) = 6 ranks, but the world has 4"),
    "divide": ((None, 3, 1), "ulysses(3) * ring(1) = 3 does not divide the world size (4)"),
    "zero": ((None, 0, 1), "ulysses must be a positive integer, got 0"),
    "disagree": ((None, "by rank", 1), "the ranks disagree on the sizes"),
}


@pytest.mark.parametrize("case", list(BAD_SIZES))
def test_bad_sizes_are_refused_on_every_rank(pools, case):
    sizes, text = BAD_SIZES[case]
    with pytest.raises(WorkerError) as err:
        pools(4).run(_mesh_with, *sizes)
    assert str(err.value).count(text) == 4, str(err.value)[-2000:]


def _sizes(rank):
    fm = _fm(2, 2, 1)
    t = fm.topology
    return dict(
        dp=fm.dp,
        sp=fm.sp,
        scale=fm.loss_scale,
        grad_scale=t.grad_scale,
        sp_rank=t.sp_rank,
        shard=fm.shard_mesh.size(),
        cp=tuple(fm.cp_mesh.mesh_dim_names),
        ulysses=torch.distributed.get_process_group_ranks(t.ulysses_group),
        dp_group=torch.distributed.get_process_group_ranks(t.dp_group),
    )


def test_the_mesh_and_the_topology_agree(pools):
    """Ranks in the topology's groups are the mesh's: ulysses {0,1},{2,3}; dp {0,2},{1,3}."""
    got = pools(4).run(_sizes)
    for rank, g in enumerate(got):
        assert (g["dp"], g["sp"], g["scale"], g["grad_scale"], g["shard"]) == (2, 2, 2.0, 2.0, 4)
        assert g["sp_rank"] == rank % 2 and g["cp"] == ("ring", "ulysses")
        assert g["ulysses"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert g["dp_group"] == [rank % 2, rank % 2 + 2]
