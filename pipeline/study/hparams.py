"""Each learned run's settings and evaluation as a TensorBoard HParams summary, so that ``tensorboard --logdir
outputs/`` compares seeds and settings in one table (TensorBoard's HParams dashboard).

One folder per learned run (an agent or a learned planner, one seed), ``<experiment>/hparams/<controller>_seed<seed>/``,
rewritten by the report stage: its hyper-parameters (an agent's run arguments from its ``config.json``; a tuned
planner's parameters from its tuning summary; ``mpc_rl``'s policy run's arguments; those with one value in every run
left out, :func:`shown_settings`) and, on each split, its CO2 (kg),
unserved energy (kWh) and gap closed vs the battery rule (%, ``100 * (rule_based - CO2) / (rule_based - oracle)``,
NaN where the rule emits no more than the oracle), as the metrics ``co2_kg/<split>``, ``unserved_kwh/<split>`` and
``gap_closed_vs_rule_pct/<split>``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from pipeline.control.tuned import rl_run_dir, tuning_files
from pipeline.study.results import run_name

HPARAMS_DIR = "hparams"
"""The folder of the HParams summaries inside an experiment's output folder."""

EXPERIMENT_DIR = "_experiment"
"""The folder inside :data:`HPARAMS_DIR` of the one experiment summary (every setting and metric: the table's
columns, which TensorBoard takes from one summary, not from each run's)."""

METRICS = ("co2_kg", "unserved_kwh", "gap_closed_vs_rule_pct")
"""The evaluation logged per split, each as ``<metric>/<split>``."""


def _scalars(d: dict, prefix: str = "") -> dict:
    """``d``'s values as HParams values: numbers, strings and bools as they are, lists and tuples as text, nested
    dicts flattened (``prefix.key``), None left out."""
    out: dict = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _scalars(value, f"{name}.")
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)
    return out


def run_settings(root: Path, controller: str, seed: int) -> dict:
    """The hyper-parameters of the learned run ``controller`` x ``seed`` of the experiment at ``root``: an agent's
    ``runs/<agent>_seed<seed>/config.json``, ``mpc_tuned``'s and ``mpc_adaptive``'s tuning summary (its parameters and
    budget), ``mpc_rl``'s policy run's ``config.json`` (``policy.``-prefixed) with the tuning's parameters; what is
    missing is left out. Always ``controller`` and ``seed``."""
    out: dict = {"controller": controller, "seed": seed}
    config = root / "runs" / run_name(controller, seed) / "config.json"
    if config.is_file():
        return out | _scalars(json.loads(config.read_text())) | {"controller": controller, "seed": seed}
    summary = tuning_files(root / "tuned", seed)[0]
    if controller.startswith("mpc_") and summary.is_file():
        s = json.loads(summary.read_text())
        out |= _scalars(s.get("params", {})) | {"budget": s.get("budget", "")}
    policy = rl_run_dir(root / "tuned", seed) / "config.json"
    if controller == "mpc_rl" and policy.is_file():
        out |= _scalars(json.loads(policy.read_text()), "policy.")
    return out


ALWAYS_SHOWN = ("controller", "seed", "budget", "preset", "total_timesteps", "learning_rate")
"""Settings shown for every run that has them; any other is shown only where it differs between the runs."""


def shown_settings(settings: dict) -> dict:
    """``settings`` (run -> its :func:`run_settings`) with each setting that has one value in every run that has it
    left out, but for :data:`ALWAYS_SHOWN`: the table then holds what tells the runs apart (an agent's run has about
    fifty arguments)."""
    values: dict = {}
    for s in settings.values():
        for key, value in s.items():
            values.setdefault(key, set()).add(json.dumps(value))
    varying = {key for key, seen in values.items() if len(seen) > 1 or key in ALWAYS_SHOWN}
    return {run: {k: v for k, v in s.items() if k in varying} for run, s in settings.items()}


def evaluation(rows: pd.DataFrame) -> pd.DataFrame:
    """Per learned run and split, the :data:`METRICS`: ``rows`` are KPI rows (``controller``, ``split``, ``co2_kg``,
    ``unserved_kwh``, ``seed``: NaN for a controller without one) that include ``rule_based`` and ``oracle`` on each
    split. Returns ``controller``, ``seed`` (int), ``split`` and the metrics, one row per seeded row of ``rows``."""
    base = rows[rows.seed.isna()].set_index(["controller", "split"]).co2_kg
    seeded = rows[rows.seed.notna()].copy()

    def gap(r) -> float:
        rule, oracle = base.get(("rule_based", r.split), math.nan), base.get(("oracle", r.split), math.nan)
        return 100.0 * (rule - r.co2_kg) / (rule - oracle) if rule > oracle else math.nan

    seeded["gap_closed_vs_rule_pct"] = [gap(r) for r in seeded.itertuples()] if len(seeded) else []
    seeded["seed"] = seeded.seed.astype(int)
    return seeded[["controller", "seed", "split", *METRICS]].reset_index(drop=True)


def _write(folder: Path, summaries: list, scalars: dict) -> Path:
    """An event file of ``summaries`` and ``scalars`` (tag -> float) in ``folder``, which it replaces."""
    from torch.utils.tensorboard import SummaryWriter

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = SummaryWriter(str(tmp))
    for summary in summaries:
        writer.file_writer.add_summary(summary)
    for tag, value in scalars.items():
        writer.add_scalar(tag, value)
    writer.close()
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def write_hparams(kpi_files: Iterable[Path], root: Path) -> list[Path]:
    """Write one HParams summary per learned run found in ``kpi_files`` (the report's KPI files; a run is a seeded
    row's controller x seed) into ``root / HPARAMS_DIR / <controller>_seed<seed>/``, and the experiment's columns into
    ``root / HPARAMS_DIR / EXPERIMENT_DIR`` (each folder replaced, so that a report made again leaves one summary).
    Returns the runs' folders written (none, and nothing written, without a seeded row).

    Raises:
        ValueError: a KPI file without the ``controller``, ``split`` or ``co2_kg`` column (named)."""
    from torch.utils.tensorboard.summary import hparams

    frames = []
    for path in kpi_files:
        df = pd.read_parquet(path)
        missing = [c for c in ("controller", "split", "co2_kg") if c not in df.columns]
        if missing:
            raise ValueError(f"KPI file {path} lacks the columns {', '.join(missing)}")
        df = df.assign(seed=df["seed"].astype("float64") if "seed" in df.columns else math.nan)
        frames.append(df.reindex(columns=["controller", "split", "co2_kg", "unserved_kwh", "seed"]))
    if not frames:
        return []
    table = evaluation(pd.concat(frames, ignore_index=True))
    if table.empty:
        return []
    runs_of = sorted(set(zip(table.controller, table.seed)))
    settings = shown_settings({(c, s): run_settings(root, c, int(s)) for c, s in runs_of})
    written, every_metric = [], {}
    for (controller, seed), runs in table.groupby(["controller", "seed"], sort=True):
        metrics = {f"{m}/{r.split}": float(getattr(r, m)) for r in runs.itertuples() for m in METRICS}
        every_metric |= metrics
        _, start, end = hparams(settings[(controller, seed)], metrics)
        written.append(_write(root / HPARAMS_DIR / run_name(controller, int(seed)), [start, end], metrics))
    union: dict = {}
    for s in settings.values():
        union |= {k: v for k, v in s.items() if k not in union}
    experiment = hparams(union, every_metric)[0]  # one experiment: every setting and metric, the table's columns
    _write(root / HPARAMS_DIR / EXPERIMENT_DIR, [experiment], {})
    return written
