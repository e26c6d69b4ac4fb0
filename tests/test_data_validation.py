"""The processed site data pass their pandera schemas, and bad data are rejected with useful messages.

Every bad frame is a modified copy of (a slice of) the committed processed data of the ``caltech`` site.
The messages must name the file, the column and the row with its timestamp / session id.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.schemas import (
    MOER_5MIN_COLUMNS,
    SERIES_COLUMNS,
    SESSIONS_COLUMNS,
    SESSIONS_SCHEMA,
    DataValidationError,
    read_table,
    series_schema,
    validate_site_data,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "envs" / "sites" / "caltech"
HOURLY = DATA / "series_60min.parquet"
SESSIONS = DATA / "sessions.parquet"
SOURCE = {"series": str(HOURLY), "sessions": str(SESSIONS)}
TZ = "America/Los_Angeles"


@pytest.fixture(scope="module")
def full() -> tuple[pd.DataFrame, pd.DataFrame]:
    return read_table(HOURLY), read_table(SESSIONS)


@pytest.fixture
def small(full) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fresh copies of the first 200 hours and 100 sessions (each test may modify them)."""
    hourly, sessions = full
    return hourly.iloc[:200].copy(), sessions.iloc[:100].copy()


def _error(hourly: pd.DataFrame, sessions: pd.DataFrame) -> str:
    with pytest.raises(DataValidationError) as info:
        validate_site_data(hourly, sessions, SOURCE)
    return str(info.value)


def _line(msg: str, column: str) -> str:
    """The message line about ``column`` (fails the test if there is none)."""
    lines = [ln for ln in msg.splitlines() if f"column '{column}'" in ln]
    assert lines, f"no line names column '{column}' in:\n{msg}"
    return lines[0]


# ----------------------------------------------------------------------------------- the committed data


def test_committed_data_pass(full):
    hourly, sessions = full
    validate_site_data(hourly, sessions, SOURCE)  # raises on any failure
    series_schema(60).validate(hourly)
    SESSIONS_SCHEMA.validate(sessions)
    assert list(hourly.columns) == list(SERIES_COLUMNS) + list(MOER_5MIN_COLUMNS)  # caltech's source is 5-minute
    assert list(sessions.columns) == list(SESSIONS_COLUMNS)
    assert str(hourly.time.dtype) == "datetime64[ns, UTC]"
    assert str(sessions.arrival.dtype) == str(sessions.departure.dtype) == "datetime64[ns, UTC]"
    for c in SERIES_COLUMNS[1:] + MOER_5MIN_COLUMNS + ("energy_kwh", "requested_energy_kwh"):
        frame = hourly if c in hourly else sessions
        assert frame[c].dtype == np.float32, c
    # 2019-05-01 00:00 local inclusive .. 2021-09-01 00:00 local exclusive
    assert hourly.time.iloc[0] == pd.Timestamp("2019-05-01", tz=TZ)
    assert hourly.time.iloc[-1] + pd.Timedelta(hours=1) == pd.Timestamp("2021-09-01", tz=TZ)
    assert len(hourly) == 20_496
    assert sessions.arrival.is_monotonic_increasing
    assert sessions.session_id.is_unique
    assert HOURLY.stat().st_size + SESSIONS.stat().st_size < 5_000_000
    # PV: a plausible San Diego year (per kWp), zero at night
    year = hourly[
        (hourly.time >= pd.Timestamp("2020-05-01", tz=TZ)) & (hourly.time < pd.Timestamp("2021-05-01", tz=TZ))
    ]
    assert 1_500 < year.pv_kw_per_kwp.astype(np.float64).sum() < 2_100
    local_hour = hourly.time.dt.tz_convert("Etc/GMT+8").dt.hour
    assert hourly.pv_kw_per_kwp[(local_hour <= 3) | (local_hour >= 21)].max() == 0.0


def test_hourly_index_across_dst(full):
    hourly, _ = full
    t = pd.DatetimeIndex(hourly.time)
    assert t.is_unique and t.is_monotonic_increasing
    assert (np.diff(t.asi8) == 3_600 * 10**9).all()
    local_dates = t.tz_convert(TZ).date
    per_day = pd.Series(1, index=local_dates).groupby(level=0).size()
    assert per_day[pd.Timestamp("2019-11-03").date()] == 25  # PDT -> PST: 01:00 twice
    assert per_day[pd.Timestamp("2020-03-08").date()] == 23  # PST -> PDT: no 02:00
    assert per_day[pd.Timestamp("2021-03-14").date()] == 23
    for day in ("2019-11-03", "2020-03-08"):
        start = pd.Timestamp(day, tz=TZ) - pd.Timedelta(days=1)
        end = pd.Timestamp(day, tz=TZ) + pd.Timedelta(days=2)
        window = t[(t >= start) & (t < end)]
        expected = pd.date_range(start, end, freq="h", inclusive="left").tz_convert("UTC")
        assert window.equals(pd.DatetimeIndex(expected).as_unit("ns")), day
    train = t[(t >= pd.Timestamp("2019-05-01", tz=TZ)) & (t < pd.Timestamp("2020-01-01", tz=TZ))]
    assert len(train) == 5_881


# ------------------------------------------------------------------------------------------ bad inputs


def test_missing_column(small):
    hourly, sessions = small
    msg = _error(hourly.drop(columns="moer_fc_h1"), sessions)
    line = _line(msg, "moer_fc_h1")
    assert str(HOURLY) in line and "missing" in line


def test_nan_value(small):
    hourly, sessions = small
    hourly.loc[17, "pv_kw_per_kwp"] = np.nan
    sessions.loc[23, "energy_kwh"] = np.nan
    msg = _error(hourly, sessions)
    line = _line(msg, "pv_kw_per_kwp")
    assert str(HOURLY) in line and "row 17" in line and str(hourly.time[17]) in line and "not_nullable" in line
    line = _line(msg, "energy_kwh")
    assert str(SESSIONS) in line and "row 23" in line and sessions.session_id[23] in line


def test_negative_energy(small):
    hourly, sessions = small
    sessions.loc[17, "energy_kwh"] = -3.0
    sessions.loc[40, "energy_kwh"] = -1.0
    msg = _error(hourly, sessions)
    line = _line(msg, "energy_kwh")
    assert line.startswith(f"{SESSIONS}: column 'energy_kwh' row 17 (session {sessions.session_id[17]}): -3.0")
    assert "greater_than_or_equal_to(0)" in line and "2 rows" in line
    assert str(HOURLY) not in msg  # the hourly slice is fine


def test_energy_above_limit(small):
    hourly, sessions = small
    sessions.loc[3, "energy_kwh"] = 5_000.0  # Wh instead of kWh, say
    line = _line(_error(hourly, sessions), "energy_kwh")
    assert "row 3" in line and sessions.session_id[3] in line and "less_than_or_equal_to(200" in line


def test_duplicate_timestamp(small):
    hourly, sessions = small
    hourly.loc[10, "time"] = hourly.time[9]
    msg = _error(hourly, sessions)
    line = _line(msg, "time")
    assert str(HOURLY) in line and "row 9" in line and str(hourly.time[9]) in line and "duplicate" in msg


def test_gap_in_hourly_index(small):
    hourly, sessions = small
    gap = hourly.drop(index=[50, 51, 52])  # row 50 of the file is now the old row 53
    msg = _error(gap, sessions)
    line = _line(msg, "time")
    assert str(HOURLY) in line and "row 50" in line and str(hourly.time[53]) in line
    assert f"3 hour(s) missing after {hourly.time[49]}" in line


def test_hourly_time_not_utc(small):
    hourly, sessions = small
    naive = hourly.assign(time=hourly.time.dt.tz_localize(None))
    line = _line(_error(naive, sessions), "time")
    assert str(HOURLY) in line and "UTC" in line
    local = hourly.assign(time=hourly.time.dt.tz_convert(TZ))
    line = _line(_error(local, sessions), "time")
    assert str(HOURLY) in line and "UTC" in line


def test_departure_before_arrival(small):
    hourly, sessions = small
    sessions.loc[5, ["arrival", "departure"]] = sessions.loc[5, ["departure", "arrival"]].to_numpy()
    msg = _error(hourly, sessions)
    line = _line(msg, "departure")
    assert str(SESSIONS) in line and "row 5" in line and sessions.session_id[5] in line
    assert "departure > arrival" in line and str(sessions.departure[5]) in line


def test_carbon_in_g_per_kwh(small):
    hourly, sessions = small
    hourly["moer_kg_per_kwh"] = hourly["moer_kg_per_kwh"] * 1000.0
    first = int(np.flatnonzero(hourly["moer_kg_per_kwh"].to_numpy() > 2.0)[0])
    line = _line(_error(hourly, sessions), "moer_kg_per_kwh")
    assert str(HOURLY) in line and f"row {first} " in line and str(hourly.time[first]) in line
    assert "looks like g/kWh" in line


def test_single_carbon_spike_is_not_called_g_per_kwh(small):
    hourly, sessions = small
    hourly.loc[30, "moer_fc_h2"] = 7.0
    line = _line(_error(hourly, sessions), "moer_fc_h2")
    assert "row 30" in line and str(hourly.time[30]) in line and "g/kWh" not in line


def test_pv_out_of_range(small):
    hourly, sessions = small
    hourly.loc[12, "pv_kw_per_kwp"] = -0.5
    line = _line(_error(hourly, sessions), "pv_kw_per_kwp")
    assert "row 12" in line and str(hourly.time[12]) in line and "greater_than_or_equal_to(0" in line


def test_wrong_dtype_and_unsorted_sessions(small):
    hourly, sessions = small
    bad = sessions.assign(energy_kwh=sessions.energy_kwh.astype(str)).iloc[::-1]
    msg = _error(hourly, bad)
    assert "float32" in _line(msg, "energy_kwh")
    assert "sorted by arrival" in _line(msg, "arrival")


def test_duplicate_session_id(small):
    hourly, sessions = small
    sessions.loc[8, "session_id"] = sessions.session_id[7]
    line = _line(_error(hourly, sessions), "session_id")
    assert str(SESSIONS) in line and "row 7" in line and "duplicate" in line


def test_all_failures_of_both_files_reported(small):
    hourly, sessions = small
    hourly.loc[3, "moer_fc_h0"] = np.nan
    sessions.loc[4, "requested_energy_kwh"] = -2.0
    msg = _error(hourly, sessions)
    assert "row 3" in _line(msg, "moer_fc_h0") and "row 4" in _line(msg, "requested_energy_kwh")


def test_validation_leaves_frames_unchanged(small):
    hourly, sessions = small
    h0, s0 = hourly.copy(), sessions.copy()
    validate_site_data(hourly, sessions, SOURCE)
    pd.testing.assert_frame_equal(hourly, h0)
    pd.testing.assert_frame_equal(sessions, s0)


# ------------------------------------------------------------------------------------------- read_table


def test_non_parquet_file(tmp_path, small):
    hourly, _ = small
    json_file = tmp_path / "hourly.json"
    hourly.to_json(json_file, date_format="iso")
    with pytest.raises(DataValidationError, match="hourly.json"):
        read_table(json_file)
    fake = tmp_path / "hourly.parquet"
    fake.write_text("time,pv_kw_per_kwp\n2019-05-01T07:00:00Z,0.0\n")  # a CSV under a .parquet name
    with pytest.raises(DataValidationError, match=r"hourly\.parquet.*not readable as parquet"):
        read_table(fake)
    with pytest.raises(FileNotFoundError, match="nothing.parquet"):
        read_table(tmp_path / "nothing.parquet")


def test_csv_round_trip(tmp_path, small):
    hourly, sessions = small
    hourly.to_csv(tmp_path / "hourly.csv", index=False)
    sessions.to_csv(tmp_path / "sessions.csv", index=False)
    h, s = read_table(tmp_path / "hourly.csv"), read_table(tmp_path / "sessions.csv")
    validate_site_data(h, s, {"series": str(tmp_path / "hourly.csv"), "sessions": str(tmp_path / "sessions.csv")})
    pd.testing.assert_series_equal(h.time, hourly.time)
    pd.testing.assert_series_equal(s.arrival, sessions.arrival)


def test_five_minute_columns_come_all_or_none():
    """A site whose hourly data hold some of the optional 5-minute MOER columns but not all is refused when a split
    is cut, naming the data file and the missing columns; with all of them the split carries them in order."""
    from conftest import make_site

    from envs.site import Site

    site = make_site(days=3)
    hourly = site.series.copy()
    for i, c in enumerate(MOER_5MIN_COLUMNS):
        hourly[c] = np.float32(0.1 + 0.01 * i)
    full = Site(site.config, hourly, site.sessions, {"series": "site/series_60min.parquet"})
    np.testing.assert_allclose(full.split("train").moer_5min[0], 0.1 + 0.01 * np.arange(len(MOER_5MIN_COLUMNS)))
    partial = Site(
        site.config, hourly.drop(columns=["moer_fc_5min_12"]), site.sessions, {"series": "site/series_60min.parquet"}
    )
    with pytest.raises(ValueError, match=r"site/series_60min\.parquet: column\(s\) moer_fc_5min_12 missing"):
        partial.split("train")
    assert site.split("train").moer_5min is None
