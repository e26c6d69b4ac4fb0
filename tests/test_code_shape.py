"""The shape of the project's code, checked on the source with ``ast``: private names stay in their module, and no
function is too long to read at once.

The project's modules are those of ``envs``, ``algos``, ``pipeline``, ``benchmarks`` and ``dodo.py`` (tests are
not checked). A private name is one with a single leading underscore (``_name``, not a dunder, not ``_`` alone).

The rules:

- **no cross-module use of a private name**: no module of the project

  - imports a private name from another module of the project (``from pipeline.x import _name``, relative imports
    resolved),
  - reads a private name through another module of the project (``rl_planner._Day`` where ``rl_planner`` is a module
    of the project imported under that name), or
  - reaches a private attribute (``x._name``, ``self._name`` included) that it does not define itself but another
    module of the project does. A module defines a name by a ``def`` or ``class``, an assignment target (a
    dataclass's field included), an attribute store (``self._name = ...``), a function's parameter or an import's
    alias.

  Private names of other libraries (``torch._dynamo``, ``sys._getframe``) are theirs, not the project's: an
  attribute reached through a third-party module imported by the module is not checked.
- **no function over** :data:`MAX_LINES` **lines**: a function or method (nested ones too) spans at most that many
  lines from its ``def`` to its last line (decorators excluded).

A failure lists every offence as ``file:line`` and what it is. The scanner is checked itself on small made-up
packages (a violating and a clean one), so that the checks of the project cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envs", "algos", "pipeline", "benchmarks")
MAX_LINES = 100


@dataclass(frozen=True)
class Module:
    """One parsed module: its dotted name, the file named in messages, its tree and whether it is a package's
    ``__init__``."""

    name: str
    file: str
    tree: ast.Module
    package: bool = False


def parse_modules(sources: Mapping[str, str]) -> list[Module]:
    """Parse ``{relative file path: source}`` into modules named from their paths (``a/b/__init__.py`` is ``a.b``,
    ``a/c.py`` is ``a.c``)."""
    out = []
    for file, text in sorted(sources.items()):
        parts = Path(file).with_suffix("").parts
        package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if package else parts)
        out.append(Module(name, file, ast.parse(text, filename=file), package))
    return out


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """``{path relative to root: source}`` of every module of the project (tests excluded)."""
    paths = [root / "dodo.py"]
    for package in PACKAGES:
        paths += [p for p in sorted((root / package).rglob("*.py")) if "__pycache__" not in p.parts]
    return {str(p.relative_to(root)): p.read_text() for p in paths}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.package else module.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def defined_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: ``def``/``class`` names, assignment targets, attribute stores, function
    parameters and import aliases."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
    return {n for n in out if _private(n)}


def _bound_imports(module: Module, project: set[str]) -> tuple[dict[str, str], set[str]]:
    """The names a module binds to modules by its imports: ``{name: project module}`` and the names bound to
    third-party modules (or their members)."""
    modules, foreign = {}, set()
    top = {m.split(".")[0] for m in project}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else alias.name.split(".")[0]
                if alias.name.split(".")[0] in top:
                    modules[bound] = target
                else:
                    foreign.add(bound)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                bound = alias.asname or alias.name
                if base.split(".")[0] not in top:
                    foreign.add(bound)
                elif f"{base}.{alias.name}" in project:
                    modules[bound] = f"{base}.{alias.name}"
    return modules, foreign


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _module_of(node: ast.AST, bound: Mapping[str, str], project: Mapping[str, Module]) -> str | None:
    """The project module an expression names (``rl_planner``, ``pipeline.control.rl_planner``), else None."""
    chain = _dotted(node)
    if not chain or chain[0] not in bound:
        return None
    path = bound[chain[0]]
    for part in chain[1:]:
        path = f"{path}.{part}"
    return path if path in project else None


def private_uses(modules: Iterable[Module]) -> list[str]:
    """``file:line name (defined in other_file)`` for every use of another project module's private name, by file
    and line."""
    modules = list(modules)
    by_name = {m.name: m for m in modules}
    defs = {m.name: defined_names(m.tree) for m in modules}
    bad = []
    for m in modules:
        bound, foreign = _bound_imports(m, set(by_name))
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(m, node)
                if base in by_name and base != m.name:
                    bad += [
                        (m.file, a.lineno, f"{a.name} (defined in {by_name[base].file})")
                        for a in node.names
                        if _private(a.name)
                    ]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                chain = _dotted(node)
                if chain and chain[0] in foreign:  # another library's private name
                    continue
                owner = _module_of(node.value, bound, by_name)
                if owner is not None:  # module._name
                    if owner != m.name:
                        bad.append((m.file, node.lineno, f"{owner}.{node.attr} (defined in {by_name[owner].file})"))
                elif node.attr not in defs[m.name]:  # x._name defined by another module only
                    other = [o.file for o in modules if o.name != m.name and node.attr in defs[o.name]]
                    if other:
                        bad.append((m.file, node.lineno, f"{node.attr} (defined in {', '.join(other)})"))
    return [f"{file}:{line} {what}" for file, line, what in sorted(bad)]


def long_functions(modules: Iterable[Module], limit: int = MAX_LINES) -> list[str]:
    """``file:line name length`` for every function or method longer than ``limit`` lines (``def`` to last line)."""
    bad = []

    def visit(node: ast.AST, prefix: str, file: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    bad.append(f"{file}:{child.lineno} {prefix}{child.name} {length}")
                visit(child, f"{prefix}{child.name}.", file)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", file)
            else:
                visit(child, prefix, file)

    for m in modules:
        visit(m.tree, "", m.file)
    return bad


PROJECT = parse_modules(project_sources())


# ------------------------------------------------------------------------------------------- the scanner itself
A = """\
import sys
from dataclasses import dataclass

import torch

_SECRET = 1


@dataclass
class Planner:
    _field: int = 0

    def __post_init__(self):
        self._cache = {}

    def _solve(self, _hint=None):
        return self._cache, self._field, _helper(), sys._getframe(), torch._dynamo


def _helper():
    return _SECRET


def _getframe():
    return None
"""

VIOLATING = """\
import pkg.a
import pkg.a as alias
from pkg import a
from pkg.a import _SECRET, Planner
from .. import a as rel
from ..a import _helper


class Child(Planner):
    def run(self):
        return self._solve(), self._own, self._field


def f(x, y):
    x._own = 1
    return a._SECRET, alias._helper, rel.Planner, pkg.a._SECRET, y._cache, y._hint, pkg.a.Planner._solve
"""

CLEAN = """\
import sys

import torch

from pkg.a import Planner
from .. import a


class Child(Planner):
    def run(self, _hint=None):
        self._mine = _hint
        return self._mine, a.Planner, sys._getframe(), torch._C._getframe
"""


def _package(b: str) -> list[Module]:
    return parse_modules({"pkg/__init__.py": "", "pkg/a.py": A, "pkg/sub/__init__.py": "", "pkg/sub/b.py": b})


def test_the_scanner_finds_every_kind_of_private_use():
    assert private_uses(_package(VIOLATING)) == [
        "pkg/sub/b.py:4 _SECRET (defined in pkg/a.py)",  # from module import _name
        "pkg/sub/b.py:6 _helper (defined in pkg/a.py)",  # relative
        "pkg/sub/b.py:11 _field (defined in pkg/a.py)",  # a dataclass field
        "pkg/sub/b.py:11 _solve (defined in pkg/a.py)",  # an inherited method
        "pkg/sub/b.py:16 _cache (defined in pkg/a.py)",  # an attribute stored there
        "pkg/sub/b.py:16 _hint (defined in pkg/a.py)",  # a parameter there
        "pkg/sub/b.py:16 _solve (defined in pkg/a.py)",
        "pkg/sub/b.py:16 pkg.a._SECRET (defined in pkg/a.py)",  # module._name, by every way of naming the module
        "pkg/sub/b.py:16 pkg.a._SECRET (defined in pkg/a.py)",
        "pkg/sub/b.py:16 pkg.a._helper (defined in pkg/a.py)",
    ]


def test_the_scanner_passes_own_and_third_party_private_names():
    # b's own private attribute and parameter, a's own names, sys's and torch's private names (a defines a
    # _getframe of its own: a third-party module's attribute is not the project's all the same)
    assert private_uses(_package(CLEAN)) == []
    assert {"_SECRET", "_field", "_cache", "_solve", "_hint", "_helper", "_getframe"} == defined_names(ast.parse(A))


def test_the_scanner_measures_functions_without_their_decorators():
    def body(indent: str, lines: int) -> str:
        return "\n".join(f"{indent}x = {i}" for i in range(lines))

    fits = f"@functools.cache\n@functools.cache\ndef fits():\n{body('    ', MAX_LINES - 1)}\n"  # def + 99 lines
    too_long = f"class C:\n    @staticmethod\n    def too_long():\n{body('        ', MAX_LINES)}\n"
    src = f"import functools\n\n\n{fits}\n\n{too_long}"
    line = src.splitlines().index("    def too_long():") + 1
    assert long_functions(parse_modules({"m.py": src})) == [f"m.py:{line} C.too_long {MAX_LINES + 1}"]
    assert long_functions(parse_modules({"m.py": src}), limit=MAX_LINES + 1) == []


# ------------------------------------------------------------------------------------------------- the project
def test_the_project_is_scanned():
    # every package and dodo.py, and in them the private names the rules guard
    names = {m.name for m in PROJECT}
    assert {"dodo", "envs.site", "pipeline.control.tuning", "algos.ppo", "algos.harness", "benchmarks"} <= names
    defined = set().union(*(defined_names(m.tree) for m in PROJECT))
    assert {"_repair_draws", "_carbon_split_uncovered", "_flatten"} <= defined


def test_no_module_uses_another_modules_private_names():
    bad = private_uses(PROJECT)
    assert not bad, "private names used outside their module:\n" + "\n".join(bad)


def test_no_function_is_longer_than_the_limit():
    bad = long_functions(PROJECT)
    assert not bad, f"functions over {MAX_LINES} lines:\n" + "\n".join(bad)
