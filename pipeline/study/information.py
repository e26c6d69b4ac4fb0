"""What forecasting what is worth at a site: the planner given the truth of each unknown in turn.

The planner is ``mpc_rl``'s at its untrained start, the registry's ``mpc_rl_start``
(:func:`pipeline.control.rl_planner.start_params`: the learned MOER forecast, the expected demand by day type at
weight 0.5, terminal value 1.0). It plans on forecasts of two unknowns, the MOER and the EV arrivals; each variant
below is that planner over a whole split, given the truth of what it says within its horizon
(:class:`pipeline.control.mpc.MPCController`'s ``perfect_moer`` and ``perfect_arrivals``):

================  ================================================  ==============================================
variant           the planner knows                                 runs as
================  ================================================  ==============================================
``forecasts``     forecasts of both (causal)                        ``mpc_rl_start``'s row of the registry
``true_moer``     the true MOER, forecast arrivals                  the planner with ``perfect_moer``
``true_arrivals`` forecast MOER, the true arrivals                  the planner with ``perfect_arrivals``
``both_true``     both true                                         ``mpc_perfect``'s row of the registry
================  ================================================  ==============================================

Given both truths the planner's parameters that are left are its horizon and terminal value, which are
``mpc_perfect``'s (the site's ``[mpc] horizon_h``, 1.0), so ``both_true`` is ``mpc_perfect`` (run with HiGHS presolve as
``mpc_perfect`` is; the learned planner runs without it: the optimum is the same, the vertex chosen among plans of
equal cost may differ).

Each variant's share of the gap is ``gap_closed_vs_rule_pct = 100 * (CO2_rule_based - CO2) / (CO2_rule_based -
CO2_oracle)`` on the same split, the report's column of the same name (not its ``saving_vs_oracle_pct``, which counts
from ``uncontrolled``): 0% is the self-consumption rule, 100% the perfect-foresight oracle. Where the study has
already run a row with the same runner (``<experiment>/baselines/``: ``rule_based``, ``oracle``, ``mpc_rl_start``,
``mpc_perfect``) and its file is newer than the site's files and the controllers' code, that row is read instead of
run again (:func:`reusable`): the same runner on the same inputs gives the same row.

``doit run value_of_information`` (:func:`run`, not part of ``doit run pipeline``) fans the runs out as Dask tasks,
one per controller x split (:func:`run_row`, into ``<experiment>/information/``), and writes
``<experiment>/report/value_of_information.parquet`` (:data:`COLUMNS`) and ``value_of_information.md`` (the table
and one reading line per split, :func:`page_blocks`), atomically. The study's report shows the same section when the
Parquet is there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from envs.config import load_config
from envs.files import write_parquet, write_text
from envs.site import Site, load_site
from pipeline import depends
from pipeline.control import registry
from pipeline.study import results
from pipeline.study.cluster import PRIORITY, get_client
from pipeline.study.config import SPLITS
from pipeline.study.document import Block, Heading, Paragraph, Table, format_number, render_markdown


@dataclass(frozen=True)
class Variant:
    """One row of the table: what the planner knows and how it is run.

    Attributes:
        name: the variant's name (:data:`VARIANTS`' key).
        controller: the name of its runs (the ``controller`` column of its KPI row and its result files): a row of
            the registry, or the planner's name with what it is given.
        knows: what the planner knows, in words (the table's first column).
        perfect_moer, perfect_arrivals: what it is given the truth of (a variant that is not a registry row).
    """

    name: str
    controller: str
    knows: str
    perfect_moer: bool = False
    perfect_arrivals: bool = False

    @property
    def registered(self) -> bool:
        """Whether it is a row of the registry (run by the registry's runner, possibly in the study already)."""
        return self.controller in registry.CONTROLLERS


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("forecasts", "mpc_rl_start", "forecasts of both (causal)"),
        Variant("true_moer", "mpc_rl_start_true_moer", "the true MOER, forecast arrivals", perfect_moer=True),
        Variant("true_arrivals", "mpc_rl_start_true_arrivals", "forecast MOER, the true arrivals",
                perfect_arrivals=True),
        Variant("both_true", "mpc_perfect", "both true (mpc_perfect)"),
    )
}  # fmt: skip
"""The variants in table order (module docstring)."""

REFERENCES = ("rule_based", "oracle")
"""The registry rows the gap is measured between: 0% and 100%."""

COLUMNS = (
    "split",
    "variant",
    "knows",
    "controller",
    "co2_kg",
    "gap_closed_vs_rule_pct",
    "ev_energy_served_pct",
    "unserved_kwh",
    "rule_based_co2_kg",
    "oracle_co2_kg",
)
"""Columns of the table (:func:`table`): the split, the variant, what it knows, the name of its runs, its CO2 (kg),
its share of the ``rule_based``-to-``oracle`` gap (%), the share of the requested EV energy it served (%), its
unserved EV energy (kWh), and the two references' CO2 on that split (kg)."""

FILES = ("value_of_information.parquet", "value_of_information.md")
"""What :func:`run` writes into the experiment's ``report/`` folder."""


def controllers() -> tuple[str, ...]:
    """Every run the table needs on a split: the variants' then the references' (:data:`REFERENCES`)."""
    return (*(v.controller for v in VARIANTS.values()), *REFERENCES)


# --------------------------------------------------------------------------------------------- one run
def simulate(site: Site, split: str, controller: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One run of :func:`controllers` over a whole split: ``(kpi_row, traces)`` as
    :func:`envs.kpis.evaluate_policy` returns them.

    A registry row runs by the registry's runner (exactly as the study runs it); the other variants are the planner of
    ``mpc_rl_start`` given the truth of what the variant says (:func:`pipeline.control.rl_planner.simulate_start`).

    Raises:
        KeyError: a name that is neither a variant's nor a reference's, or an unknown split.
        RuntimeError: an LP not solved, or an energy-balance violation.
    """
    variant = next((v for v in VARIANTS.values() if v.controller == controller), None)
    if controller in REFERENCES or (variant is not None and variant.registered):
        return registry.get(controller).simulate(site, split)
    if variant is None:
        raise KeyError(
            f"{controller!r} is not a run of the value-of-information table (runs: {', '.join(controllers())})"
        )
    from pipeline.control import rl_planner  # the planner (torch, HiGHS): imported where a run runs

    return rl_planner.simulate_start(
        site, split, controller, perfect_moer=variant.perfect_moer, perfect_arrivals=variant.perfect_arrivals
    )


def run_row(site_toml: str, controller: str, split: str, out_dir: str) -> str:
    """One run as a Dask task: :func:`simulate` of the site at ``site_toml``, its KPI row and traces written into
    ``out_dir`` (:func:`pipeline.study.results.files`, atomically); returns the KPI file.

    Raises:
        KeyError, RuntimeError: see :func:`simulate`.
    """
    kpis, traces = simulate(load_site(site_toml, validate=False), split, controller)
    kpi_file, traces_file = results.files(out_dir, controller, split)
    write_parquet(traces, traces_file)
    return str(write_parquet(kpis, kpi_file))


def reusable(folders, controller: str, split: str, site_toml: str | Path) -> Path | None:
    """A KPI file of ``controller`` on ``split`` in one of ``folders`` (in order) that is newer than every file it was
    made from (the site's TOML and data, every file of ``envs/`` and ``pipeline/control/``, and this module): the row a
    run would give now. None where there is none."""
    made_from = [*depends.controllers(), *depends.site_files(site_toml), Path(__file__)]
    newest = max(p.stat().st_mtime for p in made_from if p.is_file())
    for folder in folders:
        kpi_file = results.files(folder, controller, split)[0]
        if kpi_file.is_file() and kpi_file.stat().st_mtime >= newest:
            return kpi_file
    return None


# --------------------------------------------------------------------------------------------- the table
def table(kpis: pd.DataFrame) -> pd.DataFrame:
    """The value-of-information table from KPI rows (:func:`envs.kpis.kpi_row`'s columns, at least ``controller``,
    ``split``, ``co2_kg``, ``ev_energy_served_pct`` and ``unserved_kwh``) of every run of :func:`controllers` on each
    split present.

    Returns:
        one row per split (train, test, then others) x variant (:data:`VARIANTS`' order), :data:`COLUMNS`;
        ``gap_closed_vs_rule_pct`` is NaN on a split where ``rule_based`` emits no more than the ``oracle``.

    Raises:
        ValueError: a run missing on a split (the message names it and the split).
    """
    rows = []
    splits = sorted(kpis.split.unique(), key=lambda s: (SPLITS.index(s), "") if s in SPLITS else (len(SPLITS), s))
    for split in splits:
        here = kpis[kpis.split == split].drop_duplicates("controller", keep="last").set_index("controller")
        missing = [c for c in controllers() if c not in here.index]
        if missing:
            raise ValueError(f"value of information, {split} split: no row of {', '.join(missing)}")
        rule, oracle = (float(here.co2_kg[c]) for c in REFERENCES)
        for v in VARIANTS.values():
            r = here.loc[v.controller]
            co2 = float(r.co2_kg)
            rows.append(
                {
                    "split": split,
                    "variant": v.name,
                    "knows": v.knows,
                    "controller": v.controller,
                    "co2_kg": co2,
                    "gap_closed_vs_rule_pct": 100.0 * (rule - co2) / (rule - oracle) if rule > oracle else math.nan,
                    "ev_energy_served_pct": float(r.ev_energy_served_pct),
                    "unserved_kwh": float(r.unserved_kwh),
                    "rule_based_co2_kg": rule,
                    "oracle_co2_kg": oracle,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def value_of_information(site: Site | str | Path, split: str, study_dir: str | Path | None = None) -> pd.DataFrame:
    """The value-of-information table of one split (:func:`table`): the four variants of the planner run over the
    whole split, one after another here, against ``rule_based`` and the ``oracle`` of the same split.

    Args:
        site: a loaded site or anything :func:`envs.site.load_site` accepts.
        split: ``"train"`` or ``"test"``.
        study_dir: the study's experiment folder (``outputs/<experiment>``); a row its ``baselines/`` or
            ``information/`` holds that :func:`reusable` finds current is read instead of run (only with a ``site``
            given as a path, whose files date it).

    Raises:
        KeyError: an unknown split. RuntimeError: an LP not solved, or an energy-balance violation.
    """
    toml = None if isinstance(site, Site) else load_config(site)[1]
    loaded = site if isinstance(site, Site) else load_site(toml)
    folders = [Path(study_dir) / "information", Path(study_dir) / "baselines"] if study_dir else []
    kpis = []
    for c in controllers():
        found = reusable(folders, c, split, toml) if toml is not None and folders else None
        kpis.append(pd.read_parquet(found) if found else simulate(loaded, split, c)[0])
    return table(pd.concat(kpis, ignore_index=True))


# --------------------------------------------------------------------------------------------- the page
def _renamed(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with the gap's column under its name: a table written before it was named ``gap_closed_vs_rule_pct``
    (``gap_closed_pct``) still reads."""
    return rows.rename(columns={"gap_closed_pct": "gap_closed_vs_rule_pct"})


def reading(rows: pd.DataFrame, split: str) -> str:
    """One split's reading line: what knowing the arrivals, the MOER and both adds to the planner's share of the gap,
    in points (``gap_closed_vs_rule_pct`` of the variant minus that of ``forecasts``). ``rows``: :func:`table`'s
    rows."""
    rows = _renamed(rows)
    gap = rows[rows.split == split].set_index("variant").gap_closed_vs_rule_pct
    if gap.isna().any():
        return f"On this site's {split} split `rule_based` emits no more than the `oracle`: there is no gap to close."
    points = {v: float(gap[v] - gap["forecasts"]) for v in ("true_arrivals", "true_moer", "both_true")}
    return (
        f"On this site's {split} split, knowing the arrivals is worth {points['true_arrivals']:+.1f} points, the MOER "
        f"{points['true_moer']:+.1f}, both {points['both_true']:+.1f} (from {gap['forecasts']:.1f}% of the gap "
        "with forecasts of both)."
    )


PAGE_COLUMNS = (
    ("gap_closed_vs_rule_pct", "gap closed vs rule (%)", 1),
    ("co2_kg", "CO2 (kg)", 1),
    ("ev_energy_served_pct", "served (%)", 1),
    ("unserved_kwh", "unserved (kWh)", 1),
)
"""``(column, header, decimals)`` shown per split in the page's table."""


def page_blocks(rows: pd.DataFrame, level: int = 2, defined: bool = False) -> list[Block]:
    """The table as a section of a page (the report's, or ``value_of_information.md``), its heading at ``level``: one
    row per variant, :data:`PAGE_COLUMNS` per split, then one :func:`reading` line per split. ``rows``: :func:`table`'s
    rows (or its Parquet). ``defined``: the page defines the gap closed vs rule already (the report does), so the
    section names it without defining it again."""
    rows = _renamed(rows)
    splits = list(dict.fromkeys(rows.split))
    body = []
    for v in VARIANTS.values():
        cells = [v.knows]
        for sp in splits:
            r = rows[(rows.split == sp) & (rows.variant == v.name)]
            cells += ["–" if r.empty else format_number(r.iloc[0][c], d) for c, _, d in PAGE_COLUMNS]
        body.append(tuple(cells))
    refs = "; ".join(
        f"{sp}: `rule_based` {format_number(r.rule_based_co2_kg.iloc[0], 1)} kg, `oracle` "
        f"{format_number(r.oracle_co2_kg.iloc[0], 1)} kg"
        for sp in splits
        if len(r := rows[rows.split == sp])
    )
    gap = (
        "its gap closed vs rule is defined above"
        if defined
        else "gap closed vs rule: its share of the CO2 gap from `rule_based` (0%) to the perfect-foresight `oracle` "
        "(100%) on the same split, `100 * (CO2_rule_based - CO2) / (CO2_rule_based - CO2_oracle)`"
    )
    return [
        Heading(level, "What forecasting is worth"),
        Paragraph(
            "The planner of `mpc_rl_start` (the learned MOER forecast, the expected demand by day type at weight 0.5, "
            "terminal value 1.0) over each whole split, given the truth of the MOER, of the EV arrivals or of both "
            f"within its horizon (the site's `[mpc] horizon_h`); {gap} ({refs})."
        ),
        Table(
            header=("the planner knows", *(f"{sp}: {h}" for sp in splits for _, h, _ in PAGE_COLUMNS)),
            align=("left", *("right" for _ in range(len(splits) * len(PAGE_COLUMNS)))),
            rows=tuple(body),
            id="value-of-information",
        ),
        *(Paragraph(reading(rows, sp)) for sp in splits),
    ]


def outputs(root: str | Path) -> list[Path]:
    """The files :func:`run` writes for the experiment folder ``root`` (``doit run value_of_information``'s
    targets)."""
    return [Path(root) / "report" / f for f in FILES]


def write_outputs(rows: pd.DataFrame, root: str | Path, site_name: str) -> list[Path]:
    """Write :func:`table`'s ``rows`` as ``value_of_information.parquet`` and the page ``value_of_information.md``
    into ``<root>/report/``, atomically; returns :func:`outputs`."""
    parquet, md = outputs(root)
    write_parquet(rows, parquet)
    page = [Heading(1, f"Value of information: {site_name}"), *page_blocks(rows, level=2)[1:]]
    write_text(md, render_markdown(page))
    return [parquet, md]


# --------------------------------------------------------------------------------------------- the study
def run(
    site_toml: str | Path,
    root: str | Path,
    scheduler_address: str | None = None,
    client=None,
    log: Callable[[str], None] = print,
    workers: int | None = None,
) -> list[Path]:
    """Make the value-of-information table of a site on both splits: one Dask task per run of :func:`controllers` x
    split (:func:`run_row`, into ``<root>/information/``) that :func:`reusable` finds no current row of in
    ``<root>/information/`` or ``<root>/baselines/``; then :func:`write_outputs`. Prints a line per finished run,
    each split's reading line and the wall time.

    Args:
        site_toml: the site config (shipped name or path).
        root: the experiment folder (``outputs/<experiment>``).
        scheduler_address: an existing Dask scheduler; None: :func:`pipeline.study.cluster.get_client`'s LocalCluster.
        client: a Dask client to use instead.
        log: where progress lines go.
        workers: the LocalCluster's worker processes (None: one per core).

    Returns:
        :func:`outputs`.

    Raises:
        envs.config.ConfigError, envs.schemas.DataValidationError: a bad site config or data (before any task).
        Whatever a run raises (an LP not solved, an energy-balance violation); nothing is written then.
    """
    from distributed import as_completed

    t0 = time.perf_counter()
    cfg, path = load_config(site_toml)
    load_site(path, validate=True)  # bad data stops here, before any task
    root = Path(root)
    folders = [root / "information", root / "baselines"]
    kpi_files: dict[tuple[str, str], Path] = {}
    todo = []
    for split in SPLITS:
        for c in controllers():
            found = reusable(folders, c, split, path)
            if found:
                kpi_files[c, split] = found
            else:
                todo.append((c, split))
    todo.sort(key=lambda job: job[0] in REFERENCES)  # the planners' runs (the longest) first
    reused = ", ".join(f"{c} {s}" for c, s in kpi_files) or "none"
    log(f"value of information {cfg.name}: {len(todo)} runs as Dask tasks; rows read from the study: {reused}")
    if todo:
        client = client or get_client(scheduler_address, workers)
        futures = {
            client.submit(
                run_row, str(path), c, s, str(root / "information"), priority=PRIORITY["simulate"], retries=1,
                pure=False,
            ): (c, s)
            for c, s in todo
        }  # fmt: skip
        for fut in as_completed(futures):
            c, s = futures[fut]
            try:
                kpi_files[c, s] = Path(fut.result())
            except Exception:
                for other in futures:
                    other.cancel()
                raise
            log(f"  {c} {s}: CO2 {float(pd.read_parquet(kpi_files[c, s]).co2_kg.iloc[0]):,.1f} kg "
                f"({time.perf_counter() - t0:.0f} s elapsed)")  # fmt: skip
    rows = table(pd.concat([pd.read_parquet(f) for f in kpi_files.values()], ignore_index=True))
    paths = write_outputs(rows, root, cfg.name)
    for split in dict.fromkeys(rows.split):
        log(reading(rows, split))
    log(f"value of information {cfg.name}: {time.perf_counter() - t0:.1f} s wall; wrote {paths[1]}")
    return paths
