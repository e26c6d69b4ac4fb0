"""The grid-carbon service behind the MOER feed: the client of WattTime's API v3 (``pipeline.live.watttime``) against
its local stand-in (``pipeline.live.watttime_standin``). Through the service the feed gives the history the site's
files give, frame for frame, and the central system the same CO2; it falls back when the service is down or late,
renews an expired token, refuses wrong credentials in one line and never says a password or a token."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, assert_served, csms_site, csms_store, make_site, write_site
from pandas.testing import assert_frame_equal

from envs.site import load_site
from pipeline.data.sources import load_sources
from pipeline.live import csms, watttime
from pipeline.live.simsite import run_local
from pipeline.live.sources import LateFeed, SiteDataFeed
from pipeline.live.state import FORECAST_COLUMNS, LiveError
from pipeline.live.watttime import (
    KG_PER_KWH_PER_LBS_PER_MWH,
    Refused,
    ServiceCredentials,
    ServiceDown,
    WattTimeClient,
    moer_feed,
    service_credentials,
)
from pipeline.live.watttime_standin import Outage, WattTimeStandIn, following, local_service, service_record

FAST = {"retries": 2, "backoff_s": 0.01, "timeout_s": 5.0}
"""The client's retries in these tests: three tries 10 and 20 ms apart."""
REGION = "SGIP_CAISO_SCE"


def _replay(site, standin, feed, steps: int, at_step=None) -> None:
    """Step ``feed`` through the first ``steps`` steps of the test split, the stand-in's time at each step's start, and
    check each history against the site's files' (``at_step(t)`` runs first at step ``t``)."""
    files = SiteDataFeed(site)
    for t in range(steps):
        now = files.start + t * feed.dt
        standin.set_time(now)
        if at_step is not None:
            at_step(t)
        got, want = feed.history(now), files.history(now)
        assert_frame_equal(got.series, want.series, check_exact=True)
        assert_frame_equal(got.sessions, want.sessions)
        assert got.window_end == want.window_end


# ------------------------------------------------------------------------------------------------ the frames
@pytest.mark.parametrize("dt_h", [1.0, 0.25])
def test_a_replay_through_the_service_gives_the_files_history(dt_h):
    """The synthetic site's test day at hourly and 15-minute steps: at every step the feed of the service (the stand-in
    serving the site's record) gives exactly the history the site's files give (columns, dtypes, every value, the
    sessions, the window's end), asking only for what it lacks: one login, then at most the new points and the new
    forecast a step."""
    site = make_site(days=1, n_sockets=6, dt_h=dt_h)
    steps = site.split("test").num_steps
    with local_service(site, **FAST) as (standin, feed):
        _replay(site, standin, feed, steps)
        assert standin.logins == 1 and feed.late == []
        assert len(standin.calls) <= 2 * steps + 1 and {s for _, s in standin.calls} == {200}
        assert len(feed.issued) == steps  # the forecast of each step, issued at its start


def test_a_replay_of_the_past_against_a_service_at_its_present_asks_for_the_forecasts_issued_then():
    """The stand-in at its record's end (as the real service is for a split of the past): its last forecast is later
    than every step, so the feed asks for the one issued at each step (``/v3/forecast/historical``) and still gives
    the files' history."""
    site = make_site(days=1, n_sockets=6, dt_h=0.25)
    with local_service(site, **FAST) as (standin, feed):
        files = SiteDataFeed(site)
        for t in range(12):
            now = feed.start + t * feed.dt
            assert_frame_equal(feed.history(now).series, files.history(now).series, check_exact=True)
        assert standin.now() > now and feed.late == []
        assert standin.calls.count(("/v3/forecast/historical", 200)) == standin.calls.count(("/v3/forecast", 200)) == 12


def test_a_replay_of_caltech_from_its_raw_record_gives_the_files_history():
    """Caltech's test split, its first 25 hours at 15-minute steps (across a local midnight), the stand-in serving
    WattTime's own record (the raw SGIP file of May 2021, in lbs CO2/MWh): the history through the service is the
    files' to the last bit of every column (the MOER, its hourly forecasts and its 5-minute columns, float32)."""
    site = load_site("caltech")
    if load_sources("caltech").availability()[0] == "absent":
        pytest.skip("caltech's raw files are not here")
    files = ("moer_sce/SGIP_CAISO_SCE_2021-05.csv.gz",)
    with local_service(site, region=REGION, files=files, **FAST) as (standin, feed):
        start = feed.start.isoformat().replace("+00:00", "Z")
        login = _get(standin.url + "/login", _basic("evhub", standin.password))
        doc = _get(f"{standin.url}/v3/historical?region={REGION}&signal_type=co2_moer&start={start}&end={start}",
                   "Bearer " + login["token"])  # fmt: skip
        assert doc["meta"]["units"] == "lbs_co2_per_mwh"
        kg = doc["data"][0]["value"] * KG_PER_KWH_PER_LBS_PER_MWH
        assert kg == pytest.approx(float(standin.moer[standin.times.get_loc(feed.start)]), rel=1e-12)
        assert 100 < doc["data"][0]["value"] < 2000  # lbs/MWh, not kg/kWh
        _replay(site, standin, feed, 100)
        assert len(feed.final) == 99  # the steps whose intervals have all come are laid once


def test_the_moer_is_the_services_and_the_rest_the_files():
    """A service whose record is the site's MOER times 1.5: the feed's MOER and forecasts are 1.5 times the files',
    its PV and sessions the files' own."""
    site = make_site(days=1, n_sockets=6)
    record = service_record(site)
    with local_service(site, record=record * 1.5, **FAST) as (standin, feed):
        now = feed.start + 10 * feed.dt
        standin.set_time(now)
        got, want = feed.history(now).series, SiteDataFeed(site).history(now).series
    for c in ("moer_kg_per_kwh", *FORECAST_COLUMNS):
        a, b = got[c].to_numpy(np.float64), want[c].to_numpy(np.float64)
        assert np.isnan(a).tolist() == np.isnan(b).tolist() and np.isfinite(a).sum() > 0
        np.testing.assert_allclose(a[np.isfinite(a)], 1.5 * b[np.isfinite(b)], rtol=1e-6)
    assert_frame_equal(got[["time", "pv_kw_per_kwp"]], want[["time", "pv_kw_per_kwp"]])


# ------------------------------------------------------------------------------------------------ the central system
def test_the_csms_through_the_service_gives_the_files_co2(tmp_path):
    """The synthetic 2-day site through the central system and its simulated site, once on the site's files and once
    on the service (its time the site's): the same CO2 and unserved energy, the same plans, every car served."""
    site = csms_site()
    steps = site.split("test").num_steps
    ref, central_ref = asyncio.run(run_local(site, csms_store(tmp_path / "files.sqlite")))
    with local_service(site, **FAST) as (standin, feed):
        res, central = asyncio.run(run_local(site, csms_store(tmp_path / "wt.sqlite"), feed=feed,
                                             hooks=following(standin, steps)))  # fmt: skip
    print(f"\ncsms on the service: {res.co2_kg:.6f} kg, on the files {ref.co2_kg:.6f} kg")
    assert res.steps == ref.steps == steps
    assert abs(res.co2_kg - ref.co2_kg) < 1e-9 and abs(res.unserved_kwh - ref.unserved_kwh) < 1e-9
    assert [p["time"] for p in central.store.plans()] == [p["time"] for p in central_ref.store.plans()]
    assert central.store.events("moer_feed_late") == [] and feed.late == []
    assert_served(site, res, central)


@pytest.mark.parametrize("dt_h", [1.0, 0.25])
def test_down_late_and_refused_for_an_hour_each_the_csms_falls_back_and_serves_every_car(tmp_path, caplog, dt_h):
    """The service answers 503 for an hour, is an hour late (its last forecast not updated), refuses connections for
    an hour, and is back in between: at each step of those three hours (one step each at hourly steps, four at 15
    minutes) the central system plans on the last forecast it holds moved on and logs it (``moer_feed_late``), and
    every car is served."""
    site = csms_site(days=1, dt_h=dt_h)
    start = site.config.split_bounds("test")[0]
    hour, dt = pd.Timedelta(hours=1), pd.Timedelta(hours=dt_h)
    first = [start + pd.Timedelta(hours=h) for h in (9, 12, 15)]
    at = [t + k * dt for t in first for k in range(round(1 / dt_h))]
    outages = [Outage(first[0], first[0] + hour, "down"), Outage(first[1], first[1] + hour, "late", hour),
               Outage(first[2], first[2] + hour, "refused")]  # fmt: skip
    steps = site.split("test").num_steps
    with local_service(site, outages=outages, **FAST) as (standin, feed):
        res, central = asyncio.run(run_local(site, csms_store(tmp_path / "csms.sqlite"), feed=feed,
                                             hooks=following(standin, steps)))  # fmt: skip
    logged = central.store.events("moer_feed_late")
    assert [pd.Timestamp(e["time"]) for e in logged] == at == feed.late
    assert all("planning on the one issued at" in e["detail"] for e in logged)
    down_steps = round(1 / dt_h)
    assert standin.calls.count(("/v3/historical", 503)) == down_steps * (FAST["retries"] + 1)  # every try: 503
    assert "Connection refused" in caplog.text  # refused: its port closed
    assert_served(site, res, central)
    assert central.store.events("plan_failed") == []


def test_down_for_more_than_a_step_is_one_clear_error_and_then_it_catches_up():
    """Down two hours: the first hour falls back on the step before, the second is a LiveError naming the service,
    the step and why; back, the feed catches up (the forecasts it missed from the service's past ones) and gives
    the files' history again."""
    site = make_site(days=1, n_sockets=6)
    start = site.config.split_bounds("test")[0]
    down = Outage(start + pd.Timedelta(hours=5), start + pd.Timedelta(hours=7))
    with local_service(site, outages=[down], **FAST) as (standin, feed):
        _replay(site, standin, feed, 5)
        late = LateFeed(SiteDataFeed(site), [down.start])
        standin.set_time(down.start)
        got = feed.history(down.start)
        assert_frame_equal(got.series, late.history(down.start).series, check_exact=True)  # a LateFeed's late step
        standin.set_time(down.start + feed.dt)
        with pytest.raises(LiveError, match="nothing for the step .* nor for the 1 h before it .*503") as err:
            feed.history(down.start + feed.dt)
        assert "\n" not in str(err.value) and standin.url in str(err.value)
        files = SiteDataFeed(site)
        for t in range(7, 24):
            now = start + t * feed.dt
            standin.set_time(now)
            assert_frame_equal(feed.history(now).series, files.history(now).series, check_exact=True)


# ------------------------------------------------------------------------------------------------ credentials
def _get(url: str, authorization: str | None = None) -> dict:
    headers = {"Authorization": authorization} if authorization else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        return json.loads(r.read())


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _when(t: pd.Timestamp) -> str:
    """A time for a query string (ISO 8601, its ``+`` escaped)."""
    return urllib.parse.quote(t.isoformat())


def _status(url: str, authorization: str | None = None) -> int:
    try:
        _get(url, authorization)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def test_a_wrong_password_is_one_clear_error(tmp_path, capsys):
    """``evhub-csms --feed watttime`` with a wrong password in ``--moer-credentials``: it stops at start with one line
    saying the login was refused and where the credentials come from (never the password); without credentials,
    one line naming the variables."""
    site = make_site(days=1, n_sockets=6)
    toml = write_site(site, tmp_path)
    creds = tmp_path / "moer.env"
    creds.write_text("# the service's account\nWATTTIME_USERNAME=evhub\nWATTTIME_PASSWORD=not-the-password\n")
    argv = ["--site", str(toml), "--controller", "mpc", "--db", str(tmp_path / "csms.sqlite"), "--feed", "watttime",
            "--moer-region", REGION, "--moer-credentials", str(creds)]  # fmt: skip
    with WattTimeStandIn(site, "evhub", "the-password") as standin:
        args = csms.Args(site=str(toml), controller="mpc", db=tmp_path / "a.sqlite", feed="watttime",
                         moer_url=standin.url, moer_region=REGION, moer_credentials=creds)  # fmt: skip
        with pytest.raises(LiveError, match=r"login refused \(401\) for user 'evhub': check WATTTIME_USERNAME"):
            csms.build(args)
        assert csms.main([*argv, "--moer-url", standin.url]) == 1
        assert standin.logins == 0 and standin.calls == [("/login", 401)] * 2  # refused, not retried
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: MOER service") and "login refused (401)" in err[0]
    assert "not-the-password" not in err[0]
    with pytest.raises(LiveError, match="has no WATTTIME_USERNAME and no WATTTIME_PASSWORD"):
        service_credentials(None, {})


def test_credentials_come_from_the_environment_or_a_file(tmp_path):
    """The environment's two variables, or a file of the same two lines (comments and blank lines skipped); a bad
    line, a missing key or file is an error naming the file; the password is not in the credentials' repr."""
    env = {"WATTTIME_USERNAME": "site-7", "WATTTIME_PASSWORD": "s3cret"}
    assert service_credentials(None, env) == ServiceCredentials("site-7", "s3cret")
    f = tmp_path / "moer.env"
    f.write_text("\n# ours\nWATTTIME_USERNAME = site-8\nWATTTIME_PASSWORD=p=w\n")
    got = service_credentials(f, env)
    assert got == ServiceCredentials("site-8", "p=w") and "p=w" not in repr(got)
    f.write_text("WATTTIME_USERNAME=site-8\n")
    with pytest.raises(LiveError, match="moer.env has no WATTTIME_PASSWORD"):
        service_credentials(f)
    f.write_text("site-8 password\n")
    with pytest.raises(LiveError, match="line 1: give KEY=VALUE"):
        service_credentials(f)
    with pytest.raises(LiveError, match="no such file"):
        service_credentials(tmp_path / "none.env")


def test_the_feed_options(tmp_path):
    """``--feed files`` is the site's files (and refuses the service's options), ``--feed watttime`` needs a region;
    another feed is refused; a bad address too."""
    site = make_site(days=1, n_sockets=6)
    assert isinstance(moer_feed(site, "files"), SiteDataFeed)
    with pytest.raises(LiveError, match="go with --feed watttime"):
        moer_feed(site, "files", region=REGION)
    with pytest.raises(LiveError, match="--moer-region: give the grid region"):
        moer_feed(site, "watttime")
    with pytest.raises(LiveError, match="neither files nor watttime"):
        moer_feed(site, "wattime")
    with pytest.raises(LiveError, match="is not an http"):
        WattTimeClient("api.watttime.org", ServiceCredentials("a", "b"))


def test_an_expired_token_is_renewed_mid_run():
    """Every token ends halfway through a replay (the service answers 401): the client logs in again once and the
    replay goes on, frame for frame the files'."""
    site = make_site(days=1, n_sockets=6)
    with local_service(site, **FAST) as (standin, feed):
        _replay(site, standin, feed, 24, at_step=lambda t: standin.expire_tokens() if t == 12 else None)
        assert standin.logins == 2 and ("/v3/historical", 401) in standin.calls
        assert feed.client.logins == 2


def test_a_token_near_its_30_minutes_is_renewed_before_it_is_used():
    """A client whose tokens last 0.2 s logs in again before a call once its token is that old (no 401)."""
    site = make_site(days=1, n_sockets=6)
    with WattTimeStandIn(site, "u", "p") as standin:
        client = WattTimeClient(standin.url, ServiceCredentials("u", "p"), token_life_s=0.2, **FAST)
        client.signal_index(REGION)
        client.signal_index(REGION)
        time.sleep(0.3)
        client.signal_index(REGION)
        assert client.logins == standin.logins == 2 and all(s == 200 for _, s in standin.calls)


def test_retries_back_off_exponentially_then_give_up(monkeypatch):
    """503 twice then an answer: three tries, 10 then 20 ms apart; 503 at every try: ServiceDown after three, naming
    the status; a refusal (an unknown region: 400) is not tried again; a closed port is retried, then down."""
    site = make_site(days=1, n_sockets=6)
    waits = []
    monkeypatch.setattr(watttime.time, "sleep", waits.append)
    with WattTimeStandIn(site, "u", "p") as standin:
        client = WattTimeClient(standin.url, ServiceCredentials("u", "p"), **FAST)
        client.login()
        standin.fail_next(2)
        assert 0 <= client.signal_index(REGION)[1] <= 100
        assert waits == [0.01, 0.02] and [s for _, s in standin.calls[-3:]] == [503, 503, 200]
        standin.fail_next(3, 429)
        with pytest.raises(ServiceDown, match=r"429 Too Many Requests at each of 3 tries"):
            client.signal_index(REGION)
        n = len(standin.calls)
        with pytest.raises(Refused, match="400 Bad Request .*region 'CAISO_NORTH'") as err:
            client.signal_index("CAISO_NORTH")
        assert err.value.status == 400 and len(standin.calls) == n + 1
        url = standin.url
    with pytest.raises(ServiceDown, match="refused"):
        WattTimeClient(url, ServiceCredentials("u", "p"), **FAST).login()


def test_secrets_never_reach_the_log_or_the_console(caplog, capsys):
    """A run with everything said (DEBUG on every logger): a login, a wrong password, a 503 retried, a service down
    and a token expired and renewed: no line of the log or the console holds the password or any token given."""
    caplog.set_level(logging.DEBUG)
    site = make_site(days=1, n_sockets=6)
    start = site.config.split_bounds("test")[0]
    down = Outage(start + pd.Timedelta(hours=3), start + pd.Timedelta(hours=4))
    with local_service(site, outages=[down], **FAST) as (standin, feed):
        with pytest.raises(LiveError, match="login refused"):
            WattTimeClient(standin.url, ServiceCredentials("evhub", "wrong-" + standin.password), **FAST).login()
        standin.fail_next(1)
        for t in range(6):
            now = start + t * feed.dt
            standin.set_time(now)
            if t == 5:
                standin.expire_tokens()
            feed.history(now)
        assert feed.late == [down.start] and standin.logins == 2 and len(standin.tokens) == 2
        secrets = [standin.password, *standin.tokens]
    said = caplog.text + "".join(capsys.readouterr())
    assert "logged in as evhub" in said and "503" in said and "falls back" in said
    assert not [s for s in secrets if s in said]


# ------------------------------------------------------------------------------------------------ the stand-in
def test_the_standin_speaks_the_api():
    """Login with Basic auth only (401 otherwise), every endpoint with a live token only (401), its region and signal
    only (400); the historical points realised by its time (inclusive range, at most 32 days); the last forecast
    issued by its time, 36 points 5 minutes apart from ``generated_at``, in lbs/MWh; past forecasts a day at most;
    the signal index a percentile; 404 elsewhere."""
    site = make_site(days=1, n_sockets=6)
    start = site.config.split_bounds("test")[0]
    with WattTimeStandIn(site, "u", "p") as standin:
        url, q = standin.url, f"region={REGION}&signal_type=co2_moer"
        assert _status(url + "/login") == _status(url + "/login", _basic("u", "x")) == 401
        bearer = "Bearer " + _get(url + "/login", _basic("u", "p"))["token"]
        assert _status(f"{url}/v3/forecast?{q}") == _status(f"{url}/v3/forecast?{q}", "Bearer nope") == 401
        assert _status(f"{url}/v3/forecast?region=CAISO_NORTH&signal_type=co2_moer", bearer) == 400
        assert _status(f"{url}/v3/forecast?region={REGION}&signal_type=co2_aoer", bearer) == 400
        assert _status(f"{url}/v3/nothing?{q}", bearer) == 404
        now = start + pd.Timedelta(hours=2)
        standin.set_time(now)
        t0, t1 = _when(start + pd.Timedelta(hours=1)), _when(start + pd.Timedelta(hours=3))
        assert _status(f"{url}/v3/historical?{q}&start=2019-05-02T08:00:00+00:00&end={t1}", bearer) == 400  # '+': ' '
        hist = _get(f"{url}/v3/historical?{q}&start={t0}&end={t1}", bearer)["data"]
        assert [pd.Timestamp(p["point_time"]) for p in hist] == list(
            pd.date_range(start + pd.Timedelta(hours=1), now - pd.Timedelta(minutes=5), freq="5min"))  # fmt: skip
        far = _when(start + pd.Timedelta(days=33))
        assert _status(f"{url}/v3/historical?{q}&start={t0}&end={far}", bearer) == 400
        fc = _get(f"{url}/v3/forecast?{q}&horizon_hours=24", bearer)
        g = pd.Timestamp(fc["meta"]["generated_at"])
        assert g == now and [pd.Timestamp(p["point_time"]) for p in fc["data"]] == list(
            pd.date_range(g, periods=36, freq="5min"))  # fmt: skip
        row = site.series.set_index("time").loc[now]
        kg = np.array([p["value"] for p in fc["data"]]) * KG_PER_KWH_PER_LBS_PER_MWH
        np.testing.assert_allclose(kg.reshape(3, 12).mean(1), [row[c] for c in FORECAST_COLUMNS], rtol=1e-6)
        past = _get(f"{url}/v3/forecast/historical?{q}&start={_when(start)}&end={t1}", bearer)["data"]
        assert [pd.Timestamp(f["generated_at"]) for f in past] == [start + pd.Timedelta(hours=h) for h in range(3)]
        assert _status(f"{url}/v3/forecast/historical?{q}&start={t0}&end={far}", bearer) == 400
        index = _get(f"{url}/v3/signal-index?{q}", bearer)
        assert index["meta"]["units"] == "percentile" and 0 <= index["data"][0]["value"] <= 100


def test_the_standin_command_serves_a_site_by_hand(tmp_path):
    """``python -m pipeline.live.watttime_standin --site <toml> --port N`` with the credentials in the environment:
    says where it serves (not the password) and answers a client."""
    site = make_site(days=1, n_sockets=6)
    toml = write_site(site, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WATTTIME_USERNAME": "by-hand", "WATTTIME_PASSWORD": "hand-pw", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.live.watttime_standin", "--site", str(toml), "--port",
                             str(port)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert f"at http://127.0.0.1:{port} (user by-hand)" in line and "hand-pw" not in line
        client = WattTimeClient(f"http://127.0.0.1:{port}", ServiceCredentials("by-hand", "hand-pw"), **FAST)
        assert client.forecast(REGION).generated_at == site.series.time.iloc[-1]  # its time: the record's end
    finally:
        proc.terminate()
        proc.wait(10)
