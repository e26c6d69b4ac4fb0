"""The operator's page of the central system: ``GET /`` (HTML) and its data, ``GET /status.json`` (JSON), on the HTTP
port (``evhub-csms --http-port``) with the site controller's credentials (HTTP Basic, as the site's app:
:class:`pipeline.live.http_app.SiteApp` routes both here).

What it shows (:meth:`OperatorPage.status`), read from the store and the planning loop when asked:

- the charge points of the mapping: connected or not, each connector's socket, last StatusNotification and open
  transaction;
- the cars in (the open transactions): since when, the energy delivered (meter), the need and departure, told by the
  driver or the session model's expectation (the store's ``needs_source``), and the connector's limit now: the latest
  accepted profile's period covering the clock's time (:func:`profile_limit_kw`);
- the battery: its last SOC report and its set-point for the step;
- the last plans (step, controller, wall time, profiles sent) and the refusals and failures (the store's events);
- the CO2 so far against what the uncontrolled site would have emitted over the same hours (:func:`co2_so_far`).

The page is one HTML document with its CSS and a small script (no framework, no external asset: a site may have no
network) that fetches ``status.json`` every :data:`REFRESH_S` seconds and fills itself in. The page reads the central
system through its planning loop and a callable that names the connected ids (:data:`ConnectedIds`), not through the
central system itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from envs import timestep
from envs.config import SiteConfig
from envs.site import Site
from pipeline.live.planning import PlanningLoop
from pipeline.live.sources import SiteClock
from pipeline.live.state import LiveError, schedule_limit_kw
from pipeline.live.store import Store, utc_text

REFRESH_S = 5
"""How often the page fetches ``status.json``, s."""
LAST_PLANS = 8
"""How many of the last plans the page lists."""
LAST_EVENTS = 10
"""How many of the last refusals and failures the page lists."""
CO2_WAIT_S = 3.0
"""How long a request for the page's data waits for a new CO2 so far, s; then it gets the last one (the computation
goes on)."""
ROUTINE_EVENTS = ("connected", "profile_resent")
"""Kinds of the store's events that are not refusals or failures (counted, not listed)."""
ConnectedIds = Callable[[], Iterable[str]]
"""What the page asks the central system: the ids connected now (charge points and the site controller)."""
log = logging.getLogger("evhub.csms")


# ------------------------------------------------------------------------------------------------ a profile's limit
def profile_limit_kw(payload: dict, now: pd.Timestamp) -> float | None:
    """The limit a stored ``SetChargingProfile`` payload (OCPP 1.6J, as :func:`pipeline.live.charging_profile` makes
    it: ``csChargingProfiles.chargingSchedule``, rate unit W) sets at ``now``: the last period started by then, kW;
    None before ``startSchedule``, from ``startSchedule + duration`` on, or for a schedule in another unit."""
    schedule = (payload.get("csChargingProfiles") or {}).get("chargingSchedule") or {}
    if "startSchedule" not in schedule or schedule.get("chargingRateUnit", "W") != "W":
        return None
    periods = [(p["startPeriod"], p["limit"]) for p in schedule.get("chargingSchedulePeriod", [])]
    return schedule_limit_kw(schedule["startSchedule"], schedule.get("duration"), periods, now)


def accepted_profiles(store: Store) -> dict[tuple[str, int], dict]:
    """The latest accepted profile of each connector: ``{(charge point, connector): row}`` (``payload`` parsed)."""
    rows = store.db.execute(
        "SELECT p.* FROM profiles p JOIN (SELECT charge_point, connector, MAX(id) AS id FROM profiles "
        "WHERE status = 'accepted' GROUP BY charge_point, connector) latest ON p.id = latest.id"
    ).fetchall()
    return {(r["charge_point"], r["connector"]): dict(r) | {"payload": json.loads(r["payload"])} for r in rows}


# ------------------------------------------------------------------------------------------------ the CO2 so far
@dataclass
class Record:
    """What the CO2 so far is computed from, read from the store (:meth:`read`): every transaction (the store's rows),
    the meter readings (``transaction_id``, ``time`` UTC, ``energy_wh``: the register, Wh) and the battery's SOC
    reports (``time`` UTC, ``soc`` fraction), each sorted by time."""

    transactions: list[dict]
    meters: pd.DataFrame
    soc: pd.DataFrame

    @classmethod
    def read(cls, store: Store) -> Record:
        """Read it (in the store's thread: a SQLite connection stays in its thread)."""
        meters = pd.DataFrame(
            [tuple(r) for r in store.db.execute(
                "SELECT transaction_id, time, energy_wh FROM meter_values ORDER BY transaction_id, time, rowid"
            ).fetchall()],
            columns=["transaction_id", "time", "energy_wh"],
        )  # fmt: skip
        soc = pd.DataFrame(
            [tuple(r) for r in store.db.execute(
                "SELECT time, value FROM battery WHERE kind = 'soc' ORDER BY time, rowid"
            ).fetchall()],
            columns=["time", "soc"],
        )  # fmt: skip
        meters["time"] = pd.to_datetime(meters.time, utc=True, format="ISO8601")
        soc["time"] = pd.to_datetime(soc.time, utc=True, format="ISO8601")
        return cls(store.transactions(), meters, soc)

    def span(self, dt: pd.Timedelta, now: pd.Timestamp) -> tuple[pd.Timestamp, pd.Timestamp] | None:
        """The steps counted, UTC ``[start, end)``: from the step of the first record (a SOC report or a transaction's
        start) to the step of the last SOC report (the battery's flows are known up to it; without a report: the
        step of ``now``), never past ``now``'s step; None when nothing is recorded yet or no step has ended."""
        firsts = [pd.Timestamp(t["start_time"]).tz_convert("UTC") for t in self.transactions]
        if len(self.soc):
            firsts.append(self.soc.time.iloc[0])
        if not firsts:
            return None
        last = pd.Timestamp(now).tz_convert("UTC")
        if len(self.soc):
            last = min(last, self.soc.time.iloc[-1])
        start, end = min(firsts).floor(dt), last.floor(dt)
        return (start, end) if end > start else None


def _seconds(times, origin: pd.Timestamp) -> np.ndarray:
    """Times (UTC) as float64 seconds after ``origin``, whatever their resolution."""
    return np.asarray((pd.DatetimeIndex(times) - origin) / pd.Timedelta(seconds=1), dtype=np.float64)


def metered_kwh(meters: pd.DataFrame, edges: pd.DatetimeIndex) -> np.ndarray:
    """The EV energy of each step between ``edges`` (``(T + 1,)`` UTC), kWh ``(T,)``, from the meter readings: each
    transaction's register read as rising linearly between two readings (exact where the readings fall on the steps,
    as a charger reporting each step gives them), nothing before its first reading or after its last."""
    x_edges = _seconds(edges, edges[0])
    total = np.zeros(len(edges) - 1)
    for _, g in meters.drop_duplicates(["transaction_id", "time"], keep="last").groupby("transaction_id", sort=False):
        wh = np.maximum.accumulate(g.energy_wh.to_numpy(np.float64))
        register = np.interp(x_edges, _seconds(g.time, edges[0]), wh - wh[0])
        total += np.diff(register)
    return total / 1000.0


def battery_kwh(soc: pd.DataFrame, edges: pd.DatetimeIndex, cfg: SiteConfig) -> tuple[np.ndarray, np.ndarray]:
    """The battery's charge and discharge of each step between ``edges``, kWh on the AC side ``(T,)`` each, from its
    SOC reports: a rise of the stored energy ``dE`` took ``dE / eta_charge``, a fall gave ``-dE * eta_discharge``
    (the env's battery, :mod:`envs.evhub`), spread evenly between two reports; idle before the first report and
    after the last."""
    b = cfg.bess
    if len(soc) < 2 or b.capacity_kwh <= 0:
        return np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    d = np.diff(soc.soc.to_numpy(np.float64) * b.capacity_kwh)
    x, x_edges = _seconds(soc.time, edges[0]), _seconds(edges, edges[0])
    out = []
    for flow in (np.clip(d, 0.0, None) / b.eta_charge, np.clip(-d, 0.0, None) * b.eta_discharge):
        out.append(np.diff(np.interp(x_edges, x, np.concatenate([[0.0], np.cumsum(flow)]))))
    return out[0], out[1]


def _grid_co2(cfg: SiteConfig, net_kwh: np.ndarray, moer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each step's grid import (kWh) and CO2 (kg) from the site's net demand ``net_kwh`` (+ imports), as the env
    counts them: a surplus exported where the site may export (credited at the MOER with ``grid.export_credit =
    "moer"``), else curtailed."""
    grid_import = np.clip(net_kwh, 0.0, None)
    export = np.clip(-net_kwh, 0.0, None) if cfg.grid.export_allowed else np.zeros_like(net_kwh)
    credit = 1.0 if cfg.grid.export_credit == "moer" else 0.0
    return grid_import, (grid_import - credit * export) * moer


def _counterfactual_site(site: Site, record: Record, series: pd.DataFrame, mapping: dict, start, end) -> Site:
    """The uncontrolled site's data as a site of its own (:func:`uncontrolled_traces`): its ``test`` split the local
    days holding ``[start, end)``, the feed's PV and MOER over them (0 where the feed has none: such steps are not
    counted), and one session per transaction that overlaps them, at its connector's socket, from its start to its
    stop (or the departure it is planned with), asking what the car took (a stopped transaction: its meter) or its
    need (told or expected; at least what it took so far). Each socket has one station, named after it, in its group
    (``ev.sockets``: the site's groups, their count and power), so a car keeps its socket, group and power."""
    cfg = site.config
    dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    names = [f"socket-{i:0{len(str(max(cfg.ev.n_sockets - 1, 0)))}d}" for i in range(cfg.ev.n_sockets)]
    first, groups = 0, []
    for g in cfg.ev.groups:
        groups.append({"count": g.count, "kw": g.kw, "stations": names[first : first + g.count]})
        first += g.count
    first_day, last_day = start.tz_convert(cfg.timezone).date(), (end - dt).tz_convert(cfg.timezone).date()
    before = (first_day - pd.Timedelta(days=1)).isoformat()
    hcfg = cfg.replace(
        splits={"train": (before, before), "test": (first_day.isoformat(), last_day.isoformat())},
        episode={"session_keep_min": 1.0},
        ev={"sockets": groups},
    )
    origin, stop = hcfg.split_bounds("test")
    known = series.assign(time=pd.to_datetime(series.time, utc=True)).drop_duplicates("time", keep="last")
    h = known.set_index("time").reindex(pd.date_range(origin, stop, freq=dt, inclusive="left"))
    h = h[["pv_kw_per_kwp", "moer_kg_per_kwh"]].fillna(0.0).assign(moer_fc_h0=0.0, moer_fc_h1=0.0, moer_fc_h2=0.0)
    taken = record.meters.groupby("transaction_id").energy_wh.agg(["first", "max"])
    rows = []
    for tx in record.transactions:
        socket, leaves = mapping.get((tx["charge_point"], tx["connector"])), tx["stop_time"] or tx["departure"]
        arrival, departure = pd.Timestamp(tx["start_time"]), pd.Timestamp(leaves) if leaves else end
        if socket is None or arrival >= end or departure <= origin:
            continue
        got = (taken.loc[tx["id"], "max"] - taken.loc[tx["id"], "first"]) / 1000.0 if tx["id"] in taken.index else 0.0
        energy = got if tx["stop_time"] or tx["need_kwh"] is None else max(float(tx["need_kwh"]), got)
        rows.append((f"tx-{tx['id']}", names[socket], arrival, departure, energy))
    stamp = origin - pd.Timedelta(days=2)  # the station list, before the split: no arrival
    rows += [(f"station-{name}", name, stamp, stamp + dt, 0.0) for name in names]
    sessions = pd.DataFrame(rows, columns=["session_id", "station_id", "arrival", "departure", "energy_kwh"])
    for c in ("arrival", "departure"):
        sessions[c] = pd.to_datetime(sessions[c], utc=True).astype("datetime64[ns, UTC]")
    src = {"config": site.source.get("config", cfg.name), "series": "the MOER feed", "sessions": "the store"}
    return Site(hcfg, h.rename_axis("time").reset_index(), sessions, src)


def uncontrolled_traces(
    site: Site, record: Record, series: pd.DataFrame, mapping: dict, start: pd.Timestamp, end: pd.Timestamp
) -> pd.DataFrame:
    """The uncontrolled site over the local days holding ``[start, end)``, run through the study's env as the study
    runs its ``uncontrolled`` row (:func:`pipeline.control.baselines.uncontrolled`: each car at full power from its
    arrival until it has what it asks, the battery idle; :func:`envs.kpis.rollout_traces`) on the cars of the
    transactions, the feed's PV and MOER (``series``: ``time``, ``pv_kw_per_kwp``, ``moer_kg_per_kwh``) and the site's
    base load. Returns its traces, one row per step of those days (:data:`envs.kpis.TRACE_COLUMNS`)."""
    from envs.kpis import rollout_traces
    from pipeline.control.baselines import uncontrolled

    counterfactual = _counterfactual_site(site, record, series, mapping, start, end)
    return rollout_traces(uncontrolled, counterfactual, "test", "hub", bess_action="setpoint")[0]


def co2_so_far(site: Site, record: Record, series: pd.DataFrame, mapping: dict, now: pd.Timestamp) -> dict | None:
    """The site's CO2 so far and the uncontrolled site's over the same steps (:meth:`Record.span`), from the store and
    the MOER feed's ``series`` (its realised MOER and PV at the span's end; ``time``, ``pv_kw_per_kwp``,
    ``moer_kg_per_kwh``).

    What it counts, step by step: the EV energy from the chargers' meters (:func:`metered_kwh`), the battery's
    charge and discharge from its SOC reports (:func:`battery_kwh`), the PV of the feed (``pv_kw_per_kwp`` x the
    site's kWp: the modelled PV, not a PV meter) and the site's configured base load (``grid.base_load_kw``); the grid
    import is what they leave (import = load + EVs + charge - PV - discharge where positive; a surplus exported where
    the site may, else curtailed), its CO2 import x MOER (net of export x MOER with ``grid.export_credit =
    "moer"``). The uncontrolled site is the study's (:func:`uncontrolled_traces`): the same cars at full power from
    arrival, the battery idle. Steps without a realised MOER are left out of both (counted).

    What it cannot know: a building load besides the configured one, PV that differs from the model (clouds,
    soiling), energy a charger used between its last reading and the span's end (a charger off line), a battery that
    did not report its SOC (taken as idle). A car still plugged in has taken more by now in the uncontrolled site (at
    full power from arrival) than it has here: the difference evens out as the cars leave.

    Returns:
        ``None`` before anything is recorded, else ``{"start", "end"`` (UTC ISO 8601), ``"hours", "steps",
        "steps_without_moer", "co2_kg", "uncontrolled_co2_kg", "saved_kg", "saved_pct"`` (of the uncontrolled),
        ``"ev_kwh", "uncontrolled_ev_kwh", "grid_import_kwh", "uncontrolled_grid_import_kwh", "pv_kwh"}`` (kWh over
        the steps counted).
    """
    cfg = site.config
    dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    span = record.span(dt, now)
    if span is None:
        return None
    start, end = span
    edges = pd.date_range(start, end, freq=dt)
    times = edges[:-1]
    s = series.assign(time=pd.to_datetime(series.time, utc=True)).drop_duplicates("time", keep="last")
    s = s.set_index("time").reindex(times)
    moer = s.moer_kg_per_kwh.to_numpy(np.float64)
    known = np.isfinite(moer)
    pv_kwh = np.nan_to_num(s.pv_kw_per_kwp.to_numpy(np.float64)) * cfg.pv.kwp * cfg.dt_h
    ev_kwh = metered_kwh(record.meters, edges)
    charge, discharge = battery_kwh(record.soc, edges, cfg)
    net = cfg.grid.base_load_kw * cfg.dt_h + ev_kwh + charge - pv_kwh - discharge
    grid_import, co2 = _grid_co2(cfg, net, np.where(known, moer, 0.0))
    traces = uncontrolled_traces(site, record, series, mapping, start, end)
    at = pd.DatetimeIndex(pd.to_datetime(traces.time, utc=True))
    rows = at.isin(times[known])
    base = traces[rows]
    co2_kg, base_kg = float(co2[known].sum()), float(base.co2_kg.sum())
    return {
        "start": utc_text(start),
        "end": utc_text(end),
        "hours": timestep.hours(len(times), cfg.dt_h),
        "steps": len(times),
        "steps_without_moer": int((~known).sum()),
        "co2_kg": co2_kg,
        "uncontrolled_co2_kg": base_kg,
        "saved_kg": base_kg - co2_kg,
        "saved_pct": 100.0 * (base_kg - co2_kg) / base_kg if base_kg > 0 else None,
        "ev_kwh": float(ev_kwh[known].sum()),
        "uncontrolled_ev_kwh": float(base.ev_charge_kw.sum() * cfg.dt_h),
        "grid_import_kwh": float(grid_import[known].sum()),
        "uncontrolled_grid_import_kwh": float(base.grid_import_kw.sum() * cfg.dt_h),
        "pv_kwh": float(pv_kwh[known].sum()),
    }


# ------------------------------------------------------------------------------------------------ the page's data
def _local(ts, tz: str) -> str | None:
    """A time as the page shows it: the site's local time to the minute (None stays None)."""
    return None if ts is None else pd.Timestamp(ts).tz_convert(tz).strftime("%a %d %b %H:%M")


def _clean(x):
    """``x`` with every float that is not finite as None (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def cars_in(store: Store, mapping: dict, now: pd.Timestamp, tz: str, profiles: dict) -> list[dict]:
    """The open transactions as the page lists them: where (charge point, connector, socket), since when, the energy
    delivered (kWh, from the meter), the need and what is still needed (kWh), the departure, who said so
    (``needs_source``: ``driver`` or ``expected``) and the connector's limit now (kW; None: no accepted profile of the
    transaction covers now, the charger's own default applies)."""
    out = []
    for tx in store.open_transactions():
        where = (tx["charge_point"], tx["connector"])
        reading = tx["energy_wh"] if tx["energy_wh"] is not None else tx["meter_start_wh"]
        delivered = max(0.0, (reading - tx["meter_start_wh"]) / 1000.0)
        profile = profiles.get(where)
        limit = None
        if profile is not None and profile["transaction_id"] == tx["id"]:
            limit = profile_limit_kw(profile["payload"], now)
        need = tx["need_kwh"]
        out.append(
            {
                "id": tx["id"], "charge_point": where[0], "connector": where[1], "socket": mapping.get(where),
                "start": tx["start_time"], "start_local": _local(tx["start_time"], tz), "delivered_kwh": delivered,
                "need_kwh": need, "remaining_kwh": None if need is None else max(0.0, need - delivered),
                "departure": tx["departure"], "departure_local": _local(tx["departure"], tz),
                "needs_source": tx["needs_source"] if need is not None else None, "limit_kw": limit,
            }
        )  # fmt: skip
    return out


def charge_points(store: Store, mapping: dict, connected: set[str], cars: list[dict], tz: str) -> list[dict]:
    """The charge points of the mapping and the site controllers: each one's id, role, whether it is connected, and
    its connectors (those of the mapping and those it sent a status of): socket, last status (with its time and error
    code), the open transaction there and its limit now (kW)."""
    roles = dict(store.db.execute("SELECT id, role FROM charge_points").fetchall())
    connectors: dict[str, dict[int, dict]] = {cp: {} for cp in sorted({cp for cp, _ in mapping})}
    connectors.update({cp: {} for cp, role in sorted(roles.items()) if role == "site"})

    def slot(cp: str, n: int) -> dict:
        blank = {"connector": n, "socket": mapping.get((cp, n)), "status": None, "status_time": None}
        blank |= {"status_local": None, "error_code": None, "transaction_id": None, "limit_kw": None}
        return connectors.setdefault(cp, {}).setdefault(n, blank)

    for cp, n in sorted(mapping):
        slot(cp, n)
    for row in store.connector_statuses():
        slot(row["charge_point"], row["connector"]).update(
            status=row["status"], status_time=row["time"], status_local=_local(row["time"], tz),
            error_code=row["error_code"],
        )  # fmt: skip
    for car in cars:
        slot(car["charge_point"], car["connector"]).update(transaction_id=car["id"], limit_kw=car["limit_kw"])
    return [
        {
            "id": cp,
            "role": roles.get(cp, "unregistered"),
            "connected": cp in connected,
            "connectors": [c for _, c in sorted(slots.items())],
        }
        for cp, slots in connectors.items()
    ]


def plans_done(store: Store, held: int, tz: str) -> dict:
    """The plans made: how many, their mean and largest wall time (s), how many steps held the last plan, and the
    last :data:`LAST_PLANS` (step, controller, wall time, profiles sent), latest first."""
    count, mean, most = store.db.execute("SELECT COUNT(*), AVG(wall_s), MAX(wall_s) FROM plans").fetchone()
    last = store.db.execute("SELECT * FROM plans ORDER BY rowid DESC LIMIT ?", (LAST_PLANS,)).fetchall()
    rows = [dict(r) | {"local": _local(r["time"], tz)} for r in last]
    return {"count": count, "mean_wall_s": mean, "max_wall_s": most, "held": held, "last": rows}


def refusals(store: Store, tz: str) -> dict:
    """The store's events: how many of each kind, and the last :data:`LAST_EVENTS` refusals and failures (every kind
    but :data:`ROUTINE_EVENTS`), latest first."""
    counts = dict(store.db.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind ORDER BY kind").fetchall())
    marks = ", ".join("?" * len(ROUTINE_EVENTS))
    last = store.db.execute(
        f"SELECT * FROM events WHERE kind NOT IN ({marks}) ORDER BY rowid DESC LIMIT ?", (*ROUTINE_EVENTS, LAST_EVENTS)
    ).fetchall()
    return {"counts": counts, "last": [dict(r) | {"local": _local(r["time"], tz)} for r in last]}


class OperatorPage:
    """The operator's page (module docstring): :meth:`html` and :meth:`status`.

    Args:
        planning: the central system's planning loop (its site, store, clock, feed, mapping, options, battery
            set-point, last error). connected: the ids connected now (:data:`ConnectedIds`; default: none known).
    """

    def __init__(self, planning: PlanningLoop, connected: ConnectedIds | None = None):
        self.planning = planning
        self.connected = connected or (lambda: ())
        self.co2_key: tuple | None = None
        self.co2_doc: dict | None = None
        self.co2_task: asyncio.Future | None = None
        self.co2_task_key: tuple | None = None

    def html(self) -> bytes:
        """The page, UTF-8 HTML (the same every time: it fills itself in from ``status.json``)."""
        return PAGE.replace("%REFRESH_MS%", str(int(REFRESH_S * 1000))).encode()

    async def status(self) -> dict:
        """The page's data (``status.json``; every number straight from the store or the planning loop, but the CO2:
        :meth:`co2`). Times are UTC ISO 8601, each with its site-local text (``*_local``); energy kWh, power kW; None
        where nothing is known."""
        planning, store = self.planning, self.planning.store
        cfg, mapping = planning.site.config, planning.mapping
        tz = cfg.timezone
        now = planning.time_or_now().tz_convert("UTC")
        connected = set(self.connected())
        cars = cars_in(store, mapping, now, tz, accepted_profiles(store))
        points = charge_points(store, mapping, connected, cars, tz)
        soc = store.latest_battery("soc")
        setpoint = planning.battery_doc or {}
        if not setpoint and (got := store.latest_battery("setpoint_kw")) is not None:
            setpoint = {"time": utc_text(got[0]), "setpoint_kw": got[1]}
        mapped = [p for p in points if p["role"] != "site"]
        doc = {
            "site": cfg.name, "controller": planning.options.controller, "timezone": tz, "dt_h": cfg.dt_h,
            "clock": {"time": utc_text(now), "local": _local(now, tz),
                      "kind": "site" if isinstance(planning.clock, SiteClock) else "wall"},
            "generated_at": utc_text(pd.Timestamp.now(tz="UTC").floor("s")), "last_error": planning.last_error,
            "summary": {"cars_in": len(cars), "sockets": cfg.ev.n_sockets, "charge_points": len(mapped),
                        "connected": sum(p["connected"] for p in mapped),
                        "site_controller_connected": any(p["connected"] for p in points if p["role"] == "site")},
            "battery": {"soc": soc[1] if soc else None, "soc_time": utc_text(soc[0]) if soc else None,
                        "soc_local": _local(soc[0], tz) if soc else None, "setpoint_kw": setpoint.get("setpoint_kw"),
                        "setpoint_time": setpoint.get("time"), "setpoint_local": _local(setpoint.get("time"), tz),
                        "capacity_kwh": cfg.bess.capacity_kwh, "power_kw": cfg.bess.power_kw},
            "cars": cars, "charge_points": points, "plans": plans_done(store, planning.held, tz),
            "events": refusals(store, tz), "co2": await self.co2(now),
        }  # fmt: skip
        if doc["co2"] and "start" in doc["co2"]:
            doc["co2"] = doc["co2"] | {k + "_local": _local(doc["co2"][k], tz) for k in ("start", "end")}
        return _clean(doc)

    # ------------------------------------------------------------------------------------------ the CO2
    def _co2_key(self, now: pd.Timestamp) -> tuple:
        """What the CO2 so far depends on, read cheaply: the step, the last SOC report, the transactions (how many,
        stopped, their needs) and the last meter reading."""
        db, dt = self.planning.store.db, self.planning.dt
        tx = tuple(db.execute("SELECT COUNT(*), COUNT(stop_time), TOTAL(need_kwh) FROM transactions").fetchone())
        meter = db.execute("SELECT MAX(rowid) FROM meter_values").fetchone()[0]
        return now.floor(dt), self.planning.store.latest_battery("soc"), tx, meter

    async def co2(self, now: pd.Timestamp) -> dict | None:
        """The CO2 so far (:func:`co2_so_far`; None before anything is recorded; ``{"error": why}`` where it cannot be
        computed), computed in a worker thread when what it reads has changed, one computation at a time; a request
        waits for it up to :data:`CO2_WAIT_S`, then gets the last one (its ``end`` says how far it goes; ``{"note":
        ...}`` before the first), the computation going on."""
        key = self._co2_key(now)
        self._take_co2()
        if key != self.co2_key and (self.co2_task is None or self.co2_task.done()):
            record = Record.read(self.planning.store)  # here: the store's connection stays in the event loop's thread
            self.co2_task_key = key
            self.co2_task = asyncio.ensure_future(asyncio.to_thread(self._co2_of, record, now))
        if key != self.co2_key and not self.co2_task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.co2_task), CO2_WAIT_S)
        self._take_co2()
        return {"note": "the CO2 so far is being computed"} if self.co2_key is None else self.co2_doc

    def _take_co2(self) -> None:
        """Keep the result of the last computation when it is done."""
        if self.co2_task is not None and self.co2_task.done() and self.co2_key != self.co2_task_key:
            self.co2_key, self.co2_doc = self.co2_task_key, self.co2_task.result()

    def _co2_of(self, record: Record, now: pd.Timestamp) -> dict | None:
        planning = self.planning
        try:
            span = record.span(planning.dt, now)
            if span is None:
                return None
            series = planning.feed.history(span[1]).series
            return co2_so_far(planning.site, record, series, planning.mapping, now)
        except LiveError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the page stays up; the error is logged and shown
            log.exception("the operator's page: the CO2 so far failed")
            return {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------------------------------------ the page
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>evhub-csms: the site</title>
<link rel="icon" href="data:,">
<style>
:root { --ink: #1d2733; --dim: #5f6b7a; --line: #dde3ea; --bg: #f4f6f9; --ok: #1f8a4c; --warn: #b26b00;
        --bad: #c0392b; --accent: #2563a8; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink);
       background: var(--bg); }
header { display: flex; align-items: baseline; justify-content: space-between; gap: 16px; padding: 12px 24px;
         background: #1d2733; color: #fff; }
header h1 { margin: 0; font-size: 18px; font-weight: 600; }
header .meta { color: #c9d3df; }
header b { color: #fff; font-weight: 600; }
main { padding: 16px 24px 24px; max-width: 1400px; margin: 0 auto; }
.pill { display: inline-block; padding: 1px 8px; border-radius: 10px; background: var(--ok); color: #fff;
        font-size: 12px; }
.pill.bad { background: var(--bad); }
.tiles { display: grid; grid-template-columns: repeat(5, 1fr); gap: 12px; margin-bottom: 12px; }
.tile, .panel { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px; }
.label { color: var(--dim); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.big { font-size: 28px; font-weight: 600; font-variant-numeric: tabular-nums; }
.big small { font-size: 14px; font-weight: 400; color: var(--dim); }
.sub { color: var(--dim); font-size: 13px; }
.tile.co2 .big { color: var(--ok); }
.tile.co2.worse .big { color: var(--bad); }
.banner { background: #fdecea; border: 1px solid #f5c2bd; color: var(--bad); border-radius: 8px; padding: 8px 12px;
          margin-bottom: 12px; }
.row { display: grid; grid-template-columns: 2fr 1fr; gap: 12px; margin-bottom: 12px; }
.row.even { grid-template-columns: 1fr 1fr; }
h2 { margin: 0 0 8px; font-size: 15px; }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 6px; border-bottom: 1px solid var(--line); white-space: nowrap; }
th { color: var(--dim); font-weight: 500; font-size: 12px; }
td.num, th.num { text-align: right; }
td.detail { white-space: normal; word-break: break-word; }
td.empty { color: var(--dim); text-align: center; }
.expected { color: var(--warn); }
dl { display: grid; grid-template-columns: auto 1fr; gap: 4px 12px; margin: 8px 0 0; }
dt { color: var(--dim); }
dd { margin: 0; text-align: right; font-variant-numeric: tabular-nums; }
.note { color: var(--dim); font-size: 12px; margin: 8px 0 0; }
.chips { display: grid; grid-template-columns: repeat(auto-fill, minmax(140px, 1fr)); gap: 6px; }
.chip { border: 1px solid var(--line); border-radius: 6px; padding: 4px 8px; font-size: 12px; }
.chip .id { font-weight: 600; }
.chip .dot { display: inline-block; width: 8px; height: 8px; border-radius: 4px; background: var(--bad);
             margin-right: 6px; }
.chip.on .dot { background: var(--ok); }
.chip .st { color: var(--dim); }
.st.Charging { color: var(--ok); } .st.Faulted, .st.Unavailable { color: var(--bad); }
.counts { color: var(--dim); font-size: 12px; margin-bottom: 6px; }
#event-counts span { display: inline-block; margin: 0 6px 6px 0; padding: 1px 6px; border-radius: 4px;
                     background: var(--bg); color: var(--ink); }
footer { color: var(--dim); font-size: 12px; margin-top: 8px; }
</style>
</head>
<body>
<header>
  <h1>evhub-csms &middot; <span id="site">&ndash;</span></h1>
  <div class="meta">site time <b id="clock">&ndash;</b> (<span id="timezone"></span>, <span id="clock-kind"></span>
    clock) &middot; planner <b id="controller">&ndash;</b> &middot;
    <span id="live" class="pill bad">waiting</span></div>
</header>
<main>
<section class="tiles">
  <div class="tile"><div class="label">Cars in</div>
    <div class="big"><span id="cars-in">&ndash;</span> <small>of <span id="sockets">&ndash;</span> sockets</small></div>
    <div class="sub"><span id="cars-need">&ndash;</span> kWh still to deliver</div></div>
  <div class="tile"><div class="label">Charge points connected</div>
    <div class="big"><span id="cp-connected">&ndash;</span> <small>of <span id="cp-total">&ndash;</span></small></div>
    <div class="sub">site controller <span id="site-connected">&ndash;</span></div></div>
  <div class="tile"><div class="label">Battery set-point</div>
    <div class="big"><span id="setpoint-kw">&ndash;</span> <small>kW (+ charges)</small></div>
    <div class="sub">SOC <span id="soc-pct">&ndash;</span> % at <span id="soc-time">&ndash;</span></div></div>
  <div class="tile"><div class="label">Plans made</div>
    <div class="big"><span id="plans-made">&ndash;</span></div>
    <div class="sub">last took <span id="last-plan-s">&ndash;</span> s; <span id="plans-held">&ndash;</span> steps
      held</div></div>
  <div class="tile co2"><div class="label">CO2 saved so far</div>
    <div class="big"><span id="saved-kg">&ndash;</span> <small>kg (<span id="saved-pct">&ndash;</span> %)</small></div>
    <div class="sub"><span id="co2-kg">&ndash;</span> kg here vs <span id="uncontrolled-kg">&ndash;</span> kg
      uncontrolled</div></div>
</section>
<div id="error" class="banner" hidden></div>
<section class="row">
  <div class="panel"><h2>Cars in</h2>
    <table><thead><tr><th>Charge point</th><th>Conn.</th><th class="num">Socket</th><th>Since</th>
      <th class="num">Delivered kWh</th><th class="num">Need kWh</th><th class="num">Still kWh</th><th>Leaves</th>
      <th>Needs from</th><th class="num">Limit now kW</th></tr></thead><tbody id="cars"></tbody></table></div>
  <div class="panel"><h2>CO2 so far</h2>
    <p class="sub"><span id="co2-span">&ndash;</span></p>
    <table><thead><tr><th></th><th class="num">This site</th><th class="num">Uncontrolled</th></tr></thead><tbody>
      <tr><td>CO2, kg</td><td class="num"><span id="co2-kg-2">&ndash;</span></td>
        <td class="num"><span id="uncontrolled-kg-2">&ndash;</span></td></tr>
      <tr><td>EV energy, kWh</td><td class="num"><span id="ev-kwh">&ndash;</span></td>
        <td class="num"><span id="uncontrolled-ev-kwh">&ndash;</span></td></tr>
      <tr><td>Grid import, kWh</td><td class="num"><span id="import-kwh">&ndash;</span></td>
        <td class="num"><span id="uncontrolled-import-kwh">&ndash;</span></td></tr>
    </tbody></table>
    <dl>
      <dt>Saved</dt><dd><span id="saved-kg-2">&ndash;</span> kg</dd>
      <dt>PV (modelled)</dt><dd><span id="pv-kwh">&ndash;</span> kWh</dd>
      <dt>Steps without MOER</dt><dd><span id="no-moer">&ndash;</span></dd>
    </dl>
    <p class="note">Here: the chargers' meters, the battery's SOC reports, the modelled PV and the configured base load,
      at the grid's MOER. Uncontrolled: the same cars at full power from arrival, the battery idle, through the study's
      env. Neither knows a building load besides the configured one. Cars still in have taken more by now in the
      uncontrolled site.</p></div>
</section>
<section class="panel" style="margin-bottom: 12px"><h2>Charge points</h2><div id="cps" class="chips"></div></section>
<section class="row even">
  <div class="panel"><h2>Last plans</h2>
    <table><thead><tr><th>Step</th><th>Planner</th><th class="num">Wall s</th><th class="num">Profiles</th></tr>
      </thead><tbody id="plans"></tbody></table>
    <p class="note">Mean <span id="plan-mean-s">&ndash;</span> s, longest <span id="plan-max-s">&ndash;</span> s.</p>
  </div>
  <div class="panel"><h2>Refusals and failures</h2><div class="counts">All events by kind:
    <span id="event-counts"></span></div>
    <table><thead><tr><th>When</th><th>What</th><th>Detail</th></tr></thead><tbody id="events"></tbody></table></div>
</section>
<footer>Refreshed every %REFRESH_MS% ms from <code>status.json</code>, last fetched at
  <span id="generated">&ndash;</span> (UTC, wall clock).</footer>
</main>
<script>
(function () {
  "use strict";
  var REFRESH_MS = %REFRESH_MS%;
  function el(id) { return document.getElementById(id); }
  function num(x, digits) { return x === null || x === undefined ? "\\u2013" : Number(x).toFixed(digits); }
  function put(id, text) { el(id).textContent = text === null || text === undefined ? "\\u2013" : String(text); }
  function cell(tr, text, field, cls) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "\\u2013" : String(text);
    if (field) { td.setAttribute("data-field", field); }
    if (cls) { td.className = cls; }
    tr.appendChild(td);
    return td;
  }
  function rows(id, items, each, empty) {
    var body = el(id);
    while (body.firstChild) { body.removeChild(body.firstChild); }
    if (!items.length) {
      var tr = document.createElement("tr");
      var td = cell(tr, empty, null, "empty");
      td.colSpan = 10;
      body.appendChild(tr);
      return;
    }
    items.forEach(function (item) { var tr = document.createElement("tr"); each(tr, item); body.appendChild(tr); });
  }
  function car(tr, c) {
    tr.setAttribute("data-tx", c.id);
    cell(tr, c.charge_point, "charge_point"); cell(tr, c.connector, "connector");
    cell(tr, c.socket, "socket", "num"); cell(tr, c.start_local, "start");
    cell(tr, num(c.delivered_kwh, 2), "delivered_kwh", "num"); cell(tr, num(c.need_kwh, 2), "need_kwh", "num");
    cell(tr, num(c.remaining_kwh, 2), "remaining_kwh", "num"); cell(tr, c.departure_local, "departure");
    cell(tr, c.needs_source, "needs_source", c.needs_source === "expected" ? "expected" : "");
    cell(tr, c.limit_kw === null ? "none" : num(c.limit_kw, 2), "limit_kw", "num");
  }
  function chip(p) {
    var div = document.createElement("div");
    div.className = "chip" + (p.connected ? " on" : "");
    div.setAttribute("data-cp", p.id);
    div.setAttribute("data-connected", p.connected ? "yes" : "no");
    var head = document.createElement("div");
    var dot = document.createElement("span"); dot.className = "dot"; head.appendChild(dot);
    var id = document.createElement("span"); id.className = "id"; id.textContent = p.id; head.appendChild(id);
    if (p.role === "site") { head.appendChild(document.createTextNode(" (site controller)")); }
    div.appendChild(head);
    p.connectors.forEach(function (c) {
      var line = document.createElement("div");
      line.setAttribute("data-connector", c.connector);
      var st = document.createElement("span");
      st.className = "st " + (c.status || "");
      st.setAttribute("data-field", "status");
      st.textContent = c.status || "no status yet";
      line.appendChild(document.createTextNode(c.connector + ": "));
      line.appendChild(st);
      if (c.error_code && c.error_code !== "NoError") { line.appendChild(document.createTextNode(" " + c.error_code)); }
      if (c.transaction_id !== null) {
        line.appendChild(document.createTextNode(" \\u00b7 " + (c.limit_kw === null ? "no profile"
          : num(c.limit_kw, 1) + " kW")));
      }
      div.appendChild(line);
    });
    return div;
  }
  function render(d) {
    var s = d.summary, b = d.battery, p = d.plans, co2 = d.co2 || {};
    put("site", d.site); put("clock", d.clock.local); put("timezone", d.timezone); put("clock-kind", d.clock.kind);
    put("controller", d.controller); put("generated", d.generated_at);
    put("cars-in", s.cars_in); put("sockets", s.sockets); put("cp-connected", s.connected);
    put("cp-total", s.charge_points);
    put("site-connected", s.site_controller_connected ? "connected" : "not connected");
    put("cars-need", num(d.cars.reduce(function (a, c) { return a + (c.remaining_kwh || 0); }, 0), 1));
    put("setpoint-kw", num(b.setpoint_kw, 2)); put("soc-pct", b.soc === null ? null : num(100 * b.soc, 1));
    put("soc-time", b.soc_local);
    put("plans-made", p.count); put("plans-held", p.held); put("plan-mean-s", num(p.mean_wall_s, 3));
    put("plan-max-s", num(p.max_wall_s, 3)); put("last-plan-s", p.last.length ? num(p.last[0].wall_s, 3) : null);
    ["co2-kg", "co2-kg-2"].forEach(function (id) { put(id, num(co2.co2_kg, 2)); });
    ["uncontrolled-kg", "uncontrolled-kg-2"].forEach(function (id) { put(id, num(co2.uncontrolled_co2_kg, 2)); });
    ["saved-kg", "saved-kg-2"].forEach(function (id) { put(id, num(co2.saved_kg, 2)); });
    document.querySelector(".tile.co2").classList.toggle("worse", co2.saved_kg < 0);
    put("saved-pct", num(co2.saved_pct, 1)); put("ev-kwh", num(co2.ev_kwh, 1));
    put("uncontrolled-ev-kwh", num(co2.uncontrolled_ev_kwh, 1)); put("import-kwh", num(co2.grid_import_kwh, 1));
    put("uncontrolled-import-kwh", num(co2.uncontrolled_grid_import_kwh, 1)); put("pv-kwh", num(co2.pv_kwh, 1));
    put("no-moer", co2.steps_without_moer);
    put("co2-span", co2.error || co2.note || (co2.hours === undefined ? "nothing recorded yet"
      : co2.start_local + " to " + co2.end_local + " (" + Number(co2.hours.toFixed(2)) + " h)"));
    var problems = [d.last_error ? "The last plan failed: " + d.last_error : null,
                    co2.error ? "CO2 so far: " + co2.error : null].filter(Boolean);
    el("error").hidden = !problems.length;
    put("error", problems.join(" "));
    rows("cars", d.cars, car, "no car in");
    var cps = el("cps");
    while (cps.firstChild) { cps.removeChild(cps.firstChild); }
    d.charge_points.forEach(function (cp) { cps.appendChild(chip(cp)); });
    rows("plans", p.last, function (tr, x) {
      cell(tr, x.local, "time"); cell(tr, x.controller, "controller"); cell(tr, num(x.wall_s, 3), "wall_s", "num");
      cell(tr, x.profiles, "profiles", "num");
    }, "no plan yet");
    var counts = el("event-counts");
    while (counts.firstChild) { counts.removeChild(counts.firstChild); }
    Object.keys(d.events.counts).forEach(function (k) {
      var span = document.createElement("span");
      span.setAttribute("data-kind", k);
      span.textContent = k + " " + d.events.counts[k];
      counts.appendChild(span);
    });
    rows("events", d.events.last, function (tr, x) {
      cell(tr, x.local, "time"); cell(tr, x.kind, "kind"); cell(tr, x.detail, "detail", "detail");
    }, "none");
  }
  function refresh() {
    var url = new URL("status.json", location.href);
    url.username = ""; url.password = "";  // the browser sends the page's credentials itself
    fetch(url, {cache: "no-store", credentials: "same-origin"})
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
      .then(function (d) {
        render(d);
        el("live").textContent = "live"; el("live").className = "pill";
        document.documentElement.setAttribute("data-rendered", d.generated_at);
      })
      .catch(function (e) { el("live").textContent = "no answer: " + e.message; el("live").className = "pill bad"; })
      .then(function () { setTimeout(refresh, REFRESH_MS); });
  }
  refresh();
})();
</script>
</body>
</html>
"""
"""The operator's page: HTML with its CSS and script (``%REFRESH_MS%``: :data:`REFRESH_S` in ms)."""
