"""The central system at a real site: the mapping alone decides a connector's socket, group, power and history (charge
point ids are names), and the console says what happens, one line each with the site's time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, make_site, write_site

from pipeline.live import csms
from pipeline.live.history import SESSION_SOCKET, history
from pipeline.live.planning import CsmsOptions
from pipeline.live.sources import (
    FeedHistory,
    LateFeed,
    SiteClock,
    SiteDataFeed,
    WallClock,
    check_clock_meets_feed,
    default_mapping,
    expected_session,
    fill_late,
)
from pipeline.live.state import LiveError
from pipeline.live.store import Store

FAST_HASH = 2**4
"""scrypt's cost in these tests' stores (the production default is 2**14: 50 ms a hash)."""
DC_KW, L2_KW = 50.0, 6.6
EV = {
    "n_sockets": 6,
    "socket_kw": DC_KW,
    "sockets": [{"count": 1, "kw": DC_KW, "stations": "CA-7"}, {"count": 5, "kw": L2_KW, "stations": "CA-*"}],
}
"""Two socket groups: socket 0 a 50 kW DC charger (station CA-7's sessions: one car on each day of the test split),
sockets 1-5 Level-2 ones (every other CA-* station)."""
NAMES = {("Garage-DC", 1): 0, **{(f"Bay-{i}", 1): i for i in range(1, 6)}}
"""A site's own charge point ids, matching no station pattern of the site."""


def _site(**overrides):
    """The 2-day synthetic site with the two socket groups of :data:`EV`, a 6 h window."""
    return make_site(days=2, n_sockets=6, mpc={"horizon_h": 6}, ev=EV, **overrides)


def _store(path) -> Store:
    return Store(path, scrypt_n=FAST_HASH)


class NoSessionsFeed:
    """A grid-carbon service: the MOER and the PV outlook of the site's data, and no sessions (it knows nothing of
    the cars: the history's sessions are those the central system saw)."""

    def __init__(self, site):
        self.feed = SiteDataFeed(site)

    def history(self, now: pd.Timestamp) -> FeedHistory:
        got = self.feed.history(now)
        return FeedHistory(got.series, got.sessions.iloc[:0], got.window_end)


async def _replay(site, db, mapping: dict, feed, ocpp: str = "1.6"):
    """The central system with ``mapping`` (site clock) and the simulated site's charge points under the same names,
    over the whole test split, speaking ``ocpp``; returns the result and the central system."""
    from pipeline.live.simsite import SimSite, register, site_passwords

    store = _store(db)
    passwords = site_passwords(site, mapping)
    register(store, passwords)
    central = csms.CentralSystem(site, store, SiteClock(), feed, mapping, CsmsOptions(controller="mpc"))
    server = await central.start("127.0.0.1", 0)
    url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        return await SimSite(site, url, passwords, mapping=mapping, ocpp=ocpp).run(), central
    finally:
        await central.stop()


def _last_history(central, site):
    """The history the central system plans from at the split's last step."""
    now = site.split("test").time[-1]
    got = central.feed.history(now)
    series, issued, _ = fill_late(got.series, now, site.config.dt_h)
    state = central.planning.live_state(now, FeedHistory(series, got.sessions, got.window_end), issued)
    return state, history(site, state, 6)


# ------------------------------------------------------------------------------------------------ the mapping
@pytest.mark.parametrize("ocpp", ["1.6", "2.0.1"])
def test_charge_point_names_are_names_the_mapping_decides(tmp_path, ocpp):
    """A site's charge points named as it likes (no station pattern of the site matches them; one is the DC charger),
    speaking OCPP 1.6J or 2.0.1: the whole 2-day test split through the central system and the simulated site
    (StartTransaction then DriverNeeds, or TransactionEvent Started then NotifyEVChargingNeeds),
    the feed a grid-carbon service without sessions, so the history's sessions are the central system's: every plan
    succeeds, each transaction is filed in the history under its mapped socket (the DC car under the DC group), the
    DC charger's profiles go above a Level-2 socket's power, and the run gives the default mapping's CO2 (the names
    alone changed)."""
    site = _site()
    default = default_mapping(site)
    assert set(default.values()) == set(NAMES.values()) and default != NAMES
    base, _ = asyncio.run(_replay(site, tmp_path / "default.sqlite", default, NoSessionsFeed(site), ocpp))
    res, central = asyncio.run(_replay(site, tmp_path / "named.sqlite", NAMES, NoSessionsFeed(site), ocpp))
    assert not central.store.events("plan_failed")
    assert res.steps == base.steps == site.split("test").num_steps
    assert len(central.plans) == res.steps
    print(f"\nnamed charge points: CO2 {res.co2_kg:.6f} kg, the default names' {base.co2_kg:.6f} kg")
    assert res.co2_kg == pytest.approx(base.co2_kg, abs=1e-9) and res.unserved_kwh == pytest.approx(base.unserved_kwh)

    txs = central.store.transactions()
    assert len(txs) == res.started > 0 and {t["charge_point"] for t in txs} >= {"Garage-DC", "Bay-1"}
    _, hist = _last_history(central, site)
    filed = hist.data.sessions.set_index("session_id")
    groups = site.config.ev.group_of_socket()
    for t in txs:
        row = filed.loc[t["session_id"] or f"tx-{t['id']}"]
        assert row.socket == NAMES[(t["charge_point"], t["connector"])], (t, row)
        assert groups[row.socket] == (0 if t["charge_point"] == "Garage-DC" else 1)
    limits = {}
    for p in central.store.profiles():
        periods = json.loads(p["payload"])["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"]
        limits.setdefault(p["charge_point"], []).extend(x["limit"] for x in periods)
    assert L2_KW * 1000 < max(limits["Garage-DC"]) <= DC_KW * 1000
    assert max(max(v) for k, v in limits.items() if k != "Garage-DC") <= L2_KW * 1000


def test_a_car_on_a_renamed_charger_is_planned_at_its_mapped_socket(tmp_path):
    """Over OCPP 1.6J, with the site's data as the feed: ``CA-PROBE1`` (a name the Level-2 group's ``CA-*`` pattern
    matches) mapped to the DC socket and ``PROBE-1`` (no pattern matches it) to a Level-2 socket. A car at
    CA-PROBE1 asks 40 kWh in an hour (StartTransaction, DriverNeeds): its profile gives it 40 kW, the DC socket's
    power. A car at PROBE-1 says nothing (StartTransaction alone): it is planned on what the Level-2 group's past
    sessions lead to expect. Once both have left, the history files each under its mapped socket and group."""
    from ocpp.v16 import call
    from websockets.asyncio.client import connect

    from pipeline.live.simsite import SimChargePoint, basic_auth, register

    site = _site()
    mapping = {("CA-PROBE1", 1): 0, ("PROBE-1", 1): 2} | {
        k: v for k, v in default_mapping(site).items() if v not in (0, 2)
    }
    store = _store(tmp_path / "csms.sqlite")
    passwords = {"CA-PROBE1": "pw-dc", "PROBE-1": "pw-l2"}
    register(store, passwords)
    central = csms.CentralSystem(site, store, SiteClock(), SiteDataFeed(site), mapping, CsmsOptions(controller="mpc"))
    start = site.config.split_bounds("test")[0]
    t0 = start + pd.Timedelta(hours=18)  # sockets 0 and 2 are free in the site's data then (the history's cars)
    iso = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731

    async def scenario():
        server = await central.start("127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with contextlib.AsyncExitStack() as stack:
            cps = {}
            for cp_id, pw in passwords.items():
                ws = await stack.enter_async_context(
                    connect(f"{url}/{cp_id}", subprotocols=["ocpp1.6"],
                            additional_headers={"Authorization": basic_auth(cp_id, pw)})
                )  # fmt: skip
                cps[cp_id] = SimChargePoint(cp_id, ws)
                stack.callback(asyncio.create_task(cps[cp_id].start()).cancel)
            central.planning.clock.advance(t0)
            tx = {}
            for cp_id, cp in cps.items():
                got = await cp.call(
                    call.StartTransaction(connector_id=1, id_tag="car", meter_start=0, timestamp=iso(t0))
                )
                tx[cp_id] = got.transaction_id
            needs = {"transactionId": tx["CA-PROBE1"], "departure": iso(t0 + pd.Timedelta(hours=1)), "energyKWh": 40.0}
            answer = await cps["CA-PROBE1"].call(
                call.DataTransfer(vendor_id="evhub", message_id="DriverNeeds", data=json.dumps(needs))
            )
            assert answer.status == "Accepted"
            assert await central.planning.plan_and_wait() is None
            sent = {p["charge_point"]: json.loads(p["payload"]) for p in store.profiles()}
            t1 = t0 + pd.Timedelta(hours=2)
            for cp_id, cp in cps.items():
                await cp.call(call.StopTransaction(meter_stop=1000, timestamp=iso(t1), transaction_id=tx[cp_id]))
            central.planning.clock.advance(t1)
            assert await central.planning.plan_and_wait() is None
        await central.stop()
        return tx, sent

    tx, sent = asyncio.run(scenario())
    assert not store.events("plan_failed")
    dc = sent["CA-PROBE1"]["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"]
    assert dc[0]["limit"] == pytest.approx(40_000.0, abs=1.0)  # 40 kWh in its one hour: the DC socket's power
    l2 = sent["PROBE-1"]["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"]
    assert max(p["limit"] for p in l2) <= L2_KW * 1000

    row = store.transaction(tx["PROBE-1"])
    assert row["needs_source"] == "expected"
    realised = central.feed.history(t0).sessions
    group = realised[realised.station_id != "CA-7"]  # the Level-2 group's stations
    stay, need = expected_session(group, t0, L2_KW)
    assert (pd.Timestamp(row["departure"]), row["need_kwh"]) == (t0 + stay, pytest.approx(need))
    assert expected_session(realised, t0, L2_KW) != (stay, need)  # the group's expectation, not the whole site's

    now = t0 + pd.Timedelta(hours=2)
    got = central.feed.history(now)
    state = central.planning.live_state(now, got, now)
    ses = state.sessions.set_index("session_id")
    assert ses.loc[f"tx-{tx['CA-PROBE1']}", SESSION_SOCKET] == 0 and ses.loc[f"tx-{tx['PROBE-1']}", SESSION_SOCKET] == 2
    filed = history(site, state, 6).data.sessions.set_index("session_id")
    assert filed.loc[f"tx-{tx['CA-PROBE1']}"].socket == 0 and filed.loc[f"tx-{tx['PROBE-1']}"].socket == 2


def test_the_history_files_a_session_by_its_socket_or_its_station():
    """A history's sessions go to their station's socket as the site's own split puts them, and a session whose row
    gives a socket goes there whatever its station is called (here the second day's DC car, renamed, at a Level-2
    socket); a station no group matches, or a socket the site does not have, is refused in one line naming the
    session."""
    from pipeline.live.state import LiveState, realised_history

    site = _site()
    data = site.split("test")
    t = int(data.sessions.arrival_step.max()) + 1
    series, sessions = realised_history(site, "test", t)

    def state(s):
        return LiveState(data.time[t].tz_convert(site.config.timezone), 0.5, [], series, s)

    plain = history(site, state(sessions), 6).data.sessions
    assert plain.session_id.tolist() == data.sessions.session_id.tolist()
    np.testing.assert_array_equal(plain.socket.to_numpy(), data.sessions.socket.to_numpy())  # the site's own split
    dc = data.sessions.set_index("session_id").loc["s3_0"]
    assert dc.socket == 0 and dc.station_id == "CA-7"
    moved = sessions.assign(**{SESSION_SOCKET: np.where(sessions.session_id == "s3_0", 4.0, np.nan)})
    moved.loc[moved.session_id == "s3_0", "station_id"] = "no pattern matches me"
    got = history(site, state(moved), 6).data.sessions.set_index("session_id")
    assert got.loc["s3_0"].socket == 4
    assert (got.drop("s3_0").socket == plain.set_index("session_id").drop("s3_0").socket).all()
    with pytest.raises(LiveError, match="session 's2_5': station 'XX-1' matches no socket group of the site"):
        history(site, state(sessions.assign(station_id="XX-1")), 6)
    with pytest.raises(LiveError, match="socket 6.0 is not a socket of the site"):
        history(site, state(sessions.assign(**{SESSION_SOCKET: 6.0})), 6)


# ------------------------------------------------------------------------------------------------ the console
@pytest.fixture
def console_off():
    """Put the loggers back as they were after a test that sets up the console."""
    ocpp_log, ours = logging.getLogger("ocpp"), logging.getLogger("evhub.csms")
    before = ocpp_log.level, list(ocpp_log.filters), ours.level, list(logging.getLogger().handlers)
    yield
    ocpp_log.setLevel(before[0])
    ocpp_log.filters[:] = before[1]
    ours.setLevel(before[2])
    for h in logging.getLogger().handlers:
        if h not in before[3]:
            logging.getLogger().removeHandler(h)


def test_the_console_says_what_happens_in_one_line_each(tmp_path, capsys, console_off, monkeypatch):
    """With the console at ``info``: a plan is one line with the site's time, the controller, the profiles and the
    wall time; a step the feed has no data for, a refusal at the handshake (404), an unknown action and a
    StartTransaction at a connector the mapping lacks (each a CALLERROR) are one line each, with no traceback; a
    failure the central system does not expect (a bug) keeps its traceback."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from pipeline.live.simsite import basic_auth, register

    site = make_site(days=2, n_sockets=6, mpc={"horizon_h": 6})
    store = _store(tmp_path / "csms.sqlite")
    cp = next(iter(default_mapping(site)))[0]
    register(store, {cp: "pw"})
    central = csms.CentralSystem(site, store, SiteClock(), SiteDataFeed(site), default_mapping(site))
    csms.console(central, "info")
    start, end = site.config.split_bounds("test")

    async def scenario():
        server = await central.start("127.0.0.1", 0)
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        for path, auth in (("CP-X", basic_auth("CP-X", "pw")), (cp, basic_auth(cp, "not it"))):
            with pytest.raises(InvalidStatus):
                async with connect(
                    f"{url}/{path}", subprotocols=["ocpp1.6"], additional_headers={"Authorization": auth}
                ):
                    pass
        headers = {"Authorization": basic_auth(cp, "pw")}
        async with connect(f"{url}/{cp}", subprotocols=["ocpp1.6"], additional_headers=headers) as ws:
            for frame in ('[2, "7", "MakeCoffee", {}]',
                          '[2, "8", "StartTransaction", {"connectorId": 9, "idTag": "x", "meterStart": 0, '
                          '"timestamp": "2019-05-03T15:00:00Z"}]'):  # fmt: skip
                await ws.send(frame)
                assert json.loads(await asyncio.wait_for(ws.recv(), 10))[0] == 4
        central.planning.clock.advance(start + pd.Timedelta(hours=8))
        assert await central.planning.plan_and_wait() is None
        with monkeypatch.context() as m:
            m.setattr(central.planning, "live_state", lambda *a: {}["a bug"])
            central.planning.clock.advance(start + pd.Timedelta(hours=9))
            assert (await central.planning.plan_and_wait()).startswith("KeyError")
        central.planning.clock.advance(end + pd.Timedelta(days=1))
        assert "MOER feed" in await central.planning.plan_and_wait()
        await central.stop()

    asyncio.run(scenario())
    err = capsys.readouterr().err
    print(err)
    records = re.split(r"\n(?=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d )", err.strip())  # each starts with its time
    assert len(records) == 9 and sum(len(r.splitlines()) > 1 for r in records) == 1, err

    def one(word: str) -> str:
        got = [r for r in records if word in r.splitlines()[0]]
        assert len(got) == 1, (word, got)
        return got[0]

    plan = one(" plan: mpc")
    assert plan.startswith("2019-05-03T08:00:00-07:00 INFO plan: mpc, 0 profile(s) sent, 0 accepted, ")
    assert plan.endswith(" ms")
    later = end + pd.Timedelta(days=1)
    assert one("plan_failed: MOER feed").startswith(
        f"{later.tz_convert(site.config.timezone).isoformat()} WARNING plan_failed: MOER feed: {later.isoformat()} is "
        "not a step of the site's test split"
    )
    assert one("refused: /CP-X").endswith(" WARNING refused: /CP-X: 404 unknown charge point 'CP-X'")
    assert one(f"refused: /{cp}").endswith(f" WARNING refused: /{cp}: 401 wrong password for {cp!r}")
    assert f"{cp}: MakeCoffee answered with CALLERROR NotSupported" in one("MakeCoffee")
    assert "PropertyConstraintViolation" in one("connectorId 9")
    assert one("plan_failed: KeyError").startswith("2019-05-03T09:00:00-07:00 WARNING plan_failed: KeyError: 'a bug'")
    bug = one("not one the central system expects (a bug)").splitlines()  # the bug keeps its traceback
    assert bug[1] == "Traceback (most recent call last):" and bug[-1] == "KeyError: 'a bug'"
    assert err.count("Traceback") == 1


def test_the_command_refuses_a_wall_clock_the_feed_cannot_meet(tmp_path):
    """``evhub-csms`` (its own process) with the wall clock (the default) and the site's data as the feed, which ends
    in 2019: one line naming the clock's time, the feed's span and what to do, exit 1, nothing served."""
    toml = write_site(_site(), tmp_path / "site")
    cmd = [sys.executable, "-m", "pipeline.live.csms", "--site", str(toml), "--controller", "mpc", "--port", "0"]
    cmd += ["--db", str(tmp_path / "csms.sqlite"), "--battery-file", str(tmp_path / "battery.json")]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"evhub-csms served on: {(exc.stdout or b'').decode(errors='replace')}") from None
    assert done.returncode == 1
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: clock: the wall clock reads "), err
    assert "2019-05-03 07:00 UTC .. 2019-05-05 07:00 UTC" in err[0] and "--clock site" in err[0]
    assert "listening" not in done.stdout


class _Fixed(WallClock):
    def __init__(self, t: pd.Timestamp):
        self.t = t

    def now(self) -> pd.Timestamp:
        return self.t


def test_the_start_up_check_passes_a_clock_the_feed_covers():
    """A wall clock within the feed's span, a site clock, and a feed without a fixed span pass; a wall clock past the
    span of a late feed's data does not (the message names the span and says what to do)."""
    site = _site()
    start, end = site.config.split_bounds("test")
    feed = SiteDataFeed(site)
    check_clock_meets_feed(_Fixed(start + pd.Timedelta(minutes=30)), feed, 1.0)
    check_clock_meets_feed(SiteClock(), feed, 1.0)

    class Live:
        def history(self, now):
            raise AssertionError("not called")

    check_clock_meets_feed(_Fixed(end + pd.Timedelta(days=900)), Live(), 1.0)
    with pytest.raises(LiveError, match=r"2019-05-03 07:00 UTC \.\. 2019-05-05 07:00 UTC.*--clock site"):
        check_clock_meets_feed(_Fixed(end), LateFeed(feed, []), 1.0)
    with pytest.raises(LiveError, match="the first of them is still to come"):
        check_clock_meets_feed(_Fixed(start - pd.Timedelta(hours=1)), feed, 1.0)
