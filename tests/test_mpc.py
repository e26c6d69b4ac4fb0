"""The model-predictive controllers (pipeline/control/mpc.py): equal to the oracle with perfect information over the
whole window, causal, consistent with the env's physics, sensible tie-breaks, and their place in the pipeline."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from conftest import changed_future, make_site, write_site

from envs.config import ConfigError
from envs.kpis import balance_residual, evaluate_policy
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site
from pipeline.control.baselines import uncontrolled
from pipeline.control.forecast import REGRESSION_WARMUP_DAYS, RIDGE, MOERRegression, profile_outlook
from pipeline.control.mpc import MPCController, PlannerParams, run_mpc
from pipeline.control.oracle import solve_oracle


def _params(data, **changes) -> PlannerParams:
    """The site's ``[mpc]`` parameters with ``changes``."""
    return dataclasses.replace(PlannerParams.of_site(data.config), **changes)


def _run(site: Site, split: str, perfect: bool, horizon_h: int = 24):
    """``(kpi_row, traces, controller)`` of an MPC run that keeps every plan."""
    data = site.split(split)
    mpc = MPCController(data, _params(data, horizon_h=horizon_h), perfect=perfect, keep_plans=True)
    kpi, traces = evaluate_policy(mpc, site, split, "mpc", action_mode="socket", bess_action="setpoint")
    return kpi, traces, mpc


@pytest.fixture(scope="module")
def tiny() -> Site:
    return make_site(days=4, n_sockets=4)


@pytest.mark.parametrize("split", ["train", "test"])
def test_perfect_mpc_over_the_whole_split_equals_the_oracle(tiny, split):
    oracle, _ = solve_oracle(tiny, split)
    T = tiny.split(split).num_steps
    kpi, traces, mpc = _run(tiny, split, perfect=True, horizon_h=T)
    assert mpc.solves == T
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-6
    assert float(kpi.co2_kg.iloc[0]) == pytest.approx(float(oracle.co2_kg.iloc[0]), rel=1e-4, abs=1e-3)


@pytest.mark.parametrize("perfect", [False, True], ids=["mpc", "mpc_perfect"])
def test_bounded_by_the_oracle_balanced_and_serving(tiny, perfect):
    for split in ("train", "test"):
        oracle, _ = solve_oracle(tiny, split)
        base, _ = evaluate_policy(uncontrolled, tiny, split, "uncontrolled")
        kpi, traces, _ = _run(tiny, split, perfect)
        assert float(oracle.co2_kg.iloc[0]) <= float(kpi.co2_kg.iloc[0]) + 1e-6
        assert float(kpi.co2_kg.iloc[0]) < float(base.co2_kg.iloc[0])
        assert balance_residual(traces).max() < 1e-4
        assert float(kpi.ev_energy_delivered_kwh.iloc[0]) >= 0.99 * float(base.ev_energy_delivered_kwh.iloc[0])


def test_perfect_with_a_day_ahead_is_close_to_the_oracle(tiny):
    oracle, _ = solve_oracle(tiny, "train")
    causal, _, _ = _run(tiny, "train", perfect=False)
    perfect, _, _ = _run(tiny, "train", perfect=True)
    assert float(oracle.co2_kg.iloc[0]) <= float(perfect.co2_kg.iloc[0]) + 1e-6
    assert float(perfect.co2_kg.iloc[0]) <= float(causal.co2_kg.iloc[0]) + 1e-6


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"grid": {"import_limit_kw": 9.0}, "bess": {"power_kw": 5.0}},
        {"grid": {"export_allowed": True}, "pv": {"kwp": 25.0}},
    ],
    ids=["default", "binding_import_limit", "export"],
)
@pytest.mark.parametrize("perfect", [False, True], ids=["mpc", "mpc_perfect"])
def test_planned_first_step_is_what_the_env_does(perfect, overrides):
    """Every solve's first step, applied through the env, gives the LP's flows (same physics)."""
    site = make_site(days=3, n_sockets=4, **overrides)
    _, traces, mpc = _run(site, "train", perfect)
    assert len(mpc.plans) == len(traces)
    planned = pd.DataFrame(
        {
            "grid_import_kw": [p.grid_import_kw for p in mpc.plans],
            "grid_export_kw": [p.grid_export_kw for p in mpc.plans],
            "pv_curtailed_kw": [p.pv_curtailed_kw for p in mpc.plans],
            "bess_charge_kw": [p.bess_charge_kw for p in mpc.plans],
            "bess_discharge_kw": [p.bess_discharge_kw for p in mpc.plans],
            "ev_charge_kw": [p.ev_kw.sum() for p in mpc.plans],
        }
    )
    for col in planned.columns:
        np.testing.assert_allclose(traces[col].to_numpy(), planned[col].to_numpy(), atol=1e-5, err_msg=col)
    # tie-breaks: never charge and discharge at once, never import while curtailing
    assert (np.minimum(planned.bess_charge_kw, planned.bess_discharge_kw) < 1e-7).all()
    assert (np.minimum(traces.grid_import_kw, traces.pv_curtailed_kw) < 1e-7).all()


@pytest.mark.parametrize("perfect", [False, True], ids=["mpc", "mpc_perfect"])
def test_never_uses_data_past_its_horizon_or_future_arrivals(perfect):
    site = make_site(days=10, n_sockets=4)
    H, last = 12, (REGRESSION_WARMUP_DAYS + 1) * 24 + 5  # actions at steps 0..last are compared: the causal MOER
    # regression is in use from day REGRESSION_WARMUP_DAYS on and refit once more by `last`
    cut = last + H if perfect else last + 1  # the first step whose data the controller may not see by step `last`
    _, _, a = _run(site, "train", perfect, horizon_h=H)
    _, _, b = _run(changed_future(site, "train", cut), "train", perfect, horizon_h=H)
    for pa, pb in zip(a.plans[: last + 1], b.plans[: last + 1]):
        np.testing.assert_array_equal(pa.action, pb.action, err_msg=f"step {pa.t}")
    # ... and the change does matter afterwards
    assert any(not np.array_equal(pa.action, pb.action) for pa, pb in zip(a.plans[last + 1 :], b.plans[last + 1 :]))


def _ar_moer_site(days: int = 14, seed: int = 3) -> Site:
    """A site whose MOER is a daily cycle plus AR(1) noise (persistence 0.9 per hour) and whose data forecasts
    carry the cycle only: what the last hours' MOER says about the next ones is left for the regression."""
    site = make_site(days=days, n_sockets=4)
    hourly = site.series.copy()
    hour = hourly.time.dt.tz_convert(site.config.timezone).dt.hour.to_numpy()
    cycle = 0.25 + 0.1 * np.cos((hour - 19) / 24 * 2 * np.pi)
    rng = np.random.default_rng(seed)
    x = np.zeros(len(hourly))
    for i in range(1, len(x)):
        x[i] = 0.9 * x[i - 1] + rng.normal(0, 0.03)
    hourly["moer_kg_per_kwh"] = np.clip(cycle + x, 0.0, None).astype(np.float32)
    for h in range(3):
        hourly[f"moer_fc_h{h}"] = np.roll(cycle, -h).astype(np.float32)
    return Site(site.config, hourly, site.sessions, dict(site.source))


def test_moer_regression_is_causal_and_learns_what_the_data_forecasts_miss():
    site = _ar_moer_site()
    data = site.split("train")
    days = range(REGRESSION_WARMUP_DAYS * 24, data.num_steps - 24)
    mpc = MPCController(data, _params(data, horizon_h=24))
    fc = np.array([mpc.moer_outlook(t, 24) for t in days])
    profile = np.array([profile_outlook(data, t, 24) for t in days])
    truth = np.array([data.moer[t : t + 24] for t in days])
    err, err_profile = np.abs(fc - truth).mean(0), np.abs(profile - truth).mean(0)
    # the last hours' MOER predicts the next few: the regression beats the data's forecasts and the profile there
    assert (err[:4] < 0.8 * err_profile[:4]).all(), (err[:4], err_profile[:4])
    # causal: scrambling the MOER and its forecasts from step `cut` on leaves every forecast issued before it unchanged
    cut = REGRESSION_WARMUP_DAYS * 24 + 30
    changed = changed_future(site, "train", cut).split("train")
    other = MPCController(changed, _params(changed, horizon_h=24))
    for t in range(cut):
        np.testing.assert_array_equal(mpc.moer_outlook(t, 24), other.moer_outlook(t, 24), err_msg=f"step {t}")
    assert not np.array_equal(mpc.moer_outlook(cut, 24), other.moer_outlook(cut, 24))


def test_moer_regression_with_forgetting_is_the_weighted_fit_it_documents():
    """With a half-life the regression is weighted least squares whose pair weights halve every half-life from the
    day after their target (checked against an independent fit); half-life 0 is ``mpc``'s regression to the bit; a
    backtest that starts mid-split (the past fitted in one go) forecasts what a run from the split's start does; it is
    causal."""
    site = _ar_moer_site(days=16)
    data = site.split("train")
    H, half_life, day = 6, 2.5, 24
    t = 12 * day + 5
    f = MOERRegression(data, H, half_life_days=half_life)
    got = f(t, H)
    start = t - t % day
    want = []
    for k in range(H):
        s = np.arange(day, start - k)
        age_days = (start - ((s + k) // day * day + day)) / day
        w = 0.5 ** (age_days / half_life)
        A = f.features(s, k)
        gram = A.T @ (A * w[:, None]) + np.eye(A.shape[1]) * RIDGE * w.sum()
        coef = np.linalg.solve(gram, A.T @ (data.moer[s + k] * w))
        want.append(max(float(f.features(np.array([t]), k)[0] @ coef), 0.0))
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    assert not np.allclose(got, MOERRegression(data, H)(t, H), atol=1e-6)  # and forgetting changes the forecast
    # half-life 0 is the regression without forgetting, to the bit
    a, b = MOERRegression(data, H), MOERRegression(data, H, half_life_days=0.0)
    for u in range(REGRESSION_WARMUP_DAYS * day, data.num_steps - H, 7):
        np.testing.assert_array_equal(a(u, H), b(u, H))
    # fitted day after day from the split's start, or in one go from a later step: the same forecasts
    daily, at_once = (
        MOERRegression(data, H, half_life_days=half_life),
        MOERRegression(data, H, half_life_days=half_life),
    )
    first = 11 * day + 7
    for u in range(first):
        daily(u, H)
    for u in range(first, data.num_steps - H, 5):
        np.testing.assert_allclose(at_once(u, H), daily(u, H), rtol=1e-9, atol=1e-12, err_msg=f"step {u}")
    # causal: changing the MOER and its forecasts from step `cut` leaves every forecast issued before it unchanged
    cut = 10 * day + 9
    other = MOERRegression(changed_future(site, "train", cut).split("train"), H, half_life_days=half_life)
    mine = MOERRegression(data, H, half_life_days=half_life)
    for u in range(REGRESSION_WARMUP_DAYS * day + day, cut):
        np.testing.assert_array_equal(mine(u, H), other(u, H), err_msg=f"step {u}")
    assert not np.array_equal(mine(cut + day, H), other(cut + day, H))
    with pytest.raises(ValueError, match="half_life_days"):
        MOERRegression(data, H, half_life_days=-1.0)


def _five_minute_site(days: int = 16) -> Site:
    """:func:`_ar_moer_site` with the 5-minute columns of a WattTime source: the hour's twelve 5-minute forecasts
    are its realised MOER plus noise (they know the hour much better than the hour-mean forecasts), the last
    realised 5 minutes are the previous hour's."""
    site = _ar_moer_site(days=days)
    hourly = site.series.copy()
    moer = hourly["moer_kg_per_kwh"].to_numpy(np.float64)
    rng = np.random.default_rng(11)
    prev = np.r_[moer[0], moer[:-1]]
    hourly["moer_last_5min"] = prev.astype(np.float32)
    hourly["moer_last_15min"] = prev.astype(np.float32)
    for i in range(1, 13):
        hourly[f"moer_fc_5min_{i:02d}"] = np.clip(moer + rng.normal(0, 0.01, len(moer)), 0, None).astype(np.float32)
    return Site(site.config, hourly, site.sessions, dict(site.source))


def test_moer_regression_reads_the_five_minute_values_causally_where_the_data_have_them():
    site = _five_minute_site()
    data = site.split("train")
    assert data.moer_5min is not None and data.moer_5min.shape == (data.num_steps, len(MOER_5MIN_COLUMNS))
    H = 6
    issue = range(10 * 24, data.num_steps - H)
    truth = np.array([data.moer[t : t + H] for t in issue])
    plain, five = MOERRegression(data, H, half_life_days=5.0), MOERRegression(data, H, 5.0, five_minute=True)
    err_plain = np.abs(np.array([plain(t, H) for t in issue]) - truth).mean(0)
    err_five = np.abs(np.array([five(t, H) for t in issue]) - truth).mean(0)
    assert err_five[0] < 0.5 * err_plain[0], (err_five, err_plain)  # the hour's own 5-minute forecasts inform it
    # causal: changing every column (the 5-minute ones too) from step `cut` leaves the forecasts before it as they were
    cut = 11 * 24 + 7
    mine = MOERRegression(data, H, 5.0, five_minute=True)
    other = MOERRegression(changed_future(site, "train", cut).split("train"), H, 5.0, five_minute=True)
    for t in range(REGRESSION_WARMUP_DAYS * 24 + 24, cut):
        np.testing.assert_array_equal(mine(t, H), other(t, H), err_msg=f"step {t}")
    assert not np.array_equal(mine(cut, H), other(cut, H))
    # without the columns five_minute changes nothing
    bare = _ar_moer_site(days=16).split("train")
    t = 12 * 24
    np.testing.assert_array_equal(
        MOERRegression(bare, H, 5.0, five_minute=True)(t, H), MOERRegression(bare, H, 5.0)(t, H)
    )


def _by_arrival(sessions) -> dict:
    """``{(arrival, departure, socket): (energy kWh, weight)}`` summed over the sessions of a window."""
    keys = zip(sessions.arrival.tolist(), sessions.departure.tolist(), sessions.socket.tolist())
    out: dict = {}
    for key, e, w in zip(keys, sessions.energy_kwh, sessions.weight):
        e0, w0 = out.get(key, (0.0, 0.0))
        out[key] = (e0 + e, w0 + w)
    return out


def test_expected_demand_is_the_past_days_sessions():
    """On a split whose arrivals repeat every day, the causal controller's expected arrivals are the true ones
    (weight 1), or that share of them; with weight 0 or 0 days it plans for the plugged EVs only."""
    data = make_site(days=6, n_sockets=4).split("train")
    day = 24
    periodic = dataclasses.replace(
        data,
        arrival_need_kwh=np.tile(data.arrival_need_kwh[:day], (data.num_steps // day, 1)),
        arrival_stay_steps=np.tile(data.arrival_stay_steps[:day], (data.num_steps // day, 1)),
    )
    t, H = 3 * day + 2, 24
    plugged = (np.array([0.0, 5.0, 0.0, 2.0]), np.array([0, 3, 0, 30], dtype=np.int64))
    truth = _by_arrival(MPCController(periodic, _params(periodic, horizon_h=H), perfect=True).sessions(t, H, *plugged))
    for weight in (1.0, 0.5):
        mpc = MPCController(periodic, PlannerParams(H, expected_demand_days=3, expected_demand_weight=weight))
        got = _by_arrival(mpc.sessions(t, H, *plugged))
        assert got.keys() == truth.keys()
        for key, (e, w) in truth.items():
            share = 1.0 if key[0] == 0 else weight  # the plugged EVs are real
            assert got[key][0] == pytest.approx(share * e) and got[key][1] == pytest.approx(share * w), key
    for days, weight in ((0, 1.0), (3, 0.0)):
        params = PlannerParams(H, expected_demand_days=days, expected_demand_weight=weight)
        arr = MPCController(periodic, params).sessions(t, H, *plugged).arrival
        assert (arr == 0).all() and len(arr) == 2


def test_stores_pv_surplus_now_rather_than_curtailing():
    """No EV plugged, a PV surplus, an empty battery: the first step charges at the most it can (tie-breaks)."""
    site = make_site(days=3, n_sockets=4)
    data = site.split("test")
    b = site.config.bess
    t = int(np.argmax(data.pv_kw[:24]))
    for perfect in (False, True):
        mpc = MPCController(data, _params(data, horizon_h=24), perfect=perfect)
        plan = mpc.plan(t, b.soc_min * b.capacity_kwh, np.zeros(4), np.zeros(4, dtype=np.int64))
        surplus = data.pv_kw[t] - data.load_kw[t]
        assert surplus > 1.0
        expected = min(surplus, b.power_kw)
        assert plan.bess_charge_kw == pytest.approx(expected, abs=1e-6)
        assert plan.bess_discharge_kw == pytest.approx(0.0, abs=1e-9)
        assert plan.grid_import_kw == pytest.approx(0.0, abs=1e-9)
        assert plan.action[0] == pytest.approx(expected / b.power_kw)


def test_run_mpc_row_and_site_options(tiny, capsys):
    kpi, traces, mpc = run_mpc(tiny, "test", "mpc_perfect", horizon_h=6)
    assert kpi.controller.iloc[0] == "mpc_perfect" and float(kpi.train_wall_s.iloc[0]) == 0.0
    assert mpc.solves == len(traces) and "solves" in capsys.readouterr().out
    with pytest.raises(KeyError):
        run_mpc(tiny, "test", "mpc_oracle")
    with pytest.raises(ConfigError, match="mpc.horizon_h"):
        tiny.config.replace(mpc={"horizon_h": 0})
    with pytest.raises(ConfigError, match="mpc.expected_demand_weight"):
        tiny.config.replace(mpc={"expected_demand_weight": 1.5})
    with pytest.raises(ConfigError, match="mpc.expected_demand_days"):
        tiny.config.replace(mpc={"expected_demand_days": -1})


def test_pipeline_outputs_follow_the_site_option(tmp_path):
    from pipeline.study.config import PipelineConfig
    from pipeline.study.results import outputs

    on = write_site(make_site(days=2), tmp_path / "on")
    off_site = make_site(days=2, mpc={"enabled": False})
    off = write_site(off_site, tmp_path / "off")
    names_on = {p.name for p in outputs(PipelineConfig(site=str(on), algos=("ppo",)))["baselines"]}
    names_off = {p.name for p in outputs(PipelineConfig(site=str(off), algos=("ppo",)))["baselines"]}
    assert {"mpc_test.parquet", "mpc_perfect_train_traces.parquet"} <= names_on
    assert not any(n.startswith("mpc") for n in names_off)


def test_report_states_the_ordering():
    from pipeline.study.report import ordering_sentence, summary_paragraph

    rows = pd.DataFrame(
        {
            "controller": ["uncontrolled", "rule_based", "mpc", "mpc_perfect", "oracle"],
            "co2_kg": [100.0, 70.0, 60.0, 45.0, 40.0],
            "co2_reduction_pct": [0.0, 30.0, 40.0, 55.0, 60.0],
            "gap_closed_vs_rule_pct": [-100.0, 0.0, 33.3, 83.3, 100.0],
            "saving_vs_oracle_pct": [0.0, 50.0, 66.7, 91.7, 100.0],
            "unserved_kwh": [0.0] * 5,
            "ev_energy_delivered_kwh": [10.0] * 5,
        }
    )
    text = ordering_sentence("test", rows)
    assert text.startswith("Ordering by CO2 on the test split, lowest first, with each one's gap closed vs rule")
    assert ": oracle (40.0 kg, 100.0%) < mpc_perfect (45.0 kg, 83.3%)" in text
    assert "rule_based (70.0 kg, 0.0%) < uncontrolled (100.0 kg, -100.0%)." in text
    summary = summary_paragraph("test", rows)
    assert "**mpc_perfect**'s, 45.0 kg (55.0% below uncontrolled, gap closed vs rule 83.3%, saving vs oracle 91.7%" in (
        summary
    )
    assert "No agent was evaluated" in summary  # mpc is a baseline, not an agent
