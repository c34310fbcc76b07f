"""Docs a person reads in one sitting: every topic page at most ``PAGE_LINES`` lines, and
its prose at most ``MEAN_WORDS`` words per sentence on average.

Reference pages (``docs/reference/``: the generated API reference and the long tables a
reader looks things up in) are exempt from the length limit, not from the sentence one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.helpers import ROOT

PAGE_LINES = 150
README_LINES = 170  # the landing page: the two commands, the modes, the links
MEAN_WORDS = 22.0

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> list[str]:
    """The page's sentences: code blocks, tables, headings, HTML and directives left out;
    a list item or a paragraph is split at each full stop, question or exclamation mark
    that ends a sentence."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        bare = line.strip()
        skip = bare.startswith(("|", "#", ":::", "!!!", "<", "---")) or not bare
        if skip or re.match(r"([-*+]|\d+\.)\s", bare):
            blocks.append([])  # a new paragraph or list item
        if not skip:
            blocks[-1].append(re.sub(r"^([-*+]|\d+\.)\s+", "", bare))
    sentences = []
    for block in blocks:
        paragraph = " ".join(block)
        paragraph = re.sub(r"`[^`]*`", "CODE", paragraph)  # inline code is one word
        paragraph = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", paragraph)  # a link's text
        paragraph = re.sub(r"\b(e\.g|i\.e|etc|vs|cf)\.", r"\1", paragraph)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9(\"'*_])", paragraph):
            if re.search(r"[A-Za-z]", sentence):
                sentences.append(sentence)
    return sentences


def words(sentence: str) -> int:
    return len(sentence.split())


def mean_words(page: Path) -> float:
    sentences = prose(page.read_text())
    return sum(map(words, sentences)) / max(len(sentences), 1)


def test_the_sentence_splitter_counts_what_a_reader_sees():
    text = (
        "# Title\n\nOne short sentence. Another one, e.g. this, has `a b c` code.\n\n"
        "| a | table |\n|---|---|\n\n```bash\nnot prose at all\n```\n"
        "- a list item\n- [a link](x.md) item. Two.\n"
    )
    assert prose(text) == [
        "One short sentence.",
        "Another one, e.g this, has CODE code.",
        "a list item",
        "a link item.",
        "Two.",
    ]


def limit(page: Path) -> int | None:
    if page.name == "README.md" and page.parent == ROOT:
        return README_LINES
    return None if DOCS / "reference" in page.parents else PAGE_LINES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_topic_page_is_short(page: Path):
    most = limit(page)
    lines = len(page.read_text().splitlines())
    assert most is None or lines <= most, (
        f"{page.relative_to(ROOT)} has {lines} lines, over {most}: split it into topic "
        f"pages (or move a lookup table to docs/reference/)"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_sentences_are_short(page: Path):
    mean = mean_words(page)
    longest = max(prose(page.read_text()) or [""], key=words)
    assert mean <= MEAN_WORDS, (
        f"{page.relative_to(ROOT)}: {mean:.1f} words per sentence, over {MEAN_WORDS}; "
        f"the longest has {words(longest)}: {longest[:200]!r}"
    )
