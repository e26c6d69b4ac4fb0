"""The ``co2_comparison`` table: one row per controller x split, read from the KPI files, and what the pages and
figures ask of it: its order, which rows serve the EVs, which learning earns credit and which controller a site should
run.

Read by the report's pages (:mod:`pipeline.study.report`), its figures (:mod:`pipeline.study.figures`) and the live
path, which runs the report's answer (:func:`best_controllers`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from envs.kpis import KPI_COLUMNS, add_relative_kpis
from pipeline.control import registry

SPLIT_ORDER = ("train", "test")
"""Splits in report order; other split names follow alphabetically."""

RELATIVE_KPIS = ("co2_reduction_pct", "gap_closed_vs_rule_pct", "saving_vs_oracle_pct")
"""KPIs recomputed here from the uncontrolled, rule-based and oracle rows (:func:`envs.kpis.add_relative_kpis`; an
input file need not carry them)."""

REQUIRED_KPI_COLUMNS = ("controller", "split", *(c for c in KPI_COLUMNS if c not in RELATIVE_KPIS))
"""Columns every KPI file must have."""

SEED_COLUMNS = ("n_seeds", *(f"{c}_std" for c in KPI_COLUMNS))
"""Columns of ``co2_comparison.parquet`` after the KPIs: how many seeds a row averages and each KPI's standard
deviation over them (NaN for one seed)."""

START_COLUMNS = ("start", "co2_vs_start_kg")
"""Last columns of ``co2_comparison.parquet``: a learned controller's untrained start (the row its learning is credited
against, :attr:`pipeline.control.registry.Controller.start`; "" where none) and its CO2 minus the start's on the same
split, kg (negative: the learning cut CO2; NaN without a start row)."""


GAP_VS_RULE = "gap closed vs rule"
"""The name the pages give ``gap_closed_vs_rule_pct`` (headers, sentences, its definition in
:data:`pipeline.study.report.DEFINITIONS`)."""

SAVING_VS_ORACLE = "saving vs oracle"
"""The name the pages give ``saving_vs_oracle_pct`` (headers, sentences, the main figure,
:data:`pipeline.study.report.DEFINITIONS`)."""

SERVED_SHARE_MIN = 0.99
"""An agent must deliver at least this share of the uncontrolled controller's delivered EV energy."""


# --------------------------------------------------------------------------------------------- order
def controller_sort_key(name: str) -> tuple[int, str]:
    """Sort key: the registry's order (:func:`pipeline.control.registry.sort_key`): the causal controllers, the agents
    by name, then the bounds (``mpc_perfect``, ``oracle``)."""
    return registry.sort_key(name)


def split_sort_key(name: str) -> tuple[int, str]:
    """Sort key: ``train``, ``test``, then other splits alphabetically."""
    return (SPLIT_ORDER.index(name), "") if name in SPLIT_ORDER else (len(SPLIT_ORDER), name)


# ------------------------------------------------------------------------------------------ the table
def read_kpi_files(kpi_files: Iterable[Path]) -> pd.DataFrame:
    """Read KPI Parquet files into one ``co2_comparison`` table, averaging each agent over its seeds.

    Args:
        kpi_files: Parquet files as written from :func:`envs.kpis.kpi_row` (one or a few rows each; columns
            ``controller``, ``split``, the KPIs, possibly ``seed`` and other extra columns, which are dropped).
            An agent trained with several seeds has one row per seed (its ``seed`` column tells them apart).

    Returns:
        DataFrame with one row per controller x split and the columns ``controller``, ``split``,
        :data:`envs.kpis.KPI_COLUMNS` (float64, the mean over the seeds), then :data:`SEED_COLUMNS`: ``n_seeds`` (rows
        averaged: the training seeds of an agent, 1 for a baseline) and ``<kpi>_std`` for every KPI (sample
        standard deviation over the seeds, NaN for a single seed). Relative KPIs are recomputed per seed from
        the uncontrolled and oracle rows before averaging. Then :data:`START_COLUMNS`. Rows are ordered by split
        (train, test, others) then controller (see :func:`controller_sort_key`).

    Raises:
        ValueError: no files; a file lacks a required column (names the file and the columns); or a
            controller x split (x seed) appears twice (names both files).
    """
    frames = []
    seen: dict[tuple, Path] = {}
    for path in kpi_files:
        path = Path(path)
        df = pd.read_parquet(path)
        missing = [c for c in REQUIRED_KPI_COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"KPI file {path} lacks required columns: {', '.join(missing)}")
        for c in RELATIVE_KPIS:
            if c not in df.columns:
                df[c] = math.nan
        seed = df["seed"].astype("float64").to_numpy() if "seed" in df.columns else np.full(len(df), math.nan)
        df = df[["controller", "split", *KPI_COLUMNS]].copy()
        df["controller"] = df["controller"].astype(str)
        df["split"] = df["split"].astype(str)
        df["seed"] = seed
        for c, sp, sd in zip(df.controller, df.split, df.seed):
            key = (c, sp, None if math.isnan(sd) else sd)
            if key in seen:
                what = f"controller {c!r} on split {sp!r}" + ("" if key[2] is None else f" with seed {sd:g}")
                raise ValueError(f"{what} appears in both {seen[key]} and {path}")
            seen[key] = path
        frames.append(df)
    if not frames:
        raise ValueError("write_report needs at least one KPI file")
    per_seed = pd.concat(frames, ignore_index=True)
    per_seed[list(KPI_COLUMNS)] = per_seed[list(KPI_COLUMNS)].astype("float64")
    per_seed = add_relative_kpis(per_seed)
    groups = per_seed.groupby(["controller", "split"], sort=False)[list(KPI_COLUMNS)]
    table = (
        groups.mean().join(groups.size().rename("n_seeds")).join(groups.std(ddof=1).add_suffix("_std")).reset_index()
    )
    table["n_seeds"] = table["n_seeds"].astype("int64")
    order = sorted(
        range(len(table)), key=lambda i: (split_sort_key(table.split[i]), controller_sort_key(table.controller[i]))
    )
    table = table.iloc[order].reset_index(drop=True)
    table["start"] = [registry.describe(c).start or "" for c in table.controller]
    co2 = table.set_index(["controller", "split"]).co2_kg
    table["co2_vs_start_kg"] = [
        r.co2_kg - co2.get((r.start, r.split), math.nan) if r.start else math.nan for r in table.itertuples()
    ]
    return table[["controller", "split", *KPI_COLUMNS, *SEED_COLUMNS, *START_COLUMNS]]


def beats_its_start(table: pd.DataFrame, name: str, split: str = "train") -> bool:
    """Whether controller ``name``'s learning is credited: it emits less CO2 than its untrained start on ``split``
    (the train split: a choice on the test split's outcome would break the protocol). True for a controller without
    a start row in ``table``."""
    start = registry.describe(name).start
    rows = table[(table.split == split) & table.controller.isin([name, start])].set_index("controller").co2_kg
    return not start or start not in rows or name not in rows or bool(rows[name] < rows[start])


def serving(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of one split that deliver at least :data:`SERVED_SHARE_MIN` of the uncontrolled row's EV energy (all
    rows when there is no uncontrolled row)."""
    base = rows[rows.controller == "uncontrolled"]
    if base.empty or math.isnan(float(base.ev_energy_delivered_kwh.iloc[0])):
        return rows
    return rows[rows.ev_energy_delivered_kwh >= SERVED_SHARE_MIN * float(base.ev_energy_delivered_kwh.iloc[0])]


def best_controllers(table: pd.DataFrame, split: str = "test") -> dict[str, str]:
    """Which controller a site should run: on ``split`` (the held-out one), among the rows that serve the EVs
    (:func:`serving`), ``"causal"``: the lowest CO2 of the causal controllers (never ``mpc_perfect`` or the
    ``oracle``), ``"learned"``: the lowest of the causal learned ones (learned planners and agents), ``"bound"``: the
    ``oracle`` when present. A learned controller whose learning does not beat its untrained start on the train
    split (:func:`beats_its_start`) is named by neither: its start is. A key is absent when no row qualifies."""
    rows = serving(table[table.split == split].dropna(subset=["co2_kg"]))
    rows = rows[rows.controller.map(lambda n: beats_its_start(table, str(n)))]
    out = {}
    for key, keep in (("causal", lambda c: c.causal), ("learned", lambda c: c.causal and c.learned)):
        cand = rows[rows.controller.map(lambda n, keep=keep: keep(registry.describe(str(n))))]
        if len(cand):
            out[key] = str(cand.loc[cand.co2_kg.idxmin()].controller)
    if (table.controller == "oracle").any():
        out["bound"] = "oracle"
    return out
