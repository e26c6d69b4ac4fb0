"""The report's three figures, each drawn from the ``co2_comparison`` table (:mod:`pipeline.study.comparison`) or the
result files and written as a PNG (atomically, :func:`pipeline.study.document.atomic_savefig`):

- ``co2_by_controller.png`` (:data:`MAIN_FIGURE`, :func:`saving_figure`): each controller's saving vs oracle, sorted,
  one colour per kind of controller, one panel per split, its CO2 (kg) and unserved energy (kWh) beside each bar;
- ``test_week_traces.png`` (:func:`plot_test_week`): one test-split week of hourly traces (the week with the most EV
  energy);
- ``learning_curves.png`` (:func:`plot_learning_curves`): episodic CO2 and unserved energy vs ``global_step`` per
  agent.

:func:`write_figures` draws the three for a report. Figures use matplotlib's Agg canvas through
:class:`matplotlib.figure.Figure` (pyplot's global backend state is left alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import dates as mdates
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pipeline.control import registry
from pipeline.study.comparison import (
    SAVING_VS_ORACLE,
    best_controllers,
    controller_sort_key,
    serving,
    split_sort_key,
)
from pipeline.study.document import FigureRef, atomic_savefig, format_number

TRACE_PLOT_COLUMNS = ("time", "pv_kw", "pv_curtailed_kw", "grid_import_kw", "soc", "ev_charge_kw", "moer_kg_per_kwh")
"""Trace columns :func:`plot_test_week` plots (a subset of :data:`envs.kpis.TRACE_COLUMNS`)."""

MAIN_FIGURE = "co2_by_controller.png"
"""The report's main figure (:func:`plot_saving`), shown at the head of its results."""

WEEK_FIGURE = "test_week_traces.png"
"""The test-week figure (:func:`plot_test_week`)."""

CURVES_FIGURE = "learning_curves.png"
"""The learning curves (:func:`plot_learning_curves`)."""

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


def controller_kind(name: str) -> str:
    """The kind of controller ``name`` (a key of :data:`KIND_COLORS`), from its registry family; an unknown name is
    an agent."""
    return KINDS[registry.describe(name).family]


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
    legend of the kinds shown), the axis named for the ratio (:data:`pipeline.study.comparison.SAVING_VS_ORACLE`).
    Beside the bars two columns of text, CO2 (kg) and unserved EV energy (kWh) (:data:`FIGURE_TEXT_COLUMNS`); a row
    that serves less than :data:`pipeline.study.comparison.SERVED_SHARE_MIN` of the uncontrolled EV energy is in red
    with its share served. A row without the ratio (no uncontrolled or oracle row on its split, or no saving between
    them) gets no bar, only its text; a panel without any says so.

    It shows the saving vs oracle rather than the gap closed vs rule (``gap_closed_vs_rule_pct``, the ratio of the
    answer's and the compact tables): both order the rows of a split alike (each falls as CO2 rises, in a straight
    line), but the saving keeps the bar of every controller that emits less than ``uncontrolled`` within 0..100%,
    where the gap from the battery rule puts ``uncontrolled`` far below zero (about -245% on caltech's 2021 test
    split) and squeezes every other bar into a third of the axis.

    Args:
        table: the ``co2_comparison`` table (:func:`pipeline.study.comparison.read_kpi_files`), at least one row.
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
    (:func:`pipeline.study.comparison.best_controllers` on the test split), the oracle; those that have traces; else
    up to three of any."""
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


def read_traces(path: Path) -> pd.DataFrame:
    """A traces Parquet (:data:`envs.kpis.TRACE_COLUMNS`) with ``time`` as UTC timestamps, sorted by it.

    Raises:
        ValueError: the file lacks a column of :data:`TRACE_PLOT_COLUMNS` (names the file and the columns).
    """
    df = pd.read_parquet(path)
    missing = [c for c in TRACE_PLOT_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trace file {path} lacks columns: {', '.join(missing)}")
    time = pd.to_datetime(df["time"])
    df["time"] = time.dt.tz_localize("UTC") if time.dt.tz is None else time.dt.tz_convert("UTC")
    return df.sort_values("time").reset_index(drop=True)


def write_figures(
    table: pd.DataFrame,
    trace_files: Mapping[tuple[str, str], Path],
    metrics_files: Mapping[str, Path],
    out_dir: Path,
    timezone: str = "UTC",
) -> list[FigureRef]:
    """Draw the report's figures into ``out_dir``: the main figure always, the test week when ``trace_files`` hold a
    test split's traces, the learning curves when an agent's metrics have something to plot; a week or curves figure
    left there by an earlier report and not drawn now is removed.

    Args:
        table: the ``co2_comparison`` table (:func:`pipeline.study.comparison.read_kpi_files`).
        trace_files: ``(controller, split) -> traces Parquet``; only the test split's are read (:func:`read_traces`).
        metrics_files: ``agent -> metrics.parquet`` of its training run.
        out_dir: the report's folder (it exists).
        timezone: IANA name of the week figure's local time.

    Returns:
        A :class:`~pipeline.study.document.FigureRef` (file, title, caption) per figure drawn, the main one first.

    Raises:
        ValueError: a test split's trace file lacks a plotted column (:func:`read_traces`).
    """
    out_dir = Path(out_dir)
    plot_saving(table, out_dir / MAIN_FIGURE)
    figures = [
        FigureRef(
            MAIN_FIGURE,
            "Saving vs oracle by controller",
            f"Each controller's {SAVING_VS_ORACLE} (%, defined above), the largest first, coloured by kind; beside "
            "each bar its CO2 (kg) and unserved EV energy (kWh).",
        )
    ]
    test_traces = {c: read_traces(Path(p)) for (c, s), p in sorted(trace_files.items()) if s == "test"}
    week = plot_test_week(test_traces, table, out_dir / WEEK_FIGURE, timezone) if test_traces else None
    if week is not None:
        start = week[1][0].tz_convert(timezone)
        figures.append(
            FigureRef(
                WEEK_FIGURE,
                "Test week traces",
                f"Hourly traces of the test-split week from {start:%Y-%m-%d} ({timezone}), the week with the most EV "
                "energy.",
            )
        )
    if plot_learning_curves(metrics_files, out_dir / CURVES_FIGURE) is not None:
        caption = "Episodic CO2 and unserved energy during training, per agent."
        figures.append(FigureRef(CURVES_FIGURE, "Learning curves", caption))
    for stale in {WEEK_FIGURE, CURVES_FIGURE} - {f.file for f in figures}:
        (out_dir / stale).unlink(missing_ok=True)  # left by an earlier run; this report does not show it
    return figures
