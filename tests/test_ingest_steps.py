"""Ingestion at the site's step (``pipeline.data.ingest --dt-h``): the series at 15 minutes, the hour and 5 minutes.

The site is the "garage" of ``test_sources.py`` (5-minute MOER with forecasts, an hourly EPW year). At 15 minutes the
hour means of the series equal the hourly series (PV split within the hour by clear-sky GHI, MOER averaged from the
same raw rows), the forecasts at a step start are the raw row at that time, and the hourly series is exactly the one
of an hourly ingestion. A step finer than a source gives (2 minutes of a 5-minute MOER, 15 minutes of an hourly carbon
CSV) is refused naming the TOML, the key ``dt_h``, the source and its resolution, on the command line too. The shipped
data are checked the same way; what needs the raw files skips without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_sources import TZ, _swap_table, moer_frame, template, write_garage  # noqa: F401  (template: a fixture)

from envs.config import SITES_DIR
from envs.schemas import PHYSICS_COLUMNS, SERIES_COLUMNS
from envs.site import load_site
from pipeline.data.ingest import ingest, series_steps
from pipeline.data.pv import PVModel, clear_sky_pv_kw_per_kwp, pv_at, split_hours
from pipeline.data.readers import read_carbon
from pipeline.data.sources import SourceError, load_sources, period, step_index

ROOT = Path(__file__).resolve().parent.parent
PV_TOL = 1e-6
"""kW/kWp: the hour mean of a finer PV series against the hourly one (float32 rounding)."""
MOER_TOL = 1e-6
"""kg/kWh: the hour mean of a finer MOER series against the hourly one (both from the same raw rows)."""


def hour_means(series: pd.DataFrame, column: str, minutes: int) -> np.ndarray:
    """The mean of each hour's steps of ``column`` (the series starts on an hour: local midnight)."""
    return series[column].to_numpy(np.float64).reshape(-1, 60 // minutes).mean(axis=1)


@pytest.fixture(scope="module")
def garage15(tmp_path_factory, template) -> Path:
    """The garage ingested at 15-minute steps (its data folder)."""
    toml = write_garage(tmp_path_factory.mktemp("garage15"), template)
    summary = ingest(toml, dt_h=0.25)
    assert [p.name for p in summary["written"]] == [
        "series_15min.parquet",
        "series_60min.parquet",
        "series_5min.parquet",
        "sessions.parquet",
        "README.md",
    ]
    return toml.parent / "garage"


def test_series_steps_are_the_site_step_the_hour_and_five_minutes():
    assert series_steps(0.25) == (15, 60, 5)
    assert series_steps(1.0) == (60, 5)
    assert series_steps(5 / 60) == (5, 60)


def test_fifteen_minute_hour_means_equal_the_hourly_series(garage15):
    hourly = pd.read_parquet(garage15 / "series_60min.parquet")
    for minutes in (15, 5):
        fine = pd.read_parquet(garage15 / f"series_{minutes}min.parquet")
        assert len(fine) == len(hourly) * 60 // minutes
        assert (fine.time.iloc[:: 60 // minutes].to_numpy() == hourly.time.to_numpy()).all()
        np.testing.assert_allclose(
            hour_means(fine, "pv_kw_per_kwp", minutes), hourly.pv_kw_per_kwp, rtol=0, atol=PV_TOL
        )
        np.testing.assert_allclose(
            hour_means(fine, "moer_kg_per_kwh", minutes), hourly.moer_kg_per_kwh, rtol=0, atol=MOER_TOL
        )
    assert list(pd.read_parquet(garage15 / "series_15min.parquet").columns) == list(hourly.columns)
    assert list(pd.read_parquet(garage15 / "series_5min.parquet").columns) == list(PHYSICS_COLUMNS)
    # PV follows the sun within the hour: the 15-minute steps of a sunny morning hour rise
    fine = pd.read_parquet(garage15 / "series_15min.parquet")
    local = pd.DatetimeIndex(fine.time).tz_convert(TZ)
    morning = fine.pv_kw_per_kwp.to_numpy()[(local.hour == 9) & (local.date == pd.Timestamp("2023-10-25").date())]
    assert (np.diff(morning) > 0).all(), morning


def test_forecasts_at_a_fifteen_minute_step_start_are_the_raw_row_at_that_time(garage15):
    m = moer_frame("2023-10-21", "2023-11-09")
    m["time"] = pd.to_datetime(m.time, utc=True)
    raw = m.set_index("time")
    fine = pd.read_parquet(garage15 / "series_15min.parquet")
    t = pd.DatetimeIndex(fine.time)
    assert (t.minute % 15 == 0).all() and (t.minute != 0).any()
    row = raw.loc[t]
    for h in range(3):
        fc = row[[f"f{i}" for i in range(12 * h + 1, 12 * h + 13)]].mean(axis=1)
        np.testing.assert_allclose(fine[f"moer_fc_h{h}"], fc, rtol=1e-6)
    for i in (1, 7, 12):
        np.testing.assert_allclose(fine[f"moer_fc_5min_{i:02d}"], row[f"f{i}"], rtol=1e-6)
    five = pd.Timedelta(minutes=5)
    np.testing.assert_allclose(fine.moer_last_5min, raw.moer.loc[t - five], rtol=1e-6)
    last3 = sum(raw.moer.loc[t - k * five].to_numpy() for k in (1, 2, 3)) / 3
    np.testing.assert_allclose(fine.moer_last_15min, last3, rtol=1e-6)
    np.testing.assert_allclose(
        fine.moer_kg_per_kwh, raw.moer.groupby(raw.index.floor("15min")).mean().loc[t], rtol=1e-6
    )


def test_the_hourly_series_is_the_one_of_an_hourly_ingestion(garage15, tmp_path, template):
    toml = write_garage(tmp_path, template)
    summary = ingest(toml)  # the TOML's step: 1 h
    assert sorted(p.name for p in (tmp_path / "garage").iterdir()) == [
        "README.md",
        "series_5min.parquet",
        "series_60min.parquet",
        "sessions.parquet",
    ]
    assert summary["paths"]["series_60min"] == tmp_path / "garage" / "series_60min.parquet"
    for f in ("series_60min.parquet", "series_5min.parquet", "sessions.parquet"):
        assert pd.read_parquet(tmp_path / "garage" / f).equals(pd.read_parquet(garage15 / f)), f
    # ingesting again at the same step writes nothing
    again = ingest(toml)
    assert again["written"] == []


def test_the_readme_describes_every_series_file(garage15):
    readme = " ".join((garage15 / "README.md").read_text().split())  # prose lines are wrapped
    for needle in (
        "--dt-h 0.25`",
        "## Series: `series_15min.parquet`, `series_60min.parquet`, `series_5min.parquet`",
        "| `series_15min.parquet` | 15 minutes | the site's step (`dt_h` = 0.25 h) | 1,444 |",
        "| `series_60min.parquet` | 60 minutes | the hourly study (`dt_h` = 1) | 361 |",
        "| `series_5min.parquet` | 5 minutes | the physics every controller is also scored on",
        '.get_clearsky(times, model="haurwitz")',
        "The mean of an hour's steps is therefore the hourly value exactly",
        "Forecasts are issued at each step start",
        "## `sessions.parquet`",
        "## Splits of the site TOML",
        "`moer_de/DE_part1.csv`",
    ):
        assert needle in readme, needle


def test_a_site_loads_at_the_ingested_steps(garage15):
    toml = garage15.parent / "garage.toml"
    hourly, fine = load_site(toml), load_site(toml, dt_h=0.25)
    assert fine.split("train").num_steps == 4 * hourly.split("train").num_steps
    assert fine.physics_split("train").num_steps == 12 * hourly.split("train").num_steps


def test_a_two_minute_step_of_a_five_minute_moer_is_refused(tmp_path, template):
    toml = write_garage(tmp_path, template)
    with pytest.raises(SourceError) as info:
        ingest(toml, dt_h=2 / 60)
    message = str(info.value)
    for needle in (
        str(toml),
        "key 'dt_h' = 0.0333333 h (a step of 2 minutes)",
        "[sources.carbon] (format 'watttime-moer') has a resolution of 5 minutes",
        "a step must be a multiple of 5 minutes",
        "dt_h = 0.0833333 (5 min), 0.166667 (10 min), 0.25 (15 min)",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()
    with pytest.raises(SourceError, match=r"dt_h = 0\.3 \(given in place of the TOML's key 'dt_h'\)"):
        ingest(toml, dt_h=0.3)


def _hourly_carbon_site(folder: Path, template: Path, minutes: int = 60) -> Path:
    """The garage with a carbon CSV of one value every ``minutes`` (g/kWh, no forecasts) from 2 h before the period."""
    toml = write_garage(folder, template)
    t = pd.date_range("2023-10-22 20:00", "2023-11-07 00:00", freq=f"{minutes}min", tz="UTC", inclusive="left")
    g = 300.0 + 100.0 * np.cos(np.arange(len(t)) * minutes / 60 / 24 * 2 * np.pi) + 7.0 * (np.arange(len(t)) % 5)
    pd.DataFrame({"Datetime (UTC)": t.strftime("%Y-%m-%d %H:%M:%S"), "ci": g}).to_csv(
        folder / "raw" / "carbon.csv", index=False
    )
    _swap_table(
        toml,
        "sources.carbon",
        '[sources.carbon]\nformat = "csv"\nfiles = "carbon.csv"\ntime_column = "Datetime (UTC)"\nvalue_column = "ci"\n'
        'unit = "g/kWh"\ntimezone = "UTC"\n',
    )
    return toml


def test_a_fifteen_minute_step_of_an_hourly_carbon_csv_is_refused_and_the_cli_says_so(tmp_path, template, capsys):
    toml = _hourly_carbon_site(tmp_path, template)
    with pytest.raises(SourceError) as info:
        ingest(toml, dt_h=0.25)
    message = str(info.value)
    for needle in (
        str(toml),
        "key 'dt_h' = 0.25 h (a step of 15 minutes) is finer than a source gives",
        "[sources.carbon] (format 'csv') has a resolution of 60 minutes (the typical spacing of its timestamps",
        "steps it supports: dt_h = 1 (60 min)",
    ):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "garage").exists()

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline.data.ingest", "--site", str(toml), "--dt-h", "0.25"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {toml}: key 'dt_h' = 0.25 h"), result.stderr
    assert "[sources.carbon]" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "garage").exists()

    # at the hour it ingests, without a 5-minute physics series, and one line says why
    capsys.readouterr()
    summary = ingest(toml)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "physics series" in line]
    assert len(lines) == 1 and "[sources.carbon] (format 'csv') has a resolution of 60 minutes" in lines[0], out
    assert sorted(summary["paths"]) == ["readme", "series_60min", "sessions"]
    assert "No `series_5min.parquet`: [sources.carbon]" in (tmp_path / "garage" / "README.md").read_text()


def test_persistence_forecasts_at_fifteen_minutes_are_the_mean_of_the_hour_before(tmp_path, template):
    src = load_sources(_hourly_carbon_site(tmp_path, template, minutes=5), dt_h=0.25)
    raw = pd.read_csv(tmp_path / "raw" / "carbon.csv")
    raw = pd.Series(raw.ci.to_numpy() / 1000.0, index=pd.to_datetime(raw["Datetime (UTC)"], utc=True))
    index = step_index(*period(src.config), TZ, 0.25)
    c, info = read_carbon(src, index)
    assert info["forecast"] == "persistence" and info["resolution_min"] == 5 and not info["first_hour_own_value"]
    hour = pd.Timedelta(hours=1)
    expected = [raw[(raw.index >= s - hour) & (raw.index < s)].mean() for s in index]
    for h in range(3):
        np.testing.assert_allclose(c[f"moer_fc_h{h}"], expected, rtol=1e-12)
    np.testing.assert_allclose(c.moer_kg_per_kwh, raw.groupby(raw.index.floor("15min")).mean().loc[index], rtol=1e-12)
    # at the hour: the previous hour's mean, as ever
    hourly_index = step_index(*period(src.config), TZ, 1.0)
    ch, _ = read_carbon(src, hourly_index)
    hour_mean = raw.groupby(raw.index.floor("h")).mean()
    np.testing.assert_allclose(ch.moer_fc_h0, hour_mean.shift(1).loc[hourly_index], rtol=1e-12)


def test_split_hours_keeps_the_hour_mean_follows_the_sun_and_caps_at_the_inverter():
    index = step_index("2023-06-21", "2023-06-22", "Europe/Berlin", 0.25)  # local hours 0..23, sun ~05:00..21:30
    local = np.arange(24)
    hours = 0.8 * np.clip(np.sin(np.pi * (local + 0.5 - 5) / 16.5), 0.0, None) ** 0.5
    hours[12:14] = 0.8  # clipped hours: at the inverter's cap
    hours[1] = 0.01  # PV in a night hour: equal shares
    hours[21] = 0.5  # a sunset hour whose lit steps cannot hold it all: the rest in equal parts to the dark ones
    pv, info = split_hours(hours, index, 52.5, 13.4, 34.0, cap=0.8)
    steps = pv.reshape(24, 4)
    np.testing.assert_allclose(steps.mean(axis=1), hours, rtol=0, atol=1e-12)
    assert pv.max() <= 0.8 + 1e-12 and info["hours_equal_shares"] >= 1 and info["hours_capped"] >= 3
    assert np.allclose(steps[1], 0.01) and np.allclose(steps[12], 0.8)  # a clipped hour is clipped all through
    assert (np.diff(steps[7]) > 0).all() and (np.diff(steps[19]) < 0).all()  # morning rises, evening falls
    same, _ = split_hours(hours, index[::4], 52.5, 13.4, 34.0, cap=0.8)
    assert (same == hours).all()  # at the hour: the hourly values themselves


def test_clear_sky_steps_average_to_the_hourly_model():
    src = load_sources("iquitos", dt_h=0.25)
    p, w = src.config.pv, src.weather
    week = step_index("2023-06-01", "2023-06-08", "America/Lima", 1.0)
    hourly, _ = clear_sky_pv_kw_per_kwp(
        week,
        p.latitude,
        p.longitude,
        p.altitude_m,
        "America/Lima",
        src.pv,
        air_temp_c=w.air_temp_c,
        wind_speed_m_s=w.wind_speed_m_s,
        albedo=w.albedo,
        substeps_per_hour=w.substeps_per_hour,
    )
    for minutes in (15, 5):
        fine, info = pv_at(
            src, PVModel("clear-sky"), step_index("2023-06-01", "2023-06-08", "America/Lima", minutes / 60)
        )
        assert info["substeps_per_step"] == 12 * minutes // 60
        np.testing.assert_allclose(fine.reshape(-1, 60 // minutes).mean(axis=1), hourly, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------- the shipped data


@pytest.mark.parametrize("name", ["caltech", "iquitos"])
def test_shipped_fifteen_minute_series_average_to_the_hourly_series(name):
    folder = SITES_DIR / name
    if not (folder / "series_15min.parquet").is_file():
        pytest.skip(f"{name} has no 15-minute series")
    hourly = pd.read_parquet(folder / "series_60min.parquet")
    fine = pd.read_parquet(folder / "series_15min.parquet")
    physics = pd.read_parquet(folder / "series_5min.parquet")
    assert list(fine.columns) == list(hourly.columns) and set(SERIES_COLUMNS) <= set(fine.columns)
    assert list(physics.columns) == list(PHYSICS_COLUMNS)
    for df, minutes in ((fine, 15), (physics, 5)):
        assert len(df) == len(hourly) * 60 // minutes
        np.testing.assert_allclose(hour_means(df, "pv_kw_per_kwp", minutes), hourly.pv_kw_per_kwp, rtol=0, atol=PV_TOL)
        np.testing.assert_allclose(
            hour_means(df, "moer_kg_per_kwh", minutes), hourly.moer_kg_per_kwh, rtol=0, atol=MOER_TOL
        )


def test_shipped_caltech_forecasts_at_fifteen_minute_step_starts_are_the_raw_rows():
    src = load_sources("caltech")
    if src.availability()[0] != "present":
        pytest.skip(f"the raw files of caltech are not here ({src.availability()[1]})")
    fine = pd.read_parquet(SITES_DIR / "caltech" / "series_15min.parquet").set_index("time")
    files = [f for f in src.raw_files() if "SGIP_CAISO_SCE_2021-06" in f.name]
    raw = pd.read_csv(files[0])
    raw["time"] = pd.to_datetime(raw.time, utc=True)
    raw = raw.set_index("time")
    t = fine.index[(fine.index >= raw.index[12]) & (fine.index <= raw.index[-40])]
    assert len(t) > 2000 and (t.minute % 15 == 0).all()
    row = raw.loc[t]
    for h in range(3):
        fc = row[[f"f{i}" for i in range(12 * h + 1, 12 * h + 13)]].mean(axis=1).to_numpy()
        np.testing.assert_allclose(fine.loc[t, f"moer_fc_h{h}"], fc, rtol=0, atol=1e-6)
    np.testing.assert_allclose(fine.loc[t, "moer_fc_5min_03"], row.f3, rtol=0, atol=1e-6)
    np.testing.assert_allclose(fine.loc[t, "moer_last_5min"], raw.moer.loc[t - pd.Timedelta(minutes=5)], atol=1e-6)
