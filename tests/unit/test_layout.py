"""The package's shape, read from its source (no imports, no processes): every module on a
floor, imports pointing down or across a floor only, no import cycle anywhere (a folder's
included, type-only and function-level imports counted), each public name defined in one
module, modules of at most 400 lines, functions of at most 8 parameters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.helpers import ROOT

PKG = ROOT / "ulysses_cp"
# bottom to top: a module may import from its own floor and the floors below it
FLOORS = ["core", "config", "kernels", "modes", "models", "integrations", "training", "plan"]
# the entry points (train.py, check_attention.py) above every floor: nothing imports them
TOP_LEVEL = {
    "config.py": "config",
    "run_blocks.py": "config",
    "deepspeed_block.py": "config",
    "schema.py": "config",
    "train.py": "entry",
    "check_attention.py": "entry",
    "__init__.py": "face",
}
MAX_LINES, MAX_PARAMS = 400, 8
# the public ucp.attention keeps API.md's keywords (it builds the AttentionSpec), and
# init_topology names every run option (RunOptions' fields) for type checkers and IDEs
MANY_PARAMS = {("modes/attention.py", "attention"), ("core/topology.py", "init_topology")}
# names listed in a module's __all__ whose home is another module: the public face, and
# shard_batch and register_attention, which API.md has Hugging Face users import from
# ulysses_cp.models.hf (their homes: core/batch.py, models/hf_attention.py)
REEXPORTS = {
    ("models/hf.py", "shard_batch"),
    ("models/hf.py", "register_attention"),
    # the Trainer classes' public home, loaded on first use (trl only when a TRL one is)
    ("integrations/hf_trainer/__init__.py", "SequenceParallelTrainer"),
    ("integrations/hf_trainer/__init__.py", "SequenceParallelSFTTrainer"),
    ("integrations/hf_trainer/__init__.py", "SequenceParallelDPOTrainer"),
    ("integrations/hf_trainer/__init__.py", "SequenceParallelGRPOTrainer"),
    ("integrations/hf_trainer/__init__.py", "SequenceParallelRLOOTrainer"),
}


def floor_of(rel: str) -> str | None:
    """The floor of a module path relative to the package (``"core/comm.py"``)."""
    if "/" not in rel:
        return TOP_LEVEL.get(rel)
    folder = rel.split("/")[0]
    return folder if folder in FLOORS else None


def _module_of(parts: list[str], pkg: Path) -> str | None:
    """The module file (relative path) for dotted parts inside the package, or None."""
    path = pkg.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py").relative_to(pkg).as_posix()
    if (path / "__init__.py").is_file():
        return (path / "__init__.py").relative_to(pkg).as_posix()
    return None


def imports(path: Path, pkg: Path) -> list[str]:
    """The package modules ``path`` imports, anywhere in it (top level, functions,
    ``TYPE_CHECKING`` blocks): ``from a import b`` counts ``a.b`` when b is a module."""
    here = path.relative_to(pkg).with_suffix("").parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level])
            elif node.module and node.module.split(".")[0] == pkg.name:
                base = []
            else:
                continue
            dotted = node.module or ""
            if not node.level:
                dotted = dotted.removeprefix(pkg.name).lstrip(".")
            parts = base + [p for p in dotted.split(".") if p]
            for alias in node.names:
                found.append(_module_of([*parts, alias.name], pkg) or _module_of(parts, pkg))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == pkg.name:
                    found.append(_module_of(alias.name.split(".")[1:], pkg))
    return sorted({m for m in found if m is not None})


def import_graph(pkg: Path = PKG) -> dict[str, list[str]]:
    return {p.relative_to(pkg).as_posix(): imports(p, pkg) for p in sorted(pkg.rglob("*.py"))}


def upward_imports(graph: dict[str, list[str]]) -> list[str]:
    """Imports of a floor above the importer's (the package root imports everything and is
    imported by nothing)."""
    rank = {name: i for i, name in enumerate([*FLOORS, "entry", "face"])}
    bad = []
    for mod, targets in graph.items():
        for target in targets:
            a, b = floor_of(mod), floor_of(target)
            if a is not None and b is not None and rank[b] > rank[a]:
                bad.append(f"{mod} imports {target}")
    return bad


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every import cycle (strongly connected components of more than one module, and
    modules that import themselves), Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, []):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_on_a_floor():
    unplaced = [m for m in import_graph() if floor_of(m) is None]
    assert unplaced == [], f"place these modules on a floor (FLOORS, TOP_LEVEL): {unplaced}"


def test_no_import_points_up():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_anywhere():
    assert cycles(import_graph()) == []


def test_folders_hold_no_code_in_their_init():
    """A folder's ``__init__.py`` is its docstring: importing one module of a folder runs
    no other, and no name has a second home there."""
    for init in PKG.glob("*/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert all(isinstance(n, ast.Expr) for n in body), init


def _plant(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "ulysses_cp"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        init = path.parent / "__init__.py"
        if not init.exists():
            init.write_text('"""A folder."""\n')
    return pkg


def test_the_checks_see_a_planted_cycle_and_an_upward_import(tmp_path):
    pkg = _plant(
        tmp_path,
        {
            # a cycle inside one folder, through a type-only import
            "core/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from .b import B\n",
            "core/b.py": "def f():\n    from . import a\n",
            # a cycle across floors (it is also an upward import)
            "modes/x.py": "from ..training import y\n",
            "training/y.py": "import ulysses_cp.modes.x\n",
            # config importing a model: upward, no cycle
            "config.py": "from .models.hf import load_config\n",
            "models/hf.py": "from ..core.a import f\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["core/b.py"] == ["core/a.py"] and graph["config.py"] == ["models/hf.py"]
    assert cycles(graph) == [["core/a.py", "core/b.py"], ["modes/x.py", "training/y.py"]]
    assert upward_imports(graph) == [
        "config.py imports models/hf.py",
        "modes/x.py imports training/y.py",
    ]
    # and the real package is clean: the same checks find nothing there
    assert cycles(import_graph()) == [] and upward_imports(import_graph()) == []


# ---------------------------------------------------------------- one home per name


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def test_each_public_name_has_one_home():
    """A name in a module's ``__all__`` is defined in that module (``ulysses_cp/__init__.py``
    is the public face and re-exports; ``REEXPORTS`` lists the other cases)."""
    elsewhere = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defined = _defined(tree)
        elsewhere += [f"{rel}: {n}" for n in _exported(tree) if n not in defined]
    assert sorted(elsewhere) == sorted(f"{f}: {n}" for f, n in REEXPORTS)


# the names the public API contract (API.md) calls on the package itself: ``ucp.NAME`` and
# ``from ulysses_cp import NAME``
CONTRACT = (
    "init_topology",
    "shard_sequence",
    "gather_sequence",
    "pad_to_multiple",
    "attention",
    "sequence_parallel_cross_entropy",
    "initialize",
    "context_parallel",
    "context_parallel_unshard",
)
MAX_FACE = 30  # the public face stays small: internals are imported from their modules


def _face_imports() -> list[str]:
    """The names ``ulysses_cp/__init__.py`` binds by its imports (``as`` names included)."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    return [
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    ]


def test_the_public_faces_lazy_homes_are_its_typed_imports():
    """``ulysses_cp/__init__.py`` loads its names on first use from ``_HOMES`` (so that the
    config check imports no torch) and declares them to type checkers as imports: the two
    lists, and ``__all__``, name the same objects."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            typed |= {a.asname or a.name: (node.module, a.name) for a in node.names}
    import ulysses_cp as ucp

    assert typed == ucp._HOMES
    assert sorted(ucp._HOMES) == sorted(ucp.__all__)


def test_the_public_face_exports_what_it_imports():
    """Every name the face imports is exported, and every exported name is imported (and
    defined): nothing re-exported by accident, nothing listed that is not there."""
    import ulysses_cp as ucp

    assert sorted(_face_imports()) == sorted(ucp.__all__)
    assert [n for n in ucp.__all__ if not hasattr(ucp, n)] == []
    for name in ("attention", "shard_sequence", "init_topology", "initialize", "shard_batch"):
        assert name in ucp.__all__


def test_the_public_face_is_small_and_holds_the_contract():
    """At most ``MAX_FACE`` names at the top of the package, API.md's among them; kernel,
    planner and loss internals are imported from their modules."""
    import ulysses_cp as ucp

    assert len(ucp.__all__) <= MAX_FACE, sorted(ucp.__all__)
    assert [n for n in CONTRACT if n not in ucp.__all__] == []
    for internal in ("attn_forward", "KernelCall", "RunOptions", "local_loss_term", "plan_groups"):
        assert internal not in ucp.__all__


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: p.name)
def test_modules_are_short(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls", "ctx"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def long_signatures(pkg: Path = PKG) -> list[str]:
    """Functions with more than MAX_PARAMS parameters (self/cls/ctx not counted)."""
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _parameters(node)
                if n > MAX_PARAMS and (rel, node.name) not in MANY_PARAMS:
                    found.append(f"{rel}:{node.lineno} {node.name} takes {n}")
    return found


def test_no_function_takes_more_than_eight_parameters(tmp_path):
    assert long_signatures() == []
    pkg = _plant(tmp_path, {"core/z.py": "def f(a, b, c, d, e, f, g, h, *, i):\n    pass\n"})
    assert long_signatures(pkg) == ["core/z.py:1 f takes 9"]


def formatter_escapes(root: Path = ROOT) -> list[str]:
    """Lines that switch the formatter off (CI runs ``ruff format --check`` on the rest)."""
    marks = ("# fmt: " + "skip", "# fmt: " + "off")
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(p in (".venv", "build") or p.startswith(".") for p in path.relative_to(root).parts):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(m in line for m in marks):
                found.append(f"{path.relative_to(root)}:{i}")
    return found


def test_no_line_escapes_the_formatter(tmp_path):
    assert formatter_escapes() == []
    (tmp_path / "a.py").write_text("x = [1,2]  # fmt: " + "skip\n")
    assert formatter_escapes(tmp_path) == ["a.py:1"]
