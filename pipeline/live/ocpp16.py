"""OCPP 1.6J, the central system's side: the handlers of what a charge point (or the site controller) sends, and the
calls the central system makes to it.

A protocol module of the central system (:mod:`pipeline.live.csms`) gives its WebSocket subprotocol
(:data:`SUBPROTOCOL`) and a session class, ``Session(cp_id, connection, planning, role)``, with ``start()`` (serve the
connection until it closes), ``connection``, :meth:`Session.set_charging_profile` and
:meth:`Session.clear_charging_profile`; a module of another version of OCPP (2.0.1) sits beside this one with the same
shape. The handlers act through the planning loop (:class:`pipeline.live.planning.PlanningLoop`): its store, clock and
connector mapping, a driver's needs, and requests for a plan.

Handled: ``BootNotification``, ``Heartbeat``, ``StatusNotification`` (each connector's last status, recorded),
``Authorize``, ``StartTransaction`` and ``StopTransaction`` (recorded, then a plan asked for), ``MeterValues`` (the
energy register, Wh), and ``DataTransfer`` of vendor :data:`VENDOR`: ``DriverNeeds`` (a driver's departure and need),
``BatteryStatus`` and ``Clock`` (the site controller's). A frame that is not OCPP, or an action not supported, gets a
CALLERROR.
"""

from __future__ import annotations

import contextlib
import json

from ocpp.exceptions import OCPPError, PropertyConstraintViolationError
from ocpp.messages import unpack
from ocpp.routing import on
from ocpp.v16 import ChargePoint, call, call_result
from ocpp.v16.datatypes import IdTagInfo
from ocpp.v16.enums import Action, AuthorizationStatus, DataTransferStatus, RegistrationStatus

from pipeline.live.planning import PlanningLoop
from pipeline.live.sources import SiteClock
from pipeline.live.state import LiveError, as_timestamp
from pipeline.live.store import utc_text

VENDOR = "evhub"
"""The ``vendorId`` of the central system's ``DataTransfer`` messages (``DriverNeeds``, ``BatteryStatus``,
``Clock``)."""
SUBPROTOCOL = "ocpp1.6"
"""The WebSocket subprotocol of OCPP 1.6J."""


REGISTER = "Energy.Active.Import.Register"
"""The measurand of the energy register (OCPP 1.6J and 2.0.1), the one meter reading the central system keeps."""


def register_readings(meter_value: list[dict] | None) -> list[tuple[str, float]]:
    """``(timestamp, Wh)`` of each reading of the energy register in a ``meterValue`` list of OCPP 1.6J or 2.0.1 (keys
    in snake_case, as the ``ocpp`` package gives them): the sampled values whose measurand is :data:`REGISTER` (or
    none), of no single phase, in ``Wh`` or ``kWh`` (1.6J's ``unit``; 2.0.1's ``unit_of_measure``, times
    ``10 ** multiplier``); other units are skipped."""
    out = []
    for mv in meter_value or []:
        for sv in mv.get("sampled_value", []):
            if sv.get("measurand", REGISTER) != REGISTER or sv.get("phase") is not None:
                continue
            unit = sv.get("unit_of_measure") or {"unit": sv.get("unit", "Wh")}  # 2.0.1's, else 1.6J's
            name, multiplier = unit.get("unit", "Wh"), unit.get("multiplier", 0)
            scale = {"Wh": 1.0, "kWh": 1000.0}.get(name)
            if scale is None:
                continue
            out.append((mv["timestamp"], float(sv["value"]) * scale * 10.0 ** int(multiplier)))
    return out


async def refused_frame(session, raw_msg: str) -> bool:
    """Whether ``raw_msg`` is not an OCPP message; if so it is recorded (``bad_frame``) and answered with a CALLERROR
    naming what is wrong (``FormatViolation`` or the like; the ``ocpp`` package drops it silently). ``session``: a
    protocol module's session (its ``id``, ``planning`` and ``connection``); the frame's shape is the same in OCPP 1.6J
    and 2.0.1."""
    try:
        unpack(raw_msg)
    except OCPPError as exc:
        uid = "-1"
        with contextlib.suppress(Exception):
            parsed = json.loads(raw_msg)
            if isinstance(parsed, list) and len(parsed) > 1 and isinstance(parsed[1], str):
                uid = parsed[1]
        planning = session.planning
        planning.store.log(planning.time_or_now(), "bad_frame", f"{session.id}: {exc.description}")
        await session.connection.send(json.dumps([4, uid, exc.code, f"{session.id}: {exc.description}"[:255], {}]))
        return True
    return False


class Session(ChargePoint):
    """One connected charge point (or the site controller), its OCPP 1.6J handlers bound to the planning loop.

    Args:
        cp_id: its id (the path's). connection: its WebSocket connection. planning: the central system's planning
            loop. role: ``"charge_point"`` or ``"site"`` (the site controller), as registered in the store.
    """

    def __init__(self, cp_id: str, connection, planning: PlanningLoop, role: str):
        super().__init__(cp_id, connection, response_timeout=planning.options.response_timeout_s)
        self.planning, self.role, self.connection = planning, role, connection

    async def route_message(self, raw_msg):
        """Route a frame; one that is not an OCPP message gets a CALLERROR (:func:`refused_frame`)."""
        if not await refused_frame(self, raw_msg):
            await super().route_message(raw_msg)

    # ------------------------------------------------------------------------------ the central system's calls
    async def set_charging_profile(self, payload: dict) -> bool:
        """Send ``SetChargingProfile`` with ``payload`` (a :func:`pipeline.live.charging_profile` payload:
        ``connectorId``, ``csChargingProfiles``); returns whether the charge point accepted it.

        Raises:
            TimeoutError: no answer within the response timeout. websockets.exceptions.ConnectionClosed: the
                connection closed. OCPPError: a CALLERROR answered.
        """
        req = call.SetChargingProfile(payload["connectorId"], payload["csChargingProfiles"])
        res = await self.call(req, suppress=False)
        return res.status == "Accepted"

    async def clear_charging_profile(self, profile_id: int | None, connector_id: int) -> None:
        """Send ``ClearChargingProfile`` of the profile ``profile_id`` (None: any) at ``connector_id``; the answer is
        not read. Raises what the call raises (a timeout, a closed connection)."""
        await self.call(call.ClearChargingProfile(id=profile_id, connector_id=connector_id))

    # ------------------------------------------------------------------------------------------ the handlers
    def _socket(self, connector_id: int) -> int:
        socket = self.planning.mapping.get((self.id, int(connector_id)))
        if socket is None:
            raise PropertyConstraintViolationError(
                description=f"connectorId {connector_id} of charge point {self.id!r} is not in the site's mapping"
            )
        return socket

    @on(Action.boot_notification)
    def on_boot(self, charge_point_vendor: str, charge_point_model: str, **kwargs):
        return call_result.BootNotification(
            current_time=utc_text(self.planning.time_or_now()), interval=300, status=RegistrationStatus.accepted
        )

    @on(Action.heartbeat)
    def on_heartbeat(self):
        return call_result.Heartbeat(current_time=utc_text(self.planning.time_or_now()))

    @on(Action.status_notification)
    def on_status(self, connector_id: int, error_code: str, status: str, timestamp: str | None = None, **kwargs):
        when = self.planning.time_or_now()  # the charger's time where it gives a valid one, else the central system's
        if timestamp:
            with contextlib.suppress(LiveError):
                when = as_timestamp(timestamp, "timestamp")
        self.planning.store.set_connector_status(self.id, connector_id, status, when, error_code)
        return call_result.StatusNotification()

    @on(Action.authorize)
    def on_authorize(self, id_tag: str):
        return call_result.Authorize(id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted))

    @on(Action.start_transaction)
    def on_start(self, connector_id: int, id_tag: str, meter_start: int, timestamp: str, **kwargs):
        self._socket(connector_id)
        tx = self.planning.store.start_transaction(self.id, connector_id, id_tag, timestamp, meter_start)
        self.planning.saw(timestamp)
        self.planning.request_plan()
        return call_result.StartTransaction(
            transaction_id=tx, id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted)
        )

    @on(Action.stop_transaction)
    def on_stop(self, meter_stop: int, timestamp: str, transaction_id: int, reason=None, **kwargs):
        store = self.planning.store
        row = store.transaction(transaction_id)
        if row is None or row["charge_point"] != self.id:
            store.log(timestamp, "unknown_transaction", f"{self.id}: StopTransaction of transaction {transaction_id}")
        else:
            store.stop_transaction(transaction_id, timestamp, meter_stop, reason)
            self.planning.saw(timestamp)
            self.planning.request_plan()
        return call_result.StopTransaction(id_tag_info=IdTagInfo(status=AuthorizationStatus.accepted))

    @on(Action.meter_values)
    def on_meter_values(self, connector_id: int, meter_value: list, transaction_id: int | None = None):
        store = self.planning.store
        if transaction_id is None:
            found = store.open_transaction_at(self.id, connector_id)
            transaction_id = found["id"] if found else None
        if transaction_id is None or store.transaction(transaction_id) is None:
            return call_result.MeterValues()
        for when, wh in register_readings(meter_value):
            store.meter_value(transaction_id, when, wh)
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
            self.planning.store.log(self.planning.time_or_now(), "rejected_message", f"{self.id}: {detail}")
            return call_result.DataTransfer(status=DataTransferStatus.rejected, data=detail)
        return call_result.DataTransfer(status=DataTransferStatus.accepted, data=json.dumps(answer))

    async def driver_needs(self, body: dict) -> dict:
        """``DriverNeeds``: ``{"transactionId", "departure" (ISO 8601), "energyKWh", "sessionId" (optional)}``."""
        tx = int(body["transactionId"])
        row = self.planning.store.transaction(tx)
        if row is None or row["charge_point"] != self.id:
            raise LiveError(f"transactionId {tx}: no such transaction at charge point {self.id!r}")
        self.planning.driver_needs(tx, body["departure"], body["energyKWh"], body.get("sessionId"))
        return {"transactionId": tx}

    async def battery_status(self, body: dict) -> dict:
        """``BatteryStatus`` (site controller only): ``{"soc": fraction, "time": ISO 8601}``."""
        self._site_only("BatteryStatus")
        soc = float(body["soc"])
        if not 0.0 <= soc <= 1.0:
            raise LiveError(f"soc: {soc} is outside [0, 1]")
        self.planning.store.battery(body["time"], "soc", soc)
        return {}

    async def clock(self, body: dict) -> dict:
        """``Clock`` (site controller, site clock only): ``{"time": ISO 8601}``; answered once the step is planned
        and sent (or the last plan held): ``{"planned": time, "ok": bool, "error": str}``."""
        self._site_only("Clock")
        clock = self.planning.clock
        if not isinstance(clock, SiteClock):
            raise LiveError("Clock: this central system keeps its own time (run it with --clock site)")
        clock.advance(as_timestamp(body["time"], "Clock.time"))
        error = await self.planning.plan_and_wait()
        return {"planned": utc_text(clock.now()), "ok": error is None, "error": error}

    def _site_only(self, what: str) -> None:
        if self.role != "site":
            raise LiveError(f"{what}: charge point {self.id!r} is not the site controller")
