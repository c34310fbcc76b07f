"""The README as a landing page and the docs it points to: short, its two commands the
ones CI and the docs run, every relative link to a file that exists, and every reference
page naming objects that exist (mkdocs build --strict checks the site's own links)."""

from __future__ import annotations

import ast
import re

from tests.support.helpers import ROOT

README = ROOT / "README.md"


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = bash_blocks(README.read_text())
    assert ci in blocks, (ci, blocks)
    # the docs' home page gives the same two commands
    home = bash_blocks((ROOT / "docs" / "index.md").read_text())
    assert ci in home
    main_job = next(b for b in blocks if "train.py --deepspeed_config" in b)
    assert main_job in home
    assert (ROOT / main_job.split("--deepspeed_config ")[1].split()[0]).is_file()


def test_readme_relative_links_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [x for x in links if "://" not in x]
    assert relative, "no relative links found: the pattern is wrong"
    missing = [x for x in relative if not (ROOT / x).exists()]
    assert not missing, missing


def defines(module: str, name: str) -> bool:
    """Whether the source of ``module`` defines ``name`` at its top level (read, not
    imported: the Trainer pages would import TRL)."""
    base = ROOT / module.replace(".", "/")
    source = (base / "__init__.py" if base.is_dir() else base.with_suffix(".py")).read_text()
    return re.search(rf"^(class|def) {name}\b|^{name}\b.*=", source, re.M) is not None


def test_reference_pages_name_objects_that_exist():
    found = 0
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        for name in re.findall(r"^::: (\S+)", page.read_text(), re.M):
            found += 1
            path = ROOT / name.replace(".", "/")
            if path.is_dir() or path.with_suffix(".py").is_file():
                continue  # a whole module
            module, _, attr = name.rpartition(".")
            assert defines(module, attr), f"{page.name}: {name}"
    assert found > 30, found


def literal(path, name: str):
    """The literal value a test file assigns to ``name`` (read, not imported: those files
    skip without TRL)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no {name}")


def test_trainer_quick_start_gives_the_settings_the_tests_run():
    page = (ROOT / "docs" / "huggingface" / "quickstart.md").read_text()
    found = dict(re.findall(r'^(ARGS|DPO|GRPO|VLM)="([^"]*)"$', page, re.M))
    sft = literal(ROOT / "tests" / "launcher" / "test_examples_hf.py", "SETTINGS")
    trl = literal(ROOT / "tests" / "launcher" / "test_examples_trl.py", "EXAMPLES")
    vlm = literal(ROOT / "tests" / "launcher" / "test_examples_vlm.py", "SETTINGS")
    pairs = (("ARGS", sft), ("DPO", trl["dpo"][1]), ("GRPO", trl["grpo"][1]), ("VLM", vlm))
    for key, settings in pairs:
        assert key in found, (key, sorted(found))
        assert settings in found[key], (key, settings, found[key])


def test_the_repository_layout_names_every_module():
    tree = (ROOT / "docs" / "development" / "layout.md").read_text()
    names = set(re.findall(r"[\w.]+\.py", tree))
    package = ROOT / "ulysses_cp"
    modules = {p.name for p in package.rglob("*.py") if p.name != "__init__.py"}
    assert modules <= names, sorted(modules - names)
