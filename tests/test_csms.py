"""The central system (``evhub-csms``) against a simulated site of OCPP 1.6J clients on localhost: the loop gives the
study's CO2, it survives its faults (killed and restarted, a charge point dropped, a profile rejected, the MOER feed
late) with every car served and no transaction lost, and it refuses strangers and bad frames while still answering a
good client."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import ssl
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import CSMS_FAST_HASH as FAST_HASH  # noqa: F401 - the name other test modules import from here
from conftest import CSMS_HOURS as HOURS
from conftest import ROOT, csms_callerror, make_site, self_signed_cert, write_site
from conftest import assert_served as _served
from conftest import csms_boots as _boots
from conftest import csms_refused as _refused
from conftest import csms_serving as _serving
from conftest import csms_site as _site
from conftest import csms_store as _store
from conftest import study_co2 as _study_co2

from envs.kpis import rollout_traces
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.live import csms
from pipeline.live.simsite import SimChargePoint, SimSite, basic_auth, register, run_local, site_passwords
from pipeline.live.sources import LateFeed, SiteDataFeed, default_mapping, fill_late
from pipeline.live.store import Store, StoreError, check_password, hash_password


@pytest.fixture(scope="module")
def small():
    """The 2-day site and the study's CO2 and unserved energy over its first day."""
    site = _site()
    return site, _study_co2(site, HOURS)


# ------------------------------------------------------------------------------------------------ the loop
def test_the_csms_loop_gives_the_study_rows_co2(tmp_path, small):
    """mpc through the central system over the whole test split (2 days, across a local midnight): each hour planned
    from the store (meter values, drivers' needs, the battery's SOC report) and applied by the simulated site from
    the profiles and the battery set-point it received gives the study's CO2 to 0.1 kg, every car served."""
    site = small[0]
    co2, unserved = _study_co2(site)
    res, central = asyncio.run(run_local(site, _store(tmp_path / "csms.sqlite")))
    assert res.steps == res.hours == site.split("test").num_steps
    assert abs(res.co2_kg - co2) < 0.1, (res.co2_kg, co2)
    assert abs(res.unserved_kwh - unserved) < 1e-3
    _served(site, res, central)
    profiles = central.store.profiles()
    assert profiles and {p["status"] for p in profiles} == {"accepted"}
    assert len(central.plans) == len(central.store.plans()) == res.steps  # the events' plans fold into the hour's
    assert central.held == 0  # at hourly steps every step is an hour's start: a new plan each
    print(f"\ncsms loop, mpc, synthetic 2 days: {res.co2_kg:.4f} kg vs study {co2:.4f} kg ({res.co2_kg - co2:+.5f})")


def test_the_csms_loop_at_15_minutes_plans_at_each_hour_and_arrival_and_gives_the_study_co2(tmp_path):
    """The small site at ``dt_h = 0.25``, its first day (96 steps) through the central system and the simulated site:
    a plan at each hour's start and when a car comes, as the study's controller plans (its solves over the day), the
    profiles it sent held between plans (a period every 900 s) and the battery at the last plan's set-point for each
    step: the study's CO2 over the same day (to 1e-4 kg: the profiles' limits are rounded to 0.1 W), every car
    served."""
    site = make_site(days=2, n_sockets=6, mpc={"horizon_h": 6}, dt_h=0.25)
    co2, unserved = _study_co2(site, HOURS)
    mpc, solves = MPCController(site.split("test"), PlannerParams.of_site(site.config)), []

    def policy(obs, env):  # the study's controller (as run_mpc builds it), its solves counted over the day
        if int(env.t[0]) == 4 * HOURS:
            solves.append(mpc.solves)
        return mpc(obs, env)

    rollout_traces(policy, site, "test", "socket", bess_action="setpoint")
    res, central = asyncio.run(run_local(site, _store(tmp_path / "csms.sqlite"), hours=HOURS))
    assert res.steps == 4 * HOURS and res.hours == HOURS
    print(f"\ncsms loop at 15 minutes, mpc, synthetic day: {res.co2_kg:.5f} kg vs study {co2:.5f} kg "
          f"({res.co2_kg - co2:+.6f}), {len(central.plans)} plans in {res.steps} steps")  # fmt: skip
    assert abs(res.co2_kg - co2) < 1e-4 and abs(res.unserved_kwh - unserved) < 1e-3
    _served(site, res, central, HOURS)
    times = [pd.Timestamp(p["time"]) for p in central.store.plans()]
    start = site.config.split_bounds("test")[0]
    assert {start + pd.Timedelta(hours=h) for h in range(HOURS)} <= set(times)  # each hour's start
    assert HOURS < len(times) == len(central.plans) == solves[0] < res.steps
    assert central.held == res.steps - len(times)
    for row in central.store.profiles():
        periods = json.loads(row["payload"])["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"]
        assert [p["startPeriod"] for p in periods] == [900 * k for k in range(len(periods))]


def test_the_store_keeps_hashes_and_writes_ahead(tmp_path):
    """Passwords are stored as salted scrypt hashes only; the store runs in WAL mode and a recorded transaction is
    in the file (another connection sees it) as soon as the call returns."""
    store = _store(tmp_path / "s.sqlite")
    store.add_charge_point("CP-1", "secret-1")
    stored, role = store.charge_point("CP-1")
    assert "secret-1" not in stored and role == "charge_point"
    assert check_password(stored, "secret-1") and not check_password(stored, "secret-2")
    store.add_charge_point("CP-2", "secret-1")
    assert store.charge_point("CP-2")[0] != stored  # salted
    assert hash_password("x").startswith(f"scrypt${2**14}$8$1$")  # production strength by default
    with pytest.raises(StoreError, match="power of 2"):
        hash_password("x", 1000)
    tx = store.start_transaction("CP-1", 1, "tag", pd.Timestamp("2019-05-01T10:00Z"), 12)
    other = sqlite3.connect(tmp_path / "s.sqlite")
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert other.execute("SELECT meter_start_wh FROM transactions WHERE id = ?", (tx,)).fetchone()[0] == 12


# ------------------------------------------------------------------------------------------------ faults
def test_a_rejected_profile_is_retried_and_logged(tmp_path, small):
    """A charge point answers Rejected to its first profile: the central system logs it and sends it again; the car
    gets it and the run's CO2 is the clean run's."""
    site, (co2, _) = small
    cp = next(iter(default_mapping(site)))[0]
    res, central = asyncio.run(run_local(site, _store(tmp_path / "csms.sqlite"), hours=HOURS, reject={cp: 1}))
    assert res.rejected == 1
    assert len(central.store.events("profile_rejected")) == 1
    assert any(p["status"] == "accepted" and p["retries"] == 1 for p in central.store.profiles())
    _served(site, res, central, HOURS)
    print(f"\nfault, profile rejected once: CO2 {res.co2_kg - co2:+.5f} kg vs the clean run")
    assert abs(res.co2_kg - co2) < 0.1


def test_a_dropped_charge_point_gets_its_profile_again(tmp_path, small):
    """A charge point with a car drops off before an hour is planned (it restarts and forgets its profile) and
    reconnects after: the central system sends it its transaction's latest profile again."""
    site, (co2, _) = small
    data = site.split("test")
    ses = data.sessions[~data.sessions.rejected]
    long = ses[ses.departure_step - ses.arrival_step >= 3].iloc[0]
    t, sock = int(long.arrival_step) + 1, int(long.socket)
    cp_id = {i: c for (c, _), i in default_mapping(site).items()}[sock]

    async def drop(sim):
        await sim.drop(cp_id)

    res, central = asyncio.run(run_local(site, _store(tmp_path / "csms.sqlite"), hours=HOURS, hooks={t: drop}))
    resent = central.store.events("profile_resent")
    assert any(cp_id in e["detail"] for e in resent)
    assert any(p["status"] == "offline" for p in central.store.profiles())
    _served(site, res, central, HOURS)
    print(f"\nfault, charge point dropped and reconnected: CO2 {res.co2_kg - co2:+.5f} kg vs the clean run")
    assert abs(res.co2_kg - co2) < 0.05 * co2  # the hour it was off line it sent no meter value: planned on the last


def test_a_late_moer_feed_is_planned_on_the_last_forecast(tmp_path):
    """The MOER feed brings nothing for three hours (one at a time): the central system plans on the forecast issued
    an hour before, says so in its log, and every car is still served (the CO2 differs: other forecasts, other
    plans; the difference is printed). A 1-day site, run over its whole split: a window cut short would miss what
    the battery holds at its end."""
    site = _site(days=1)
    co2, _ = _study_co2(site)
    start = site.config.split_bounds("test")[0]
    late = [start + pd.Timedelta(hours=h) for h in (9, 12, 15)]
    feed = LateFeed(SiteDataFeed(site, "test"), late)
    res, central = asyncio.run(run_local(site, _store(tmp_path / "csms.sqlite"), feed=feed))
    logged = central.store.events("moer_feed_late")
    assert len(logged) == 3 and "planning on the one issued at" in logged[0]["detail"]
    _served(site, res, central)
    print(f"\nfault, MOER feed late 3 h: CO2 {res.co2_kg - co2:+.5f} kg vs the clean run")
    assert abs(res.co2_kg - co2) < 0.15 * co2


def test_fill_late_moves_the_last_forecast_on():
    """The hour without a forecast gets the previous hour's, one hour on; the realised MOER of that hour, missing too,
    is its forecast. At 15-minute steps the forecast of the step before is moved on by a step."""
    t = pd.date_range("2019-05-01", periods=3, freq="h", tz="UTC")
    h = pd.DataFrame(
        {
            "time": t,
            "pv_kw_per_kwp": [0.0] * 3,
            "moer_kg_per_kwh": [0.3, float("nan"), float("nan")],
            "moer_fc_h0": [0.3, 0.4, float("nan")],
            "moer_fc_h1": [0.4, 0.5, float("nan")],
            "moer_fc_h2": [0.5, 0.6, float("nan")],
        }
    )
    out, issued, late = fill_late(h, t[2], 1.0)
    assert late and issued == t[1]
    assert out.loc[2, ["moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]].tolist() == [0.5, 0.6, 0.6]
    assert out.loc[1, "moer_kg_per_kwh"] == 0.4
    same, issued, late = fill_late(h.iloc[:2], t[1], 1.0)
    assert not late and issued == t[1] and same is not None
    quarter = h.assign(time=pd.date_range("2019-05-01", periods=3, freq="15min", tz="UTC"))
    out, issued, late = fill_late(quarter, quarter.time[2], 0.25)  # a step on: a quarter of each next hour's value
    assert late and issued == quarter.time[1]
    np.testing.assert_allclose(out.loc[2, ["moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]].tolist(), [0.425, 0.525, 0.6])


def test_fill_late_plans_through_an_hour_without_the_feed_and_refuses_more():
    """At 15-minute steps a feed silent for an hour (four steps): each step since the last forecast gets it moved on
    by its steps (an hour on: the next hour's values), the realised MOER of the silent steps its forecast; a fifth
    silent step is refused as stale (left as it is)."""
    t = pd.date_range("2019-05-01", periods=6, freq="15min", tz="UTC")
    nan = float("nan")
    h = pd.DataFrame(
        {
            "time": t,
            "pv_kw_per_kwp": [0.0] * 6,
            "moer_kg_per_kwh": [0.3] + [nan] * 5,
            "moer_fc_h0": [0.4] + [nan] * 5,
            "moer_fc_h1": [0.8] + [nan] * 5,
            "moer_fc_h2": [0.6] + [nan] * 5,
        }
    )
    out, issued, late = fill_late(h, t[4], 0.25)
    assert late and issued == t[0]
    fc = out[["moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]].to_numpy()
    np.testing.assert_allclose(fc[4], [0.8, 0.6, 0.6])  # an hour on
    np.testing.assert_allclose(fc[2], [0.6, 0.7, 0.6])  # half an hour on: halfway to each next hour
    np.testing.assert_allclose(out.moer_kg_per_kwh[:4], [0.3, 0.5, 0.6, 0.7])  # the silent steps' forecast
    assert np.isnan(out.moer_kg_per_kwh[4])  # the step planned: not realised yet
    same, issued, late = fill_late(h, t[5], 0.25)
    assert late and issued == t[5] and same is h


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_csms_killed_mid_run_resumes_from_its_store(tmp_path, small):
    """The central system runs as its own process (the command, ``python -m pipeline.live.csms``); it is killed
    (SIGKILL) in the middle of the day with cars plugged in and started again on the same store (in the test's
    process, built as the command builds it: a second start-up of the command would only cost time): it resumes the
    open transactions from SQLite, re-plans, every car is served, no transaction is lost, and the CO2 is the clean
    run's."""
    site, (co2, _) = small
    toml = write_site(site, tmp_path / "site")
    passwords = site_passwords(site)
    db, battery = tmp_path / "csms.sqlite", tmp_path / "battery.json"
    store = _store(db)
    register(store, passwords)
    store.close()
    port = _free_port()
    args = csms.Args(site=str(toml), controller="mpc", clock="site", port=port, db=db, battery_file=battery)
    cmd = [sys.executable, "-m", "pipeline.live.csms", "--site", str(toml), "--controller", "mpc", "--clock", "site"]
    cmd += ["--port", str(port), "--db", str(db), "--battery-file", str(battery)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = site.split("test")
    ses = data.sessions[~data.sessions.rejected & (data.sessions.arrival_step < HOURS)]
    t_kill = int(ses.arrival_step.iloc[len(ses) // 2]) + 1
    restarted: list[csms.CentralSystem] = []

    async def kill(sim):
        proc.kill()
        proc.wait()
        central = csms.build(args)
        await central.start("127.0.0.1", port)
        restarted.append(central)
        await sim.connect_all()

    sim = SimSite(site, f"ws://127.0.0.1:{port}", passwords, hours=HOURS, hooks={t_kill: kill})

    async def replay():
        try:
            return await sim.run()
        finally:
            for central in restarted:
                await central.stop()

    try:
        res = asyncio.run(replay())
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9 and len(restarted) == 1
    txs = Store(db).transactions()
    assert res.unserved_kwh < 1e-3 and res.fallbacks == 0
    assert res.started == res.stopped == len(txs) == len(ses)
    assert all(t["stop_time"] is not None for t in txs)
    before = [t for t in txs if pd.Timestamp(t["start_time"]) < data.time[t_kill] < pd.Timestamp(t["stop_time"])]
    assert before, "no car was plugged in across the restart"
    assert restarted[0].store.events("profile_resent")  # the open transactions' profiles, sent again
    assert json.loads(battery.read_text())["time"] == data.time[HOURS - 1].isoformat()
    print(f"\nfault, central system killed and restarted: CO2 {res.co2_kg - co2:+.5f} kg vs the clean run")
    assert abs(res.co2_kg - co2) < 0.1


# ------------------------------------------------------------------------------------------------ security
@pytest.mark.parametrize(
    "case", ["wrong password", "unknown id", "no auth header", "user not the path's id", "battery without site"]
)
def test_strangers_are_refused_at_the_handshake(tmp_path, case):
    """Wrong password, unknown id, no credentials, another id's credentials, and the battery's set-point asked by a
    charge point: refused at the handshake (401 / 404), logged; a good client still boots afterwards."""

    async def scenario():
        async with _serving(tmp_path) as (central, port, cp, pw):
            url = f"ws://127.0.0.1:{port}"
            if case == "wrong password":
                code = await _refused(f"{url}/{cp}", {"Authorization": basic_auth(cp, "nope")})
            elif case == "unknown id":
                code = await _refused(f"{url}/CP-404", {"Authorization": basic_auth("CP-404", "x")})
            elif case == "no auth header":
                code = await _refused(f"{url}/{cp}", {})
            elif case == "user not the path's id":
                code = await _refused(f"{url}/{cp}", {"Authorization": basic_auth("site", pw["site"])})
            else:
                code = await _refused(f"{url}/battery", {"Authorization": basic_auth(cp, pw[cp])})
            assert code == (404 if case == "unknown id" else 401)
            assert central.store.events("refused")
            assert await _boots(url, cp, pw[cp]) == "Accepted"

    asyncio.run(scenario())


@pytest.mark.parametrize("case", ["malformed JSON", "unsupported action", "bad payload", "1 MB frame"])
def test_bad_frames_get_a_callerror_or_close_and_the_service_goes_on(tmp_path, case):
    """A frame that is not JSON, an action OCPP 1.6 does not have, a payload against the schema: a CALLERROR naming
    it; a frame over 1 MiB: the connection is closed (1009). A good client still boots afterwards."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def scenario():
        async with _serving(tmp_path) as (central, port, cp, pw):
            url = f"ws://127.0.0.1:{port}"
            headers = {"Authorization": basic_auth(cp, pw[cp])}
            async with connect(f"{url}/{cp}", subprotocols=["ocpp1.6"], additional_headers=headers) as ws:
                if case == "1 MB frame":
                    await ws.send('[2,"1","Heartbeat",{"x":"' + "x" * (1 << 20) + '"}]')
                    with pytest.raises(ConnectionClosed) as closed:
                        await asyncio.wait_for(ws.recv(), 10)
                    assert closed.value.rcvd.code == 1009
                else:
                    frame = {
                        "malformed JSON": '[2, "7", "Heartbeat", {',
                        "unsupported action": '[2, "7", "MakeCoffee", {}]',
                        "bad payload": '[2, "7", "StartTransaction", {"connectorId": "one"}]',
                    }[case]
                    want = {"malformed JSON": "Format", "unsupported action": "NotSupported", "bad payload": ""}[case]
                    await csms_callerror(ws, frame, want)
            assert await _boots(url, cp, pw[cp]) == "Accepted"

    asyncio.run(scenario())


async def _post(port: int, path: str, auth: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` as JSON to the HTTP endpoint: ``(status, JSON answer)``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nContent-Length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)
    raw = await reader.read()
    writer.close()
    status, _, rest = raw.partition(b"\r\n")
    return int(status.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_the_drivers_http_endpoint_sets_a_transactions_needs(tmp_path):
    """``POST /drivers/<charge point>/<connector>`` with the site controller's credentials sets the departure and
    need of the connector's open transaction, recorded as the driver's; a charge point's credentials get 401, a
    connector without a transaction 404, a body without its need or with a departure without its UTC offset 400."""
    from ocpp.v16 import call
    from websockets.asyncio.client import connect

    async def scenario():
        async with _serving(tmp_path) as (central, port, cp, pw):
            http = central.http_server.sockets[0].getsockname()[1]
            site_auth, path = basic_auth("site", pw["site"]), f"/drivers/{cp}/1"
            body = {"departure": "2019-05-03T18:00:00-07:00", "need_kwh": 12.5}
            assert (await _post(http, path, site_auth, body))[0] == 404  # no car yet
            headers = {"Authorization": basic_auth(cp, pw[cp])}
            async with connect(
                f"ws://127.0.0.1:{port}/{cp}", subprotocols=["ocpp1.6"], additional_headers=headers
            ) as ws:
                client = SimChargePoint(cp, ws)
                task = asyncio.create_task(client.start())
                started = await client.call(
                    call.StartTransaction(connector_id=1, id_tag="car", meter_start=0, timestamp="2019-05-03T16:00:00Z")
                )
                task.cancel()
            assert await _post(http, path, site_auth, body) == (200, {"transactionId": started.transaction_id})
            row = central.store.transaction(started.transaction_id)
            assert row["needs_source"] == "driver" and row["need_kwh"] == 12.5
            assert pd.Timestamp(row["departure"]) == pd.Timestamp(body["departure"])
            assert (await _post(http, path, headers["Authorization"], body))[0] == 401
            assert (await _post(http, path, site_auth, {"departure": body["departure"]}))[0] == 400
            assert (await _post(http, path, site_auth, body | {"departure": "2019-05-03T18:00"}))[0] == 400
            assert len(central.store.events("http_refused")) == 4

    asyncio.run(scenario())


def test_tls_profile_2(tmp_path):
    """With a certificate and key the central system speaks wss:// only: a client trusting the certificate boots, a
    plain ws:// client gets no handshake."""
    cert, key = self_signed_cert(tmp_path)
    server_tls = csms.server_tls(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))

    async def scenario():
        from websockets.asyncio.client import connect

        async with _serving(tmp_path, server_tls) as (_, port, cp, pw):
            assert await _boots(f"wss://127.0.0.1:{port}", cp, pw[cp], client_tls) == "Accepted"
            with pytest.raises(Exception):  # noqa: B017 - a plain client fails in the handshake, however it fails
                async with connect(f"ws://127.0.0.1:{port}/{cp}", subprotocols=["ocpp1.6"], open_timeout=5):
                    pass

    asyncio.run(scenario())


def test_the_command_says_what_is_wrong_in_one_line(capsys, tmp_path):
    """A bad option: one line naming it, exit 1."""
    assert csms.main(["--clock", "moon", "--db", str(tmp_path / "x.sqlite")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --clock:"), err
    assert csms.main(["--certfile", str(tmp_path / "c.pem"), "--db", str(tmp_path / "x.sqlite")]) == 1
    assert "--keyfile" in capsys.readouterr().err
    # no --controller: the report's answer, and without study results one line saying how to get one
    assert csms.main(["--db", str(tmp_path / "x.sqlite"), "--output-dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: controller: not given") and "--controller" in err[0], err
