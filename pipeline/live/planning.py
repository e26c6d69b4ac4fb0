"""The central system's planning loop (:class:`PlanningLoop`): when to plan, the live state a plan starts from, and
what a plan does.

At each step of its clock (the site's ``dt_h``), and after each StartTransaction, StopTransaction or driver's message,
the central system takes the step (:meth:`PlanningLoop.plan_once`): the live state from the store (open transactions,
their energy so far from the meter values, the driver's departure and need from a ``DataTransfer`` (vendor ``evhub``,
message ``DriverNeeds``) or the session model's expectation), the history from the MOER feed, and
:func:`pipeline.live.make_plan` given its last plan. Where the controller plans anew (each hour's start, a car that
came, left before its time or changed its departure; every step at hourly steps: :func:`pipeline.live.held_step`) it
sends each connector with a car its ``SetChargingProfile`` (through :class:`Chargers`: retried when rejected), clears
the profiles of ended transactions, and publishes the battery's set-point (a JSON file written atomically, and ``GET
/battery``); between plans the chargers hold the profiles they were sent (nothing is sent again) and the battery's
set-point for the step is the last plan's.

What it does is said on the logger ``evhub.csms``, one line each: a plan (INFO: the controller, the profiles sent and
accepted, its wall time), a step that holds the last plan (DEBUG), a profile not accepted (WARNING), a step that
failed (the store's ``plan_failed`` event: one line; a failure the central system does not expect, a bug, also gets
its traceback). Each record carries the step's time (``site_time``) for the console
(:func:`pipeline.live.csms.console`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd

from envs import timestep
from envs.errors import is_expected
from envs.files import write_text
from envs.site import Site, station_sockets
from pipeline.live.history import SESSION_SOCKET
from pipeline.live.profiles import LivePlan, make_plan
from pipeline.live.sources import Clock, FeedHistory, MoerFeed, SiteClock, expected_session, fill_late
from pipeline.live.state import DayStart, LiveError, LiveState, PluggedEV, as_timestamp
from pipeline.live.store import Store, StoreError, utc_text

log = logging.getLogger("evhub.csms")
NOT_ACCEPTED = {
    "rejected": " (refused at every try: the charger keeps the profile it had)",
    "timeout": " (no answer at any try: the charger keeps the profile it had)",
    "offline": " (the charge point is not connected: it gets the profile when it reconnects)",
}
"""What a profile's status other than ``accepted`` means, as the console says it."""


@dataclass
class CsmsOptions:
    """How the central system plans and sends.

    Attributes:
        controller: the causal controller of the registry that plans. plan_kwargs: more arguments of
            :func:`pipeline.live.make_plan` (``output_dir``, ``experiment``, ``seed``).
        retries: how many times a rejected or unanswered profile is sent again. retry_delay_s: seconds between.
        response_timeout_s: how long a charge point has to answer a call, s.
        battery_file: where the battery's set-point is written (JSON, atomically); None: not written.
        step_timer: take each step of the clock by itself (a wall clock); with a site clock the site's Clock
            message is the step.
        event_delay_s: a transaction's start or stop, or a driver's message, is taken in this many seconds later
            (the events of a burst, such as a car's StartTransaction and DriverNeeds, get one plan); a step's plan
            takes them in at once.
    """

    controller: str = "mpc"
    plan_kwargs: dict = field(default_factory=dict)
    retries: int = 3
    retry_delay_s: float = 0.2
    response_timeout_s: float = 10.0
    battery_file: Path | None = None
    step_timer: bool = False
    event_delay_s: float = 2.0


class Chargers(Protocol):
    """Where a plan's charging profiles go: the connected charge points (:class:`pipeline.live.csms.CentralSystem`)."""

    async def send_profile(self, cp_id: str, row: int) -> str:
        """Send the profile of store row ``row`` to charge point ``cp_id``; returns its status (recorded)."""

    async def clear_ended(self) -> None:
        """Clear the charging profile of each ended transaction at its charge point."""


class PlanningLoop:
    """The central system's planning loop (module docstring): one plan at a time, on request.

    Args:
        site: the site. store: its record. clock: the time it plans by. feed: the MOER feed.
        mapping: ``{(charge point id, connector): socket}`` (:func:`pipeline.live.sources.default_mapping`).
        options: :class:`CsmsOptions`. chargers: where the profiles go (:class:`Chargers`).

    Attributes:
        plans: the plans made (not those held), in order. plan_latency_s: their wall times, s. held: how many steps
            held the last plan. last_plan: the last plan made or held. battery_doc: the battery's set-point for the
            step (``GET /battery``; None before the first plan). last_error: the error of the last plan, or None.
    """

    def __init__(
        self, site: Site, store: Store, clock: Clock, feed: MoerFeed, mapping: dict, options: CsmsOptions,
        chargers: Chargers,
    ):  # fmt: skip
        self.site, self.store, self.clock, self.feed, self.mapping = site, store, clock, feed, mapping
        self.options, self.chargers = options, chargers
        self.battery_doc: dict | None = None
        self.plans: list[LivePlan] = []
        self.plan_latency_s: list[float] = []
        self.last_plan: LivePlan | None = None
        self.held = 0
        self.requested = self.done = 0
        self.last_error: str | None = None
        self.wake: asyncio.Event | None = None
        self.delayed: asyncio.TimerHandle | None = None
        self.finished: asyncio.Condition | None = None
        self.tasks: list[asyncio.Task] = []
        self.dt = pd.Timedelta(timestep.step_timedelta(site.config.dt_h))

    # ------------------------------------------------------------------------------------------ time
    def time_or_now(self) -> pd.Timestamp:
        """The clock's time, or the wall clock's before a site clock is set."""
        try:
            return self.clock.now()
        except LiveError:
            return pd.Timestamp.now(tz="UTC")

    def saw(self, timestamp) -> None:
        """A charge point's event at ``timestamp``: a site clock moves on to it (the site's time is at least that)."""
        if isinstance(self.clock, SiteClock) and self.clock.time is not None:
            t = pd.Timestamp(timestamp).tz_convert("UTC")
            if t > self.clock.time:
                self.clock.advance(t)

    # ------------------------------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Start planning (in the running event loop): the loop that plans on request, and with
        :attr:`CsmsOptions.step_timer` the one that asks for a plan at each step of the clock."""
        self.wake, self.finished = asyncio.Event(), asyncio.Condition()
        self.tasks.append(asyncio.create_task(self.run()))
        if self.options.step_timer:
            self.tasks.append(asyncio.create_task(self.stepper()))

    def stop(self) -> None:
        """Stop planning (the loops are cancelled)."""
        for t in self.tasks:
            t.cancel()

    def request_plan(self, now: bool = False) -> int:
        """Ask for a plan (at the clock's step) with what the store holds then: at once (``now``, a step's plan)
        or after :attr:`CsmsOptions.event_delay_s` (an event's); returns the request's number."""
        self.requested += 1
        if self.wake is not None:
            if now or self.options.event_delay_s <= 0:
                self.wake.set()
            elif self.delayed is None or self.delayed.cancelled():
                self.delayed = asyncio.get_running_loop().call_later(self.options.event_delay_s, self.wake.set)
        return self.requested

    async def plan_and_wait(self) -> str | None:
        """Plan now and wait until the plan is sent; returns None, or the error that stopped it."""
        n = self.request_plan(now=True)
        async with self.finished:
            await self.finished.wait_for(lambda: self.done >= n)
        return self.last_error

    async def run(self) -> None:
        """Plan whenever asked, one plan at a time; requests made while planning are served by the next plan."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.delayed is not None:
                self.delayed.cancel()
                self.delayed = None
            n = self.requested
            if n == self.done:  # served by a plan since
                continue
            try:
                await self.plan_once()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - the service keeps running; the error is logged and answered
                self.failed(exc)
            async with self.finished:
                self.done = n
                self.finished.notify_all()

    def failed(self, exc: Exception) -> None:
        """A step that failed: its reason kept (:attr:`last_error`) and recorded (event ``plan_failed``, said in one
        line). A reason the central system expects (a :class:`pipeline.live.state.LiveError`, a feed or config error,
        :func:`envs.errors.is_expected`; an ``OSError``: a service out of reach) is that line alone; any other is a
        bug, and its traceback follows."""
        expected = isinstance(exc, LiveError | OSError) or is_expected(exc)
        self.last_error = str(exc) if isinstance(exc, LiveError) else f"{type(exc).__name__}: {exc}"
        self.store.log(self.time_or_now(), "plan_failed", self.last_error)
        if not expected:
            log.error("the failure above is not one the central system expects (a bug); its traceback:", exc_info=exc)

    async def stepper(self) -> None:
        """Ask for a plan at each step of the clock (a wall clock)."""
        while True:
            now = self.clock.now()
            nxt = now.floor(self.dt) + self.dt
            await asyncio.sleep(max((nxt - now).total_seconds(), 0.0) + 0.01)
            self.request_plan(now=True)

    # ------------------------------------------------------------------------------------------ a driver's needs
    def driver_needs(self, tx: int, departure, need_kwh, session_id: str | None = None) -> None:
        """Record a driver's departure (ISO 8601 with its UTC offset, or a Timestamp) and energy need (kWh) for
        transaction ``tx``, and ask for a plan. The need is kept at the precision of the site's session data (float32
        kWh, :mod:`envs.schemas`): OCPP 2.0.1's ``energyAmount`` is whole Wh, and 36,762 Wh read as the float32 of
        36.762 kWh is the session's own figure, where a float64 36.762 would differ from it by 1e-6 kWh, enough to tip
        a plan between two of nearly equal CO2.

        Raises:
            LiveError: a need that is not a finite energy >= 0, a departure that is not a time or has no UTC
                offset (:func:`pipeline.live.state.as_timestamp`), an unknown transaction.
        """
        need = float(np.float32(need_kwh))
        if not np.isfinite(need) or need < 0:
            raise LiveError(f"energy need: {need_kwh!r} is not an energy >= 0 (kWh)")
        if not isinstance(departure, str | pd.Timestamp):
            raise LiveError(f"departure: {departure!r} is not an ISO 8601 time")
        when = as_timestamp(departure, "departure")
        try:
            self.store.set_needs(tx, when, need, session_id, "driver")
        except StoreError as exc:
            raise LiveError(str(exc)) from None
        self.request_plan()

    # ------------------------------------------------------------------------------------------ the state
    def live_state(self, now: pd.Timestamp, hist: FeedHistory, issued: pd.Timestamp) -> LiveState:
        """The live state at step ``now`` from the store (module docstring) and the feed's history."""
        cfg, store = self.site.config, self.store
        evs, seen = [], None
        for tx in store.open_transactions():
            socket = self.mapping.get((tx["charge_point"], tx["connector"]))
            if socket is None:
                continue
            if tx["need_kwh"] is None:  # the driver said nothing: the session model's expectation, recorded
                seen = self.sessions(hist, now) if seen is None else seen
                start = pd.Timestamp(tx["start_time"])
                stay, need = expected_session(self.group_sessions(seen, socket), start, self.socket_kw(socket))
                store.set_needs(tx["id"], start + stay, need, None, "expected")
                tx = store.transaction(tx["id"]) | {"energy_wh": tx["energy_wh"]}
            delivered = max(0.0, ((tx["energy_wh"] or tx["meter_start_wh"]) - tx["meter_start_wh"]) / 1000.0)
            departure = max(pd.Timestamp(tx["departure"]), now + self.dt)
            evs.append(
                PluggedEV(
                    socket, max(0.0, tx["need_kwh"] - delivered), departure, tx["charge_point"], tx["connector"],
                    tx["id"],
                )
            )  # fmt: skip
        got = store.latest_battery("soc")
        soc = got[1] if got else cfg.bess.soc_initial
        local = now.tz_convert(cfg.timezone)
        day = store.latest_battery("day_start_soc")
        if day is None or (local.hour == 0 and local.minute == 0 and day[0] < now):
            store.battery(now, "day_start_soc", soc)
            store.battery(now, "day_start_need_kwh", sum(e.need_kwh for e in evs))
        day_start = DayStart(store.latest_battery("day_start_soc")[1], store.latest_battery("day_start_need_kwh")[1])
        return LiveState(
            local, soc, evs, hist.series, self.sessions(hist, now), forecast_issued_at=issued, day_start=day_start,
            window_end=hist.window_end,
        )  # fmt: skip

    def socket_kw(self, socket: int) -> float:
        """A socket's power, kW."""
        groups = self.site.config.ev.groups
        k = socket
        for g in groups:
            if k < g.count:
                return float(g.kw)
            k -= g.count
        return float(self.site.config.ev.socket_kw)

    def group_sessions(self, sessions: pd.DataFrame, socket: int) -> pd.DataFrame:
        """The rows of ``sessions`` (:meth:`sessions`' frame) at a socket of ``socket``'s group: by the column
        :data:`pipeline.live.history.SESSION_SOCKET` where a row has it, else by its station
        (:func:`envs.site.station_sockets` over the site's stations and these)."""
        if not len(sessions):
            return sessions
        cfg = self.site.config
        stations = sessions.station_id.astype(str)
        by_station = station_sockets(cfg, set(self.site.sessions.station_id.astype(str)) | set(stations))
        at = stations.map(by_station).astype(np.float64)
        if SESSION_SOCKET in sessions:
            at = sessions[SESSION_SOCKET].astype(np.float64).fillna(at)
        group = np.append(cfg.ev.group_of_socket(), -1)  # -1: a station of no group
        mine = group[at.fillna(cfg.ev.n_sockets).to_numpy(np.int64)] == group[socket]
        return sessions[mine]

    def sessions(self, hist: FeedHistory, now: pd.Timestamp) -> pd.DataFrame:
        """The feed's sessions and those the central system saw that the feed does not have (by session id); each of
        these is filed under the socket its connector is mapped to (column
        :data:`pipeline.live.history.SESSION_SOCKET`), whatever its charge point is called (a transaction at a
        connector the mapping no longer has is left out)."""
        known = set(hist.sessions.session_id.astype(str)) if len(hist.sessions) else set()
        rows = []
        for tx in self.store.transactions():
            sid = tx["session_id"] or f"tx-{tx['id']}"
            socket = self.mapping.get((tx["charge_point"], tx["connector"]))
            if sid in known or tx["departure"] is None or socket is None:
                continue
            arrival = min(pd.Timestamp(tx["start_time"]), now)
            end = pd.Timestamp(tx["stop_time"] or tx["departure"])
            stop = tx["meter_stop_wh"] if tx["meter_stop_wh"] is not None else tx["meter_start_wh"]
            rows.append(
                {
                    "session_id": sid,
                    "station_id": tx["charge_point"],
                    "arrival": arrival,
                    "departure": max(end, arrival + pd.Timedelta(minutes=1)),
                    "energy_kwh": max(0.0, (stop - tx["meter_start_wh"]) / 1000.0),
                    SESSION_SOCKET: socket,
                }
            )
        if not rows:
            return hist.sessions
        return pd.concat([hist.sessions, pd.DataFrame(rows)], ignore_index=True)

    # ------------------------------------------------------------------------------------------ a plan
    async def plan_once(self) -> LivePlan:
        """Take the clock's step: plan, or hold the last plan where the controller would
        (:func:`pipeline.live.make_plan` given the last plan), and act on it: a new plan is recorded, the battery's
        set-point published, the ended transactions' profiles cleared and the new ones sent; a plan held publishes the
        battery's set-point for the step (the chargers hold their profiles). Returns the plan (or the plan held).

        Raises:
            LiveError: the clock is not set, the feed has no history for the step, or the state is refused.
        """
        now = self.clock.now().tz_convert("UTC").floor(self.dt)
        hist = await asyncio.to_thread(self.feed.history, now)  # a service's time-outs and retries leave the loop free
        series, issued, late = fill_late(hist.series, now, self.site.config.dt_h)
        if late:
            self.store.log(now, "moer_feed_late", f"no new MOER forecast at {now.isoformat()}: planning on the one "
                           f"issued at {issued.isoformat()}")  # fmt: skip
        hist = FeedHistory(series, hist.sessions, hist.window_end)
        state = self.live_state(now, hist, issued)
        plan = await asyncio.to_thread(
            make_plan, self.site, state, self.options.controller, last=self.last_plan, **self.options.plan_kwargs
        )
        self.last_plan = plan
        if plan.holds is None:
            self.plans.append(plan)
            self.plan_latency_s.append(plan.wall_s)
            self.store.plan_made(now, plan.controller, plan.wall_s, len(plan.charging_profiles))
        self.store.battery(now, "setpoint_kw", float(plan.battery_kw[0]))
        self.publish_battery(now, plan)
        if plan.holds is not None:
            self.held += 1
            log.debug("held: the plan of %s holds, the battery at %+.2f kW", plan.holds.issued_at.strftime("%H:%M"),
                      float(plan.battery_kw[0]), extra={"site_time": now})  # fmt: skip
            await self.chargers.clear_ended()
            return plan
        rows = [
            (e, self.store.profile_planned(now, e["station_id"], e["connector_id"], e["payload"]["csChargingProfiles"]
                                           .get("transactionId"), e["payload"]))
            for e in plan.charging_profiles
        ]  # fmt: skip
        await self.chargers.clear_ended()  # first: a connector's next car's profile has the same id
        statuses = await asyncio.gather(*(self.chargers.send_profile(e["station_id"], row) for e, row in rows))
        self.say(now, plan, [(e, status) for (e, _), status in zip(rows, statuses, strict=True)])
        return plan

    def say(self, now: pd.Timestamp, plan: LivePlan, sent: list[tuple[dict, str]]) -> None:
        """Say a plan in one line (INFO: the controller, the profiles sent and accepted, the plan's wall time) and each
        profile not accepted in one more (WARNING), at step ``now``; ``sent``: each profile's entry and status."""
        at = {"site_time": now}
        accepted = sum(status == "accepted" for _, status in sent)
        log.info("plan: %s, %d profile(s) sent, %d accepted, %.0f ms", plan.controller, len(sent), accepted,
                 1000.0 * plan.wall_s, extra=at)  # fmt: skip
        for e, status in sent:
            if status != "accepted":
                where, why = f"{e['station_id']} connector {e['connector_id']}", NOT_ACCEPTED.get(status, "")
                log.warning("profile to %s: %s%s", where, status, why, extra=at)

    def publish_battery(self, now: pd.Timestamp, plan: LivePlan) -> None:
        """The battery's set-point for the step: kept for ``GET /battery`` and written to the battery file."""
        self.battery_doc = {
            "time": utc_text(now),
            "setpoint_kw": float(plan.battery_kw[0]),
            "until": utc_text(now + self.dt),
            "plan_kw": [float(x) for x in plan.battery_kw],
            "controller": plan.controller,
        }
        if self.options.battery_file is not None:
            write_text(self.options.battery_file, json.dumps(self.battery_doc, indent=2) + "\n")
