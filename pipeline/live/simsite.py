"""A simulated site for the central system: the site's charge points as OCPP 1.6J clients (one asyncio process) and
its site controller (the battery's management system and the clock), replaying a split of the site's sessions in
accelerated time through the study's env (:class:`envs.evhub.EVHubVectorEnv`, socket actions, set-point battery,
float64), so that what the central system sends is judged by the study's physics.

Each step ``t`` of the site (:meth:`SimSite.tick`, ``dt_h`` hours): the cars that left end their transaction
(``StopTransaction``), the cars that arrived start one (``StartTransaction``, then ``DataTransfer`` ``DriverNeeds`` with
the session's departure and need), each open transaction reports its meter (``MeterValues``, Wh), the site controller
reports the battery's SOC (``DataTransfer`` ``BatteryStatus``) and sets the time (``DataTransfer`` ``Clock``: answered
once the step is planned and sent, or the last plan held); it reads the battery's set-point (``GET /battery``); the env
steps once with each socket at its charging profile's limit for the step (the profile it holds: the last plan's) and
the battery at its set-point: the plan's step, as the study's replay applies it (``tests/test_plan.py``). A simulated
meter counts whole Wh between sessions (``meterStart`` is an integer).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pandas as pd
import torch
from ocpp.routing import on
from ocpp.v16 import ChargePoint, call
from ocpp.v16 import call_result as result
from ocpp.v16.enums import Action, ChargingProfileStatus, ClearChargingProfileStatus

from envs import timestep
from envs.evhub import EVHubVectorEnv
from envs.site import Site
from pipeline.live.ocpp16 import SUBPROTOCOL, VENDOR
from pipeline.live.sources import default_mapping
from pipeline.live.state import LiveError

PROFILE_WAIT_S = 10.0
"""How long a car waits for its charging profile after the step is planned before it charges at full power (a
charger's default without a profile), s."""


def basic_auth(cp_id: str, password: str) -> str:
    """The ``Authorization`` header value of HTTP Basic auth."""
    return "Basic " + base64.b64encode(f"{cp_id}:{password}".encode()).decode()


class SimChargePoint(ChargePoint):
    """A simulated charge point: keeps the last charging profile per connector (a later plan's replaces an earlier's)
    and answers ``Rejected`` once where told to (:attr:`reject_next`)."""

    def __init__(self, cp_id: str, connection, response_timeout: float = 60.0):
        super().__init__(cp_id, connection, response_timeout=response_timeout)
        self.connection = connection
        self.profiles: dict[int, dict] = {}
        self.received = asyncio.Event()
        self.reject_next = 0
        self.rejected = 0

    @on(Action.set_charging_profile)
    def on_set_profile(self, connector_id: int, cs_charging_profiles: dict):
        if self.reject_next > 0:
            self.reject_next -= 1
            self.rejected += 1
            return result.SetChargingProfile(status=ChargingProfileStatus.rejected)
        old = self.profiles.get(connector_id)
        start = cs_charging_profiles["charging_schedule"]["start_schedule"]
        if old is None or pd.Timestamp(start) >= pd.Timestamp(old["charging_schedule"]["start_schedule"]):
            self.profiles[connector_id] = cs_charging_profiles
        self.received.set()
        return result.SetChargingProfile(status=ChargingProfileStatus.accepted)

    @on(Action.clear_charging_profile)
    def on_clear_profile(self, connector_id: int | None = None, **kwargs):
        self.profiles.pop(connector_id, None)
        return result.ClearChargingProfile(status=ClearChargingProfileStatus.accepted)

    def limit_kw(self, connector_id: int, now: pd.Timestamp, transaction_id: int) -> float | None:
        """The connector's limit at ``now`` by its profile (kW), None without a profile of that transaction covering
        ``now``."""
        p = self.profiles.get(connector_id)
        if p is None or p.get("transaction_id") != transaction_id:
            return None
        sched = p["charging_schedule"]
        offset = (now - pd.Timestamp(sched["start_schedule"])).total_seconds()
        if offset < 0 or offset >= sched.get("duration", math.inf):
            return None
        limit = None
        for period in sched["charging_schedule_period"]:
            if period["start_period"] <= offset:
                limit = float(period["limit"])
        return None if limit is None else limit / 1000.0


@dataclass
class SimResult:
    """What a simulated run gave: ``co2_kg``, ``unserved_kwh`` (the env's), the steps run and their hours, the
    transactions started and stopped, the profiles rejected by the charge points, the steps a car charged without a
    profile (``fallbacks``), and the run's wall time, s."""

    co2_kg: float = 0.0
    unserved_kwh: float = 0.0
    steps: int = 0
    hours: float = 0.0
    started: int = 0
    stopped: int = 0
    rejected: int = 0
    fallbacks: int = 0
    wall_s: float = 0.0
    transactions: list[int] = field(default_factory=list)


@dataclass
class Open:
    """A socket's car as the simulated site tracks it: its transaction and the steps it has left at the next step."""

    tx: int
    left_next: int


class SimSite:
    """The simulated site (module docstring).

    Args:
        site: the site. url: the central system's ``ws[s]://host:port``. passwords: ``{id: password}`` of each
            charge point and of the site controller. site_id: the site controller's id.
        split: the split replayed from its start. hours: how many hours, whole steps of the site (default: the whole
            split).
        mapping: ``{(charge point, connector): socket}`` (default :func:`pipeline.live.sources.default_mapping`).
        tls: the client's TLS context for ``wss://``.
        hooks: ``{step: coroutine function(sim)}`` run at the start of that step (faults: a restart of the central
            system, a dropped charge point).
    """

    def __init__(
        self, site: Site, url: str, passwords: dict[str, str], site_id: str = "site", split: str = "test",
        hours: float | None = None, mapping: dict | None = None, tls: ssl.SSLContext | None = None,
        hooks: dict[int, Callable[[SimSite], Awaitable[None]]] | None = None,
    ):  # fmt: skip
        self.site, self.url, self.passwords, self.site_id, self.tls = site, url.rstrip("/"), passwords, site_id, tls
        self.data = site.split(split)
        n = self.data.num_steps
        self.steps = n if hours is None else min(timestep.steps(hours, site.config.dt_h, at_least=0), n)
        self.mapping = mapping or default_mapping(site)
        self.socket_of = {cp: (cp_id, conn) for (cp_id, conn), cp in self.mapping.items()}
        self.hooks = hooks or {}
        self.env = EVHubVectorEnv(
            1, site=site, split=split, action_mode="socket", full_split=True, dtype=torch.float64,
            bess_action="setpoint",
        )  # fmt: skip
        self.cps: dict[str, SimChargePoint] = {}
        self.pending_rejects: dict[str, int] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.open: dict[int, Open] = {}
        self.register_wh = np.zeros(site.config.ev.n_sockets)
        self.result = SimResult()
        self.start = site.config.split_bounds(split)[0]
        self.dt = pd.Timedelta(timestep.step_timedelta(site.config.dt_h))
        ses = self.data.sessions[~self.data.sessions.rejected]
        self.session_ids = {(int(r.arrival_step), int(r.socket)): str(r.session_id) for r in ses.itertuples()}

    # ------------------------------------------------------------------------------------------ connections
    async def connect(self, cp_id: str, wait_s: float = 120.0) -> SimChargePoint:
        """Connect ``cp_id`` (retrying while the central system is down, up to ``wait_s``) and boot it."""
        from websockets.asyncio.client import connect

        deadline = time.monotonic() + wait_s
        while True:
            try:
                ws = await connect(
                    f"{self.url}/{cp_id}", subprotocols=[SUBPROTOCOL], ssl=self.tls, compression=None,
                    additional_headers={"Authorization": basic_auth(cp_id, self.passwords[cp_id])}, open_timeout=10,
                )  # fmt: skip
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        cp = SimChargePoint(cp_id, ws)
        old = self.cps.get(cp_id)
        if old is not None:
            cp.reject_next, cp.rejected = old.reject_next, old.rejected
        cp.reject_next += self.pending_rejects.pop(cp_id, 0)
        self.cps[cp_id] = cp
        self.tasks[cp_id] = asyncio.create_task(self.listen(cp))
        await cp.call(call.BootNotification(charge_point_vendor="evhub-sim", charge_point_model="socket"))
        return cp

    async def listen(self, cp: SimChargePoint) -> None:
        """Run a charge point's session until its connection closes."""
        from websockets.exceptions import ConnectionClosed

        with contextlib.suppress(ConnectionClosed, asyncio.CancelledError):
            await cp.start()

    async def connect_all(self) -> None:
        """Connect the site controller and every charge point."""
        ids = [self.site_id, *sorted({cp for cp, _ in self.mapping})]
        for k in range(0, len(ids), 50):
            await asyncio.gather(*(self.connect(i) for i in ids[k : k + 50]))

    def online(self, cp_id: str) -> bool:
        """Whether a charge point's connection is open."""
        return self.cps[cp_id].connection.state.name == "OPEN"

    async def drop(self, cp_id: str) -> None:
        """Close a charge point's connection; it forgets its profiles (a charger that restarts)."""
        cp = self.cps[cp_id]
        await cp.connection.close()
        self.tasks[cp_id].cancel()
        cp.profiles.clear()

    async def close(self) -> None:
        """Close every connection."""
        for cp in self.cps.values():
            with contextlib.suppress(Exception):
                await cp.connection.close()
        for t in self.tasks.values():
            t.cancel()

    async def battery_setpoint(self) -> dict:
        """``GET /battery`` with the site controller's credentials: the central system's set-point document."""
        u = urlparse(self.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port, ssl=self.tls if u.scheme == "wss" else None)
        auth = basic_auth(self.site_id, self.passwords[self.site_id])
        request = f"GET /battery HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        await writer.drain()
        raw = await reader.read()
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
        if " 200 " not in status:
            raise LiveError(f"GET /battery: {status}")
        return json.loads(body)

    # ------------------------------------------------------------------------------------------ the steps
    async def run(self) -> SimResult:
        """Replay the steps; returns the :class:`SimResult`."""
        t0 = time.perf_counter()
        self.env.reset(seed=0)
        await self.connect_all()
        try:
            for t in range(self.steps):
                await self.tick(t)
            await self.stop_all(self.start + self.steps * self.dt)
        finally:
            await self.close()
        self.result.rejected = sum(cp.rejected for cp in self.cps.values())
        self.result.wall_s = time.perf_counter() - t0
        return self.result

    async def events(self, t: int, now: pd.Timestamp) -> None:
        """Step ``t``'s transactions: those that ended stop, the new cars start and tell their needs."""
        env = self.env
        need, left = env.ev_need_kwh[0].numpy(), env.steps_left()[0].numpy()
        for i in range(len(left)):
            cur = self.open.get(i)
            if cur is not None and (left[i] == 0 or left[i] != cur.left_next):
                await self.stop(i, now)
                cur = None
            if left[i] > 0 and cur is None:
                await self.begin(i, t, now, float(need[i]), now + int(left[i]) * self.dt)
            if i in self.open:
                self.open[i].left_next = int(left[i]) - 1

    async def begin(self, i: int, t: int, now: pd.Timestamp, need_kwh: float, departure: pd.Timestamp) -> None:
        """A car plugs in at socket ``i``: StartTransaction, then DriverNeeds."""
        cp_id, conn = self.socket_of[i]
        cp = self.cps[cp_id]
        self.register_wh[i] = float(math.ceil(self.register_wh[i]))
        res = await cp.call(
            call.StartTransaction(
                connector_id=conn, id_tag=f"car-{t}-{i}", meter_start=int(self.register_wh[i]), timestamp=_iso(now)
            )
        )
        self.open[i] = Open(int(res.transaction_id), 0)
        self.result.started += 1
        self.result.transactions.append(int(res.transaction_id))
        body = {"transactionId": int(res.transaction_id), "departure": _iso(departure), "energyKWh": need_kwh}
        if (t, i) in self.session_ids:
            body["sessionId"] = self.session_ids[(t, i)]
        answer = await cp.call(call.DataTransfer(vendor_id=VENDOR, message_id="DriverNeeds", data=json.dumps(body)))
        if answer.status != "Accepted":
            raise LiveError(f"DriverNeeds of {cp_id}: {answer.status} ({answer.data})")

    async def stop(self, i: int, now: pd.Timestamp) -> None:
        """The car at socket ``i`` leaves: StopTransaction."""
        cp_id, _ = self.socket_of[i]
        tx = self.open.pop(i).tx
        await self.cps[cp_id].call(
            call.StopTransaction(meter_stop=int(round(self.register_wh[i])), timestamp=_iso(now), transaction_id=tx)
        )
        self.result.stopped += 1

    async def stop_all(self, now: pd.Timestamp) -> None:
        """End every open transaction (the end of the replay)."""
        for i in sorted(self.open):
            await self.stop(i, now)

    async def report(self, now: pd.Timestamp) -> None:
        """Each open transaction's meter and the battery's SOC."""
        for i, o in self.open.items():
            cp_id, conn = self.socket_of[i]
            if not self.online(cp_id):  # a charge point off line reports when it is back
                continue
            sample = {
                "value": repr(float(self.register_wh[i])),
                "measurand": "Energy.Active.Import.Register",
                "unit": "Wh",
            }
            mv = [{"timestamp": _iso(now), "sampledValue": [sample]}]
            await self.cps[cp_id].call(call.MeterValues(connector_id=conn, meter_value=mv, transaction_id=o.tx))
        soc = float(self.env.energy_kwh[0]) / self.site.config.bess.capacity_kwh
        body = json.dumps({"soc": soc, "time": _iso(now)})
        await self.cps[self.site_id].call(call.DataTransfer(vendor_id=VENDOR, message_id="BatteryStatus", data=body))

    async def tick(self, t: int) -> None:
        """One step (module docstring)."""
        now = self.start + t * self.dt
        if t in self.hooks:
            await self.hooks[t](self)
        await self.events(t, now)
        await self.report(now)
        body = json.dumps({"time": _iso(now)})
        answer = await self.cps[self.site_id].call(call.DataTransfer(vendor_id=VENDOR, message_id="Clock", data=body))
        got = json.loads(answer.data or "{}")
        if answer.status != "Accepted" or not got.get("ok"):
            raise LiveError(f"step {now.isoformat()}: the central system did not plan it: {answer.status} {got}")
        for cp_id in {self.socket_of[i][0] for i in self.open}:
            if not self.online(cp_id):
                await self.connect(cp_id)
        limits = await self.limits(now)
        doc = await self.battery_setpoint()
        if pd.Timestamp(doc.get("time")) != now:
            raise LiveError(f"GET /battery: the set-point is for {doc.get('time')}, not for {now.isoformat()}")
        self.step(limits, float(doc["setpoint_kw"]))

    async def limits(self, now: pd.Timestamp) -> dict[int, float | None]:
        """Each open socket's limit for the step (kW); a charge point that has none yet waits up to
        :data:`PROFILE_WAIT_S` for it (a reconnected one gets its profile again)."""
        out = {}
        deadline = time.monotonic() + PROFILE_WAIT_S
        for i, o in self.open.items():
            cp_id, conn = self.socket_of[i]
            while True:
                cp = self.cps[cp_id]
                kw = cp.limit_kw(conn, now, o.tx)
                if kw is not None or time.monotonic() > deadline:
                    break
                cp.received.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cp.received.wait(), max(deadline - time.monotonic(), 0.01))
            out[i] = kw
        return out

    def step(self, limits: dict[int, float | None], battery_kw: float) -> None:
        """Step the env once: each socket at its limit (full power without one), the battery at its set-point."""
        env, cfg = self.env, self.site.config
        dt, pmax = cfg.dt_h, self.data.socket_kw
        need = env.ev_need_kwh[0].numpy().copy()
        left = env.steps_left()[0].numpy().copy()
        occupied = left > 0
        cap = np.where(occupied, np.minimum(need / dt, pmax), 0.0)
        floor = np.zeros_like(cap)
        if cfg.ev.deadline_floor:
            floor = np.minimum(np.maximum((need - pmax * dt * np.maximum(left - 1, 0)) / dt, 0.0), cap)
        action = np.zeros(1 + len(cap))
        action[0] = np.clip(battery_kw / cfg.bess.power_kw, -1.0, 1.0) if cfg.bess.power_kw > 0 else 0.0
        for i, kw in limits.items():
            span = cap[i] - floor[i]
            if kw is None:
                self.result.fallbacks += 1
                kw = cap[i]
            if kw >= cap[i] - 1e-4:  # within the profile's 0.1 W resolution of all the car can take
                action[1 + i] = 1.0
            elif span > 1e-12:
                action[1 + i] = np.clip((kw - floor[i]) / span, 0.0, 1.0)
        _, _, _, _, info = env.step(torch.as_tensor(action)[None])
        after = env.ev_need_kwh[0].numpy()
        gone = occupied & ((left == 1) | (env.steps_left()[0].numpy() != left - 1))
        unserved = float(info["unserved_kwh"][0])
        delivered = np.where(gone, need - (unserved / max(int(gone.sum()), 1)), need - after)
        self.register_wh += np.where(occupied, np.maximum(delivered, 0.0) * 1000.0, 0.0)
        self.result.co2_kg += float(info["co2_kg"][0])
        self.result.unserved_kwh += unserved
        self.result.steps += 1
        self.result.hours = timestep.hours(self.result.steps, cfg.dt_h)


def _iso(ts: pd.Timestamp) -> str:
    return pd.Timestamp(ts).tz_convert("UTC").strftime("%Y-%m-%dT%H:%M:%SZ")


def site_passwords(site: Site, mapping: dict | None = None, site_id: str = "site") -> dict[str, str]:
    """A fresh random password for each charge point of ``mapping`` and for the site controller."""
    import secrets

    ids = {cp for cp, _ in (mapping or default_mapping(site))}
    return {i: secrets.token_urlsafe(12) for i in sorted(ids | {site_id})}


def register(store, passwords: dict[str, str], site_id: str = "site") -> None:
    """Register ``passwords``'s ids in a central system's store (``site_id`` as the site controller)."""
    for cp_id, password in passwords.items():
        store.add_charge_point(cp_id, password, "site" if cp_id == site_id else "charge_point")


async def run_local(
    site: Site, db, controller: str = "mpc", split: str = "test", hours: float | None = None,
    feed=None, hooks: dict | None = None, reject: dict[str, int] | None = None, options=None,
) -> tuple[SimResult, object]:  # fmt: skip
    """A central system (site clock, the site's data as its MOER feed) and this simulated site in one event loop on
    localhost; returns the simulated site's result and the central system (its store open).

    Args:
        db: the central system's store (a path, or a :class:`pipeline.live.store.Store`).
        feed: its MOER feed (default :class:`pipeline.live.sources.SiteDataFeed`).
        hooks: as :class:`SimSite`'s. reject: ``{charge point: n}``: it answers Rejected to its next ``n`` profiles.
        options: the :class:`pipeline.live.planning.CsmsOptions` (``controller`` is set from ``controller``).
    """
    from pipeline.live.csms import CentralSystem, CsmsOptions
    from pipeline.live.sources import SiteClock, SiteDataFeed
    from pipeline.live.store import Store

    store = db if isinstance(db, Store) else Store(db)
    passwords = site_passwords(site)
    register(store, passwords)
    options = options or CsmsOptions()
    options.controller = controller
    central = CentralSystem(site, store, SiteClock(), feed or SiteDataFeed(site, split), default_mapping(site), options)
    server = await central.start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sim = SimSite(site, f"ws://127.0.0.1:{port}", passwords, split=split, hours=hours, hooks=hooks)
    for cp_id, n in (reject or {}).items():
        sim.pending_rejects[cp_id] = n
    try:
        res = await sim.run()
    finally:
        await central.stop()
    return res, central


@dataclass
class Args:
    """The simulated site: the site's charge points as OCPP 1.6J clients replaying a split against a running
    evhub-csms (started with --clock site), in accelerated time (docs/live.md)."""

    site: str = "caltech"
    """the site: a shipped name or the path of a site TOML (the central system's)"""
    url: str = "ws://127.0.0.1:9000"
    """the central system's ws:// or wss:// address"""
    credentials: Path = Path("credentials.txt")
    """the `id password [role]` lines the central system was started with (the site controller's role: site)"""
    split: str = "test"
    """the split replayed from its start"""
    hours: float | None = None
    """hours to replay, whole steps of the site (default: the whole split)"""
    cafile: Path | None = None
    """with wss://: the certificate to trust (PEM)"""


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.live.simsite`` (tyro): replay, print the result as JSON; an expected error prints one
    line and returns 1."""
    import tyro

    from envs.errors import exit_code
    from envs.site import load_site
    from pipeline.live.csms import read_credentials

    args = tyro.cli(Args, args=argv)

    def run() -> None:
        rows = read_credentials(args.credentials)
        site_ids = [i for i, _, role in rows if role == "site"]
        if not site_ids:
            raise LiveError(f"--credentials: {args.credentials}: no id with the role site (the site controller)")
        tls = ssl.create_default_context(cafile=str(args.cafile)) if args.cafile else None
        sim = SimSite(
            load_site(args.site), args.url, {i: p for i, p, _ in rows}, site_ids[0], args.split, args.hours, tls=tls
        )
        res = asyncio.run(sim.run())
        print(json.dumps({k: v for k, v in vars(res).items() if k != "transactions"}, indent=2), flush=True)

    return exit_code(run)


if __name__ == "__main__":
    raise SystemExit(main())
