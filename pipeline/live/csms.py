"""``evhub-csms``: the central system (CSMS) of a site, OCPP 1.6J over WebSocket, one asyncio process.

Charge points connect to ``ws[s]://host:port/<id>`` with the ``ocpp1.6`` subprotocol and HTTP Basic auth (OCPP
security profile 1: the user is the id of the path, the password's salted hash is in the store); TLS (profile 2) with
``--certfile``/``--keyfile``. Unknown ids get 404, missing or wrong credentials 401, at the handshake; frames over
``max_frame_bytes`` close the connection (1009); a frame that is not OCPP, or an action not supported, gets a
CALLERROR. Everything learnt is written to the store (:class:`pipeline.live.store.Store`) before it is acted on.

At each step of its clock (the site's ``dt_h``), and after each StartTransaction, StopTransaction or driver's message,
the central system takes the step (:meth:`CentralSystem.plan_once`): the live state from the store (open transactions,
their energy so far from the meter values, the driver's departure and need from a ``DataTransfer`` (vendor ``evhub``,
message ``DriverNeeds``) or the session model's expectation), the history from the MOER feed, and
:func:`pipeline.live.make_plan` given its last plan. Where the controller plans anew (each hour's start, a car that
came, left before its time or changed its departure; every step at hourly steps: :func:`pipeline.live.held_step`) it
sends each connector with a car its ``SetChargingProfile`` (retried when rejected), clears the profiles of ended
transactions, and publishes the battery's set-point (a JSON file written atomically, and ``GET /battery``); between
plans the chargers hold the profiles they were sent (nothing is sent again) and the battery's set-point for the step
is the last plan's.

With an HTTP port (``--http-port``) it also serves the site's app, with the site controller's credentials (Basic
auth): ``POST /drivers/<charge point>/<connector>`` with ``{"departure": ISO 8601, "need_kwh": kWh}`` sets the needs
of the connector's open transaction (as ``DriverNeeds`` does), and ``GET /battery``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import ssl
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pandas as pd
from ocpp.exceptions import OCPPError, PropertyConstraintViolationError
from ocpp.messages import unpack
from ocpp.routing import on
from ocpp.v16 import ChargePoint, call, call_result
from ocpp.v16.datatypes import IdTagInfo
from ocpp.v16.enums import Action, AuthorizationStatus, DataTransferStatus, RegistrationStatus

from envs import timestep
from envs.files import write_text
from envs.site import Site
from pipeline.live.profiles import LivePlan, make_plan
from pipeline.live.sources import Clock, FeedHistory, MoerFeed, SiteClock, expected_session, fill_late
from pipeline.live.state import DayStart, LiveError, LiveState, PluggedEV, as_timestamp
from pipeline.live.store import Store, StoreError, check_password, utc_text

VENDOR = "evhub"
"""The ``vendorId`` of the central system's ``DataTransfer`` messages (``DriverNeeds``, ``BatteryStatus``,
``Clock``)."""
SUBPROTOCOL = "ocpp1.6"
MAX_FRAME_BYTES = 1 << 20
"""The largest frame taken (1 MiB); a larger one closes the connection with 1009."""
HTTP_MAX_BODY = 1 << 16
"""The largest request body of the HTTP endpoint (64 KiB); a larger one gets 413."""
HTTP_TIMEOUT_S = 10.0
"""How long the HTTP endpoint waits for a whole request, s (then 408)."""
log = logging.getLogger("evhub.csms")


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


class OcppSession(ChargePoint):
    """One connected charge point (or the site controller), its OCPP 1.6J handlers bound to the central system."""

    def __init__(self, cp_id: str, connection, central: CentralSystem, role: str):
        super().__init__(cp_id, connection, response_timeout=central.options.response_timeout_s)
        self.central, self.role, self.connection = central, role, connection

    async def route_message(self, raw_msg):
        """Route a frame; one that is not an OCPP message gets a CALLERROR (``FormatViolation``) naming what is wrong
        (the ``ocpp`` package drops it silently)."""
        try:
            unpack(raw_msg)
        except OCPPError as exc:
            uid = "-1"
            with contextlib.suppress(Exception):
                parsed = json.loads(raw_msg)
                if isinstance(parsed, list) and len(parsed) > 1 and isinstance(parsed[1], str):
                    uid = parsed[1]
            self.central.store.log(self.central.time_or_now(), "bad_frame", f"{self.id}: {exc.description}")
            await self.connection.send(json.dumps([4, uid, exc.code, f"{self.id}: {exc.description}"[:255], {}]))
            return
        await super().route_message(raw_msg)

    def _socket(self, connector_id: int) -> int:
        socket = self.central.mapping.get((self.id, int(connector_id)))
        if socket is None:
            raise PropertyConstraintViolationError(
                description=f"connectorId {connector_id} of charge point {self.id!r} is not in the site's mapping"
            )
        return socket

    @on(Action.boot_notification)
    def on_boot(self, charge_point_vendor: str, charge_point_model: str, **kwargs):
        return call_result.BootNotification(
            current_time=utc_text(self.central.time_or_now()), interval=300, status=RegistrationStatus.accepted
        )

    @on(Action.heartbeat)
    def on_heartbeat(self):
        return call_result.Heartbeat(current_time=utc_text(self.central.time_or_now()))

    @on(Action.status_notification)
    def on_status(self, connector_id: int, error_code: str, status: str, **kwargs):
        return call_result.StatusNotification()

    @on(Action.authorize)
    def on_authorize(self, id_tag: str):
        return call_result.Authorize(id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted))

    @on(Action.start_transaction)
    def on_start(self, connector_id: int, id_tag: str, meter_start: int, timestamp: str, **kwargs):
        self._socket(connector_id)
        tx = self.central.store.start_transaction(self.id, connector_id, id_tag, timestamp, meter_start)
        self.central.saw(timestamp)
        self.central.request_plan()
        return call_result.StartTransaction(
            transaction_id=tx, id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted)
        )

    @on(Action.stop_transaction)
    def on_stop(self, meter_stop: int, timestamp: str, transaction_id: int, reason=None, **kwargs):
        store = self.central.store
        row = store.transaction(transaction_id)
        if row is None or row["charge_point"] != self.id:
            store.log(timestamp, "unknown_transaction", f"{self.id}: StopTransaction of transaction {transaction_id}")
        else:
            store.stop_transaction(transaction_id, timestamp, meter_stop, reason)
            self.central.saw(timestamp)
            self.central.request_plan()
        return call_result.StopTransaction(id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted))

    @on(Action.meter_values)
    def on_meter_values(self, connector_id: int, meter_value: list, transaction_id: int | None = None):
        store = self.central.store
        if transaction_id is None:
            here = (self.id, connector_id)
            found = [t for t in store.open_transactions() if (t["charge_point"], t["connector"]) == here]
            transaction_id = found[0]["id"] if found else None
        if transaction_id is None or store.transaction(transaction_id) is None:
            return call_result.MeterValues()
        for mv in meter_value:
            for sv in mv.get("sampled_value", []):
                if sv.get("measurand", "Energy.Active.Import.Register") != "Energy.Active.Import.Register":
                    continue
                wh = float(sv["value"]) * (1000.0 if sv.get("unit") == "kWh" else 1.0)
                store.meter_value(transaction_id, mv["timestamp"], wh)
        return call_result.MeterValues()

    @on(Action.data_transfer)
    async def on_data_transfer(self, vendor_id: str, message_id: str | None = None, data: str | None = None):
        if vendor_id != VENDOR:
            return call_result.DataTransfer(status=DataTransferStatus.unknown_vendor_id)
        try:
            body = json.loads(data or "{}")
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return call_result.DataTransfer(status=DataTransferStatus.rejected, data=f"data: not a JSON object ({exc})")
        handler = {"DriverNeeds": self.driver_needs, "BatteryStatus": self.battery_status, "Clock": self.clock}
        if message_id not in handler:
            return call_result.DataTransfer(status=DataTransferStatus.unknown_message_id)
        try:
            answer = await handler[message_id](body)
        except (LiveError, KeyError, TypeError, ValueError) as exc:
            detail = f"{message_id}: {exc!s}"[:500]
            self.central.store.log(self.central.time_or_now(), "rejected_message", f"{self.id}: {detail}")
            return call_result.DataTransfer(status=DataTransferStatus.rejected, data=detail)
        return call_result.DataTransfer(status=DataTransferStatus.accepted, data=json.dumps(answer))

    async def driver_needs(self, body: dict) -> dict:
        """``DriverNeeds``: ``{"transactionId", "departure" (ISO 8601), "energyKWh", "sessionId" (optional)}``."""
        tx = int(body["transactionId"])
        row = self.central.store.transaction(tx)
        if row is None or row["charge_point"] != self.id:
            raise LiveError(f"transactionId {tx}: no such transaction at charge point {self.id!r}")
        self.central.driver_needs(tx, body["departure"], body["energyKWh"], body.get("sessionId"))
        return {"transactionId": tx}

    async def battery_status(self, body: dict) -> dict:
        """``BatteryStatus`` (site controller only): ``{"soc": fraction, "time": ISO 8601}``."""
        self._site_only("BatteryStatus")
        soc = float(body["soc"])
        if not 0.0 <= soc <= 1.0:
            raise LiveError(f"soc: {soc} is outside [0, 1]")
        self.central.store.battery(body["time"], "soc", soc)
        return {}

    async def clock(self, body: dict) -> dict:
        """``Clock`` (site controller, site clock only): ``{"time": ISO 8601}``; answered once the step is planned
        and sent (or the last plan held): ``{"planned": time, "ok": bool, "error": str}``."""
        self._site_only("Clock")
        clock = self.central.clock
        if not isinstance(clock, SiteClock):
            raise LiveError("Clock: this central system keeps its own time (run it with --clock site)")
        clock.advance(as_timestamp(body["time"], "Clock.time"))
        error = await self.central.plan_and_wait()
        return {"planned": utc_text(clock.now()), "ok": error is None, "error": error}

    def _site_only(self, what: str) -> None:
        if self.role != "site":
            raise LiveError(f"{what}: charge point {self.id!r} is not the site controller")


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """``(user, password)`` of an HTTP Basic ``Authorization`` header value; None: none, or not Basic."""
    if not header or not header.startswith("Basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class CentralSystem:
    """The central system (module docstring).

    Args:
        site: the site. store: its record. clock: the time it plans by. feed: the MOER feed.
        mapping: ``{(charge point id, connector): socket}`` (:func:`pipeline.live.sources.default_mapping`).
        options: :class:`CsmsOptions`.
    """

    def __init__(
        self, site: Site, store: Store, clock: Clock, feed: MoerFeed, mapping: dict, options: CsmsOptions | None = None
    ):
        self.site, self.store, self.clock, self.feed, self.mapping = site, store, clock, feed, mapping
        self.options = options or CsmsOptions()
        self.connected: dict[str, OcppSession] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.battery_doc: dict | None = None
        self.plans: list[LivePlan] = []
        self.plan_latency_s: list[float] = []
        self.last_plan: LivePlan | None = None
        self.held = 0
        self.requested = self.done = 0
        self.last_error: str | None = None
        self.verified: set[tuple[str, bytes]] = set()
        self.wake: asyncio.Event | None = None
        self.delayed: asyncio.TimerHandle | None = None
        self.finished: asyncio.Condition | None = None
        self.tasks: list[asyncio.Task] = []
        self.http_server: asyncio.Server | None = None
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

    # ------------------------------------------------------------------------------------------ serving
    async def start(
        self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None,
        http_port: int | None = None,
    ):  # fmt: skip
        """Start serving (and planning), the HTTP endpoint too on ``http_port`` (0: any free port; None: not served,
        ``self.http_server`` None); returns the WebSocket server (``server.sockets[0].getsockname()`` gives the
        port)."""
        from websockets.asyncio.server import serve

        self.http_server = None
        if http_port is not None:
            self.http_server = await asyncio.start_server(self.http, host, http_port, ssl=ssl_context)
        self.wake, self.finished = asyncio.Event(), asyncio.Condition()
        self.tasks.append(asyncio.create_task(self.planner()))
        if self.options.step_timer:
            self.tasks.append(asyncio.create_task(self.stepper()))
        self.server = await serve(
            self.handler,
            host,
            port,
            subprotocols=[SUBPROTOCOL],
            process_request=self.process_request,
            ssl=ssl_context,
            max_size=MAX_FRAME_BYTES,
            compression=None,
            logger=log,
        )
        return self.server

    async def stop(self) -> None:
        """Stop serving and planning."""
        for t in self.tasks:
            t.cancel()
        self.server.close()
        await self.server.wait_closed()
        if self.http_server is not None:
            self.http_server.close()
            await self.http_server.wait_closed()

    async def verify(self, cp_id: str, stored: str, password: str) -> bool:
        """Whether ``password`` is ``cp_id``'s (its stored hash ``stored``): scrypt in a worker thread (the event loop
        goes on serving meanwhile); a pair once verified is remembered by an HMAC of it (reconnections skip scrypt)."""
        key = (cp_id, hmac.new(stored.encode(), password.encode(), hashlib.sha256).digest())
        if key in self.verified:
            return True
        if not await asyncio.to_thread(check_password, stored, password):
            return False
        self.verified.add(key)
        return True

    async def site_authorised(self, header: str | None) -> tuple[str | None, HTTPStatus | None, str]:
        """The site controller a request's ``Authorization`` header authenticates: ``(id, None, "")``, or ``(None,
        401, why)``."""
        creds = basic_credentials(header)
        if creds is None:
            return None, HTTPStatus.UNAUTHORIZED, "no Basic credentials"
        user, password = creds
        known = self.store.charge_point(user)
        if known is None or known[1] != "site":
            return None, HTTPStatus.UNAUTHORIZED, f"{user!r} is not the site controller"
        if not await self.verify(user, known[0], password):
            return None, HTTPStatus.UNAUTHORIZED, f"wrong password for {user!r}"
        return user, None, ""

    async def authorised(self, request) -> tuple[str | None, HTTPStatus | None, str]:
        """The id a handshake's request authenticates as (Basic auth against the path's id; ``/battery``: the site
        controller): ``(id, None, "")``, or ``(None, status, why)``."""
        path = unquote(urlparse(request.path).path)
        header = request.headers.get("Authorization")
        if path == "/battery":
            return await self.site_authorised(header)
        cp_id = path.rstrip("/").rsplit("/", 1)[-1]
        known = self.store.charge_point(cp_id) if cp_id else None
        if known is None:
            return None, HTTPStatus.NOT_FOUND, f"unknown charge point {cp_id!r}"
        creds = basic_credentials(header)
        if creds is None:
            return None, HTTPStatus.UNAUTHORIZED, "no Basic credentials"
        user, password = creds
        if user != cp_id:
            return None, HTTPStatus.UNAUTHORIZED, f"user {user!r} is not the charge point of the path {cp_id!r}"
        if not await self.verify(cp_id, known[0], password):
            return None, HTTPStatus.UNAUTHORIZED, f"wrong password for {cp_id!r}"
        return cp_id, None, ""

    async def process_request(self, connection, request):
        """The handshake's hook: refuse strangers (404 / 401), serve ``GET /battery``, else let the upgrade go on."""
        cp_id, status, why = await self.authorised(request)
        if status is not None:
            self.store.log(self.time_or_now(), "refused", f"{request.path}: {why}")
            response = connection.respond(status, f"{why}\n")
            if status == HTTPStatus.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = 'Basic realm="evhub-csms"'
            return response
        if urlparse(request.path).path == "/battery":
            response = connection.respond(HTTPStatus.OK, json.dumps(self.battery_doc or {}) + "\n")
            response.headers["Content-Type"] = "application/json"
            return response
        return None

    async def handler(self, connection) -> None:
        """One charge point's connection: its OCPP session until it closes; its open transactions' latest profiles
        are sent again when it (re)connects."""
        from websockets.exceptions import ConnectionClosed

        if connection.subprotocol != SUBPROTOCOL:
            await connection.close(1002, f"subprotocol {SUBPROTOCOL} required")
            return
        cp_id = unquote(urlparse(connection.request.path).path).rstrip("/").rsplit("/", 1)[-1]
        _, role = self.store.charge_point(cp_id)
        session = OcppSession(cp_id, connection, self, role)
        old = self.connected.get(cp_id)
        self.connected[cp_id] = session
        if old is not None:
            await old.connection.close(1000, "replaced by a new connection")
        self.store.log(self.time_or_now(), "connected", cp_id)
        resend = asyncio.create_task(self.resend(cp_id))
        try:
            await session.start()
        except ConnectionClosed:
            pass
        finally:
            resend.cancel()
            if self.connected.get(cp_id) is session:
                del self.connected[cp_id]

    # ------------------------------------------------------------------------------------------ the site's app
    async def http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request of the HTTP endpoint (module docstring), answered with JSON and the connection closed: 200,
        or 400 (a bad request or body), 401, 404 (no such endpoint, or no open transaction at the connector), 408,
        411 (no ``Content-Length``), 413 (a body over :data:`HTTP_MAX_BODY`)."""
        try:
            status, doc = await asyncio.wait_for(self.http_answer(reader), HTTP_TIMEOUT_S)
        except TimeoutError:
            status, doc = HTTPStatus.REQUEST_TIMEOUT, {"error": "the request did not come whole in time"}
        except (ValueError, UnicodeDecodeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, doc = HTTPStatus.BAD_REQUEST, {"error": "not an HTTP/1.1 request"}
        if status != HTTPStatus.OK:
            self.store.log(self.time_or_now(), "http_refused", f"{int(status)}: {doc.get('error')}")
        body = (json.dumps(doc) + "\n").encode()
        head = f"HTTP/1.1 {int(status)} {status.phrase}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        if status == HTTPStatus.UNAUTHORIZED:
            head += 'WWW-Authenticate: Basic realm="evhub-csms"\r\n'
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + b"\r\n" + body)
            await writer.drain()
            writer.close()

    async def http_answer(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, dict]:
        """Read one request of the HTTP endpoint and act on it: ``(status, JSON document)``.

        Raises:
            ValueError, UnicodeDecodeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError: not HTTP.
        """
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, target, _ = head[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        _, status, why = await self.site_authorised(headers.get("authorization"))
        if status is not None:
            return status, {"error": why}
        path = unquote(urlparse(target).path)
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/battery":
            return HTTPStatus.OK, self.battery_doc or {}
        if method != "POST" or len(parts) != 3 or parts[0] != "drivers" or not parts[2].isdigit():
            return HTTPStatus.NOT_FOUND, {"error": f"{method} {path}: give POST /drivers/<charge point>/<connector>"}
        length = headers.get("content-length", "")
        if not length.isdigit():
            return HTTPStatus.LENGTH_REQUIRED, {"error": "no Content-Length"}
        if int(length) > HTTP_MAX_BODY:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"a body over {HTTP_MAX_BODY} bytes"}
        cp_id, connector = parts[1], int(parts[2])
        open_tx = [
            t for t in self.store.open_transactions() if (t["charge_point"], t["connector"]) == (cp_id, connector)
        ]
        if not open_tx:
            return HTTPStatus.NOT_FOUND, {"error": f"no open transaction at {cp_id!r} connector {connector}"}
        try:
            body = json.loads(await reader.readexactly(int(length)))
            if not isinstance(body, dict):
                raise LiveError("the body is not a JSON object")
            self.driver_needs(open_tx[-1]["id"], body["departure"], body["need_kwh"], body.get("session_id"))
        except KeyError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": f"the body has no {exc.args[0]!r}"}
        except (LiveError, TypeError, ValueError) as exc:
            return HTTPStatus.BAD_REQUEST, {"error": str(exc)[:500]}
        return HTTPStatus.OK, {"transactionId": open_tx[-1]["id"]}

    def driver_needs(self, tx: int, departure, need_kwh, session_id: str | None = None) -> None:
        """Record a driver's departure (ISO 8601 with its UTC offset, or a Timestamp) and energy need (kWh) for
        transaction ``tx``, and ask for a plan.

        Raises:
            LiveError: a need that is not a finite energy >= 0, a departure that is not a time or has no UTC
                offset (:func:`pipeline.live.state.as_timestamp`), an unknown transaction.
        """
        need = float(need_kwh)
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

    # ------------------------------------------------------------------------------------------ planning
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

    async def planner(self) -> None:
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
            except LiveError as exc:
                self.last_error = str(exc)
                self.store.log(self.time_or_now(), "plan_failed", str(exc))
            except Exception as exc:  # noqa: BLE001 - the service keeps running; the error is logged and answered
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("plan failed")
                self.store.log(self.time_or_now(), "plan_failed", self.last_error)
            async with self.finished:
                self.done = n
                self.finished.notify_all()

    async def stepper(self) -> None:
        """Ask for a plan at each step of the clock (a wall clock)."""
        while True:
            now = self.clock.now()
            nxt = now.floor(self.dt) + self.dt
            await asyncio.sleep(max((nxt - now).total_seconds(), 0.0) + 0.01)
            self.request_plan(now=True)

    def live_state(self, now: pd.Timestamp, hist: FeedHistory, issued: pd.Timestamp) -> LiveState:
        """The live state at step ``now`` from the store (module docstring) and the feed's history."""
        cfg, store = self.site.config, self.store
        evs = []
        for tx in store.open_transactions():
            socket = self.mapping.get((tx["charge_point"], tx["connector"]))
            if socket is None:
                continue
            if tx["need_kwh"] is None:  # the driver said nothing: the session model's expectation, recorded
                stay, need = expected_session(hist.sessions, pd.Timestamp(tx["start_time"]), self.socket_kw(socket))
                store.set_needs(tx["id"], pd.Timestamp(tx["start_time"]) + stay, need, None, "expected")
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

    def sessions(self, hist: FeedHistory, now: pd.Timestamp) -> pd.DataFrame:
        """The feed's sessions and those the central system saw that the feed does not have (by session id)."""
        known = set(hist.sessions.session_id.astype(str)) if len(hist.sessions) else set()
        rows = []
        for tx in self.store.transactions():
            sid = tx["session_id"] or f"tx-{tx['id']}"
            if sid in known or tx["departure"] is None:
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
                }
            )
        if not rows:
            return hist.sessions
        return pd.concat([hist.sessions, pd.DataFrame(rows)], ignore_index=True)

    async def plan_once(self) -> LivePlan:
        """Take the clock's step: plan, or hold the last plan where the controller would
        (:func:`pipeline.live.make_plan` given the last plan), and act on it: a new plan is recorded, the battery's
        set-point published, the ended transactions' profiles cleared and the new ones sent; a plan held publishes the
        battery's set-point for the step (the chargers hold their profiles). Returns the plan (or the plan held).

        Raises:
            LiveError: the clock is not set, the feed has no history for the step, or the state is refused.
        """
        now = self.clock.now().tz_convert("UTC").floor(self.dt)
        hist = self.feed.history(now)
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
            await self.clear_ended()
            return plan
        rows = [
            (e, self.store.profile_planned(now, e["station_id"], e["connector_id"], e["payload"]["csChargingProfiles"]
                                           .get("transactionId"), e["payload"]))
            for e in plan.charging_profiles
        ]  # fmt: skip
        await self.clear_ended()  # first: a connector's next car's profile has the same id
        await asyncio.gather(*(self.send_profile(e["station_id"], row) for e, row in rows))
        return plan

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

    async def send_profile(self, cp_id: str, row: int) -> str:
        """Send the profile of store row ``row`` (the connector's latest when it is sent, under the charge point's
        lock), retried when rejected or unanswered; returns its status (recorded)."""
        from websockets.exceptions import ConnectionClosed

        lock = self.locks.setdefault(cp_id, asyncio.Lock())
        async with lock:
            status, tries = "offline", 0
            for tries in range(self.options.retries + 1):
                session = self.connected.get(cp_id)
                if session is None:
                    status = "offline"
                    break
                payload = json.loads(self.store.db.execute("SELECT payload FROM profiles WHERE id = ?", (row,))
                                     .fetchone()["payload"])  # fmt: skip
                try:
                    req = call.SetChargingProfile(payload["connectorId"], payload["csChargingProfiles"])
                    res = await session.call(req, suppress=False)
                    status = "accepted" if res.status == "Accepted" else "rejected"
                except TimeoutError:
                    status = "timeout"
                except ConnectionClosed:
                    status = "offline"
                    break
                except OCPPError as exc:
                    status = "rejected"
                    self.store.log(self.time_or_now(), "profile_error", f"{cp_id}: {exc}")
                if status == "accepted":
                    break
                self.store.log(self.time_or_now(), f"profile_{status}", f"{cp_id} profile {row} try {tries + 1}")
                await asyncio.sleep(self.options.retry_delay_s)
            self.store.profile_status(row, status, tries, self.time_or_now())
            return status

    async def resend(self, cp_id: str) -> None:
        """Send a (re)connected charge point the latest profile of each of its open transactions."""
        for tx in self.store.open_transactions():
            if tx["charge_point"] != cp_id:
                continue
            latest = self.store.latest_profile(cp_id, tx["connector"])
            if latest is None or latest["transaction_id"] != tx["id"]:
                continue
            row = self.store.profile_planned(latest["plan_time"], cp_id, tx["connector"], tx["id"], latest["payload"])
            self.store.log(self.time_or_now(), "profile_resent", f"{cp_id} connector {tx['connector']} row {row}")
            await self.send_profile(cp_id, row)

    async def clear_ended(self) -> None:
        """Clear the charging profile of each ended transaction at its charge point (when connected)."""
        for tx in self.store.stopped_not_cleared():
            session = self.connected.get(tx["charge_point"])
            if session is None:
                continue
            socket = self.mapping.get((tx["charge_point"], tx["connector"]))
            req = call.ClearChargingProfile(id=1 + socket if socket is not None else None, connector_id=tx["connector"])
            with contextlib.suppress(Exception):
                async with self.locks.setdefault(tx["charge_point"], asyncio.Lock()):
                    await session.call(req)
                self.store.mark_cleared(tx["id"])


# ------------------------------------------------------------------------------------------------ the command
@dataclass
class Args:
    """evhub-csms: the site's central system, OCPP 1.6J over WebSocket (docs/live.md): at each step of the site it
    plans with a controller of the study where the controller would (each hour's start, a car that comes) and sends
    each connector with a car its charging profile; between plans the last plan holds."""

    site: str = "caltech"
    """the site: a shipped name (caltech, iquitos) or the path of a site TOML"""
    controller: str | None = None
    """the causal planner of the registry that plans (docs/live.md); default: the report's answer for the site, read
    from its results (as evhub-plan's)"""
    db: Path = Path("outputs/csms/csms.sqlite")
    """the central system's record (SQLite): charge points, transactions, meter values, profiles, set-points"""
    host: str = "127.0.0.1"
    """the address to listen on"""
    port: int = 9000
    """the port to listen on"""
    http_port: int | None = None
    """the port of the HTTP endpoint for the site's app (POST /drivers/<charge point>/<connector>, GET /battery;
    the site controller's credentials; TLS as the WebSocket's); default: not served"""
    certfile: Path | None = None
    """TLS certificate (PEM; OCPP security profile 2: wss://); with --keyfile"""
    keyfile: Path | None = None
    """TLS private key (PEM)"""
    credentials: Path | None = None
    """a file of lines `id password [role]` (role charge_point or site): registered, salted and hashed, in the
    store at start (the file can then be removed)"""
    mapping: Path | None = None
    """a JSON list of {charge_point, connector, socket} (default: one charge point per socket, named after its
    first station in the site's data, connector 1)"""
    battery_file: Path | None = Path("outputs/csms/battery.json")
    """where the battery's set-point is written (JSON, atomically; also served at GET /battery)"""
    clock: str = "wall"
    """wall: plan at each step of the real time; site: the site controller sets the time (a simulated site)"""
    split: str = "test"
    """the split of the site's data the MOER feed reads (the site's data files stand for the grid's feed)"""
    output_dir: str = "outputs"
    """the study's output folder (its results and tuning)"""
    experiment: str = ""
    """the study's experiment folder in it (default: the site's name)"""


def read_credentials(path: Path) -> list[tuple[str, str, str]]:
    """The ``id password [role]`` lines of a credentials file (blank lines and ``#`` comments skipped).

    Raises:
        LiveError: no such file, or a line without an id and a password (the message names the line).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise LiveError(f"--credentials: {path}: no such file") from None
    out = []
    for k, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) not in (2, 3):
            raise LiveError(f"--credentials: {path} line {k}: give `id password [role]`")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else "charge_point"))
    return out


def server_tls(certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """The TLS context of ``--certfile``/``--keyfile`` (None without them).

    Raises:
        LiveError: only one of them, or files TLS cannot load (the message names them).
    """
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise LiveError("--certfile / --keyfile: give both (TLS needs the certificate and its key)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise LiveError(f"--certfile / --keyfile: {certfile}, {keyfile}: not a certificate and key ({exc})") from None
    return ctx


def build(args: Args) -> CentralSystem:
    """The central system of ``args`` (its store opened, the credentials registered).

    Raises:
        LiveError: a bad option (the message names it). ConfigError, FileNotFoundError: an unknown site.
    """
    from envs.site import load_site
    from pipeline.live.controllers import answer, check_controller
    from pipeline.live.sources import SiteDataFeed, WallClock, default_mapping, read_mapping
    from pipeline.live.store import StoreError

    if args.clock not in ("wall", "site"):
        raise LiveError(f"--clock: {args.clock!r} is neither wall nor site")
    site = load_site(args.site)
    controller = args.controller or answer(site, args.output_dir, args.experiment)
    check_controller(controller)
    if args.split not in ("train", "test"):
        raise LiveError(f"--split: {args.split!r} is neither train nor test")
    store = Store(args.db)
    if args.credentials is not None:
        try:
            for cp_id, password, role in read_credentials(args.credentials):
                store.add_charge_point(cp_id, password, role)
        except StoreError as exc:
            raise LiveError(f"--credentials: {exc}") from None
    mapping = (
        read_mapping(args.mapping, site.config.ev.n_sockets) if args.mapping is not None else default_mapping(site)
    )
    options = CsmsOptions(
        controller=controller,
        plan_kwargs={"output_dir": args.output_dir, "experiment": args.experiment},
        battery_file=args.battery_file,
        step_timer=args.clock == "wall",
    )
    clock = SiteClock() if args.clock == "site" else WallClock()
    return CentralSystem(site, store, clock, SiteDataFeed(site, args.split), mapping, options)


async def serve_forever(
    central: CentralSystem, host: str, port: int, tls: ssl.SSLContext | None, http_port: int | None = None
) -> None:
    """Serve until cancelled."""
    server = await central.start(host, port, tls, http_port)
    scheme = "wss" if tls else "ws"
    print(f"evhub-csms: listening on {scheme}://{host}:{server.sockets[0].getsockname()[1]}/<charge point id>",
          flush=True)  # fmt: skip
    every = f"{timestep.step_minutes(central.site.config.dt_h)} minutes"
    print(f"evhub-csms: a step every {every} with {central.options.controller}: a plan at each hour's start and when "
          "a car comes, the last plan held between", flush=True)  # fmt: skip
    if central.http_server is not None:
        got = central.http_server.sockets[0].getsockname()[1]
        scheme = "https" if tls else "http"
        print(f"evhub-csms: the site's app at {scheme}://{host}:{got}/drivers/<charge point>/<connector>", flush=True)
    try:
        await asyncio.Future()
    finally:
        await central.stop()


def main(argv: list[str] | None = None) -> int:
    """``evhub-csms`` (tyro): parse :class:`Args`, serve; an expected error prints one line and returns 1."""
    import tyro

    from envs.errors import exit_code

    args = tyro.cli(Args, args=argv)

    def run() -> None:
        tls = server_tls(args.certfile, args.keyfile)
        central = build(args)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_forever(central, args.host, args.port, tls, args.http_port))

    return exit_code(run)


if __name__ == "__main__":
    raise SystemExit(main())
