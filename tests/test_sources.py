"""A third site built from nothing but a TOML and small raw files (``pipeline.data.sources`` /
``pipeline.data.ingest``).

The "garage" site lies in Europe/Berlin (DST): its sessions are two CSV files with their own column names (one
with naive local times, the TOML giving the zone; one with UTC offsets), its carbon a WattTime-style MOER of
another region with forecast columns (two overlapping files), its weather a synthetic EPW whose header says
UTC+1 (the sessions are at UTC+2 before the DST change of 2023-10-29). It is ingested, loaded and run through
the baselines and the oracle. Then: timestamps across DST, PV at solar noon, and each kind of bad raw input,
which must stop ingestion with the file, the column and the row named and nothing written.

Through doit (ingest -> validate -> baselines; a bad source stopping doit at ``ingest``) and the byte-for-byte
regeneration of the shipped sites: ``test_ingest_slow.py`` (marked slow).
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.kpis import balance_residual, evaluate_policy
from envs.site import load_site
from pipeline.control.baselines import POLICIES
from pipeline.control.oracle import solve_oracle
from pipeline.data.ingest import ingest, status, task_plan
from pipeline.data.sources import SourceError, load_sources, parse_times, period

TZ = "Europe/Berlin"
LON, LAT = 13.4, 52.5
FIRST, LAST = "2023-10-23", "2023-11-06"  # train 10-23..10-31 (DST ends 10-29), test 11-01..11-06
COLS = {
    "station": "Charge point",
    "id": "Transaction",
    "arrival": "Plugged in",
    "departure": "Unplugged",
    "energy": "Energy [kWh]",
    "requested": "Requested [kWh]",
}

TOML = f"""
name = "garage"
timezone = "{TZ}"
dt_h = 1.0
data_dir = "garage"

[pv]
kwp = 30.0
tilt_deg = 30.0
azimuth_deg = 180.0

[bess]
capacity_kwh = 40.0
power_kw = 20.0

[ev]
[[ev.sockets]]
count = 4
kw = 11.0
stations = "AC-*"

[[ev.sockets]]
count = 1
kw = 50.0
stations = "DC-*"

[grid]
import_limit_kw = 200.0

[splits]
train = ["2023-10-23", "2023-10-31"]
test = ["2023-11-01", "2023-11-06"]

[episode]
train_h = 48

[sources]
root = "raw"
attribution = "Synthetic raw files written by the test."

[sources.sessions]
format = "csv"
files = ["sessions/october.csv", "sessions/november.csv"]
timezone = "{TZ}"                  # october.csv has naive local times; november.csv carries offsets
[sources.sessions.columns]
arrival = "{COLS["arrival"]}"
departure = "{COLS["departure"]}"
energy_kwh = "{COLS["energy"]}"
station_id = "{COLS["station"]}"
session_id = "{COLS["id"]}"
requested_energy_kwh = "{COLS["requested"]}"

[sources.carbon]
format = "watttime-moer"
files = "moer_de/*.csv"
unit = "kg/kWh"

[sources.weather]
format = "epw"
file = "weather/berlin.epw"
"""


# ---------------------------------------------------------------------------------------- raw files


def write_epw(path: Path, lat: float, lon: float, tz_hours: float, altitude: float = 34.0, drop: int = 0) -> None:
    """A synthetic EPW (pvlib ``read_epw`` layout: 8 header lines, 35 columns, hour-ending local standard time):
    clear-sky irradiance (pvlib's simplified Solis) at the middle of each hour; ``drop`` last records left out."""
    import pvlib

    tz = dt.timezone(dt.timedelta(hours=tz_hours))
    start = pd.date_range("2005-01-01", periods=8760, freq="h")  # hour starts, local standard time
    mid = (start + pd.Timedelta(minutes=30)).tz_localize(tz)
    cs = pvlib.location.Location(lat, lon, altitude=altitude).get_clearsky(mid, model="simplified_solis")
    hour = start.hour + 1
    n = 8760 - drop
    ghi, dni, dhi = (np.round(cs[k].to_numpy()[:n]).astype(int).astype(str) for k in ("ghi", "dni", "dhi"))
    flags = "?9?9?9?9E0?9?9?9?9?9?9?9?9?9?9?9?9?9?9*9*9?9?9?9"
    rows = [
        f"2005,{m},{d},{hr},60,{flags},12.0,5.0,60,101325,0,0,300,{g},{n_},{f},0,0,0,0,180,2.0,5,5,9999,99999,9,"
        "999999999,10,0.1,0,88,0.2,0,0"
        for m, d, hr, g, n_, f in zip(start.month[:n], start.day[:n], hour[:n], ghi, dni, dhi)
    ]
    header = [
        f"LOCATION,Test City,BE,DEU,SYNTH,999999,{lat},{lon},{tz_hours},{altitude}",
        "DESIGN CONDITIONS,0",
        "TYPICAL/EXTREME PERIODS,0",
        "GROUND TEMPERATURES,0",
        "HOLIDAYS/DAYLIGHT SAVINGS,No,0,0,0",
        "COMMENTS 1,synthetic clear-sky year",
        "COMMENTS 2,written by the tests",
        "DATA PERIODS,1,1,Data,Sunday, 1/ 1,12/31",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header + rows) + "\n")


def moer_frame(first_utc: str, last_utc: str) -> pd.DataFrame:
    """5-minute WattTime-style MOER (kg/kWh) with forecasts f1..f36 (the true values ahead, slightly off)."""
    t = pd.date_range(first_utc, last_utc, freq="5min", tz="UTC", inclusive="left")
    hours = (t - t[0]).total_seconds().to_numpy() / 3600.0
    moer = 0.35 + 0.15 * np.sin(2 * np.pi * hours / 24.0)
    d = {"time": t.strftime("%Y-%m-%d %H:%M:%S+00:00"), "moer": np.round(moer, 6)}
    for i in range(1, 37):
        d[f"f{i}"] = np.round(np.roll(moer, -i) * 1.01, 6)
    return pd.DataFrame(d)


def session_rows(days: pd.DatetimeIndex, offsets: bool) -> pd.DataFrame:
    """Four AC stations at 08:00 + k h local for 6 h (10 kWh) and a DC one at 12:20 for 1 h (30 kWh), every day;
    ``offsets``: the times carry their UTC offset, else naive local wall-clock times."""
    rows = []
    for day in days:
        for k in range(4):
            rows.append((f"AC-{k + 1}", day + pd.Timedelta(hours=8 + k), pd.Timedelta(hours=6), 10.0 + k))
        rows.append(("DC-1", day + pd.Timedelta(hours=12, minutes=20), pd.Timedelta(hours=1), 30.0))
    out = []
    for i, (st, arr, dwell, kwh) in enumerate(rows):
        a = arr.tz_localize(TZ)
        dep = (a.tz_convert("UTC") + dwell).tz_convert(TZ)
        fmt = (lambda x: x.isoformat(sep=" ")) if offsets else (lambda x: x.strftime("%Y-%m-%d %H:%M:%S"))
        out.append(
            {
                COLS["station"]: st,
                COLS["id"]: f"{'N' if offsets else 'O'}{i:04d}",
                COLS["arrival"]: fmt(a),
                COLS["departure"]: fmt(dep),
                COLS["energy"]: kwh,
                COLS["requested"]: kwh + 5.0,
            }
        )
    return pd.DataFrame(out)


def write_garage(folder: Path, template: Path) -> Path:
    """Write the garage site into ``folder``: its TOML and a copy of the raw files of ``template`` (made once by
    the ``template`` fixture); returns the TOML path."""
    shutil.copytree(template / "raw", folder / "raw")
    toml = folder / "garage.toml"
    toml.write_text(TOML)
    return toml


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A folder holding the garage site's raw files (``raw/``), written once per module."""
    folder = tmp_path_factory.mktemp("garage_raw")
    _make_raw(folder / "raw")
    return folder


def _make_raw(raw: Path) -> None:
    (raw / "sessions").mkdir(parents=True)
    october = pd.date_range("2023-10-23", "2023-10-31", freq="D")
    november = pd.date_range("2023-11-01", "2023-11-06", freq="D")
    session_rows(october, offsets=False).to_csv(raw / "sessions" / "october.csv", index=False)
    session_rows(november, offsets=True).to_csv(raw / "sessions" / "november.csv", index=False)
    (raw / "moer_de").mkdir()
    m = moer_frame("2023-10-21", "2023-11-09")
    cut = len(m) // 2
    m.iloc[: cut + 288].to_csv(raw / "moer_de" / "DE_part1.csv", index=False)  # the two files overlap by a day
    m.iloc[cut:].to_csv(raw / "moer_de" / "DE_part2.csv", index=False)
    write_epw(raw / "weather" / "berlin.epw", LAT, LON, 1.0)


@pytest.fixture(scope="module")
def garage(tmp_path_factory, template) -> Path:
    """The garage site, ingested once (its TOML path)."""
    toml = write_garage(tmp_path_factory.mktemp("garage"), template)
    summary = ingest(toml)
    assert not summary["skipped"] and len(summary["written"]) == 4  # series at 60 and 5 min, sessions, README
    return toml


# ------------------------------------------------------------------------------------ the third site


def test_garage_ingests_validates_and_runs_baselines_and_oracle(garage):
    site = load_site(garage)  # pandera schemas over both tables
    h, s = site.series, site.sessions
    assert period(site.config) == (FIRST, "2023-11-07")
    assert h.time.iloc[0] == pd.Timestamp(FIRST, tz=TZ) and len(h) == 15 * 24 + 1  # 25 h on 2023-10-29
    assert len(s) == 15 * 5 and s.session_id.is_unique
    assert set(s.station_id) == {"AC-1", "AC-2", "AC-3", "AC-4", "DC-1"}
    assert (s.requested_energy_kwh == s.energy_kwh + 5).all()
    # MOER: hourly mean of the 5-minute values; forecasts from the row at the hour start (files overlap)
    m = moer_frame("2023-10-21", "2023-11-09")
    m["time"] = pd.to_datetime(m.time, utc=True)
    hour_mean = m.groupby(m.time.dt.floor("h")).moer.mean()
    np.testing.assert_allclose(h.moer_kg_per_kwh, hour_mean.reindex(pd.DatetimeIndex(h.time)).to_numpy(), rtol=1e-6)
    row = m.set_index("time").loc[pd.DatetimeIndex(h.time)]
    np.testing.assert_allclose(h.moer_fc_h1, row[[f"f{i}" for i in range(13, 25)]].mean(axis=1), rtol=1e-6)
    # the 5-minute columns: f1..f12 of that row, and the last realised rows strictly before the hour start
    np.testing.assert_allclose(h.moer_fc_5min_07, row["f7"], rtol=1e-6)
    by_time = m.set_index("time").moer
    five = pd.Timedelta(minutes=5)
    t = pd.DatetimeIndex(h.time)
    np.testing.assert_allclose(h.moer_last_5min, by_time.loc[t - five], rtol=1e-6)
    last3 = by_time.loc[t - five].to_numpy() + by_time.loc[t - 2 * five].to_numpy() + by_time.loc[t - 3 * five]
    np.testing.assert_allclose(h.moer_last_15min, last3 / 3, rtol=1e-6)
    assert site.split("train").moer_5min.shape == (site.split("train").num_steps, 14)
    readme = (garage.parent / "garage" / "README.md").read_text()
    for needle in ("`sessions/october.csv`", "`moer_de/DE_part1.csv`", "`weather/berlin.epw`", "UTC+1", "Charge point"):
        assert needle in readme, needle

    kpis = {}
    for split in ("train", "test"):
        data = site.split(split)
        assert not data.sessions.rejected.any()
        assert sorted(set(data.socket_kw)) == [11.0, 50.0]
        for name in ("uncontrolled", "rule_based"):
            k, traces = evaluate_policy(POLICIES[name], site, split, name, train_wall_s=0.0)
            assert balance_residual(traces).max() <= 1e-6
            kpis[name, split] = k.iloc[0]
        oracle, _ = solve_oracle(site, split)
        kpis["oracle", split] = oracle.iloc[0]
        assert oracle.co2_kg.iloc[0] <= kpis["rule_based", split].co2_kg + 1e-6
        assert kpis["rule_based", split].co2_kg < kpis["uncontrolled", split].co2_kg
        assert kpis["uncontrolled", split].ev_energy_served_pct > 99.0


def test_sessions_land_in_their_local_hour_across_the_dst_change(garage):
    site = load_site(garage)
    for split in ("train", "test"):
        data = site.split(split)
        local = data.time.tz_convert(TZ)
        arrival = local[data.sessions.arrival_step.to_numpy()]
        ac1 = (data.sessions.station_id == "AC-1").to_numpy()
        dc = (data.sessions.station_id == "DC-1").to_numpy()
        assert (arrival[ac1].hour == 8).all() and (arrival[ac1].minute == 0).all()  # naive 08:00 and offsets 08:00+01
        # 12:20 local goes to the step of 12:00 (the nearest step start, as the env discretises), before and
        # after the change of offset
        assert set(arrival[dc].hour) == {12}
        assert len(set(arrival[ac1].date)) == len(arrival[ac1])  # one a day, also on the 25-hour day
    sessions = site.sessions
    first = sessions[sessions.session_id == "O0000"].arrival.iloc[0]
    assert first == pd.Timestamp("2023-10-23 08:00", tz=TZ)  # CEST: 06:00 UTC
    after = sessions[sessions.arrival.dt.tz_convert(TZ).dt.date == dt.date(2023, 10, 30)]
    assert (after[after.station_id == "AC-1"].arrival.dt.hour == 7).all()  # CET: 07:00 UTC


def test_parse_times_reads_dst_edges_and_offsets():
    kw = dict(file="f.csv", column_name="t", key="sources.sessions", toml=Path("site.toml"), fmt=None)
    naive = pd.Series(["2023-10-29 02:30:00", "2023-03-26 02:30:00", "2023-10-29 03:30:00", "2023-07-01 12:00:00"])
    got = parse_times(naive, tz=TZ, **kw)
    assert list(got) == [
        pd.Timestamp("2023-10-29 00:30", tz="UTC"),  # repeated local time: first occurrence (CEST)
        pd.Timestamp("2023-03-26 01:00", tz="UTC"),  # 02:30 does not exist: moved to 03:00 CEST
        pd.Timestamp("2023-10-29 02:30", tz="UTC"),  # CET after the change
        pd.Timestamp("2023-07-01 10:00", tz="UTC"),
    ]
    aware = pd.Series(["2023-10-29 02:30:00+01:00", "2023-10-29T02:30:00+02:00", "2023-10-29 01:30:00Z"])
    assert list(parse_times(aware, tz=None, **kw)) == [
        pd.Timestamp("2023-10-29 01:30", tz="UTC"),
        pd.Timestamp("2023-10-29 00:30", tz="UTC"),
        pd.Timestamp("2023-10-29 01:30", tz="UTC"),
    ]
    rfc = pd.Series(["Wed, 25 Apr 2018 11:08:04 GMT"])
    assert parse_times(rfc, tz=None, **{**kw, "fmt": "%a, %d %b %Y %H:%M:%S %Z"}).iloc[0] == pd.Timestamp(
        "2018-04-25 11:08:04", tz="UTC"
    )
    with pytest.raises(
        SourceError, match=r"f\.csv: column 't' row 1 \(line 3\): timestamp '2023-10-29 02:30' has no UTC"
    ):
        parse_times(pd.Series(["2023-10-29 02:30+01:00", "2023-10-29 02:30"]), tz=TZ, **kw)


def test_pv_of_an_epw_in_another_utc_offset_peaks_at_local_solar_noon(garage):
    """The EPW says UTC+1; the site's clock is UTC+2 until 10-29. PV must follow the sun, not either clock:
    the PV-weighted mean time of each day lies within 10 minutes of solar noon computed from the longitude."""
    import pvlib

    h = load_site(garage).series.set_index("time")["pv_kw_per_kwp"].astype(np.float64)
    mid = h.index + pd.Timedelta(minutes=30)
    utc_h = (mid.hour + mid.minute / 60.0).to_numpy()
    for day, pv in h.groupby(h.index.date):
        if pv.sum() == 0:
            continue
        t = utc_h[h.index.date == day]
        centroid = float((pv.to_numpy() * t).sum() / pv.sum())
        eot_min = float(pvlib.solarposition.equation_of_time_spencer71(pd.Timestamp(day).day_of_year))
        solar_noon = 12.0 - LON / 15.0 - eot_min / 60.0
        assert abs(centroid - solar_noon) < 10 / 60, (day, centroid, solar_noon)
    days = h.index.tz_convert(TZ).date
    local_peak = h[h > 0].groupby(days[h.to_numpy() > 0]).idxmax().map(lambda t: t.tz_convert(TZ).hour)
    assert set(local_peak[local_peak.index < dt.date(2023, 10, 29)]) <= {11, 12}  # noon ~12:04 CEST
    assert set(local_peak[local_peak.index > dt.date(2023, 10, 29)]) <= {10, 11}  # noon ~11:04 CET


def test_clear_sky_site_needs_its_location_and_a_shipped_site_without_raw_files_is_used_as_is(tmp_path, capsys):
    from envs.config import SITES_DIR, config_from_dict

    iq = load_sources("iquitos")
    raw = {**_raw_toml(SITES_DIR / "iquitos.toml")}
    raw["pv"] = {k: v for k, v in raw["pv"].items() if k != "latitude"}
    with pytest.raises(SourceError, match=r"key 'pv\.latitude' is missing: the clear-sky weather source needs"):
        from pipeline.data.sources import parse_sources

        parse_sources(config_from_dict(raw, "iq.toml"), "iq.toml")
    assert iq.availability()[0] == "none" and task_plan("iquitos")["state"] == "ready"
    # a copy of the caltech TOML whose raw folder is absent, its data_dir the shipped data: nothing to ingest
    text = (SITES_DIR / "caltech.toml").read_text()
    text = text.replace('root = "../../../shared/data"', 'root = "no_such_folder"')
    text = text.replace('data_dir = "caltech"', f'data_dir = "{(SITES_DIR / "caltech").as_posix()}"')
    toml = tmp_path / "caltech_clone.toml"
    toml.write_text(text)
    assert status(toml)[0] == "shipped" and task_plan(toml)["state"] == "shipped"
    assert ingest(toml)["skipped"]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "raw sources of" in out[0] and "are used as they are" in out[0]
    with pytest.raises(FileNotFoundError, match="raw sources not found"):
        ingest(toml, tmp_path / "elsewhere")


def _swap_table(toml: Path, table: str, body: str) -> None:
    """Replace the ``[table]`` of the garage TOML (up to the next table) by ``body``."""
    text = toml.read_text()
    start = text.index(f"[{table}]")
    nxt = text.find("\n[", start + 1)
    toml.write_text(text[:start] + body.strip() + "\n" + (text[nxt:] if nxt >= 0 else ""))


def test_acn_json_sessions_read_like_the_csv_ones(tmp_path, template, garage):
    """ACN-Data API items (RFC 1123 GMT times, ``kWhRequested`` from the last ``userInputs``, none for some)."""
    import json

    from pipeline.data.readers import read_sessions

    expected = load_site(garage).sessions
    items = []
    for i, r in expected.iterrows():
        ui = None if i % 3 == 0 else [{"kWhRequested": 1.0}, {"kWhRequested": float(r.requested_energy_kwh)}]
        items.append(
            {
                "sessionID": r.session_id,
                "stationID": r.station_id,
                "kWhDelivered": float(r.energy_kwh),
                "connectionTime": r.arrival.strftime("%a, %d %b %Y %H:%M:%S GMT"),
                "disconnectTime": r.departure.strftime("%a, %d %b %Y %H:%M:%S GMT"),
                "userInputs": ui,
            }
        )
    toml = write_garage(tmp_path, template)
    (tmp_path / "raw" / "sessions" / "acn.json").write_text(json.dumps({"_meta": {}, "_items": items[::-1]}))
    _swap_table(toml, "sources.sessions.columns", "")
    _swap_table(toml, "sources.sessions", '[sources.sessions]\nformat = "acn-json"\nfiles = "sessions/acn.json"')
    got, info = read_sessions(load_sources(toml))
    pd.testing.assert_frame_equal(
        got.drop(columns="requested_energy_kwh"), expected.drop(columns="requested_energy_kwh")
    )
    no_input = (np.arange(len(expected)) % 3 == 0)[::-1]  # items were written in reverse
    by_id = got.set_index("session_id")
    ids = [it["sessionID"] for it in items[::-1]]
    assert (by_id.loc[np.array(ids)[no_input]].eval("requested_energy_kwh == energy_kwh")).all()
    assert info["report"][0]["requested_filled"] == int(no_input.sum())


def test_hourly_carbon_csv_in_g_per_kwh_gets_persistence_forecasts_and_measured_pv(tmp_path, template):
    from pipeline.data.pv import read_pv
    from pipeline.data.readers import read_carbon
    from pipeline.data.sources import period_index

    toml = write_garage(tmp_path, template)
    hours = pd.date_range("2023-10-22 20:00", "2023-11-07 00:00", freq="h", tz="UTC", inclusive="left")
    g = 300.0 + 100.0 * np.cos(np.arange(len(hours)) / 24 * 2 * np.pi)
    pd.DataFrame({"Datetime (UTC)": hours.strftime("%Y-%m-%d %H:%M:%S"), "Carbon intensity gCO2eq/kWh": g}).to_csv(
        tmp_path / "raw" / "carbon.csv", index=False
    )
    pv = np.clip(np.sin((hours.hour - 5) / 12 * np.pi), 0, None) * 0.7
    pd.DataFrame({"ts": hours.tz_convert(TZ).strftime("%Y-%m-%dT%H:%M:%S%z"), "kw_per_kwp": pv}).to_csv(
        tmp_path / "raw" / "pv.csv", index=False
    )
    _swap_table(
        toml,
        "sources.carbon",
        """[sources.carbon]
format = "csv"
files = "carbon.csv"
time_column = "Datetime (UTC)"
value_column = "Carbon intensity gCO2eq/kWh"
unit = "g/kWh"
timezone = "UTC"
""",
    )
    _swap_table(
        toml,
        "sources.weather",
        """[sources.weather]
format = "pv-csv"
files = "pv.csv"
time_column = "ts"
value_column = "kw_per_kwp"
""",
    )
    src = load_sources(toml)
    index = period_index(src.config)
    c, info = read_carbon(src, index)
    truth = pd.Series(g / 1000.0, index=hours)
    np.testing.assert_allclose(c.moer_kg_per_kwh, truth.reindex(index), rtol=1e-12)
    prev = truth.shift(1).reindex(index)  # the file starts 2 h before the period: the first hour has a past too
    for h in range(3):
        np.testing.assert_allclose(c[f"moer_fc_h{h}"], prev, rtol=1e-12)
    assert info["forecast"] == "persistence" and not info["first_hour_own_value"]
    assert "moer_last_5min" not in c.columns  # 5-minute columns only from 5-minute files with forecasts
    got, pinfo = read_pv(src, index)
    np.testing.assert_allclose(got, pd.Series(pv, index=hours).reindex(index).to_numpy(), rtol=1e-12)
    assert pinfo["format"] == "pv-csv"


def test_pv_keys_and_fleet_tables_are_checked_naming_the_key():
    from envs.config import SITES_DIR, ConfigError, config_from_dict
    from pipeline.data.sources import parse_sources

    raw = _raw_toml(SITES_DIR / "iquitos.toml")
    for key, value, match in (
        ("tilt_deg", 95.0, r"key 'pv\.tilt_deg' must be in \[0, 90\] degrees, got 95\.0"),
        ("latitude", "north", r"key 'pv\.latitude' must be a number, got 'north'"),
        ("temperature_model", "glass", r"key 'pv\.temperature_model' must be one of"),
    ):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**raw, "pv": {**raw["pv"], key: value}}, "iq.toml")
    fleet = [dict(raw["sources"]["sessions"]["fleet"][0]), dict(raw["sources"]["sessions"]["fleet"][1])]
    del fleet[1]["battery_kwh"]
    bad = {**raw, "sources": {**raw["sources"], "sessions": {**raw["sources"]["sessions"], "fleet": fleet}}}
    with pytest.raises(SourceError, match=r"iq\.toml: key 'sources\.sessions\.fleet\[1\]\.battery_kwh' is missing"):
        parse_sources(config_from_dict(bad, "iq.toml"), "iq.toml")
    fleet[1]["battery_kwh"], fleet[1]["dwel_h"] = 7.2, [1, 8]
    with pytest.raises(
        SourceError,
        match=r"unknown key 'sources\.sessions\.fleet\[1\]\.dwel_h': did you mean "
        r"'sources\.sessions\.fleet\[1\]\.dwell_h'",
    ):
        parse_sources(config_from_dict(bad, "iq.toml"), "iq.toml")


def _raw_toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


# ------------------------------------------------------------------------------------------ bad input


def _csv(folder: Path, rel: str, edit) -> None:
    p = folder / "raw" / rel
    edit(pd.read_csv(p, dtype=str)).to_csv(p, index=False)


def _toml(folder: Path, old: str, new: str) -> None:
    p = folder / "garage.toml"
    text = p.read_text()
    assert old in text, old
    p.write_text(text.replace(old, new))


def _set(col: str, row: int, value: str):
    def edit(d: pd.DataFrame) -> pd.DataFrame:
        d.loc[row, col] = value
        return d

    return edit


def _epw_short(folder: Path) -> None:
    p = folder / "raw" / "weather" / "berlin.epw"
    lines = p.read_text().splitlines()
    p.write_text("\n".join(lines[:-24]) + "\n")  # the last day of the year left out: 8,736 records


def _moer_gap(folder: Path) -> None:
    for name in ("DE_part1.csv", "DE_part2.csv"):
        p = folder / "raw" / "moer_de" / name
        d = pd.read_csv(p, dtype=str)
        t = pd.to_datetime(d.time, utc=True)
        d[(t < pd.Timestamp("2023-11-02 10:00", tz="UTC")) | (t >= pd.Timestamp("2023-11-02 13:00", tz="UTC"))].to_csv(
            p, index=False
        )


def _shift_year(col: str):
    def edit(d: pd.DataFrame) -> pd.DataFrame:
        d[col] = d[col].str.replace("2023-", "2024-", regex=False)
        return d

    return edit


BAD = {
    "misnamed-column": (
        lambda f: _csv(f, "sessions/october.csv", lambda d: d.rename(columns={COLS["energy"]: "Energy (kWh)"})),
        [
            "october.csv",
            "column 'Energy [kWh]' is missing",
            "did you mean 'Energy (kWh)'?",
            "sources.sessions.columns.energy_kwh",
        ],
    ),
    "no-time-zone": (
        lambda f: _toml(f, f'timezone = "{TZ}"                  #', "#"),
        ["october.csv", f"column '{COLS['arrival']}' row 0 (line 2)", "has no UTC offset", "sources.sessions.timezone"],
    ),
    "unparsable-timestamp": (
        lambda f: _csv(f, "sessions/october.csv", _set(COLS["departure"], 7, "2023-10-24 25:61")),
        ["october.csv", f"column '{COLS['departure']}' row 7 (line 9)", "cannot parse timestamp '2023-10-24 25:61'"],
    ),
    "carbon-g-per-kwh-declared-kg": (
        lambda f: _csv(f, "moer_de/DE_part1.csv", lambda d: d.assign(moer=(d.moer.astype(float) * 1000).astype(str))),
        ["DE_part1.csv", "column 'moer' row 0 (line 2)", "looks like g/kWh", "above 2 kg CO2/kWh"],
    ),
    "carbon-does-not-cover-the-splits": (
        _moer_gap,
        [
            "DE_part1.csv",
            "does not cover the site's period",
            "2023-11-02 10:00:00+00:00",
            "11:00 CET",
            "in split 'test'",
            "first of 3 missing hour(s)",
        ],
    ),
    "epw-of-the-wrong-length": (
        _epw_short,
        ["berlin.epw", "expected 8,760 distinct hourly records", "got 8,736"],
    ),
    "a-file-outside-the-period-leaves-a-split-uncovered": (  # the file is skipped; then no file covers the test split
        lambda f: [_csv(f, "sessions/november.csv", _shift_year(c)) for c in (COLS["arrival"], COLS["departure"])],
        [
            "garage.toml",
            "key 'splits.test' (2023-11-01..2023-11-06, Europe/Berlin) selects none of the 45 sessions",
            "no file of [sources.sessions] (files = ['sessions/october.csv', 'sessions/november.csv']) covers split "
            "'test'",
            "The files cover (arrivals, local dates): sessions/october.csv 2023-10-23..2023-10-31 (45 sessions), "
            "sessions/november.csv 2024-11-01..2024-11-06 (30 sessions, skipped: outside the period)",
            "Point key 'sources.sessions.files' at files with sessions from 2023-11-01 to 2023-11-06",
        ],
    ),
    "a-split-without-sessions": (
        lambda f: _toml(
            f, 'files = ["sessions/october.csv", "sessions/november.csv"]', 'files = ["sessions/october.csv"]'
        ),
        [
            "garage.toml",
            "key 'splits.test' (2023-11-01..2023-11-06, Europe/Berlin) selects none of the 45 sessions",
            "no file of [sources.sessions] (files = 'sessions/october.csv') covers split 'test'",
            "The files cover (arrivals, local dates): sessions/october.csv 2023-10-23..2023-10-31 (45 sessions).",
        ],
    ),
    "sessions-between-the-splits": (  # the test split moved past the November sessions, which now lie in no split
        lambda f: _toml(f, 'test = ["2023-11-01", "2023-11-06"]', 'test = ["2023-11-07", "2023-11-08"]'),
        [
            "garage.toml",
            "key 'splits.test' (2023-11-07..2023-11-08, Europe/Berlin) selects none of the 75 sessions",
            "november.csv: 30 session(s) outside every split, first row 0 (line 2) arriving 2023-11-01 07:00:00+00:00",
        ],
    ),
    "missing-energy-column-in-the-toml": (
        lambda f: _toml(f, f'energy_kwh = "{COLS["energy"]}"\n', ""),
        ["garage.toml", "key 'sources.sessions.columns.energy_kwh' is missing"],
    ),
    "unknown-sources-key": (
        lambda f: _toml(f, 'unit = "kg/kWh"', 'units = "kg/kWh"'),
        ["garage.toml", "unknown key 'sources.carbon.units'", "did you mean 'sources.carbon.unit'?"],
    ),
    "a-pattern-matching-no-file": (
        lambda f: shutil.rmtree(f / "raw" / "moer_de"),
        ["garage.toml", "key 'sources.carbon.files'", "no file matches 'moer_de/*.csv'"],
    ),
}


@pytest.mark.parametrize("kind", list(BAD), ids=list(BAD))
def test_bad_raw_input_stops_ingestion_naming_file_column_row_and_writes_nothing(tmp_path, template, kind):
    toml = write_garage(tmp_path, template)
    breaker, needles = BAD[kind]
    breaker(tmp_path)
    with pytest.raises((SourceError, FileNotFoundError)) as info:
        ingest(toml)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()  # nothing written, not even a folder


def test_message_names_relative_rows_as_data_rows_and_lines():
    with pytest.raises(SourceError, match=re.escape("f.csv: column 'e' row 2 (line 4): 'x' is not a number")):
        from pipeline.data.sources import numbers

        numbers(pd.Series(["1", "2", "x"]), file="f.csv", column_name="e")
