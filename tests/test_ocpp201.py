"""OCPP 2.0.1 beside 1.6J in the central system (``evhub-csms``): a simulated site of both kinds of charge point gives
the study's CO2 with every session one transaction in the store and its needs from the car's
``NotifyEVChargingNeeds``; a 2.0.1 charge point that reconnects gets its profile again; the handshake refuses strangers
and bad frames get a CALLERROR as for 1.6; the store keeps 1.6 and 2.0.1 transactions in one table (an older store file
gains the charger's transaction id)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import ssl

import numpy as np
import pandas as pd
import pytest
from conftest import (
    CSMS_HOURS,
    assert_served,
    csms_boots,
    csms_callerror,
    csms_refused,
    csms_serving,
    csms_site,
    csms_store,
    self_signed_cert,
    study_co2,
)
from ocpp import v201
from ocpp.exceptions import OCPPError
from ocpp.messages import Call, validate_payload

from pipeline.live import charging_profile, csms
from pipeline.live.ocpp16 import register_readings
from pipeline.live.ocpp201 import SUBPROTOCOL, profile_request
from pipeline.live.simsite import SimChargePoint201, basic_auth, ocpp_versions, run_local
from pipeline.live.sources import default_mapping
from pipeline.live.state import LiveError


def _versions(central) -> dict[str, int]:
    """How many of the store's transactions each version made (2.0.1's carry the charger's id)."""
    txs = central.store.transactions()
    return {
        "2.0.1": sum(t["charger_tx_id"] is not None for t in txs),
        "1.6": sum(t["charger_tx_id"] is None for t in txs),
    }


def _needs_from_the_cars(central) -> None:
    """Each 2.0.1 transaction's need came from ``NotifyEVChargingNeeds``: the driver's, in whole Wh (``energyAmount``),
    kept as the float32 kWh of the site's data, with the session's id; each 1.6 one from ``DriverNeeds``."""
    for t in central.store.transactions():
        assert t["needs_source"] == "driver" and t["session_id"] is not None, t
        if t["charger_tx_id"] is not None:
            wh = round(t["need_kwh"] * 1000.0)
            assert t["need_kwh"] == float(np.float32(wh / 1000.0)), t


# ------------------------------------------------------------------------------------------------ the loop
def test_a_mix_of_16_and_201_charge_points_gives_the_study_co2(tmp_path):
    """mpc through the central system over the small site's 2-day test split, its charge points alternately OCPP 1.6J
    and 2.0.1 on the same port: the study's CO2 to 1e-4 kg (the cars of 2.0.1 tell their need in whole Wh), nothing
    unserved, every session one transaction of the store (both versions among them), each with its car's needs,
    every profile accepted."""
    site = csms_site()
    co2, unserved = study_co2(site)
    res, central = asyncio.run(run_local(site, csms_store(tmp_path / "csms.sqlite"), ocpp="mix"))
    print(f"\ncsms loop, 1.6 + 2.0.1, mpc, synthetic 2 days: {res.co2_kg:.5f} kg vs study {co2:.5f} kg "
          f"({res.co2_kg - co2:+.6f}), {_versions(central)}")  # fmt: skip
    assert abs(res.co2_kg - co2) < 1e-4 and abs(res.unserved_kwh - unserved) < 1e-3
    assert_served(site, res, central)
    assert min(_versions(central).values()) > 0
    _needs_from_the_cars(central)
    assert {p["status"] for p in central.store.profiles()} == {"accepted"}
    assert len(central.plans) == res.steps


def test_a_mix_at_15_minutes_gives_the_study_co2(tmp_path):
    """The small site at 15-minute steps, its first day (96 steps), charge points of both versions: the study's CO2 to
    1e-4 kg, a plan at each hour's start and when a car comes (the study's controller's plans), the 2.0.1 profiles
    with a period every 900 s, every car served."""
    site = csms_site(dt_h=0.25)
    co2, unserved = study_co2(site, CSMS_HOURS)
    res, central = asyncio.run(run_local(site, csms_store(tmp_path / "csms.sqlite"), hours=CSMS_HOURS, ocpp="mix"))
    print(f"\ncsms loop at 15 minutes, 1.6 + 2.0.1, synthetic day: {res.co2_kg:.6f} kg vs study {co2:.6f} kg "
          f"({res.co2_kg - co2:+.6f}), {len(central.plans)} plans in {res.steps} steps")  # fmt: skip
    assert res.steps == 4 * CSMS_HOURS
    assert abs(res.co2_kg - co2) < 1e-4 and abs(res.unserved_kwh - unserved) < 1e-3
    assert_served(site, res, central, CSMS_HOURS)
    assert min(_versions(central).values()) > 0
    _needs_from_the_cars(central)
    assert CSMS_HOURS < len(central.plans) < res.steps


def test_a_201_charge_point_that_reconnects_gets_its_profile_again(tmp_path):
    """A 2.0.1 charge point with a car drops off before an hour is planned (it forgets its profile) and reconnects
    after: the central system sends its open transaction's latest profile again, under the charger's transaction id,
    and every car is served."""
    site = csms_site()
    data = site.split("test")
    ses = data.sessions[~data.sessions.rejected]
    long = ses[ses.departure_step - ses.arrival_step >= 3].iloc[0]
    cp_id = {i: c for (c, _), i in default_mapping(site).items()}[int(long.socket)]
    dropped = {}

    async def drop(sim):
        dropped["profiles"] = dict(sim.cps[cp_id].profiles)
        await sim.drop(cp_id)

    hooks = {int(long.arrival_step) + 1: drop}
    store = csms_store(tmp_path / "csms.sqlite")
    res, central = asyncio.run(run_local(site, store, hours=CSMS_HOURS, hooks=hooks, ocpp="2.0.1"))
    assert any(cp_id in e["detail"] for e in central.store.events("profile_resent"))
    assert any(p["status"] == "offline" for p in central.store.profiles())
    held = next(iter(dropped["profiles"].values()))
    tx = central.store.charger_transaction(cp_id, held["transaction_id"])
    assert tx is not None and tx["charge_point"] == cp_id and tx["connector"] == 1
    assert_served(site, res, central, CSMS_HOURS)


# ------------------------------------------------------------------------------------------------ the protocol
def test_the_plans_profile_becomes_a_valid_201_request():
    """A plan's 1.6J profile converted for 2.0.1: evseId the connector, the schedule a list (id, start, duration, W,
    the periods as planned), the charger's transaction id as a string; valid by the OCPP 2.0.1 schema."""
    now = pd.Timestamp("2019-05-03T08:00", tz="America/Los_Angeles")
    old = charging_profile(now, 3, 2, [1.5, 0.0, 6.6], 6.6, 0.25, transaction_id=7)
    req = profile_request(old, "tx-abc")
    prof = req["chargingProfile"]
    assert req["evseId"] == 2 and prof["id"] == 4 and prof["transactionId"] == "tx-abc"
    assert prof["chargingProfilePurpose"] == "TxProfile" and prof["chargingProfileKind"] == "Absolute"
    (schedule,) = prof["chargingSchedule"]
    assert schedule["id"] == 4 and schedule["chargingRateUnit"] == "W" and schedule["duration"] == 2700
    assert schedule["startSchedule"] == "2019-05-03T15:00:00Z"
    assert [(p["startPeriod"], p["limit"]) for p in schedule["chargingSchedulePeriod"]] == [
        (0, 1500.0), (900, 0.0), (1800, 6600.0)
    ]  # fmt: skip
    asyncio.run(validate_payload(Call("1", "SetChargingProfile", req), "2.0.1"))
    with pytest.raises(Exception, match="transactionId"):  # noqa: B017 - the schema's own error type
        bad = req | {"chargingProfile": prof | {"transactionId": 7}}
        asyncio.run(validate_payload(Call("1", "SetChargingProfile", bad), "2.0.1"))


def test_register_readings_take_the_energy_register_in_wh():
    """Both versions' spellings: the energy register in Wh or kWh (with a multiplier), the default measurand counted,
    other measurands, units and single phases skipped."""
    mv = [
        {
            "timestamp": "t",
            "sampled_value": [
                {"value": 1200.5},
                {"value": 2.5, "unit_of_measure": {"unit": "kWh"}},
                {"value": 3, "unit_of_measure": {"unit": "Wh", "multiplier": 3}},
                {"value": 9, "measurand": "Power.Active.Import"},
                {"value": 9, "phase": "L1"},
                {"value": 9, "unit_of_measure": {"unit": "varh"}},
            ],
        }
    ]
    assert register_readings(mv) == [("t", 1200.5), ("t", 2500.0), ("t", 3000.0)]
    assert register_readings(None) == []
    v16 = [  # OCPP 1.6J's spelling: the unit a string, no multiplier; a phase's reading is not the total
        {
            "timestamp": "u",
            "sampled_value": [
                {"value": "1200.5"},
                {"value": "2.5", "unit": "kWh"},
                {"value": "9", "unit": "kWh", "phase": "L1"},
                {"value": "9", "unit": "kW", "measurand": "Power.Active.Import"},
            ],
        }
    ]
    assert register_readings(v16) == [("u", 1200.5), ("u", 2500.0)]


def test_ocpp_versions_alternate_in_a_mix():
    """mix alternates in the order of the ids, the first 1.6; an unknown choice is refused in one line."""
    assert ocpp_versions(["b", "a", "c"], "mix") == {"a": "1.6", "b": "2.0.1", "c": "1.6"}
    assert set(ocpp_versions(["a", "b"], "2.0.1").values()) == {"2.0.1"}
    with pytest.raises(LiveError, match="--ocpp: '3.0'"):
        ocpp_versions(["a"], "3.0")


async def _client(port: int, cp: str, password: str):
    """A raw 2.0.1 client (its session running); close its connection when done."""
    from websockets.asyncio.client import connect

    ws = await connect(
        f"ws://127.0.0.1:{port}/{cp}", subprotocols=[SUBPROTOCOL],
        additional_headers={"Authorization": basic_auth(cp, password)},
    )  # fmt: skip
    client = SimChargePoint201(cp, ws)
    asyncio.create_task(client.start())
    assert ws.subprotocol == SUBPROTOCOL
    return client


def _event(kind: str, tx: str, time: str, wh: float | None = None, seq: int = 0, **more):
    mv = None if wh is None else [{"timestamp": time, "sampled_value": [{"value": wh}]}]
    info = {"transaction_id": tx} | more.pop("info", {})
    return v201.call.TransactionEvent(kind, time, "Trigger", seq, info, meter_value=mv, **more)


def test_transaction_events_and_charging_needs_reach_the_store(tmp_path):
    """Over a real socket, a 2.0.1 charger's messages: a StatusNotification recorded for its EVSE; a Started without
    the register (its first reading becomes the start) and sent twice (one transaction); Updated readings in kWh;
    NotifyEVChargingNeeds with DC parameters sets the needs (the driver's: departure, energyAmount in kWh); needs
    without a departure, or at an EVSE without a car, are Rejected with the reason; an EVSE not in the mapping gets a
    CALLERROR; an Ended without a reading stops at the last one; an event of an unknown transaction is logged."""

    async def scenario():
        async with csms_serving(tmp_path) as (central, port, cp, pw):
            store, c = central.store, await _client(port, cp, pw[cp])
            await c.call(v201.call.StatusNotification("2019-05-03T16:00:00Z", "Occupied", 1, 1))
            assert [(s["charge_point"], s["connector"], s["status"]) for s in store.connector_statuses()] == [
                (cp, 1, "Occupied")
            ]  # fmt: skip
            start = _event("Started", "T-1", "2019-05-03T16:00:00Z", evse={"id": 1}, id_token={"id_token": "car",
                           "type": "Local"})  # fmt: skip
            assert (await c.call(start)).id_token_info["status"] == "Accepted"
            await c.call(start)  # sent again (its answer lost): still one transaction
            (tx,) = store.transactions()
            assert tx["charger_tx_id"] == "T-1" and tx["id_tag"] == "car" and tx["connector"] == 1
            upd = _event("Updated", "T-1", "2019-05-03T16:15:00Z", seq=1)
            upd.meter_value = [{"timestamp": "2019-05-03T16:15:00Z", "sampled_value": [{"value": 10.0,
                               "unit_of_measure": {"unit": "kWh"}}]}]  # fmt: skip
            await c.call(upd)
            await c.call(_event("Updated", "T-1", "2019-05-03T16:30:00Z", 12500.0, seq=2))
            assert store.transaction(tx["id"])["meter_start_wh"] == 10000.0
            assert store.open_transactions()[0]["energy_wh"] == 12500.0
            needs = {
                "requested_energy_transfer": "DC",
                "departure_time": "2019-05-03T18:00:00Z",
                "dc_charging_parameters": {"ev_max_current": 125, "ev_max_voltage": 400, "energy_amount": 21500},
            }
            got = await c.call(v201.call.NotifyEVChargingNeeds(needs, 1))
            assert got.status == "Accepted"
            row = store.transaction(tx["id"])
            assert row["needs_source"] == "driver" and row["need_kwh"] == 21.5
            assert pd.Timestamp(row["departure"]) == pd.Timestamp("2019-05-03T18:00:00Z")
            no_departure = {k: v for k, v in needs.items() if k != "departure_time"}
            got = await c.call(v201.call.NotifyEVChargingNeeds(no_departure, 1))
            assert got.status == "Rejected" and "departureTime" in got.status_info["additional_info"]
            assert (await c.call(v201.call.NotifyEVChargingNeeds(needs, 2))).status == "Rejected"  # no car there
            with pytest.raises(OCPPError) as err:
                await c.call(_event("Started", "T-2", "2019-05-03T16:40:00Z", 0.0, evse={"id": 9}), suppress=False)
            assert err.value.code == "PropertyConstraintViolation" and "evseId 9" in err.value.description
            await c.call(
                _event("Ended", "T-1", "2019-05-03T17:00:00Z", seq=3, info={"stopped_reason": "EVDisconnected"})
            )
            row = store.transaction(tx["id"])
            assert (
                row["stop_time"] is not None
                and row["meter_stop_wh"] == 12500.0
                and row["stop_reason"] == "EVDisconnected"
            )
            await c.call(_event("Updated", "T-404", "2019-05-03T17:05:00Z", 1.0))
            assert "T-404" in store.events("unknown_transaction")[-1]["detail"]
            assert len(store.transactions()) == 1
            await c.connection.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------ security
@pytest.mark.parametrize("case", ["wrong password", "unknown id", "no auth header", "user not the path's id"])
def test_strangers_speaking_201_are_refused_at_the_handshake(tmp_path, case):
    """Security profile 1 holds for ``ocpp2.0.1``: a wrong password, an unknown id, no credentials or another id's
    credentials are refused at the handshake (401 / 404) and logged; a good 2.0.1 client boots afterwards on the same
    port, and a client offering both versions gets 2.0.1."""

    async def scenario():
        async with csms_serving(tmp_path) as (central, port, cp, pw):
            url = f"ws://127.0.0.1:{port}"
            headers = {
                "wrong password": {"Authorization": basic_auth(cp, "nope")},
                "unknown id": {"Authorization": basic_auth("CP-404", "x")},
                "no auth header": {},
                "user not the path's id": {"Authorization": basic_auth("site", pw["site"])},
            }[case]
            path = "CP-404" if case == "unknown id" else cp
            assert await csms_refused(f"{url}/{path}", headers, SUBPROTOCOL) == (404 if case == "unknown id" else 401)
            assert central.store.events("refused")
            assert await csms_boots(url, cp, pw[cp], ocpp="2.0.1") == "Accepted"
            from websockets.asyncio.client import connect

            auth = {"Authorization": basic_auth(cp, pw[cp])}
            async with connect(f"{url}/{cp}", subprotocols=["ocpp1.6", SUBPROTOCOL], additional_headers=auth) as ws:
                assert ws.subprotocol == SUBPROTOCOL

    asyncio.run(scenario())


def test_tls_profile_2_speaking_201(tmp_path):
    """Security profile 2 holds for ``ocpp2.0.1``: over wss:// a 2.0.1 client trusting the certificate boots."""
    cert, key = self_signed_cert(tmp_path)
    client_tls = ssl.create_default_context(cafile=str(cert))

    async def scenario():
        async with csms_serving(tmp_path, csms.server_tls(cert, key)) as (_, port, cp, pw):
            assert await csms_boots(f"wss://127.0.0.1:{port}", cp, pw[cp], client_tls, ocpp="2.0.1") == "Accepted"

    asyncio.run(scenario())


@pytest.mark.parametrize("case", ["malformed JSON", "unsupported action", "a 1.6 action", "bad payload"])
def test_bad_201_frames_get_a_callerror_and_the_service_goes_on(tmp_path, case):
    """Over ``ocpp2.0.1``: a frame that is not JSON, an action OCPP 2.0.1 does not have (one of 1.6's among them), a
    payload against the 2.0.1 schema: a CALLERROR naming it, the connection kept; a good client still boots."""
    from websockets.asyncio.client import connect

    async def scenario():
        async with csms_serving(tmp_path) as (_, port, cp, pw):
            url = f"ws://127.0.0.1:{port}"
            headers = {"Authorization": basic_auth(cp, pw[cp])}
            async with connect(f"{url}/{cp}", subprotocols=[SUBPROTOCOL], additional_headers=headers) as ws:
                frame = {
                    "malformed JSON": '[2, "7", "Heartbeat", {',
                    "unsupported action": '[2, "7", "MakeCoffee", {}]',
                    "a 1.6 action": '[2, "7", "StartTransaction", {"connectorId": 1}]',
                    "bad payload": '[2, "7", "TransactionEvent", {"eventType": "Begun"}]',
                }[case]
                want = {"malformed JSON": "Format", "bad payload": ""}.get(case, "NotSupported")
                await csms_callerror(ws, frame, want)
                await ws.send('[2, "8", "Heartbeat", {}]')
                assert json.loads(await asyncio.wait_for(ws.recv(), 10))[:2] == [3, "8"]  # the connection goes on
            assert await csms_boots(url, cp, pw[cp], ocpp="2.0.1") == "Accepted"

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------ the store
def test_an_older_store_file_gains_the_chargers_transaction_id(tmp_path):
    """A store file written before 2.0.1 (its transactions table without ``charger_tx_id``) opens with the column
    added and its rows kept; 1.6 and 2.0.1 transactions then share the table, a 2.0.1 one found by the charger's id;
    opening it again changes nothing."""
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE transactions (id INTEGER PRIMARY KEY AUTOINCREMENT, charge_point TEXT NOT NULL, connector "
        "INTEGER NOT NULL, id_tag TEXT NOT NULL, start_time TEXT NOT NULL, meter_start_wh REAL NOT NULL, stop_time "
        "TEXT, meter_stop_wh REAL, stop_reason TEXT, departure TEXT, need_kwh REAL, session_id TEXT, needs_source "
        "TEXT NOT NULL DEFAULT 'expected', cleared INTEGER NOT NULL DEFAULT 0);"
        "INSERT INTO transactions (charge_point, connector, id_tag, start_time, meter_start_wh) VALUES "
        "('CA-1', 1, 'old', '2019-05-01T10:00:00+00:00', 5.0);"
    )
    db.close()
    store = csms_store(path)
    (old,) = store.transactions()
    assert old["id_tag"] == "old" and old["charger_tx_id"] is None
    t0 = pd.Timestamp("2019-05-01T11:00Z")
    a = store.start_transaction("CA-1", 1, "car-a", t0, 100.0)
    b = store.start_transaction("CA-2", 1, "car-b", t0, 200.0, charger_tx_id="uuid-b")
    assert store.charger_transaction("CA-2", "uuid-b")["id"] == b
    assert store.charger_transaction("CA-1", "uuid-b") is None
    assert [t["id"] for t in store.open_transactions()] == [old["id"], a, b]
    store.stop_transaction(b, t0 + pd.Timedelta(hours=1), None, "EVDisconnected")
    assert store.transaction(b)["meter_stop_wh"] == 200.0  # no reading given: the last one
    store.close()
    again = csms_store(path)
    assert len(again.transactions()) == 3
    assert sum(r["name"] == "charger_tx_id" for r in again.db.execute("PRAGMA table_info(transactions)")) == 1
    again.close()
