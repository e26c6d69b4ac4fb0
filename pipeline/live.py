"""Live planning: a controller of the study run at a site, one plan an hour, sent to its chargers over OCPP 1.6J.

:func:`make_plan` takes a site, a causal controller of the registry and the live state (:class:`LiveState`: the
time, the battery's SOC, the plugged EVs, and the history realised before that time: sessions, MOER, the current MOER
forecast) and returns a :class:`LivePlan`: the battery's set-points over the controller's window and one OCPP 1.6J
``SetChargingProfile.req`` payload per connector with a car (``TxProfile``, ``Absolute``, rate unit W, one period per
step), each validated against the ``ocpp`` package's JSON schema. :func:`main` is the ``evhub-plan`` command
(``docs/live.md``).

The live path is the simulated path. The controller is rebuilt from the history alone at every call, as the study's
runs build it over a split: the history becomes a site of its own whose ``test`` split starts at the history's first
local midnight (:func:`history`), everything after the state's time blanked (NaN MOER, no sessions), so a controller
that read the future would plan on NaN. What a controller learns as the hours pass is rebuilt the same way:

- the MOER regression (``mpc`` and the learned planners) refits at the start of every day of its split; it is refit
  day after day from the history's start up to the state's day (:func:`_catch_up`), the same sums in the same order;
- ``mpc_adaptive`` re-chooses its demand weight each week from backtests of the weeks before it; those of the history
  are run here (:func:`pipeline.control.backtest.run_window` on the history) and kept in a cache keyed by what they
  read (:class:`WeekCosts`);
- ``mpc_rl`` sets its parameters at each local midnight from the state then (SOC, the plugged cars' need): the state
  carries it (:attr:`LiveState.day_start`).

The first step of a plan, applied through the env, is the step the study's run of that controller takes: the replay
test (``tests/test_plan.py``) steps a split hour by hour through :func:`make_plan` and reproduces the report's row.

``--at TIME`` rebuilds a state from the site's own data (:func:`state_at`): the sessions and MOER of the split
holding that hour, up to it; the cars plugged in then, each still needing its session's energy (capped at what its
socket can deliver before it leaves: the data do not say how the hours before were charged); the battery at its
initial SOC; the window ends at the split's end, as in the study.
"""

from __future__ import annotations

import dataclasses
import decimal
import hashlib
import json
import math
import os
import sys
import time as _time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from envs.errors import InputError, exit_code
from envs.files import write_parquet, write_text
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site, SplitData, load_site
from pipeline.control import registry, scenario
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.paths import PROJECT_ROOT, shown_path

FORECAST_COLUMNS = ("moer_fc_h0", "moer_fc_h1", "moer_fc_h2")
"""The hourly columns of the MOER forecast issued at each hour (kg/kWh for that hour and the next two)."""
SESSION_COLUMNS = ("session_id", "station_id", "arrival", "departure", "energy_kwh")
"""The sessions columns a history needs (``sessions.parquet``'s, ``requested_energy_kwh`` optional)."""
MAX_FORECAST_AGE_STEPS = 1
"""A MOER forecast issued more than this many steps before the state's time is stale."""
REFUSED = {
    "uncontrolled": "it is no control: every car at full power from arrival, the battery idle; there is no plan to "
    "send (leave the chargers and the battery as they are)",
    "rule_based": "it is the battery's own self-consumption rule, decided hour by hour on site with the chargers at "
    "full power; there is no plan over a window to send",
    "mpc_perfect": "it is not causal: it plans on the true MOER and arrivals of the next hours, which no site knows",
    "oracle": "it is not causal: it plans the whole split with perfect foresight (the study's lower bound)",
}
"""The registry's controllers :func:`make_plan` refuses, and why."""
AGENT_REASON = (
    "it is a model-free agent: it acts one hour at a time from the env's observation and has no plan over a horizon "
    "to send as a charging profile (and on the study's sites it lands behind mpc)"
)
"""Why the agents are refused."""


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
        time: the hour the plan starts, tz-aware, on a step of the site (whole hours at ``dt_h = 1``).
        soc: the battery's state of charge, fraction of its capacity, [0, 1] (kept within the config's
            ``[soc_min, soc_max]``, as the env keeps it).
        evs: the plugged cars.
        hourly: the realised history in ``hourly.parquet``'s columns (``time`` UTC, ``pv_kw_per_kwp``,
            ``moer_kg_per_kwh``, ``moer_fc_h0..h2``, the 5-minute columns where the site has them) from its first
            local midnight on: the realised MOER of every hour before ``time``, the forecasts issued at every hour up
            to ``time``, the PV outlook through the controller's window (NaN where not known).
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
    hourly: pd.DataFrame
    sessions: pd.DataFrame
    forecast_issued_at: pd.Timestamp | None = None
    day_start: DayStart | None = None
    window_end: pd.Timestamp | None = None


def _timestamp(value, where: str) -> pd.Timestamp:
    """``value`` as a tz-aware timestamp; LiveError naming ``where`` otherwise."""
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


def _split_of(site: Site, ts: pd.Timestamp) -> str:
    cfg = site.config
    for split in ("train", "test"):
        start, end = cfg.split_bounds(split)
        if start <= ts < end:
            return split
    bounds = ", ".join(f"{s} {getattr(cfg.splits, s)[0]}..{getattr(cfg.splits, s)[1]}" for s in ("train", "test"))
    raise LiveError(
        f"--at: {ts.isoformat()} lies outside the site's data ({bounds}, local dates): --at rebuilds the state from "
        "the split holding that hour"
    )


def state_at(site: Site | str | Path, at, soc: float | None = None) -> LiveState:
    """The live state at hour ``at`` rebuilt from the site's own data (module docstring): every car plugged in then
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
    ts = _timestamp(at, "--at")
    split = _split_of(site, ts)
    data = site.split(split)
    start, end = cfg.split_bounds(split)
    dt = pd.Timedelta(hours=cfg.dt_h)
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
    local = data.time.tz_convert(cfg.timezone)
    midnights = np.flatnonzero((local.hour == 0) & (local.minute == 0) & (np.arange(len(local)) <= t))
    m = int(midnights[-1]) if len(midnights) else 0
    for r in ses.itertuples():
        if r.arrival_step <= m < r.departure_step:
            need_then[r.socket] = min(float(r.need_kwh), kw[r.socket] * cfg.dt_h * (r.departure_step - m))
    soc = cfg.bess.soc_initial if soc is None else float(soc)
    return LiveState(
        time=ts.tz_convert(cfg.timezone),
        soc=soc,
        evs=evs,
        hourly=h,
        sessions=s,
        day_start=DayStart(cfg.bess.soc_initial if m < t else soc, float(sum(need_then.values()))),
        window_end=end,
    )


def realised_history(site: Site, split: str, t: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What the site's data say had been realised at step ``t`` of ``split``: ``(hourly, sessions)`` of a
    :class:`LiveState`. The hourly rows of the split, the realised MOER blanked from ``t`` on, the forecasts (and
    5-minute values) after ``t``, the PV kept (the modelled series of a typical year, known ahead); the split's
    sessions that arrived by step ``t`` (arrival rounded to the step, as the site model does)."""
    start, end = site.config.split_bounds(split)
    dt = pd.Timedelta(hours=site.config.dt_h)
    now = start + t * dt
    h = site.hourly[(site.hourly.time >= start) & (site.hourly.time < end)].reset_index(drop=True)
    s = site.sessions
    s = s[(s.arrival >= start) & (s.arrival < end)]
    s = s[np.rint((s.arrival - start) / dt).to_numpy() <= t].reset_index(drop=True)
    h = h.copy()
    h.loc[h.time >= now, "moer_kg_per_kwh"] = np.nan
    later = [c for c in (*FORECAST_COLUMNS, *MOER_5MIN_COLUMNS) if c in h]
    h.loc[h.time > now, later] = np.nan
    return h, s


# ------------------------------------------------------------------------------------------------ the history
@dataclass
class History:
    """The live state as a split the controllers run on (:func:`history`).

    Attributes:
        site: the history as a site: its ``test`` split is the history (every session kept, as in an evaluation).
        data: that split: ``T`` steps from the history's first local midnight to the window's end.
        t: the state's step in it.
        energy_kwh: the battery's energy, kWh.
        ev_need_kwh, ev_steps_left: ``(N,)`` the env's socket state (need kWh, steps to departure; 0: free).
        stations, connectors, transactions: each socket's car's charge point, connector and transaction (free: "",
            0, None).
        day_start: as in the state.
        source: the real site (its train split, its tuning).
    """

    site: Site
    data: SplitData
    t: int
    energy_kwh: float
    ev_need_kwh: np.ndarray
    ev_steps_left: np.ndarray
    stations: list[str]
    connectors: list[int]
    transactions: list[int | None]
    day_start: DayStart | None
    source: Site


def station_sockets(config, station_ids) -> dict[str, int]:
    """The socket each station's sessions go to, as the site model assigns them: within the first group whose
    pattern the station matches, one socket per station in sorted order, wrapping when the group has fewer sockets
    than stations (:class:`envs.site.Site`). Stations matching no group are left out."""
    groups = config.ev.groups
    first = np.cumsum([0] + [g.count for g in groups])
    seen = [0] * len(groups)
    out = {}
    for st in sorted(set(map(str, station_ids))):
        k = next((i for i, g in enumerate(groups) if g.matches(st)), None)
        if k is not None:
            out[st] = int(first[k] + seen[k] % groups[k].count)
            seen[k] += 1
    return out


def _local_midnight(ts: pd.Timestamp, tz: str, after: bool) -> pd.Timestamp:
    """The local midnight at or after ``ts`` (``after``: strictly after), UTC."""
    local = ts.tz_convert(tz)
    day = local.normalize()
    if after or day != local:
        day = pd.Timestamp(local.date() + pd.Timedelta(days=1)).tz_localize(tz)
    return day.tz_convert("UTC")


def history(site: Site, state: LiveState, horizon_steps: int) -> History:
    """Check ``state`` and turn it into the split the controllers run on (module docstring).

    Args:
        site: the real site. horizon_steps: the controller's window, steps (the PV outlook must cover it).

    Raises:
        LiveError: a bad state: a time between steps, a SOC outside [0, 1], a car on an unknown or taken socket or
            leaving before the state's time, a stale MOER forecast, a history with gaps, sessions that arrive after
            the state's time; the message names the field and its value.
    """
    cfg = site.config
    tz, dt = cfg.timezone, pd.Timedelta(hours=cfg.dt_h)
    now = _timestamp(state.time, "time").tz_convert("UTC")
    if not (isinstance(state.soc, int | float) and 0.0 <= state.soc <= 1.0):
        raise LiveError(f"soc: {state.soc} is outside [0, 1] (a fraction of the battery's capacity)")
    h = state.hourly
    missing = [c for c in ("time", "pv_kw_per_kwp", "moer_kg_per_kwh", *FORECAST_COLUMNS) if c not in h]
    if missing:
        raise LiveError(f"hourly: column(s) {', '.join(missing)} missing (hourly.parquet's columns are needed)")
    if len(h) == 0:
        raise LiveError("hourly: no rows (the history needs the hours before the state's time)")
    times = pd.DatetimeIndex(pd.to_datetime(h.time, utc=True))
    origin = _local_midnight(times.min(), tz, after=False)
    if origin > now:
        raise LiveError(
            f"hourly: the history starts at {times.min()}, and its first local midnight ({origin}) lies after the "
            f"state's time {now}: give the hours from a local midnight before it"
        )
    pos = (now - origin) / dt
    if pos != int(pos):
        raise LiveError(f"time: {state.time.isoformat()} is not on a step of the site (steps of {cfg.dt_h:g} h)")
    t = int(pos)
    end = state.window_end
    if end is None:
        end = _local_midnight(now + horizon_steps * dt, tz, after=True)
    end = end.tz_convert("UTC")
    last_day = (end.tz_convert(tz) - pd.Timedelta(hours=1)).date()
    first_day = origin.tz_convert(tz).date()
    before = (first_day - pd.Timedelta(days=1)).isoformat()  # the history site's train split: unused, apart
    hcfg = cfg.replace(
        splits={"train": (before, before), "test": (first_day.isoformat(), last_day.isoformat())},
        episode={"session_keep_min": 1.0},
    )
    grid = pd.date_range(origin, end, freq=dt, inclusive="left")
    hh = h.assign(time=times).drop_duplicates("time", keep="last").set_index("time").reindex(grid)
    hh = hh.astype({c: np.float32 for c in hh.columns if hh[c].dtype.kind in "fiu"})  # the ingested data's dtype
    hh.loc[hh.index >= now, "moer_kg_per_kwh"] = np.nan  # nothing after the state's time is read
    later = [c for c in (*FORECAST_COLUMNS, *MOER_5MIN_COLUMNS) if c in hh]
    hh.loc[hh.index > now, later] = np.nan
    _check_known(hh, t, horizon_steps, state, dt)
    hourly = hh.rename_axis("time").reset_index()

    sessions = _sessions(state.sessions, origin, now, dt, t)
    known = set(map(str, site.sessions.station_id.unique())) | set(sessions.station_id)
    stamp = origin - pd.Timedelta(days=2)  # one row per station, before the split: the station list, no arrival
    phantoms = pd.DataFrame(
        {
            "session_id": [f"live-station-{i}" for i in range(len(known))],
            "station_id": sorted(known),
            "arrival": stamp,
            "departure": stamp + dt,
            "energy_kwh": 0.0,
        }
    )
    all_sessions = pd.concat([sessions[list(SESSION_COLUMNS)], phantoms], ignore_index=True)
    all_sessions["arrival"] = pd.to_datetime(all_sessions.arrival, utc=True).astype("datetime64[ns, UTC]")
    all_sessions["departure"] = pd.to_datetime(all_sessions.departure, utc=True).astype("datetime64[ns, UTC]")
    src = {
        "config": site.source.get("config", cfg.name),
        "hourly": "the state's hourly",
        "sessions": "the state's sessions",
    }
    hsite = Site(hcfg, hourly, all_sessions, src)
    data = hsite.split("test")

    N = cfg.ev.n_sockets
    need = np.zeros(N)
    left = np.zeros(N, np.int64)
    stations, connectors, transactions = [""] * N, [0] * N, [None] * N
    holder: dict[int, int] = {}
    by_station = station_sockets(cfg, known)
    socket_station: dict[int, str] = {}
    for st, i in sorted(by_station.items()):
        socket_station.setdefault(i, st)
    groups = cfg.ev.groups
    first = np.cumsum([0] + [g.count for g in groups])
    for k, ev in enumerate(state.evs):
        where = f"evs[{k}]"
        sock = ev.socket
        if isinstance(sock, bool) or not isinstance(sock, int | np.integer | str):
            raise LiveError(f"{where}.socket: {sock!r} is neither a socket index nor a station id")
        if isinstance(sock, str):
            if sock not in by_station:
                raise LiveError(
                    f"{where}.socket: unknown socket {sock!r}: not a station id of the site (sockets 0..{N - 1}, or a "
                    f"station id such as {', '.join(sorted(by_station)[:3])})"
                )
            i = by_station[sock]
            if i in holder:  # taken: the group's first free socket, as the site model does
                g = next(j for j in range(len(groups)) if first[j] <= i < first[j + 1])
                free = [j for j in range(first[g], first[g + 1]) if j not in holder]
                if not free:
                    raise LiveError(f"{where}.socket: {sock!r}: every socket of its group already holds a car")
                i = free[0]
            station = ev.station_id or sock
        else:
            i = int(sock)
            if not 0 <= i < N:
                raise LiveError(f"{where}.socket: unknown socket {i}: the site has sockets 0..{N - 1}")
            if i in holder:
                raise LiveError(f"{where}.socket: socket {i} already holds evs[{holder[i]}]")
            station = ev.station_id or socket_station.get(i, f"socket-{i}")
        if not (isinstance(ev.need_kwh, int | float) and math.isfinite(ev.need_kwh) and ev.need_kwh >= 0):
            raise LiveError(f"{where}.need_kwh: {ev.need_kwh!r} is not an energy >= 0 (kWh)")
        dep = _timestamp(ev.departure, f"{where}.departure")
        if dep <= now:
            raise LiveError(
                f"{where}.departure: {dep.isoformat()} is not after the state's time {state.time.isoformat()} (a car "
                "that has left is not plugged in)"
            )
        holder[i] = k
        need[i] = float(ev.need_kwh)
        left[i] = max(1, int(np.rint((dep.tz_convert("UTC") - now) / dt)))
        stations[i], connectors[i], transactions[i] = str(station), int(ev.connector_id), ev.transaction_id
    b = cfg.bess
    energy = min(max(float(state.soc), b.soc_min), b.soc_max) * b.capacity_kwh
    if state.day_start is not None and not 0.0 <= state.day_start.soc <= 1.0:
        raise LiveError(f"day_start.soc: {state.day_start.soc} is outside [0, 1]")
    return History(hsite, data, t, energy, need, left, stations, connectors, transactions, state.day_start, site)


def _check_known(hh: pd.DataFrame, t: int, H: int, state: LiveState, dt: pd.Timedelta) -> None:
    """The history holds what a controller reads: the realised MOER of every step before ``t``, the forecasts issued
    at every step up to ``t``, the PV over the window; the current forecast is recent."""
    now = hh.index[t]
    if state.forecast_issued_at is not None:
        issued = _timestamp(state.forecast_issued_at, "moer_forecast.issued_at")
        age = now - issued.tz_convert("UTC")
        if age < pd.Timedelta(0):
            raise LiveError(
                f"moer_forecast.issued_at: {issued.isoformat()} is after the state's time {state.time.isoformat()}"
            )
        if age > MAX_FORECAST_AGE_STEPS * dt:
            raise LiveError(
                f"moer_forecast.issued_at: {issued.isoformat()} is {age / pd.Timedelta(hours=1):g} h before the "
                f"state's time {state.time.isoformat()}: the MOER forecast is stale (at most "
                f"{MAX_FORECAST_AGE_STEPS} step of {dt / pd.Timedelta(hours=1):g} h old)"
            )
    checks = [("moer_kg_per_kwh", slice(0, t), "the realised MOER of every hour before the state's time")]
    checks += [
        (c, slice(0, t + 1), "the MOER forecast issued at every hour up to the state's time") for c in FORECAST_COLUMNS
    ]
    checks += [
        (c, slice(0, t + 1), "the 5-minute values at every hour up to the state's time")
        for c in MOER_5MIN_COLUMNS
        if c in hh
    ]
    checks.append(("pv_kw_per_kwp", slice(0, min(t + H, len(hh))), f"the PV outlook over the window ({H} steps)"))
    for col, rows, what in checks:
        gap = np.flatnonzero(~np.isfinite(hh[col].to_numpy()[rows]))
        if len(gap):
            at = hh.index[rows.start + gap[0]]
            stale = " (the MOER forecast is stale)" if col in FORECAST_COLUMNS and at == now else ""
            raise LiveError(f"hourly: {col} missing at {at.isoformat()}{stale}: the history needs {what}")


def _sessions(s: pd.DataFrame, origin: pd.Timestamp, now: pd.Timestamp, dt: pd.Timedelta, t: int) -> pd.DataFrame:
    """The history's sessions that arrived in its span, checked: none after the state's time."""
    missing = [c for c in SESSION_COLUMNS if c not in s]
    if missing:
        raise LiveError(f"sessions: column(s) {', '.join(missing)} missing (sessions.parquet's columns are needed)")
    s = s[list(SESSION_COLUMNS)].copy()
    for c in ("arrival", "departure"):
        s[c] = pd.to_datetime(s[c], utc=True)
    s["session_id"] = s.session_id.astype(str)
    s["station_id"] = s.station_id.astype(str)
    s["energy_kwh"] = s.energy_kwh.astype(np.float64)
    step = np.rint((s.arrival - origin) / dt).to_numpy()
    late = np.flatnonzero(step > t)
    if len(late):
        r = s.iloc[late[0]]
        raise LiveError(
            f"sessions: session {r.session_id!r} arrives at {r.arrival.isoformat()}, after the state's time "
            f"{now.isoformat()}: give the sessions realised by then"
        )
    return s[s.arrival >= origin - dt / 2].reset_index(drop=True)


# ------------------------------------------------------------------------------------------------ the controllers
def _catch_up(mpc: MPCController, t: int, since: int = 0) -> None:
    """Refit ``mpc``'s MOER regression day after day up to step ``t``'s day, as a run over the split does (one
    refit at each day start): the same sums in the same order, so the same forecast as the run's. ``since``: the
    step whose day it is already fitted to (0: a new controller)."""
    fc = mpc.forecaster
    day = getattr(fc, "day", None)
    if day is None:
        return
    for start in range(since - since % day + day, t - t % day + 1, day):
        fc(start, 1)


@dataclass
class StepPlan:
    """A controller's plan from the state: ``action`` the env's socket action of its first step (``[a_bess,
    a_1..a_N]``, set-point battery), ``bess_kw`` ``(H,)`` kW (+ = charge) and ``ev_kw`` ``(N, H)`` kW."""

    action: np.ndarray
    bess_kw: np.ndarray
    ev_kw: np.ndarray
    params: PlannerParams | None = None


def _plan_step(hist: History, m: MPCController, since: int = 0) -> StepPlan:
    """``m``'s plan from the state (its forecast refit up to the state's day first, from ``since``'s day on)."""
    _catch_up(m, hist.t, since)
    p = m.plan(hist.t, hist.energy_kwh, hist.ev_need_kwh, hist.ev_steps_left)
    return StepPlan(p.action, p.bess_kw_steps, p.ev_kw_steps, m.params)


class WeekCosts:
    """Backtested costs of ``mpc_adaptive``'s weeks (:func:`pipeline.control.backtest.run_window` on the history),
    kept by a key of what each backtest reads (the config, the parameters, the window, the history up to the week's
    end and the PV over the horizon beyond it): in memory, and in ``folder/week_costs.json`` when a folder is given."""

    def __init__(self, folder: str | Path | None = None):
        self.file = Path(folder) / "week_costs.json" if folder else None
        self.costs: dict[str, float] = {}
        if self.file and self.file.is_file():
            try:
                self.costs = {k: float(v) for k, v in json.loads(self.file.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.costs = {}
        self.computed = 0

    @staticmethod
    def data_digest(hist: History, start: int, steps: int, horizon_h: float) -> str:
        """Digest of what a backtest of steps ``[start, start + steps)`` reads of the history: the MOER, forecasts and
        5-minute values up to its end, the PV and load over the window beyond it, the arrivals up to its end, the
        sockets' power, the history's start."""
        d = hist.data
        end = start + steps
        horizon = max(1, int(round(horizon_h / d.config.dt_h)))
        h = hashlib.sha256(str(d.time[0]).encode())
        arrays = [d.moer[:end], d.moer_fc[:end], d.pv_kw[: end + horizon], d.load_kw[: end + horizon]]
        arrays += [d.arrival_need_kwh[: end + 1], d.arrival_stay_steps[: end + 1], d.socket_kw]
        if d.moer_5min is not None:
            arrays.append(d.moer_5min[:end])
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def cost(self, hist: History, params: PlannerParams, start: int, steps: int, digest: str | None = None) -> float:
        """The backtested cost (kg, :attr:`pipeline.control.backtest.WindowResult.cost`) of ``params`` over steps
        ``[start, start + steps)`` of the history, from the cache or run now (``digest``: :meth:`data_digest`'s)."""
        from pipeline.control.backtest import run_window

        digest = digest or self.data_digest(hist, start, steps, params.horizon_h)
        what = json.dumps([dataclasses.asdict(hist.data.config), params.as_dict(), start, steps, digest], default=str)
        k = hashlib.sha256(what.encode()).hexdigest()
        if k not in self.costs:
            self.costs[k] = run_window(hist.site, "test", start, steps, params).cost
            self.computed += 1
        return self.costs[k]

    def save(self) -> None:
        if self.file and self.computed:
            write_text(self.file, json.dumps(self.costs, indent=0, sort_keys=True))
            self.computed = 0


def _adaptive_params(hist: History, tuned_dir: Path, seed: int, weeks_cache: WeekCosts) -> PlannerParams:
    """``mpc_adaptive``'s parameters at the state's step: ``mpc_tuned``'s in the history's first week, then the
    candidate of least mean backtested cost over the last ``lookback`` weeks (the lookback chosen on the train
    split's week table, as :func:`pipeline.control.learned.simulate_adaptive` does)."""
    from pipeline.control import learned, tuning
    from pipeline.control.backtest import week_steps, weeks

    tuned = tuning.load_params(tuned_dir, seed)
    cands = learned.candidates(tuned)
    lookback = learned.choose_lookback(_train_week_table(hist.source, tuned_dir, seed, cands))
    w = hist.t // week_steps(hist.data.config.dt_h)
    if w == 0:
        return cands[0]
    past = weeks(hist.data)[max(0, w - lookback) : w]
    digests = [weeks_cache.data_digest(hist, s, n, tuned.horizon_h) for s, n in past]
    cost = np.array([[weeks_cache.cost(hist, c, s, n, g) for c in cands] for (s, n), g in zip(past, digests)])
    return cands[learned.week_choice(cost)]


def _train_week_table(site: Site, tuned_dir: Path, seed: int, cands: list) -> pd.DataFrame:
    """The train split's week table kept beside the tuning (computed and kept there when missing or older than the
    tuning, as :func:`pipeline.control.learned.simulate_adaptive` does)."""
    from pipeline.control import learned, tuning

    f = learned.table_file(tuned_dir, "train", seed)
    stamp = tuning.result_files(tuned_dir, seed)[0].stat().st_mtime_ns
    if f.is_file() and f.stat().st_mtime_ns >= stamp:
        t = pd.read_parquet(f)
        if t.candidate.nunique() == len(cands):
            return t
    return pd.read_parquet(write_parquet(learned.week_table(site, "train", cands), f))


def _rl_params(hist: History, tuned_dir: Path, seed: int) -> tuple[PlannerParams, MPCController, int]:
    """``mpc_rl``'s parameters of the state's day: its policy's action on the day-level observation at the last local
    midnight (or the history's first step), from the site then (:attr:`LiveState.day_start`); returns them, the
    planner (its forecast refit up to that midnight's day) and that midnight's step."""
    import torch

    from envs.kpis import load_policy
    from pipeline.control import rl_planner

    path = rl_planner.policy_file(rl_planner.run_dir(tuned_dir, seed))
    if not path.is_file():
        raise LiveError(
            f"controller: no trained mpc_rl policy for seed {seed} ({shown_path(path)}): run `doit run pipeline` first"
        )
    d, t = hist.data, hist.t
    local = d.time.tz_convert(d.config.timezone)
    mids = np.flatnonzero((local.hour == 0) & (local.minute == 0))
    m = int(max([0, *mids[mids <= t]]))
    if m == t:
        soc, need = hist.energy_kwh / max(d.config.bess.capacity_kwh, 1e-9), float(hist.ev_need_kwh.sum())
    elif hist.day_start is None:
        raise LiveError(
            f"day_start: missing: mpc_rl sets its parameters at each local midnight from the battery's SOC and the "
            f"plugged cars' need then ({d.time[m].tz_convert(d.config.timezone).isoformat()}); give them"
        )
    else:
        soc, need = float(hist.day_start.soc), float(hist.day_start.ev_need_kwh)
    base = rl_planner.base_params(hist.source)
    b = d.config.bess
    energy = min(max(soc, b.soc_min), b.soc_max) * b.capacity_kwh
    env = SimpleNamespace(
        t=torch.tensor([m]),
        energy_kwh=torch.tensor([energy], dtype=torch.float64),
        ev_need_kwh=torch.tensor([[need]], dtype=torch.float64),
    )
    view = SimpleNamespace(config=d.config, split=lambda s: d if s == "test" else hist.source.split(s))
    day = rl_planner._Day(view, "test", base, env)
    _catch_up(day.mpc, m)
    policy = load_policy(path)
    x = torch.as_tensor(day.observe(None))[None]
    with torch.no_grad():
        a = policy(x, env)[0].numpy()
    params = rl_planner.day_params(base, a)
    day.mpc.set_params(params)
    return params, day.mpc, m


# ------------------------------------------------------------------------------------------------ the answer
def results_root(site: Site, output_dir: str | Path = "outputs", experiment: str = "") -> Path:
    """``<output_dir>/<experiment>`` of the study of ``site`` (``output_dir`` relative to the project root,
    ``experiment`` by default the site's name), as the pipeline lays it out."""
    out = Path(output_dir)
    if not out.is_absolute():
        out = PROJECT_ROOT / out
    return out / (experiment or site.config.name)


def answer(site: Site, output_dir: str | Path = "outputs", experiment: str = "") -> str:
    """The controller the report answers with for ``site``: the lowest-CO2 causal row of its results
    (``report/co2_comparison.parquet``) on the held-out split, as the report's first section names it
    (:func:`pipeline.study.report.best_controllers`).

    Raises:
        LiveError: no results yet (run the pipeline, or name a controller), or none that names a causal row.
    """
    f = results_root(site, output_dir, experiment) / "report" / "co2_comparison.parquet"
    if not f.is_file():
        raise LiveError(
            f"controller: not given, and no study results for site {site.config.name!r} to read the report's answer "
            f"from ({shown_path(f)} is missing): run `doit run pipeline` first, or pass --controller (e.g. mpc)"
        )
    from pipeline.study.report import best_controllers

    table = pd.read_parquet(f)
    split = "test" if (table.split == "test").any() else str(table.split.iloc[0])
    best = best_controllers(table, split).get("causal")
    if best is None:
        raise LiveError(f"controller: {shown_path(f)} names no causal controller: pass --controller")
    return best


def supported() -> tuple[str, ...]:
    """The registry's controllers :func:`make_plan` runs: the causal planners (not the agents or online agents, nor the
    baselines of :data:`REFUSED`)."""
    return tuple(n for n in registry.CONTROLLERS if registry.CONTROLLERS[n].causal and not registry.is_agent(n)
                 and n not in REFUSED)  # fmt: skip


def _check_controller(name: str) -> None:
    if name in REFUSED:
        raise LiveError(f"controller: {name!r} cannot run at a site: {REFUSED[name]}")
    if name not in registry.CONTROLLERS:
        try:
            registry.get(name)
        except KeyError as exc:
            raise LiveError(f"controller: {exc.args[0]}") from None
    if registry.is_agent(name):
        raise LiveError(f"controller: {name!r} is not supported by evhub-plan: {AGENT_REASON}")


def _seed(name: str, tuned_dir: Path, seed: int | None) -> int:
    if seed is not None:
        return int(seed)
    stems = (p.stem.removeprefix("mpc_tuned_seed") for p in tuned_dir.glob("mpc_tuned_seed*.json"))
    found = sorted(int(s) for s in stems if s.isdigit())
    found = [s for s in found if name != "mpc_rl" or (tuned_dir / f"mpc_rl_seed{s}" / "policy.pt2").is_file()]
    if not found:
        raise LiveError(
            f"controller: {name!r} reads what the study tuned on the train split, and {shown_path(tuned_dir)} holds "
            "none: run `doit run pipeline` first"
        )
    return found[0]


def horizon_of(site: Site, name: str, tuned_dir: Path, seed: int | None) -> tuple[PlannerParams, int]:
    """The planner parameters a controller starts from and its window, steps."""
    from pipeline.control import rl_planner, tuning

    cfg = site.config
    if name == "mpc":
        params = PlannerParams.of_site(cfg)
    elif name == "mpc_tuned_start":
        params = PlannerParams.learned_start(cfg)
    elif name == "mpc_rl_start":
        params = rl_planner.start_params(site)
    elif name == "mpc_rl":
        params = rl_planner.base_params(site)
    elif name in ("mpc_tuned", "mpc_adaptive"):
        params = tuning.load_params(tuned_dir, seed)
    elif name == "mpc_scenario":
        params = scenario.base_params(cfg)
    else:  # supported() grew without a branch here
        raise NotImplementedError(f"evhub-plan has no planner parameters for {name!r} yet")
    return params, max(1, int(round(params.horizon_h / cfg.dt_h)))


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class LivePlan:
    """One plan (:func:`make_plan`).

    Attributes:
        issued_at: the state's time (site's local time).
        controller, seed: what planned it (seed None for an unseeded controller).
        dt_h: the step, hours. battery_kw: ``(H,)`` the battery's power per step, kW, + = charge.
        ev_kw: ``(N, H)`` each socket's planned EV power, kW (0 for a free socket).
        action: the env's socket action of the first step (``[a_bess, a_1..a_N]``, set-point battery): applying it
            in the env is applying the plan's first step.
        charging_profiles: one entry per socket with a car: ``socket``, ``station_id`` (the charge point),
            ``connector_id``, ``action`` ("SetChargingProfile") and ``payload`` (the OCPP 1.6J request, validated).
        params: the planner's parameters of this step (None for the baselines).
        wall_s: seconds the plan took.
    """

    issued_at: pd.Timestamp
    controller: str
    seed: int | None
    dt_h: float
    battery_kw: np.ndarray
    ev_kw: np.ndarray
    action: np.ndarray
    charging_profiles: list[dict]
    params: PlannerParams | None = None
    wall_s: float = 0.0

    @property
    def horizon_h(self) -> float:
        """The window planned, hours."""
        return len(self.battery_kw) * self.dt_h

    def to_json(self) -> dict:
        """The plan as the command writes it (``docs/live.md``)."""
        return {
            "issued_at": self.issued_at.isoformat(),
            "controller": self.controller,
            "seed": self.seed,
            "horizon_h": self.horizon_h,
            "step_h": self.dt_h,
            "battery_kw": [round(float(x), 4) + 0.0 for x in self.battery_kw],  # (+ 0.0: no -0.0)
            "charging_profiles": self.charging_profiles,
        }


def _ocpp_validator():
    from ocpp.messages import MessageType, get_validator

    return get_validator(MessageType.Call, "SetChargingProfile", "1.6", parse_float=decimal.Decimal)


def validate_profile(payload: dict) -> None:
    """Check a ``SetChargingProfile.req`` payload against OCPP 1.6J's JSON schema (the ``ocpp`` package's), numbers
    read as decimals (the schema's ``multipleOf: 0.1``).

    Raises:
        ValueError: the first schema violation, with its path in the payload.
    """
    inst = json.loads(json.dumps(payload), parse_float=decimal.Decimal)
    errors = sorted(_ocpp_validator().iter_errors(inst), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ValueError(f"SetChargingProfile.req {'/'.join(map(str, e.absolute_path))}: {e.message}")


def charging_profile(
    issued_at: pd.Timestamp, socket: int, connector_id: int, kw: np.ndarray, socket_kw: float, dt_h: float,
    transaction_id: int | None = None,
) -> dict:  # fmt: skip
    """The OCPP 1.6J ``SetChargingProfile.req`` payload of one connector: a ``TxProfile`` (``Absolute``, from
    ``issued_at``), one period per step of ``kw`` (kW, the car's stay within the window) as a limit in W rounded to
    0.1 W and never above the socket's power; ``chargingProfileId`` is ``1 + socket`` (a new plan replaces the
    connector's last one), ``stackLevel`` 0."""
    step_s = int(round(dt_h * 3600))
    cap_w = math.floor(socket_kw * 10000.0 + 1e-6) / 10.0
    limits = [round(float(p) * 1000.0, 1) for p in kw]
    periods = [
        {"startPeriod": k * step_s, "limit": min(w, cap_w) if w > 0 else 0.0} for k, w in enumerate(limits)
    ]  # (0.0, never -0.0)
    profile = {
        "chargingProfileId": 1 + int(socket),
        "stackLevel": 0,
        "chargingProfilePurpose": "TxProfile",
        "chargingProfileKind": "Absolute",
        "chargingSchedule": {
            "duration": step_s * len(periods),
            "startSchedule": issued_at.tz_convert("UTC").strftime("%Y-%m-%dT%H:%M:%SZ"),
            "chargingRateUnit": "W",
            "chargingSchedulePeriod": periods,
        },
    }
    if transaction_id is not None:
        profile = {
            "chargingProfileId": profile.pop("chargingProfileId"),
            "transactionId": int(transaction_id),
        } | profile
    return {"connectorId": int(connector_id), "csChargingProfiles": profile}


def make_plan(
    site: Site | str | Path,
    state: LiveState,
    controller: str | None = None,
    *,
    seed: int | None = None,
    output_dir: str | Path = "outputs",
    experiment: str = "",
    week_costs: WeekCosts | None = None,
) -> LivePlan:
    """Plan from the live state: the function behind ``evhub-plan`` (module docstring).

    Args:
        site: a site or anything :func:`envs.site.load_site` accepts.
        state: the live state.
        controller: a causal controller of the registry (:func:`supported`); None: the report's answer for the site,
            read from its results (:func:`answer`).
        seed: the study's seed of a tuned controller (default: the lowest one tuned).
        output_dir, experiment: where the study's results and tuning are (``<output_dir>/<experiment>/``).
        week_costs: ``mpc_adaptive``'s cache of week backtests (default: ``<experiment>/live/``).

    Returns:
        the :class:`LivePlan`, its profiles validated against OCPP 1.6J.

    Raises:
        LiveError: a bad state or request (the message names the field and the value): an unknown or refused
            controller, no results to read the answer from, no tuning, a bad state (:func:`history`).
    """
    t0 = _time.perf_counter()
    site = load_site(site)
    name = controller or answer(site, output_dir, experiment)
    try:
        _check_controller(name)
    except LiveError as exc:
        if controller:
            raise
        raise LiveError(f"{exc} (it is the report's answer for site {site.config.name!r}: pass --controller)") from None
    root = results_root(site, output_dir, experiment)
    tuned_dir = root / "tuned"
    c = registry.CONTROLLERS[name]
    if c.tuned:
        seed = _seed(name, tuned_dir, seed)
    else:
        seed = None
    params, H = horizon_of(site, name, tuned_dir, seed)
    hist = history(site, state, H)
    if name == "mpc":
        step = _plan_step(hist, MPCController(hist.data, params, presolve=True))
    elif name == "mpc_adaptive":
        cache = week_costs if week_costs is not None else WeekCosts(root / "live")
        params = _adaptive_params(hist, tuned_dir, seed, cache)
        step = _plan_step(hist, MPCController(hist.data, params, presolve=False))
        cache.save()
    elif name == "mpc_rl":
        params, m, midnight = _rl_params(hist, tuned_dir, seed)
        step = _plan_step(hist, m, since=midnight)
    elif name == "mpc_scenario":
        step = _plan_step(hist, scenario.controller(hist.data))
    elif name in ("mpc_tuned", "mpc_tuned_start", "mpc_rl_start"):
        step = _plan_step(hist, MPCController(hist.data, params, presolve=False))
    else:  # supported() grew without a branch here
        raise NotImplementedError(f"evhub-plan has no way to run {name!r} yet")
    cfg = site.config
    issued = _timestamp(state.time, "time").tz_convert(cfg.timezone)
    profiles = []
    for i in np.flatnonzero(hist.ev_steps_left > 0):
        n = min(int(hist.ev_steps_left[i]), len(step.bess_kw))
        payload = charging_profile(
            issued, int(i), hist.connectors[i], step.ev_kw[i, :n], float(hist.data.socket_kw[i]), cfg.dt_h,
            hist.transactions[i],
        )  # fmt: skip
        validate_profile(payload)
        profiles.append(
            {
                "socket": int(i),
                "station_id": hist.stations[i],
                "connector_id": hist.connectors[i],
                "action": "SetChargingProfile",
                "payload": payload,
            }
        )
    return LivePlan(
        issued_at=issued,
        controller=name,
        seed=seed,
        dt_h=cfg.dt_h,
        battery_kw=np.asarray(step.bess_kw, np.float64),
        ev_kw=np.asarray(step.ev_kw, np.float64),
        action=np.asarray(step.action, np.float64),
        charging_profiles=profiles,
        params=step.params,
        wall_s=_time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------------------------------ the state file
STATE_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "live-state.schema.json",
    "title": "evhub-plan live state",
    "description": (
        "What a site knows at the hour it plans (evhub-plan --state FILE; docs/live.md). Times are ISO 8601 with a "
        "UTC offset; energy kWh; SOC a fraction of the battery's capacity; MOER kg CO2/kWh."
    ),
    "type": "object",
    "required": ["time", "soc", "evs", "moer_forecast", "hourly", "sessions"],
    "additionalProperties": False,
    "properties": {
        "time": {
            "type": "string",
            "description": "The hour the plan starts, on a step of the site (whole hours), e.g. "
            "2021-08-23T08:00:00-07:00.",
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
            "description": "The current MOER forecast: kg CO2/kWh for the hour of time and the next two.",
            "required": ["issued_at", "kg_per_kwh"],
            "additionalProperties": False,
            "properties": {
                "issued_at": {
                    "type": "string",
                    "description": "When it was issued: at most one step before time (else it is stale).",
                },
                "kg_per_kwh": {
                    "type": "array",
                    "items": {"type": "number", "minimum": 0},
                    "minItems": 3,
                    "maxItems": 3,
                },
            },
        },
        "hourly": {
            "description": "The realised hours from a local midnight on, in hourly.parquet's columns (time, "
            "pv_kw_per_kwp, moer_kg_per_kwh, moer_fc_h0..h2 and the 5-minute columns where the site has them): the "
            "MOER of every hour before time, the forecasts issued up to time, the PV through the controller's window. "
            "A Parquet or CSV file (path relative to this file) or the rows inline.",
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
                _timestamp(v, f"{where}[{k}].{c}")
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
    errors = sorted(jsonschema.Draft202012Validator(STATE_SCHEMA).iter_errors(raw), key=lambda e: e.path)
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".")
        raise LiveError(f"{where or 'state'}: {e.message} (state file {shown_path(path)})")
    base = path.parent
    time = _timestamp(raw["time"], "time")
    hourly = _table(raw["hourly"], base, "hourly", ("time",))
    sessions = _table(raw["sessions"], base, "sessions", ("arrival", "departure"))
    fc = raw["moer_forecast"]
    issued = _timestamp(fc["issued_at"], "moer_forecast.issued_at")
    if "time" in hourly:
        hourly = hourly.assign(time=pd.to_datetime(hourly.time, utc=True))
        row = hourly.time == time.tz_convert("UTC")
        if not row.any():
            hourly = pd.concat([hourly, pd.DataFrame({"time": [time.tz_convert("UTC")]})], ignore_index=True)
            row = hourly.time == time.tz_convert("UTC")
        for c, v in zip(FORECAST_COLUMNS, fc["kg_per_kwh"]):
            hourly[c] = hourly[c].astype(np.float64) if c in hourly else np.nan
            hourly.loc[row, c] = float(v)
    evs = [
        PluggedEV(
            socket=e["socket"],
            need_kwh=float(e["need_kwh"]),
            departure=_timestamp(e["departure"], f"evs[{k}].departure"),
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
        hourly=hourly,
        sessions=sessions,
        forecast_issued_at=issued,
        day_start=DayStart(float(ds["soc"]), float(ds["ev_need_kwh"])) if ds else None,
    )


def write_state(state: LiveState, path: str | Path) -> list[Path]:
    """Write ``state`` as a state file, its history beside it (``<stem>_hourly.parquet``, ``<stem>_sessions.parquet``);
    returns the files written. The window end of a ``--at`` state is not kept (a state file plans a whole
    horizon)."""
    path = Path(path)
    now = state.time.tz_convert("UTC")
    h = state.hourly
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
        "hourly": f"{path.stem}_hourly.parquet",
        "sessions": f"{path.stem}_sessions.parquet",
    }
    if state.day_start is not None:
        doc["day_start"] = {"soc": state.day_start.soc, "ev_need_kwh": state.day_start.ev_need_kwh}
    return [
        write_parquet(state.hourly, path.parent / doc["hourly"]),
        write_parquet(state.sessions, path.parent / doc["sessions"]),
        write_text(path, json.dumps(doc, indent=2) + "\n"),
    ]


# ------------------------------------------------------------------------------------------------ the command
@dataclass
class Args:
    """evhub-plan: plan the next hours of a site with a controller of the study and write one OCPP 1.6J
    SetChargingProfile.req per connector with a car (docs/live.md). Give the state with --state FILE, or rebuild it
    from the site's own data with --at TIME."""

    site: str = "caltech"
    """the site: a shipped name (caltech, iquitos) or the path of a site TOML"""
    controller: str | None = None
    """a causal planner of the registry (mpc, mpc_tuned_start, mpc_tuned, mpc_adaptive, mpc_rl_start, mpc_rl,
    mpc_scenario);
    default: the report's answer for the site, read from its results"""
    at: str | None = None
    """rebuild the state from the site's data at this hour (ISO 8601 with a UTC offset, e.g.
    2021-08-23T08:00:00-07:00): the cars plugged in then, each still needing its session's energy (capped at what its
    socket delivers before it leaves); the battery at its initial SOC (or --soc)"""
    state: Path | None = None
    """a state file (JSON, docs/live-state.schema.json): the time, SOC, plugged cars, MOER forecast and the history"""
    soc: float | None = None
    """with --at: the battery's SOC, [0, 1] (default: the site's initial SOC)"""
    seed: int | None = None
    """the study's seed of a tuned controller (default: the lowest one tuned)"""
    out: Path | None = None
    """write the plan (JSON) to this file, atomically (default: stdout)"""
    save_state: Path | None = None
    """with --at: also write the rebuilt state as a state file (and its history as Parquet beside it)"""
    output_dir: str = "outputs"
    """the study's output folder (its results and tuning), relative to the project root unless absolute"""
    experiment: str = ""
    """the study's experiment folder in it (default: the site's name)"""


@contextmanager
def quiet_stdout():
    """Send what native libraries print to stdout (the LP solver's banner) to stderr, so stdout carries the plan."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    try:
        os.dup2(sys.stderr.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def run(args: Args) -> LivePlan:
    """Run the command of ``args``: read or rebuild the state, plan, write the plan (and the state with
    ``--save-state``); returns the plan.

    Raises:
        LiveError: a bad request or state (nothing is written).
    """
    if (args.at is None) == (args.state is None):
        raise LiveError("--at / --state: give exactly one (the hour to rebuild the state at, or a state file)")
    if args.state is not None and (args.soc is not None or args.save_state is not None):
        raise LiveError("--soc / --save-state: only with --at (a state file carries its own SOC)")
    site = load_site(args.site)
    state = state_at(site, args.at, args.soc) if args.at is not None else read_state(args.state)
    with quiet_stdout():
        plan = make_plan(
            site, state, args.controller, seed=args.seed, output_dir=args.output_dir, experiment=args.experiment
        )
    text = json.dumps(plan.to_json(), indent=2) + "\n"
    if args.save_state is not None:
        write_state(state, args.save_state)
    if args.out is not None:
        write_text(args.out, text)
        print(
            f"wrote {args.out}: {plan.controller}, {len(plan.charging_profiles)} charging profile(s) over "
            f"{plan.horizon_h:g} h (OCPP 1.6J, validated), {plan.wall_s:.2f} s",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return plan


def main(argv: list[str] | None = None) -> int:
    """``evhub-plan`` (tyro): parse :class:`Args`, :func:`run`; an expected error prints one line and returns 1."""
    import tyro

    args = tyro.cli(Args, args=argv)
    return exit_code(lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = [
    "Args",
    "DayStart",
    "History",
    "LiveError",
    "LivePlan",
    "LiveState",
    "PluggedEV",
    "STATE_SCHEMA",
    "WeekCosts",
    "answer",
    "charging_profile",
    "history",
    "main",
    "make_plan",
    "read_state",
    "run",
    "state_at",
    "supported",
    "validate_profile",
    "write_state",
]
