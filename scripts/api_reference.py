"""The API reference's griffe extension (mkdocs.yml, ``mkdocstrings`` ``extensions``): the
docstrings are read as the site shows them, not as Sphinx would.

- A Sphinx role (``:func:`attn_forward```, ``:class:`~ulysses_cp.core.options.RunOptions```,
  ``:meth:``, ``:mod:``, ``:data:``, ``:attr:``, ``:exc:``, ``:obj:``) becomes a link to the
  object's entry on the site, its name in code; a name the site does not show stays code.
- A default written as an expression (``layout=_DEFAULT.layout``) shows its value
  (``'zigzag'``), read from the imported function.
- A dataclass field's default written as ``field(default=x, ...)`` shows ``x``, and a
  ``default_factory`` of ``list`` shows ``[]``.
- Module-level attributes (loggers such as ``log``, constants such as ``LATEST``) are not
  listed: a module's API is its functions and classes.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
from collections.abc import Iterator

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)(?:\(\))?`"
)
LITERAL = (str, int, float, bool, type(None))


def walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object it defines (aliases, the re-exports, left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)  # type: ignore[arg-type]


def resolve(scope: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as written in ``scope``'s docstring, or None."""
    first, _, rest = target.partition(".")
    for where in (scope, scope.module):
        try:
            found = where.resolve(first)
        except (griffe.NameResolutionError, ValueError):
            continue
        path = f"{found}.{rest}" if rest else found
        try:
            return scope.modules_collection[path].canonical_path  # re-exports: the home
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return path
    return target if "." in target else None


def linked(scope: griffe.Object, match: re.Match) -> str:
    target = match["target"]
    title = target.rpartition(".")[2] if match["tilde"] else target
    code = f"<code>{html.escape(title)}</code>"
    path = resolve(scope, target)
    if path is None:
        return code
    # optional: a link where the site shows the object, the code alone where it does not
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def runtime_defaults(func: griffe.Function) -> None:
    """Defaults written as expressions, replaced by their values where those are literals."""
    exprs = [p for p in func.parameters if isinstance(p.default, griffe.Expr)]
    if not exprs:
        return
    obj = importlib.import_module(func.module.path)
    for part in func.path[len(func.module.path) + 1 :].split("."):
        obj = getattr(obj, part)
    values = inspect.signature(obj).parameters
    for p in exprs:
        value = values[p.name].default if p.name in values else inspect.Parameter.empty
        if isinstance(value, LITERAL):
            p.default = repr(value)


FACTORIES = {"list": "[]", "dict": "{}"}


def field_default(attr: griffe.Attribute) -> None:
    """A dataclass field's ``field(default=x, ...)`` shown as ``x`` (a config key's default
    as the JSON's reader wants it), ``field(default_factory=list)`` as ``[]``."""
    value = attr.value
    if not (isinstance(value, griffe.ExprCall) and str(value.function) == "field"):
        return
    for arg in value.arguments:
        if isinstance(arg, griffe.ExprKeyword) and arg.name == "default":
            attr.value = arg.value
        elif isinstance(arg, griffe.ExprKeyword) and arg.name == "default_factory":
            attr.value = FACTORIES.get(str(arg.value), f"{arg.value}()")


class SiteDocstrings(griffe.Extension):
    """Roles as links, defaults as values, no module attributes (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        for obj in list(walk(pkg)):
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(lambda m, o=obj: linked(o, m), obj.docstring.value)
            if isinstance(obj, griffe.Function):
                runtime_defaults(obj)
            elif isinstance(obj, griffe.Attribute) and obj.parent and obj.parent.is_class:
                field_default(obj)
        for mod in [o for o in walk(pkg) if isinstance(o, griffe.Module)]:
            for name, member in list(mod.members.items()):
                if not member.is_alias and isinstance(member, griffe.Attribute):
                    del mod.members[name]
