"""The import rules of docs/design (who imports whom), checked on the source with ``ast``.

Every ``import`` and ``from ... import`` counts, at the top of a file or inside a function (a lazy import is still a
dependency), relative ones resolved. A ``from package import name`` where ``package.name`` is a module of the project
is an import of that module. Only the project's own modules are in the graph: ``envs``, ``algos``, ``pipeline``,
``benchmarks`` and ``dodo``.

The rules:

- ``envs`` imports no other package of the project;
- each ``algos/<algo>.py`` imports ``envs`` and the harness (``algos/harness``, a module or a package) only, no other
  algo; the harness imports ``envs`` only;
- ``pipeline`` never imports ``algos``, ``benchmarks`` or ``dodo``; inside it, ``pipeline.data`` imports neither
  ``pipeline.control`` nor ``pipeline.study``, and ``pipeline.control`` does not import ``pipeline.study``;
- ``dodo.py`` imports the pipeline and nothing below it (``envs``, ``algos``) directly;
- no import circle among the project's modules.
"""

from __future__ import annotations

import ast
import graphlib
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envs", "algos", "pipeline", "benchmarks")
TOP = (*PACKAGES, "dodo")


def _modules() -> dict[str, Path]:
    """Every module of the project: dotted name -> file (a package is its ``__init__.py``)."""
    out = {"dodo": ROOT / "dodo.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> dict[str, int]:
    """The project modules ``name`` imports, each with the line of its first import."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}

    def add(module: str, line: int) -> None:
        while module and module not in MODULES:  # `import envs.site.x` of a non-module name: its module
            module = module.rpartition(".")[0]
        if module and module != name:
            found.setdefault(module, line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TOP:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] not in TOP:
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                add(sub if sub in MODULES else module, node.lineno)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(importers, allowed) -> list[str]:
    """``file:line imports module`` for every import of a module in ``importers`` that ``allowed(importer,
    imported)`` rejects."""
    return [
        f"{MODULES[a].relative_to(ROOT)}:{line} imports {b}"
        for a in MODULES
        if importers(a)
        for b, line in GRAPH[a].items()
        if not allowed(a, b)
    ]


ALGOS = sorted(p.stem for p in (ROOT / "algos").glob("*.py") if p.stem not in ("__init__", "harness"))


def test_the_graph_sees_the_modules_and_their_imports():
    # the parser finds what is there: top-level, lazy (inside a function) and relative imports
    assert {"envs.config", "envs.site", "envs.toml_table", "pipeline.study.tasks", "dodo"} <= set(MODULES)
    assert {f"algos.{a}" for a in ("ppo", "sac", "a2c", "dqn")} <= set(MODULES) and len(ALGOS) >= 4
    assert "envs.config" in GRAPH["envs.site"] and "envs.toml_table" in GRAPH["envs.config"]
    assert "pipeline.control.registry" in GRAPH["pipeline.study.config"]
    assert "envs.config" in GRAPH["pipeline.data.sources"]  # also inside load_sources()
    assert any(_under(m, "algos.harness") for m in GRAPH["algos.ppo"])


def test_envs_imports_no_other_package_of_the_project():
    bad = _violations(lambda a: _under(a, "envs"), lambda a, b: _under(b, "envs"))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("algo", ALGOS)
def test_an_algo_imports_only_envs_and_the_harness(algo):
    bad = _violations(lambda a: a == f"algos.{algo}", lambda a, b: _under(b, "envs", "algos.harness"))
    assert not bad, "\n".join(bad)


def test_the_harness_imports_only_envs():
    bad = _violations(lambda a: _under(a, "algos.harness"), lambda a, b: _under(b, "envs", "algos.harness"))
    assert not bad, "\n".join(bad)


def test_the_pipeline_imports_neither_the_algos_nor_the_benchmarks():
    bad = _violations(lambda a: _under(a, "pipeline"), lambda a, b: not _under(b, "algos", "benchmarks", "dodo"))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "lower, higher",
    [("pipeline.data", ("pipeline.control", "pipeline.study")), ("pipeline.control", ("pipeline.study",))],
    ids=["data", "control"],
)
def test_inside_the_pipeline_data_and_control_do_not_import_what_stands_on_them(lower, higher):
    bad = _violations(lambda a: _under(a, lower), lambda a, b: not _under(b, *higher))
    assert not bad, "\n".join(bad)


def test_dodo_imports_the_pipeline_and_nothing_below_it():
    bad = _violations(lambda a: a == "dodo", lambda a, b: not _under(b, "envs", "algos"))
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {a: set(imported) for a, imported in GRAPH.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        cycle = exc.args[1][::-1]  # graphlib lists each module before the one that imports it
        steps = [f"{a} -> {b} ({MODULES[a].relative_to(ROOT)}:{GRAPH[a][b]})" for a, b in itertools.pairwise(cycle)]
        pytest.fail("import circle:\n" + "\n".join(steps))


def test_every_registry_runner_names_a_function():
    from pipeline.control import registry

    for c in registry.CONTROLLERS.values():
        if c.simulated:
            assert callable(c.run_function), c.name
        else:
            with pytest.raises(TypeError, match="trained, not simulated"):
                _ = c.run_function


def test_reading_the_settings_and_the_controller_table_imports_no_controller():
    """The registry names its runners by module and the tuning imports its planner where it runs, so reading the
    study's settings and the controller table (what ``dodo.py`` does before anything else: a bad doit variable or site
    config stops doit there) and naming every stage's files (doit's targets) import neither torch nor a controller;
    ``envs.site`` likewise leaves the env (torch) until it is asked for."""
    import subprocess
    import sys

    code = (
        "import sys, envs.site, pipeline.study.config, pipeline.control.registry as r; r.simulated(); "
        "from pipeline.control.tuning import BUDGETS; "
        "from pipeline.study.results import outputs; outputs(pipeline.study.config.from_environment()); "
        "light = {r.__name__, 'pipeline.control.tuning', 'pipeline.control.tuned'}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pipeline.control.') and m not in light))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_doit_loads_every_task_without_torch_matplotlib_or_pvlib(tmp_path):
    """``doit list`` (every task of ``dodo.py`` created, its targets named) and the study's graph, which doit's process
    imports to submit a stage's tasks, import none of the heavy libraries: each task imports them where it runs (a Dask
    worker, or the stage that needs them), so doit answers in about a second. doit loads ``dodo.py`` as its command
    line does (so the experiment folder, here a fresh one, is created for its state database); ``--status`` runs every
    up-to-date check, ``mpc_rl``'s own (its run's fingerprint from its training command) included."""
    import os
    import subprocess
    import sys

    from pipeline.control.tuned import rl_policy_file, rl_run_dir

    run = rl_run_dir(tmp_path / "outputs" / "caltech" / "tuned", 1)  # a finished run, made by other code
    run.mkdir(parents=True)
    (run / "run.json").write_text('{"fingerprint": "other"}')
    rl_policy_file(run).write_bytes(b"")
    code = (
        "import sys; from doit.doit_cmd import DoitMain; "
        "rc = DoitMain().run(['list', '--status', '--all', '-q']); import pipeline.study.graph; "
        "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'pvlib', 'highspy')))"
    )
    env = {**os.environ, "EVHUB_OUTPUT_DIR": str(tmp_path / "outputs")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    out = out.stdout
    assert out.strip().splitlines()[-1] == "0 []", out
