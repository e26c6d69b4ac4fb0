"""The study's CO2 comparison report: one table, three figures, a Markdown page and the same as an HTML page.

:func:`write_report` gathers the KPI rows of every controller x split (baselines, oracle, evaluated
agents; each a Parquet written by :func:`envs.kpis.kpi_row`), their hourly traces and the agents' training
``metrics.parquet``, and writes into one folder:

- ``co2_comparison.parquet``: one row per controller x split, columns ``controller``, ``split`` and exactly
  :data:`envs.kpis.KPI_COLUMNS`, relative KPIs filled by :func:`envs.kpis.add_relative_kpis`;
- ``co2_by_controller.png``: the main figure (:func:`saving_figure`): each controller's saving vs oracle (the share
  of the oracle's CO2 saving over ``uncontrolled``), sorted, one colour per kind of controller, one panel per split,
  with its CO2 (kg) and unserved energy (kWh) beside each bar;
- ``test_week_traces.png``: one test-split week of hourly traces (the week with the most EV energy);
- ``learning_curves.png``: episodic CO2 and unserved energy vs ``global_step`` per agent (when metrics exist);
- ``report.md``: title, the answer (the controller a site should run, with its numbers, then what each of its
  columns means, :data:`DEFINITIONS`: every ratio of the report defined there once), the results (main figure,
  a compact table per split with every KPI folded under it, what each controller knows), the site, the figures;
- ``report.html``: the same content as one self-contained page (inline CSS, figures embedded as ``data:``
  URIs, nothing fetched), laid out so that at 1280 px no table is wider than its box and the answer's numbers are
  in the first screen. Both pages are rendered from one list of blocks (:func:`report_blocks`), so their
  tables and sentences cannot drift apart.

Every file is written atomically (temporary name in the output folder, then :func:`os.replace`), so a
reader never sees half a report. Figures use matplotlib's Agg canvas through :class:`matplotlib.figure.Figure`
(pyplot's global backend state is left alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import dates as mdates
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from envs.files import write_parquet, write_text
from envs.kpis import KPI_COLUMNS, add_relative_kpis
from pipeline.control import registry
from pipeline.study.document import (
    Block,
    Bullets,
    Definitions,
    Details,
    FigureRef,
    Heading,
    Note,
    Paragraph,
    Table,
    atomic_savefig,
    format_number,
    frame_table,
    markdown_table,
    render_html,
    render_markdown,
)
from pipeline.study.information import page_blocks as information_blocks

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

TRACE_PLOT_COLUMNS = ("time", "pv_kw", "pv_curtailed_kw", "grid_import_kw", "soc", "ev_charge_kw", "moer_kg_per_kwh")
"""Trace columns :func:`write_report` plots (a subset of :data:`envs.kpis.TRACE_COLUMNS`)."""

MAIN_FIGURE = "co2_by_controller.png"
"""The report's main figure (:func:`plot_saving`), shown at the head of its results."""

GAP_VS_RULE = "gap closed vs rule"
"""The name the pages give ``gap_closed_vs_rule_pct`` (headers, sentences, its definition in :data:`DEFINITIONS`)."""

SAVING_VS_ORACLE = "saving vs oracle"
"""The name the pages give ``saving_vs_oracle_pct`` (headers, sentences, the main figure, :data:`DEFINITIONS`)."""

DEFINITIONS = (
    (
        "CO2 cut (%)",
        "the CO2 a controller saves against `uncontrolled` (EVs charged at full power on arrival, battery idle), as a "
        "share of `uncontrolled`'s CO2: `100 * (CO2_uncontrolled - CO2) / CO2_uncontrolled` (`co2_reduction_pct`).",
    ),
    (
        f"{GAP_VS_RULE} (%)",
        "the share of the CO2 gap between the battery rule, `rule_based` (0%), and the perfect-foresight `oracle` "
        "(100%) that a controller closes on the same split: `100 * (CO2_rule_based - CO2) / (CO2_rule_based - "
        "CO2_oracle)`; negative where a controller emits more than `rule_based`; shown as – where `rule_based` emits "
        "no more than the oracle (`gap_closed_vs_rule_pct`).",
    ),
    (
        f"{SAVING_VS_ORACLE} (%)",
        "the share of the oracle's CO2 saving over `uncontrolled` (0%) that a controller achieves on the same split, "
        "the `oracle` being 100%: `100 * (CO2_uncontrolled - CO2) / (CO2_uncontrolled - CO2_oracle)` "
        "(`saving_vs_oracle_pct`; the main figure shows it).",
    ),
    ("unserved (kWh)", "EV energy still needed at departure (`unserved_kwh`)."),
)
"""``(term, definition)`` of each column the answer and the main figure show: the one place in the page that says what
a ratio is measured from (:func:`definitions`). Every table header and sentence names a ratio by its term."""

SERVED_SHARE_MIN = 0.99
"""An agent must deliver at least this share of the uncontrolled controller's delivered EV energy."""

RESULTS_COLUMNS = (
    ("co2_kg", "CO2 (kg)", 1),
    ("co2_vs_start_kg", "CO2 vs untrained start (kg)", 1),
    ("co2_reduction_pct", "CO2 cut vs uncontrolled (%)", 1),
    ("gap_closed_vs_rule_pct", f"{GAP_VS_RULE.capitalize()} (%)", 1),
    ("ev_energy_served_pct", "EV energy served (%)", 1),
    ("unserved_kwh", "Unserved (kWh)", 1),
)
"""``(column, header with unit, decimals)`` of the compact results table of each split (:func:`results_table`)."""

TABLE_COLUMNS = (
    ("co2_kg", "CO2 (kg)", 1),
    ("co2_vs_start_kg", "CO2 vs its untrained start (kg)", 1),
    ("co2_reduction_pct", "CO2 cut vs uncontrolled (%)", 1),
    ("gap_closed_vs_rule_pct", f"{GAP_VS_RULE.capitalize()} (%)", 1),
    ("saving_vs_oracle_pct", f"{SAVING_VS_ORACLE.capitalize()} (%)", 1),
    ("ev_energy_served_pct", "EV energy served (%)", 1),
    ("unserved_kwh", "Unserved energy (kWh)", 1),
    ("sessions_rejected", "Sessions rejected (count)", 0),
    ("grid_import_kwh", "Grid import (kWh)", 1),
    ("pv_self_consumption_pct", "PV self-consumption (%)", 1),
    ("peak_import_kw", "Peak import (kW)", 1),
    ("train_wall_s", "Training wall time (s)", 0),
    ("steps_per_s", "Training steps/s", 0),
)
"""``(column, header with unit, decimals)`` of the full KPI table of each split (:func:`kpi_table`, folded in the
page)."""

KINDS = {
    "reference": "baselines",
    "rule": "baselines",
    "planner": "planners",
    "learned planner": "learned planners",
    "agent": "agents",
    "online agent": "agents",
    "bound": "foresight",
}
"""The kind each registry family (:data:`pipeline.control.registry.FAMILIES`) is shown as in the main figure."""

KIND_COLORS = {
    "baselines": "#8a8a8a",
    "planners": "#0072b2",
    "learned planners": "#009e73",
    "agents": "#e69f00",
    "foresight": "#cc79a7",
}
"""One colour per kind (colour-blind safe), in legend order."""


# --------------------------------------------------------------------------------------------- helpers
def controller_sort_key(name: str) -> tuple[int, str]:
    """Sort key: the registry's order (:func:`pipeline.control.registry.sort_key`): the causal controllers, the agents
    by name, then the bounds (``mpc_perfect``, ``oracle``)."""
    return registry.sort_key(name)


def split_sort_key(name: str) -> tuple[int, str]:
    """Sort key: ``train``, ``test``, then other splits alphabetically."""
    return (SPLIT_ORDER.index(name), "") if name in SPLIT_ORDER else (len(SPLIT_ORDER), name)


def controller_kind(name: str) -> str:
    """The kind of controller ``name`` (a key of :data:`KIND_COLORS`), from its registry family; an unknown name is
    an agent."""
    return KINDS[registry.describe(name).family]


# ------------------------------------------------------------------------------------------ the table
def read_kpi_files(kpi_files: Iterable[Path]) -> pd.DataFrame:
    """Read KPI Parquet files into one ``co2_comparison`` table, averaging each agent over its seeds.

    Args:
        kpi_files: Parquet files as written from :func:`envs.kpis.kpi_row` (one or a few rows each; columns
            ``controller``, ``split``, the KPIs, possibly ``seed`` and other extra columns, which are dropped).
            An agent trained with several seeds has one row per seed (its ``seed`` column tells them apart).

    Returns:
        DataFrame with one row per controller x split and the columns ``controller``, ``split``,
        :data:`KPI_COLUMNS` (float64, the mean over the seeds), then :data:`SEED_COLUMNS`: ``n_seeds`` (rows
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


# ---------------------------------------------------------------------------------------------- figures
FIGURE_TEXT_COLUMNS = (("co2_kg", "CO2\n(kg)", 0, 44), ("unserved_kwh", "unserved\n(kWh)", 1, 100))
"""The text columns beside the main figure's bars: ``(KPI, header, decimals, right edge in points from the axes)``."""


def _beside(ax, text: str, y: float, x_pt: float, ha: str, xycoords=None, **kw) -> None:
    """``text`` at ``x_pt`` points right of ``ax``'s right edge, at data ``y`` (or as ``xycoords`` say)."""
    where = ax.get_yaxis_transform() if xycoords is None else xycoords
    ax.annotate(text, (1.0, y), xycoords=where, xytext=(x_pt, 0), textcoords="offset points", ha=ha, **kw)


def ranked_by_saving(rows: pd.DataFrame) -> pd.DataFrame:
    """One split's rows ordered as the main figure shows them: the largest ``saving_vs_oracle_pct`` first, ties by the
    lower CO2, rows without the ratio (NaN) last."""
    key = rows.saving_vs_oracle_pct.fillna(-math.inf)
    return (
        rows.assign(_key=key)
        .sort_values(["_key", "co2_kg"], ascending=[False, True], kind="mergesort")
        .drop(columns="_key")
    )


def saving_figure(table: pd.DataFrame) -> Figure:
    """The main figure: each controller's saving vs oracle (``saving_vs_oracle_pct``, %: the share of the oracle's CO2
    saving over ``uncontrolled``) as a horizontal bar, one panel per split side by side (train, test, others), rows in
    :func:`ranked_by_saving` order from the top, one colour per kind (:func:`controller_kind`, :data:`KIND_COLORS`, a
    legend of the kinds shown), the axis named for the ratio (:data:`SAVING_VS_ORACLE`). Beside the bars two columns
    of text, CO2 (kg) and unserved EV energy (kWh) (:data:`FIGURE_TEXT_COLUMNS`); a row that serves less than
    :data:`SERVED_SHARE_MIN` of the uncontrolled EV energy is in red with its share served. A row without the ratio (no
    uncontrolled or oracle row on its split, or no saving between them) gets no bar, only its text; a panel without
    any says so.

    It shows the saving vs oracle rather than the gap closed vs rule (``gap_closed_vs_rule_pct``, the ratio of the
    answer's and the compact tables): both order the rows of a split alike (each falls as CO2 rises, in a straight
    line), but the saving keeps the bar of every controller that emits less than ``uncontrolled`` within 0..100%,
    where the gap from the battery rule puts ``uncontrolled`` far below zero (about -245% on caltech's 2021 test
    split) and squeezes every other bar into a third of the axis.

    Args:
        table: the ``co2_comparison`` table (:func:`read_kpi_files`), at least one row.
    """
    splits = sorted(table.split.unique(), key=split_sort_key)
    n_rows = max((int((table.split == sp).sum()) for sp in splits), default=1)
    fig = Figure(figsize=(5.9 * len(splits), 1.9 + 0.34 * n_rows), layout="constrained")
    axes = fig.subplots(1, len(splits), squeeze=False)[0]
    kinds_shown: set[str] = set()
    red = "#b00020"
    for ax, sp in zip(axes, splits):
        rows = table[table.split == sp]
        serves = set(serving(rows).controller)
        base = rows[rows.controller == "uncontrolled"].ev_energy_delivered_kwh
        rows = ranked_by_saving(rows)
        y = np.arange(len(rows))
        saving = rows.saving_vs_oracle_pct.to_numpy(np.float64)
        kinds = [controller_kind(c) for c in rows.controller]
        kinds_shown |= set(kinds)
        ax.barh(y, np.nan_to_num(saving), height=0.72, color=[KIND_COLORS[k] for k in kinds])
        lo = min(0.0, float(np.nanmin(saving)) if np.isfinite(saving).any() else 0.0)
        ax.set_xlim(lo - 3.0 if lo < 0 else 0.0, 125.0)
        for yi, g in zip(y, saving):
            if not math.isnan(g):
                ax.text(max(g, 0.0) + 1.0, yi, f"{g:.1f}%", va="center", ha="left", fontsize=10)
        for col, header, decimals, right in FIGURE_TEXT_COLUMNS:
            _beside(ax, header, 1.0, right, "right", ax.transAxes, va="bottom", fontsize=9.5, color="#57606a")
            for yi, r in zip(y, rows.itertuples()):
                short = r.controller not in serves
                style = {"color": red, "fontweight": "bold"} if short else {"color": "#1f2328"}
                value = format_number(getattr(r, col), decimals)
                _beside(ax, value, yi, right, "right", va="center", fontsize=10, **style)
        for yi, r in zip(y, rows.itertuples()):
            if r.controller not in serves and len(base) and float(base.iloc[0]) > 0:
                served = f"{100 * r.ev_energy_delivered_kwh / float(base.iloc[0]):.1f}% served"
                right = FIGURE_TEXT_COLUMNS[-1][3]
                _beside(ax, served, yi, right + 6, "left", va="center", fontsize=10, color=red, fontweight="bold")
        ax.set_yticks(y, list(rows.controller), fontsize=11)
        ax.invert_yaxis()  # the most closed on top
        ax.set_xticks([t for t in (0, 20, 40, 60, 80, 100) if t >= ax.get_xlim()[0]])
        ax.tick_params(axis="x", labelsize=10)
        ax.axvline(0.0, color="#1f2328", lw=0.8)
        ax.axvline(100.0, color="#1f2328", lw=0.8, ls=":")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlabel(f"{SAVING_VS_ORACLE} (%): share of the oracle's CO2 saving\n0% = uncontrolled, 100% = oracle",
                      fontsize=10)  # fmt: skip
        ax.set_title(f"{sp} split", fontsize=12, fontweight="bold")
        if not np.isfinite(saving).any():
            ax.text(0.5, 0.5, f"no {SAVING_VS_ORACLE} known: no saving\nbetween uncontrolled and oracle",
                    transform=ax.transAxes, ha="center", va="center", fontsize=10, color="#57606a")  # fmt: skip
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in KIND_COLORS if k in kinds_shown]
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize=10.5, frameon=False)
    return fig


def plot_saving(table: pd.DataFrame, path: Path) -> Path:
    """Write :func:`saving_figure` of ``table`` as a PNG to ``path`` (atomically); returns ``path``."""
    return atomic_savefig(saving_figure(table), path)


def _read_traces(path: Path) -> pd.DataFrame:
    df = pd.read_parquet(path)
    missing = [c for c in TRACE_PLOT_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace file {path} lacks columns: {', '.join(missing)}")
    time = pd.to_datetime(df["time"])
    df["time"] = time.dt.tz_localize("UTC") if time.dt.tz is None else time.dt.tz_convert("UTC")
    return df.sort_values("time").reset_index(drop=True)


def choose_week(traces: pd.DataFrame, timezone: str = "UTC") -> tuple[pd.Timestamp, pd.Timestamp]:
    """The week of ``traces`` with the most EV energy: ``(start, end)`` UTC timestamps, end exclusive.

    Candidate starts are local Mondays 00:00 (in ``timezone``) with a whole week of steps after them; if
    there is none, every step with a whole week after it; if the traces are shorter than a week, the
    whole table. EV energy is ``sum(ev_charge_kw) * dt`` (kWh); ties go to the earliest week.
    """
    t = traces["time"]
    if len(t) < 2:
        return t.iloc[0], t.iloc[0] + pd.Timedelta(hours=1)
    dt = pd.Series(t).diff().median()
    n = max(1, round(pd.Timedelta(days=7) / dt))
    if len(t) <= n:
        return t.iloc[0], t.iloc[-1] + dt
    energy = traces["ev_charge_kw"].to_numpy(np.float64)
    window = np.convolve(energy, np.ones(n), mode="valid")  # window[i] = sum(energy[i:i+n])
    local = t.dt.tz_convert(timezone)
    monday = ((local.dt.day_of_week == 0) & (local.dt.hour == 0) & (local.dt.minute == 0)).to_numpy()[: len(window)]
    candidates = np.flatnonzero(monday) if monday.any() else np.arange(len(window))
    i = int(candidates[np.argmax(window[candidates])])
    return t.iloc[i], t.iloc[i] + n * dt


def _week_columns(available: Iterable[str], table: pd.DataFrame) -> list[str]:
    """Controllers shown in the week figure: uncontrolled, the controller a site should run and the best learned one
    (:func:`best_controllers` on the test split), the oracle; those that have traces; else up to three of any."""
    available = sorted(set(available), key=controller_sort_key)
    best = best_controllers(table) if (table.split == "test").any() else {}
    picks = ["uncontrolled", best.get("causal"), best.get("learned"), "oracle"]
    cols = list(dict.fromkeys(c for c in picks if c in available))
    return cols if len(cols) > 1 else available[:3]


def plot_test_week(
    traces: Mapping[str, pd.DataFrame], table: pd.DataFrame, path: Path, timezone: str = "UTC"
) -> tuple[Path, tuple[pd.Timestamp, pd.Timestamp]] | None:
    """One test week of hourly traces, one column of panels per controller, shared y per row.

    Rows: PV available and curtailed (kW), grid import (kW), BESS SOC (%), EV charging (kW), carbon
    intensity (kg/kWh). The week is chosen by :func:`choose_week` on the uncontrolled traces (else the
    first shown controller's). Returns ``(path, (start, end))`` or ``None`` when ``traces`` is empty.
    """
    cols = _week_columns(traces, table)
    if not cols:
        return None
    ref = traces["uncontrolled"] if "uncontrolled" in traces else traces[cols[0]]
    start, end = choose_week(ref, timezone)
    rows = (
        ("PV (kW)", "pv"),
        ("Grid import (kW)", "grid_import_kw"),
        ("BESS SOC (%)", "soc"),
        ("EV charging (kW)", "ev_charge_kw"),
        ("Carbon intensity\n(kg CO2/kWh)", "moer_kg_per_kwh"),
    )
    fig = Figure(figsize=(4.6 * len(cols) + 1.0, 10.5), layout="constrained")
    axes = fig.subplots(len(rows), len(cols), sharex="col", sharey="row", squeeze=False)
    for j, c in enumerate(cols):
        tr = traces[c]
        w = tr[(tr.time >= start) & (tr.time < end)]
        x = w.time.dt.tz_convert(timezone).dt.tz_localize(None)
        for i, (label, key) in enumerate(rows):
            ax = axes[i, j]
            if key == "pv":
                ax.plot(x, w.pv_kw, drawstyle="steps-post", color="goldenrod", lw=1.2, label="PV available")
                ax.fill_between(
                    x, w.pv_curtailed_kw, step="post", color="tab:red", alpha=0.45, lw=0, label="PV curtailed"
                )
            elif key == "soc":
                ax.plot(x, 100.0 * w.soc, drawstyle="steps-post", color="tab:green", lw=1.2)
                ax.set_ylim(-5, 105)
            else:
                color = {"grid_import_kw": "tab:blue", "ev_charge_kw": "tab:purple", "moer_kg_per_kwh": "dimgray"}[key]
                ax.plot(x, w[key], drawstyle="steps-post", color=color, lw=1.2)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(label)
        axes[-1, j].xaxis.set_major_formatter(mdates.DateFormatter("%a %d %b"))
        axes[-1, j].tick_params(axis="x", labelrotation=45, labelsize=8)
        for lab in axes[-1, j].get_xticklabels():
            lab.set_horizontalalignment("right")
        axes[-1, j].set_xlabel(f"local time ({timezone})")
        co2 = float(w.co2_kg.sum()) if "co2_kg" in w else math.nan
        uns = float(w.unserved_kwh.sum()) if "unserved_kwh" in w else math.nan
        axes[0, j].set_title(f"{c}\nweek CO2 {co2:,.1f} kg, unserved {uns:,.1f} kWh", fontsize=10)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    local_start = start.tz_convert(timezone)
    fig.suptitle(f"Test split, week from {local_start:%a %Y-%m-%d %H:%M} (the week with the most EV energy)")
    return atomic_savefig(fig, path), (start, end)


def _read_metrics(path: Path | None) -> pd.DataFrame | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        df = pd.read_parquet(path)
    except Exception:  # a half-written or foreign file: skip the curve, the report still stands
        return None
    if "global_step" not in df.columns or df.empty:
        return None
    return df


def plot_learning_curves(metrics_files: Mapping[str, Path], path: Path) -> Path | None:
    """Episodic CO2 (kg) and unserved energy (kWh) per training episode vs ``global_step``, per agent.

    Missing, unreadable or empty metrics files, or ones without ``global_step`` and either episodic
    column, are skipped; returns ``None`` (and writes nothing) when no agent has anything to plot.
    Raw points are drawn faintly with a rolling mean over about 1/20 of the points.
    """
    panels = (
        ("episodic_co2_kg", "CO2 per training episode (kg)"),
        ("episodic_unserved_kwh", "Unserved per training episode (kWh)"),
    )
    data = {}
    for agent in sorted(metrics_files):
        df = _read_metrics(metrics_files[agent])
        if df is not None and any(k in df.columns and df[k].notna().any() for k, _ in panels):
            data[agent] = df
    if not data:
        return None
    fig = Figure(figsize=(9.0, 6.5), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for k, (agent, df) in enumerate(data.items()):
        color = f"C{k % 10}"
        for ax, (col, _) in zip(axes, panels):
            if col not in df.columns:
                continue
            d = df[["global_step", col]].dropna().sort_values("global_step")
            if d.empty:
                continue
            smooth = d[col].rolling(max(1, len(d) // 20), min_periods=1).mean()
            ax.plot(d.global_step, d[col], color=color, alpha=0.25, lw=0.8, marker="." if len(d) < 50 else None)
            ax.plot(d.global_step, smooth, color=color, lw=1.8, label=agent)
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="agent", fontsize=8)
    axes[0].set_title("Learning curves (train-split episodes)")
    axes[-1].set_xlabel("global_step (environment steps)")
    return atomic_savefig(fig, path)


def _seeds_cell(r: pd.Series) -> str:
    n = int(r.get("n_seeds", 1))
    seeded = registry.describe(str(r.controller)).seeded or registry.is_agent(str(r.controller))
    return "–" if not seeded else (str(n) if n > 1 else "1 (single seed)")


def _kpi_rows(rows: pd.DataFrame, columns: Sequence[tuple[str, str, int]]) -> Table:
    body = []
    for _, r in rows.iterrows():
        n = int(r.get("n_seeds", 1))

        def cell(c: str, d: int, r=r, n=n) -> str:
            std = r.get(f"{c}_std", math.nan)
            return format_number(r[c], d) + (f" ± {format_number(std, d)}" if n > 1 and not math.isnan(std) else "")

        body.append((str(r.controller), _seeds_cell(r), *(cell(c, d) for c, _, d in columns)))
    return Table(
        header=("Controller", "Seeds", *(h for _, h, _ in columns)),
        align=("left", *("right" for _ in range(len(columns) + 1))),
        rows=tuple(body),
    )


def results_table(rows: pd.DataFrame) -> Table:
    """The compact results of one split's rows (:data:`RESULTS_COLUMNS`: CO2, CO2 against the untrained start, the
    cut, the gap closed vs rule, EV energy served, unserved energy) as a :class:`Table`; what each controller knows is
    in :func:`controller_legend`, every KPI in :func:`kpi_table`.

    A seeded controller (an agent, a learned planner) averaged over several seeds shows ``mean ± std`` and its number
    of seeds; one with one seed is marked ``1 (single seed)``; the deterministic controllers show –. NaN shows as –.
    """
    return _kpi_rows(rows, RESULTS_COLUMNS)


def kpi_table(rows: pd.DataFrame) -> Table:
    """Every KPI of the report (:data:`TABLE_COLUMNS`, headers with units) of one split's rows as a :class:`Table`,
    seeds as in :func:`results_table`."""
    return _kpi_rows(rows, TABLE_COLUMNS)


def controller_legend(names: Iterable[str]) -> Bullets:
    """One line per controller: its name, family (:data:`pipeline.control.registry.FAMILIES`), the untrained start its
    learning is credited against (where it has one) and what it reads when it acts
    (:attr:`pipeline.control.registry.Controller.knows`)."""
    items = []
    for name in dict.fromkeys(names):
        c = registry.describe(name)
        start = f"; credited against its untrained start, `{c.start}`" if c.start else ""
        causal = "" if c.causal else "; not causal, cannot be run"
        items.append(f"**{name}** ({c.family}{start}{causal}): {c.knows}")
    return Bullets(tuple(items))


def kpi_markdown_table(rows: pd.DataFrame) -> str:
    """Markdown table of every KPI of one split's rows (:func:`kpi_table`)."""
    return markdown_table(kpi_table(rows))


def site_data_sources(readme: Path) -> list[str]:
    """The bullet items of the first ``## Sources...`` section of a site's data README (continuation lines
    joined), as inline Markdown for ``write_report(data_sources=...)``; ``[]`` when the file or section is absent."""
    path = Path(readme)
    if not path.is_file():
        return []
    items: list[str] = []
    inside = in_item = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            if inside:
                break
            inside = line[3:].strip().lower().startswith("sources")
        elif inside and line.startswith("- "):
            items.append(line[2:].strip())
            in_item = True
        elif inside and in_item and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        else:
            in_item = False
    return items


def ordering_sentence(split: str, rows: pd.DataFrame) -> str:
    """The controllers of one split from the lowest CO2 to the highest, each with its gap closed vs rule
    (``gap_closed_vs_rule_pct``) where known; "" without rows."""
    ranked = rows.dropna(subset=["co2_kg"]).sort_values(["co2_kg", "controller"], kind="mergesort")
    if ranked.empty:
        return ""
    parts = []
    for _, r in ranked.iterrows():
        gap = r.gap_closed_vs_rule_pct
        parts.append(f"{r.controller} ({r.co2_kg:,.1f} kg" + ("" if math.isnan(gap) else f", {gap:.1f}%") + ")")
    return (
        f"Ordering by CO2 on the {split} split, lowest first, with each one's {GAP_VS_RULE} where known: "
        + " < ".join(parts)
        + "."
    )


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


ANSWER_COLUMNS = (
    ("co2_kg", "CO2 (kg)"),
    ("co2_reduction_pct", "CO2 cut (%)"),
    ("gap_closed_vs_rule_pct", f"{GAP_VS_RULE} (%)"),
    ("unserved_kwh", "unserved (kWh)"),
)
"""``(column, header)`` of the answer's table, once per split (headers ``"<split>: <header>"``), one decimal."""


def answer_blocks(table: pd.DataFrame) -> list[Block]:
    """The report's first section: the controller a site can run with the lowest CO2 on the held-out split, the best
    learned controller beside it and the perfect-foresight limit, in a compact table (:data:`ANSWER_COLUMNS` per
    split, the held-out split first, ``id="answer"``); then what its columns mean (:func:`definitions`), the learned
    controllers left out and what the named ones know. ``[]`` when no causal controller serves the EVs."""
    split = "test" if (table.split == "test").any() else str(table.split.iloc[0])
    best = best_controllers(table, split)
    if "causal" not in best:
        return []
    roles = {
        "causal": "lowest CO2 a site can run",
        "learned": "best learned controller",
        "bound": "perfect-foresight limit",
    }
    splits = sorted(table.split.unique(), key=lambda sp: (sp != split, split_sort_key(sp)))
    body = []
    for key, name in best.items():
        if key == "learned" and name == best["causal"]:
            continue
        cells = [roles[key], name]
        for sp in splits:
            r = table[(table.split == sp) & (table.controller == name)]
            cells += ["–" if r.empty else format_number(r.iloc[0][c], 1) for c, _ in ANSWER_COLUMNS]
        body.append(tuple(cells))
    name = best["causal"]
    text = (
        f"Run **{name}**: of the controllers that act only on what was realised before the hour they act on, it "
        f"emits the least CO2 on the held-out {split} split while serving the EVs."
    )
    if "learned" in best and best["learned"] != name:
        text += f" The best learned controller is **{best['learned']}**."
    elif "learned" in best:
        text += " It is also the best learned controller."
    blocks: list[Block] = [
        Heading(2, "The answer"),
        Paragraph(text),
        Table(
            header=("", "Controller", *(f"{sp}: {h}" for sp in splits for _, h in ANSWER_COLUMNS)),
            align=("left", "left", *("right" for _ in range(len(splits) * len(ANSWER_COLUMNS)))),
            rows=tuple(body),
            id="answer",
        ),
    ]
    unearned = [
        f"**{n}** (no lower than its untrained start, {registry.describe(n).start}, on the train split)"
        for n in dict.fromkeys(table.controller)
        if not beats_its_start(table, str(n))
    ]
    blocks.append(definitions())
    if unearned:
        blocks.append(Paragraph("Left out, as their learning does not beat their start: " + ", ".join(unearned) + "."))
    blocks.append(controller_legend(dict.fromkeys(best.values())))
    return blocks


def definitions() -> Definitions:
    """What the answer's columns and the main figure's ratio are (:data:`DEFINITIONS`), as a :class:`Definitions` with
    ``id="definitions"``: each ratio's reference rows, in words and as a formula. The page holds it once: under the
    answer, or at the head of the results when there is no answer."""
    return Definitions(DEFINITIONS, id="definitions")


def summary_paragraph(split: str, rows: pd.DataFrame) -> str:
    """Generated sentences for one split: the lowest-CO2 controller apart from the oracle (with its
    unserved energy), and whether every agent delivers >= 99% of the uncontrolled EV energy (the ordering of all
    controllers by CO2 follows in its own paragraph, :func:`ordering_sentence`)."""
    out = []
    others = rows[rows.controller != "oracle"].dropna(subset=["co2_kg"])
    if len(others):
        best = others.loc[others.co2_kg.idxmin()]
        s = (
            f"On the **{split}** split the lowest CO2 apart from the oracle is **{best.controller}**'s, "
            f"{best.co2_kg:,.1f} kg"
        )
        details = []
        if not math.isnan(best.co2_reduction_pct):
            details.append(f"{best.co2_reduction_pct:.1f}% below uncontrolled")
        for c, name in (("gap_closed_vs_rule_pct", GAP_VS_RULE), ("saving_vs_oracle_pct", SAVING_VS_ORACLE)):
            if not math.isnan(best[c]):
                details.append(f"{name} {best[c]:.1f}%")
        details.append(f"unserved {best.unserved_kwh:,.1f} kWh")
        s += " (" + ", ".join(details) + ")"
        oracle = rows[rows.controller == "oracle"]
        if len(oracle):
            bound = float(oracle.co2_kg.iloc[0])
            s += f"; the oracle's lower bound is {bound:,.1f} kg"
            if best.co2_kg < bound * (1 - 1e-6) and best.ev_energy_delivered_kwh >= float(
                oracle.ev_energy_delivered_kwh.iloc[0]
            ):
                s += (
                    " (**below the oracle's bound while delivering as much EV energy: check the oracle and the "
                    "evaluation**)"
                )
        out.append(s + ".")
    agents = rows[rows.controller.map(registry.is_agent)]
    base = rows[rows.controller == "uncontrolled"]
    if agents.empty:
        out.append("No agent was evaluated on this split.")
    elif base.empty or math.isnan(float(base.ev_energy_delivered_kwh.iloc[0])):
        out.append("Without an uncontrolled row the agents' EV service cannot be compared with it.")
    else:
        ref = float(base.ev_energy_delivered_kwh.iloc[0])
        share = {r.controller: (r.ev_energy_delivered_kwh / ref if ref > 0 else math.nan) for _, r in agents.iterrows()}
        short = {a: v for a, v in share.items() if not v >= SERVED_SHARE_MIN}
        pct = f"{100 * SERVED_SHARE_MIN:.0f}%"
        if not short:
            out.append(
                f"Every agent delivers at least {pct} of the EV energy the uncontrolled controller delivers "
                f"({ref:,.1f} kWh): " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in share.items()) + "."
            )
        else:
            out.append(
                f"**Not every agent serves the EVs**: below {pct} of the uncontrolled delivered EV energy "
                f"({ref:,.1f} kWh) are "
                + ", ".join(f"{a} ({100 * v:.1f}%)" for a, v in short.items())
                + "; their CO2 is not a fair saving."
            )
    return " ".join(out)


# ---------------------------------------------------------------------------------------------- entry
def write_report(
    kpi_files: list[Path],
    trace_files: dict[tuple[str, str], Path],
    metrics_files: dict[str, Path],
    out_dir: Path,
    title: str,
    site_summary: dict[str, str],
    notes: Iterable[str] = (),
    data_sources: Sequence[str] = (),
    sizing: pd.DataFrame | None = None,
    information: pd.DataFrame | None = None,
) -> Path:
    """Write the CO2 comparison report (table, figures, Markdown and HTML pages) into ``out_dir``.

    Args:
        kpi_files: KPI Parquet files, one or a few rows each, as from :func:`envs.kpis.kpi_row` (columns
            ``controller``, ``split``, :data:`KPI_COLUMNS`; extra columns ignored, the relative KPIs may be
            absent and are recomputed).
        trace_files: ``(controller, split) -> traces Parquet`` with :data:`envs.kpis.TRACE_COLUMNS`, one row
            per step; only the test split's are plotted.
        metrics_files: ``agent -> metrics.parquet`` of its training run (``global_step``,
            ``episodic_co2_kg``, ``episodic_unserved_kwh``, ...); missing or empty files are skipped.
        out_dir: output folder, created if needed.
        title: the report's title (Markdown heading).
        site_summary: ``key -> value`` lines for the report's site section, in order. A ``timezone`` key
            (IANA name) sets the local time of the week figure (default UTC).
        notes: Markdown sentences shown as a quoted block right under the title (e.g. that the site's EV
            sessions are synthetic); none by default.
        data_sources: inline-Markdown lines listed under "Data sources" in the site section (e.g.
            :func:`site_data_sources` of the site's data README); the section is left out when empty.
        sizing: results of a sizing study, one row per sized variant; shown as a "Sizing results" table
            when given (:func:`pipeline.study.document.frame_table`), left out when ``None``.
        information: the value-of-information table (:func:`pipeline.study.information.table`, ``doit run
            value_of_information``); shown as the section "What forecasting is worth" when given.

    Returns:
        Path of ``report.md``. Beside it: ``report.html`` (the same content as one self-contained page, figures
        embedded), ``co2_comparison.parquet``, ``co2_by_controller.png``, and when their inputs exist
        ``test_week_traces.png`` and ``learning_curves.png``.

    Raises:
        ValueError: no KPI file; a KPI file lacks required columns, or a trace file lacks plotted columns
            (names the file); a controller x split appears in two KPI files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timezone = str(site_summary.get("timezone", "UTC"))

    table = read_kpi_files(kpi_files)
    write_parquet(table, out_dir / "co2_comparison.parquet")
    figures: list[FigureRef] = []

    plot_saving(table, out_dir / MAIN_FIGURE)
    figures.append(
        FigureRef(
            MAIN_FIGURE,
            "Saving vs oracle by controller",
            f"Each controller's {SAVING_VS_ORACLE} (%, defined above), the largest first, coloured by kind; beside "
            "each bar its CO2 (kg) and unserved EV energy (kWh).",
        )
    )

    test_traces = {c: _read_traces(Path(p)) for (c, s), p in sorted(trace_files.items()) if s == "test"}
    week = plot_test_week(test_traces, table, out_dir / "test_week_traces.png", timezone) if test_traces else None
    if week is not None:
        start = week[1][0].tz_convert(timezone)
        figures.append(
            FigureRef(
                "test_week_traces.png",
                "Test week traces",
                f"Hourly traces of the test-split week from {start:%Y-%m-%d} ({timezone}), the week with the most EV "
                "energy.",
            )
        )

    if plot_learning_curves(metrics_files, out_dir / "learning_curves.png") is not None:
        caption = "Episodic CO2 and unserved energy during training, per agent."
        figures.append(FigureRef("learning_curves.png", "Learning curves", caption))

    for stale in {"test_week_traces.png", "learning_curves.png"} - {f.file for f in figures}:
        (out_dir / stale).unlink(missing_ok=True)  # left by an earlier run; this report does not show it

    blocks = report_blocks(
        title,
        site_summary,
        table,
        figures,
        notes=notes,
        data_sources=data_sources,
        sizing=sizing,
        information=information,
    )
    write_text(out_dir / "report.html", render_html(blocks, title, out_dir))  # before report.md, the task's target
    return write_text(out_dir / "report.md", render_markdown(blocks))


def report_blocks(
    title: str,
    site_summary: Mapping[str, str],
    table: pd.DataFrame,
    figures: Sequence[FigureRef],
    notes: Iterable[str] = (),
    data_sources: Sequence[str] = (),
    sizing: pd.DataFrame | None = None,
    information: pd.DataFrame | None = None,
) -> list[Block]:
    """The report's content, once, for both report.md and report.html (see :func:`write_report`).

    In order: the title and notes, the answer (:func:`answer_blocks`, with the ratios' :func:`definitions`), the
    results (the definitions here when there is no answer, the main figure :data:`MAIN_FIGURE` when in ``figures``; per
    split a compact table, its summary and, folded, every KPI and the
    ordering by CO2; what each controller knows), what forecasting is worth when ``information`` is given
    (:func:`pipeline.study.information.page_blocks`), the site, the sizing results when given, the other figures.
    ``figures`` are the figures written (the week figure is ``test_week_traces.png``, the learning curves
    ``learning_curves.png``); a sentence says which of those two is omitted.
    """
    blocks: list[Block] = [Heading(1, title)]
    blocks += [Note(n) for n in notes]
    answer = answer_blocks(table)
    blocks += answer
    blocks.append(Heading(2, "Results"))
    if not answer:  # the ratios are defined under the answer; without one, here
        blocks.append(definitions())
    blocks += [f for f in figures if f.file == MAIN_FIGURE]
    for split in sorted(table.split.unique(), key=split_sort_key):
        rows = table[table.split == split]
        blocks += [Heading(3, f"{split} split"), results_table(rows), Paragraph(summary_paragraph(split, rows))]
        folded: list[Block] = [kpi_table(rows)]
        if order := ordering_sentence(split, rows):
            folded.append(Paragraph(order))
        blocks.append(Details(f"Every KPI of the {split} split, and its ordering by CO2", tuple(folded)))
    blocks += [Heading(3, "What each controller knows"), controller_legend(table.controller)]
    blocks.append(
        Note(
            "**Unserved energy always stands beside CO2.** A controller could cut CO2 by not charging the cars; the "
            "unserved energy (kWh still needed at departure) and the share of EV energy served show whether a saving "
            "is real. The `oracle` is the physical lower bound. `mpc` re-solves a linear program over the next hours "
            "every hour from what is known then (MOER forecasts, the plugged EVs, the demand of the same hours of the "
            "past week); `mpc_tuned` is that planner on a learned MOER forecast (the same regression on the 5-minute "
            "data, forgetting old days), its parameters tuned in closed loop (CMA-ES) on the train split, "
            "`mpc_adaptive` the same re-tuned each week on the split's own last weeks; `mpc_perfect` is the same "
            "controller given the true MOER and arrivals within its horizon: the two bracket what forecasting is "
            "worth. A learned controller is credited only against its untrained start (`mpc_tuned_start`: where "
            "the tuning starts; `mpc_rl_start`: the policy's zero action; `mpc_adaptive`'s start is `mpc_tuned`): "
            "`CO2 vs untrained start` is its CO2 minus the start's. Only the causal controllers (all but "
            "`mpc_perfect` and `oracle`) can be run."
        )
    )
    if information is not None:
        blocks += information_blocks(information, defined=True)
    site = tuple(f"**{k}**: {v}" for k, v in site_summary.items()) or ("(no site summary given)",)
    blocks += [Heading(2, "Site"), Bullets(site)]
    if data_sources:
        blocks += [Heading(3, "Data sources"), Bullets(tuple(data_sources))]
    if sizing is not None:
        blocks += [Heading(2, "Sizing results"), frame_table(sizing)]
        blocks.append(
            Paragraph(
                "From `doit run sizing`: its own page, `../sizing/sizing.html` (and `sizing.md`), has the whole grid, "
                "the definitions and the figures."
            )
        )
    blocks.append(Heading(2, "Figures"))
    blocks += [f for f in figures if f.file != MAIN_FIGURE]
    files = {f.file for f in figures}
    if "learning_curves.png" not in files:
        blocks.append(Paragraph("No training metrics were found, so the learning curves are omitted."))
    if "test_week_traces.png" not in files:
        blocks.append(Paragraph("No test-split traces were given, so the test-week figure is omitted."))
    blocks.append(Paragraph("The full table is in `co2_comparison.parquet`."))
    return blocks
