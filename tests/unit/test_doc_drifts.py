"""The docs name what the code has: the config examples hold every key of their blocks
(and load), the Trainer page lists every subclass, every ``ulysses_cp.x`` / ``ucp.x`` name
resolves, and every ``f(..., key=...)`` the docs show for one of our functions or
dataclasses names an argument it takes."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
from pathlib import Path

from tests.support.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


def json_blocks(page: str) -> list[str]:
    return re.findall(r"```json\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


def test_the_config_example_holds_every_key_of_every_block():
    from ulysses_cp import config as c
    from ulysses_cp import run_blocks as b
    from ulysses_cp.core.options import CONFIG_KEYS
    from ulysses_cp.schema import from_block

    blocks = json_blocks("training/config.md")  # the one page with every key of every block
    block = next(b for b in blocks if b.startswith('"sequence_parallel"'))
    example = json.loads("{" + block + "}")
    sp = {f.name for f in dataclasses.fields(c.SequenceParallelConfig)} - {"options"}
    expected = {"sequence_parallel": sp | set(CONFIG_KEYS)}
    classes = {"model": c.ModelConfig, "data": b.DataConfig, "eval": b.EvalConfig}
    classes["training"] = b.TrainingConfig
    expected |= {k: {f.name for f in dataclasses.fields(v)} for k, v in classes.items()}
    for name, keys in expected.items():
        assert set(example[name]) == keys, (name, keys ^ set(example[name]))
    c.SequenceParallelConfig.from_dict(example["sequence_parallel"])  # types fit
    for name, cls in classes.items():
        from_block(cls, example[name], name)


def test_the_hugging_face_model_example_holds_every_key():
    from ulysses_cp.config import HFModelConfig
    from ulysses_cp.schema import from_block

    block = next(b for b in json_blocks("hf_models.md") if b.startswith('"model"'))
    model = json.loads("{" + block + "}")["model"]
    assert set(model) == {f.name for f in dataclasses.fields(HFModelConfig)}
    from_block(HFModelConfig, model, "model")


def test_the_trainer_page_lists_every_subclass():
    from ulysses_cp.integrations import hf_trainer

    page = (ROOT / "docs" / "huggingface" / "index.md").read_text()
    table = dict(re.findall(r"^\| `(SequenceParallel\w+)` \| `([\w.]+)` \|", page, re.M))
    assert sorted(table) == sorted(hf_trainer.__all__)
    count = len(hf_trainer.__all__)
    assert f"has {WORDS[count]} drop-in subclasses" in page, count
    for name, parent in table.items():  # the parent the page names is the class's
        cls = getattr(hf_trainer, name)
        assert parent.rpartition(".")[2] in [b.__name__ for b in cls.__mro__], (name, parent)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_in_the_docs_exists():
    names = set()
    for page in PAGES:
        for m in re.finditer(
            r"(?<![\w/])((?:ulysses_cp|ucp)(?:\.[A-Za-z_]\w*)+)", page.read_text()
        ):
            names.add(re.sub(r"^ucp\.", "ulysses_cp.", m.group(1)))
    assert len(names) > 30, len(names)
    assert [n for n in sorted(names) if not resolves(n)] == []


def signatures() -> dict[str, list[set[str] | None]]:
    """Our functions' and dataclasses' argument names by name (None: takes ``**kwargs``,
    or a class whose arguments are not read here)."""
    found: dict[str, list[set[str] | None]] = {}
    for path in sorted((ROOT / "ulysses_cp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            args: set[str] | None = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                args = None if a.kwarg else {x.arg for x in (*a.args, *a.kwonlyargs)}
            elif isinstance(node, ast.ClassDef):
                dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                body = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
                args = set(body) if dataclass and body else None  # type: ignore[arg-type]
            else:
                continue
            found.setdefault(node.name, []).append(args)
    return found


def keyword_calls(text: str, ours: dict) -> list[tuple[str, list[str], str]]:
    """(name, keywords, call) of each ``name(..., key=...)`` in the inline code and the
    Python blocks of a page; ``other.name(...)`` only where ``other`` is ours (``ucp``,
    ``ulysses_cp.x``, one of our classes), not ``AutoModel.from_config(...)``."""
    code = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```python\n(.*?)```", text, re.S)
    calls = []
    for span in code:
        for m in re.finditer(r"(?<![\w.])(?:([\w.]+)\.)?([A-Za-z_]\w*)\(([^()]*)\)", span):
            owner, name, inside = m.groups()
            keywords = re.findall(r"\b([a-z_]\w*)=(?!=)", inside)
            mine = owner is None or owner.startswith(("ucp", "ulysses_cp"))
            if keywords and (mine or owner.rpartition(".")[2] in ours):
                calls.append((name, keywords, m.group(0)))
    return calls


def test_the_docs_call_our_functions_with_arguments_they_take():
    ours = signatures()
    wrong, checked = [], 0
    for page in PAGES:
        for name, keywords, call in keyword_calls(page.read_text(), ours):
            if name not in ours or None in ours[name]:
                continue
            checked += 1
            for key in keywords:
                if not any(key in args for args in ours[name] if args is not None):
                    wrong.append(f"{Path(page).name}: {call}: {name} takes no {key}")
    assert checked > 5, checked
    assert wrong == []
