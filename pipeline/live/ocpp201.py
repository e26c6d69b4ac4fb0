"""OCPP 2.0.1, the central system's side: the handlers of what a charge point sends, and the calls the central system
makes to it; served beside OCPP 1.6J (:mod:`pipeline.live.ocpp16`) on the same port, chosen by the WebSocket
subprotocol (:data:`SUBPROTOCOL`).

A protocol module of the central system (:mod:`pipeline.live.csms`) with the shape of :mod:`pipeline.live.ocpp16`: a
session class, ``Session(cp_id, connection, planning, role)``, with ``start()``, ``connection``,
:meth:`Session.set_charging_profile` and :meth:`Session.clear_charging_profile`, its handlers acting through the
planning loop (:class:`pipeline.live.planning.PlanningLoop`).

EVSEs and connectors: the mapping's connector number of a 2.0.1 charge point is its EVSE id: EVSE ``N`` is connector
``N`` (a mapping row ``{"charge_point": id, "connector": N, "socket": i}``); the connector id inside an EVSE is not read
(an EVSE charges one car at a time, whichever of its connectors it uses). EVSE 0, the station as a whole, maps to no
socket.

Transactions: a 2.0.1 charger names its transactions itself (``transactionId``, a string); each is recorded in the
store's one table of transactions, as 1.6's are, under an id of the central system's, with the charger's id beside it
(:meth:`pipeline.live.store.Store.charger_transaction` finds it), so planning, the profiles' resending and clearing,
and the operator's page see both versions alike.

Handled: ``BootNotification``, ``Heartbeat``, ``StatusNotification`` (each EVSE's last status, recorded),
``Authorize``, ``TransactionEvent`` (``Started``: the transaction recorded, then a plan asked for;
``Updated``: its meter values; ``Ended``: recorded, then a plan asked for; the meter values of each are the energy
register, ``Energy.Active.Import.Register``, in Wh or kWh), ``MeterValues`` (an EVSE's register, counted to its open
transaction) and ``NotifyEVChargingNeeds`` (ISO 15118: the car's ``departureTime`` and ``energyAmount``, Wh, of its AC
or DC charging parameters: the driver's needs, as 1.6's ``DriverNeeds``). Calls: ``SetChargingProfile`` (the plan's
``TxProfile``, :func:`profile_request`) and ``ClearChargingProfile``. A frame that is not OCPP, or an action not
supported, gets a CALLERROR. The site controller (the battery's ``BatteryStatus``, the site ``Clock``) speaks 1.6J.
"""

from __future__ import annotations

import contextlib

from ocpp.exceptions import PropertyConstraintViolationError
from ocpp.routing import on
from ocpp.v201 import ChargePoint, call, call_result
from ocpp.v201.datatypes import IdTokenInfoType, StatusInfoType
from ocpp.v201.enums import (
    Action,
    AuthorizationStatusEnumType,
    NotifyEVChargingNeedsStatusEnumType,
    RegistrationStatusEnumType,
)

from pipeline.live.ocpp16 import VENDOR, refused_frame, register_readings
from pipeline.live.planning import PlanningLoop
from pipeline.live.state import LiveError, as_timestamp
from pipeline.live.store import utc_text

SUBPROTOCOL = "ocpp2.0.1"
"""The WebSocket subprotocol of OCPP 2.0.1."""


def profile_request(payload: dict, transaction_id: str | None) -> dict:
    """The OCPP 2.0.1 ``SetChargingProfileRequest`` of a plan's profile, converted from its 1.6J payload
    (:func:`pipeline.live.charging_profile`: ``connectorId``, ``csChargingProfiles``): ``evseId`` is the connector
    number (EVSE ``N`` is connector ``N``); the profile keeps its id, stack level, purpose (``TxProfile``) and kind
    (``Absolute``); its one schedule (start, duration, rate unit W, the periods and their limits as planned) becomes
    the list ``chargingSchedule`` with the profile's id as its own; ``transactionId`` is the charger's (a string; None:
    none).

    Raises:
        KeyError: a payload without those fields.
    """
    p = payload["csChargingProfiles"]
    profile = {
        "id": int(p["chargingProfileId"]),
        "stackLevel": int(p["stackLevel"]),
        "chargingProfilePurpose": p["chargingProfilePurpose"],
        "chargingProfileKind": p["chargingProfileKind"],
        "chargingSchedule": [{"id": int(p["chargingProfileId"]), **p["chargingSchedule"]}],
    }
    if transaction_id is not None:
        profile["transactionId"] = str(transaction_id)
    return {"evseId": int(payload["connectorId"]), "chargingProfile": profile}


class Session(ChargePoint):
    """One connected OCPP 2.0.1 charge point, its handlers bound to the planning loop (module docstring).

    Args:
        cp_id: its id (the path's). connection: its WebSocket connection. planning: the central system's planning
            loop. role: as registered in the store (``"charge_point"``; the site controller speaks 1.6J).
    """

    def __init__(self, cp_id: str, connection, planning: PlanningLoop, role: str):
        super().__init__(cp_id, connection, response_timeout=planning.options.response_timeout_s)
        self.planning, self.role, self.connection = planning, role, connection

    async def route_message(self, raw_msg):
        """Route a frame; one that is not an OCPP message gets a CALLERROR (:func:`pipeline.live.ocpp16.refused_frame`,
        the frame's shape is the same in both versions)."""
        if not await refused_frame(self, raw_msg):
            await super().route_message(raw_msg)

    # ------------------------------------------------------------------------------ the central system's calls
    async def set_charging_profile(self, payload: dict) -> bool:
        """Send ``SetChargingProfile`` of a plan's profile (its 1.6J payload, :func:`profile_request`; the
        transaction's id there, the central system's, becomes the charger's); returns whether it was accepted.

        Raises:
            TimeoutError: no answer within the response timeout. websockets.exceptions.ConnectionClosed: the
                connection closed. OCPPError: a CALLERROR answered.
        """
        tx = payload["csChargingProfiles"].get("transactionId")
        charger_tx = None
        if tx is not None:
            row = self.planning.store.transaction(tx)
            charger_tx = (row or {}).get("charger_tx_id") or str(tx)
        req = profile_request(payload, charger_tx)
        res = await self.call(call.SetChargingProfile(req["evseId"], req["chargingProfile"]), suppress=False)
        return res.status == "Accepted"

    async def clear_charging_profile(self, profile_id: int | None, connector_id: int) -> None:
        """Send ``ClearChargingProfile`` of the profile ``profile_id`` (None: the ``TxProfile`` of EVSE
        ``connector_id``); the answer is not read. Raises what the call raises (a timeout, a closed connection)."""
        criteria = None
        if profile_id is None:
            criteria = {"evseId": int(connector_id), "chargingProfilePurpose": "TxProfile"}
        await self.call(call.ClearChargingProfile(charging_profile_id=profile_id, charging_profile_criteria=criteria))

    # ------------------------------------------------------------------------------------------ the handlers
    def check_evse(self, evse_id: int) -> int:
        """The connector of EVSE ``evse_id`` (the same number) when the site's mapping has it.

        Raises:
            PropertyConstraintViolationError: not in the mapping (answered as a CALLERROR).
        """
        if (self.id, int(evse_id)) not in self.planning.mapping:
            raise PropertyConstraintViolationError(
                description=f"evseId {evse_id} of charge point {self.id!r} is not in the site's mapping"
            )
        return int(evse_id)

    @on(Action.boot_notification)
    def on_boot(self, charging_station: dict, reason: str, **kwargs):
        return call_result.BootNotification(
            current_time=utc_text(self.planning.time_or_now()), interval=300, status=RegistrationStatusEnumType.accepted
        )

    @on(Action.heartbeat)
    def on_heartbeat(self, **kwargs):
        return call_result.Heartbeat(current_time=utc_text(self.planning.time_or_now()))

    @on(Action.status_notification)
    def on_status(self, timestamp: str, connector_status: str, evse_id: int, connector_id: int, **kwargs):
        when = self.planning.time_or_now()  # the charger's time where it gives a valid one, else the central system's
        with contextlib.suppress(LiveError):
            when = as_timestamp(timestamp, "timestamp")
        self.planning.store.set_connector_status(self.id, int(evse_id), connector_status, when)
        return call_result.StatusNotification()

    @on(Action.authorize)
    def on_authorize(self, id_token: dict, **kwargs):
        return call_result.Authorize(id_token_info=IdTokenInfoType(status=AuthorizationStatusEnumType.accepted))

    @on(Action.transaction_event)
    def on_transaction_event(
        self, event_type: str, timestamp: str, trigger_reason: str, seq_no: int, transaction_info: dict,
        meter_value: list | None = None, evse: dict | None = None, id_token: dict | None = None, **kwargs,
    ):  # fmt: skip
        store, tid = self.planning.store, str(transaction_info["transaction_id"])
        readings = register_readings(meter_value)
        row = store.charger_transaction(self.id, tid)
        if event_type == "Started" and (row is None or row["stop_time"] is not None):  # not a Started sent again
            if evse is None:
                raise PropertyConstraintViolationError(description=f"transaction {tid}: Started without its evse")
            connector = self.check_evse(evse["id"])
            start = readings.pop(0)[1] if readings else None
            tag = (id_token or {}).get("id_token", "")
            tx = store.start_transaction(self.id, connector, tag, timestamp, start, charger_tx_id=tid)
            for when, wh in readings:
                store.meter_value(tx, when, wh)
            self.planning.saw(timestamp)
            self.planning.request_plan()
        elif row is None:
            store.log(timestamp, "unknown_transaction", f"{self.id}: TransactionEvent {event_type} of transaction "
                      f"{tid}")  # fmt: skip
        elif row["stop_time"] is None:
            ended = event_type == "Ended"
            for when, wh in readings[:-1] if ended else readings:
                store.meter_value(row["id"], when, wh)
            if ended:
                stop = readings[-1][1] if readings else None
                store.stop_transaction(row["id"], timestamp, stop, transaction_info.get("stopped_reason"))
                self.planning.saw(timestamp)
                self.planning.request_plan()
        if id_token is None:
            return call_result.TransactionEvent()
        return call_result.TransactionEvent(id_token_info=IdTokenInfoType(status=AuthorizationStatusEnumType.accepted))

    @on(Action.meter_values)
    def on_meter_values(self, evse_id: int, meter_value: list, **kwargs):
        store = self.planning.store
        tx = store.open_transaction_at(self.id, evse_id) if evse_id else None  # EVSE 0: the station's own meter
        for when, wh in register_readings(meter_value) if tx is not None else []:
            store.meter_value(tx["id"], when, wh)
        return call_result.MeterValues()

    @on(Action.notify_ev_charging_needs)
    def on_charging_needs(self, charging_needs: dict, evse_id: int, custom_data: dict | None = None, **kwargs):
        """The car's departure and energy need at EVSE ``evse_id`` into its open transaction's plan (the
        ``sessionId`` of a ``customData`` of vendor :data:`pipeline.live.ocpp16.VENDOR`, where given, names its
        session); ``Rejected`` (and logged), with the reason, when there is no open transaction there, no departure or
        no energy amount."""
        tx = self.planning.store.open_transaction_at(self.id, evse_id)
        params = charging_needs.get("ac_charging_parameters") or charging_needs.get("dc_charging_parameters") or {}
        try:
            if tx is None:
                raise LiveError(f"evseId {evse_id}: no open transaction at charge point {self.id!r}")
            if "departure_time" not in charging_needs or "energy_amount" not in params:
                raise LiveError("chargingNeeds: give departureTime and the energyAmount of its charging parameters")
            custom = custom_data or {}
            session_id = custom.get("session_id") if custom.get("vendor_id") == VENDOR else None
            need_kwh = float(params["energy_amount"]) / 1000.0
            self.planning.driver_needs(tx["id"], charging_needs["departure_time"], need_kwh, session_id)
        except LiveError as exc:
            self.planning.store.log(self.planning.time_or_now(), "rejected_message", f"{self.id}: {exc}")
            return call_result.NotifyEVChargingNeeds(
                status=NotifyEVChargingNeedsStatusEnumType.rejected,
                status_info=StatusInfoType(reason_code="InvalidValue", additional_info=str(exc)[:512]),
            )
        return call_result.NotifyEVChargingNeeds(status=NotifyEVChargingNeedsStatusEnumType.accepted)
