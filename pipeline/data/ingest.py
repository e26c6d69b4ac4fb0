"""Ingest a site's raw sources (its TOML's ``[sources]``, see :mod:`pipeline.data.sources`) into its processed data.

``python -m pipeline.data.ingest --site path/to/site.toml`` (or the name of a site shipped in ``envs/sites/``) reads the
sources the TOML names, builds the two tables, checks them with :func:`envs.schemas.validate_site_data` and
writes, atomically (:mod:`envs.files`), into the site's ``data_dir`` beside the TOML (or ``--out-dir``):

- ``hourly.parquet``: one row per UTC hour of the site's period (:func:`pipeline.data.sources.period`: local
  midnight of the first split's first date to local midnight after the last split's last date, in the site
  ``timezone``; continuous, DST days have 23 or 25 rows): ``time`` (datetime64[ns, UTC], hour start),
  ``pv_kw_per_kwp`` (float32, kW AC per kWp DC, hour mean), ``moer_kg_per_kwh`` (float32, kg CO2/kWh, hour
  mean), ``moer_fc_h0``/``h1``/``h2`` (float32, kg CO2/kWh, the forecasts issued at the hour start for the
  hour itself / the next / the one after), and from 5-minute carbon files with forecasts
  :data:`envs.schemas.MOER_5MIN_COLUMNS` (float32, kg CO2/kWh).
- ``sessions.parquet``: one row per EV session, sorted by arrival: ``session_id``, ``station_id`` (str),
  ``arrival``, ``departure`` (datetime64[ns, UTC]), ``energy_kwh`` (float32, kWh delivered),
  ``requested_energy_kwh`` (float32, kWh asked for) [, ``kind`` (str) for generated sessions].
- ``README.md``: provenance (the TOML's ``[sources] attribution``, each raw file's SHA-256), the derivation
  of every column, the per-file session counts and a summary per split.

Every check runs before anything is written: bad input raises :class:`pipeline.data.sources.SourceError` (or
:class:`envs.schemas.DataValidationError`) naming the file, the column and the row, and leaves the previous
files in place. A file whose content would not change is not rewritten. On the command line such an error (any
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

from envs import files
from envs.config import SITES_DIR
from envs.errors import exit_code
from envs.schemas import validate_site_data
from pipeline import depends
from pipeline.data.pv import read_pv
from pipeline.data.readers import read_carbon, read_sessions
from pipeline.data.sources import SourceError, Sources, load_sources, period, period_index
from pipeline.paths import shown_path

OUTPUTS = ("hourly.parquet", "sessions.parquet", "README.md")
"""What ingestion writes into a site's data folder."""


# ---------------------------------------------------------------------------------------------- build


def build(src: Sources) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Build the hourly and the sessions table of a site from its sources (nothing is written).

    Returns:
        ``(hourly, sessions, info)``: the tables described in the module docstring (RangeIndex) and the
        diagnostics of each source (``pv``, ``carbon``, ``sessions``).

    Prints one line per raw file skipped because none of its rows lies in the site's period.

    Raises:
        SourceError: see :func:`pipeline.data.pv.read_pv`, :func:`~pipeline.data.readers.read_carbon` and
            :func:`~pipeline.data.readers.read_sessions`.
    """
    index = period_index(src.config)
    sessions, session_info = read_sessions(src, log=_say)  # cheapest first: a bad file stops before the PV model runs
    carbon, carbon_info = read_carbon(src, index, log=_say)
    pv, pv_info = read_pv(src, index)
    hourly = pd.DataFrame({"time": index, "pv_kw_per_kwp": pv.astype(np.float32)})
    for c in carbon.columns:
        hourly[c] = carbon[c].to_numpy().astype(np.float32)
    hourly = hourly.reset_index(drop=True)
    return hourly, sessions, {"pv": pv_info, "carbon": carbon_info, "sessions": session_info}


def _say(line: str) -> None:
    print(line, flush=True)


def split_summary(
    hourly: pd.DataFrame, sessions: pd.DataFrame, tz: str, splits: dict[str, tuple[str, str]]
) -> list[dict]:
    """Hours, sessions, energy (kWh), PV (kWh/kWp) and mean carbon intensity (kg/kWh) of each split.

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


def _pv_lines(src: Sources, info: dict) -> list[str]:
    import pvlib

    p, w = src.pv, src.weather
    chain = [
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
    if w.format == "epw":
        meta = info["metadata"]
        lo, hi = info["albedo_range"]
        steps = [
            f"`pvlib.iotools.read_epw` on `{info['file']}`. EPW records are hour-ending local standard time of the"
            f" file's header ({_utc_offset(meta['TZ'])}, no DST); read_epw labels each with its hour start. Solar"
            " position (`pvlib.solarposition.get_solarposition`, the header's latitude, longitude and altitude, the"
            " hour's pressure and temperature) at the middle of the hour.",
            *chain,
            f"Calendar: each UTC hour is converted to the file's local standard time ({_utc_offset(meta['TZ'])},"
            " fixed offset, never DST) and takes the value with the same (month, day, hour); Feb 29 takes Feb 28's"
            " values. The same typical year therefore repeats every calendar year: PV is not the weather of the"
            " calendar years of the period.",
        ]
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
            f"Annual yield of the typical year: **{info['annual_kwh_per_kwp']:.0f} kWh AC per kWp** (plane-of-array"
            f" irradiation {info['annual_poa_kwh_per_m2']:.0f} kWh/m2, GHI {info['annual_ghi_kwh_per_m2']:.0f} kWh/m2;"
            f" DC before the {p.losses_pct:.2f}% losses {info['annual_dc_before_losses_kwh_per_kwp']:.0f}"
            " kWh/kWp)."
        ]
    elif w.format == "clear-sky":
        c = src.config.pv
        lt = info["linke_turbidity_range"]
        n = w.substeps_per_hour
        steps = [
            f'`pvlib.location.Location({c.latitude}, {c.longitude}, tz="{src.config.timezone}", altitude='
            f"{info['altitude']:g})` (`[pv]` latitude, longitude, altitude_m); every {60 / n:g}-minute sub-step (at its"
            " middle) gets solar position and Ineichen clear-sky GHI/DNI/DHI "
            '(`Location.get_clearsky(model="ineichen")`,'
            " Linke turbidity from `pvlib.clearsky.lookup_linke_turbidity`, pvlib's monthly climatology file "
            "`LinkeTurbidities.h5` (SoDa service, Remund et al. 2003), interpolated to the day: "
            f"{lt[0]:.2f}..{lt[1]:.2f} at this site).",
            *chain,
        ]
        steps = [
            s.replace("ALBEDO", f"albedo {w.albedo:g} (`[sources.weather] albedo`)").replace(
                "TEMPERATURE",
                f"constant air temperature {w.air_temp_c:g} C and wind {w.wind_speed_m_s:g} m/s"
                " (`[sources.weather]` air_temp_c, wind_speed_m_s: clear-sky data carry no weather)",
            )
            for s in steps
        ]
        steps[-1] = steps[-1].replace("floored at 0.", f"floored at 0; then the mean of the hour's {n} sub-steps.")
        head = [
            f"PV (pvlib {pvlib.__version__} clear-sky model through the PVWatts chain, per kWp DC; every day "
            "cloudless):"
        ]
        tail = [
            f"Clear-sky yield over the period: **{info['annual_kwh_per_kwp']:,.0f} kWh AC per kWp** (clear-sky GHI "
            f"{info['annual_ghi_kwh_per_m2']:,.0f} kWh/m2, plane of array {info['annual_poa_kwh_per_m2']:,.0f} "
            "kWh/m2). Real years are cloudier: this is an upper bound of what the array can give."
        ]
    else:
        return [
            f"PV: measured output per kWp (`[sources.weather]` format `pv-csv`, column `{w.value_column}`, unit"
            f" {w.unit}), the mean of the values whose time falls in the hour. Sum over the period:"
            f" {info['annual_kwh_per_kwp']:,.0f} kWh/kWp; peak {info['peak_kw_per_kwp']:.3f} kW/kWp."
        ]
    return head + [""] + [f"{i}. {s}" for i, s in enumerate(steps, 1)] + [""] + tail


def _carbon_lines(src: Sources, info: dict) -> tuple[list[str], list[str]]:
    """(column-table rows, paragraph) of the carbon columns."""
    c = src.carbon
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
        f"`{c.time_column}` (UTC) falls in the hour |"
    ]
    if info["forecast"] == "file":
        rows += [
            "| `moer_fc_h0` | float32 | kg CO2/kWh | forecast issued at the hour start (the raw row whose time equals"
            " the hour start): mean of `f1..f12`, i.e. the forecast for this hour |",
            "| `moer_fc_h1` | float32 | kg CO2/kWh | same row: mean of `f13..f24`, the forecast for the next hour |",
            "| `moer_fc_h2` | float32 | kg CO2/kWh | same row: mean of `f25..f36`, the forecast for the hour after |",
            "| `moer_fc_5min_01` .. `_12` | float32 | kg CO2/kWh | same row: `f1` .. `f12`, the forecasts for the"
            " hour's twelve 5-minute intervals |",
            f"| `moer_last_5min` | float32 | kg CO2/kWh | the raw `{c.value_column}` of the last row before the hour"
            " start: the latest realised 5 minutes (`moer_fc_h0` where the files hold no earlier row) |",
            f"| `moer_last_15min` | float32 | kg CO2/kWh | mean raw `{c.value_column}` of the last three rows before"
            " the hour start |",
        ]
    else:
        first = (
            "the hour before the period in the file"
            if not info["first_hour_own_value"]
            else "its own value: the file has nothing earlier"
        )
        rows += [
            "| `moer_fc_h0`, `moer_fc_h1`, `moer_fc_h2` | float32 | kg CO2/kWh | persistence (the file has no"
            " forecasts): at each hour start, the mean of the previous hour, the latest hour known then, for all"
            f" three hours ahead; the first hour of the period takes {first} |"
        ]
    what = "WattTime MOER (marginal operating emissions rate)" if c.format == "watttime-moer" else "carbon intensity"
    para = [
        f"Carbon: {what} from `[sources.carbon]` format `{c.format}`; the files may overlap, repeated rows are"
        f" identical and kept once ({info['rows']:,} distinct rows). "
        + (
            "Every hour has at least 12 samples. "
            if info["hours_below_12_samples"] == 0
            else f"{info['hours_below_12_samples']:,} hour(s) have fewer than 12 samples (mean of those present). "
        )
        + (
            "Where an hour start has no raw row of its own, the forecast comes from the nearest earlier row: "
            + (
                "this happens for no hour in this dataset."
                if info["forecast_rows_from_earlier"] == 0
                else f"this happens for {info['forecast_rows_from_earlier']:,} hour(s)."
            )
            if info["forecast"] == "file"
            else ""
        )
    ]
    return rows, [para[0].rstrip()]


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


def render_readme(src: Sources, hourly: pd.DataFrame, sessions: pd.DataFrame, info: dict) -> str:
    """The provenance / attribution / column README of a site's processed data (Markdown, deterministic)."""
    cfg = src.config
    tz = cfg.timezone
    first, end = period(cfg)
    generated = src.sessions.format == "fleet"
    t0, t1 = hourly.time.iloc[0], hourly.time.iloc[-1]
    lines = [
        f"# Processed data of the `{cfg.name}` site" + (" (synthetic EV sessions)" if generated else ""),
        "",
        f"Written by `python -m pipeline.data.ingest --site {_shown(src.toml)}` from the sources named in the "
        "`[sources]` table of the site TOML; do not edit by hand. Rerunning it rewrites the same data.",
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
    months = _months_without_sessions(hourly, sessions, tz)
    offsets = {
        t.utcoffset()
        for t in pd.DatetimeIndex(hourly.time)
        .tz_convert(tz)[:: 24 * 7]
        .append(pd.DatetimeIndex(hourly.time).tz_convert(tz)[-1:])
    }
    dst = (
        "Local days with a DST change have 23 or 25 rows."
        if len(offsets) > 1
        else f"{tz} keeps one UTC offset over the period (no daylight saving time)."
    )
    carbon_rows, carbon_para = _carbon_lines(src, info["carbon"])
    lines += [
        "## `hourly.parquet`",
        "",
        f"One row per UTC hour, {len(hourly):,} rows, from {t0} ({first} 00:00 {tz}) to {t1} inclusive (the hour"
        f" before {end} 00:00 {tz}): the site's period, from local midnight of the first split's first date to local"
        " midnight after the last split's last date. Continuous: no gap"
        + (f", also through the months without sessions ({months})." if months else ".")
        + f" {dst} zstd-compressed Parquet.",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        "| `time` | datetime64[ns, UTC] | - | start of the hour |",
        "| `pv_kw_per_kwp` | float32 | kW AC per kWp DC | mean AC output of 1 kWp of PV over the hour (below) |",
        *carbon_rows,
        "",
        *carbon_para,
        "",
        *_pv_lines(src, info["pv"]),
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


def status(site: str | Path) -> tuple[str, str]:
    """Whether ingesting ``site`` can run: ``(state, line)`` where ``state`` is ``"ready"`` (the raw sources are
    here, or every source is generated), ``"shipped"`` (none of the raw files is here but the processed data are:
    they are used as is; ``line`` says so) or ``"missing"`` (neither; ``line`` says what is missing).

    Raises:
        SourceError: a malformed ``[sources]`` table, or some raw files present and others not.
    """
    src = load_sources(site)
    state, why = src.availability()
    if state in ("none", "present"):
        return "ready", ""
    if state == "partial":
        src.raw_files()  # raises, naming the pattern that matches nothing
    data = [src.data_dir / n for n in OUTPUTS[:2]]
    if all(p.is_file() for p in data):
        return "shipped", (
            f"ingest: raw sources of {_shown(src.toml)} not found ({why}); the processed data in"
            f" {_shown(src.data_dir)}/ are used as they are"
        )
    return "missing", (
        f"{src.toml}: raw sources not found ({why}) and no processed data in {src.data_dir}: get the raw files, or"
        " fix [sources] root / the file patterns"
    )


def task_plan(site: str | Path) -> dict:
    """What the doit task ``ingest`` of ``site`` needs, decided without reading any raw file's content.

    Returns:
        dict with ``state``: ``"ready"`` (sources present or generated: ingest), ``"shipped"`` (no raw file here,
        processed data present: nothing to do), ``"none"`` (the TOML has no ``[sources]``: its processed data are
        the inputs) or ``"error"`` (a bad ``[sources]`` table, some raw files missing, or neither raw sources nor
        processed data); ``line`` (what to print, or the error message); for ``"ready"``: ``file_dep`` (every raw
        file, globs expanded, and the ingestion code), ``targets`` (the processed files) and ``settings`` (the
        parts of the TOML ingestion reads, for ``config_changed``).
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
        "targets": [str(src.data_dir / n) for n in OUTPUTS],
        "settings": src.settings(),
    }


def ingest(site: str | Path, out_dir: str | Path | None = None) -> dict:
    """Build, validate and write ``hourly.parquet``, ``sessions.parquet`` and ``README.md`` of a site.

    Args:
        site: the name of a site shipped in ``envs/sites/`` or the path of a site TOML.
        out_dir: destination folder (default: the site's ``data_dir`` beside the TOML).

    Returns:
        A summary dict: ``skipped`` (True when the raw sources are absent and the shipped processed data are used
        as is: nothing else then), output ``paths``, ``written`` (the files rewritten; a file whose content
        would not change is kept), per-file session ``report`` or generator ``stats``, and the ``splits`` summary.

    Prints one line per raw file skipped (none of its rows in the site's period) and a summary.

    Raises:
        FileNotFoundError: neither the raw sources nor processed data are there.
        envs.site.ConfigError: the site TOML is malformed (file and key named).
        SourceError: bad ``[sources]``, a raw file that cannot be read (cut short, or not what ``format`` says),
            bad raw data (the message names file, column and row, or TOML and key), or a split that no file of a
            source covers (the source, the split and what each file covers named).
        envs.schemas.DataValidationError: the built tables break the schemas.
        Nothing is written when anything is raised.
    """
    src = load_sources(site)
    state, line = status(src.toml)
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
    print(f"ingest {_shown(src.toml)}: period {first}..{end} ({src.config.timezone}) into {_shown(out)}/", flush=True)
    hourly, sessions, info = build(src)
    paths = {"hourly": out / OUTPUTS[0], "sessions": out / OUTPUTS[1], "readme": out / OUTPUTS[2]}
    validate_site_data(hourly, sessions, {k: str(v) for k, v in paths.items()})
    readme = render_readme(src, hourly, sessions, info)
    written = []
    for key, df in (("hourly", hourly), ("sessions", sessions)):
        if not _unchanged_parquet(df, paths[key]):
            files.write_parquet(df, paths[key], compression="zstd")
            written.append(paths[key])
    if not paths["readme"].is_file() or paths["readme"].read_text(encoding="utf-8") != readme:
        files.write_text(paths["readme"], readme)
        written.append(paths["readme"])
    splits = split_summary(
        hourly, sessions, src.config.timezone, {"train": src.config.splits.train, "test": src.config.splits.test}
    )
    _print_summary(hourly, sessions, info, splits, paths, written)
    return {
        "skipped": False,
        "paths": paths,
        "written": written,
        "info": info,
        "splits": splits,
    }


def _print_summary(hourly, sessions, info, splits, paths, written) -> None:
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
    print(f"hourly: {len(hourly):,} rows {hourly.time.iloc[0]} .. {hourly.time.iloc[-1]}; sessions: {len(sessions):,}")
    for s in splits:
        print(
            f"  split {s['split']} {s['dates']}: {s['hours']:,} h, {s['sessions']:,} sessions, {s['energy_kwh']:,.0f} "
            f"kWh, PV {s['pv_kwh_per_kwp']:,.0f} kWh/kWp, mean carbon {s['moer_mean']:.3f} kg/kWh"
        )
    for p in paths.values():
        print(f"{'wrote' if p in written else 'unchanged'} {p} ({p.stat().st_size:,} bytes)")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m pipeline.data.ingest --site SITE [--out-dir DIR]``.

    Returns the exit status: 0, or 1 after an expected error (:func:`envs.errors.is_expected`: a bad site TOML,
    ``[sources]`` or raw file, data that break the schemas, missing files), whose message alone goes to stderr.
    Any other exception propagates with its traceback.
    """
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.data.ingest",
        description="Build a site's processed data (hourly.parquet, sessions.parquet, README.md) from the raw "
        "sources its TOML names in [sources] (EV sessions, grid carbon, weather or a location); see "
        "pipeline/data/sources.py for the format. Everything is checked before anything is written.",
        epilog="Examples: python -m pipeline.data.ingest --site my_site.toml; python -m pipeline.data.ingest --site "
        "my_site.toml --out-dir /tmp/check. Without the raw files of a shipped site, its shipped processed data are "
        "used as they are (one line says so).",
    )
    shipped = ", ".join(sorted(p.stem for p in SITES_DIR.glob("*.toml")))
    ap.add_argument("--site", required=True, help=f"the path of a site TOML, or the name of a shipped site ({shipped})")
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="output folder (default: the site's data_dir beside its TOML)"
    )
    a = ap.parse_args(argv)
    return exit_code(lambda: ingest(a.site, a.out_dir))


if __name__ == "__main__":
    raise SystemExit(main())
