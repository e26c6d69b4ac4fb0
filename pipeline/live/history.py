"""The live history as a site of its own (:func:`history`): its ``test`` split starts at the history's first local
midnight, everything after the state's time blanked, so a controller that read the future would plan on NaN.

Each session of the history is filed under a socket: the one its row gives (the optional column
:data:`SESSION_SOCKET`: where a central system's mapping put the car, whatever its charge point is called), else its
station's (:func:`envs.site.station_sockets`, the site model's rule). In the history's site every socket has one
station named after it (:func:`socket_station`) and each group's stations are its sockets' names, so a session keeps
that socket's group, power and place, as the site's own split gives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from envs import timestep
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site, SplitData, plug_socket, station_sockets
from pipeline.live.state import (
    FORECAST_COLUMNS,
    MAX_FORECAST_AGE_H,
    SESSION_COLUMNS,
    DayStart,
    LiveError,
    LiveState,
    as_timestamp,
    blank_unrealised,
)

SESSION_SOCKET = "socket"
"""An optional column of a history's sessions: the socket (0-based index) the session was at; missing or NaN: its
station's socket."""


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
    dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    now = as_timestamp(state.time, "time").tz_convert("UTC")
    if not (isinstance(state.soc, int | float) and 0.0 <= state.soc <= 1.0):
        raise LiveError(f"soc: {state.soc} is outside [0, 1] (a fraction of the battery's capacity)")
    times, origin, end, t = _window(cfg, state, now, horizon_steps)
    last_day = (end.tz_convert(cfg.timezone) - dt).date()
    first_day = origin.tz_convert(cfg.timezone).date()
    before = (first_day - pd.Timedelta(days=1)).isoformat()  # the history site's train split: unused, apart
    hcfg = cfg.replace(
        splits={"train": (before, before), "test": (first_day.isoformat(), last_day.isoformat())},
        episode={"session_keep_min": 1.0},
        ev={"sockets": _socket_groups(cfg)},
    )
    grid = pd.date_range(origin, end, freq=dt, inclusive="left")
    hh = state.series.assign(time=times).drop_duplicates("time", keep="last").set_index("time").reindex(grid)
    hh = hh.astype({c: np.float32 for c in hh.columns if hh[c].dtype.kind in "fiu"})  # the ingested data's dtype
    hh = blank_unrealised(hh, hh.index, now)  # nothing after the state's time is read
    _check_known(hh, t, horizon_steps, state, dt)
    series = hh.rename_axis("time").reset_index()

    sessions = _sessions(state.sessions, origin, now, dt, t, cfg.ev.n_sockets)
    by_name = sessions[SESSION_SOCKET].isna()
    known = set(map(str, site.sessions.station_id.unique())) | set(sessions.station_id[by_name])
    src = {
        "config": site.source.get("config", cfg.name),
        "series": "the state's series",
        "sessions": "the state's sessions",
    }
    hsite = Site(hcfg, series, _filed(cfg, sessions, station_sockets(cfg, known), origin, dt), src)
    data = hsite.split("test")
    need, left, stations, connectors, transactions = _plugged(cfg, state, known, now)
    b = cfg.bess
    energy = min(max(float(state.soc), b.soc_min), b.soc_max) * b.capacity_kwh
    if state.day_start is not None and not 0.0 <= state.day_start.soc <= 1.0:
        raise LiveError(f"day_start.soc: {state.day_start.soc} is outside [0, 1]")
    return History(hsite, data, t, energy, need, left, stations, connectors, transactions, state.day_start, site)


def _window(
    cfg, state: LiveState, now: pd.Timestamp, horizon_steps: int
) -> tuple[pd.DatetimeIndex, pd.Timestamp, pd.Timestamp, int]:
    """Where the history lies on the site's steps: ``(times, origin, end, t)``, the times of the state's series
    (UTC), the history's first local midnight (UTC), the window's end (UTC, excluded: the state's ``window_end``,
    else the local midnight after ``horizon_steps`` steps from ``now``) and the state's step from ``origin``.

    Raises:
        LiveError: a column of the series missing, no rows, a history that starts after ``now``, a time between
            steps.
    """
    tz, dt = cfg.timezone, pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    h = state.series
    missing = [c for c in ("time", "pv_kw_per_kwp", "moer_kg_per_kwh", *FORECAST_COLUMNS) if c not in h]
    if missing:
        raise LiveError(f"series: column(s) {', '.join(missing)} missing (the columns of the site's series are needed)")
    if len(h) == 0:
        raise LiveError("series: no rows (the history needs the steps before the state's time)")
    times = pd.DatetimeIndex(pd.to_datetime(h.time, utc=True))
    origin = _local_midnight(times.min(), tz, after=False)
    if origin > now:
        raise LiveError(
            f"series: the history starts at {times.min()}, and its first local midnight ({origin}) lies after the "
            f"state's time {now}: give the steps from a local midnight before it"
        )
    pos = (now - origin) / dt
    if pos != int(pos):
        raise LiveError(f"time: {state.time.isoformat()} is not on a step of the site (steps of {cfg.dt_h:g} h)")
    end = state.window_end
    if end is None:
        end = _local_midnight(now + horizon_steps * dt, tz, after=True)
    return times, origin, end.tz_convert("UTC"), int(pos)


def socket_station(socket: int, n_sockets: int) -> str:
    """The name of socket ``socket``'s one station in a history's site (``socket-007`` of 128 sockets): the names sort
    in the sockets' order."""
    return f"socket-{socket:0{len(str(max(n_sockets - 1, 0)))}d}"


def _socket_groups(cfg) -> list[dict]:
    """The site's socket groups (their count and power) with each group's stations its sockets' names
    (:func:`socket_station`), as ``ev.sockets`` tables."""
    first, out = 0, []
    for g in cfg.ev.groups:
        names = [socket_station(i, cfg.ev.n_sockets) for i in range(first, first + g.count)]
        out.append({"count": g.count, "kw": g.kw, "stations": names})
        first += g.count
    return out


def _filed(
    cfg, sessions: pd.DataFrame, by_station: dict[str, int], origin: pd.Timestamp, dt: pd.Timedelta
) -> pd.DataFrame:
    """``sessions`` filed under their sockets (module docstring): each one's station id the name of its socket (the
    column :data:`SESSION_SOCKET` where given, else its station's, ``by_station``), and one row per socket two days
    before ``origin`` (the station list, no arrival); the times ``datetime64[ns, UTC]``.

    Raises:
        LiveError: a session without a socket whose station matches no socket group of the site.
    """
    N = cfg.ev.n_sockets
    socket = sessions[SESSION_SOCKET].copy()
    by_name = socket.isna()
    socket[by_name] = sessions.station_id[by_name].map(by_station)
    if socket.isna().any():
        r = sessions[socket.isna()].iloc[0]
        patterns = ", ".join(repr(p) for g in cfg.ev.groups for p in g.stations)
        raise LiveError(
            f"sessions: session {r.session_id!r}: station {r.station_id!r} matches no socket group of the site "
            f"({patterns}): give its socket (column {SESSION_SOCKET!r}) or a station of the site"
        )
    filed = sessions[list(SESSION_COLUMNS)].assign(station_id=[socket_station(int(i), N) for i in socket])
    stamp = origin - pd.Timedelta(days=2)  # one row per socket, before the split: the station list, no arrival
    phantoms = pd.DataFrame(
        {
            "session_id": [f"live-station-{i}" for i in range(N)],
            "station_id": [socket_station(i, N) for i in range(N)],
            "arrival": stamp,
            "departure": stamp + dt,
            "energy_kwh": 0.0,
        }
    )
    all_sessions = pd.concat([filed, phantoms], ignore_index=True)
    all_sessions["arrival"] = pd.to_datetime(all_sessions.arrival, utc=True).astype("datetime64[ns, UTC]")
    all_sessions["departure"] = pd.to_datetime(all_sessions.departure, utc=True).astype("datetime64[ns, UTC]")
    return all_sessions


def _plugged(cfg, state: LiveState, known: set[str], now: pd.Timestamp) -> tuple:
    """The plugged cars as the env's socket state: ``(need, left, stations, connectors, transactions)``, ``need``
    ``(N,)`` float64 kWh and ``left`` ``(N,)`` int64 steps to departure (0: free), and each socket's charge point,
    connector and transaction (free: "", 0, None). A car given a station id takes its group's first free socket.

    Raises:
        LiveError: a car on an unknown or taken socket, a need that is not an energy >= 0, a departure not after
            ``now``.
    """
    N = cfg.ev.n_sockets
    need = np.zeros(N)
    left = np.zeros(N, np.int64)
    stations, connectors, transactions = [""] * N, [0] * N, [None] * N
    holder: dict[int, int] = {}
    by_station = station_sockets(cfg, known)
    socket_station: dict[int, str] = {}
    for st, i in sorted(by_station.items()):
        socket_station.setdefault(i, st)
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
            free = np.ones(N, bool)
            free[list(holder)] = False
            i = plug_socket(cfg, by_station[sock], free)  # taken: the group's first free socket
            if i < 0:
                raise LiveError(f"{where}.socket: {sock!r}: every socket of its group already holds a car")
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
        dep = as_timestamp(ev.departure, f"{where}.departure")
        if dep <= now:
            raise LiveError(
                f"{where}.departure: {dep.isoformat()} is not after the state's time {state.time.isoformat()} (a car "
                "that has left is not plugged in)"
            )
        holder[i] = k
        need[i] = float(ev.need_kwh)
        left[i] = timestep.steps((dep.tz_convert("UTC") - now) / pd.Timedelta(hours=1), cfg.dt_h)
        stations[i], connectors[i], transactions[i] = str(station), int(ev.connector_id), ev.transaction_id
    return need, left, stations, connectors, transactions


def _check_known(hh: pd.DataFrame, t: int, H: int, state: LiveState, dt: pd.Timedelta) -> None:
    """The history holds what a controller reads: the realised MOER of every step before ``t``, the forecasts issued
    at every step up to ``t``, the PV over the window; the current forecast is recent."""
    now = hh.index[t]
    if state.forecast_issued_at is not None:
        issued = as_timestamp(state.forecast_issued_at, "moer_forecast.issued_at")
        age = now - issued.tz_convert("UTC")
        if age < pd.Timedelta(0):
            raise LiveError(
                f"moer_forecast.issued_at: {issued.isoformat()} is after the state's time {state.time.isoformat()}"
            )
        if age > pd.Timedelta(hours=MAX_FORECAST_AGE_H):
            raise LiveError(
                f"moer_forecast.issued_at: {issued.isoformat()} is {age / pd.Timedelta(hours=1):g} h before the "
                f"state's time {state.time.isoformat()}: the MOER forecast is stale (at most {MAX_FORECAST_AGE_H:g} h "
                "old)"
            )
    checks = [("moer_kg_per_kwh", slice(0, t), "the realised MOER of every step before the state's time")]
    checks += [
        (c, slice(0, t + 1), "the MOER forecast issued at every step up to the state's time") for c in FORECAST_COLUMNS
    ]
    checks += [
        (c, slice(0, t + 1), "the 5-minute values at every step up to the state's time")
        for c in MOER_5MIN_COLUMNS
        if c in hh
    ]
    checks.append(("pv_kw_per_kwp", slice(0, min(t + H, len(hh))), f"the PV outlook over the window ({H} steps)"))
    for col, rows, what in checks:
        gap = np.flatnonzero(~np.isfinite(hh[col].to_numpy()[rows]))
        if len(gap):
            at = hh.index[rows.start + gap[0]]
            stale = " (the MOER forecast is stale)" if col in FORECAST_COLUMNS and at == now else ""
            raise LiveError(f"series: {col} missing at {at.isoformat()}{stale}: the history needs {what}")


def _sessions(
    s: pd.DataFrame, origin: pd.Timestamp, now: pd.Timestamp, dt: pd.Timedelta, t: int, n_sockets: int
) -> pd.DataFrame:
    """The history's sessions that arrived in its span, checked: none after the state's time, a socket given (column
    :data:`SESSION_SOCKET`, NaN where not given: added when missing) one of the site's."""
    missing = [c for c in SESSION_COLUMNS if c not in s]
    if missing:
        raise LiveError(f"sessions: column(s) {', '.join(missing)} missing (sessions.parquet's columns are needed)")
    given = s[SESSION_SOCKET] if SESSION_SOCKET in s else None
    s = s[list(SESSION_COLUMNS)].copy()
    for c in ("arrival", "departure"):
        s[c] = pd.to_datetime(s[c], utc=True)
    s["session_id"] = s.session_id.astype(str)
    s["station_id"] = s.station_id.astype(str)
    s["energy_kwh"] = s.energy_kwh.astype(np.float64)
    s[SESSION_SOCKET] = np.nan
    if given is not None:
        sock = pd.to_numeric(given, errors="coerce").to_numpy(np.float64)
        bad = np.flatnonzero(given.notna().to_numpy() & ~np.isin(sock, np.arange(n_sockets)))
        if len(bad):
            raise LiveError(
                f"sessions: session {s.session_id.iloc[bad[0]]!r}: socket {given.iloc[bad[0]]} is not a socket of "
                f"the site (0..{n_sockets - 1})"
            )
        s[SESSION_SOCKET] = sock
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
