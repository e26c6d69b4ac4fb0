"""The live planner (pipeline/live/, ``evhub-plan``): the live path is the simulated path, its charging profiles are
OCPP 1.6J, a bad state gets one clear line and writes nothing."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, make_site, write_site

from envs import timestep
from envs.config import load_config
from envs.evhub import EVHubVectorEnv
from envs.kpis import rollout_traces
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site, load_site, site_files, station_sockets
from pipeline import live
from pipeline.control import registry, rl_planner
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.tuned import rl_policy_file, rl_run_dir, tuning_files
from pipeline.live.state import FORECAST_COLUMNS

AT = "2021-08-23T08:00:00-07:00"
"""The hour of the issue's example on the shipped caltech site (its test split)."""


def _site(days: int, dt_h: float = 1.0) -> Site:
    """A synthetic site with a 6 h window and the 5-minute MOER columns the learned planners read, at a step of
    ``dt_h`` hours."""
    site = make_site(days=days, n_sockets=6, mpc={"horizon_h": 6}, dt_h=dt_h)
    series = site.series.copy()
    for i, c in enumerate(MOER_5MIN_COLUMNS):
        series[c] = (series["moer_kg_per_kwh"] * (0.98 + 0.003 * i)).astype(np.float32)
    return Site(site.config, series, site.sessions, dict(site.source), physics_series=site.physics_series)


class _DayPolicy(torch.nn.Module):
    """A fixed day-level policy for ``mpc_rl`` that reads every feature of its observation."""

    def __init__(self):
        super().__init__()
        self.w = torch.linspace(-1.0, 1.0, 2 * len(rl_planner.OBS_NAMES)).reshape(len(rl_planner.OBS_NAMES), 2)

    def forward(self, x):
        return torch.tanh(x @ self.w)


def _study(out, name: str = "synthetic") -> None:
    """A study folder ``out/<name>/tuned`` as the pipeline leaves it: tuned planner parameters of seed 1 and an
    exported ``mpc_rl`` policy."""
    tuned = out / name / "tuned"
    tuned.mkdir(parents=True)
    params = PlannerParams(
        horizon_h=6, expected_demand_weight=0.6, demand_day_type=True, moer_half_life_days=3.0, moer_five_minute=True
    )
    tuning_files(tuned, 1)[0].write_text(json.dumps({"params": params.as_dict()}))
    policy = rl_policy_file(rl_run_dir(tuned, 1))
    policy.parent.mkdir()
    torch.export.save(torch.export.export(_DayPolicy(), (torch.zeros(1, len(rl_planner.OBS_NAMES)),)), str(policy))


def _replay(
    site: Site, split: str, name: str, steps: int | None = None, co2_steps: list | None = None, **kw
) -> tuple[float, float, list[live.LivePlan]]:
    """Step ``split`` step by step through :func:`pipeline.live.make_plan` (its first ``steps`` steps; all without),
    each call given the last plan (held where the study's controller holds it): the state read off the env (its time,
    SOC, plugged cars; the history realised by then; the SOC and need at the last midnight), the plan's step applied in
    the env. Returns the env's CO2 (kg), its unserved energy (kWh) and the plans (each step's: new or held); with
    ``co2_steps``, each step's CO2 is appended to it."""
    data, cfg = site.split(split), site.config
    env = EVHubVectorEnv(
        1, site=site, split=split, action_mode="socket", full_split=True, dtype=torch.float64, bess_action="setpoint"
    )
    env.reset(seed=0)
    dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    end = cfg.split_bounds(split)[1]
    local = data.time.tz_convert(cfg.timezone)
    co2 = unserved = 0.0
    plans, day_start, last = [], None, None
    for t in range(data.num_steps if steps is None else steps):
        need, left = env.ev_need_kwh[0].numpy().copy(), env.steps_left()[0].numpy().copy()
        soc = float(env.energy_kwh[0]) / cfg.bess.capacity_kwh
        if t == 0 or (local[t].hour == 0 and local[t].minute == 0):
            day_start = live.DayStart(soc, float(need.sum()))
        series, sessions = live.realised_history(site, split, t)
        now = data.time[t]
        evs = [live.PluggedEV(int(i), float(need[i]), now + int(left[i]) * dt) for i in np.flatnonzero(left > 0)]
        state = live.LiveState(local[t], soc, evs, series, sessions, day_start=day_start, window_end=end)
        last = live.make_plan(site, state, name, last=last, **kw)
        plans.append(last)
        _, _, _, _, info = env.step(torch.as_tensor(last.action)[None])
        co2 += float(info["co2_kg"][0])
        unserved += float(info["unserved_kwh"][0])
        if co2_steps is not None:
            co2_steps.append(float(info["co2_kg"][0]))
    return co2, unserved, plans


def _run(site: Site, name: str, tuned_dir=None) -> tuple[pd.Series, pd.DataFrame]:
    """The study's run of ``name`` over the test split: its report row and its per-step traces."""
    c = registry.get(name)
    kpis, traces = c.simulate(site, "test", seed=1, tuned_dir=tuned_dir) if c.tuned else c.simulate(site, "test")
    return kpis.iloc[0], traces


def _assert_replays(site: Site, name: str, out=None, steps: int | None = None) -> list[live.LivePlan]:
    """The live path over the test split (its first ``steps`` steps) emits the study's run's CO2 to 0.1 kg and its
    unserved energy: the report row's over the whole split, the traces' sum over the first ``steps`` steps; at hourly
    steps every step is a new plan."""
    row, traces = _run(site, name, out / "synthetic" / "tuned" if out else None)
    kw = {"output_dir": out, "experiment": "synthetic"} if out else {}
    co2, unserved, plans = _replay(site, "test", name, steps, **kw)
    want_co2, want_unserved = (
        (row.co2_kg, row.unserved_kwh)
        if steps is None
        else (traces.co2_kg.iloc[:steps].sum(), traces.unserved_kwh.iloc[:steps].sum())
    )
    assert abs(co2 - want_co2) < 0.1, (name, co2, want_co2)
    assert abs(unserved - want_unserved) < 1e-3
    assert len(plans) == (site.split("test").num_steps if steps is None else steps)
    assert all(p.holds is None for p in plans) or site.config.dt_h < 1
    return plans


def test_the_live_path_reproduces_mpcs_report_row():
    """``mpc``, stepped hour by hour through make_plan (each plan rebuilt from the state and the history alone),
    emits the CO2 of the study's run of it over the split, to 0.1 kg; its plans span its window (shortened at the
    split's end, as the study's)."""
    site = _site(days=10)
    plans = _assert_replays(site, "mpc")
    assert {len(p.battery_kw) for p in plans[:-6]} == {6} and len(plans[-1].battery_kw) == 1
    assert any(p.charging_profiles for p in plans)


REPLAY_DAYS = 9
"""Days of the test split the replays below step through: past the first week, where ``mpc_adaptive`` re-chooses its
weight and the MOER regression has warmed up (:data:`pipeline.control.forecast.REGRESSION_WARMUP_DAYS`), into the
second; ``mpc``'s replay above steps through a whole split."""


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A 15-day synthetic site (three weeks of test split: mpc_adaptive re-chooses its weight twice; the MOER regression
    warms up in the second week) with a study folder."""
    out = tmp_path_factory.mktemp("out")
    _study(out)
    return _site(days=15), out


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["mpc_tuned_start", "mpc_rl_start", "mpc_tuned", "mpc_adaptive", "mpc_rl", "mpc_scenario"]
)
def test_the_live_path_reproduces_every_supported_controllers_row(study, name):
    """Every controller evhub-plan runs, stepped hour by hour through make_plan, emits its study row's CO2 to 0.1 kg:
    the weekly re-choice of mpc_adaptive (backtests of the history's past weeks), mpc_rl's daily parameters (from the
    state at the last midnight) and the refit MOER forecasts are rebuilt from the data realised before each hour."""
    site, out = study
    plans = _assert_replays(site, name, out, steps=REPLAY_DAYS * 24)
    if name == "mpc_adaptive":  # the choice moved off mpc_tuned's weight after the first week
        weights = {round(p.params.expected_demand_weight, 3) for p in plans}
        assert len(weights) >= 2, weights
    if name == "mpc_rl":
        weights = {round(p.params.expected_demand_weight, 3) for p in plans}
        assert len(weights) >= 3, weights  # a day's weight from its own midnight's state


def test_every_supported_controller_has_one_entry_of_the_dispatch_table():
    """The live path runs exactly the controllers :func:`pipeline.live.supported` names, each by its entry of
    :data:`pipeline.live.LIVE_CONTROLLERS`; a refused one has none."""
    assert set(live.LIVE_CONTROLLERS) == set(live.supported())
    assert not set(live.LIVE_CONTROLLERS) & set(live.REFUSED)


def test_the_realised_history_blanks_what_was_not_yet_known_and_keeps_the_rest():
    """At step t the realised MOER is blank from t on, the forecasts and 5-minute values after t; every other value is
    the site's own, and the site's data are left as they were."""
    site = _site(days=10)
    before = site.series.copy()
    t = 8 * 24 + 9
    series, _ = live.realised_history(site, "test", t)
    start, end = site.config.split_bounds("test")
    rows = site.series[(site.series.time >= start) & (site.series.time < end)].reset_index(drop=True)
    assert list(series.columns) == list(rows.columns) and len(series) == len(rows)
    step = np.arange(len(rows))
    later = [c for c in (*FORECAST_COLUMNS, *MOER_5MIN_COLUMNS) if c in rows]
    assert len(later) == len(FORECAST_COLUMNS) + len(MOER_5MIN_COLUMNS)
    for c in rows.columns:
        blank = step >= t if c == "moer_kg_per_kwh" else step > t if c in later else np.zeros(len(rows), bool)
        np.testing.assert_array_equal(series[c].isna().to_numpy(), blank, err_msg=c)
        pd.testing.assert_series_equal(series[c][~blank], rows[c][~blank], obj=c)
    pd.testing.assert_frame_equal(site.series, before)


def test_the_plan_reads_nothing_after_the_states_time():
    """The history given past the state's time (the realised MOER, forecasts and 5-minute values of the hours to come)
    leaves the plan as it is: the function blanks them before any controller sees them."""
    site = _site(days=10)
    t = 8 * 24 + 9
    state = live.state_at(site, site.split("test").time[t])
    plan = live.make_plan(site, state, "mpc_tuned_start")
    start, end = site.config.split_bounds("test")
    future = site.series[(site.series.time >= start) & (site.series.time < end)].reset_index(drop=True)
    future = future.astype({c: np.float64 for c in future.columns if c != "time"})
    told = live.LiveState(state.time, state.soc, state.evs, future, state.sessions, window_end=state.window_end)
    again = live.make_plan(site, told, "mpc_tuned_start")
    np.testing.assert_array_equal(again.battery_kw, plan.battery_kw)
    np.testing.assert_array_equal(again.ev_kw, plan.ev_kw)
    shuffled = future.copy()
    later = shuffled.time > state.time
    shuffled.loc[later, "moer_fc_h0"] = shuffled.loc[later, "moer_fc_h0"].to_numpy()[::-1] * 3
    told = live.LiveState(state.time, state.soc, state.evs, shuffled, state.sessions, window_end=state.window_end)
    np.testing.assert_array_equal(live.make_plan(site, told, "mpc_tuned_start").battery_kw, plan.battery_kw)


# ------------------------------------------------------------------------------------------------ OCPP 1.6J
def _ocpp_accepts(payload: dict) -> None:
    """The ``ocpp`` package's own check of a call it would send (its JSON schema, decimals for the limits)."""
    from ocpp.messages import Call, validate_payload

    asyncio.run(validate_payload(Call(unique_id="1", action="SetChargingProfile", payload=payload), "1.6"))


@pytest.fixture(scope="module")
def caltech_plan():
    site = load_site("caltech")
    state = live.state_at(site, AT)
    return site, state, live.make_plan(site, state, "mpc")


def test_caltechs_profiles_are_ocpp_16_and_within_each_sockets_power(caltech_plan):
    """At the issue's hour on caltech: one TxProfile per connector with a car, Absolute from the state's time, in W, one
    period per step of the car's stay within the window (15 minutes at the shipped step), each limit between 0 and its
    socket's power; ocpp accepts every payload; the limits are the plan's EV power, and the first step's is what the env
    applies."""
    site, state, plan = caltech_plan
    assert state.evs and len(plan.charging_profiles) == len(state.evs)
    step_s = round(site.config.dt_h * 3600)  # the site's step: every period of a profile is one
    n = round(24 / site.config.dt_h)
    assert plan.horizon_h == 24 and len(plan.battery_kw) == n
    kw = site.split("test").socket_kw
    dt = pd.Timedelta(seconds=step_s)
    for ev, entry in zip(state.evs, plan.charging_profiles):
        p = entry["payload"]
        _ocpp_accepts(p)
        prof = p["csChargingProfiles"]
        assert (prof["chargingProfilePurpose"], prof["chargingProfileKind"]) == ("TxProfile", "Absolute")
        sched = prof["chargingSchedule"]
        assert sched["chargingRateUnit"] == "W" and sched["startSchedule"] == "2021-08-23T15:00:00Z"
        stay = min(round((ev.departure - state.time) / dt), n)
        periods = sched["chargingSchedulePeriod"]
        assert [q["startPeriod"] for q in periods] == [step_s * k for k in range(stay)]
        assert sched["duration"] == step_s * stay
        limits = np.array([q["limit"] for q in periods])
        assert entry["socket"] == ev.socket and entry["station_id"] == ev.station_id
        assert (np.copysign(1.0, limits) > 0).all() and (limits <= kw[ev.socket] * 1000).all()  # no -0.0 either
        np.testing.assert_allclose(limits, plan.ev_kw[ev.socket, :stay] * 1000, atol=0.051)
    assert abs(plan.battery_kw).max() <= site.config.bess.power_kw + 1e-9


def test_a_limit_above_the_socket_is_cut_and_a_bad_payload_is_refused():
    """The profile never asks more than the socket gives (a plan rounding up is cut to it), carries the transaction
    when known, and the validator refuses what OCPP 1.6J refuses (a limit finer than 0.1 W, a missing schedule)."""
    kw = np.array([6.60004, 1.23456, -1e-12])  # a solver's -0.0 or a hair below 0 is sent as 0.0
    p = live.charging_profile(pd.Timestamp(AT), 3, 2, kw, 6.6, 1.0, transaction_id=7)
    live.validate_profile(p)
    _ocpp_accepts(p)
    limits = [q["limit"] for q in p["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"]]
    assert limits == [6600.0, 1234.6, 0.0] and np.copysign(1.0, limits[2]) == 1.0
    assert p["connectorId"] == 2 and p["csChargingProfiles"]["transactionId"] == 7
    bad = json.loads(json.dumps(p))
    bad["csChargingProfiles"]["chargingSchedule"]["chargingSchedulePeriod"][1]["limit"] = 1234.56
    with pytest.raises(ValueError, match="multiple of 0.1"):
        live.validate_profile(bad)
    del bad["csChargingProfiles"]["chargingSchedule"]
    with pytest.raises(ValueError, match="chargingSchedule"):
        live.validate_profile(bad)


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The 10-day synthetic site written to disk, and a state file rebuilt from it at 09:00 of the test split's
    ninth day (``--at ... --save-state``)."""
    folder = tmp_path_factory.mktemp("plan")
    site = _site(days=10)
    toml = write_site(site, folder)
    at = site.split("test").time[8 * 24 + 9].tz_convert(site.config.timezone).isoformat()
    state = folder / "state.json"
    assert live.main(["--site", str(toml), "--at", at, "--controller", "mpc", "--save-state", str(state)]) == 0
    return toml, at, state


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = live.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_state_file_plans_as_its_hour_does(written, capsys, tmp_path):
    """The state written by ``--save-state`` (the JSON of docs/live-state.schema.json and its history as Parquet)
    gives the plan ``--at`` gives at that hour: the file path and the rebuilt path are one."""
    toml, at, state = written
    doc = json.loads(state.read_text())
    assert doc["time"] == at and doc["series"] == "state_series.parquet" and doc["evs"]
    code, out, err = _cli(capsys, "--site", str(toml), "--at", at, "--controller", "mpc")
    assert code == 0, err
    code, again, err = _cli(capsys, "--site", str(toml), "--state", str(state), "--controller", "mpc")
    assert code == 0, err
    assert json.loads(again) == json.loads(out)
    assert json.loads(out)["charging_profiles"]


def test_the_state_schema_in_docs_is_the_one_the_command_reads():
    """docs/live-state.schema.json is :data:`pipeline.live.STATE_SCHEMA` written out."""
    assert json.loads((ROOT / "docs" / "live-state.schema.json").read_text()) == live.STATE_SCHEMA


def _edited(state, folder, **changes):
    """A copy of the state file with top-level fields changed (``evs__0__socket=...`` for a car's field)."""
    doc = json.loads(state.read_text())
    for key, value in changes.items():
        *path, last = key.split("__")
        d = doc
        for p in path:
            d = d[int(p)] if isinstance(d, list) else d[p]
        d[int(last) if isinstance(d, list) else last] = value
    for f in ("series", "sessions"):
        (folder / doc[f]).write_bytes((state.parent / doc[f]).read_bytes())
    path = folder / "state.json"
    path.write_text(json.dumps(doc))
    return path, doc


BAD_STATES = {
    "unknown station": ({"evs__0__socket": "CA-999"}, "evs[0].socket: unknown socket 'CA-999'"),
    "unknown socket index": ({"evs__0__socket": 6}, "evs[0].socket: unknown socket 6: the site has sockets 0..5"),
    "departure in the past": (
        {"evs__0__departure": "2019-05-19T07:00:00-07:00"},
        "evs[0].departure: 2019-05-19T07:00:00-07:00 is not after the state's time",
    ),
    "soc above 1": ({"soc": 1.5}, "soc: 1.5 is greater than the maximum of 1"),
    "soc below 0": ({"soc": -0.2}, "soc: -0.2 is less than the minimum of 0"),
    "stale forecast": (
        {"moer_forecast__issued_at": "2019-05-19T06:00:00-07:00"},
        "moer_forecast.issued_at: 2019-05-19T06:00:00-07:00 is 3 h before the state's time",
    ),
    "time without offset": ({"time": "2019-05-19T09:00:00"}, "time: '2019-05-19T09:00:00' has no UTC offset"),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_bad_state_gets_one_line_naming_the_field_and_writes_nothing(written, capsys, tmp_path, case):
    toml, at, state = written
    changes, message = BAD_STATES[case]
    path, doc = _edited(state, tmp_path, **changes)
    assert doc["time"] == "2019-05-19T09:00:00-07:00" or case == "time without offset"
    out_file = tmp_path / "plan.json"
    code, out, err = _cli(
        capsys, "--site", str(toml), "--state", str(path), "--controller", "mpc", "--out", str(out_file)
    )
    assert code == 1 and out == ""
    assert err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out_file.exists() and not list(tmp_path.glob(".plan.json*"))


def test_a_state_file_with_an_hourly_table_gets_one_line_naming_series(written, capsys, tmp_path):
    """A state file whose history table is under ``hourly`` is refused in one line that names the field ``series``,
    and nothing is written."""
    toml, at, state = written
    doc = json.loads(state.read_text())
    doc["hourly"] = doc.pop("series")
    for f in ("hourly", "sessions"):
        (tmp_path / doc[f]).write_bytes((state.parent / doc[f]).read_bytes())
    path, out_file = tmp_path / "state.json", tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    code, out, err = _cli(
        capsys, "--site", str(toml), "--state", str(path), "--controller", "mpc", "--out", str(out_file)
    )
    assert code == 1 and out == "" and not out_file.exists()
    assert err.startswith("error: hourly: not a field of a state file") and "the field series" in err, err
    assert len(err.strip().splitlines()) == 1


BAD_REQUESTS = {
    "--at outside the data": (["--at", "2020-03-02T08:00:00-08:00"], "--at: 2020-03-02T08:00:00-08:00 lies outside"),
    "--at between steps": (["--at", "2019-05-19T09:30:00-07:00"], "--at: 2019-05-19T09:30:00-07:00 is not on a step"),
    "--soc outside [0, 1]": (["--at", "2019-05-19T09:00:00-07:00", "--soc", "1.2"], "--soc: 1.2 is outside [0, 1]"),
    "not causal": (["--at", "2019-05-19T09:00:00-07:00", "--controller", "oracle"], "'oracle' cannot run at a site"),
    "an agent": (["--at", "2019-05-19T09:00:00-07:00", "--controller", "ppo"], "'ppo' is not supported"),
    "a baseline": (
        ["--at", "2019-05-19T09:00:00-07:00", "--controller", "rule_based"],
        "'rule_based' cannot run at a site: it is the battery's own self-consumption rule",
    ),
    "unknown controller": (["--at", "2019-05-19T09:00:00-07:00", "--controller", "mcp"], "did you mean 'mpc'"),
    "no results to answer from": (["--at", "2019-05-19T09:00:00-07:00"], "run `doit run pipeline` first, or pass"),
    "no tuning": (["--at", "2019-05-19T09:00:00-07:00", "--controller", "mpc_tuned"], "holds none: run `doit run"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_gets_one_line_and_writes_nothing(written, capsys, tmp_path, case):
    toml, at, state = written
    argv, message = BAD_REQUESTS[case]
    if "--controller" not in argv and case != "no results to answer from":
        argv = [*argv, "--controller", "mpc"]
    out_file = tmp_path / "plan.json"
    code, out, err = _cli(
        capsys, "--site", str(toml), *argv, "--out", str(out_file), "--output-dir", str(tmp_path / "outputs")
    )
    assert code == 1 and out == "" and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out_file.exists()


def test_the_default_controller_is_the_reports_answer(written, tmp_path, capsys):
    """Without --controller, the plan is the report's answer read from the study's results: the lowest-CO2 causal row
    on the test split that beats its untrained start on the train split (here mpc_rl_start: mpc_rl is lower on the
    test split but not on the train split; mpc_perfect and the oracle are lower still but not causal)."""
    toml, at, state = written
    rows = [
        ("uncontrolled", 300.0, 200.0),
        ("rule_based", 280.0, 180.0),
        ("mpc", 260.0, 170.0),
        ("mpc_rl_start", 250.0, 160.0),
        ("mpc_rl", 251.0, 150.0),
        ("mpc_perfect", 200.0, 120.0),
        ("oracle", 199.0, 119.0),
    ]
    table = pd.DataFrame(
        [
            {"controller": c, "split": sp, "co2_kg": co2, "ev_energy_delivered_kwh": 100.0}
            for c, train, test in rows
            for sp, co2 in (("train", train), ("test", test))
        ]
    )
    report = tmp_path / "outputs" / "synthetic" / "report"
    report.mkdir(parents=True)
    table.to_parquet(report / "co2_comparison.parquet")
    site = load_site(toml)
    assert live.answer(site, tmp_path / "outputs") == "mpc_rl_start"
    code, out, err = _cli(capsys, "--site", str(toml), "--at", at, "--output-dir", str(tmp_path / "outputs"))
    assert code == 0, err
    assert json.loads(out)["controller"] == "mpc_rl_start"


def test_evhub_plan_from_a_subprocess_at_caltechs_hour(tmp_path):
    """``evhub-plan --site caltech --at 2021-08-23T08:00:00-07:00 --out plan.json`` run as a process (here with
    --controller mpc: a fresh clone has no study results to read the answer from): exit 0, nothing on stdout, a plan
    whose profiles ocpp accepts; the console script is declared."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["evhub-plan"] == "pipeline.live:main"
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "pipeline.live", "--site", "caltech", "--at", AT, "--controller", "mpc"]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    plan = json.loads(out.read_text())
    assert plan["issued_at"] == AT and plan["controller"] == "mpc" and plan["horizon_h"] == 24
    assert len(plan["battery_kw"]) == round(24 / load_config("caltech")[0].dt_h) and plan["charging_profiles"]
    for entry in plan["charging_profiles"]:
        _ocpp_accepts(entry["payload"])
    naive = [
        sys.executable,
        "-m",
        "pipeline.live",
        "--site",
        "caltech",
        "--at",
        "2021-08-23T08:00:00",
        "--out",
        str(out),
    ]
    out.unlink()
    bad = subprocess.run(naive, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "error: --at: '2021-08-23T08:00:00' has no UTC offset: give one, e.g. 2021-08-23T08:00:00-07:00"
    )
    assert not out.exists()


def test_a_state_with_its_history_inline_and_cars_by_station_plans_the_same(written, capsys, tmp_path):
    """The history may be given inline (rows as JSON objects, times with their offsets) rather than as files, and a
    car by its station id (the socket its sessions go to), with the OCPP connector and transaction it has there."""
    toml, at, state = written
    doc = json.loads(state.read_text())
    code, out, err = _cli(capsys, "--site", str(toml), "--state", str(state), "--controller", "mpc")
    assert code == 0, err
    by_station = station_sockets(load_site(toml).config, load_site(toml).sessions.station_id)
    inline = dict(doc)
    for f in ("series", "sessions"):
        df = pd.read_parquet(state.parent / doc[f])
        for c in ("time", "arrival", "departure"):
            if c in df:
                df[c] = df[c].map(lambda x: x.isoformat())
        inline[f] = json.loads(df.to_json(orient="records"))
    ev = inline["evs"][0]
    station = next(st for st, i in by_station.items() if i == ev["socket"])
    inline["evs"] = [{**ev, "socket": station, "connector_id": 2, "transaction_id": 41}, *inline["evs"][1:]]
    path = tmp_path / "inline.json"
    path.write_text(json.dumps(inline))
    code, again, err = _cli(capsys, "--site", str(toml), "--state", str(path), "--controller", "mpc")
    assert code == 0, err
    a, b = json.loads(out), json.loads(again)
    assert a["battery_kw"] == b["battery_kw"]
    first = next(p for p in b["charging_profiles"] if p["socket"] == ev["socket"])
    assert first["station_id"] == station and first["payload"]["connectorId"] == 2
    assert first["payload"]["csChargingProfiles"]["transactionId"] == 41
    assert [p["payload"]["csChargingProfiles"]["chargingSchedule"] for p in a["charging_profiles"]] == [
        p["payload"]["csChargingProfiles"]["chargingSchedule"] for p in b["charging_profiles"]
    ]


# ------------------------------------------------------------------------------------------------ 15-minute steps
def _caltech_toml(folder: Path, dt_h: float, test: tuple[str, str]) -> Path:
    """A copy of the shipped caltech TOML in ``folder``: its step ``dt_h``, its data the shipped folder's (an absolute
    path), its test split the local days ``test``."""
    toml = site_files("caltech")["config"]
    data = (toml.parent / "caltech").resolve()
    text = re.sub(r"(?m)^dt_h = .*$", f"dt_h = {dt_h}", toml.read_text())
    text = re.sub(r"(?m)^data_dir = .*$", f'data_dir = "{data.as_posix()}"', text)
    text = re.sub(r"(?m)^test = .*$", f'test = ["{test[0]}", "{test[1]}"]', text)
    out = folder / "caltech_15min.toml"
    out.write_text(text)
    return out


CALTECH_DAYS = ("2021-05-03", "2021-05-05")
"""The days of caltech's 15-minute copy (its test split): a Monday to a Wednesday of the shipped test split."""


@pytest.fixture(scope="module")
def caltech_15min(tmp_path_factory) -> Path:
    return _caltech_toml(tmp_path_factory.mktemp("caltech15"), 0.25, CALTECH_DAYS)


def _periods(plan: dict | live.LivePlan) -> list[tuple[list[int], int]]:
    """Each profile's ``startPeriod``s and ``duration``."""
    entries = plan["charging_profiles"] if isinstance(plan, dict) else plan.charging_profiles
    scheds = [e["payload"]["csChargingProfiles"]["chargingSchedule"] for e in entries]
    return [([q["startPeriod"] for q in s["chargingSchedulePeriod"]], s["duration"]) for s in scheds]


def test_evhub_plan_at_15_minutes_sends_a_period_every_900_s(caltech_15min, capsys, tmp_path):
    """caltech at ``dt_h = 0.25``: evhub-plan at a quarter hour plans the window at the site's step (96 steps of 24 h),
    each car's profile has one period per step of its stay within the window, 900 s apart, and ocpp accepts it; the
    state it saves holds the series at 15 minutes and plans the same."""
    at = "2021-05-04T10:45:00-07:00"
    state = tmp_path / "state.json"
    code, out, err = _cli(
        capsys, "--site", str(caltech_15min), "--at", at, "--controller", "mpc", "--save-state", str(state)
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["issued_at"] == at and plan["step_h"] == 0.25 and plan["horizon_h"] == 24
    assert len(plan["battery_kw"]) == 96 and plan["charging_profiles"]
    evs = {e["socket"]: e for e in json.loads(state.read_text())["evs"]}
    for entry, (starts, duration) in zip(plan["charging_profiles"], _periods(plan)):
        _ocpp_accepts(entry["payload"])
        stay = (pd.Timestamp(evs[entry["socket"]]["departure"]) - pd.Timestamp(at)) / pd.Timedelta(minutes=15)
        n = min(int(stay), 96)
        assert starts == [900 * k for k in range(n)] and duration == 900 * n
    series = pd.read_parquet(tmp_path / "state_series.parquet")
    assert set(np.diff(series.time.to_numpy()).astype("timedelta64[m]").astype(int)) == {15}
    code, again, err = _cli(capsys, "--site", str(caltech_15min), "--state", str(state), "--controller", "mpc")
    assert code == 0, err
    assert json.loads(again) == plan


def _study_actions(site: Site, split: str = "test") -> tuple[np.ndarray, pd.DataFrame, MPCController]:
    """``mpc``'s run over ``split`` as the study builds it (:func:`pipeline.control.mpc.run_mpc`), its action at each
    step recorded: ``(actions (T, 1 + N), traces, controller)``."""
    mpc = MPCController(site.split(split), PlannerParams.of_site(site.config))
    actions = []

    def policy(obs, env):
        a = mpc(obs, env)
        actions.append(a[0].numpy().copy())
        return a

    traces, _ = rollout_traces(policy, site, split, "socket", bess_action="setpoint")
    return np.array(actions), traces, mpc


def _assert_replays_exactly(site: Site) -> list[live.LivePlan]:
    """The live path (each call given the last plan) over the whole test split takes the study's ``mpc`` actions at
    every step, plans where the study's controller plans and holds its plan between, and emits the study row's CO2 to
    1e-9 kg, step by step and in all."""
    actions, traces, mpc = _study_actions(site)
    _, study = registry.get("mpc").simulate(site, "test")
    np.testing.assert_array_equal(study.co2_kg.to_numpy(), traces.co2_kg.to_numpy())
    co2_steps: list[float] = []
    co2, unserved, plans = _replay(site, "test", "mpc", co2_steps=co2_steps)
    np.testing.assert_allclose(np.array([p.action for p in plans]), actions, rtol=0, atol=1e-12)
    np.testing.assert_allclose(co2_steps, study.co2_kg.to_numpy(), rtol=0, atol=1e-9)
    assert abs(co2 - study.co2_kg.sum()) < 1e-9 and abs(unserved - study.unserved_kwh.sum()) < 1e-9
    new = [p for p in plans if p.holds is None]
    assert len(new) == mpc.solves < len(plans)
    hour = timestep.steps_per_hour(site.config.dt_h)
    assert all(p.holds is None for p in plans[::hour])  # a plan at each hour's start
    for p in plans:
        assert all(starts == [900 * k for k in range(len(starts))] for starts, _ in _periods(p))
        if p.holds is not None:
            assert p.charging_profiles is p.holds.charging_profiles and p.holds.holds is None
    print(f"\n{site.config.name} at 15 minutes, {len(plans)} steps: {len(new)} plans, CO2 {co2:.6f} kg")
    return plans


def test_the_live_path_reproduces_mpc_at_15_minutes(caltech_15min):
    """caltech at ``dt_h = 0.25`` over three days: the live path stepped through make_plan, each call given the last
    plan, takes the study's ``mpc`` actions at every step (a plan at each hour's start and when a car comes, the last
    plan held between, as :meth:`pipeline.control.mpc.MPCController.act` holds it) and emits its CO2 to 1e-9 kg."""
    _assert_replays_exactly(load_site(caltech_15min))


@pytest.mark.slow
def test_the_live_path_reproduces_mpcs_report_row_at_15_minutes():
    """The synthetic site of the hourly replay at ``dt_h = 0.25``, its whole 10-day test split: past the MOER
    regression's warm-up (refit day after day on the split's hours), the live path still takes the study's actions
    at every step and emits its row's CO2 to 1e-9 kg."""
    site = _site(days=10, dt_h=0.25)
    plans = _assert_replays_exactly(site)
    assert {len(p.battery_kw) for p in plans[: -4 * 6] if p.holds is None} == {24}
