"""Ingest a site's raw sources (its TOML's ``[sources]``, see :mod:`pipeline.data.sources`) into its processed data.

``python -m pipeline.data.ingest --site path/to/site.toml [--dt-h 0.25]`` (or the name of a site shipped in
``envs/sites/``) reads the sources the TOML names, builds the tables at the site's step ``dt_h`` (the TOML's, or
``--dt-h``), checks them with :func:`envs.schemas.validate_site_data` and writes, atomically (:mod:`envs.files`), into
the site's ``data_dir`` beside the TOML (or ``--out-dir``):

- the series (:func:`envs.site.series_file`), one row per UTC step of the period (:func:`pipeline.data.sources.period`:
  local midnight of the first split's first date to local midnight after the last split's last date, in the site
  ``timezone``; continuous, DST days have 23 or 25 hours of steps): ``time`` (datetime64[ns, UTC], step start),
  ``pv_kw_per_kwp`` (float32, kW AC per kWp DC, step mean), ``moer_kg_per_kwh`` (float32, kg CO2/kWh, step mean),
  ``moer_fc_h0``/``h1``/``h2`` (float32, kg CO2/kWh, the forecasts issued at the step start for the hour from it / the
  next hour / the one after: leads in hours at every step), and from 5-minute carbon files with forecasts
  :data:`envs.schemas.MOER_5MIN_COLUMNS` (float32, kg CO2/kWh). Three files, each where the sources support its step
  (:func:`series_steps`):

  - ``series_<m>min.parquet`` at the site's step (``series_15min.parquet`` at ``dt_h = 0.25``);
  - ``series_60min.parquet``, the hourly study's data, whatever the site's step;
  - ``series_5min.parquet``, the 5-minute physics every controller is also scored on, holding only
    :data:`envs.schemas.PHYSICS_COLUMNS` (the full series where the site's step is 5 minutes); a site whose sources
    are coarser (an hourly carbon file) gets none, and one line says so.

  An hourly EPW's PV is split into the steps of each hour in proportion to the clear-sky GHI at each step's middle,
  so that the mean of an hour's steps is the hourly value (:func:`pipeline.data.pv.split_hours`).
- ``sessions.parquet``: one row per EV session, sorted by arrival: ``session_id``, ``station_id`` (str),
  ``arrival``, ``departure`` (datetime64[ns, UTC], the raw minute timestamps, whatever the step), ``energy_kwh``
  (float32, kWh delivered), ``requested_energy_kwh`` (float32, kWh asked for) [, ``kind`` (str) for generated
  sessions].
- ``README.md``: provenance (the TOML's ``[sources] attribution``, each raw file's SHA-256), the derivation
  of every column at each step, the per-file session counts and a summary per split.

Every check runs before anything is written: bad input raises :class:`pipeline.data.sources.SourceError` (or
:class:`envs.schemas.DataValidationError`) naming the file, the column and the row, and leaves the previous
files in place; so does a step finer than a source gives (naming the TOML, the key ``dt_h``, the source and its
resolution). A file whose content would not change is not rewritten. On the command line such an error (any
:func:`envs.errors.is_expected` one) prints its message alone, without a traceback, and exits with status 1.

A raw sessions or carbon file none of whose rows lies in the site's period (a download folder holding other
years) is skipped with one line naming it and why; the README lists it (:mod:`pipeline.data.readers`).

When none of the site's raw files is present (a clone without the raw folder of a shipped site) and the
processed data are, there is nothing to do: the shipped processed data are used as they are, and one line
says so.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from envs import files, timestep
from envs.config import SITES_DIR
from envs.errors import exit_code
from envs.schemas import PHYSICS_COLUMNS, validate_site_data, validate_table
from envs.site import series_file
from pipeline import depends
from pipeline.data.pv import load_pv, pv_at, pv_step_refusal
from pipeline.data.readers import carbon_at, carbon_step_refusal, load_carbon, read_sessions
from pipeline.data.sources import SourceError, Sources, load_sources, period, step_error, step_index
from pipeline.paths import shown_path

HOURLY_MINUTES = 60
"""The step of the hourly study's series, minutes: written whatever the site's step."""
PHYSICS_MINUTES = timestep.step_minutes(timestep.PHYSICS_DT_H)
"""The step of the physics series every controller is also scored on, minutes (5)."""
OUTPUTS = (series_file(".", 1.0).name, "sessions.parquet", "README.md")
"""What ingestion writes into a site's data folder whatever its step: the hourly series, the sessions and the README;
besides, the series at the site's step and the 5-minute physics series (:func:`outputs`)."""
PHYSICS_FORMATS = {"carbon": ("watttime-moer", "constant"), "weather": ("epw", "clear-sky")}
"""Source formats that always give the 5-minute physics series (a ``csv`` or ``pv-csv`` file does where its
resolution allows, which only its content tells)."""


def series_steps(dt_h: float) -> tuple[int, ...]:
    """The steps, minutes, of the series ingestion writes for a site at ``dt_h``: its own, the hour and 5 minutes,
    each once in that order (``(15, 60, 5)`` at ``dt_h = 0.25``, ``(60, 5)`` at 1)."""
    return tuple(dict.fromkeys((timestep.step_minutes(dt_h), HOURLY_MINUTES, PHYSICS_MINUTES)))


def outputs(src: Sources) -> list[str]:
    """The names of the files ingestion writes for ``src`` at its config's step: the series of :func:`series_steps`
    (the 5-minute one only where the source formats always give it, :data:`PHYSICS_FORMATS`), the sessions and the
    README."""
    physics = src.carbon.format in PHYSICS_FORMATS["carbon"] and src.weather.format in PHYSICS_FORMATS["weather"]
    steps = [m for m in series_steps(src.config.dt_h) if physics or m != PHYSICS_MINUTES or m == _site_minutes(src)]
    return [series_file(".", m / 60).name for m in steps] + list(OUTPUTS[1:])


def _site_minutes(src: Sources) -> int:
    return timestep.step_minutes(src.config.dt_h)


# ---------------------------------------------------------------------------------------------- build


def build(src: Sources) -> tuple[dict[int, pd.DataFrame], pd.DataFrame, dict]:
    """Build the series at each step of :func:`series_steps` and the sessions table of a site from its sources (nothing
    is written). The raw files are read once; each step's series is laid onto that step's index.

    Returns:
        ``(series, sessions, info)``: ``series`` maps each step written (minutes) to its table (RangeIndex; the
        5-minute one with :data:`envs.schemas.PHYSICS_COLUMNS` only unless it is the site's step), ``sessions`` the
        table described in the module docstring, ``info`` the diagnostics of each source at the hourly step (``pv``,
        ``carbon``, ``sessions``), per step (``steps``: minutes -> ``{"pv", "carbon"}``) and ``no_physics`` (why the
        sources give no 5-minute series, or None).

    Prints one line per raw file skipped because none of its rows lies in the site's period, and one where the sources
    give no 5-minute physics series.

    Raises:
        SourceError: see :func:`pipeline.data.pv.read_pv`, :func:`~pipeline.data.readers.read_carbon` and
            :func:`~pipeline.data.readers.read_sessions`; a site step (or the hour) finer than a source gives.
    """
    cfg = src.config
    sessions, session_info = read_sessions(src, log=_say)  # cheapest first: a bad file stops before the PV model runs
    carbon = load_carbon(src, log=_say)
    site = _site_minutes(src)
    steps, no_physics = [], None
    pv = load_pv(src)
    for m in series_steps(cfg.dt_h):
        refusal = carbon_step_refusal(src, carbon, m) or pv_step_refusal(src, pv, m)
        if refusal is None:
            steps.append(m)
        elif m == PHYSICS_MINUTES and m != site:
            no_physics = refusal
            _say(f"ingest: no {PHYSICS_MINUTES}-minute physics series ({series_file('.', m / 60).name}): {refusal}")
        else:
            raise step_error(src, m, refusal)
    series, by_step = {}, {}
    for m in steps:
        index = step_index(*period(cfg), cfg.timezone, m / 60)
        c, c_info = carbon_at(src, carbon, index)
        p, p_info = pv_at(src, pv, index)
        table = pd.DataFrame({"time": index, "pv_kw_per_kwp": p.astype(np.float32)})
        for col in c.columns:
            table[col] = c[col].to_numpy().astype(np.float32)
        if m == PHYSICS_MINUTES and m != site:
            table = table[list(PHYSICS_COLUMNS)]
        series[m] = table.reset_index(drop=True)
        by_step[m] = {"pv": p_info, "carbon": c_info}
    hourly = by_step[HOURLY_MINUTES]
    info = {"pv": hourly["pv"], "carbon": hourly["carbon"], "sessions": session_info, "steps": by_step}
    return series, sessions, {**info, "no_physics": no_physics}


def _say(line: str) -> None:
    print(line, flush=True)


def split_summary(
    hourly: pd.DataFrame, sessions: pd.DataFrame, tz: str, splits: dict[str, tuple[str, str]]
) -> list[dict]:
    """Hours, sessions, energy (kWh), PV (kWh/kWp) and mean carbon intensity (kg/kWh) of each split, from the hourly
    series ``hourly`` (one row an hour: its PV means in kW add up to kWh).

    ``splits`` maps split names to inclusive local dates of ``tz``; sessions count by arrival. Where ``sessions``
    has a ``kind`` column, ``by_kind`` counts the sessions of each kind.
    """
    rows = []
    for name, (first, last) in splits.items():
        start = pd.Timestamp(first).tz_localize(tz).tz_convert("UTC")
        end = (pd.Timestamp(last) + pd.Timedelta(days=1)).tz_localize(tz).tz_convert("UTC")
        h = hourly[(hourly.time >= start) & (hourly.time < end)]
        s = sessions[(sessions.arrival >= start) & (sessions.arrival < end)]
        rows.append(
            {
                "split": name,
                "dates": f"{first}..{last}",
                "hours": len(h),
                "sessions": len(s),
                "energy_kwh": float(s.energy_kwh.astype(np.float64).sum()),
                "pv_kwh_per_kwp": float(h.pv_kw_per_kwp.astype(np.float64).sum()),
                "moer_mean": float(h.moer_kg_per_kwh.astype(np.float64).mean()),
            }
        )
        if "kind" in s.columns:
            rows[-1]["by_kind"] = s.kind.value_counts().to_dict()
    return rows


# --------------------------------------------------------------------------------------------- README


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _shown(path: Path) -> str:
    return shown_path(path)


def _months_without_sessions(hourly: pd.DataFrame, sessions: pd.DataFrame, tz: str) -> str:
    """Local months of the period without any session arrival, as ``2024-01, 2024-03..2024-05``."""

    def local_months(t: pd.Series) -> pd.Series:
        return t.dt.tz_convert(tz).dt.tz_localize(None).dt.to_period("M")

    months = pd.PeriodIndex(local_months(hourly.time).unique(), freq="M")
    used = set(local_months(sessions.arrival).unique()) if len(sessions) else set()
    empty = [m for m in months if m not in used]
    runs: list[list[pd.Period]] = []
    for m in empty:
        if runs and runs[-1][-1] + 1 == m:
            runs[-1].append(m)
        else:
            runs.append([m])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def _utc_offset(hours: float) -> str:
    h = int(abs(hours))
    m = int(round((abs(hours) - h) * 60))
    return f"UTC{'-' if hours < 0 else '+'}{h}" + (f":{m:02d}" if m else "")


def _compass(azimuth: float) -> str:
    names = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")
    return names[int(((azimuth % 360) + 22.5) // 45) % 8]


def _finer(info: dict) -> list[int]:
    """The steps finer than the hour that ingestion wrote, minutes, finest last (``[15, 5]``)."""
    return sorted((m for m in info["steps"] if m < HOURLY_MINUTES), reverse=True)


def _files_at(steps: list[int]) -> str:
    return ", ".join(f"`{series_file('.', m / 60).name}`" for m in steps)


def _pv_lines(src: Sources, info: dict) -> list[str]:
    """The PV paragraphs of the README: the model of an hour, and how each finer step's values are made (by the
    weather's format: an EPW typical year, the clear-sky model, or measured output)."""
    w = src.weather
    if w.format == "epw":
        head, steps, tail = _pv_epw_lines(src, info)
    elif w.format == "clear-sky":
        head, steps, tail = _pv_clear_sky_lines(src, info)
    else:
        return _pv_measured_lines(src, info)
    return head + [""] + [f"{i}. {s}" for i, s in enumerate(steps, 1)] + [""] + tail


def _pv_chain(p) -> list[str]:
    """The PVWatts chain's steps of the README, from plane of array to AC (``ALBEDO`` and ``TEMPERATURE`` stand for
    the weather's own), for the PV parameters ``p`` (:class:`pipeline.data.sources.PVParams`)."""
    return [
        f"Plane of array: `pvlib.irradiance.get_total_irradiance`, tilt {p.surface_tilt:g} deg, azimuth"
        f" {p.surface_azimuth:g} deg ({_compass(p.surface_azimuth)}), sky diffuse model `{p.transposition}`, ALBEDO, no"
        " incidence-angle modifier.",
        f"Cell temperature: `pvlib.temperature.sapm_cell`, SAPM `{p.temperature_model}`, TEMPERATURE.",
        f"DC: `pvlib.pvsystem.pvwatts_dc`, pdc0 = 1 kW, gamma_pdc = {p.gamma_pdc}/K; DC losses"
        f" {p.losses_pct:.2f}% (`pvlib.pvsystem.pvwatts_losses()` defaults: soiling, shading, mismatch,"
        " wiring, connections, LID, nameplate, availability)."
        if p.system_losses_pct is None
        else (
            f"DC: `pvlib.pvsystem.pvwatts_dc`, pdc0 = 1 kW, gamma_pdc = {p.gamma_pdc}/K; DC losses {p.losses_pct:.2f}%."
        ),
        f"AC: `pvlib.inverter.pvwatts`, eta_inv_nom = {p.eta_inv_nom}, DC/AC ratio {p.dc_ac_ratio:g} (inverter pdc0 ="
        f" {1 / p.dc_ac_ratio:.4f} kW per kWp, so AC output is capped at {p.eta_inv_nom / p.dc_ac_ratio:.3f}"
        " kW/kWp), floored at 0.",
    ]


def _pv_epw_lines(src: Sources, info: dict) -> tuple[list[str], list[str], list[str]]:
    """``(head, steps, tail)`` of the PV paragraphs for an EPW typical year: the file, the chain, the calendar, the
    steps within the hour, and the annual yield."""
    import pvlib

    p, pv = src.pv, info["pv"]
    finer = _finer(info)
    meta = pv["metadata"]
    lo, hi = pv["albedo_range"]
    steps = [
        f"`pvlib.iotools.read_epw` on `{pv['file']}`. EPW records are hour-ending local standard time of the"
        f" file's header ({_utc_offset(meta['TZ'])}, no DST); read_epw labels each with its hour start. Solar"
        " position (`pvlib.solarposition.get_solarposition`, the header's latitude, longitude and altitude, the"
        " hour's pressure and temperature) at the middle of the hour.",
        *_pv_chain(p),
        f"Calendar: each UTC hour is converted to the file's local standard time ({_utc_offset(meta['TZ'])},"
        " fixed offset, never DST) and takes the value with the same (month, day, hour); Feb 29 takes Feb 28's"
        " values. The same typical year therefore repeats every calendar year: PV is not the weather of the"
        " calendar years of the period.",
    ]
    if finer:
        per = "; ".join(
            f"{m} minutes: {info['steps'][m]['pv']['hours_equal_shares']:,} hour(s) of the period with equal"
            f" shares, {info['steps'][m]['pv']['hours_capped']:,} capped, peak"
            f" {info['steps'][m]['pv']['step_peak_kw_per_kwp']:.3f} kW/kWp"
            for m in finer
        )
        steps.append(
            f"Steps within the hour ({_files_at(finer)}): the weather file is hourly, so each hour is modelled as"
            " above, then split into its steps in proportion to the clear-sky GHI at each step's middle"
            f" (`pvlib.location.Location({meta['latitude']}, {meta['longitude']}, altitude={meta['altitude']:g})"
            '.get_clearsky(times, model="haurwitz")`, the header\'s location; solar position at the middle of the'
            " interval, as pvlib advises for interval-averaged data). An hour whose step middles all have the sun"
            " below the horizon gets equal shares; a step's share above the AC limit"
            f" ({p.eta_inv_nom / p.dc_ac_ratio:.3f} kW/kWp) is cut to it and the rest goes to the hour's other"
            " steps in proportion to their clear-sky GHI (a clipped hour is clipped all through). The mean of an"
            " hour's steps is therefore the hourly value exactly (up to float rounding): the steps add the sun's"
            f" course within the hour, not the weather's. At {per}."
        )
    steps = [
        s.replace("ALBEDO", f"ground albedo from the EPW ({lo:.2f}..{hi:.2f})").replace(
            "TEMPERATURE", "EPW air temperature and wind speed"
        )
        for s in steps
    ]
    head = [
        f"PV (pvlib {pvlib.__version__} PVWatts chain, per kWp DC), from the typical year of the weather file"
        f" (WMO {meta.get('WMO_code', '?')}, {meta.get('city', '?')}, {meta.get('data_type', '')}, lat"
        f" {meta['latitude']}, lon {meta['longitude']}, {meta['altitude']:.0f} m, {_utc_offset(meta['TZ'])}):",
    ]
    tail = [
        f"Annual yield of the typical year: **{pv['annual_kwh_per_kwp']:.0f} kWh AC per kWp** (plane-of-array"
        f" irradiation {pv['annual_poa_kwh_per_m2']:.0f} kWh/m2, GHI {pv['annual_ghi_kwh_per_m2']:.0f} kWh/m2;"
        f" DC before the {p.losses_pct:.2f}% losses {pv['annual_dc_before_losses_kwh_per_kwp']:.0f}"
        " kWh/kWp)."
    ]
    return head, steps, tail


def _pv_clear_sky_lines(src: Sources, info: dict) -> tuple[list[str], list[str], list[str]]:
    """``(head, steps, tail)`` of the PV paragraphs for the clear-sky model: the sub-steps' clear sky, the chain, the
    steps' means, and the period's yield (an upper bound)."""
    import pvlib

    p, w, pv = src.pv, src.weather, info["pv"]
    c = src.config.pv
    lt = pv["linke_turbidity_range"]
    n = w.substeps_per_hour
    by_step = sorted(info["steps"], reverse=True)
    subs = ", ".join(f"{info['steps'][m]['pv']['substeps_per_step']} in a {m}-minute step" for m in by_step)
    aligned = all(n * m % 60 == 0 for m in by_step)
    steps = [
        f'`pvlib.location.Location({c.latitude}, {c.longitude}, tz="{src.config.timezone}", altitude='
        f"{pv['altitude']:g})` (`[pv]` latitude, longitude, altitude_m); every {60 / n:g}-minute sub-step (at its"
        " middle) gets solar position and Ineichen clear-sky GHI/DNI/DHI "
        '(`Location.get_clearsky(model="ineichen")`,'
        " Linke turbidity from `pvlib.clearsky.lookup_linke_turbidity`, pvlib's monthly climatology file "
        "`LinkeTurbidities.h5` (SoDa service, Remund et al. 2003), interpolated to the day: "
        f"{lt[0]:.2f}..{lt[1]:.2f} at this site).",
        *_pv_chain(p),
    ]
    steps = [
        s.replace("ALBEDO", f"albedo {w.albedo:g} (`[sources.weather] albedo`)").replace(
            "TEMPERATURE",
            f"constant air temperature {w.air_temp_c:g} C and wind {w.wind_speed_m_s:g} m/s"
            " (`[sources.weather]` air_temp_c, wind_speed_m_s: clear-sky data carry no weather)",
        )
        for s in steps
    ]
    steps[-1] = steps[-1].replace(
        "floored at 0.",
        f"floored at 0; then the mean of the step's sub-steps ({subs})."
        + (
            " The sub-steps are the same instants at every step, so the mean of an hour's steps is the hourly"
            " value (up to float rounding)."
            if aligned
            else f" The {n} sub-steps of an hour do not divide evenly into every step: the sub-steps of a step are"
            " spread evenly over it, so an hour's steps average to its hourly value only approximately."
        ),
    )
    head = [
        f"PV (pvlib {pvlib.__version__} clear-sky model through the PVWatts chain, per kWp DC; every day cloudless):"
    ]
    tail = [
        f"Clear-sky yield over the period: **{pv['annual_kwh_per_kwp']:,.0f} kWh AC per kWp** (clear-sky GHI "
        f"{pv['annual_ghi_kwh_per_m2']:,.0f} kWh/m2, plane of array {pv['annual_poa_kwh_per_m2']:,.0f} "
        "kWh/m2). Real years are cloudier: this is an upper bound of what the array can give."
    ]
    return head, steps, tail


def _pv_measured_lines(src: Sources, info: dict) -> list[str]:
    """The PV paragraph for measured output per kWp (``pv-csv``): its column, unit and resolution, sum and peaks."""
    w, pv = src.weather, info["pv"]
    return [
        f"PV: measured output per kWp (`[sources.weather]` format `pv-csv`, column `{w.value_column}`, unit"
        f" {w.unit}, timestamps {pv['resolution_min']:g} minutes apart), the mean of the values whose time falls"
        f" in the step. Sum over the period: {pv['annual_kwh_per_kwp']:,.0f} kWh/kWp; peak"
        f" {pv['peak_kw_per_kwp']:.3f} kW/kWp (hourly means)."
        + "".join(
            f" At {m} minutes: peak {info['steps'][m]['pv']['peak_kw_per_kwp']:.3f} kW/kWp." for m in _finer(info)
        )
    ]


def _carbon_lines(src: Sources, info: dict) -> tuple[list[str], list[str]]:
    """(column-table rows, paragraph) of the carbon columns, at each file's step."""
    c = src.carbon
    carbon = info["carbon"]
    if c.format == "constant":
        k = c.kg_per_kwh
        rows = [
            "| `moer_kg_per_kwh` | float32 | kg CO2/kWh "
            f"| constant grid factor {k:g} (`[sources.carbon] kg_per_kwh`) |",
            "| `moer_fc_h0`, `moer_fc_h1`, `moer_fc_h2` | float32 | kg CO2/kWh | the same constant (a constant is its"
            " own perfect forecast) |",
        ]
        para = [
            f"With a constant grid factor, CO2 is proportional to grid import ({k:g} kg per kWh imported): the only way"
            " to cut it is to import less, so the report's unserved energy must be read beside it."
        ]
        return rows, para
    unit = "" if c.unit == "kg/kWh" else f", converted from {c.unit}"
    rows = [
        f"| `moer_kg_per_kwh` | float32 | kg CO2/kWh | mean of the raw `{c.value_column}` values{unit} whose "
        f"`{c.time_column}` (UTC) falls in the step |"
    ]
    if carbon["forecast"] == "file":
        rows += [
            "| `moer_fc_h0` | float32 | kg CO2/kWh | forecast issued at the step start (the raw row whose time equals"
            " the step start): mean of `f1..f12`, i.e. the forecast for the hour from the step start (at 60 minutes:"
            " this hour) |",
            "| `moer_fc_h1` | float32 | kg CO2/kWh | same row: mean of `f13..f24`, the forecast for the next hour (60"
            " to 120 minutes after the step start) |",
            "| `moer_fc_h2` | float32 | kg CO2/kWh | same row: mean of `f25..f36`, the forecast for the hour after (120"
            " to 180 minutes) |",
            "| `moer_fc_5min_01` .. `_12` | float32 | kg CO2/kWh | same row: `f1` .. `f12`, the forecasts for the"
            " twelve 5-minute intervals of the hour from the step start |",
            f"| `moer_last_5min` | float32 | kg CO2/kWh | the raw `{c.value_column}` of the last row before the step"
            " start: the latest realised 5 minutes (`moer_fc_h0` where the files hold no earlier row) |",
            f"| `moer_last_15min` | float32 | kg CO2/kWh | mean raw `{c.value_column}` of the last three rows before"
            " the step start |",
        ]
    else:
        first = (
            "the hour before the period in the file"
            if not carbon["first_hour_own_value"]
            else "its own value: the file has nothing earlier"
        )
        rows += [
            "| `moer_fc_h0`, `moer_fc_h1`, `moer_fc_h2` | float32 | kg CO2/kWh | persistence (the file has no"
            " forecasts): at each step start, the mean of the raw values in the hour before it (the latest hour known"
            " then; at 60 minutes the previous hour's mean), for all three hours ahead; the first step of the period"
            f" takes {first} |"
        ]
    what = "WattTime MOER (marginal operating emissions rate)" if c.format == "watttime-moer" else "carbon intensity"
    steps = info["steps"]
    short = {m: v["carbon"] for m, v in steps.items() if v["carbon"]["steps_below_samples"]}
    samples = ", ".join(
        f"{steps[m]['carbon']['samples_per_step']} in a {m}-minute step" for m in sorted(steps, reverse=True)
    )
    para = (
        f"Carbon: {what} from `[sources.carbon]` format `{c.format}`; the files may overlap, repeated rows are"
        f" identical and kept once ({carbon['rows']:,} distinct rows, {carbon['resolution_min']:g} minutes apart). "
        + (
            f"Every step has all its samples ({samples}). "
            if not short
            else "; ".join(
                f"{v['steps_below_samples']:,} {m}-minute step(s) have fewer than {v['samples_per_step']} samples"
                for m, v in short.items()
            )
            + " (mean of those present). "
        )
    )
    if carbon["forecast"] == "file":
        earlier = {m: v["carbon"]["forecast_rows_from_earlier"] for m, v in steps.items()}
        para += (
            "Forecasts are issued at each step start, whatever the step, with leads in hours: at a 15-minute step"
            " the forecast of the step starting at 10:15 comes from the raw row of 10:15 and covers 10:15..11:15,"
            " 11:15..12:15 and 12:15..13:15. Where a step start has no raw row of its own, the forecast comes from the"
            " nearest earlier row: this happens "
            + (
                "for no step in this dataset."
                if not any(earlier.values())
                else ", ".join(f"for {n:,} {m}-minute step(s)" for m, n in earlier.items() if n) + "."
            )
        )
    return rows, [para.rstrip()]


def _session_lines(src: Sources, sessions: pd.DataFrame, info: dict) -> list[str]:
    s = src.sessions
    if s.format == "fleet":
        return _fleet_lines(src, sessions, info["stats"])
    cols = s.columns
    how = {"acn-csv": "ACN-Data CSV", "acn-json": "ACN-Data JSON (`_items`)", "csv": "CSV"}[s.format]
    tz_note = (
        (
            f"; times without a UTC offset are local times of {s.timezone} (a repeated local time when clocks go"
            " back is read as its first occurrence)"
        )
        if s.timezone
        else ""
    )
    unit = "" if s.energy_unit == "kWh" else f", converted from {s.energy_unit}"
    req = (
        f"raw `{cols['requested_energy_kwh']}`{unit}: what the driver asked for"
        if "requested_energy_kwh" in cols
        else "equal to `energy_kwh` (the source has no requested energy)"
    )
    sid = f"raw `{cols['session_id']}` (unique)" if "session_id" in cols else "`<file>:<row>` (the source has no id)"
    lines = [
        f"One row per charging session, {len(sessions):,} rows, sorted by arrival (then session id);"
        f" {sessions.station_id.nunique():,} stations. Source: {how}, `[sources.sessions]`{tz_note}.",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        f"| `session_id` | str | - | {sid} |",
        f"| `station_id` | str | - | raw `{cols['station_id']}` |",
        f"| `arrival` | datetime64[ns, UTC] | - | raw `{cols['arrival']}`, converted to UTC |",
        f"| `departure` | datetime64[ns, UTC] | - | raw `{cols['departure']}`, converted to UTC |",
        f"| `energy_kwh` | float32 | kWh | raw `{cols['energy_kwh']}`{unit}: energy actually delivered |",
        f"| `requested_energy_kwh` | float32 | kWh | {req} |",
        "",
    ]
    report = info["report"]
    filled = sum(r["requested_filled"] for r in report)
    drops = sum(r["read"] - r["kept"] for r in report)
    lines += [
        "Dropped: sessions with departure <= arrival, zero (or missing) delivered energy, an arrival outside the"
        f" period, or a repeated id ({drops:,} in all). Kept sessions arriving in no split are counted in the last"
        " column (they stay in the table, unused by the splits)."
        + (f" {filled:,} kept session(s) without a requested energy take their delivered energy." if filled else ""),
        "",
        "| raw file | read | departure <= arrival | zero energy | outside the period | repeated id | kept "
        "| in no split |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report:
        lines.append(
            f"| `{r['file']}` | {r['read']:,} | {r['dropped_departure_not_after_arrival']:,} |"
            f" {r['dropped_zero_energy']:,} | {r['dropped_outside_period']:,} | {r['dropped_duplicate_id']:,} |"
            f" {r['kept']:,} | {r['outside_splits']:,} |"
        )
    return lines


def _fleet_lines(src: Sources, sessions: pd.DataFrame, stats: dict) -> list[str]:
    s = src.sessions
    fl = s.fleets
    ids = ", ".join(f"`{f.station_ids()[0]}`..`{f.station_ids()[-1]}` ({f.kind})" for f in fl)
    lines = [
        f"One row per session, {len(sessions):,} rows, sorted by arrival (then socket id); columns of the sessions"
        " schema plus `kind`. **Generated**: drawn by `pipeline.data.synthetic.generate_sessions` from the fleet"
        f" parameters of `[[sources.sessions.fleet]]` (seed {s.seed}): synthetic, not measured.",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        f"| `session_id` | str | - | `{s.session_id_prefix}-000001`... in arrival order |",
        f"| `station_id` | str | - | socket id: {ids} |",
        "| `arrival` | datetime64[ns, UTC] | - | drawn local arrival (to the minute), converted to UTC |",
        "| `departure` | datetime64[ns, UTC] | - | arrival + drawn dwell (to the minute) |",
        "| `energy_kwh` | float32 | kWh | drawn energy need of the session (to the Wh) |",
        "| `requested_energy_kwh` | float32 | kWh | equal to `energy_kwh` |",
        f"| `kind` | str | - | {', '.join(f'`{f.kind}`' for f in fl)} |",
        "",
        "Fleet parameters (`[[sources.sessions.fleet]]` of the site TOML):",
        "",
        "| parameter | " + " | ".join(f.kind for f in fl) + " |",
        "| --- |" + " --- |" * len(fl),
    ]

    def mix(f):
        return "; ".join(f"{w:.0%} at {m:g} h (sd {sd:g} h)" for w, m, sd in f.arrival_mix)

    def energy(f):
        lo, hi = f.energy_kwh
        b = f"({f.energy_beta[0]:g}, {f.energy_beta[1]:g})"
        return (
            f"{f.battery_kwh:g} kWh x Beta{b} clipped to [{f.energy_frac[0]:g}, {f.energy_frac[1]:g}] = "
            f"{lo:.2f}..{hi:.2f} kWh"
        )

    for label, get in (
        ("sockets (ids)", lambda f: f"{f.n_sockets} (`{f.station_ids()[0]}`..`{f.station_ids()[-1]}`)"),
        ("sessions per socket per day (Poisson mean)", lambda f: f"{f.sessions_per_socket_day:g}"),
        ("arrival, local hour (mixture of normals, wrapped to 0..24 h)", mix),
        ("battery (usable), kWh", lambda f: f"{f.battery_kwh:g}"),
        ("energy per session", energy),
        (
            "dwell (log-normal)",
            lambda f: (
                f"median {f.dwell_median_h:g} h, log-sd {f.dwell_sigma:g}, clipped to"
                f" {f.dwell_h[0]:g}..{f.dwell_h[1]:g} h"
            ),
        ),
        ("turnaround on a socket", lambda f: f"{f.turnaround_h:g} h"),
    ):
        lines.append(f"| {label} | " + " | ".join(get(f) for f in fl) + " |")
    days = max(1, len(pd.date_range(*period(src.config), freq="D", inclusive="left")))
    lines += [
        "",
        "Per local day and kind the number of sessions is Poisson; each session goes to a random socket of its kind"
        " that is free one turnaround before its arrival, so no socket ever holds two sessions. A session that finds"
        " every socket of its kind busy is not generated (dropped below).",
        "",
        "| kind | drawn | dropped (no free socket) | kept | energy kWh | kWh per day |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k, v in stats.items():
        lines.append(
            f"| {k} | {v['drawn']:,} | {v['dropped']:,} | {v['kept']:,} | {v['energy_kwh']:,.0f} |"
            f" {v['energy_kwh'] / days:,.1f} |"
        )
    return lines


def _wrap(lines: list[str], width: int = 115) -> list[str]:
    """Wrap long prose lines (not table rows, headings or the TOML's own text) at ``width``; a numbered or bulleted
    item's continuation lines are indented under its text."""
    out = []
    for line in lines:
        if "\n" in line or len(line) <= width or line.startswith(("|", "#")):
            out.append(line)
            continue
        m = re.match(r"^(\d+\. |- )", line)
        indent = " " * len(m.group(1)) if m else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return out


def _minutes_list(series: dict) -> str:
    """``60, 15 or 5``: the steps of the series written, minutes, coarsest first."""
    m = [str(x) for x in sorted(series, reverse=True)]
    return m[0] if len(m) == 1 else ", ".join(m[:-1]) + f" or {m[-1]}"


def _series_lines(src: Sources, series: dict[int, pd.DataFrame], sessions: pd.DataFrame, info: dict) -> list[str]:
    """The README's table of the series files: the period, and each file's step, use, rows and columns."""
    cfg = src.config
    tz = cfg.timezone
    first, end = period(cfg)
    hourly = series[HOURLY_MINUTES]
    site = _site_minutes(src)
    months = _months_without_sessions(hourly, sessions, tz)
    offsets = {
        t.utcoffset()
        for t in pd.DatetimeIndex(hourly.time)
        .tz_convert(tz)[:: 24 * 7]
        .append(pd.DatetimeIndex(hourly.time).tz_convert(tz)[-1:])
    }
    dst = (
        "Local days with a DST change have 23 or 25 hours of steps."
        if len(offsets) > 1
        else f"{tz} keeps one UTC offset over the period (no daylight saving time)."
    )
    t0 = hourly.time.iloc[0]
    t_end = pd.Timestamp(end).tz_localize(tz).tz_convert("UTC")

    def use(m: int) -> str:
        if m == site:
            also = {HOURLY_MINUTES: ": the hourly study", PHYSICS_MINUTES: ", also the physics"}.get(m, "")
            return f"the site's step (`dt_h` = {cfg.dt_h:.6g} h){also}"
        if m == HOURLY_MINUTES:
            return "the hourly study (`dt_h` = 1)"
        return "the physics every controller is also scored on (5-minute simulation of the site)"

    def cols(m: int, df: pd.DataFrame) -> str:
        if list(df.columns) == list(PHYSICS_COLUMNS):
            return ", ".join(f"`{c}`" for c in PHYSICS_COLUMNS) + " (no forecast)"
        return f"all {len(df.columns)} below"

    names = _files_at(list(series))
    lines = [
        f"## Series: {names}",
        "",
        f"The site's time series at each step it is ingested at, one file per step, one row per UTC step from {t0}"
        f" ({first} 00:00 {tz}) to the step before {t_end} ({end} 00:00 {tz}): the site's period, from local midnight"
        " of the first split's first date to local midnight after the last split's last date. Continuous: no gap"
        + (f", also through the months without sessions ({months})." if months else ".")
        + f" {dst} zstd-compressed Parquet.",
        "",
        "| file | step | use | rows | last step start | columns |",
        "| --- | --- | --- | ---: | --- | --- |",
        *(
            f"| `{series_file('.', m / 60).name}` | {m} minutes | {use(m)} | {len(df):,} | {df.time.iloc[-1]} |"
            f" {cols(m, df)} |"
            for m, df in series.items()
        ),
        "",
    ]
    if info.get("no_physics"):
        lines += [
            f"No `{series_file('.', PHYSICS_MINUTES / 60).name}`: {info['no_physics']}.",
            "",
        ]
    return lines


def render_readme(src: Sources, series: dict[int, pd.DataFrame], sessions: pd.DataFrame, info: dict) -> str:
    """The provenance / attribution / column README of a site's processed data (Markdown, deterministic): every series
    file of ``series`` (minutes -> table, as :func:`build` gives them), the sessions and the splits."""
    cfg = src.config
    tz = cfg.timezone
    first, end = period(cfg)
    generated = src.sessions.format == "fleet"
    hourly = series[HOURLY_MINUTES]
    carbon_rows, carbon_para = _carbon_lines(src, info)
    lines = [
        f"# Processed data of the `{cfg.name}` site" + (" (synthetic EV sessions)" if generated else ""),
        "",
        f"Written by `python -m pipeline.data.ingest --site {_shown(src.toml)} --dt-h {cfg.dt_h:.6g}` from the sources"
        " named in the `[sources]` table of the site TOML; do not edit by hand. Rerunning it rewrites the same data.",
        "",
        "## Sources and attribution",
        "",
    ]
    if src.attribution.strip():
        lines += [src.attribution.strip(), ""]
    raw = src.raw_files()
    skipped = [(k, s) for k in ("sessions", "carbon") for s in info[k].get("skipped", [])]
    if raw:
        lines += [
            f'Raw files (relative to the raw folder, `[sources] root = "{src.root_text}"` beside the TOML, SHA-256):',
            "",
            "| file | bytes | sha256 |",
            "| --- | ---: | --- |",
        ]
        names = {s["file"] for _, s in skipped}
        for p in raw:
            rel = p.resolve().relative_to(src.root).as_posix() if p.resolve().is_relative_to(src.root) else p.name
            mark = " (skipped)" if rel in names else ""
            lines.append(f"| `{rel}`{mark} | {p.stat().st_size:,} | `{_sha256(p)[:16]}...` |")
        lines.append("")
    if skipped:
        lines += [
            f"Skipped: {len(skipped)} raw file(s) none of whose rows lies in the site's period {first}..{end} ({tz}),"
            " read but unused: "
            + "; ".join(
                f"`{s['file']}` (`[sources.{k}]`, {s['rows']:,} {'sessions' if k == 'sessions' else 'rows'},"
                f" {s['first']}..{s['last']})"
                for k, s in skipped
            )
            + ".",
            "",
        ]
    lines += _series_lines(src, series, sessions, info)
    lines += [
        f"Columns, at each file's step (a *step* is the file's {_minutes_list(series)} minutes; the forecasts' leads"
        " are hours at every step, issued at each step start):",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        "| `time` | datetime64[ns, UTC] | - | start of the step |",
        "| `pv_kw_per_kwp` | float32 | kW AC per kWp DC | mean AC output of 1 kWp of PV over the step (below) |",
        *carbon_rows,
        "",
        *carbon_para,
        "",
        *_pv_lines(src, info),
        "",
        "## `sessions.parquet`",
        "",
        *_session_lines(src, sessions, info["sessions"]),
        "",
    ]
    splits = split_summary(hourly, sessions, tz, {"train": cfg.splits.train, "test": cfg.splits.test})
    kinds = "kind" in sessions.columns
    lines += [
        f"## Splits of the site TOML (inclusive local dates, {tz})",
        "",
        "| split | dates | hours | sessions (by arrival) |"
        + (" by kind |" if kinds else "")
        + " energy kWh | PV kWh/kWp | mean carbon kg/kWh |",
        "| --- | --- | ---: | ---: |" + (" --- |" if kinds else "") + " ---: | ---: | ---: |",
    ]
    for s in splits:
        by_kind = (" " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_kind"].items())) + " |") if kinds else ""
        lines.append(
            f"| {s['split']} | {s['dates']} | {s['hours']:,} | {s['sessions']:,} |{by_kind} {s['energy_kwh']:,.0f} |"
            f" {s['pv_kwh_per_kwp']:,.0f} | {s['moer_mean']:.3f} |"
        )
    if src.notes.strip():
        lines += ["", src.notes.strip()]
    lines.append("")
    return "\n".join(_wrap(lines))


# ---------------------------------------------------------------------------------------------- write


def _unchanged_parquet(df: pd.DataFrame, path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        old = pd.read_parquet(path)
    except Exception:  # noqa: BLE001 - an unreadable file is rewritten
        return False
    return list(old.columns) == list(df.columns) and list(old.dtypes) == list(df.dtypes) and old.equals(df)


def status(site: str | Path, dt_h: float | None = None) -> tuple[str, str]:
    """Whether ingesting ``site`` (at ``dt_h``, None: its TOML's step) can run: ``(state, line)`` where ``state`` is
    ``"ready"`` (the raw sources are here, or every source is generated), ``"shipped"`` (none of the raw files is here
    but the processed data at that step are: they are used as is; ``line`` says so) or ``"missing"`` (neither;
    ``line`` says what is missing).

    Raises:
        SourceError: a malformed ``[sources]`` table, some raw files present and others not, or a ``dt_h`` that is
            not a whole-minute divisor of the hour.
    """
    src = load_sources(site, dt_h)
    state, why = src.availability()
    if state in ("none", "present"):
        return "ready", ""
    if state == "partial":
        src.raw_files()  # raises, naming the pattern that matches nothing
    data = [series_file(src.data_dir, src.config.dt_h), src.data_dir / "sessions.parquet"]
    if all(p.is_file() for p in data):
        return "shipped", (
            f"ingest: raw sources of {_shown(src.toml)} not found ({why}); the processed data in"
            f" {_shown(src.data_dir)}/ are used as they are"
        )
    return "missing", (
        f"{src.toml}: raw sources not found ({why}) and no processed data in {src.data_dir}"
        + (f" (no {data[0].name})" if data[1].is_file() else "")
        + ": get the raw files, or fix [sources] root / the file patterns"
    )


def task_plan(site: str | Path) -> dict:
    """What the doit task ``ingest`` of ``site`` needs, decided without reading any raw file's content.

    Returns:
        dict with ``state``: ``"ready"`` (sources present or generated: ingest), ``"shipped"`` (no raw file here,
        processed data present: nothing to do), ``"none"`` (the TOML has no ``[sources]``: its processed data are
        the inputs) or ``"error"`` (a bad ``[sources]`` table, some raw files missing, or neither raw sources nor
        processed data); ``line`` (what to print, or the error message); for ``"ready"``: ``file_dep`` (every raw
        file, globs expanded, and the ingestion code), ``targets`` (the processed files: :func:`outputs`, the
        5-minute series only where the source formats always give it) and ``settings`` (the parts of the TOML
        ingestion reads, for ``config_changed``).
    """
    from envs.config import load_config

    cfg, path = load_config(site)
    if not cfg.sources:
        return {
            "state": "none",
            "line": f"ingest: {_shown(path)} names no [sources]: its processed data are the inputs",
        }
    try:
        state, line = status(path)
        src = load_sources(path)
        raw = src.raw_files() if state == "ready" else []
    except SourceError as exc:
        return {"state": "error", "line": str(exc)}
    if state == "missing":
        return {"state": "error", "line": line}
    if state == "shipped":
        return {"state": "shipped", "line": line}
    return {
        "state": "ready",
        "line": f"ingest {_shown(path)}",
        "file_dep": [str(p) for p in raw] + depends.as_strings(depends.ingestion()),
        "targets": [str(src.data_dir / n) for n in outputs(src)],
        "settings": src.settings(),
    }


def ingest(site: str | Path, out_dir: str | Path | None = None, *, dt_h: float | None = None) -> dict:
    """Build, validate and write the series (at the site's step, at 60 minutes and the 5-minute physics series, each
    where the sources support its step), ``sessions.parquet`` and ``README.md`` of a site.

    Args:
        site: the name of a site shipped in ``envs/sites/`` or the path of a site TOML.
        out_dir: destination folder (default: the site's ``data_dir`` beside the TOML).
        dt_h: the site's step for this ingestion, hours, in place of its TOML's ``dt_h`` (None: the TOML's).

    Returns:
        A summary dict: ``skipped`` (True when the raw sources are absent and the shipped processed data are used
        as is: nothing else then), output ``paths`` (``series_<m>min`` of each series written, ``sessions``,
        ``readme``), ``written`` (the files rewritten; a file whose content would not change is kept), ``info``
        (per-file session ``report`` or generator ``stats``, the sources' diagnostics) and the ``splits`` summary.

    Prints one line per raw file skipped (none of its rows in the site's period), one where the sources give no
    5-minute physics series, and a summary.

    Raises:
        FileNotFoundError: neither the raw sources nor processed data are there.
        envs.site.ConfigError: the site TOML is malformed (file and key named).
        SourceError: bad ``[sources]``, a raw file that cannot be read (cut short, or not what ``format`` says),
            bad raw data (the message names file, column and row, or TOML and key), a split that no file of a
            source covers (the source, the split and what each file covers named), a ``dt_h`` that is not a
            whole-minute divisor of the hour, or a step finer than a source gives (the TOML, the key ``dt_h``, the
            source and its resolution named).
        envs.schemas.DataValidationError: the built tables break the schemas.
        Nothing is written when anything is raised.
    """
    src = load_sources(site, dt_h)
    state, line = status(src.toml, dt_h)
    if state == "shipped" and out_dir is None:
        print(line, flush=True)
        return {"skipped": True, "paths": {}, "written": []}
    if state == "shipped":
        raise FileNotFoundError(
            f"{src.toml}: raw sources not found ({src.availability()[1]}): nothing to build into {out_dir}"
        )
    if state == "missing":
        raise FileNotFoundError(line)
    out = Path(out_dir) if out_dir is not None else src.data_dir
    first, end = period(src.config)
    print(
        f"ingest {_shown(src.toml)}: period {first}..{end} ({src.config.timezone}) at"
        f" {timestep.step_minutes(src.config.dt_h)}-minute steps into {_shown(out)}/",
        flush=True,
    )
    series, sessions, info = build(src)
    paths = {f"series_{m}min": series_file(out, m / 60) for m in series}
    paths.update({"sessions": out / "sessions.parquet", "readme": out / "README.md"})
    site_key = f"series_{_site_minutes(src)}min"
    validate_site_data(
        series[_site_minutes(src)],
        sessions,
        {"series": str(paths[site_key]), "sessions": str(paths["sessions"])},
        _site_minutes(src),
    )
    for m, df in series.items():
        if m != _site_minutes(src):
            kind = "physics" if list(df.columns) == list(PHYSICS_COLUMNS) else "series"
            validate_table(kind, df, str(paths[f"series_{m}min"]), m)
    readme = render_readme(src, series, sessions, info)
    written = []
    tables = [(f"series_{m}min", df) for m, df in series.items()] + [("sessions", sessions)]
    for key, df in tables:
        if not _unchanged_parquet(df, paths[key]):
            files.write_parquet(df, paths[key], compression="zstd", split_floats=True)
            written.append(paths[key])
    if not paths["readme"].is_file() or paths["readme"].read_text(encoding="utf-8") != readme:
        files.write_text(paths["readme"], readme)
        written.append(paths["readme"])
    splits = split_summary(
        series[HOURLY_MINUTES],
        sessions,
        src.config.timezone,
        {"train": src.config.splits.train, "test": src.config.splits.test},
    )
    _print_summary(series, sessions, info, splits, paths, written)
    return {
        "skipped": False,
        "paths": paths,
        "written": written,
        "info": info,
        "splits": splits,
    }


def _print_summary(series, sessions, info, splits, paths, written) -> None:
    pv = info["pv"]
    if "annual_kwh_per_kwp" in pv:
        print(
            f"PV: {pv['format']}, {pv['annual_kwh_per_kwp']:,.0f} kWh/kWp over a year of the model; peak "
            f"{pv['peak_kw_per_kwp']:.3f} kW/kWp"
        )
    c = info["carbon"]
    print(f"carbon: {c['format']}, forecasts: {c['forecast']}" + (f", {c['rows']:,} raw rows" if "rows" in c else ""))
    for r in info["sessions"].get("report", []):
        print(
            f"  {r['file']}: read {r['read']:,}, dropped {r['dropped_departure_not_after_arrival']} (departure <= "
            f"arrival), {r['dropped_zero_energy']} (zero energy), {r['dropped_outside_period']} (outside the period), "
            f"{r['dropped_duplicate_id']} (repeated id); kept {r['kept']:,}, of which {r['outside_splits']:,} in no "
            "split"
        )
    for k, v in info["sessions"].get("stats", {}).items():
        print(f"  {k}: drawn {v['drawn']:,}, dropped {v['dropped']:,} (no free socket), kept {v['kept']:,}")
    for m, df in series.items():
        print(
            f"series at {m} minutes: {len(df):,} rows {df.time.iloc[0]} .. {df.time.iloc[-1]}, {len(df.columns)}"
            " columns"
        )
    print(f"sessions: {len(sessions):,}")
    for s in splits:
        print(
            f"  split {s['split']} {s['dates']}: {s['hours']:,} h, {s['sessions']:,} sessions, {s['energy_kwh']:,.0f} "
            f"kWh, PV {s['pv_kwh_per_kwp']:,.0f} kWh/kWp, mean carbon {s['moer_mean']:.3f} kg/kWh"
        )
    for p in paths.values():
        print(f"{'wrote' if p in written else 'unchanged'} {p} ({p.stat().st_size:,} bytes)")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m pipeline.data.ingest --site SITE [--dt-h HOURS] [--out-dir DIR]``.

    Returns the exit status: 0, or 1 after an expected error (:func:`envs.errors.is_expected`: a bad site TOML,
    ``[sources]`` or raw file, data that break the schemas, missing files), whose message alone goes to stderr.
    Any other exception propagates with its traceback.
    """
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.data.ingest",
        description="Build a site's processed data (series_<m>min.parquet at the site's step, series_60min.parquet, "
        "the 5-minute physics series series_5min.parquet, sessions.parquet, README.md) from the raw sources its TOML "
        "names in [sources] (EV sessions, grid carbon, weather or a location); see pipeline/data/sources.py for the "
        "format. Everything is checked before anything is written.",
        epilog="Examples: python -m pipeline.data.ingest --site my_site.toml; python -m pipeline.data.ingest --site "
        "my_site.toml --dt-h 0.25 --out-dir /tmp/check. Without the raw files of a shipped site, its shipped processed "
        "data are used as they are (one line says so).",
    )
    shipped = ", ".join(sorted(p.stem for p in SITES_DIR.glob("*.toml")))
    ap.add_argument("--site", required=True, help=f"the path of a site TOML, or the name of a shipped site ({shipped})")
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="output folder (default: the site's data_dir beside its TOML)"
    )
    ap.add_argument(
        "--dt-h",
        type=float,
        default=None,
        help="the site's step for this ingestion, hours, in place of the TOML's dt_h (a whole-minute divisor of the "
        "hour: 1, 0.5, 0.25, 0.0833333 for 5 minutes, ...); the series at 60 and 5 minutes are written too",
    )
    a = ap.parse_args(argv)
    return exit_code(lambda: ingest(a.site, a.out_dir, dt_h=a.dt_h))


if __name__ == "__main__":
    raise SystemExit(main())
