"""The operator's page of the central system (``GET /`` and ``GET /status.json`` on the HTTP port): a run of the small
synthetic site through the central system and its simulated site, paused midway with cars in and plans made, the
central system serving while the page is read: its JSON is the store's (cars, needs, limits, battery, plans, refusals,
statuses), its CO2 so far the simulated site's, its uncontrolled CO2 the study's ``uncontrolled`` run's over the same
hours; it needs the site controller's credentials; and headless Chromium renders the store's numbers."""

from __future__ import annotations

import asyncio
import html
import json
import re
import shutil
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import make_site

from envs import timestep
from pipeline.control import registry
from pipeline.live.csms import CentralSystem, CsmsOptions
from pipeline.live.operator import LAST_EVENTS, LAST_PLANS, ROUTINE_EVENTS, battery_kwh, metered_kwh, profile_limit_kw
from pipeline.live.simsite import SimSite, basic_auth, register, site_passwords
from pipeline.live.sources import SiteClock, SiteDataFeed, default_mapping
from pipeline.live.store import Store, StoreError

FAST_HASH = 2**4
"""scrypt's cost in these tests' stores (the production default is 2**14)."""
PAUSE = 14
"""The step the run pauses at: hour 14 of the small site's test split (its first day), cars in, 14 plans made."""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH = 1280
"""The screenshot's width, px."""


# ------------------------------------------------------------------------------------------------ the paused run
async def _get(port: int, path: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
    """``GET path`` on the HTTP port: ``(status, headers (lower-case names), body)``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n"
    writer.write(head.encode())
    raw = await reader.read()
    writer.close()
    top, _, body = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def _browser(browser: str, profile: Path, url: str, *args: str) -> str:
    """Headless Chromium on ``url`` at :data:`WIDTH` px, 5 s of virtual time (the page's script fetches its data and
    renders it); returns its stdout. Run as a subprocess of the event loop, so that the central system serves it."""
    proc = await asyncio.create_subprocess_exec(
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
        f"--user-data-dir={profile}", f"--window-size={WIDTH},1400", "--virtual-time-budget=5000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, f"{browser} exited {proc.returncode}: {err.decode()[-2000:]}"
    return out.decode()


@dataclass
class Paused:
    """What the paused run gave: the site, the JSON fetched with the site controller's credentials, the store at that
    moment (``store``: its open transactions, plans, events, battery, statuses), each open transaction's limit as its
    simulated charger holds it, the simulated site's CO2 after each step, the statuses sent, the answers to requests
    without good credentials, and (with a browser) the rendered DOM, the events then, and the screenshot."""

    site: object
    status: dict
    store: dict
    limits: dict[int, float | None]
    co2_after: list[float]
    sent: dict[tuple[str, int], tuple[str, str]]
    refused: dict[str, tuple[int, dict]]
    page: tuple[int, dict, bytes]
    dom: str | None = None
    dom_events: list[dict] | None = None
    shot: Path | None = None


def _snapshot(store: Store) -> dict:
    return {
        "open": store.open_transactions(),
        "plans": store.plans(),
        "events": store.events(),
        "soc": store.latest_battery("soc"),
        "setpoint": store.latest_battery("setpoint_kw"),
        "statuses": store.connector_statuses(),
    }


async def _send_statuses(sim: SimSite, now: pd.Timestamp) -> dict[tuple[str, int], tuple[str, str]]:
    """Each connector's StatusNotification: ``Charging`` with a car, else ``Available``, one free connector
    ``Faulted`` (``GroundFailure``); and a late ``Preparing`` (an hour old) to a charging one, to be kept out."""
    from ocpp.v16 import call

    sent = {}
    busy = {sim.socket_of[i] for i in sim.open}
    free = sorted(set(sim.socket_of.values()) - busy)
    for cp, conn in sorted(sim.socket_of.values()):
        status, error = ("Charging" if (cp, conn) in busy else "Available"), "NoError"
        if (cp, conn) == free[0]:
            status, error = "Faulted", "GroundFailure"
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        await sim.cps[cp].call(
            call.StatusNotification(connector_id=conn, error_code=error, status=status, timestamp=stamp)
        )
        sent[(cp, conn)] = (status, error)
    cp, conn = sorted(busy)[0]
    late = (now - pd.Timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    await sim.cps[cp].call(
        call.StatusNotification(connector_id=conn, error_code="NoError", status="Preparing", timestamp=late)
    )
    return sent


async def _paused_run(site, db: Path, profile: Path) -> Paused:
    """The central system (site clock, HTTP port) and the simulated site, a profile rejected once; at step
    :data:`PAUSE` (the central system serving, nothing else happening) the page is read every way."""
    store = Store(db, scrypt_n=FAST_HASH)
    passwords = site_passwords(site)
    register(store, passwords)
    mapping = default_mapping(site)
    central = CentralSystem(site, store, SiteClock(), SiteDataFeed(site), mapping, CsmsOptions(controller="mpc"))
    server = await central.start("127.0.0.1", 0, http_port=0)
    http = central.http_server.sockets[0].getsockname()[1]
    site_auth = basic_auth("site", passwords["site"])
    co2_after: list[float] = []
    got: list[Paused] = []

    async def each(sim):
        co2_after.append(sim.result.co2_kg)

    async def pause(sim):
        co2_after.append(sim.result.co2_kg)
        now = central.planning.clock.now()
        sent = await _send_statuses(sim, now)
        cp = next(iter(mapping))[0]
        refused = {
            "page, no credentials": await _get(http, "/", None),
            "data, no credentials": await _get(http, "/status.json", None),
            "data, a charge point's": await _get(http, "/status.json", basic_auth(cp, passwords[cp])),
            "page, wrong password": await _get(http, "/", basic_auth("site", "not-it")),
        }
        page = await _get(http, "/", site_auth)
        code, _, body = await _get(http, "/status.json", site_auth)
        assert code == 200, body
        limits = {
            o.tx: sim.cps[sim.socket_of[i][0]].limit_kw(sim.socket_of[i][1], now, o.tx) for i, o in sim.open.items()
        }
        done = Paused(site, json.loads(body), _snapshot(store), limits, list(co2_after), sent, refused, page)
        browser = next((b for b in BROWSERS if shutil.which(b)), None)
        if browser is not None:
            url = f"http://site:{passwords['site']}@127.0.0.1:{http}/"
            done.dom = await _browser(browser, profile, url, "--dump-dom")
            done.dom_events = store.events()
            done.shot = profile.parent / "operator.png"
            await _browser(browser, profile, url, f"--screenshot={done.shot}")
        got.append(done)

    sim = SimSite(site, f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}", passwords, hours=PAUSE + 1,
                  hooks={**dict.fromkeys(range(PAUSE), each), PAUSE: pause})  # fmt: skip
    sim.pending_rejects[next(iter(mapping))[0]] = 1
    try:
        await sim.run()
    finally:
        await central.stop()
        store.close()
    return got[0]


@pytest.fixture(scope="module")
def paused(tmp_path_factory) -> Paused:
    """The small site (2 days, 6 sockets, hourly) run to step :data:`PAUSE` and read there."""
    tmp = tmp_path_factory.mktemp("operator")
    site = make_site(days=2, n_sockets=6, mpc={"horizon_h": 6})
    return asyncio.run(_paused_run(site, tmp / "csms.sqlite", tmp / "profile"))


# ------------------------------------------------------------------------------------------------ the JSON
def test_the_json_is_the_stores(paused):
    """``status.json`` at the pause: the cars in are the store's open transactions (where, since when, delivered from
    the meter, the need, departure and its source), each with the limit its charger holds now; the battery's last SOC
    and set-point; the plans made (the last ones with their wall time); the refusals and failures (counted by kind, the
    last ones listed); every charge point connected; each connector's last status (a late one kept out)."""
    d, s, site = paused.status, paused.store, paused.site
    mapping = default_mapping(site)
    assert [c["id"] for c in d["cars"]] == [t["id"] for t in s["open"]] and len(s["open"]) >= 2
    assert d["summary"]["cars_in"] == len(s["open"])
    for car, tx in zip(d["cars"], s["open"]):
        delivered = (tx["energy_wh"] - tx["meter_start_wh"]) / 1000.0
        assert (car["charge_point"], car["connector"]) == (tx["charge_point"], tx["connector"])
        assert car["socket"] == mapping[(tx["charge_point"], tx["connector"])]
        assert car["start"] == tx["start_time"] and car["departure"] == tx["departure"]
        assert car["need_kwh"] == tx["need_kwh"] and car["needs_source"] == tx["needs_source"] == "driver"
        assert car["delivered_kwh"] == pytest.approx(delivered, abs=1e-12)
        assert car["remaining_kwh"] == pytest.approx(max(0.0, tx["need_kwh"] - delivered), abs=1e-12)
        assert paused.limits[tx["id"]] is not None
        assert car["limit_kw"] == pytest.approx(paused.limits[tx["id"]], abs=1e-9)  # the charger's own
    assert d["battery"]["soc"] == s["soc"][1] and d["battery"]["setpoint_kw"] == s["setpoint"][1]
    plans = d["plans"]
    assert plans["count"] == len(s["plans"]) == PAUSE
    assert plans["mean_wall_s"] == pytest.approx(np.mean([p["wall_s"] for p in s["plans"]]))
    want = [{k: p[k] for k in ("time", "controller", "wall_s", "profiles")} for p in s["plans"][::-1][:LAST_PLANS]]
    assert [{k: p[k] for k in ("time", "controller", "wall_s", "profiles")} for p in plans["last"]] == want
    events = d["events"]
    assert events["counts"] == dict(Counter(e["kind"] for e in s["events"]))
    assert {"profile_rejected", "http_refused"} <= set(events["counts"])
    listed = [e for e in s["events"][::-1] if e["kind"] not in ROUTINE_EVENTS][:LAST_EVENTS]
    assert [(e["kind"], e["detail"]) for e in events["last"]] == [(e["kind"], e["detail"]) for e in listed]
    points = {p["id"]: p for p in d["charge_points"]}
    assert set(points) == {cp for cp, _ in mapping} | {"site"} and all(p["connected"] for p in points.values())
    assert d["summary"]["connected"] == d["summary"]["charge_points"] == len({cp for cp, _ in mapping})
    shown = {(cp, c["connector"]): (c["status"], c["error_code"]) for cp, p in points.items() for c in p["connectors"]}
    assert shown == paused.sent  # the late Preparing kept out
    assert {(r["charge_point"], r["connector"]): (r["status"], r["error_code"]) for r in s["statuses"]} == paused.sent
    for car in d["cars"]:
        (slot,) = [c for c in points[car["charge_point"]]["connectors"] if c["connector"] == car["connector"]]
        assert slot["transaction_id"] == car["id"] and slot["limit_kw"] == car["limit_kw"]


def test_the_co2_so_far_is_the_simulated_sites_and_the_uncontrolled_the_studys(paused):
    """The CO2 so far covers the test split's steps up to the last SOC report (step ``PAUSE - 1``: the steps whose
    meters and battery are known): the simulated site's own CO2 over them (its env's), and the uncontrolled site's the
    study's ``uncontrolled`` run over the same steps, each to 1 Wh per transaction at the highest MOER (the simulated
    meters count whole Wh at a transaction's start and stop)."""
    site, co2 = paused.site, paused.status["co2"]
    start = site.config.split_bounds("test")[0]
    dt = pd.Timedelta(timestep.step_timedelta(site.config.dt_h))
    steps = PAUSE - 1
    assert co2["start"] == start.isoformat() and co2["end"] == (start + steps * dt).isoformat()
    assert co2["steps"] == steps and co2["hours"] == steps and co2["steps_without_moer"] == 0
    data = site.split("test")
    n_tx = int((~data.sessions.rejected & (data.sessions.arrival_step < PAUSE)).sum())
    tolerance = n_tx * 1e-3 * float(data.moer[:steps].max())
    assert abs(co2["co2_kg"] - paused.co2_after[steps]) < tolerance, (co2["co2_kg"], paused.co2_after[steps])
    _, traces = registry.get("uncontrolled").simulate(site, "test")
    study = float(traces.co2_kg.iloc[:steps].sum())
    assert abs(co2["uncontrolled_co2_kg"] - study) < tolerance, (co2["uncontrolled_co2_kg"], study)
    assert co2["uncontrolled_ev_kwh"] == pytest.approx(float(traces.ev_charge_kw.iloc[:steps].sum()), abs=n_tx * 1e-3)
    assert co2["saved_kg"] == pytest.approx(co2["uncontrolled_co2_kg"] - co2["co2_kg"])
    assert co2["pv_kwh"] == pytest.approx(float(data.pv_kw[:steps].sum()) * site.config.dt_h)
    here, there = co2["co2_kg"], co2["uncontrolled_co2_kg"]
    print(f"\noperator's page at hour {steps}: {here:.4f} kg (the simulated site's {paused.co2_after[steps]:.4f}), "
          f"uncontrolled {there:.4f} kg (the study's {study:.4f})")  # fmt: skip


def test_the_page_needs_the_site_controllers_credentials(paused):
    """``GET /`` and ``GET /status.json`` without credentials, with a charge point's or with a wrong password: 401 with
    a Basic challenge; with the site controller's: the page, HTML that loads nothing from elsewhere, never cached."""
    for case, (code, headers, _) in paused.refused.items():
        assert code == 401, case
        assert headers.get("www-authenticate", "").startswith("Basic"), case
    code, headers, body = paused.page
    assert code == 200 and headers["content-type"].startswith("text/html")
    assert headers["cache-control"] == "no-store" and "default-src 'none'" in headers["content-security-policy"]
    text = body.decode()
    assert "<script>" in text and "status.json" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the page loads something from elsewhere"


# ------------------------------------------------------------------------------------------------ the browser
def _rendered(dom: str) -> tuple[dict[str, str], dict[int, dict[str, str]], dict[str, tuple[str, list[str]]]]:
    """What the page shows: each ``<span id>``'s text, each car row's cells (by ``data-field``) by transaction id, and
    each charge point's connected flag and connectors' statuses."""
    ids = {m[1]: html.unescape(m[2]) for m in re.finditer(r'<span id="([\w-]+)">([^<]*)</span>', dom)}
    cars = {}
    for m in re.finditer(r'<tr data-tx="(\d+)">(.*?)</tr>', dom, flags=re.S):
        cells = re.finditer(r'<td data-field="(\w+)"[^>]*>([^<]*)</td>', m[2])
        cars[int(m[1])] = {c[1]: html.unescape(c[2]) for c in cells}
    cps = {}
    for m in re.finditer(r'<div class="chip[^"]*" data-cp="([^"]+)" data-connected="(\w+)">(.*?)</div></div>', dom):
        cps[html.unescape(m[1])] = (m[2], re.findall(r'data-field="status">([^<]*)<', m[3]))
    return ids, cars, cps


def _close(text: str, value: float, digits: int) -> bool:
    return abs(float(text) - value) <= 0.5 * 10.0**-digits + 1e-9


def test_the_page_renders_the_stores_numbers_in_headless_chromium(paused):
    """In headless Chromium at 1280 px (the central system serving, the run paused), the page's script fetches
    ``status.json`` and fills itself in: the cars in with their delivered energy, need, what is still needed and limit,
    the battery's set-point, the plans made, the CO2 so far and the uncontrolled site's, the charge points connected
    and their statuses are the store's (to the digits shown); a screenshot 1280 px wide is written."""
    if paused.dom is None:
        pytest.skip(
            f"no headless browser on PATH (looked for {', '.join(BROWSERS)}); `apt-get install chromium` runs it"
        )
    assert 'data-rendered="' in paused.dom, "the page's script did not render its data"
    ids, cars, cps = _rendered(paused.dom)
    s, co2 = paused.store, paused.status["co2"]
    assert ids["cars-in"] == str(len(s["open"])) and ids["plans-made"] == str(len(s["plans"]))
    assert _close(ids["setpoint-kw"], s["setpoint"][1], 2) and _close(ids["soc-pct"], 100 * s["soc"][1], 1)
    assert _close(ids["co2-kg"], co2["co2_kg"], 2) and _close(ids["uncontrolled-kg"], co2["uncontrolled_co2_kg"], 2)
    assert _close(ids["saved-kg"], co2["saved_kg"], 2)
    assert set(cars) == {t["id"] for t in s["open"]}
    for tx in s["open"]:
        shown, delivered = cars[tx["id"]], (tx["energy_wh"] - tx["meter_start_wh"]) / 1000.0
        assert shown["charge_point"] == tx["charge_point"] and shown["needs_source"] == tx["needs_source"]
        assert _close(shown["need_kwh"], tx["need_kwh"], 2) and _close(shown["delivered_kwh"], delivered, 2)
        assert _close(shown["remaining_kwh"], max(0.0, tx["need_kwh"] - delivered), 2)
        assert _close(shown["limit_kw"], paused.limits[tx["id"]], 2)
    assert set(cps) == {p["id"] for p in paused.status["charge_points"]}
    assert all(flag == "yes" for flag, _ in cps.values())
    for (cp, _), (status, _) in paused.sent.items():
        assert status in cps[cp][1]
    shot = paused.shot.read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", shot[16:24])[0] == WIDTH


# ------------------------------------------------------------------------------------------------ the parts
class _SlowFeed:
    """The site's data as the MOER feed, each history taking ``delay_s`` (a slow grid-carbon service)."""

    def __init__(self, site, delay_s: float):
        self.feed, self.delay_s = SiteDataFeed(site), delay_s

    def history(self, now):
        import time

        time.sleep(self.delay_s)
        return self.feed.history(now)


def test_the_co2_so_far_is_the_grids_import_at_the_moer_and_a_slow_one_does_not_hold_the_page(tmp_path, monkeypatch):
    """From a store written by hand (one car metered 3, 3 and 0.5 kWh over three early-morning hours, the battery's
    SOC up 10 % then down 5 %): the CO2 so far is each hour's grid import (the car plus the battery's charge, less its
    discharge and the PV) at the hour's MOER, over the hours up to the last SOC report; the uncontrolled site's the car
    at full power from its arrival until it has its need, the battery idle. A computation slower than the page waits
    gives a note, and its figure at the next request."""
    from pipeline.live import operator
    from pipeline.live.planning import PlanningLoop

    monkeypatch.setattr(operator, "CO2_WAIT_S", 0.05)
    site = make_site(days=1, n_sockets=6)
    cfg, data = site.config, site.split("test")
    cp = next(iter(default_mapping(site)))
    store = Store(tmp_path / "s.sqlite", scrypt_n=FAST_HASH)
    at = [data.time[k] for k in range(5, 9)]  # 05:00 .. 08:00 local: steps 5, 6, 7 counted
    tx = store.start_transaction(cp[0], cp[1], "car", at[0], 0.0)
    for t, wh in zip(at[1:], (3000.0, 6000.0, 6500.0)):
        store.meter_value(tx, t, wh)
    store.set_needs(tx, data.time[12], 10.0, None, "driver")
    for t, soc in zip(at, (0.5, 0.6, 0.6, 0.55)):
        store.battery(t, "soc", soc)
    clock = SiteClock(at[-1])
    planning = PlanningLoop(site, store, clock, _SlowFeed(site, 0.3), default_mapping(site), CsmsOptions(), None)
    page = operator.OperatorPage(planning)

    async def twice():
        first = await page.co2(clock.now())
        await page.co2_task
        return first, await page.co2(clock.now())

    first, co2 = asyncio.run(twice())
    assert first == {"note": "the CO2 so far is being computed"}
    b, steps = cfg.bess, slice(5, 8)
    ev = np.array([3.0, 3.0, 0.5])
    battery = np.array([0.1 * b.capacity_kwh / b.eta_charge, 0.0, -0.05 * b.capacity_kwh * b.eta_discharge])
    pv = data.pv_kw[steps] * cfg.dt_h
    want = float((np.clip(ev + battery - pv, 0.0, None) * data.moer[steps]).sum())
    assert cfg.ev.socket_kw == 6.6 and cfg.dt_h == 1.0
    full = np.array([6.6, 3.4, 0.0])  # full power until its 10 kWh are in
    base = float((np.clip(full - pv, 0.0, None) * data.moer[steps]).sum())
    assert pv[2] > 0 and want > 0  # the PV of 07:00 counts
    assert (co2["start"], co2["end"], co2["steps"]) == (at[0].isoformat(), at[-1].isoformat(), 3)
    assert co2["co2_kg"] == pytest.approx(want, rel=1e-9) and co2["ev_kwh"] == pytest.approx(6.5)
    assert co2["uncontrolled_co2_kg"] == pytest.approx(base, rel=1e-9)
    assert co2["uncontrolled_ev_kwh"] == pytest.approx(10.0)
    store.close()


def test_a_fresh_central_systems_page_says_there_is_nothing_yet(tmp_path):
    """Before anything happens (no charge point connected, no car, no SOC report, no plan): the page's data say so,
    with every charge point of the mapping listed, and are JSON without NaN."""
    site = make_site(days=1, n_sockets=6)
    store = Store(tmp_path / "s.sqlite", scrypt_n=FAST_HASH)
    central = CentralSystem(site, store, SiteClock(), SiteDataFeed(site), default_mapping(site))
    d = asyncio.run(central.app.operator.status())
    json.loads(json.dumps(d, allow_nan=False))
    assert d["cars"] == [] and d["co2"] is None and d["battery"]["soc"] is None and d["battery"]["setpoint_kw"] is None
    assert d["plans"]["count"] == 0 and d["plans"]["last"] == [] and d["events"] == {"counts": {}, "last": []}
    assert d["summary"] == {
        "cars_in": 0, "sockets": 6, "charge_points": 6, "connected": 0, "site_controller_connected": False
    }  # fmt: skip
    assert [p["id"] for p in d["charge_points"]] == sorted({cp for cp, _ in default_mapping(site)})
    assert all(c["status"] is None for p in d["charge_points"] for c in p["connectors"])
    store.close()


def test_a_profiles_limit_is_its_period_covering_now():
    """A stored profile's limit at a time: the period started last, in kW; none before its start, from its end on, or
    in another rate unit."""
    payload = {
        "connectorId": 1,
        "csChargingProfiles": {
            "chargingSchedule": {
                "startSchedule": "2019-05-03T10:00:00Z",
                "duration": 7200,
                "chargingRateUnit": "W",
                "chargingSchedulePeriod": [{"startPeriod": 0, "limit": 1000.0}, {"startPeriod": 3600, "limit": 2500.0}],
            }
        },
    }
    at = pd.Timestamp
    assert profile_limit_kw(payload, at("2019-05-03T09:59:59Z")) is None
    assert profile_limit_kw(payload, at("2019-05-03T10:00:00Z")) == 1.0
    assert profile_limit_kw(payload, at("2019-05-03T10:59:59Z")) == 1.0
    assert profile_limit_kw(payload, at("2019-05-03T04:00:00-07:00")) == 2.5
    assert profile_limit_kw(payload, at("2019-05-03T12:00:00Z")) is None
    payload["csChargingProfiles"]["chargingSchedule"]["chargingRateUnit"] = "A"
    assert profile_limit_kw(payload, at("2019-05-03T10:30:00Z")) is None


def test_meter_and_soc_readings_become_each_steps_energy():
    """A register read at 10:00, 10:30 and 12:00 gives each hour its share of the rise between two readings, nothing
    before the first or after the last; a rise of the battery's energy ``dE`` took ``dE / eta_charge``, a fall gave
    ``-dE * eta_discharge``, spread over the hours between the reports."""
    t = pd.to_datetime(["2019-05-03T10:00Z", "2019-05-03T10:30Z", "2019-05-03T12:00Z"], utc=True)
    meters = pd.DataFrame({"transaction_id": [1, 1, 1], "time": t, "energy_wh": [1000.0, 2000.0, 5000.0]})
    edges = pd.date_range("2019-05-03T09:00Z", periods=5, freq="h")
    np.testing.assert_allclose(metered_kwh(meters, edges), [0.0, 2.0, 2.0, 0.0])
    two = pd.concat([meters, meters.assign(transaction_id=2, energy_wh=meters.energy_wh + 7000.0)])
    np.testing.assert_allclose(metered_kwh(two, edges), [0.0, 4.0, 4.0, 0.0])
    cfg = make_site(days=1, bess={"capacity_kwh": 40.0, "eta_charge": 0.9, "eta_discharge": 0.8}).config
    soc = pd.DataFrame({"time": t[[0, 2]].append(pd.DatetimeIndex(["2019-05-03T13:00Z"])), "soc": [0.5, 0.6, 0.55]})
    charge, discharge = battery_kwh(soc, edges, cfg)  # +4 kWh from 10:00 to 12:00, -2 kWh from 12:00 to 13:00
    np.testing.assert_allclose(charge, [0.0, 2.0 / 0.9, 2.0 / 0.9, 0.0], atol=1e-12)
    np.testing.assert_allclose(discharge, [0.0, 0.0, 0.0, 2.0 * 0.8], atol=1e-12)


def test_the_store_keeps_each_connectors_last_status(tmp_path):
    """The last status per connector, with its error code; a late notification (an older time) is kept out; an
    empty status or a negative connector is refused."""
    store = Store(tmp_path / "s.sqlite", scrypt_n=FAST_HASH)
    at = pd.Timestamp
    store.set_connector_status("CP-1", 1, "Available", at("2019-05-03T10:00Z"), "NoError")
    store.set_connector_status("CP-1", 1, "Charging", at("2019-05-03T10:05Z"), "NoError")
    store.set_connector_status("CP-1", 1, "Preparing", at("2019-05-03T10:01Z"), "NoError")
    store.set_connector_status("CP-1", 0, "Faulted", at("2019-05-03T10:02Z"), "GroundFailure")
    store.set_connector_status("CP-0", 2, "Unavailable", at("2019-05-03T10:03Z"))
    got = [(r["charge_point"], r["connector"], r["status"], r["error_code"]) for r in store.connector_statuses()]
    assert got == [
        ("CP-0", 2, "Unavailable", None),
        ("CP-1", 0, "Faulted", "GroundFailure"),
        ("CP-1", 1, "Charging", "NoError"),
    ]
    assert store.connector_statuses()[2]["time"] == "2019-05-03T10:05:00+00:00"
    with pytest.raises(StoreError, match="empty status"):
        store.set_connector_status("CP-1", 1, "", at("2019-05-03T11:00Z"))
    with pytest.raises(StoreError, match="negative"):
        store.set_connector_status("CP-1", -1, "Available", at("2019-05-03T11:00Z"))
