"""Writes what ``examples/hf_trainer_sft.py`` and ``examples/dpo_long.py`` need to run
anywhere, offline, in seconds: a tiny random Qwen3 (``DIR/model``), a word-level tokenizer
with a chat template (``DIR/tokenizer``), a JSONL of random chats (``DIR/chats.jsonl``,
one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line, of uneven lengths)
and one of preference pairs (``DIR/pairs.jsonl``, one ``{"prompt": ..., "chosen": ...,
"rejected": ...}`` per line).

    python examples/make_tiny_assets.py DIR [--chats 48] [--pairs 32] [--seed 0] [--vlm]

``--vlm`` also writes what ``examples/vlm_sft.py`` needs: a tiny random Qwen2.5-VL with its
image processor (``DIR/vlm``), four small PNGs of different sizes (``DIR/images``) and
``DIR/captions.jsonl`` (one ``{"image": "images/img0.png", "prompt": ..., "answer": ...}``
per line).

The model learns nothing useful: it stands in for a real checkpoint so that the examples
and their tests (tests/launcher/test_examples_hf.py, tests/launcher/test_examples_trl.py)
run in seconds on CPU ranks.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROLES = ("system", "user", "assistant")
SPECIAL = ("<pad>", "<eos>", "<unk>")
VOCAB = 96  # the model's vocabulary: the special tokens, the roles, then words w6 .. w95
# every message is "<role> <content> <eos>", the turns back to back; the generation prompt
# (for inference) is the assistant's role word
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
    "{{ eos_token }} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def words() -> list[str]:
    first = len(SPECIAL) + len(ROLES)
    return [f"w{i}" for i in range(first, VOCAB)]


def save_tokenizer(folder: Path) -> None:
    import tokenizers
    import transformers

    vocab = {t: i for i, t in enumerate((*SPECIAL, *ROLES, *words()))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def save_model(folder: Path, seed: int) -> None:
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


# the tiny VLM's token ids of its image placeholders (words the texts never use)
VISION_IDS = dict(image_token_id=93, video_token_id=94, vision_start_token_id=95)
VISION_END = 92
CAPTION_WORDS = VOCAB - 8  # captions use the words below w88


def save_vlm(folder: Path, seed: int) -> None:
    """A tiny random Qwen2.5-VL (M-RoPE) with its image processor (patches of 2 x 2 pixels
    and 2 frames, 2 x 2 patches merged into one token)."""
    import torch
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    text.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    text.update(rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=0)
    # the tokenizer's ids (no bos, <eos> = 1): Qwen2.5-VL's defaults (151643, 151645) lie
    # outside the 96-word vocabulary, and transformers warns about them on every load
    text.update(bos_token_id=None, eos_token_id=1)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    vision.update(patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=8)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vision_end_token_id=VISION_END, **VISION_IDS
    )
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg).save_pretrained(folder)
    processor = transformers.Qwen2VLImageProcessor(
        patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=1024
    )
    processor.save_pretrained(folder)


def save_images(folder: Path, seed: int) -> list[dict]:
    """Four small PNGs of different sizes (``folder/images``) and a caption row for each
    image twice (prompt and answer of 2-8 words); returns the rows of captions.jsonl."""
    from PIL import Image

    rng = random.Random(seed + 2)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    vocab = words()[: CAPTION_WORDS - len(SPECIAL) - len(ROLES)]
    rows = []
    for i, (h, w) in enumerate([(12, 20), (16, 16), (8, 24), (20, 12)]):
        pixels = bytes(rng.randrange(256) for _ in range(h * w * 3))
        name = f"images/img{i}.png"
        Image.frombytes("RGB", (w, h), pixels).save(folder / name)
        for _ in range(2):
            prompt, answer = (" ".join(rng.choices(vocab, k=rng.randint(2, 8))) for _ in "pa")
            rows.append({"image": name, "prompt": prompt, "answer": answer})
    rng.shuffle(rows)
    return rows


def chats(n: int, seed: int) -> list[dict]:
    """``n`` chats: an optional system turn, then 1-2 user/assistant exchanges; contents of
    1-12 words, so the tokenized chats have lengths of every residue."""
    rng = random.Random(seed)
    vocab = words()
    out = []
    for _ in range(n):
        turns = [("system",)] if rng.random() < 0.3 else []
        turns += [("user",), ("assistant",)] * rng.randint(1, 2)
        messages = [
            {"role": r, "content": " ".join(rng.choices(vocab, k=rng.randint(1, 12)))}
            for (r,) in turns
        ]
        out.append({"messages": messages})
    return out


def pairs(n: int, seed: int) -> list[dict]:
    """``n`` preference pairs: a prompt of 2-10 words, two answers of 1-16 words each.

    Each answer starts with a space, as in TRL's standard format: TRL tokenizes the prompt
    alone and the prompt + answer as one string, and the prompt's tokens must be a prefix
    of the latter's (with no space, the prompt's last word and the answer's first merge
    into one unknown word, and TRL warns that it drops the prompt's end)."""
    rng = random.Random(seed + 1)
    vocab = words()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(vocab, k=rng.randint(lo, hi)))

    return [
        {"prompt": text(2, 10), "chosen": " " + text(1, 16), "rejected": " " + text(1, 16)}
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where model/, tokenizer/, chats.jsonl go")
    parser.add_argument("--chats", type=int, default=48, help="chats in chats.jsonl (48)")
    parser.add_argument("--pairs", type=int, default=32, help="pairs in pairs.jsonl (32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and texts (0)")
    parser.add_argument(
        "--vlm", action="store_true", help="also vlm/, images/ and captions.jsonl (vlm_sft.py's)"
    )
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    save_model(args.folder / "model", args.seed)
    save_tokenizer(args.folder / "tokenizer")
    lines = (json.dumps(c) for c in chats(args.chats, args.seed))
    (args.folder / "chats.jsonl").write_text("\n".join(lines) + "\n")
    lines = (json.dumps(p) for p in pairs(args.pairs, args.seed))
    (args.folder / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    print(
        f"wrote {args.folder}/model, {args.folder}/tokenizer, {args.folder}/chats.jsonl, "
        f"{args.folder}/pairs.jsonl"
    )
    if args.vlm:
        save_vlm(args.folder / "vlm", args.seed)
        lines = (json.dumps(r) for r in save_images(args.folder, args.seed))
        (args.folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.folder}/vlm, {args.folder}/images, {args.folder}/captions.jsonl")


if __name__ == "__main__":
    main()
