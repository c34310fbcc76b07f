"""Conformance: a tiny random model of each family under Ulysses, ring and hybrid gives the
single-process loss and, summed over the ranks, the single-process gradients of the same
model run with transformers' own ``"eager"`` attention (the reference, independent of
ulysses_cp's kernels). Sliding windows (per layer), softcap and sinks included.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_hf_families.py.
"""

from __future__ import annotations

from tests.distributed.test_hf_families import family_config, transformers


def test_families_exercise_what_they_claim():
    """The tiny configs really have the variants: windows, softcap, sinks, layer types."""
    assert family_config("mistral").sliding_window == 8
    assert family_config("gemma2").attn_logit_softcapping == 0.01
    assert family_config("gemma2").layer_types == ["sliding_attention", "full_attention"]
    assert family_config("qwen2").layer_types == ["full_attention", "sliding_attention"]
    model = transformers.AutoModelForCausalLM.from_config(
        family_config("gpt_oss"), attn_implementation="eager"
    )
    assert model.model.layers[0].self_attn.sinks.shape == (4,)
