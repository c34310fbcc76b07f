"""A vision-language model trained on text under sequence parallelism: Qwen2.5-VL's
conditional-generation wrapper (its M-RoPE positions, three axes equal on text) equals the
one-process model in loss and SP-summed gradients at Ulysses 2 and hybrid 2 x 2. Image
batches are refused (tests/distributed/test_hf_trainer_refusals.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.helpers import HF_TINY, hf_loss_and_grads, topology

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-9, atol=1e-10)


def qwen2_5_vl():
    """A tiny Qwen2.5-VL: M-RoPE sections 1 + 1 + 2 of the 8-wide heads' 4 frequencies."""
    text = dict(HF_TINY, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=93,
        video_token_id=94,
        vision_start_token_id=95,
    )


def _text(rank, u, r):
    from ulysses_cp.models import hf

    topo = topology(u, r)
    hf.register_attention(topo, backend="math")
    cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    sp = hf.from_config(copy.deepcopy(qwen2_5_vl()))  # as train.py builds it
    assert type(sp) is cls
    ref = cls._from_config(copy.deepcopy(qwen2_5_vl()), attn_implementation="sdpa")
    sp, ref = sp.double(), ref.double()
    ref.load_state_dict(sp.state_dict())
    ids = torch.randint(90, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, ref_loss, grads = hf_loss_and_grads(sp, ref, topo, ids)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    checked = 0
    for name, (grad, want) in grads.items():
        if "visual" in name:  # the vision tower sees no image on text
            continue
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        checked += 1
    return checked


@pytest.mark.parametrize("u,r", [(2, 1), (2, 2)], ids=str)
def test_a_vlm_on_text_equals_one_process(pools, u, r):
    assert all(n > 10 for n in pools(u * r).run(_text, u, r))
