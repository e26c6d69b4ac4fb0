"""What each stage of the study depends on, in one place: the code as globs over the project, a site's files, and the
fingerprint of a set of files.

Read by doit (``file_dep`` in ``dodo.py``: a changed file re-runs the stage), by a training run's fingerprint
(:func:`pipeline.study.tasks.run_fingerprint`: a changed file makes a run a fresh one, not a resume of the last) and by
a tuning's (:func:`pipeline.control.tuning.fingerprint`: a changed file makes a cached tuning stale). One definition,
so that what re-runs a stage also invalidates what the stage cached.

Globbed rather than listed, so that a new module of ``envs/`` (or of the harness) is a dependency without anyone
remembering to add it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from envs.site import site_files as _site_files
from pipeline.paths import PROJECT_ROOT

ENV = ("envs/**/*.py",)
"""The environments and what they stand on (site model, schemas, KPIs, vector envs, seeding, file writing)."""
HARNESS = ("algos/harness.py", "algos/harness/**/*.py")
"""The agents' shared harness (a module or a package)."""
DATA = ("pipeline/data/**/*.py", "envs/schemas.py", "envs/site.py", "envs/timestep.py")
"""Ingestion: raw sources, readers, PV models, synthetic fleets, the site config and schemas it checks with, and the
steps it writes the series at."""
CONTROL = ("pipeline/control/**/*.py",)
"""The simulated controllers: registry, baselines, planners, the oracle, the learned planners' tuning."""
REPORT = (
    "pipeline/study/report.py",
    "pipeline/study/comparison.py",
    "pipeline/study/figures.py",
    "pipeline/study/document.py",
    "pipeline/study/information.py",
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


def ingestion(root: Path = PROJECT_ROOT) -> list[Path]:
    """The code the doit task ``ingest`` depends on (:data:`DATA`)."""
    return files(*DATA, root=root)


def controllers(root: Path = PROJECT_ROOT) -> list[Path]:
    """The code the simulated controllers depend on: every file of ``envs`` and of ``pipeline/control``."""
    return files(*ENV, *CONTROL, root=root)


def site_files(site_toml: str | Path) -> list[Path]:
    """A site's files: its TOML and its processed series at its step and ``sessions.parquet``
    (:func:`envs.site.site_files`; the data files need not exist yet)."""
    return list(_site_files(site_toml).values())


def fingerprint(paths: Iterable[Path], *, root: Path = PROJECT_ROOT, salt: str = "") -> str:
    """SHA-256 (hex) of ``salt`` and of each file's name and bytes, in the given order.

    A file inside ``root`` is named by its path relative to ``root`` (a copy of the project elsewhere gives the same
    fingerprint), any other by its name alone (a site's data folder may be moved).

    Raises:
        FileNotFoundError: a path that is not a file.
    """
    h = hashlib.sha256(salt.encode())
    for p in paths:
        p = Path(p)
        try:
            name = p.resolve().relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            name = p.name
        h.update(name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def as_strings(paths: list[Path]) -> list[str]:
    """``paths`` as strings (doit's ``file_dep``)."""
    return [str(p) for p in paths]
