"""MoE models under sequence parallelism: the router's load-balancing loss over the whole
sequence, against transformers' own one-process loss (``model(labels=...)`` with
``output_router_logits``: cross-entropy + coefficient x aux) and its gradients, float64;
the loss alone against ``load_balancing_loss_func`` with padding; the terms refused."""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import ulysses_cp as ucp
from tests.support.helpers import shard_loss, topology

transformers = pytest.importorskip("transformers")
from tests.support.hf_zoo import tiny_config, wake_zero_params_, with_router_loss  # noqa: E402
from ulysses_cp.config import HFModelConfig  # noqa: E402
from ulysses_cp.models import hf  # noqa: E402

COEF = 0.5
IDS = torch.randint(90, (2, 64), generator=torch.Generator().manual_seed(1))
# the families the issue names: plain MoE (Qwen3-MoE, Mixtral, OLMoE), GDN + MoE
# (Qwen3-Next), sinks + biased router (GPT-OSS)
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss"]


def moe_config(family: str, coef: float = COEF):
    return with_router_loss(tiny_config(family), coef)


def moe_pair(family: str, topo, coef: float = COEF):
    """(SP model, one-process sdpa/eager reference), the same float64 weights."""
    hf.register_attention(topo, backend="math")
    cfg = moe_config(family, coef)
    torch.manual_seed(0)
    sp = hf.from_config(cfg, dtype=torch.float64)
    wake_zero_params_(sp)
    auto = transformers.AutoModelForCausalLM
    for impl in ("sdpa", "eager"):
        try:
            ref = auto.from_config(
                copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.float64
            )
            break
        except (ValueError, ImportError, KeyError):
            continue
    ref.load_state_dict(sp.state_dict())
    return sp, ref


def _summed_grads(model, group) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g, group=group)  # the SP ranks' shares sum to the gradient
        out[name] = g
    return out


def _worst(grads: dict, ref) -> float:
    """The largest gradient error, relative to each gradient's largest entry (parameters
    paired in order: a tiled MLP renames the SP model's)."""
    refs = [p.grad for p in ref.parameters()]
    floor = 1e-6 * max(g.abs().max().item() for g in refs if g is not None)
    worst = 0.0
    for g, want in zip(grads.values(), refs, strict=True):
        want = torch.zeros_like(g) if want is None else want
        worst = max(worst, (g - want).abs().max().item() / max(want.abs().max().item(), floor))
    return worst


def _family_exact(rank, family, u, r, packed):
    topo = topology(u, r)
    sp, ref = moe_pair(family, topo)
    model = hf.HFCausalLM(sp)
    assert model.router is not None and model.router.enabled and model.router.coef == COEF
    if packed:  # two documents in one row, against each run alone by one process
        row, cu = IDS[:1], torch.tensor([0, 24, 64], dtype=torch.int32)
        docs = [row[:, :24], row[:, 24:]]
        outs = [ref(input_ids=d, output_router_logits=True) for d in docs]
        ce = sum(
            torch.nn.functional.cross_entropy(o.logits[0, :-1], d[0, 1:], reduction="sum")
            for o, d in zip(outs, docs)
        )
        # the family's own loss over both documents' router logits (the packed row's rows)
        layers = zip(*(o.router_logits for o in outs))
        logits = tuple(torch.cat(per_layer) for per_layer in layers)
        func = sys.modules[type(ref).__module__].load_balancing_loss_func
        aux = func(logits, model.router.num_experts, model.router.top_k, None)
        out = SimpleNamespace(aux_loss=aux)
        want = ce / (row.shape[1] - 2) + COEF * aux
        want.backward()
        pos = torch.cat([torch.arange(24), torch.arange(40)])[None]
        targets = torch.cat([row[:, 1:], torch.full((1, 1), -100)], 1)
        targets[0, 23] = -100  # no target across the border
        batch = {"input_ids": row, "shift_labels": targets, "position_ids": pos}
        local = ucp.shard_batch({**batch, "cu_seqlens": cu}, topo)
    else:  # the cross-entropy in float64 (transformers' own casts the logits to float32)
        out = ref(input_ids=IDS)
        ce = torch.nn.functional.cross_entropy(
            out.logits[0:, :-1].flatten(0, 1), IDS[:, 1:].flatten()
        )
        want = ce + COEF * out.aux_loss
        with torch.no_grad():  # the family adds exactly COEF x its aux loss
            own = ref(input_ids=IDS, labels=IDS).loss
        assert abs(own.item() - want.item()) < 1e-6 * own.item()
        want.backward()
        local = ucp.shard_batch({"input_ids": IDS, "labels": IDS}, topo)
    loss = model.loss(
        local["input_ids"], local["position_ids"], local["shift_labels"], topo, batch=local["batch"]
    )
    loss.backward()
    grads = _summed_grads(sp, topo.sp_group)
    with torch.no_grad():  # the aux value alone
        model(local["input_ids"], local["position_ids"], local["batch"])
        aux = model.aux_loss()
    return {
        "loss": abs(loss.item() - want.item()) / abs(want.item()),
        "aux": abs(aux.item() - out.aux_loss.item()) / abs(out.aux_loss.item()),
        "grad": _worst(grads, ref),
        "aux_share": COEF * out.aux_loss.item() / want.item(),
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("u,r", [(2, 1), (1, 2), (2, 2)])
def test_moe_loss_and_gradients_equal_one_process(pools, family, u, r):
    """The loss with its load-balancing term, that term alone, and every gradient equal
    transformers' own one-process model, at u2, r2 and u2 x r2 (float64; routers and
    norms run float32 parts: ~1e-7)."""
    for res in pools(u * r).run(_family_exact, family, u, r, False):
        assert res["aux_share"] > 0.05, res  # the term is a visible part of the loss
        assert res["loss"] < 1e-6 and res["aux"] < 1e-6 and res["grad"] < 1e-5, res


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_moe_packed_row_equals_one_process(pools, family):
    for res in pools(4).run(_family_exact, family, 2, 2, True):
        assert res["loss"] < 1e-6 and res["aux"] < 1e-6 and res["grad"] < 1e-5, res


def _memory_features(rank, family):
    topo = topology(2, 1)
    sp, ref = moe_pair(family, topo)
    out = ref(input_ids=IDS)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
    (ce + COEF * out.aux_loss).backward()
    mc = HFModelConfig(
        hf_config={"model_type": family},
        dtype="float64",
        activation_checkpointing=True,
        tiled_mlp=4,  # the router runs on 4 pieces of each layer's tokens
        tiled_loss=2,
        fused_loss=True,
    )
    model = hf.wrap(sp, topo, mc)
    local = ucp.shard_batch({"input_ids": IDS, "labels": IDS}, topo)
    loss = shard_loss(model, local, topo, tiled_loss=2, fused_loss=True)
    loss.backward()
    want = ce + COEF * out.aux_loss
    return abs(loss.item() - want.item()) / want.item(), _worst(
        _summed_grads(sp, topo.sp_group), ref
    )


def test_moe_router_loss_under_memory_features(pools):
    """Checkpointed layers (the routers run again in backward), MLP tiles (each layer's
    router sees 4 pieces of the tokens) and the fused head keep the loss exact."""
    for loss_err, grad_err in pools(2).run(_memory_features, "qwen3_moe"):
        assert loss_err < 1e-6 and grad_err < 1e-5, (loss_err, grad_err)


def _built(family: str, **fields):
    cfg = tiny_config(family)
    for key, value in fields.items():
        setattr(cfg.get_text_config(), key, value)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _refused(rank):
    topo = topology(2, 1)
    hf.register_attention(topo, backend="math")
    cfg = tiny_config("bamba")
    cfg.z_loss_coefficient = 0.1
    with pytest.raises(ValueError) as info:
        hf.HFCausalLM(hf.from_config(cfg, dtype=torch.float64))
    return str(info.value)


def test_an_uncomputed_loss_term_is_refused_on_every_rank(pools):
    messages = set(pools(2).run(_refused))
    assert len(messages) == 1 and "z_loss_coefficient" in messages.pop()


def _padded(rank, family):
    """Rows of 64 and 52 tokens, right-padded, and the packing multiple's padding: the aux
    loss over the real tokens alone, its value and gradients (float64)."""
    topo = topology(2, 2)
    sp, ref = moe_pair(family, topo)
    mask = torch.ones_like(IDS)
    mask[1, 52:] = 0
    out = ref(input_ids=IDS, attention_mask=mask)
    out.aux_loss.backward()  # transformers excludes the padding through the mask
    model = hf.HFCausalLM(sp)
    labels = IDS.masked_fill(mask == 0, -100)
    batch = {"input_ids": IDS, "labels": labels, "token_mask": mask}
    local = ucp.shard_batch(batch, topo)
    model(local["input_ids"], local["position_ids"], local["batch"])
    aux = model.aux_loss(local["token_mask"])
    aux.backward()
    err = abs(aux.item() - out.aux_loss.item()) / out.aux_loss.item()
    return err, _worst(_summed_grads(sp, topo.sp_group), ref)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_router_loss_with_padding_equals_one_process(pools, family):
    for err, grad in pools(4).run(_padded, family):
        assert err < 1e-6 and grad < 1e-5, (err, grad)


def _per_shard(rank):
    """The loss taken on each shard alone (the all-reduce skipped): not the one-process
    loss. The check above would see it."""
    from ulysses_cp.models import router_loss

    saved = router_loss.group_size
    router_loss.group_size = lambda group: 1
    try:
        return _family_exact(rank, "qwen3_moe", 2, 1, False)
    finally:
        router_loss.group_size = saved


def test_moe_check_sees_a_per_shard_router_loss(pools):
    for res in pools(2).run(_per_shard):
        assert res["aux"] > 1e-4 and res["grad"] > 1e-3, res
