"""Every shell command in README.md and docs/*.md runs as written: checked statically,
without running a program.

The commands are the lines of the fenced ``bash``/``sh``/``shell`` blocks, the ``$ `` lines
of ``console`` blocks, any other line that starts with ``$ ``, and the inline code spans
that start with ``.venv/bin/``. Each line is split into
simple commands (``&&``, ``;``, ``|``, redirections, ``bash -c '...'``), variables assigned
in the same block (``ARGS="..."``) are expanded, and usage brackets (``[--top N]``) are
read as the option inside. Each simple command is then checked:

- the program follows the README's venv convention: ``.venv/bin/python``, never a bare
  ``python``, ``pip``, ``deepspeed``, ``torchrun``, ``accelerate`` (or the dev tools and
  console scripts), and ``.venv/bin/X`` is a program the venv has;
- every repository file it names (``train.py``, ``scripts/...``, ``configs/...``,
  ``examples/...``) exists;
- every ``-m module`` is found (``importlib.util.find_spec``), every console script is
  declared in pyproject.toml, every ``pip install -e .[extra]`` extra too, every
  ``pytest -m`` marker is declared;
- every option is one that program's argparse parser accepts: ours (scripts, examples,
  ``ulysses_cp`` modules), DeepSpeed's launcher, torchrun's and ``accelerate launch``'s.
  The parser is taken without running the program: its ``parse_args`` function, else its
  ``main``, called while ``ArgumentParser.parse_known_args`` raises with the parser it was
  called on, so nothing after the parsing runs. mkdocs's options are read from its click
  commands; ruff's and mypy's are not checked (only that the venv has them).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from tests.support.helpers import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy's dependency
    import tomli as tomllib

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSOLE_SCRIPTS = PYPROJECT["project"]["scripts"]
VENV_BIN = Path(sys.prefix) / "bin"
# programs the venv provides: a bare name is another program outside the venv
VENV_PROGRAMS = {"python", "python3", "pip", "pip3", "deepspeed", "torchrun", "accelerate"}
VENV_PROGRAMS |= {"ruff", "mypy", "mkdocs", "pytest", *CONSOLE_SCRIPTS}
# programs that are not ours or the venv's: their arguments are not checked
SYSTEM_PROGRAMS = {"cd", "export", "source", "srun", "scontrol", "sed", "head", "git", "ls"}
# files a page names as the reader's own (not the repository's)
USER_FILES = {"sft.py", "quickstart.py"}
# shell scripts that hand their options to a Python script
FORWARDS = {"scripts/gpu_check.sh": "scripts/gpu_check.py"}
REPO_PATH = re.compile(r"^(?:scripts|configs|examples|docs|tests)/\S+$|^train\.py$")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b")  # CFG, NAME, OUT.json: a value to fill in


@dataclass
class Command:
    where: str  # page:line
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def shell_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, line, block id) of every shell line of a page, continuations joined;
    then every inline code span outside the blocks that starts with ``.venv/bin/X``."""
    yield from block_lines(text)
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        fenced ^= line.strip().startswith("```")
        for span in [] if fenced else re.findall(r"`(\.venv/bin/[^`\s]+[^`]*)`", line):
            yield number, span.replace("...", ""), f"inline {number}"


def block_lines(text: str) -> Iterator[tuple[int, str, str]]:
    lang, block, pending, start = None, 0, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        fence = re.match(r"```+\s*(\w*)", line)
        if fence:
            lang = None if lang is not None else fence.group(1) or ""
            block += 1
            continue
        if lang in ("bash", "sh", "shell"):
            shell = line.removeprefix("$ ")
        elif line.startswith("$ "):
            shell = line[2:]
        else:
            continue
        if not pending:
            start = number
        if shell.endswith("\\"):
            pending += shell[:-1] + " "
            continue
        yield start, pending + shell, f"{block}"
        pending = ""


def simple_commands(line: str, variables: dict[str, str]) -> Iterator[list[str]]:
    """The simple commands of one shell line; ``NAME=value`` alone is stored in
    ``variables``, and a ``$NAME`` word defined there is expanded."""
    line = re.sub(r"\$\([^()]*\)", "SUBST", line)  # $(...): a value here
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.commenters = "#"
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*list(lexer), ";"]:
        if token and set(token) <= set(";&|<>"):
            yield from one_command(words, variables)
            words = [] if token[0] not in "<>" else ["__REDIRECT__"]
        elif words[:1] == ["__REDIRECT__"]:
            words = []  # the redirection's target
        else:
            words.append(token)


def one_command(words: list[str], variables: dict[str, str]) -> Iterator[list[str]]:
    words = [w for w in words if w != "__REDIRECT__"]
    assigned = 0
    while assigned < len(words) and re.match(r"^[A-Za-z_]\w*=", words[assigned]):
        assigned += 1
    if assigned == len(words):
        for w in words:
            name, _, value = w.partition("=")
            variables[name] = value
        return
    argv: list[str] = []
    for w in words[assigned:]:
        m = re.fullmatch(r"\$\{?(\w+)\}?", w)
        argv += shlex.split(variables[m.group(1)]) if m and m.group(1) in variables else [w]
    argv = [unbracket(w) for w in argv]
    if "-c" in argv and argv[argv.index("-c") - 1] == "bash":  # srun ... bash -c '...'
        for line in argv[argv.index("-c") + 1 :]:
            yield from simple_commands(line, variables)
        return
    yield argv


def unbracket(word: str) -> str:
    """A word of a usage synopsis without its brackets: ``[--top`` and ``N]`` are
    ``--top`` and ``N``; ``.[gpu]`` stays."""
    word = word.lstrip("[")
    while word.endswith("]") and word.count("]") > word.count("["):
        word = word[:-1]
    return word


def doc_commands() -> list[Command]:
    found = []
    for page in PAGES:
        variables: dict[str, dict[str, str]] = {}
        for number, line, block in shell_lines(page.read_text()):
            where = f"{page.relative_to(ROOT)}:{number}"
            for argv in simple_commands(line, variables.setdefault(block, {})):
                found.append(Command(where, argv))
    return found


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Parsed(self)


def captured(call: Callable[[], object], program: str) -> argparse.ArgumentParser:
    """The parser ``call`` parses its arguments with (``program``: its name in the
    errors); nothing after the parsing runs."""
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [program]
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", _grab):
            call()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    raise AssertionError(f"{call} returned without parsing its arguments")


def parser_of_module(module, program: str) -> argparse.ArgumentParser:
    parse = getattr(module, "parse_args", None)
    if callable(parse) and "argv" in inspect.signature(parse).parameters:
        return captured(lambda: parse([]), program)
    return captured(module.main, program)


@cache
def parser_of_file(rel: str) -> argparse.ArgumentParser:
    """The parser of a Python file of the repository, imported under another name (its
    ``__main__`` block does not run)."""
    path = ROOT / rel
    for folder in (str(path.parent), str(ROOT)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    name = "_doc_command_" + re.sub(r"\W", "_", rel)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, rel
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return parser_of_module(module, rel)


@cache
def parser_of_module_name(name: str) -> argparse.ArgumentParser:
    """The parser of ``python -m name`` (a package: the module its ``__main__`` imports)."""
    spec, program = importlib.util.find_spec(name), f"-m {name}"
    assert spec is not None, name
    if spec.submodule_search_locations:  # a package: __main__ imports the code
        main = Path(spec.submodule_search_locations[0]) / "__main__.py"
        imported = next(
            n for n in ast.parse(main.read_text()).body if isinstance(n, ast.ImportFrom)
        )
        name = importlib.util.resolve_name("." * imported.level + (imported.module or ""), name)
    return parser_of_module(importlib.import_module(name), program)


@cache
def launcher_parser(program: str) -> argparse.ArgumentParser:
    if program == "deepspeed":
        from deepspeed.launcher import runner

        return captured(lambda: runner.parse_args([]), "deepspeed")
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        return get_args_parser()
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def walk_options(parser: argparse.ArgumentParser, args: list[str], *, stop_at_positional: bool):
    """(errors, positionals): every ``-x``/``--xx`` in ``args`` checked against ``parser``,
    option values skipped; with ``stop_at_positional`` (a launcher), the first positional
    and everything after it are returned as the positionals."""
    errors, positionals, i = [], [], 0
    actions = parser._option_string_actions
    while i < len(args):
        word = args[i]
        i += 1
        if not word.startswith("-") or word == "-" or PLACEHOLDER.fullmatch(word):
            positionals.append(word)
            if stop_at_positional:
                return errors, positionals + args[i:]
            continue
        name, eq, _ = word.partition("=")
        action = actions.get(name)
        if action is None:
            errors.append(f"{name} is not an option of {parser.prog}")
            continue
        if eq or action.nargs == 0:
            continue
        if action.nargs == "?":
            i += i < len(args) and not args[i].startswith("-") and args[i] in (action.choices or ())
        elif action.nargs in (None, 1):
            i += 1
        else:  # +, *, N: values up to the next option
            while i < len(args) and not args[i].startswith("-"):
                i += 1
    return errors, positionals


def check_files(argv: list[str]) -> list[str]:
    errors = []
    for word in argv:
        value = word.partition("=")[2] if word.startswith("-") else word
        missing = REPO_PATH.match(value) and not (ROOT / value).exists()
        if missing and not PLACEHOLDER.search(value):
            errors.append(f"{value} does not exist")
    return errors


def check_python_program(program: str, args: list[str]) -> list[str]:
    """``program`` (``.py`` file, ``-m module`` or console script) given ``args``."""
    if program.startswith("-m "):
        module = program[3:]
        if importlib.util.find_spec(module) is None:
            return [f"-m {module}: no such module"]
        if module == "pytest":
            return check_pytest(args)
        if not module.startswith("ulysses_cp"):
            return []
        parser = parser_of_module_name(module)
    elif program in CONSOLE_SCRIPTS:
        parser = parser_of_module_name(CONSOLE_SCRIPTS[program].partition(":")[0])
    elif program in USER_FILES:
        return []
    else:
        if not (ROOT / program).is_file():
            return [f"{program} does not exist"]
        parser = parser_of_file(program)
    return walk_options(parser, args, stop_at_positional=False)[0]


def check_pytest(args: list[str]) -> list[str]:
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    errors = []
    for i, word in enumerate(args[:-1]):
        if word == "-m":
            used = set(re.findall(r"\w+", args[i + 1])) - {"not", "and", "or"}
            errors += [f"pytest marker {m} is not declared" for m in sorted(used - markers)]
    return errors


def check_python(args: list[str]) -> list[str]:
    """``python [options] (-m module | file.py) args``."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        i += 1
    if i == len(args):
        return []
    if args[i] == "-m":
        return check_python_program(f"-m {args[i + 1]}", args[i + 2 :])
    return check_python_program(args[i], args[i + 1 :])


def check_launcher(program: str, args: list[str]) -> list[str]:
    if program == "accelerate":
        if args[:1] != ["launch"]:
            return [f"accelerate {args[:1]}: only 'accelerate launch' is checked"]
        args = args[1:]
    parser = launcher_parser(program)
    errors, rest = walk_options(parser, args, stop_at_positional=True)
    if not rest:
        return [*errors, f"{program}: no script to launch"]
    module = {"deepspeed": "--module", "torchrun": "--module", "accelerate": "--module"}
    if module[program] in args[: len(args) - len(rest)] or "-m" in args[: len(args) - len(rest)]:
        return errors + check_python_program(f"-m {rest[0]}", rest[1:])
    return errors + check_python_program(rest[0], rest[1:])


def check_pip(args: list[str]) -> list[str]:
    extras = PYPROJECT["project"]["optional-dependencies"]
    errors = []
    for word in args:
        m = re.fullmatch(r"\.\[([\w,]+)\]", word)
        for extra in m.group(1).split(",") if m else ():
            if extra not in extras:
                errors.append(f"pip extra [{extra}] is not in pyproject.toml")
    return errors


def check_mkdocs(args: list[str]) -> list[str]:
    from mkdocs.__main__ import cli

    command = cli.commands.get(args[0]) if args else None
    if command is None:
        return [f"mkdocs {args[:1]}: no such command"]
    options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    return [
        f"{w} is not an option of mkdocs {args[0]}"
        for w in args[1:]
        if w.startswith("-") and w.partition("=")[0] not in options
    ]


def check(cmd: Command) -> list[str]:
    program, args = cmd.argv[0], cmd.argv[1:]
    errors = check_files(cmd.argv)
    if program in VENV_PROGRAMS:  # reported, then checked as the venv's
        errors.append(f"bare {program}: write .venv/bin/{program} (the README's convention)")
        program = f".venv/bin/{program}"
    if program in SYSTEM_PROGRAMS:
        return errors
    if program == "bash":
        script = args[0] if args else ""
        if script in FORWARDS:
            errors += walk_options(
                parser_of_file(FORWARDS[script]), args[1:], stop_at_positional=False
            )[0]
        elif len(args) > 1:
            errors.append(f"bash {script}: its options are not checked (add it to FORWARDS)")
        return errors
    if not program.startswith(".venv/bin/"):
        return [*errors, f"{program}: an unknown program (not the venv's nor in SYSTEM_PROGRAMS)"]
    name = program.removeprefix(".venv/bin/")
    if name in CONSOLE_SCRIPTS:
        return errors + check_python_program(name, args)
    if not (VENV_BIN / name).exists():
        return [*errors, f"{program}: the venv has no {name}"]
    if name in ("python", "python3"):
        return errors + check_python(args)
    if name in ("deepspeed", "torchrun", "accelerate"):
        return errors + check_launcher(name, args)
    if name in ("pip", "pip3"):
        return errors + check_pip(args)
    if name == "mkdocs":
        return errors + check_mkdocs(args)
    return errors


def test_the_extraction_finds_the_commands():
    commands = doc_commands()
    programs = {c.argv[0] for c in commands}
    assert len(commands) > 50, len(commands)
    assert {".venv/bin/python", ".venv/bin/deepspeed", ".venv/bin/accelerate", "bash"} <= programs
    # a block's variable is expanded, a continuation joined, a usage bracket read inside
    quick = "docs/huggingface/quickstart.md:"  # its blocks set ARGS="..." and use $ARGS
    sft = next(c for c in commands if c.where.startswith(quick) and "--deepspeed" in c.argv)
    assert "--max_length" in sft.argv
    assert any("--max_steps" in c.argv and "train.py" in c.argv for c in commands)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("python scripts/make_tiny_corpus.py", "bare python"),
        (".venv/bin/python scripts/nope.py", "scripts/nope.py does not exist"),
        (".venv/bin/python -m ulysses_cp.nope", "no such module"),
        (".venv/bin/python -m ulysses_cp.plan --wrold 8", "--wrold is not an option"),
        (".venv/bin/deepspeed --num_gpu 4 train.py", "--num_gpu is not an option"),
        (".venv/bin/deepspeed --num_gpus 4 train.py --max_step 3", "--max_step is not an"),
        (".venv/bin/ulysses-cp-nope", "the venv has no ulysses-cp-nope"),
        (".venv/bin/pip install -e .[nope]", "pip extra [nope]"),
        ("X=1 bash scripts/gpu_check.sh --onl model", "--onl is not an option"),
        (".venv/bin/python -m pytest -m unti -q", "marker unti"),
        (".venv/bin/mkdocs build --strct", "--strct is not an option of mkdocs build"),
    ],
)
def test_a_broken_command_is_found(line, error):
    errors = [e for argv in simple_commands(line, {}) for e in check(Command("x", argv))]
    assert any(error in e for e in errors), errors


def test_every_doc_command_runs_as_written():
    broken = [f"{cmd}\n    {e}" for cmd in doc_commands() for e in check(cmd)]
    assert not broken, "\n".join(broken)
