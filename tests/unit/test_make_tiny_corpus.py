"""scripts/make_tiny_corpus.py (docs/training/corpus.md's example corpus): it writes everything or,
without its packages or with a bad option, nothing, with an error that names the fix."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import make_tiny_corpus


def test_it_writes_the_corpus_and_a_tokenizer_that_loads(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "corpus"
    make_tiny_corpus.main(["--out", str(out), "--docs", "20", "--eval_docs", "3"])
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = (out / "eval.jsonl").read_text().splitlines()
    assert (len(train), len(held)) == (20, 3)
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    ids = tok(train[0]["text"])["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids


def test_without_tokenizers_it_writes_nothing_and_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit) as err:
        make_tiny_corpus.main(["--out", str(out)])
    assert "nothing was written" in str(err.value)
    assert ".venv/bin/python" in str(err.value) and ".[data]" in str(err.value)
    assert not out.exists()


def test_a_bad_option_writes_nothing(tmp_path, capsys):
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit):
        make_tiny_corpus.main(["--out", str(out), "--docs", "0"])
    assert "--docs (0) and --eval_docs (200) must be at least 1" in capsys.readouterr().err
    assert not out.exists()
