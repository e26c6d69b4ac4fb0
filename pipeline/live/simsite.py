"""A simulated site for the central system: the site's charge points as OCPP 1.6J or 2.0.1 clients, or a mix of both
(one asyncio process), and its site controller (the battery's management system and the clock, OCPP 1.6J), replaying a
split of the site's sessions in accelerated time through the study's env (:class:`envs.evhub.EVHubVectorEnv`, socket
actions, set-point battery, float64), so that what the central system sends is judged by the study's physics.

Each step ``t`` of the site (:meth:`SimSite.tick`, ``dt_h`` hours): the cars that left end their transaction (1.6:
``StopTransaction``; 2.0.1: ``TransactionEvent`` ``Ended``), the cars that arrived start one (1.6: ``StartTransaction``,
then ``DataTransfer`` ``DriverNeeds`` with the session's departure and need; 2.0.1: ``TransactionEvent`` ``Started``,
then ``NotifyEVChargingNeeds`` with the departure and the need, to the nearest Wh: the standard's resolution), each open
transaction reports its meter (1.6: ``MeterValues``; 2.0.1: ``TransactionEvent`` ``Updated``; Wh), the site controller
reports the battery's SOC (``DataTransfer`` ``BatteryStatus``) and sets the time (``DataTransfer`` ``Clock``: answered
once the step is planned and sent, or the last plan held); it reads the battery's set-point (``GET /battery``); the env
steps once with each socket at its charging profile's limit for the step (the profile it holds: the last plan's) and the
battery at its set-point: the plan's step, as the study's replay applies it (``tests/test_plan.py``). A simulated meter
counts whole Wh between sessions (``meterStart`` is an integer).
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
from typing import Literal
from urllib.parse import urlparse

import numpy as np
import pandas as pd
import torch
from ocpp import v201
from ocpp.routing import on
from ocpp.v16 import ChargePoint, call
from ocpp.v16 import call_result as result
from ocpp.v16.enums import Action, ChargingProfileStatus, ClearChargingProfileStatus

from envs import timestep
from envs.evhub import EVHubVectorEnv
from envs.site import Site
from pipeline.live import ocpp16, ocpp201
from pipeline.live.ocpp16 import VENDOR
from pipeline.live.sources import default_mapping
from pipeline.live.state import LiveError, schedule_limit_kw

PROFILE_WAIT_S = 10.0
"""How long a car waits for its charging profile after the step is planned before it charges at full power (a
charger's default without a profile), s."""


def basic_auth(cp_id: str, password: str) -> str:
    """The ``Authorization`` header value of HTTP Basic auth."""
    return "Basic " + base64.b64encode(f"{cp_id}:{password}".encode()).decode()


OCPP_CHOICES = ("1.6", "2.0.1", "mix")
"""What the simulated charge points speak (:func:`ocpp_versions`): all OCPP 1.6J, all 2.0.1, or a mix."""


def ocpp_versions(cp_ids, ocpp: str = "1.6") -> dict[str, str]:
    """The OCPP version of each charge point: ``"1.6"`` or ``"2.0.1"`` for all, or ``"mix"``: alternating in the
    sorted order of the ids, the first 1.6.

    Raises:
        LiveError: ``ocpp`` not one of :data:`OCPP_CHOICES`.
    """
    if ocpp not in OCPP_CHOICES:
        raise LiveError(f"--ocpp: {ocpp!r} is not one of {', '.join(OCPP_CHOICES)}")
    ids = sorted(set(cp_ids))
    if ocpp == "mix":
        return {cp: ("1.6", "2.0.1")[k % 2] for k, cp in enumerate(ids)}
    return dict.fromkeys(ids, ocpp)


def _limit_kw(schedule: dict, now: pd.Timestamp) -> float | None:
    """The limit at ``now`` of a charging schedule as the ``ocpp`` package gives it (keys in snake_case, limits in W),
    kW (:func:`pipeline.live.state.schedule_limit_kw`)."""
    periods = [(p["start_period"], p["limit"]) for p in schedule["charging_schedule_period"]]
    return schedule_limit_kw(schedule["start_schedule"], schedule.get("duration"), periods, now)


def _wh_sample(wh: float, context: str) -> dict:
    """A 2.0.1 sampled value of the energy register, Wh."""
    return {"value": float(wh), "context": context, "measurand": ocpp16.REGISTER, "unit_of_measure": {"unit": "Wh"}}


class SimProfiles:
    """What both simulated charge points keep (a mixin before their version's ``ChargePoint``): the connection, the
    last profile per connector or EVSE (:attr:`profiles`), an event set when one comes, and how many to reject
    (:attr:`reject_next`) and were rejected."""

    def __init__(self, cp_id: str, connection, response_timeout: float = 60.0):
        super().__init__(cp_id, connection, response_timeout=response_timeout)
        self.connection = connection
        self.profiles: dict[int, dict] = {}
        self.received = asyncio.Event()
        self.reject_next = 0
        self.rejected = 0


class SimChargePoint(SimProfiles, ChargePoint):
    """A simulated OCPP 1.6J charge point: keeps the last charging profile per connector (a later plan's replaces an
    earlier's) and answers ``Rejected`` once where told to (:attr:`reject_next`); :meth:`boot`, :meth:`begin`,
    :meth:`meter`, :meth:`end` and :meth:`heartbeat` send what a charger sends (the same methods as
    :class:`SimChargePoint201`'s)."""

    SUBPROTOCOL = ocpp16.SUBPROTOCOL

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
        return _limit_kw(p["charging_schedule"], now)

    async def boot(self) -> str:
        """``BootNotification``; returns the registration status."""
        res = await self.call(call.BootNotification(charge_point_vendor="evhub-sim", charge_point_model="socket"))
        return res.status

    async def heartbeat(self) -> None:
        """``Heartbeat``."""
        await self.call(call.Heartbeat())

    async def begin(
        self, connector: int, id_tag: str, meter_wh: int, now: pd.Timestamp, need_kwh: float,
        departure: pd.Timestamp, session_id: str | None, socket_kw: float,
    ) -> int:  # fmt: skip
        """A car plugs in at ``connector``: ``StartTransaction`` (``meter_wh``: the register, whole Wh), then
        ``DataTransfer`` ``DriverNeeds`` (the departure, the need in kWh, the session's id where given); returns the
        transaction's id (the central system's).

        Raises:
            LiveError: the central system did not accept the driver's needs.
        """
        res = await self.call(
            call.StartTransaction(connector_id=connector, id_tag=id_tag, meter_start=int(meter_wh), timestamp=_iso(now))
        )
        tx = int(res.transaction_id)
        body = {"transactionId": tx, "departure": _iso(departure), "energyKWh": need_kwh}
        if session_id is not None:
            body["sessionId"] = session_id
        answer = await self.call(call.DataTransfer(vendor_id=VENDOR, message_id="DriverNeeds", data=json.dumps(body)))
        if answer.status != "Accepted":
            raise LiveError(f"DriverNeeds of {self.id}: {answer.status} ({answer.data})")
        return tx

    async def meter(self, connector: int, tx: int, wh: float, now: pd.Timestamp) -> None:
        """``MeterValues``: the register of a transaction's connector, Wh."""
        sample = {"value": repr(float(wh)), "measurand": ocpp16.REGISTER, "unit": "Wh"}
        mv = [{"timestamp": _iso(now), "sampledValue": [sample]}]
        await self.call(call.MeterValues(connector_id=connector, meter_value=mv, transaction_id=tx))

    async def end(self, connector: int, tx: int, wh: float, now: pd.Timestamp) -> None:
        """The car leaves: ``StopTransaction`` (the register rounded to whole Wh)."""
        await self.call(call.StopTransaction(meter_stop=int(round(wh)), timestamp=_iso(now), transaction_id=tx))


class SimChargePoint201(SimProfiles, v201.ChargePoint):
    """A simulated OCPP 2.0.1 charge point (one connector per EVSE: EVSE ``N`` is connector ``N``): names its
    transactions itself, keeps the last ``TxProfile`` per EVSE and answers ``Rejected`` once where told to, as
    :class:`SimChargePoint` does; its car tells its needs with ``NotifyEVChargingNeeds`` (ISO 15118: AC charging
    parameters, DC above 22 kW)."""

    SUBPROTOCOL = ocpp201.SUBPROTOCOL

    def __init__(self, cp_id: str, connection, response_timeout: float = 60.0):
        super().__init__(cp_id, connection, response_timeout)
        self.seq: dict[str, int] = {}

    @on(v201.enums.Action.set_charging_profile)
    def on_set_profile(self, evse_id: int, charging_profile: dict, **kwargs):
        if self.reject_next > 0:
            self.reject_next -= 1
            self.rejected += 1
            return v201.call_result.SetChargingProfile(status=v201.enums.ChargingProfileStatusEnumType.rejected)
        old = self.profiles.get(evse_id)
        start = charging_profile["charging_schedule"][0]["start_schedule"]
        if old is None or pd.Timestamp(start) >= pd.Timestamp(old["charging_schedule"][0]["start_schedule"]):
            self.profiles[evse_id] = charging_profile
        self.received.set()
        return v201.call_result.SetChargingProfile(status=v201.enums.ChargingProfileStatusEnumType.accepted)

    @on(v201.enums.Action.clear_charging_profile)
    def on_clear_profile(self, charging_profile_id: int | None = None, charging_profile_criteria=None, **kwargs):
        evse = (charging_profile_criteria or {}).get("evse_id")
        for e, p in list(self.profiles.items()):
            if p["id"] == charging_profile_id or (charging_profile_id is None and e == evse):
                del self.profiles[e]
        return v201.call_result.ClearChargingProfile(status=v201.enums.ClearChargingProfileStatusEnumType.accepted)

    def limit_kw(self, connector_id: int, now: pd.Timestamp, transaction_id: str) -> float | None:
        """The EVSE's limit at ``now`` by its profile (kW), None without a profile of that transaction (the charger's
        id) covering ``now``."""
        p = self.profiles.get(connector_id)
        if p is None or p.get("transaction_id") != transaction_id:
            return None
        return _limit_kw(p["charging_schedule"][0], now)

    async def boot(self) -> str:
        """``BootNotification``; returns the registration status."""
        station = {"model": "socket", "vendor_name": "evhub-sim"}
        res = await self.call(v201.call.BootNotification(charging_station=station, reason="PowerUp"))
        return res.status

    async def heartbeat(self) -> None:
        """``Heartbeat``."""
        await self.call(v201.call.Heartbeat())

    async def event(self, kind: str, tx: str, now: pd.Timestamp, trigger: str, wh: float, context: str, **more):
        """A ``TransactionEvent`` of ``kind`` with the register's reading (Wh) and the transaction's next ``seqNo``."""
        seq = self.seq.get(tx, -1) + 1
        self.seq[tx] = seq
        info = {"transaction_id": tx} | more.pop("info", {})
        mv = [{"timestamp": _iso(now), "sampled_value": [_wh_sample(wh, context)]}]
        return await self.call(
            v201.call.TransactionEvent(
                event_type=kind, timestamp=_iso(now), trigger_reason=trigger, seq_no=seq, transaction_info=info,
                meter_value=mv, **more,
            )
        )  # fmt: skip

    async def begin(
        self, connector: int, id_tag: str, meter_wh: int, now: pd.Timestamp, need_kwh: float,
        departure: pd.Timestamp, session_id: str | None, socket_kw: float,
    ) -> str:  # fmt: skip
        """A car plugs in at EVSE ``connector``: ``TransactionEvent`` ``Started`` (the register, Wh), then
        ``NotifyEVChargingNeeds`` (the departure; the need to the nearest Wh, ``energyAmount`` being whole Wh: the
        session data's energies are whole Wh, kept as float32; the session's id in a ``customData`` of vendor
        :data:`pipeline.live.ocpp16.VENDOR` where given); returns the transaction's id (the charger's).

        Raises:
            LiveError: the central system did not accept the car's needs.
        """
        tx = f"{id_tag}-{now.strftime('%Y%m%d%H%M')}"
        await self.event(
            "Started", tx, now, "CablePluggedIn", meter_wh, "Transaction.Begin", info={"charging_state": "EVConnected"},
            evse={"id": connector, "connector_id": 1}, id_token={"id_token": id_tag, "type": "Local"},
        )  # fmt: skip
        wh = round(need_kwh * 1000.0)
        if socket_kw > 22.0:  # beyond AC's three phases: a DC charger
            mode, params = "DC", {"dc_charging_parameters": {"energy_amount": wh, "ev_max_current": math.ceil(
                socket_kw * 1000.0 / 400.0), "ev_max_voltage": 400}}  # fmt: skip
        else:
            mode, params = "AC_single_phase", {"ac_charging_parameters": {"energy_amount": wh, "ev_min_current": 6,
                "ev_max_current": math.ceil(socket_kw * 1000.0 / 240.0), "ev_max_voltage": 240}}  # fmt: skip
        needs = {"requested_energy_transfer": mode, "departure_time": _iso(departure)} | params
        custom = None if session_id is None else {"vendor_id": VENDOR, "session_id": session_id}
        answer = await self.call(
            v201.call.NotifyEVChargingNeeds(charging_needs=needs, evse_id=connector, custom_data=custom)
        )
        if answer.status != "Accepted":
            raise LiveError(f"NotifyEVChargingNeeds of {self.id}: {answer.status} ({answer.status_info})")
        return tx

    async def meter(self, connector: int, tx: str, wh: float, now: pd.Timestamp) -> None:
        """``TransactionEvent`` ``Updated``: the register of a transaction's EVSE, Wh."""
        await self.event("Updated", tx, now, "MeterValuePeriodic", wh, "Sample.Periodic",
                         info={"charging_state": "Charging"})  # fmt: skip

    async def end(self, connector: int, tx: str, wh: float, now: pd.Timestamp) -> None:
        """The car leaves: ``TransactionEvent`` ``Ended`` (the register, Wh)."""
        await self.event(
            "Ended", tx, now, "EVDeparted", wh, "Transaction.End", info={"stopped_reason": "EVDisconnected"}
        )
        self.seq.pop(tx, None)


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
    transactions: list[int | str] = field(default_factory=list)


@dataclass
class Open:
    """A socket's car as the simulated site tracks it: its transaction (1.6: the central system's id; 2.0.1: the
    charger's) and the steps it has left at the next step."""

    tx: int | str
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
        ocpp: what the charge points speak (:func:`ocpp_versions`): ``"1.6"``, ``"2.0.1"`` or ``"mix"``; the site
            controller speaks 1.6J.

    Raises:
        LiveError: ``ocpp`` is not one of :data:`OCPP_CHOICES`.
    """

    def __init__(
        self, site: Site, url: str, passwords: dict[str, str], site_id: str = "site", split: str = "test",
        hours: float | None = None, mapping: dict | None = None, tls: ssl.SSLContext | None = None,
        hooks: dict[int, Callable[[SimSite], Awaitable[None]]] | None = None, ocpp: str = "1.6",
    ):  # fmt: skip
        self.site, self.url, self.passwords, self.site_id, self.tls = site, url.rstrip("/"), passwords, site_id, tls
        self.data = site.split(split)
        n = self.data.num_steps
        self.steps = n if hours is None else min(timestep.steps(hours, site.config.dt_h, at_least=0), n)
        self.mapping = mapping or default_mapping(site)
        self.socket_of = {cp: (cp_id, conn) for (cp_id, conn), cp in self.mapping.items()}
        self.versions = ocpp_versions([cp for cp, _ in self.mapping], ocpp)
        self.hooks = hooks or {}
        self.env = EVHubVectorEnv(
            1, site=site, split=split, action_mode="socket", full_split=True, dtype=torch.float64,
            bess_action="setpoint",
        )  # fmt: skip
        self.cps: dict[str, SimChargePoint | SimChargePoint201] = {}
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
    async def connect(self, cp_id: str, wait_s: float = 120.0) -> SimChargePoint | SimChargePoint201:
        """Connect ``cp_id`` in its version of OCPP (retrying while the central system is down, up to ``wait_s``) and
        boot it."""
        from websockets.asyncio.client import connect

        kind = SimChargePoint201 if self.versions.get(cp_id) == "2.0.1" else SimChargePoint
        deadline = time.monotonic() + wait_s
        while True:
            try:
                ws = await connect(
                    f"{self.url}/{cp_id}", subprotocols=[kind.SUBPROTOCOL], ssl=self.tls, compression=None,
                    additional_headers={"Authorization": basic_auth(cp_id, self.passwords[cp_id])}, open_timeout=10,
                )  # fmt: skip
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        cp = kind(cp_id, ws)
        old = self.cps.get(cp_id)
        if old is not None:
            cp.reject_next, cp.rejected = old.reject_next, old.rejected
        cp.reject_next += self.pending_rejects.pop(cp_id, 0)
        self.cps[cp_id] = cp
        self.tasks[cp_id] = asyncio.create_task(self.listen(cp))
        await cp.boot()
        return cp

    async def listen(self, cp: SimChargePoint | SimChargePoint201) -> None:
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
        """A car plugs in at socket ``i``: its transaction starts and it tells its needs (module docstring)."""
        cp_id, conn = self.socket_of[i]
        self.register_wh[i] = float(math.ceil(self.register_wh[i]))
        tx = await self.cps[cp_id].begin(
            conn, f"car-{t}-{i}", int(self.register_wh[i]), now, need_kwh, departure, self.session_ids.get((t, i)),
            float(self.data.socket_kw[i]),
        )  # fmt: skip
        self.open[i] = Open(tx, 0)
        self.result.started += 1
        self.result.transactions.append(tx)

    async def stop(self, i: int, now: pd.Timestamp) -> None:
        """The car at socket ``i`` leaves: its transaction ends."""
        cp_id, conn = self.socket_of[i]
        await self.cps[cp_id].end(conn, self.open.pop(i).tx, float(self.register_wh[i]), now)
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
            await self.cps[cp_id].meter(conn, o.tx, float(self.register_wh[i]), now)
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
    feed=None, hooks: dict | None = None, reject: dict[str, int] | None = None, options=None, ocpp: str = "1.6",
) -> tuple[SimResult, object]:  # fmt: skip
    """A central system (site clock, the site's data as its MOER feed) and this simulated site in one event loop on
    localhost; returns the simulated site's result and the central system (its store open).

    Args:
        db: the central system's store (a path, or a :class:`pipeline.live.store.Store`).
        feed: its MOER feed (default :class:`pipeline.live.sources.SiteDataFeed`).
        hooks: as :class:`SimSite`'s. reject: ``{charge point: n}``: it answers Rejected to its next ``n`` profiles.
        options: the :class:`pipeline.live.planning.CsmsOptions` (``controller`` is set from ``controller``).
        ocpp: what the charge points speak: ``"1.6"``, ``"2.0.1"`` or ``"mix"`` (:func:`ocpp_versions`).
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
    sim = SimSite(site, f"ws://127.0.0.1:{port}", passwords, split=split, hours=hours, hooks=hooks, ocpp=ocpp)
    for cp_id, n in (reject or {}).items():
        sim.pending_rejects[cp_id] = n
    try:
        res = await sim.run()
    finally:
        await central.stop()
    return res, central


@dataclass
class Args:
    """The simulated site: the site's charge points as OCPP 1.6J or 2.0.1 clients replaying a split against a running
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
    ocpp: Literal["1.6", "2.0.1", "mix"] = "1.6"
    """what the charge points speak: 1.6 (OCPP 1.6J), 2.0.1, or mix (alternating in the order of their ids, the first
    1.6); the site controller speaks 1.6J"""


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
        passwords = {i: p for i, p, _ in rows}
        sim = SimSite(
            load_site(args.site), args.url, passwords, site_ids[0], args.split, args.hours, tls=tls, ocpp=args.ocpp
        )
        res = asyncio.run(sim.run())
        print(json.dumps({k: v for k, v in vars(res).items() if k != "transactions"}, indent=2), flush=True)

    return exit_code(run)


if __name__ == "__main__":
    raise SystemExit(main())
