"""``"offload_activations": n``: the checkpointed inputs of the first ``n`` decoder layers
wait on CPU, the rest stay on the device. Refused when it cannot mean anything, exact (it
moves bytes, nothing else), applied to the Hugging Face models' layers too, and searched by
the planner when the host cannot take every layer's input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import ulysses_cp as ucp
from tests.support.helpers import ROOT, TINY, offloaded_inputs
from ulysses_cp.config import HFModelConfig, ModelConfig, RunConfig
from ulysses_cp.core.offload import offloaded_layers
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.plan.cli import plan, table
from ulysses_cp.plan.search import GiB, Hardware, ZeroKnobs, predict
from ulysses_cp.plan.shapes import model_shape
from ulysses_cp.plan.written import base_run


def test_settings_and_refusals_name_the_numbers():
    assert [offloaded_layers(s, 4) for s in (True, False, 0, 3, 4)] == [4, 0, 0, 3, 4]
    ok = ModelConfig.from_dict(
        {"n_layers": 3, "activation_checkpointing": True, "offload_activations": 2}
    )
    assert ok.offload_activations == 2
    with pytest.raises(ValueError, match="5 layers asked for, the model has 3 decoder layers"):
        ModelConfig.from_dict(
            {"n_layers": 3, "activation_checkpointing": True, "offload_activations": 5}
        )
    with pytest.raises(ValueError, match="a number of layers >= 0, got -1"):
        HFModelConfig.from_dict(
            {"hf_config": "x", "activation_checkpointing": True, "offload_activations": -1}
        )
    with pytest.raises(ValueError, match=r"needs model\.activation_checkpointing"):
        ModelConfig.from_dict({"offload_activations": 1})
    with pytest.raises(ValueError, match=r"must be true or false or an integer, got .2."):
        ModelConfig.from_dict({"activation_checkpointing": True, "offload_activations": "2"})


def test_partial_offload_is_exact_and_offloads_the_first_layers():
    topo = ucp.init_topology(1, 1)
    ids = torch.randint(TINY.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    results = []
    for offload, want in ((False, 0), (2, 2), (True, 4)):
        mc = replace(TINY, n_layers=4, activation_checkpointing=True, offload_activations=offload)
        torch.manual_seed(0)
        model = Decoder(mc, ucp.Attention(topo, backend="math")).double()
        logits = model(ids, pos)
        kept = offloaded_inputs(logits)
        assert len(kept) == want
        if want:  # the first layer's input (the embedding's output) is among them
            assert any(torch.equal(x, model.embed(ids)) for x in kept)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hugging_face_layers_take_the_count():
    pytest.importorskip("transformers")
    from ulysses_cp.models import hf

    topo = ucp.init_topology(1, 1)
    ids = torch.randint(256, (1, 32))
    for offload, want in ((1, 1), (True, 2)):
        mc = HFModelConfig(
            hf_config="configs/hf/tiny_llama.json",
            activation_checkpointing=True,
            offload_activations=offload,
        )
        model = hf.build_model(topo, mc, backend="math")
        model.train()
        logits = model(ids, torch.arange(32)[None])
        assert len(offloaded_inputs(logits)) == want
    mc = replace(mc, offload_activations=3)
    with pytest.raises(ValueError, match="3 layers asked for, the model has 2"):
        hf.build_model(topo, mc, backend="math")


def test_the_planner_finds_the_count_the_host_can_take():
    """A host that holds the inputs of about half the layers: the config as written (every
    layer offloaded) is bound by the host; the planner names a count that reaches further,
    and at that count and length both the GPU and the host fit."""
    raw = RunConfig.load(ROOT / "configs" / "tiny_cpu_zero2_u2r2.json").raw
    raw["model"] = {
        **raw["model"],
        "n_layers": 8,
        "activation_checkpointing": True,
        "offload_activations": True,
    }
    # a small reduce bucket: ZeRO-2's default one (5e8 elements) would not fit this GPU
    raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "reduce_bucket_size": 100_000}
    run = RunConfig.load(raw)
    hw = Hardware(gpu_mem_gb=0.1, host_mem_gb=0.05, gpus_per_node=4)
    got = plan(run, world=4, hw=hw, seq_step=16)
    split, written = got["offload_split"], got["config"]
    assert split is not None and 0 < split["offload_activations"] < 8
    assert split["max_seq_len"] > written["max_seq_len"] > 0
    host_budget = hw.host_mem_gb * GiB / hw.gpus_per_node

    def at(run_cfg):  # the predicted bytes at the split's longest sequence
        return predict(
            model_shape(run.model),
            run_cfg,
            seq_len=split["max_seq_len"],
            batch=4,
            micro_steps=1,
            world=4,
            hw=hw,
            zero_knobs=ZeroKnobs.of(raw["zero_optimization"]),
        )

    over = at(base_run(run))
    assert over["host_bytes_per_rank"] > host_budget  # every layer offloaded: too much
    n = replace(base_run(run), offload_activations=split["offload_activations"])
    p = at(n)
    assert p["peak_bytes_per_rank"] <= hw.gpu_mem_gb * GiB
    assert p["host_bytes_per_rank"] <= host_budget
    assert f'"offload_activations": {split["offload_activations"]} (the inputs' in table(got)
