"""The code each stage of the study depends on, as globs over the project: one definition, read by doit
(``file_dep`` in ``dodo.py``: a changed file re-runs the stage) and by :func:`pipeline.study.tasks.run_fingerprint`
(a changed file makes a training run a fresh one, not a resume of the last).

Globbed rather than listed, so that a new module of ``envs/`` (or of the harness) is a dependency without anyone
remembering to add it.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.study.config import PROJECT_ROOT

ENV = ("envs/**/*.py",)
"""The environments and what they stand on (site model, schemas, KPIs, vector envs, seeding, file writing)."""
HARNESS = ("algos/harness.py", "algos/harness/**/*.py")
"""The agents' shared harness (a module or a package)."""
DATA = ("pipeline/data/**/*.py",)
"""Ingestion: raw sources, readers, PV models, synthetic fleets."""
CONTROL = ("pipeline/control/**/*.py",)
"""The simulated controllers: registry, baselines, planners, the oracle."""
REPORT = (
    "pipeline/study/report.py",
    "pipeline/study/document.py",
    "pipeline/study/tasks.py",
    "pipeline/study/results.py",
    "pipeline/control/registry.py",
)
"""What writes the report from the result files."""


def files(*patterns: str, root: Path = PROJECT_ROOT) -> list[Path]:
    """The files matching the glob ``patterns`` under ``root``, sorted, each once (``__pycache__`` left out)."""
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}
    return sorted(found)


def training(algo: str, root: Path = PROJECT_ROOT) -> list[Path]:
    """The code a training run of ``algos/<algo>.py`` depends on: its script, the harness and every file of ``envs``."""
    return files(f"algos/{algo}.py", *HARNESS, *ENV, root=root)


def controllers(root: Path = PROJECT_ROOT) -> list[Path]:
    """The code the simulated controllers depend on: ``envs`` and ``pipeline/control``."""
    return files(*ENV, *CONTROL, root=root)


def as_strings(paths: list[Path]) -> list[str]:
    """``paths`` as strings (doit's ``file_dep``)."""
    return [str(p) for p in paths]
