"""How much PV and battery to build: ``doit run sizing`` runs the controllers over a grid of PV kWp x BESS kWh.

At every point of the grid (PV ``kwp`` x BESS ``bess_kwh``, the BESS power being
``bess_kw = bess_kw_per_kwh * bess_kwh``, the C-rate) the site's config is changed in memory
(:meth:`envs.config.SiteConfig.replace`, the loaded data reused: no TOML is written per point) and the controllers run
on both splits: ``uncontrolled``, ``rule_based`` (:mod:`pipeline.control.baselines`), ``mpc`` (the causal
receding-horizon LP, :mod:`pipeline.control.mpc`) and the perfect-foresight ``oracle`` (:mod:`pipeline.control.oracle`,
the lower bound of CO2); ``mpc_perfect`` on request. Each point is one Dask task (:func:`size_point`, given the site
TOML's path and three numbers, returning a few small dicts); the cluster is :func:`pipeline.study.cluster.get_client`'s:
a scheduler address if given, else an embedded ``LocalCluster`` of ``workers`` processes.

Definitions (per controller ``c``, split ``s`` and point ``(kwp, kwh)``; ``H_s`` = hours of split ``s``):

- ``co2_t_per_year = co2_kg * 8760 / H_s / 1000``: the split's CO2 scaled to a 365-day year (t/yr). A split
  of some months carries their season: the caltech test split is May-August, sunnier than a year's mean.
- ``co2_avoided_t_per_year = (CO2[uncontrolled, s, (0, 0)] - CO2[c, s, (kwp, kwh)]) * 8760 / H_s / 1000``:
  against the site with neither PV nor battery and no control, so for ``mpc`` and ``oracle`` it includes what
  shifting the EV charging alone avoids (their value at the ``(0, 0)`` point, which costs nothing);
  ``co2_avoided_pct`` is the same as a share of the reference's CO2.
- ``capex = capex_per_kwp * kwp + capex_per_kwh * kwh + capex_per_kw * bess_kw`` (currency of ``[sizing]``),
  which is also the extra capex over the ``(0, 0)`` point.
- ``annualised_cost = capex_pv * CRF(r, n_pv) + capex_bess * CRF(r, n_bess)`` per year, with the capital
  recovery factor ``CRF(r, n) = r (1 + r)^n / ((1 + r)^n - 1)`` (``= 1 / n`` when ``r = 0``: plain
  ``capex / lifetime``), ``r = discount_rate``, ``n_pv = lifetime_years``, ``n_bess = bess_lifetime_years``
  (default ``lifetime_years``). No operating cost, no replacement, no tariff: CO2 only.
- ``cost_per_t_avoided = annualised_cost / co2_avoided_t_per_year`` (currency per tonne of CO2); NaN where
  nothing is avoided (``co2_avoided_t_per_year <= 0``), 0 at a point without capex that avoids CO2.
- ``pareto``: the point is on the cost-CO2 Pareto front of its controller and split (no other point of the grid
  has ``annualised_cost`` and ``co2_t_per_year`` both lower or equal and one of them lower).
- The headline (:func:`headline`): per controller and split, the point with capex that has the lowest
  ``cost_per_t_avoided``.

The grid and the costs come from the site TOML's ``[sizing]`` table (:func:`parse_sizing`, keys in
:data:`SIZING_KEYS`); the doit variables ``kwp=0,20,40,80``, ``bess_kwh=0,40,80,160``, ``bess_kw_per_kwh=0.5``
and ``controllers=rule_based,oracle`` (environment variables ``EVHUB_SIZING_KWP``, ``EVHUB_SIZING_BESS_KWH``,
``EVHUB_SIZING_BESS_KW_PER_KWH``, ``EVHUB_SIZING_CONTROLLERS``) override its grid, and ``workers=N``
(``EVHUB_WORKERS``, :class:`pipeline.study.config.PipelineConfig`'s) sizes the LocalCluster. The point ``(0, 0)`` is
the reference: a 0 is added to an axis that lacks one.

Outputs, in ``<output_dir>/<experiment>/sizing/`` (:func:`outputs`): ``sizing.parquet`` (one row per point x
controller x split, columns :data:`COLUMNS`), and the study's page (:mod:`pipeline.study.sizing_page`):
``co2_saved.png``, ``pareto.png``, ``sizing.md`` and ``sizing.html`` (self-contained, the figures embedded). Every file
is written atomically.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs.config import ConfigError, load_config
from envs.site import Site, load_site, site_files
from envs.toml_table import Range, TomlTable
from pipeline.control import registry
from pipeline.study.config import SPLITS, shown_path, variable

HOURS_PER_YEAR = 8760.0
"""Hours of the year a split's CO2 is scaled to (365 days)."""

KNOWN_CONTROLLERS = registry.simulated(tuned=False)
"""Controllers a sizing study can run: those the study simulates without a tuning
(:func:`pipeline.control.registry.simulated`), in report order (``uncontrolled`` always runs: it is the reference)."""

DEFAULT_CONTROLLERS = ("uncontrolled", "rule_based", "mpc", "oracle")
"""Controllers run when neither ``[sizing] controllers`` nor the doit variable ``controllers`` says otherwise."""

GRID_KEYS = ("kwp", "bess_kwh", "bess_kw_per_kwh", "controllers")
COST_KEYS = (
    "capex_per_kwp",
    "capex_per_kwh",
    "capex_per_kw",
    "lifetime_years",
    "bess_lifetime_years",
    "discount_rate",
    "currency",
)
SIZING_KEYS = GRID_KEYS + COST_KEYS
"""Keys of the ``[sizing]`` table of a site TOML:

- ``kwp``: PV sizes, kWp (a list of numbers >= 0, or one number);
- ``bess_kwh``: BESS energy sizes, kWh (likewise);
- ``bess_kw_per_kwh``: BESS power per kWh of energy (C-rate), kW/kWh, > 0 (default 0.5);
- ``controllers``: list of :data:`KNOWN_CONTROLLERS` (default :data:`DEFAULT_CONTROLLERS`);
- ``capex_per_kwp``, ``capex_per_kwh``, ``capex_per_kw``: installed cost per kWp of PV, per kWh and per kW of
  BESS, >= 0 (currency units; ``capex_per_kw`` defaults to 0);
- ``lifetime_years`` (> 0) and ``bess_lifetime_years`` (> 0, default ``lifetime_years``);
- ``discount_rate``: real discount rate per year in [0, 1) (default 0: capex / lifetime);
- ``currency``: a label (default ``"USD"``).

Without ``capex_per_kwp``, ``capex_per_kwh`` and ``lifetime_years`` the study runs but its cost columns are NaN;
giving some of them requires all three."""

COLUMNS = (
    "kwp", "bess_kwh", "bess_kw", "controller", "split", "hours",
    "co2_kg", "co2_t_per_year", "unserved_kwh", "ev_energy_requested_kwh", "ev_energy_delivered_kwh",
    "ev_energy_served_pct", "grid_import_kwh", "grid_export_kwh", "pv_generation_kwh", "pv_self_consumption_pct",
    "peak_import_kw", "capex", "annualised_cost", "co2_avoided_kg", "co2_avoided_t_per_year", "co2_avoided_pct",
    "cost_per_t_avoided", "currency", "pareto", "wall_s", "task_wall_s",
)  # fmt: skip
"""Columns of ``sizing.parquet``: sizes (kWp, kWh, kW; float64), ``controller`` and ``split`` (str), ``hours``
(the split's length, h), the KPIs of :mod:`envs.kpis` (kg, kWh, %, kW), the yearly and cost columns of the module
docstring (t/yr, currency, currency/yr, currency/t), ``currency`` (its label, str), ``pareto`` (bool), ``wall_s``
(seconds of this controller on this split) and ``task_wall_s`` (seconds of the whole point's Dask task)."""


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class SizingCosts:
    """Unit costs of PV and battery and how capex is annualised (module docstring).

    Attributes:
        capex_per_kwp: installed PV cost per kWp (DC), currency/kWp.
        capex_per_kwh: installed BESS cost per kWh of energy, currency/kWh.
        capex_per_kw: installed BESS cost per kW of power, currency/kW.
        lifetime_years: PV lifetime, years.
        bess_lifetime_years: BESS lifetime, years.
        discount_rate: real discount rate per year (0: capex / lifetime).
        currency: label of the currency.
    """

    capex_per_kwp: float
    capex_per_kwh: float
    capex_per_kw: float
    lifetime_years: float
    bess_lifetime_years: float
    discount_rate: float = 0.0
    currency: str = "USD"

    @staticmethod
    def crf(rate: float, years: float) -> float:
        """Capital recovery factor ``r (1 + r)^n / ((1 + r)^n - 1)``, per year; ``1 / n`` when ``r = 0``."""
        if rate == 0:
            return 1.0 / years
        g = (1.0 + rate) ** years
        return rate * g / (g - 1.0)

    def capex(self, kwp: float, bess_kwh: float, bess_kw: float) -> float:
        """Installed cost of ``kwp`` of PV and a ``bess_kwh`` / ``bess_kw`` battery (currency)."""
        return self.capex_per_kwp * kwp + self.capex_per_kwh * bess_kwh + self.capex_per_kw * bess_kw

    def annualised(self, kwp: float, bess_kwh: float, bess_kw: float) -> float:
        """Annualised capex (currency per year): each part times its capital recovery factor."""
        pv = self.capex_per_kwp * kwp * self.crf(self.discount_rate, self.lifetime_years)
        bess = self.capex_per_kwh * bess_kwh + self.capex_per_kw * bess_kw
        bess *= self.crf(self.discount_rate, self.bess_lifetime_years)
        return pv + bess


@dataclass(frozen=True)
class SizingSpec:
    """What ``doit run sizing`` runs: the grid, the controllers and the costs.

    Attributes:
        kwp: PV sizes, kWp, sorted, with 0.
        bess_kwh: BESS energy sizes, kWh, sorted, with 0.
        bess_kw_per_kwh: BESS power per kWh (C-rate), kW/kWh.
        controllers: controllers run at every point (``uncontrolled`` first).
        costs: the unit costs, or ``None`` when ``[sizing]`` gives none.
        source: the site TOML (for messages).
        notes: what was changed on the way (a 0 added to an axis).
    """

    kwp: tuple[float, ...]
    bess_kwh: tuple[float, ...]
    bess_kw_per_kwh: float = 0.5
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS
    costs: SizingCosts | None = None
    source: str = "<sizing>"
    notes: tuple[str, ...] = ()

    def points(self) -> list[tuple[float, float, float]]:
        """Every grid point as ``(kwp, bess_kwh, bess_kw)``, PV outer, BESS inner."""
        return [(p, e, e * self.bess_kw_per_kwh) for p in self.kwp for e in self.bess_kwh]

    def as_dict(self) -> dict:
        """Plain dict of the settings that decide the results (for doit's ``config_changed``)."""
        d = asdict(self)
        d.pop("notes")
        return d


def parse_sizing(
    table: Mapping[str, Any], source: str = "<sizing>", overrides: Mapping[str, tuple[Any, str]] | None = None
) -> SizingSpec:
    """Check a ``[sizing]`` table (:data:`SIZING_KEYS`) and build the study's :class:`SizingSpec`.

    Args:
        table: the raw ``[sizing]`` table (``SiteConfig.sizing``).
        source: the site TOML's path, named in every message.
        overrides: grid settings from doit or environment variables: ``key -> (value, origin)`` for keys of
            :data:`GRID_KEYS`, the value already parsed (a list of numbers, a number, a list of names) and
            ``origin`` naming where it came from (``"doit variable kwp='0,20'"``).

    Returns:
        the spec; a 0 is added to the ``kwp`` and ``bess_kwh`` axes that lack it (the reference point), with a
        note in ``notes``.

    Raises:
        ConfigError: an unknown key (the message names ``source``, ``sizing.<key>`` and the closest known key),
            a value of the wrong type, a negative size or cost, an empty grid (no ``kwp`` or ``bess_kwh`` given
            anywhere, or an empty list), ``bess_kw_per_kwh <= 0``, a lifetime <= 0, a discount rate outside
            [0, 1), an unknown controller, or some but not all of the required cost keys; the message names the
            TOML and the dotted key, or the doit / environment variable the value came from.
    """
    TomlTable(table, "sizing", source, ConfigError).check_keys(SIZING_KEYS)
    overrides = dict(overrides or {})
    # the table with the overrides on top: a value from a doit / environment variable names that in its messages
    t = TomlTable(
        {**table, **{k: v for k, (v, _) in overrides.items()}},
        "sizing",
        source,
        ConfigError,
        origins={k: origin for k, (_, origin) in overrides.items()},
    )

    notes = []
    axes = {}
    for key, unit in (("kwp", "kWp"), ("bess_kwh", "kWh")):
        t.require(
            key,
            why=(
                f": the sizing grid is empty (give it in [sizing], e.g. {key} = [0, 20, 40], or as the doit variable "
                f"{key}=0,20,40)"
            ),
        )
        empty = f"is an empty grid: give at least one size in {unit}, e.g. [0, 20, 40]"
        sizes = tuple(sorted(set(t.numbers(key, range=Range(ge=0, unit=unit), scalar=True, empty=empty))))
        if 0.0 not in sizes:
            sizes = (0.0, *sizes)
            notes.append(f"0 {unit} added to the {key} axis: the point (0 kWp, 0 kWh) is the reference of CO2 avoided")
        axes[key] = sizes
    ratio = t.number("bess_kw_per_kwh", 0.5, Range(gt=0, unit="kW per kWh (the battery's C-rate)"))
    chosen = t.strings(
        "controllers", DEFAULT_CONTROLLERS, KNOWN_CONTROLLERS, expect="a non-empty list of controller names"
    )
    controllers = tuple(c for c in KNOWN_CONTROLLERS if c in chosen or c == "uncontrolled")

    costs = None
    if any(k in table for k in COST_KEYS):
        t.require(
            "capex_per_kwp",
            "capex_per_kwh",
            "lifetime_years",
            why=": unit costs need all of sizing.capex_per_kwp, sizing.capex_per_kwh, sizing.lifetime_years",
        )
        cost, years = Range(ge=0, unit="(a cost)"), Range(gt=0, unit="years")
        lifetime = t.number("lifetime_years", range=years)
        costs = SizingCosts(
            capex_per_kwp=t.number("capex_per_kwp", range=cost),
            capex_per_kwh=t.number("capex_per_kwh", range=cost),
            capex_per_kw=t.number("capex_per_kw", 0.0, cost),
            lifetime_years=lifetime,
            bess_lifetime_years=t.number("bess_lifetime_years", lifetime, years),
            discount_rate=t.number("discount_rate", 0.0, Range(ge=0, lt=1, what="a yearly rate")),
            currency=t.string("currency", "USD", nonempty=True),
        )
    return SizingSpec(axes["kwp"], axes["bess_kwh"], ratio, controllers, costs, source, tuple(notes))


def _parse_variable(name: str, text: str, origin: str) -> Any:
    """A doit / environment variable's text as the value :func:`parse_sizing` expects (raises ValueError naming it)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if name == "controllers":
        return items
    try:
        numbers = [float(t) for t in items]
    except ValueError:
        raise ConfigError(f"{origin}: {name} must be comma-separated numbers") from None
    if name == "bess_kw_per_kwh":
        if len(numbers) != 1:
            raise ConfigError(f"{origin}: bess_kw_per_kwh must be one number (kW per kWh)")
        return numbers[0]
    return numbers


def sizing_spec(site: str | Path, variables: Callable[[str], tuple[str, str] | None] | None = None) -> SizingSpec:
    """The sizing study of a site: its TOML's ``[sizing]`` table with the grid settings of doit / environment
    variables (``kwp``, ``bess_kwh``, ``bess_kw_per_kwh``, ``controllers``) on top.

    Args:
        site: a shipped site name or a site TOML path.
        variables: ``name -> (text, origin) | None`` (default :func:`pipeline.study.config.variable`: doit's
            command line, then ``EVHUB_SIZING_*``).

    Raises:
        FileNotFoundError, ConfigError: see :func:`envs.config.load_config` and :func:`parse_sizing`.
    """

    variables = variables or variable
    cfg, path = load_config(site)
    overrides = {}
    for name in GRID_KEYS:
        if (given := variables(name)) is not None:
            text, origin = given
            overrides[name] = (_parse_variable(name, text, origin), origin)
    return parse_sizing(cfg.sizing, shown_path(path), overrides)


# ------------------------------------------------------------------------------------------------ one point
_BASE_SITES: dict[tuple[str, float], Site] = {}


def _base_site(site_toml: str) -> Site:
    """The site as loaded from ``site_toml`` (data not re-validated), cached per worker process and file mtime."""
    files = site_files(site_toml)
    key = (str(files["config"]), max(p.stat().st_mtime for p in files.values()))
    if key not in _BASE_SITES:
        _BASE_SITES.clear()
        _BASE_SITES[key] = load_site(files["config"], validate=False)
    return _BASE_SITES[key]


def site_at(site: Site, kwp: float, bess_kwh: float, bess_kw: float) -> Site:
    """``site`` with ``kwp`` of PV and a ``bess_kwh`` / ``bess_kw`` battery: a new :class:`~envs.site.Site` with the
    changed config and the same data frames (nothing is copied or written).

    Raises:
        ConfigError: a negative size (see :func:`envs.config.config_from_dict`).
    """
    cfg = site.config.replace(
        pv={"kwp": float(kwp)}, bess={"capacity_kwh": float(bess_kwh), "power_kw": float(bess_kw)}
    )
    return Site(cfg, site.series, site.sessions, dict(site.source))


def run_controller(site: Site, controller: str, split: str) -> pd.DataFrame:
    """One controller over one split of ``site``: its one-row KPI table (:func:`envs.kpis.kpi_row`).

    Raises:
        KeyError: unknown controller or split.
        RuntimeError: an LP not solved, or an energy-balance violation.
    """
    if controller not in KNOWN_CONTROLLERS:
        raise KeyError(f"unknown controller {controller!r}: known are {', '.join(KNOWN_CONTROLLERS)}")
    return registry.get(controller).simulate(site, split)[0]


KPI_KEYS = (
    "co2_kg",
    "unserved_kwh",
    "ev_energy_requested_kwh",
    "ev_energy_delivered_kwh",
    "ev_energy_served_pct",
    "grid_import_kwh",
    "grid_export_kwh",
    "pv_generation_kwh",
    "pv_self_consumption_pct",
    "peak_import_kw",
)


def size_point(site_toml: str, kwp: float, bess_kwh: float, bess_kw: float, controllers: Sequence[str]) -> list[dict]:
    """One grid point (a Dask task): every controller on both splits of the site sized ``kwp`` / ``bess_kwh`` /
    ``bess_kw``.

    Args:
        site_toml: path of the site config (its data is read once per worker process).
        kwp: PV size, kWp; bess_kwh: BESS energy, kWh; bess_kw: BESS power, kW.
        controllers: names from :data:`KNOWN_CONTROLLERS`.

    Returns:
        one dict per controller x split: ``kwp``, ``bess_kwh``, ``bess_kw``, ``controller``, ``split``, ``hours``
        (float), the KPIs of :data:`KPI_KEYS`, ``wall_s`` (that run's seconds) and ``task_wall_s`` (the whole
        point's seconds). The controllers' own progress lines are not printed.

    Raises:
        KeyError, RuntimeError, ConfigError: see :func:`run_controller` and :func:`site_at`.
    """
    t0 = time.perf_counter()
    site = site_at(_base_site(site_toml), kwp, bess_kwh, bess_kw)
    rows = []
    for split in SPLITS:
        hours = site.split(split).num_steps * site.config.dt_h
        for controller in controllers:
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # the MPC and the oracle print a line per run
                kpi = run_controller(site, controller, split)
            row = {
                "kwp": float(kwp),
                "bess_kwh": float(bess_kwh),
                "bess_kw": float(bess_kw),
                "controller": controller,
                "split": split,
                "hours": float(hours),
            }
            row.update({k: float(kpi[k].iloc[0]) for k in KPI_KEYS})
            row["wall_s"] = time.perf_counter() - t
            rows.append(row)
    wall = time.perf_counter() - t0
    for row in rows:
        row["task_wall_s"] = wall
    return rows


# ------------------------------------------------------------------------------------------------ the table
def pareto_mask(cost: np.ndarray, co2: np.ndarray) -> np.ndarray:
    """Which points are Pareto-optimal for (cost, CO2), both to be minimised: no other point is lower or equal in
    both and lower in one. Shapes ``(n,)`` float; returns ``(n,)`` bool (False where either is NaN)."""
    cost, co2 = np.asarray(cost, np.float64), np.asarray(co2, np.float64)
    ok = ~(np.isnan(cost) | np.isnan(co2))
    out = np.zeros(len(cost), bool)
    for i in np.flatnonzero(ok):
        le = ok & (cost <= cost[i]) & (co2 <= co2[i])
        lt = (cost < cost[i]) | (co2 < co2[i])
        out[i] = not (le & lt).any()
    return out


def build_table(rows: Sequence[Mapping[str, Any]], spec: SizingSpec) -> pd.DataFrame:
    """The ``sizing.parquet`` table (:data:`COLUMNS`) from the rows of :func:`size_point`: yearly CO2, CO2 avoided
    against uncontrolled at (0 kWp, 0 kWh) of the same split, costs and the Pareto flag (module docstring).

    Raises:
        ValueError: no uncontrolled row at (0, 0) for a split (the reference is missing).
    """
    df = pd.DataFrame(list(rows))
    year = HOURS_PER_YEAR / df.hours
    df["co2_t_per_year"] = df.co2_kg * year / 1000.0
    ref = df[(df.controller == "uncontrolled") & (df.kwp == 0) & (df.bess_kwh == 0)].set_index("split").co2_kg
    missing = [s for s in df.split.unique() if s not in ref.index]
    if missing:
        raise ValueError(f"no uncontrolled run at 0 kWp / 0 kWh on split(s) {missing}: the reference of CO2 avoided")
    base = df.split.map(ref)
    df["co2_avoided_kg"] = base - df.co2_kg
    df["co2_avoided_t_per_year"] = df.co2_avoided_kg * year / 1000.0
    df["co2_avoided_pct"] = np.where(
        base.abs() > 0, 100.0 * df.co2_avoided_kg / base.where(base.abs() > 0, 1.0), math.nan
    )
    c = spec.costs
    if c is None:
        df["capex"] = math.nan
        df["annualised_cost"] = math.nan
    else:
        df["capex"] = [c.capex(p, e, w) for p, e, w in zip(df.kwp, df.bess_kwh, df.bess_kw)]
        df["annualised_cost"] = [c.annualised(p, e, w) for p, e, w in zip(df.kwp, df.bess_kwh, df.bess_kw)]
    df["currency"] = c.currency if c is not None else ""
    avoided = df.co2_avoided_t_per_year
    df["cost_per_t_avoided"] = np.where(avoided > 0, df.annualised_cost / avoided.where(avoided > 0, 1.0), math.nan)
    df["pareto"] = False
    for _, idx in df.groupby(["controller", "split"]).groups.items():
        sub = df.loc[idx]
        df.loc[idx, "pareto"] = pareto_mask(sub.annualised_cost.to_numpy(), sub.co2_t_per_year.to_numpy())
    df["pareto"] = df.pareto.astype(bool)
    order = {c: i for i, c in enumerate(KNOWN_CONTROLLERS)}
    df = df.assign(_s=df.split.map({s: i for i, s in enumerate(SPLITS)}), _c=df.controller.map(order))
    df = df.sort_values(["_s", "_c", "kwp", "bess_kwh"], kind="mergesort").drop(columns=["_s", "_c"])
    return df[list(COLUMNS)].reset_index(drop=True)


def headline(table: pd.DataFrame) -> pd.DataFrame:
    """Per split and controller, the point with capex whose cost per tonne of CO2 avoided is lowest.

    Args:
        table: the ``sizing.parquet`` table (:func:`build_table`).

    Returns:
        one row per split x controller that has such a point (none without costs), columns ``split``,
        ``controller``, ``kwp``, ``bess_kwh``, ``bess_kw``, ``cost_per_t_avoided``, ``co2_avoided_t_per_year``,
        ``co2_avoided_pct``, ``annualised_cost``, ``capex``, ``unserved_kwh``; and ``free_avoided_pct``, what the
        controller avoids at (0, 0) without any capex (%).
    """
    out = []
    cols = [
        "split",
        "controller",
        "kwp",
        "bess_kwh",
        "bess_kw",
        "cost_per_t_avoided",
        "co2_avoided_t_per_year",
        "co2_avoided_pct",
        "annualised_cost",
        "capex",
        "unserved_kwh",
    ]
    for (_split, _controller), rows in table.groupby(["split", "controller"], sort=False):
        ok = rows[(rows.capex > 0) & rows.cost_per_t_avoided.notna()]
        if ok.empty:
            continue
        best = ok.loc[ok.cost_per_t_avoided.idxmin(), cols].to_dict()
        free = rows[(rows.kwp == 0) & (rows.bess_kwh == 0)].co2_avoided_pct
        best["free_avoided_pct"] = float(free.iloc[0]) if len(free) else math.nan
        out.append(best)
    return pd.DataFrame(out, columns=[*cols, "free_avoided_pct"])


def report_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The headline of a sizing study as the main report shows it (``write_report(sizing=...)``): one row per split x
    controller (:func:`headline`) with readable column names and units, rounded."""
    head = headline(table)
    cur = str(table.currency.iloc[0]) if "currency" in table and len(table) and table.currency.iloc[0] else "currency"
    return pd.DataFrame(
        {
            "split": head.split,
            "controller": head.controller,
            "PV (kWp)": head.kwp,
            "BESS (kWh)": head.bess_kwh,
            "BESS (kW)": head.bess_kw,
            f"cost per t CO2 avoided ({cur}/t)": head.cost_per_t_avoided.round(0),
            "CO2 avoided (t/yr)": head.co2_avoided_t_per_year.round(2),
            "CO2 avoided (%)": head.co2_avoided_pct.round(1),
            "CO2 avoided at 0 kWp / 0 kWh (%)": head.free_avoided_pct.round(1),
        }
    )


# ------------------------------------------------------------------------------------------------ outputs
def outputs(root: Path) -> list[Path]:
    """The files ``doit run sizing`` writes under the experiment folder ``root`` (its doit targets)."""
    folder = Path(root) / "sizing"
    return [folder / f for f in ("sizing.parquet", "co2_saved.png", "pareto.png", "sizing.html", "sizing.md")]
