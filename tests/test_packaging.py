"""The install the README gives is complete: every third-party module the project imports is a declared dependency."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

from conftest import ROOT

PACKAGES = ("envs", "pipeline", "algos", "benchmarks")


def imported_modules() -> dict[str, str]:
    """Top-level module -> one file importing it, over the installed packages and dodo.py (imports inside functions
    included: a stage that imports a library only when it runs still needs it installed)."""
    found: dict[str, str] = {}
    files = [ROOT / "dodo.py", *(f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py")))]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(f.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project["dependencies"]}
    declared |= {"distributed"}  # dask[distributed]
    dists = packages_distributions()
    missing = []
    for module, where in sorted(imported_modules().items()):
        if module in sys.stdlib_module_names or module in PACKAGES or module == "tests":
            continue
        if module in ("stable_baselines3", "psutil"):  # the dev extras' baseline library; psutil comes with distributed
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared:
            missing.append(f"{module} (imported in {where}; distribution {sorted(names)})")
    assert not missing, "imported but not in pyproject.toml's dependencies: " + "; ".join(missing)
