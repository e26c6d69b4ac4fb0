"""The names of the study's result files, written and read here only.

Under ``<output_dir>/<experiment>/``::

    baselines/<controller>_<split>.parquet                 one KPI row of a simulated controller
    baselines/<controller>_<split>_traces.parquet          its hourly traces
    runs/<agent>_seed<seed>/                               a training run (TensorBoard events, metrics, policy)
    eval/<agent>_seed<seed>_<split>[_traces].parquet       a trained agent evaluated on a split

Controller names may hold underscores (``rule_based``, ``mpc_perfect``); a split name is the last part and
never holds one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TRACES_SUFFIX = "_traces"
_SEED = re.compile(r"^(?P<controller>.+)_seed(?P<seed>\d+)$")


def run_name(agent: str, seed: int) -> str:
    """A training run's folder name, ``<agent>_seed<seed>``."""
    return f"{agent}_seed{seed}"


def stem(controller: str, split: str, seed: int | None = None) -> str:
    """``<controller>_<split>`` or, for a seeded agent, ``<agent>_seed<seed>_<split>``.

    Raises:
        ValueError: a split name with an underscore (it could not be read back).
    """
    if "_" in split:
        raise ValueError(f"split name {split!r} must not contain '_'")
    return f"{controller if seed is None else run_name(controller, seed)}_{split}"


def files(folder: str | Path, controller: str, split: str, seed: int | None = None) -> tuple[Path, Path]:
    """``(kpi_file, traces_file)`` of one controller (or seeded agent) on one split inside ``folder``."""
    s = stem(controller, split, seed)
    return Path(folder) / f"{s}.parquet", Path(folder) / f"{s}{TRACES_SUFFIX}.parquet"


@dataclass(frozen=True)
class ResultFile:
    """What a result file's name says: its controller, seed (None for a simulated controller), split and whether
    it holds traces."""

    controller: str
    seed: int | None
    split: str
    traces: bool


def parse(path: str | Path) -> ResultFile:
    """Read a result file's name back (the inverse of :func:`files`).

    Raises:
        ValueError: a name that :func:`files` does not write.
    """
    name = Path(path).name
    if not name.endswith(".parquet"):
        raise ValueError(f"{path}: not a result file (expected <controller>_<split>[_traces].parquet)")
    base = name.removesuffix(".parquet")
    traces = base.endswith(TRACES_SUFFIX)
    base = base.removesuffix(TRACES_SUFFIX) if traces else base
    head, sep, split = base.rpartition("_")
    if not sep or not head or not split:
        raise ValueError(f"{path}: not a result file (expected <controller>_<split>[_traces].parquet)")
    m = _SEED.match(head)
    return ResultFile(m["controller"], int(m["seed"]), split, traces) if m else ResultFile(head, None, split, traces)
