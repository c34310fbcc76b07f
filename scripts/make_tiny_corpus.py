"""Write a small synthetic corpus and a BPE tokenizer trained on it, for
``configs/tiny_cpu_hf_dataset_u2r2.json`` (the shape of a real corpus + tokenizer, on CPU).

    .venv/bin/python scripts/make_tiny_corpus.py [--out runs/tiny_corpus] [--docs 3000]

Writes ``OUT/train.jsonl`` and ``OUT/eval.jsonl`` (``{"text": ...}`` per line) and
``OUT/tokenizer/`` (``tokenizer.json`` + ``tokenizer_config.json``, a 512-token BPE with
``<bos>``/``<eos>``). Each document introduces a character (name, animal, colour, home,
food) and later sentences refer back to those facts, so a model can lower its loss by
attending to the start of the document. Deterministic for a given ``--seed``. The corpus and
the tokenizer are made in memory first: a missing package or a bad option stops it before
anything is written.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = """
names: ada bo cy dee eli fay gus hal ivy jo kit lu max ned oli pia quin rex sam tia
animals: cat dog fox owl bee hen cow pig elk yak ram eel ant bat emu
colours: red blue green gold grey pink black white brown violet
places: hill lake wood farm town cave beach field river valley
foods: bread apples honey rice fish corn pears nuts cheese soup
verbs: walks runs sings sleeps reads swims dances waits looks plays
"""
W = {k: v.split() for k, v in (line.split(":") for line in WORDS.strip().splitlines())}
NAMES, ANIMALS, COLOURS, PLACES, FOODS, VERBS = (
    W[k] for k in ("names", "animals", "colours", "places", "foods", "verbs")
)


def document(rng: random.Random) -> str:
    name, animal, colour, place, food = (
        rng.choice(x) for x in (NAMES, ANIMALS, COLOURS, PLACES, FOODS)
    )
    out = [f"{name} is a {colour} {animal} from the {place} and likes {food} ."]
    for _ in range(rng.randint(4, 40)):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(f"one day {name} {rng.choice(VERBS)} near the {rng.choice(PLACES)} .")
        elif kind == 1:
            out.append(f"the {colour} {animal} eats {food} at the {place} .")
        elif kind == 2:
            out.append(f"{name} the {animal} {rng.choice(VERBS)} with a {rng.choice(ANIMALS)} .")
        else:
            out.append(f"back at the {place} , {name} has more {food} .")
    return " ".join(out)


def import_tokenizers():
    """``tokenizers`` and ``transformers``, or an error that names the fix."""
    try:
        import tokenizers
        import transformers
    except ImportError as exc:
        raise SystemExit(
            f"make_tiny_corpus.py needs tokenizers and transformers ({exc}); nothing was "
            "written. Run it with the venv's Python (.venv/bin/python, after bash "
            "scripts/setup.sh) or install them: .venv/bin/pip install -e .[data]"
        ) from None
    return tokenizers, transformers


def train_tokenizer(texts: list[str], vocab_size: int):
    """A BPE tokenizer trained on ``texts``, in memory (``save_pretrained`` writes it)."""
    tokenizers, transformers = import_tokenizers()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<bos>", "<eos>", "<pad>"]
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/tiny_corpus")
    p.add_argument("--docs", type=int, default=3000, help="training documents")
    p.add_argument("--eval_docs", type=int, default=200)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.docs < 1 or args.eval_docs < 1:
        p.error(f"--docs ({args.docs}) and --eval_docs ({args.eval_docs}) must be at least 1")
    import_tokenizers()  # before the documents are made: a missing package writes nothing
    rng = random.Random(args.seed)
    train = [document(rng) for _ in range(args.docs)]
    held = [document(rng) for _ in range(args.eval_docs)]
    tokenizer = train_tokenizer(train, args.vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train.jsonl", train), ("eval.jsonl", held)):
        (out / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer.save_pretrained(out / "tokenizer")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"wrote {len(train)} + {len(held)} documents and a tokenizer to {out} ({size / 1e6:.1f} MB)"
    )


if __name__ == "__main__":
    main()
