"""The sizing study's run and page: :func:`run_sizing` computes the points of :mod:`pipeline.study.sizing` on Dask and
writes its figures, ``co2_saved.png`` and ``pareto.png``, and ``sizing.md`` and ``sizing.html`` (self-contained, the
figures embedded), rendered from one list of blocks (:func:`page_blocks`) with :mod:`pipeline.study.document`'s
renderers; :func:`write_outputs` writes them beside ``sizing.parquet``, every file atomically.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from envs.config import load_config
from envs.files import write_parquet, write_text
from envs.site import load_site
from pipeline.study.cluster import get_client
from pipeline.study.config import SPLITS
from pipeline.study.document import (
    Block,
    Bullets,
    FigureRef,
    Heading,
    Note,
    Paragraph,
    atomic_savefig,
    frame_table,
    render_html,
    render_markdown,
)
from pipeline.study.sizing import KNOWN_CONTROLLERS, SizingSpec, build_table, headline, size_point, sizing_spec


# ------------------------------------------------------------------------------------------------ figures
def _controllers_in(table: pd.DataFrame) -> list[str]:
    """The controllers of ``table``, in report order (:data:`pipeline.study.sizing.KNOWN_CONTROLLERS`)."""
    return [c for c in KNOWN_CONTROLLERS if c in set(table.controller)]


def _splits_in(table: pd.DataFrame) -> list[str]:
    """The splits of ``table``, in the study's order (:data:`pipeline.study.config.SPLITS`)."""
    return [s for s in SPLITS if s in set(table.split)]


def plot_co2_saved(table: pd.DataFrame, path: Path) -> Path:
    """Heatmaps of CO2 avoided (% of uncontrolled at 0 kWp / 0 kWh), one per controller (rows) and split (columns),
    PV kWp on x, BESS kWh on y, each cell labelled; one colour scale for all."""

    controllers, splits = _controllers_in(table), _splits_in(table)
    kwp, kwh = sorted(table.kwp.unique()), sorted(table.bess_kwh.unique())
    size = (1.2 + (0.75 * len(kwp) + 1.2) * len(splits), 0.6 + (0.55 * len(kwh) + 0.9) * len(controllers))
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(len(controllers), len(splits), squeeze=False)
    vals = table.co2_avoided_pct.to_numpy(np.float64)
    lo = min(0.0, float(np.nanmin(vals))) if np.isfinite(vals).any() else 0.0
    hi = max(1.0, float(np.nanmax(vals))) if np.isfinite(vals).any() else 100.0
    image = None
    for i, c in enumerate(controllers):
        for j, s in enumerate(splits):
            ax = axes[i, j]
            rows = table[(table.controller == c) & (table.split == s)]
            grid = rows.pivot_table(index="bess_kwh", columns="kwp", values="co2_avoided_pct", aggfunc="first")
            grid = grid.reindex(index=kwh, columns=kwp)
            z = grid.to_numpy(np.float64)
            image = ax.imshow(z, origin="lower", cmap="viridis", vmin=lo, vmax=hi, aspect="auto")
            for (y, x), v in np.ndenumerate(z):
                if np.isfinite(v):
                    dark = v < lo + 0.6 * (hi - lo)
                    ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
            ax.set_xticks(range(len(kwp)), [f"{v:g}" for v in kwp], fontsize=8)
            ax.set_yticks(range(len(kwh)), [f"{v:g}" for v in kwh], fontsize=8)
            ax.set_title(f"{c}, {s} split", fontsize=10)
            if i == len(controllers) - 1:
                ax.set_xlabel("PV (kWp)")
            if j == 0:
                ax.set_ylabel("BESS (kWh)")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="CO2 avoided vs uncontrolled at 0 kWp / 0 kWh (%)")
    fig.suptitle("CO2 avoided over the sizing grid")
    return atomic_savefig(fig, path)


def plot_pareto(table: pd.DataFrame, path: Path, currency: str = "USD") -> Path:
    """Annualised capex (x, thousand ``currency``/yr) vs CO2 (y, t/yr) of every point, one panel per split, one
    colour per controller; Pareto-optimal points filled and joined, the others hollow; the Pareto points of the
    controller with the lowest CO2 labelled ``kWp/kWh``. Without costs, x is PV kWp + BESS kWh instead."""

    controllers, splits = _controllers_in(table), _splits_in(table)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.2 * len(splits), 5.0), layout="constrained")
    axes = fig.subplots(1, len(splits), squeeze=False)[0]
    costs = table.annualised_cost.notna().any()
    for ax, s in zip(axes, splits):
        for k, c in enumerate(controllers):
            rows = table[(table.controller == c) & (table.split == s)]
            x = rows.annualised_cost / 1000.0 if costs else rows.kwp + rows.bess_kwh
            color = f"C{k % 10}"
            ax.scatter(
                x[~rows.pareto], rows.co2_t_per_year[~rows.pareto], s=22, facecolors="none", edgecolors=color, alpha=0.7
            )
            front = rows[rows.pareto].assign(x=x[rows.pareto]).sort_values("x")
            ax.plot(front.x, front.co2_t_per_year, "-o", color=color, ms=5, lw=1.4, label=f"{c} (Pareto front)")
            if c == "oracle" or (c == controllers[-1] and "oracle" not in controllers):
                for _, r in front.iterrows():
                    ax.annotate(
                        f"{r.kwp:g}/{r.bess_kwh:g}",
                        (r.x, r.co2_t_per_year),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                        color=color,
                    )
        ax.set_xlabel(
            f"annualised capex (thousand {currency}/yr)" if costs else "PV kWp + BESS kWh (no unit costs given)"
        )
        ax.set_ylabel("grid CO2 (t/yr, split scaled to a year)")
        ax.set_title(f"{s} split: cost vs CO2 (filled: Pareto-optimal; labels kWp/kWh)", fontsize=10)
        ax.set_ylim(bottom=min(0.0, float(table.co2_t_per_year.min())))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return atomic_savefig(fig, path)


# ------------------------------------------------------------------------------------------------ the page
def money(v: float | None, currency: str) -> str:
    """``v`` as a whole amount of ``currency`` (``"1,234 USD"``); a dash for None or a value that is not finite."""
    return "–" if v is None or not math.isfinite(v) else f"{v:,.0f} {currency}"


def page_blocks(table: pd.DataFrame, spec: SizingSpec, site_name: str, info: Mapping[str, str]) -> list[Block]:
    """The sizing page's content (for sizing.md and sizing.html): headline, definitions, settings, the table and
    the figures (``co2_saved.png``, ``pareto.png``).

    Args:
        table: the ``sizing.parquet`` table (:func:`pipeline.study.sizing.build_table`). spec: the study.
        site_name: the site's name. info: more settings to list (``{label: text}``: Dask workers, wall time).
    """
    cur = spec.costs.currency if spec.costs else "USD"
    return [
        Heading(1, f"Sizing study: {site_name}"),
        _costs_note(spec),
        *_headline_blocks(table, cur),
        *_definition_blocks(cur),
        *_settings_blocks(table, spec, site_name, info),
        *_results_blocks(table, cur),
        *_figure_blocks(),
    ]


def _costs_note(spec: SizingSpec) -> Note:
    """What the unit costs are (assumptions of the site config), or that there are none."""
    if spec.costs is None:
        return Note(
            "No unit costs in `[sizing]` (`capex_per_kwp`, `capex_per_kwh`, `lifetime_years`): costs and cost per "
            "tonne are left out."
        )
    cur = spec.costs.currency
    return Note(
        f"**Unit costs are assumptions** from the site config (`{spec.source}`, `[sizing]`), not quotes: PV "
        f"{spec.costs.capex_per_kwp:,.0f} {cur}/kWp, BESS {spec.costs.capex_per_kwh:,.0f} {cur}/kWh + "
        f"{spec.costs.capex_per_kw:,.0f} {cur}/kW, lifetime {spec.costs.lifetime_years:g} years (BESS "
        f"{spec.costs.bess_lifetime_years:g}), discount rate {100 * spec.costs.discount_rate:g}%/yr. Results "
        "scale with them."
    )


def _headline_blocks(table: pd.DataFrame, cur: str) -> list[Block]:
    """The headline (:func:`pipeline.study.sizing.headline`): per split, each controller's cheapest point per tonne
    of CO2 avoided (costs in ``cur``), and how to read it."""
    blocks: list[Block] = [Heading(2, "Headline")]
    head = headline(table)
    if head.empty:
        blocks.append(Paragraph("No point with capex avoids CO2 at a known cost (no unit costs, or nothing avoided)."))
    for split in _splits_in(table):
        rows = head[head.split == split]
        if rows.empty:
            continue
        parts = []
        for _, r in rows.iterrows():
            shifts = r.controller != "uncontrolled" and math.isfinite(r.free_avoided_pct)
            free = f"; {r.free_avoided_pct:.1f}% at no capex" if shifts else ""
            parts.append(
                f"**{r.controller}** at {r.kwp:g} kWp + {r.bess_kwh:g} kWh / {r.bess_kw:g} kW: "
                f"**{money(r.cost_per_t_avoided, cur)}/t**, {r.co2_avoided_t_per_year:,.2f} t/yr avoided "
                f"({r.co2_avoided_pct:.1f}%{free})"
            )
        blocks.append(
            Paragraph(f"Cheapest point per tonne of CO2 avoided on the **{split}** split: " + "; ".join(parts) + ".")
        )
    oracle_note = ""
    if "oracle" in set(table.controller):
        oracle_note = " The `oracle` is the perfect-foresight bound, not a controller one can buy."
    blocks.append(
        Paragraph(
            "Cost per tonne = annualised capex / CO2 avoided per year, both against the site with no PV, no battery "
            "and uncontrolled charging; the headline is over the points with capex (at 0 kWp / 0 kWh a controller that "
            f"shifts charging avoids CO2 for nothing).{oracle_note}"
        )
    )
    return blocks


def _definition_blocks(cur: str) -> list[Block]:
    """The definitions of the table's yearly and cost columns (costs in ``cur``)."""
    return [
        Heading(2, "Definitions"),
        Bullets(
            (
                "`co2_t_per_year` = split CO2 (kg) x 8,760 / split hours / 1,000: each split scaled to a 365-day year "
                "(a split of a few months keeps their season).",
                "`co2_avoided_t_per_year` = (CO2 of `uncontrolled` at 0 kWp / 0 kWh - CO2 of the controller at the "
                "point) on the same split, scaled likewise; `co2_avoided_pct` relative to that reference.",
                f"`capex` = capex_per_kwp x kWp + capex_per_kwh x kWh + capex_per_kw x kW ({cur}): the extra capex "
                "over the 0 / 0 point.",
                "`annualised_cost` = PV capex x CRF(r, lifetime_years) + BESS capex x CRF(r, bess_lifetime_years), "
                "CRF(r, n) = r(1+r)^n / ((1+r)^n - 1), = 1/n at r = 0 (capex / lifetime). No operating cost, "
                "replacement or tariff.",
                f"`cost_per_t_avoided` = annualised_cost / co2_avoided_t_per_year ({cur}/t); empty where nothing is "
                "avoided.",
                "`pareto`: no other point of the same controller and split has both lower-or-equal annualised cost and "
                "CO2, one of them lower.",
            )
        ),
    ]


def _settings_blocks(table: pd.DataFrame, spec: SizingSpec, site_name: str, info: Mapping[str, str]) -> list[Block]:
    """The study's settings: the site, the grid, the controllers and splits, ``info`` and the spec's notes."""
    settings = [
        f"**site**: {site_name} (`{spec.source}`)",
        f"**PV (kWp)**: {', '.join(f'{v:g}' for v in spec.kwp)}",
        f"**BESS (kWh)**: {', '.join(f'{v:g}' for v in spec.bess_kwh)}, power {spec.bess_kw_per_kwh:g} kW per kWh",
        f"**controllers**: {', '.join(spec.controllers)}; splits {', '.join(_splits_in(table))}",
        *(f"**{k}**: {v}" for k, v in info.items()),
        *(f"**note**: {n}" for n in spec.notes),
    ]
    return [Heading(2, "Settings"), Bullets(tuple(settings))]


def _results_blocks(table: pd.DataFrame, cur: str) -> list[Block]:
    """The table, one row per point x controller x split, its columns readable and rounded (costs in ``cur``)."""
    shown = table.assign(
        controller=table.controller,
        pareto=np.where(table.pareto, "yes", ""),
        co2_t_per_year=table.co2_t_per_year.round(3),
        co2_avoided_pct=table.co2_avoided_pct.round(1),
        cost_per_t_avoided=table.cost_per_t_avoided.round(0),
        annualised_cost=table.annualised_cost.round(0),
        unserved_kwh=table.unserved_kwh.round(2),
        ev_energy_served_pct=table.ev_energy_served_pct.round(2),
        wall_s=table.wall_s.round(1),
    )
    columns = {
        "split": "split",
        "controller": "controller",
        "kwp": "PV (kWp)",
        "bess_kwh": "BESS (kWh)",
        "bess_kw": "BESS (kW)",
        "co2_t_per_year": "CO2 (t/yr)",
        "co2_avoided_pct": "CO2 avoided (%)",
        "unserved_kwh": "unserved (kWh)",
        "ev_energy_served_pct": "EV energy served (%)",
        "annualised_cost": f"annualised capex ({cur}/yr)",
        "cost_per_t_avoided": f"cost per t avoided ({cur}/t)",
        "pareto": "Pareto",
        "wall_s": "wall (s)",
    }
    return [
        Heading(2, "Results"),
        frame_table(shown[list(columns)].rename(columns=columns)),
        Paragraph(
            "Every column (grid import, PV generation, EV energy, peak import, wall seconds) is in `sizing.parquet`."
        ),
    ]


def _figure_blocks() -> list[Block]:
    """The two figures, ``co2_saved.png`` (:func:`plot_co2_saved`) and ``pareto.png`` (:func:`plot_pareto`)."""
    return [
        Heading(2, "Figures"),
        FigureRef(
            "co2_saved.png",
            "CO2 avoided over the grid",
            "CO2 avoided (% of uncontrolled at 0 kWp / 0 kWh) per controller and split.",
        ),
        FigureRef(
            "pareto.png",
            "Cost vs CO2 Pareto front",
            "Annualised capex vs yearly CO2 per point; filled points joined by lines are Pareto-optimal.",
        ),
    ]


def write_outputs(
    table: pd.DataFrame, spec: SizingSpec, out_dir: Path, site_name: str, info: Mapping[str, str] | None = None
) -> dict[str, Path]:
    """Write ``sizing.parquet``, the two figures, ``sizing.html`` and ``sizing.md`` (the last, the doit target) into
    ``out_dir``, atomically; returns their paths by name."""

    out_dir = Path(out_dir)
    paths = {"parquet": write_parquet(table, out_dir / "sizing.parquet")}
    paths["co2_saved"] = plot_co2_saved(table, out_dir / "co2_saved.png")
    paths["pareto"] = plot_pareto(table, out_dir / "pareto.png", spec.costs.currency if spec.costs else "USD")
    blocks = page_blocks(table, spec, site_name, info or {})
    title = f"Sizing study: {site_name}"
    paths["html"] = write_text(out_dir / "sizing.html", render_html(blocks, title, out_dir))
    paths["md"] = write_text(out_dir / "sizing.md", render_markdown(blocks))
    return paths


# ------------------------------------------------------------------------------------------------ the study
def run_sizing(
    site_toml: str | Path,
    out_dir: str | Path,
    spec: SizingSpec | None = None,
    workers: int | None = None,
    scheduler_address: str | None = None,
    client=None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Run the sizing study: validate the site's data, submit one Dask task per grid point (:func:`size_point`),
    print a line per finished point, then write the outputs (:func:`pipeline.study.sizing_page.write_outputs`).

    Args:
        site_toml: the site config (shipped name or path).
        out_dir: the output folder (``<experiment>/sizing``).
        spec: the study (default :func:`sizing_spec` of the site, with doit / environment variables).
        workers: worker processes of the embedded LocalCluster (default :func:`pipeline.study.cluster.get_client`'s);
            ignored with a scheduler.
        scheduler_address: an existing Dask scheduler; None starts a LocalCluster.
        client: a Dask client to use instead of either.
        log: where progress lines go.

    Returns:
        the written paths by name (``parquet``, ``co2_saved``, ``pareto``, ``html``, ``md``).

    Raises:
        ConfigError, envs.schemas.DataValidationError: a bad config, ``[sizing]`` table or data (before any task
            runs; nothing is written). Whatever a point raises (the message names the point); nothing is written.
    """
    from distributed import as_completed

    t0 = time.perf_counter()
    cfg, path = load_config(site_toml)
    spec = spec or sizing_spec(path)
    load_site(path, validate=True)  # bad data stops the study before any task
    if scheduler_address and workers and client is None:
        log(f"sizing: workers={workers} is ignored: the points run on the workers of the scheduler {scheduler_address}")
    client = client or get_client(scheduler_address, n_workers=workers)
    n_workers = len(client.scheduler_info().get("workers", {}))
    points = spec.points()
    where = f"scheduler {scheduler_address}" if scheduler_address else "LocalCluster"
    log(
        f"sizing {cfg.name}: {len(points)} points ({len(spec.kwp)} PV x {len(spec.bess_kwh)} BESS) x "
        f"{len(spec.controllers)} controllers ({', '.join(spec.controllers)}) x {len(SPLITS)} splits, "
        f"{n_workers} Dask worker(s) ({where})"
    )
    futures = {
        client.submit(
            size_point,
            str(path),
            p,
            e,
            w,
            spec.controllers,
            key=f"sizing-{cfg.name}-{p:g}kWp-{e:g}kWh-{w:g}kW",
            retries=1,
            pure=False,
        ): (p, e, w)
        for p, e, w in points
    }
    rows: list[dict] = []
    done = 0
    for fut in as_completed(futures):
        p, e, w = futures[fut]
        try:
            result = fut.result()
        except Exception as exc:
            for other in futures:
                other.cancel()
            raise RuntimeError(
                f"sizing point {p:g} kWp / {e:g} kWh / {w:g} kW failed: {type(exc).__name__}: {exc}"
            ) from exc
        done += 1
        rows += result
        co2 = "; ".join(
            f"{s} " + ", ".join(f"{r['controller']} {r['co2_kg']:,.0f}" for r in result if r["split"] == s)
            for s in SPLITS
        )
        log(
            f"[{done:>{len(str(len(points)))}}/{len(points)}] {p:g} kWp, {e:g} kWh / {w:g} kW in "
            f"{result[0]['task_wall_s']:.1f} s ({time.perf_counter() - t0:.0f} s elapsed); CO2 kg: {co2}"
        )
    table = build_table(rows, spec)
    wall = time.perf_counter() - t0
    info = {"Dask workers": f"{n_workers} ({where})", "wall time": f"{wall:.1f} s for {len(points)} points"}
    paths = write_outputs(table, spec, Path(out_dir), cfg.name, info)
    log(f"sizing {cfg.name}: {len(points)} points in {wall:.1f} s wall on {n_workers} worker(s); wrote {paths['html']}")
    for _, r in headline(table).iterrows():
        log(
            f"  cheapest per tonne avoided, {r.split} split, {r.controller}: {r.kwp:g} kWp + {r.bess_kwh:g} kWh / "
            f"{r.bess_kw:g} kW, {money(r.cost_per_t_avoided, spec.costs.currency if spec.costs else '')}/t, "
            f"{r.co2_avoided_t_per_year:,.2f} t/yr avoided ({r.co2_avoided_pct:.1f}%)"
        )
    return paths
