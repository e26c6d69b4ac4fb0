"""The live state: the time, the battery's SOC, the plugged EVs and the history realised before it (:class:`LiveState`),
rebuilt from a site's own data (:func:`state_at`) or read from and written to its files (:data:`STATE_SCHEMA`,
:func:`read_state`, :func:`write_state`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from envs import timestep
from envs.errors import InputError
from envs.files import write_parquet, write_text
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site, load_site
from pipeline.paths import shown_path

FORECAST_COLUMNS = ("moer_fc_h0", "moer_fc_h1", "moer_fc_h2")
"""The columns of the MOER forecast issued at each step's start (kg/kWh for the hour from it, the next hour and the one
after: leads in hours at every step)."""
SESSION_COLUMNS = ("session_id", "station_id", "arrival", "departure", "energy_kwh")
"""The sessions columns a history needs (``sessions.parquet``'s, ``requested_energy_kwh`` optional)."""
MAX_FORECAST_AGE_H = 1.0
"""A MOER forecast issued more than this many hours before the state's time is stale (a step at hourly steps, four at
15 minutes): the forecast covers three hours (:data:`FORECAST_COLUMNS`), so moved on by an hour it still covers two,
and a grid-carbon service down for an hour is planned through on its last forecast
(:func:`pipeline.live.sources.fill_late`)."""


class LiveError(InputError):
    """A bad live state or request: the message names the field and its value."""


# ------------------------------------------------------------------------------------------------ the state
@dataclass(frozen=True)
class PluggedEV:
    """One car plugged in at the state's time.

    Attributes:
        socket: the socket's index (0-based, the site's ``[[ev.sockets]]`` groups in order) or a station id of the
            site (the socket its sessions go to; the group's first free one when that is taken).
        need_kwh: energy it still needs, kWh, >= 0.
        departure: when it leaves, tz-aware; after the state's time.
        station_id: the charge point the profile goes to (default: ``socket`` when it is a station id, else the
            socket's first station in the site's data, else ``socket-<i>``).
        connector_id: its OCPP connector at that charge point (default 1).
        transaction_id: its OCPP transaction, put in the profile when given.
    """

    socket: int | str
    need_kwh: float
    departure: pd.Timestamp
    station_id: str | None = None
    connector_id: int = 1
    transaction_id: int | None = None


@dataclass(frozen=True)
class DayStart:
    """The site at the last local midnight (or at the history's first step, if later): what ``mpc_rl`` sets its
    day's parameters from. ``soc`` in [0, 1]; ``ev_need_kwh``: the plugged cars' total need then, kWh."""

    soc: float
    ev_need_kwh: float


@dataclass
class LiveState:
    """What the site knows at ``time``.

    Attributes:
        time: the step the plan starts, tz-aware, on a step of the site (whole hours at ``dt_h = 1``, quarter hours at
            ``dt_h = 0.25``).
        soc: the battery's state of charge, fraction of its capacity, [0, 1] (kept within the config's
            ``[soc_min, soc_max]``, as the env keeps it).
        evs: the plugged cars.
        series: the realised history at the site's step, in the columns of its series (``series_<m>min.parquet``:
            ``time`` UTC, ``pv_kw_per_kwp``, ``moer_kg_per_kwh``, ``moer_fc_h0..h2``, the 5-minute columns where the
            site has them) from its first local midnight on: the realised MOER of every step before ``time``, the
            forecasts issued at every step up to ``time``, the PV outlook through the controller's window (NaN where
            not known).
        sessions: the sessions that arrived by ``time``, ``sessions.parquet``'s columns (arrival and departure UTC,
            energy kWh).
        forecast_issued_at: when the current MOER forecast (the row of ``time``) was issued; None: at ``time``.
        day_start: the site at the last local midnight (``mpc_rl`` only; None: not known).
        window_end: where the controller's window ends at the latest (None: a whole horizon; ``--at``: the split's
            end, where the study's run ends).
    """

    time: pd.Timestamp
    soc: float
    evs: list[PluggedEV]
    series: pd.DataFrame
    sessions: pd.DataFrame
    forecast_issued_at: pd.Timestamp | None = None
    day_start: DayStart | None = None
    window_end: pd.Timestamp | None = None


def as_timestamp(value, where: str) -> pd.Timestamp:
    """``value`` (a timestamp or an ISO 8601 string) as a tz-aware ``pd.Timestamp``.

    Raises:
        LiveError: not a time, or one without a UTC offset (the message names ``where`` and the value).
    """
    if isinstance(value, pd.Timestamp):
        ts = value
    else:
        try:
            ts = pd.Timestamp(value)
        except (ValueError, TypeError):
            raise LiveError(f"{where}: {value!r} is not an ISO 8601 time (e.g. 2021-08-23T08:00:00-07:00)") from None
    if ts is pd.NaT or ts.tzinfo is None:
        raise LiveError(f"{where}: {value!r} has no UTC offset: give one, e.g. 2021-08-23T08:00:00-07:00")
    return ts


def schedule_limit_kw(start, duration_s: float | None, periods, now: pd.Timestamp) -> float | None:
    """The limit a charging schedule sets at ``now``, kW: the last of ``periods`` (``(start_period s, limit W)`` pairs,
    in order) started by then; None before ``start``, from ``start + duration_s`` on (None: no end), or before the
    first period. The schedule's fields as either OCPP version and spelling carries them, read by the caller."""
    offset = (pd.Timestamp(now) - pd.Timestamp(start)).total_seconds()
    if offset < 0 or offset >= (math.inf if duration_s is None else duration_s):
        return None
    limit = None
    for start_period, limit_w in periods:
        if start_period <= offset:
            limit = float(limit_w)
    return None if limit is None else limit / 1000.0


def _split_of(site: Site, ts: pd.Timestamp) -> str:
    cfg = site.config
    for split in ("train", "test"):
        start, end = cfg.split_bounds(split)
        if start <= ts < end:
            return split
    bounds = ", ".join(f"{s} {getattr(cfg.splits, s)[0]}..{getattr(cfg.splits, s)[1]}" for s in ("train", "test"))
    raise LiveError(
        f"--at: {ts.isoformat()} lies outside the site's data ({bounds}, local dates): --at rebuilds the state from "
        "the split holding that time"
    )


def state_at(site: Site | str | Path, at, soc: float | None = None) -> LiveState:
    """The live state at step ``at`` rebuilt from the site's own data (module docstring): every car plugged in then
    still needs its session's energy, capped at what its socket delivers before it leaves; ``day_start`` (for
    ``mpc_rl``) is the site at the last local midnight alike, the battery at its initial SOC then.

    Args:
        site: a site or anything :func:`envs.site.load_site` accepts.
        at: a tz-aware time (or ISO 8601 string) within one of the site's splits, on a step.
        soc: the battery's SOC (default: the config's initial SOC).

    Raises:
        LiveError: ``at`` without a UTC offset, outside the splits or between steps; ``soc`` outside [0, 1].
    """
    site = load_site(site)
    cfg = site.config
    ts = as_timestamp(at, "--at")
    split = _split_of(site, ts)
    data = site.split(split)
    start, end = cfg.split_bounds(split)
    dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    pos = (ts.tz_convert("UTC") - start) / dt
    if pos != int(pos):
        raise LiveError(f"--at: {ts.isoformat()} is not on a step of the site (steps of {cfg.dt_h:g} h from {start})")
    t = int(pos)
    if soc is not None and not 0.0 <= soc <= 1.0:
        raise LiveError(f"--soc: {soc} is outside [0, 1] (a fraction of the battery's capacity)")
    h, s = realised_history(site, split, t)
    evs, need_then = [], {}
    ses = data.sessions[~data.sessions.rejected]
    kw = data.socket_kw
    for r in ses.itertuples():
        if r.arrival_step <= t < r.departure_step:
            need = min(float(r.need_kwh), kw[r.socket] * cfg.dt_h * (r.departure_step - t))
            dep = start + r.departure_step * dt
            evs.append(PluggedEV(int(r.socket), need, dep.tz_convert(cfg.timezone), station_id=str(r.station_id)))
    m = data.last_midnight(t)
    for r in ses.itertuples():
        if r.arrival_step <= m < r.departure_step:
            need_then[r.socket] = min(float(r.need_kwh), kw[r.socket] * cfg.dt_h * (r.departure_step - m))
    soc = cfg.bess.soc_initial if soc is None else float(soc)
    return LiveState(
        time=ts.tz_convert(cfg.timezone),
        soc=soc,
        evs=evs,
        series=h,
        sessions=s,
        day_start=DayStart(cfg.bess.soc_initial if m < t else soc, float(sum(need_then.values()))),
        window_end=end,
    )


def realised_history(site: Site, split: str, t: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the site's data say had been realised at step ``t`` of ``split``: ``(series, sessions)`` of a
    :class:`LiveState`. The rows of the site's series (at its step) in the split, the realised MOER blanked from ``t``
    on, the forecasts (and 5-minute values) after ``t``, the PV kept (the modelled series of a typical year, known
    ahead); the split's sessions that arrived by step ``t`` (arrival rounded to the step, as the site model does)."""
    start, end = site.config.split_bounds(split)
    dt = pd.Timedelta(timestep.step_timedelta(site.config.dt_h))
    now = start + t * dt
    h = site.series[(site.series.time >= start) & (site.series.time < end)].reset_index(drop=True)
    s = site.sessions
    s = s[(s.arrival >= start) & (s.arrival < end)]
    s = s[np.rint((s.arrival - start) / dt).to_numpy() <= t].reset_index(drop=True)
    return blank_unrealised(h, h.time, now), s


def blank_unrealised(series: pd.DataFrame, times, now: pd.Timestamp) -> pd.DataFrame:
    """``series`` as known at ``now``: the realised MOER (``moer_kg_per_kwh``) blanked (NaN) at ``now`` and after, the
    forecasts (:data:`FORECAST_COLUMNS`) and 5-minute values (:data:`~envs.schemas.MOER_5MIN_COLUMNS`) after ``now``;
    every other column kept (the PV is a typical year's modelled series, known ahead). A new frame with ``series``'s
    index and columns; ``series`` is left as it is.

    Args:
        times: each row's time (UTC), ``len(series)`` of them (a column or the index).
    """
    times = pd.DatetimeIndex(times)
    masks = {"moer_kg_per_kwh": times >= now}
    later = times > now
    masks.update((c, later) for c in (*FORECAST_COLUMNS, *MOER_5MIN_COLUMNS))
    columns = {}
    for c in series.columns:
        if c not in masks:
            columns[c] = series[c]
            continue
        v = series[c].to_numpy(copy=True)
        if v.dtype.kind != "f":  # NaN needs a float column
            v = v.astype(np.float64)
        v[masks[c]] = np.nan
        columns[c] = v
    return pd.DataFrame(columns, index=series.index)


# ------------------------------------------------------------------------------------------------ the state file
STATE_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "live-state.schema.json",
    "title": "evhub-plan live state",
    "description": (
        "What a site knows at the step it plans (evhub-plan --state FILE; docs/live.md). Times are ISO 8601 with a "
        "UTC offset; energy kWh; SOC a fraction of the battery's capacity; MOER kg CO2/kWh."
    ),
    "type": "object",
    "required": ["time", "soc", "evs", "moer_forecast", "series", "sessions"],
    "additionalProperties": False,
    "properties": {
        "time": {
            "type": "string",
            "description": "The step the plan starts, on a step of the site (whole hours at dt_h = 1, quarter hours "
            "at dt_h = 0.25), e.g. 2021-08-23T08:00:00-07:00.",
        },
        "soc": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "description": "The battery's state of charge, fraction of its capacity (kept within the site's "
            "[soc_min, soc_max]).",
        },
        "evs": {
            "type": "array",
            "description": "The plugged cars.",
            "items": {
                "type": "object",
                "required": ["socket", "need_kwh", "departure"],
                "additionalProperties": False,
                "properties": {
                    "socket": {
                        "type": ["integer", "string"],
                        "description": "The socket's index (0-based, the site's [[ev.sockets]] groups in order) or a "
                        "station id of the site.",
                    },
                    "need_kwh": {"type": "number", "minimum": 0, "description": "Energy still needed, kWh."},
                    "departure": {"type": "string", "description": "When the car leaves; after time."},
                    "station_id": {
                        "type": "string",
                        "description": "The OCPP charge point of the profile (default: the socket's station).",
                    },
                    "connector_id": {"type": "integer", "minimum": 1, "description": "OCPP connector (default 1)."},
                    "transaction_id": {"type": "integer", "description": "OCPP transaction, put in the profile."},
                },
            },
        },
        "moer_forecast": {
            "type": "object",
            "description": "The current MOER forecast, issued at time's step: kg CO2/kWh for the hour from time, the "
            "next hour and the one after.",
            "required": ["issued_at", "kg_per_kwh"],
            "additionalProperties": False,
            "properties": {
                "issued_at": {
                    "type": "string",
                    "description": "When it was issued: at most an hour before time (else it is stale).",
                },
                "kg_per_kwh": {
                    "type": "array",
                    "items": {"type": "number", "minimum": 0},
                    "minItems": 3,
                    "maxItems": 3,
                },
            },
        },
        "series": {
            "description": "The realised steps from a local midnight on, at the site's step, in the columns of its "
            "series_<minutes>min.parquet (time, pv_kw_per_kwp, moer_kg_per_kwh, moer_fc_h0..h2 and the 5-minute "
            "columns where the site has them): the MOER of every step before time, the forecasts issued up to time, "
            "the PV through the controller's window. A Parquet or CSV file (path relative to this file) or the rows "
            "inline.",
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
        },
        "sessions": {
            "description": "The sessions that arrived by time, in sessions.parquet's columns (session_id, station_id, "
            "arrival, departure, energy_kwh). A Parquet or CSV file (path relative to this file) or the rows inline.",
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
        },
        "day_start": {
            "type": "object",
            "description": "mpc_rl only: the site at the last local midnight (its day's parameters are set from it).",
            "required": ["soc", "ev_need_kwh"],
            "additionalProperties": False,
            "properties": {
                "soc": {"type": "number", "minimum": 0, "maximum": 1},
                "ev_need_kwh": {"type": "number", "minimum": 0},
            },
        },
    },
}
"""The JSON Schema of a state file (``docs/live-state.schema.json`` is this, written out)."""


def _table(value, base: Path, where: str, time_columns: tuple[str, ...]) -> pd.DataFrame:
    """A history table given as a file path (relative to ``base``) or as rows inline."""
    from envs.schemas import read_table

    if isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else base / value
        if not path.is_file():
            raise LiveError(f"{where}: {value!r}: no such file ({shown_path(path)})")
        return read_table(path)
    df = pd.DataFrame.from_records(value)
    for c in time_columns:
        if c in df:
            for k, v in enumerate(df[c]):
                as_timestamp(v, f"{where}[{k}].{c}")
            df[c] = pd.to_datetime(df[c], utc=True, format="ISO8601")
    return df


def read_state(path: str | Path) -> LiveState:
    """Read a state file (JSON, :data:`STATE_SCHEMA`).

    Raises:
        LiveError: no such file, not JSON, or a field against the schema (the message names it and its value).
    """
    import jsonschema

    path = Path(path)
    if not path.is_file():
        raise LiveError(f"--state: {shown_path(path)}: no such file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LiveError(f"--state: {shown_path(path)}: not valid JSON ({exc})") from None
    if isinstance(raw, dict) and "hourly" in raw:
        raise LiveError(
            f"hourly: not a field of a state file: the realised history is the field series (the site's series at its "
            f"step): rename the key (state file {shown_path(path)})"
        )
    errors = sorted(jsonschema.Draft202012Validator(STATE_SCHEMA).iter_errors(raw), key=lambda e: e.path)
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".")
        raise LiveError(f"{where or 'state'}: {e.message} (state file {shown_path(path)})")
    base = path.parent
    time = as_timestamp(raw["time"], "time")
    series = _table(raw["series"], base, "series", ("time",))
    sessions = _table(raw["sessions"], base, "sessions", ("arrival", "departure"))
    fc = raw["moer_forecast"]
    issued = as_timestamp(fc["issued_at"], "moer_forecast.issued_at")
    if "time" in series:
        series = series.assign(time=pd.to_datetime(series.time, utc=True))
        row = series.time == time.tz_convert("UTC")
        if not row.any():
            series = pd.concat([series, pd.DataFrame({"time": [time.tz_convert("UTC")]})], ignore_index=True)
            row = series.time == time.tz_convert("UTC")
        for c, v in zip(FORECAST_COLUMNS, fc["kg_per_kwh"]):
            series[c] = series[c].astype(np.float64) if c in series else np.nan
            series.loc[row, c] = float(v)
    evs = [
        PluggedEV(
            socket=e["socket"],
            need_kwh=float(e["need_kwh"]),
            departure=as_timestamp(e["departure"], f"evs[{k}].departure"),
            station_id=e.get("station_id"),
            connector_id=int(e.get("connector_id", 1)),
            transaction_id=e.get("transaction_id"),
        )
        for k, e in enumerate(raw["evs"])
    ]
    ds = raw.get("day_start")
    return LiveState(
        time=time,
        soc=float(raw["soc"]),
        evs=evs,
        series=series,
        sessions=sessions,
        forecast_issued_at=issued,
        day_start=DayStart(float(ds["soc"]), float(ds["ev_need_kwh"])) if ds else None,
    )


def write_state(state: LiveState, path: str | Path) -> list[Path]:
    """Write ``state`` as a state file, its history beside it (``<stem>_series.parquet``, ``<stem>_sessions.parquet``);
    returns the files written. The window end of a ``--at`` state is not kept (a state file plans a whole
    horizon)."""
    path = Path(path)
    now = state.time.tz_convert("UTC")
    h = state.series
    row = h[pd.to_datetime(h.time, utc=True) == now]
    kg = [float(row[c].iloc[0]) for c in FORECAST_COLUMNS] if len(row) else []
    doc = {
        "time": state.time.isoformat(),
        "soc": float(state.soc),
        "evs": [
            {"socket": e.socket, "need_kwh": float(e.need_kwh), "departure": pd.Timestamp(e.departure).isoformat()}
            | ({"station_id": e.station_id} if e.station_id else {})
            | ({"connector_id": e.connector_id} if e.connector_id != 1 else {})
            | ({"transaction_id": e.transaction_id} if e.transaction_id is not None else {})
            for e in state.evs
        ],
        "moer_forecast": {"issued_at": (state.forecast_issued_at or state.time).isoformat(), "kg_per_kwh": kg},
        "series": f"{path.stem}_series.parquet",
        "sessions": f"{path.stem}_sessions.parquet",
    }
    if state.day_start is not None:
        doc["day_start"] = {"soc": state.day_start.soc, "ev_need_kwh": state.day_start.ev_need_kwh}
    return [
        write_parquet(state.series, path.parent / doc["series"]),
        write_parquet(state.sessions, path.parent / doc["sessions"]),
        write_text(path, json.dumps(doc, indent=2) + "\n"),
    ]
