"""The study's CO2 comparison report: one table, three figures, a Markdown page and the same as an HTML page.

:func:`write_report` gathers the KPI rows of every controller x split (baselines, oracle, evaluated
agents; each a Parquet written by :func:`envs.kpis.kpi_row`), their hourly traces and the agents' training
``metrics.parquet``, and writes into one folder:

- ``co2_comparison.parquet``: one row per controller x split (:func:`pipeline.study.comparison.read_kpi_files`),
  columns ``controller``, ``split``, :data:`envs.kpis.KPI_COLUMNS` (the relative KPIs filled by
  :func:`envs.kpis.add_relative_kpis`), then the seeds' and the untrained starts' columns;
- the figures of :mod:`pipeline.study.figures`: ``co2_by_controller.png`` (the main one), ``test_week_traces.png``
  and ``learning_curves.png`` (when their inputs exist);
- ``report.md``: title, the answer (the controller a site should run, with its numbers, then what each of its
  columns means, :data:`DEFINITIONS`: every ratio of the report defined there once), the results (main figure,
  a compact table per split with every KPI folded under it, what each controller knows), the site, the figures;
- ``report.html``: the same content as one self-contained page (inline CSS, figures embedded as ``data:``
  URIs, nothing fetched), laid out so that at 1280 px no table is wider than its box and the answer's numbers are
  in the first screen. Both pages are rendered from one list of blocks (:func:`report_blocks`), so their
  tables and sentences cannot drift apart.

Every file is written atomically (temporary name in the output folder, then :func:`os.replace`), so a
reader never sees half a report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from envs.files import write_parquet, write_text
from pipeline.control import registry
from pipeline.study.comparison import (
    GAP_VS_RULE,
    SAVING_VS_ORACLE,
    SERVED_SHARE_MIN,
    beats_its_start,
    best_controllers,
    read_kpi_files,
    split_sort_key,
)
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
    format_number,
    frame_table,
    markdown_table,
    render_html,
    render_markdown,
)
from pipeline.study.figures import CURVES_FIGURE, MAIN_FIGURE, WEEK_FIGURE, write_figures
from pipeline.study.information import page_blocks as information_blocks

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


PHYSICS_FILE = "co2_physics_5min.parquet"
"""The report's table of every controller scored on the site simulated at 5 minutes (:func:`physics_blocks`)."""


def physics_table(table: pd.DataFrame, physics: pd.DataFrame) -> pd.DataFrame:
    """Each controller's CO2 at the site's step (``table``, :func:`~pipeline.study.comparison.read_kpi_files`'s) beside
    its CO2 on the 5-minute site (``physics``, the same from the ``physics/`` files): ``controller``, ``split``,
    ``co2_kg``, ``co2_5min_kg``, ``change_pct`` (``100 * (co2_5min - co2) / co2``), ``gap_closed_vs_rule_pct`` (at the
    step), ``gap_closed_5min_pct`` (against ``rule_based`` and ``oracle`` on the 5-minute site), ``unserved_5min_kwh``,
    ``sessions_rejected_5min``; one row per controller x split of both, in ``table``'s order."""
    both = table[["controller", "split", "co2_kg", "gap_closed_vs_rule_pct"]].merge(
        physics[["controller", "split", "co2_kg", "gap_closed_vs_rule_pct", "unserved_kwh", "sessions_rejected"]],
        on=["controller", "split"],
        suffixes=("", "_5min"),
    )
    return pd.DataFrame(
        {
            "controller": both.controller,
            "split": both.split,
            "co2_kg": both.co2_kg,
            "co2_5min_kg": both.co2_kg_5min,
            "change_pct": 100.0 * (both.co2_kg_5min - both.co2_kg) / both.co2_kg,
            "gap_closed_vs_rule_pct": both.gap_closed_vs_rule_pct,
            "gap_closed_5min_pct": both.gap_closed_vs_rule_pct_5min,
            "unserved_5min_kwh": both.unserved_kwh,
            "sessions_rejected_5min": both.sessions_rejected,
        }
    )


def physics_blocks(physics: pd.DataFrame, step_minutes: int) -> list[Block]:
    """The report's section on the 5-minute site (:func:`physics_table`'s rows): what it is, then one table per
    split."""
    blocks: list[Block] = [
        Heading(2, "At 5-minute physics"),
        Paragraph(
            f"Every controller also runs on the site simulated at 5 minutes: it still decides every {step_minutes} "
            "minutes on what it observes then, and each decision holds over the step's 5-minute sub-steps as a "
            "charging profile and a battery set-point would (a car that arrives within a step charges at full power "
            "until the next decision); cars arrive and leave at their own 5 minutes and the MOER is the 5-minute "
            "one. The `oracle` here is the perfect-foresight LP at 5 minutes, and the gap closed is measured "
            "between `rule_based` and it on the 5-minute site. The difference is what a controller's step costs it."
        ),
    ]
    columns = (
        ("co2_kg", f"CO2 at {step_minutes} min (kg)", 1),
        ("co2_5min_kg", "CO2 at 5-min physics (kg)", 1),
        ("change_pct", "change", 1),
        ("gap_closed_vs_rule_pct", f"gap closed at {step_minutes} min", 1),
        ("gap_closed_5min_pct", "gap closed at 5-min physics", 1),
        ("unserved_5min_kwh", "unserved at 5 min (kWh)", 3),
        ("sessions_rejected_5min", "sessions rejected at 5 min", 0),
    )
    for split in sorted(physics.split.unique(), key=split_sort_key):
        rows = physics[physics.split == split]
        body = tuple(
            (str(r.controller), *(format_number(getattr(r, c), d) for c, _, d in columns)) for r in rows.itertuples()
        )
        blocks += [
            Heading(3, f"{split} split at 5-minute physics"),
            Table(
                header=("Controller", *(h for _, h, _ in columns)),
                align=("left", *("right" for _ in columns)),
                rows=body,
            ),
        ]
    blocks.append(Paragraph(f"The table is in `{PHYSICS_FILE}`."))
    return blocks


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
    physics_files: Sequence[Path] = (),
    step_minutes: int = 60,
) -> Path:
    """Write the CO2 comparison report (table, figures, Markdown and HTML pages) into ``out_dir``.

    Args:
        kpi_files: KPI Parquet files, one or a few rows each, as from :func:`envs.kpis.kpi_row` (columns
            ``controller``, ``split``, :data:`envs.kpis.KPI_COLUMNS`; extra columns ignored, the relative KPIs may be
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
        physics_files: KPI files of the controllers scored on the 5-minute site (the study's ``physics/``); when given,
            the section "At 5-minute physics" (:func:`physics_blocks`) and :data:`PHYSICS_FILE`.
        step_minutes: the site's step, minutes (named in that section).

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
    physics = None
    if physics_files:
        physics = physics_table(table, read_kpi_files(physics_files))
        write_parquet(physics, out_dir / PHYSICS_FILE)
    figures = write_figures(table, trace_files, metrics_files, out_dir, timezone)

    blocks = report_blocks(
        title,
        site_summary,
        table,
        figures,
        notes=notes,
        data_sources=data_sources,
        sizing=sizing,
        information=information,
        physics=None if physics is None else physics_blocks(physics, step_minutes),
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
    physics: Sequence[Block] | None = None,
) -> list[Block]:
    """The report's content, once, for both report.md and report.html (see :func:`write_report`; ``physics``: the
    section on the 5-minute site, :func:`physics_blocks`, after the results).

    In order: the title and notes, the answer (:func:`answer_blocks`, with the ratios' :func:`definitions`), the
    results (the definitions here when there is no answer, the main figure
    :data:`pipeline.study.figures.MAIN_FIGURE` when in ``figures``; per split a compact table, its summary and,
    folded, every KPI and the ordering by CO2; what each controller knows), what forecasting is worth when
    ``information`` is given (:func:`pipeline.study.information.page_blocks`), the site, the sizing results when given,
    the other figures. ``figures`` are the figures written (:func:`pipeline.study.figures.write_figures`); a sentence
    says which of the week figure and the learning curves is omitted.
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
    if physics is not None:
        blocks += physics
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
    if CURVES_FIGURE not in files:
        blocks.append(Paragraph("No training metrics were found, so the learning curves are omitted."))
    if WEEK_FIGURE not in files:
        blocks.append(Paragraph("No test-split traces were given, so the test-week figure is omitted."))
    blocks.append(Paragraph("The full table is in `co2_comparison.parquet`."))
    return blocks
