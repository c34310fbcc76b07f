"""Image batches of vision-language models under sequence parallelism, through the Trainer
subclasses' sequence-parallel side (``SequenceParallelRun``: shard, forward, loss, as
``compute_loss`` runs them): two rows, three images of two sizes, text on both sides of
each image and end padding. The loss and the gradients (every parameter, the vision
tower's included, reduced as DeepSpeed reduces them) equal the one-process model's, at
Ulysses 2 and hybrid 2 x 2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.support.helpers import HF_TINY

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed
TOL = dict(rtol=1e-7, atol=1e-9)  # float64 sums in another order
IMAGE, VIDEO, START = 93, 94, 95
GRIDS = [(1, 4, 4), (1, 2, 6), (1, 2, 6)]  # Qwen-VL's (t, h, w) patches: 4, 3 and 3 tokens
TILES = [2, 1, 1]  # InternVL's 8 x 8 tiles per image: 8, 4 and 4 tokens
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "internvl"]


def _qwen_vision(**extra) -> dict:
    sizes = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    return dict(sizes, patch_size=2, temporal_patch_size=2, spatial_merge_size=2, **extra)


def config(family: str):
    """Tiny models: M-RoPE sections 1 + 1 + 2 of the 8-wide heads' 4 frequencies."""
    text = dict(HF_TINY, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    ids = dict(image_token_id=IMAGE, video_token_id=94, vision_start_token_id=START)
    if family == "qwen2_5_vl":
        vision = _qwen_vision(window_size=8, fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        text = dict(
            text, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]}
        )
        vision = _qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    vision.update(num_attention_heads=2, image_size=[8, 8], patch_size=[2, 2])
    return transformers.InternVLConfig(
        text_config=dict(HF_TINY, model_type="qwen2"), vision_config=vision, image_token_id=IMAGE
    )


def image_batch(family: str) -> dict:
    """Row 0: text, image 0, text, image 1, text (26 tokens); row 1: text, image 2, text,
    then end padding. Labels: the text tokens."""
    g = torch.Generator().manual_seed(2)
    qwen = family != "internvl"
    tokens = [t * h * w // 4 for t, h, w in GRIDS] if qwen else [4 * n for n in TILES]

    def text(n):
        return torch.randint(90, (n,), generator=g).tolist()

    def image(i):
        return [START] + [IMAGE] * tokens[i]

    row0 = text(5) + image(0) + text(6) + image(1) + text(5)
    row1 = text(3) + image(2) + text(8)
    ids = torch.tensor([row0, row1 + [0] * (len(row0) - len(row1))])
    mask = torch.zeros_like(ids)
    mask[0], mask[1, : len(row1)] = 1, 1
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if not qwen:
        pixels = torch.randn(sum(TILES), 3, 8, 8, generator=g, dtype=torch.float64)
        return {**batch, "pixel_values": pixels}
    patches = sum(t * h * w for t, h, w in GRIDS)
    return {
        **batch,
        "pixel_values": torch.randn(patches, 3 * 2 * 2 * 2, generator=g, dtype=torch.float64),
        "image_grid_thw": torch.tensor(GRIDS),
        "mm_token_type_ids": (ids == IMAGE).int(),
    }


def video_batch(family: str) -> dict:
    """The Qwen families' video path: row 0: text, image 0, text; row 1: text, a video of
    two temporal patches of 2 tokens each, text."""
    g = torch.Generator().manual_seed(3)
    rows = [[], []]
    rows[0] = torch.randint(90, (5,), generator=g).tolist() + [START] + [IMAGE] * 4 + [7, 8, 9]
    # Qwen3-VL: each temporal patch its own group, after its timestamp's text
    frames = (
        [START] + [VIDEO] * 4
        if family == "qwen2_5_vl"
        else [START, VIDEO, VIDEO, 13, START, VIDEO, VIDEO]
    )
    rows[1] = [11, 12, *frames, *torch.randint(90, (13 - 2 - len(frames),), generator=g).tolist()]
    ids = torch.tensor(rows)
    labels = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": torch.randn(16, 24, generator=g, dtype=torch.float64),
        "image_grid_thw": torch.tensor([GRIDS[0]]),
        "pixel_values_videos": torch.randn(16, 24, generator=g, dtype=torch.float64),
        "video_grid_thw": torch.tensor([(2, 2, 4)]),
        "mm_token_type_ids": types,
        **({"second_per_grid_ts": torch.tensor([0.5])} if family == "qwen2_5_vl" else {}),
    }


def _model(family: str):
    return {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "internvl": transformers.InternVLForConditionalGeneration,
    }[family]


def _causal_lm_loss(logits, labels):
    """transformers' loss in the logits' dtype (its own computes in float32)."""
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten())


def _images(rank, u, r, family, video=False):
    from ulysses_cp.integrations.hf_trainer.run import SequenceParallelRun, sequence_parallel_loss

    run = SequenceParallelRun.from_block(
        {"ulysses_degree": u, "ring_degree": r, "attention_backend": "math"}
    )
    torch.manual_seed(0)
    cls = _model(family)
    sp = cls._from_config(copy.deepcopy(config(family)), attn_implementation="sdpa").double()
    ref = cls._from_config(copy.deepcopy(config(family)), attn_implementation="sdpa").double()
    ref.load_state_dict(sp.state_dict())
    run.attach(sp, lean=False)
    run.probe()
    tower = [m for n, m in sp.named_modules() if n.endswith(("visual", "vision_tower"))]
    assert tower[0].config._attn_implementation == "sdpa"  # whole images, no exchange
    batch = video_batch(family) if video else image_batch(family)
    local = run.shard(batch)
    logits = sp(**run.forward_kwargs(local)).logits
    loss = sequence_parallel_loss(
        logits, local["shift_labels"], run.topo, num_items_in_batch=None, value_scale=1
    )
    loss.backward()
    ref_loss = _causal_lm_loss(ref(**batch).logits, batch["labels"])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    world = dist.get_world_size()
    named = dict(ref.named_parameters())
    checked = []
    for name, p in sp.named_parameters():
        want = named[name].grad
        if want is None or not bool(want.any()):
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # DeepSpeed's average over the W ranks (grad_scale = P)
        torch.testing.assert_close(grad / world, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        checked.append(name)
    return checked


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("u,r", [(2, 1), (2, 2)], ids=str)
def test_image_batches_equal_one_process(pools, u, r, family):
    checked = pools(u * r).run(_images, u, r, family)
    assert checked[0] == checked[-1]
    assert sum(("visual" in n or "vision" in n) for n in checked[0]) > 5, checked[0]
    assert sum("language_model" in n for n in checked[0]) > 10, checked[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_video_batches_equal_one_process(pools, family):
    checked = pools(4).run(_images, 2, 2, family, video=True)
    assert sum(("visual" in n) for n in checked[0]) > 5, checked[0]
