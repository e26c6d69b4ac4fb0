"""The Iquitos site: its config and shipped data, the generator behind them, the PV model, the baselines, the report.

The shipped data (``envs/sites/iquitos/``) must be exactly what ``python -m pipeline.data.ingest --site iquitos`` writes
from the TOML's ``[sources]`` (fleet generator, constant grid factor, clear-sky PV).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.config import load_config
from envs.kpis import balance_residual, evaluate_policy
from envs.schemas import read_table, validate_site_data
from envs.site import Site, load_site
from pipeline.control.baselines import POLICIES
from pipeline.data import pv as pv_model
from pipeline.data import readers, sources, synthetic

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "envs" / "sites" / "iquitos"
TZ = "America/Lima"
SRC = sources.load_sources("iquitos")
FLEETS = SRC.sessions.fleets
FLEET = {f.kind: f for f in FLEETS}
CLEAR_SKY_KWH_PER_KWP = 1798.0
"""Clear-sky AC yield of the shipped PV profile, kWh per kWp per year (stated in the README and the TOML)."""


@pytest.fixture(scope="module")
def site() -> Site:
    return load_site("iquitos", dt_h=1.0)  # the hourly series; runs the pandera schemas over both tables


@pytest.fixture(scope="module")
def sessions() -> pd.DataFrame:
    return read_table(DATA / "sessions.parquet")


# ------------------------------------------------------------------------------------------ the config


def test_config_states_the_study_sizes():
    cfg, path = load_config("iquitos")
    assert path.name == "iquitos.toml"
    assert cfg.name == "iquitos" and cfg.timezone == TZ
    assert cfg.ev.n_sockets == 128 == sum(f.n_sockets for f in FLEETS)
    assert (FLEET["motorbike"].n_sockets, FLEET["moto-taxi"].n_sockets) == (112, 16)
    assert cfg.ev.socket_kw == 3.3
    assert cfg.pv.kwp == 4050.0
    assert cfg.bess.capacity_kwh == 4520.0
    assert cfg.bess.power_kw == pytest.approx(0.25 * 4520.0)
    assert cfg.synthetic_sessions is True and "synthetic" in cfg.data_note
    assert sources.period(cfg) == ("2023-01-01", "2024-01-01")  # the one generated year, from the splits
    assert SRC.sessions.format == "fleet" and SRC.carbon.kg_per_kwh == 0.4521 and SRC.weather.format == "clear-sky"
    assert (cfg.pv.latitude, cfg.pv.longitude, cfg.pv.tilt_deg, cfg.pv.azimuth_deg) == (-3.75, -73.25, 10.0, 0.0)
    caltech = load_config("caltech")[0]
    assert caltech.synthetic_sessions is False and caltech.data_note == ""


def test_shipped_data_pass_schemas_with_constant_grid_factor(site):
    h, s = site.series, site.sessions
    validate_site_data(h, s, {"series": "series_60min.parquet", "sessions": "sessions.parquet"})
    assert len(h) == 8760
    assert h.time.iloc[0] == pd.Timestamp("2023-01-01", tz=TZ).tz_convert("UTC")
    for c in ("moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2"):
        assert (h[c].to_numpy() == np.float32(0.4521)).all()
    ids = sorted(s.station_id.unique())
    assert ids == FLEET["motorbike"].station_ids() + FLEET["moto-taxi"].station_ids()
    assert len(ids) == 128


def test_splits_map_each_socket_id_to_its_own_socket(site):
    index = {st: i for i, st in enumerate(sorted(site.sessions.station_id.unique()))}
    for split in ("train", "test"):
        d = site.split(split)
        assert not d.sessions.rejected.any()
        assert (d.sessions.socket.to_numpy() == d.sessions.station_id.map(index).to_numpy()).all()
    assert site.split("test").time.min() > site.split("train").time.max()


# ------------------------------------------------------------------------------------------ the generator


def test_generator_is_reproducible():
    a, sa = synthetic.generate_sessions(FLEETS, 7, "2023-03-01", "2023-03-15", TZ, "IQ")
    b, sb = synthetic.generate_sessions(FLEETS, 7, "2023-03-01", "2023-03-15", TZ, "IQ")
    pd.testing.assert_frame_equal(a, b)
    assert sa == sb
    c, _ = synthetic.generate_sessions(FLEETS, 8, "2023-03-01", "2023-03-15", TZ, "IQ")
    assert not a[["arrival", "energy_kwh"]].equals(c[["arrival", "energy_kwh"]])


def test_shipped_sessions_are_the_generator_output(sessions):
    regenerated, _ = readers.read_sessions(SRC)
    pd.testing.assert_frame_equal(sessions, regenerated)


def test_sessions_respect_fleet_parameters(sessions):
    days = 365
    for kind, f in FLEET.items():
        s = sessions[sessions.kind == kind]
        assert s.station_id.str.startswith(f.station_prefix + "-").all()
        assert set(s.station_id) == set(f.station_ids())
        # Poisson mean per day, less the few dropped when every socket of the kind is busy (< 3%)
        expected = f.sessions_per_socket_day * f.n_sockets * days
        assert 0.97 * expected <= len(s) <= 1.02 * expected
        lo, hi = f.energy_kwh
        assert s.energy_kwh.between(lo - 1e-3, hi + 1e-3).all()
        dwell_h = (s.departure - s.arrival).dt.total_seconds() / 3600.0
        assert dwell_h.between(f.dwell_h[0] - 1e-9, f.dwell_h[1] + 1e-9).all()
        assert 0.85 * f.dwell_median_h <= dwell_h.median() <= 1.15 * f.dwell_median_h
        local_hour = s.arrival.dt.tz_convert(TZ).dt.hour
        peaks = {round(m) % 24 for _, m, _ in f.arrival_mix}
        assert local_hour.value_counts().idxmax() in peaks | {(p - 1) % 24 for p in peaks} | {
            (p + 1) % 24 for p in peaks
        }
    assert (sessions.requested_energy_kwh == sessions.energy_kwh).all()


def test_no_two_sessions_overlap_on_a_socket(sessions):
    s = sessions.sort_values(["station_id", "arrival"])
    same = s.station_id.to_numpy()[1:] == s.station_id.to_numpy()[:-1]
    gap = s.arrival.to_numpy()[1:] - s.departure.to_numpy()[:-1]
    assert (gap[same] >= np.timedelta64(60, "m")).all()  # one hour turnaround


def test_most_requests_fit_dwell_at_socket_power(sessions):
    dwell_h = (sessions.departure - sessions.arrival).dt.total_seconds() / 3600.0
    over = sessions.energy_kwh > dwell_h * load_config("iquitos")[0].ev.socket_kw
    assert not over[sessions.kind == "motorbike"].any()
    assert over.mean() < 0.02  # 842 moto-taxi sessions of 72,845 (1.2%), stated in the README


# -------------------------------------------------------------------------------------------------- PV


def test_pv_zero_at_night_peaks_near_solar_noon(site):
    h = site.series.set_index("time")["pv_kw_per_kwp"].astype(np.float64)
    local = h.index.tz_convert(TZ)
    night = (local.hour >= 19) | (local.hour < 5)
    assert (h[night] == 0.0).all()
    # solar noon at lon -73.25 in UTC-5 is 11:53 local +- the equation of time (11:37..12:09): the sunniest
    # hour starts at 11 or 12 local every day
    peak_hour = h.groupby(local.date).idxmax().map(lambda t: t.tz_convert(TZ).hour)
    assert set(peak_hour) <= {11, 12}
    assert h.max() <= 0.8 + 1e-6  # inverter cap at DC/AC 1.2, eta 0.96
    assert h.sum() == pytest.approx(CLEAR_SKY_KWH_PER_KWP, abs=1.0)


def test_pv_is_the_pvlib_clear_sky_model(site):
    week = sources.hourly_index("2023-06-01", "2023-06-08", TZ)
    pv_cfg, w = SRC.config.pv, SRC.weather
    pv, info = pv_model.clear_sky_pv_kw_per_kwp(
        week,
        pv_cfg.latitude,
        pv_cfg.longitude,
        pv_cfg.altitude_m,
        TZ,
        SRC.pv,
        air_temp_c=w.air_temp_c,
        wind_speed_m_s=w.wind_speed_m_s,
        albedo=w.albedo,
        substeps_per_hour=w.substeps_per_hour,
    )
    stored = site.series.set_index("time").loc[week, "pv_kw_per_kwp"].to_numpy()
    np.testing.assert_allclose(pv.to_numpy(np.float32), stored, rtol=0, atol=1e-7)
    lo, hi = info["linke_turbidity_range"]
    assert 2.0 < lo <= hi < 7.0  # pvlib's climatology, not a default constant


# ----------------------------------------------------------------------------------- baselines, report


@pytest.fixture(scope="module")
def short_site(site) -> Site:
    """The shipped site with the test split cut to its first week."""
    cfg = site.config.replace(splits={"test": ("2023-10-02", "2023-10-08")})
    return Site(cfg, site.series, site.sessions, dict(site.source))


@pytest.fixture(scope="module")
def baseline_runs(short_site, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("iquitos_baselines")
    runs = {}
    for name in ("uncontrolled", "rule_based"):
        kpis, traces = evaluate_policy(POLICIES[name], short_site, "test", name, train_wall_s=0.0)
        kpis.to_parquet(out / f"{name}_test.parquet")
        traces.to_parquet(out / f"{name}_test_traces.parquet")
        runs[name] = (kpis.iloc[0], traces, out / f"{name}_test.parquet", out / f"{name}_test_traces.parquet")
    return runs


def test_baselines_balance_and_report_unserved_energy(short_site, baseline_runs):
    data = short_site.split("test")
    assert data.num_steps == 7 * 24
    for name, (k, traces, _, _) in baseline_runs.items():
        assert balance_residual(traces).max() <= 1e-6, name
        assert np.isfinite(k.unserved_kwh) and k.unserved_kwh >= 0.0
        assert k.ev_energy_delivered_kwh + k.unserved_kwh <= k.ev_energy_requested_kwh + 1e-6
        assert k.ev_energy_served_pct > 99.0
        # constant grid factor: CO2 is grid import times 0.4521
        assert k.co2_kg == pytest.approx(np.float32(0.4521) * k.grid_import_kwh, rel=1e-9, abs=1e-9)
    assert baseline_runs["rule_based"][0].co2_kg < baseline_runs["uncontrolled"][0].co2_kg


def test_report_labels_synthetic_sessions(short_site, baseline_runs, tmp_path):
    from pipeline.study.tasks import make_report

    cfg = {"site_toml": short_site.source["config"], "algos": []}
    kpis = [str(r[2]) for r in baseline_runs.values()]
    traces = {f"{n}|test": str(r[3]) for n, r in baseline_runs.items()}
    md = Path(make_report(cfg, kpis, traces, {}, str(tmp_path))).read_text()
    assert md.startswith("# CO2 comparison: iquitos (synthetic EV sessions)")
    assert "**Synthetic EV sessions.**" in md and "**Constant grid factor** (0.4521 kg CO2/kWh)" in md
    assert "Unserved energy (kWh)" in md
