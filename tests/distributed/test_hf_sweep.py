"""The family sweep: every decoder family transformers 5 ships (tests/support/hf_zoo.py), built tiny
and random, under hybrid sequence parallelism 2 x 2 (the all-to-all and the ring), is
either exact (the one-process loss and, summed over the SP ranks, the one-process
gradients, float64 where the family runs in it) or refused on every rank with the same
message. Anything else fails: a silently wrong family, a crash, or a refusal on some ranks
only. ``VERDICTS`` pins which way each family goes (docs/reference/families.md is this table), so a
family that changes sides is seen; the families the issue names run in every mode."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.support.helpers import topology

transformers = pytest.importorskip("transformers")
from tests.support.hf_zoo import (  # noqa: E402
    FAMILIES,
    has_router_loss,
    tiny_config,
    wake_zero_params_,
    with_router_loss,
)
from ulysses_cp.models import hf  # noqa: E402

pytestmark = pytest.mark.slow
IDS = torch.randint(90, (2, 64), generator=torch.Generator().manual_seed(1))
AUX_COEF = 0.5  # the MoE load-balancing loss's coefficient where the sweep turns it on


def _reference(cfg, dtype, state):
    """The one-process model: sdpa (float64 softmax) where the family has it, else eager."""
    auto = transformers.AutoModelForCausalLM
    for impl in ("sdpa", "eager"):
        try:
            ref = auto.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
        except (ValueError, ImportError, KeyError):
            continue
        ref.load_state_dict(state)
        return ref, impl
    raise AssertionError("no reference implementation")


def _sweep(rank, family, u, r, aux=False):
    """``aux``: the family's MoE load-balancing loss on (coefficient 0.5); the reference is
    then transformers' own ``model(labels=...)`` loss, which adds it."""
    fam = FAMILIES[family]
    topo = topology(u, r)
    hf.register_attention(topo, backend="math")
    cfg = tiny_config(family)
    if aux:
        cfg = with_router_loss(cfg, AUX_COEF)
    torch.manual_seed(0)
    try:
        sp = hf.from_config(cfg, dtype=fam.dtype)
        wake_zero_params_(sp)
        model = hf.HFCausalLM(sp)
        model.probe()
    except ValueError as exc:
        return "refused", str(exc), {}
    if family in STOCHASTIC:  # compare the deterministic (eval) forward
        sp.eval()
    # the loss and the summed gradients are the same on every rank: rank 0 alone compares
    ref, own_error = None, 0.0
    if dist.get_rank() == 0:
        ref, impl = _reference(cfg, fam.dtype, sp.state_dict())
        if family in STOCHASTIC:
            ref.eval()
        out = ref(input_ids=IDS)
        logits = out.logits.double()
        want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
        if aux and getattr(out, "aux_loss", None) is not None:  # the family's own term
            want = want + AUX_COEF * out.aux_loss
            with torch.no_grad():  # the family adds exactly AUX_COEF x its aux loss
                own = ref(input_ids=IDS, labels=IDS).loss.item()
            own_error = abs(own - want.item()) / abs(own)
        want.backward()
    local = hf.shard_batch({"input_ids": IDS, "labels": IDS}, topo)
    loss = model.loss(
        local["input_ids"], local["position_ids"], local["shift_labels"], topo, batch=local["batch"]
    )
    loss.backward()
    grads = []
    for name, p in sp.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)  # the SP ranks' shares sum to the gradient
        grads.append((name, grad))
    if ref is None:
        return "exact", None, {}
    errors = {"loss": abs(loss.item() - want.item()) / abs(want.item()), "own loss": own_error}
    pairs = [
        (name, grad, torch.zeros_like(q) if q.grad is None else q.grad)
        for (name, grad), q in zip(grads, ref.parameters())
    ]
    # relative to each gradient's largest entry, with a floor for gradients that are zero
    # in exact arithmetic (a key bias shifts every score of a row: the softmax cancels it)
    floor = 1e-6 * max(g.abs().max().item() for _, _, g in pairs)
    for name, grad, ref_grad in pairs:
        scale = max(ref_grad.abs().max().item(), floor, 1e-30)
        errors[name] = (grad - ref_grad).abs().max().item() / scale
    return "exact", impl, errors


# training forwards that sample per token (PhiMoE's sparsemixer routing draws Gumbel noise
# and Heun masks): under SP each rank draws for its own tokens, the same distribution as
# one process but not the same draws, so the sweep compares their eval forward
STOCHASTIC = {"phimoe"}


def bound(family: str) -> float:
    """Relative error bound. Float64 models still take parts in float32 (eager attention's
    softmax, norms, MoE routers, the gated delta rule): up to ~4e-7 of the largest gradient
    entry here. A wrong family is off by far more: a skipped logit scale 17x, a convolution
    on a shard 45%, Llama 4's temperature from local positions 2e-4."""
    return 1e-4 if FAMILIES[family].dtype == torch.float32 else 1e-5


def check(results, family):
    verdicts = {v for v, _, _ in results}
    assert len(verdicts) == 1, f"{family}: ranks disagree: {[v for v, _, _ in results]}"
    verdict = verdicts.pop()
    if verdict == "refused":
        messages = {m for _, m, _ in results}
        assert len(messages) == 1, f"{family}: refused with different messages: {messages}"
        return verdict, messages.pop()
    impl = results[0][1]
    worst = {}
    for _, _, errors in results:
        for name, err in errors.items():
            worst[name] = max(worst.get(name, 0.0), err)
    bad = {n: e for n, e in worst.items() if e > bound(family)}
    assert not bad, f"{family} ({impl} reference) is silently wrong: {bad}"
    return verdict, max(worst.values())


# the families that train exactly (docs/reference/families.md lists every family and why the
# rest are refused); a family changing sides fails here until the table says so
EXACT_NAMES = """
    afmoe apertus apertus1p5_text arcee aria_text axk1 bamba beam bert bert-generation biogpt
    bitnet codegen cohere cohere2 cohere2_moe cohere_compass_text ctrl cwm dbrx deepseek_v2
    deepseek_v3 diffllama dory dots1 emu3 ernie ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe
    falcon_h1 falcon_mamba flex_olmo flint gemma gemma2 gemma3_text gemma3n_text gemma4_text
    gemma4_unified_text glm glm4 glm4_moe glm4_moe_lite gpt-sw3 gpt2 gpt_bigcode gpt_neox
    gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared
    helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax internlm3 iquestcoder
    jais2 jamba jetmoe kimi_linear kolibri1 laguna lfm2 lfm2_moe llama llama4_text longcat_flash
    mamba mamba2 mellum mimo_v2_flash minicpm3 minimax minimax_m2 minimax_m3_vl_text ministral
    ministral3 mistral mixtral mllama moshi nanochat nemotron nemotron_h olmo olmo2 olmo3 olmoe
    opt persimmon phi phi3 phi4_multimodal qwen2 qwen2_moe qwen3 qwen3_5_moe_text qwen3_5_text
    qwen3_moe qwen3_next roc_bert sarvam_mla sarvam_moe seed_oss smollm3 solar_open stablelm
    starcoder2 vaultgemma whisper youtu zamba zamba2
"""
EXACT = set(EXACT_NAMES.split())
# the families the hybrid and head work names: exact in every mode, not only hybrid 2 x 2
NAMED = [
    "cohere",
    "cohere2",
    "granite",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_text",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "lfm2",
    "lfm2_moe",
    "mamba",
    "falcon_mamba",
    "jamba",
    "mamba2",
    "zamba",
    "zamba2",
    "kimi_linear",
    "minimax",
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_exact_or_refused(pools, family):
    verdict, detail = check(pools(4).run(_sweep, family, 2, 2), family)
    print(f"SWEEP {family}: {verdict}: {detail}")
    assert verdict == ("exact" if family in EXACT else "refused"), detail


@pytest.mark.parametrize("u,r", [(4, 1), (1, 4)], ids=str)
@pytest.mark.parametrize("family", NAMED)
def test_named_families_are_exact_in_every_mode(pools, family, u, r):
    verdict, detail = check(pools(4).run(_sweep, family, u, r), family)
    assert verdict == "exact", detail


# MLA at DeepSeek-V3's proportions (q/k heads 12 wide, values 8; tests/support/hf_zoo.py): Ulysses
# and ring alone too
MLA_FAMILIES = ["deepseek_v3", "glm4_moe_lite", "minicpm3"]


@pytest.mark.parametrize("u,r", [(2, 1), (1, 2)], ids=str)
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_families_are_exact_in_every_mode(pools, family, u, r):
    cfg = tiny_config(family)
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    verdict, detail = check(pools(4).run(_sweep, family, u, r), family)
    assert verdict == "exact", detail


# the MoE families (a config with output_router_logits): with the load-balancing loss on,
# the exact ones stay exact, its term included (docs/reference/families.md, "MoE families")
MOE = sorted(f for f in FAMILIES if has_router_loss(f))


@pytest.mark.parametrize("family", MOE)
def test_moe_family_is_exact_with_its_router_loss_or_refused(pools, family):
    verdict, detail = check(pools(4).run(_sweep, family, 2, 2, True), family)
    print(f"MOE SWEEP {family}: {verdict}: {detail}")
    assert verdict == ("exact" if family in EXACT else "refused"), detail
