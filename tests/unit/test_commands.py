"""The entry points' command lines (ulysses_cp.core.commands): ``--help`` names the
program as the user typed it, reads as plain text (no reST markup) and states every
option's default; the ``usage:`` line of the programs themselves is checked in
test_entry_points.py."""

from __future__ import annotations

import re
import sys
import types

import pytest

from ulysses_cp import check_attention, train
from ulysses_cp.core.commands import program_name
from ulysses_cp.plan import cli as plan_cli

PARSERS = {
    "ulysses_cp.plan": lambda argv: plan_cli.parse_args(argv),
    "ulysses_cp.train": lambda argv: train.parse_args(argv),
    "ulysses_cp.check_attention": lambda argv: check_attention.main(argv),
}


# required options, flags and options that do nothing when absent
NO_DEFAULT = {
    "ulysses_cp.plan": {"--deepspeed_config", "--world", "--json", "--write-config"},
    "ulysses_cp.train": {"--deepspeed_config", "--overwrite", "--plan"},
    "ulysses_cp.check_attention": {"--json"},
}


def help_text(module: str, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        PARSERS[module](["--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def option_help(text: str, option: str) -> str:
    """The help of ``option``: its line and the indented lines that follow it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(option + " "))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 6) or line.strip().startswith("-"):
            break
        block.append(line)
    return " ".join(" ".join(block).split())


@pytest.mark.parametrize("module", list(PARSERS))
def test_help_is_plain_text_with_the_program_as_typed(module, capsys):
    text = help_text(module, capsys)
    assert text.startswith(f"usage: python -m {module} "), text[:200]
    assert "``" not in text and ":func:" not in text and ":mod:" not in text, text


@pytest.mark.parametrize(
    ("module", "option", "default"),
    [
        ("ulysses_cp.plan", "--gpu-mem-gb", "80"),
        ("ulysses_cp.plan", "--host-mem-gb", "2048"),
        ("ulysses_cp.plan", "--seq-step", "1024"),
        ("ulysses_cp.plan", "--peak-tflops", "989"),
        ("ulysses_cp.plan", "--mfu", "0.45"),
        ("ulysses_cp.plan", "--intra-gbs", "450"),
        ("ulysses_cp.plan", "--inter-gbs", "50"),
        ("ulysses_cp.plan", "--top", "10"),
        ("ulysses_cp.train", "--local_rank", "-1"),
        ("ulysses_cp.check_attention", "--world", "4"),
        ("ulysses_cp.check_attention", "--seq", "1024"),
        ("ulysses_cp.check_attention", "--batch", "2"),
        ("ulysses_cp.check_attention", "--heads", "8"),
        ("ulysses_cp.check_attention", "--kv-heads", "2"),
        ("ulysses_cp.check_attention", "--head-dim", "64"),
        ("ulysses_cp.check_attention", "--dtype", "float32"),
        ("ulysses_cp.check_attention", "--backend", "auto"),
    ],
)
def test_help_states_the_default(module, option, default, capsys):
    got = option_help(help_text(module, capsys), option)
    assert re.search(rf"\(default: {re.escape(default)}(\.0)?\)", got), got


@pytest.mark.parametrize("module", list(PARSERS))
def test_every_option_with_a_default_says_it(module, capsys):
    """Each option's help that has a value by default names it; one whose default is
    None says in words what happens without it (``default: the config's ...``)."""
    text = help_text(module, capsys)
    options = re.findall(r"^  (--[\w-]+)", text, flags=re.M)
    assert len(options) >= 7, text
    missing = [o for o in options if o not in NO_DEFAULT[module]]
    missing = [o for o in missing if "default" not in option_help(text, o)]
    assert missing == [], (missing, text)


def test_the_program_is_named_as_typed(monkeypatch):
    main = sys.modules["__main__"]
    monkeypatch.setattr(main, "__spec__", types.SimpleNamespace(name="ulysses_cp.plan.__main__"))
    assert program_name("ulysses_cp.plan") == "python -m ulysses_cp.plan"
    monkeypatch.setattr(main, "__spec__", types.SimpleNamespace(name="ulysses_cp.train"))
    assert program_name("ulysses_cp.train") == "python -m ulysses_cp.train"
    monkeypatch.setattr(main, "__spec__", None)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/ulysses-cp-plan", "--help"])
    assert program_name("ulysses_cp.plan") == "ulysses-cp-plan"
    monkeypatch.setattr(sys, "argv", ["scripts/check_attention.py"])
    assert program_name("ulysses_cp.check_attention") == "check_attention.py"
    monkeypatch.setattr(sys, "argv", ["/venv/lib/pytest/__main__.py"])  # called from code
    assert program_name("ulysses_cp.plan") == "python -m ulysses_cp.plan"
