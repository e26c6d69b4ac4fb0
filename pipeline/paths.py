"""Where the project lies, and how the pipeline shows a path: shared by its sub-packages (data, control, study)."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def shown_path(path: str | Path) -> str:
    """``path`` as a report shows it: relative to the project root when it lies inside it (a shipped site
    config reads ``envs/sites/caltech.toml`` on every machine), else as given."""
    try:
        return Path(path).resolve().relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        return str(path)
