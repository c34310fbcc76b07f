"""Writes what ``examples/hf_trainer_sft.py`` and ``examples/dpo_long.py`` need to run
anywhere, offline, in seconds: a tiny random Qwen3 (``DIR/model``), a word-level tokenizer
with a chat template (``DIR/tokenizer``), a JSONL of random chats (``DIR/chats.jsonl``,
one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line, of uneven lengths)
and one of preference pairs (``DIR/pairs.jsonl``, one ``{"prompt": ..., "chosen": ...,
"rejected": ...}`` per line).

    python examples/make_tiny_assets.py DIR [--chats 48] [--pairs 32] [--seed 0]

The model learns nothing useful: it stands in for a real checkpoint so that the examples
and their tests (tests/test_examples_hf.py, tests/test_examples_trl.py) run in seconds on
CPU ranks.
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
    """``n`` preference pairs: a prompt of 2-10 words, two answers of 1-16 words each."""
    rng = random.Random(seed + 1)
    vocab = words()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(vocab, k=rng.randint(lo, hi)))

    return [
        {"prompt": text(2, 10), "chosen": text(1, 16), "rejected": text(1, 16)} for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where model/, tokenizer/, chats.jsonl go")
    parser.add_argument("--chats", type=int, default=48, help="chats in chats.jsonl (48)")
    parser.add_argument("--pairs", type=int, default=32, help="pairs in pairs.jsonl (32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and texts (0)")
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


if __name__ == "__main__":
    main()
