"""The scenario MPC (pipeline/control/scenario.py): ``mpc``'s LP when given ``mpc``'s one future, one first step for
every scenario, causal, its scenarios drawn from what was realised before the hour, consistent with the env."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import changed_future, make_site

from envs.kpis import balance_residual, evaluate_policy
from envs.site import Site
from pipeline.control import registry, scenario
from pipeline.control.forecast import REGRESSION_WARMUP_DAYS
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.oracle import solve_oracle
from pipeline.control.scenario import ScenarioMPC


class _OneMean(ScenarioMPC):
    """One scenario: ``mpc``'s expected demand (:meth:`MPCController.sessions`), on the point MOER outlook."""

    def scenario_sessions(self, t, H, need, steps_left):
        return [self.sessions(t, H, need, steps_left)]


def _run(site: Site, split: str, ctrl):
    kpi, traces = evaluate_policy(ctrl, site, split, "x", action_mode="socket", bess_action="setpoint")
    return kpi, traces


@pytest.mark.parametrize(
    "overrides",
    [{}, {"grid": {"export_allowed": True, "export_credit": "moer"}, "pv": {"kwp": 25.0}}],
    ids=["default", "export_credit"],
)
def test_one_scenario_of_the_expected_demand_is_mpcs_lp(overrides):
    """With one scenario equal to ``mpc``'s expected demand and its MOER outlook, every plan is ``mpc``'s."""
    site = make_site(days=9, n_sockets=4, **overrides)
    data = site.split("train")
    params = dataclasses.replace(PlannerParams.of_site(data.config), horizon_h=12)
    a = MPCController(data, params, presolve=False, keep_plans=True)
    b = _OneMean(data, params, presolve=False, keep_plans=True, n_scenarios=1)
    ka, _ = _run(site, "train", a)
    kb, _ = _run(site, "train", b)
    assert len(a.plans) == len(b.plans) == data.num_steps
    for pa, pb in zip(a.plans, b.plans):
        np.testing.assert_array_equal(pa.action, pb.action, err_msg=f"step {pa.t}")
        np.testing.assert_array_equal(pa.bess_kw_steps, pb.bess_kw_steps, err_msg=f"step {pa.t}")
        np.testing.assert_array_equal(pa.ev_kw_steps, pb.ev_kw_steps, err_msg=f"step {pa.t}")
        assert pa.co2_planned_kg == pb.co2_planned_kg
    assert float(ka.co2_kg.iloc[0]) == float(kb.co2_kg.iloc[0])


def test_the_first_step_is_shared_and_the_rest_is_each_scenarios_own():
    """In the stacked LP's optimum every scenario's step 0 (battery, grid, curtailment, each plugged EV) is the same,
    while later steps differ; without the non-anticipativity rows the scenarios' step 0 would differ."""
    site = make_site(days=10, n_sockets=4)
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=4)
    t, H = 8 * 24 + 7, m.H
    need = np.array([12.0, 0.0, 4.0, 20.0])
    left = np.array([6, 0, 2, 9], dtype=np.int64)
    cap, floor = m._step0_env_bounds(need, left)
    moer = m.moer_outlook(t, H)
    blocks = [m._window_lp(t, H, moer, 10.0, s, cap, floor) for s in m.scenario_sessions(t, H, need, left)]
    assert len({len(w["lp"]["c"]) for w in blocks}) > 1  # the scenarios' arrivals differ
    prob = m.probabilities()
    stacked = m.stack(blocks, prob)
    z = m._solve(stacked["c"], stacked["A_eq"], stacked["b_eq"], stacked["bounds"], t)

    def step0(zz, w):
        off = w["lp"]["off"]
        return np.r_[[zz[off[n]] for n in ("ch", "dis", "g", "u", "x")], zz[w["col0"]]]

    parts = [z[o : o + len(w["lp"]["c"])] for w, o in zip(blocks, stacked["starts"])]
    first = [step0(zz, w) for zz, w in zip(parts, blocks)]
    for f in first[1:]:
        np.testing.assert_allclose(f, first[0], atol=1e-7)
    later = [zz[w["lp"]["off"]["ch"] + 1 : w["lp"]["off"]["ch"] + H] for zz, w in zip(parts, blocks)]
    assert any(not np.allclose(x, later[0], atol=1e-6) for x in later[1:])
    # each scenario alone plans another first step: the shared one is a compromise
    alone = [step0(m._solve(w["lp"]["c"], w["lp"]["A_eq"], w["lp"]["b_eq"], w["lp"]["bounds"], t), w) for w in blocks]
    assert any(not np.allclose(x, alone[0], atol=1e-6) for x in alone[1:])
    np.testing.assert_allclose(prob, np.full(4, 0.25))
    m2 = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3, recency_half_life=1.0)
    np.testing.assert_allclose(m2.probabilities(), np.array([4, 2, 1]) / 7)


def test_scenarios_are_the_last_past_days_of_the_same_type_realised_before_the_hour():
    """Scenario k at window step j is the k-th most recent past day of the step's day type whose same hour lies at or
    before t, and its arrivals are the sessions realised at that hour, unscaled."""
    site = make_site(days=14, n_sockets=4)
    data = site.split("train")
    K, day = 5, 24
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=K)
    weekend = np.asarray(data.time.tz_convert(site.config.timezone).day_of_week >= 5)
    need, left = np.array([3.0, 0, 0, 0]), np.array([4, 0, 0, 0], dtype=np.int64)
    for t in (2 * day + 3, 9 * day + 17, 13 * day + 1):
        H = min(m.H, data.num_steps - t)
        days = m.scenario_days(t, H)
        sessions = m.scenario_sessions(t, H, need, left)
        for k in range(1, H):
            u = t + k
            want = [j for j in range(1, u // day + 1) if u - j * day <= t and weekend[u - j * day] == weekend[u]][:K]
            got = days[:, k]
            if not want:  # no past day of its type yet: no arrivals there
                assert (got == 0).all()
                continue
            assert all(u - j * day <= t for j in got)  # realised by t
            if len(want) >= K:
                assert list(got) == want
            else:  # a split's first days: the days there are, in turn
                assert set(got) == set(want) and list(got[: len(want)]) == want
        for s, (arr, end, e, sock, w) in enumerate(sessions):
            assert arr[0] == 0 and sock[0] == 0 and e[0] == 3.0 and end[0] == 4  # the plugged EV first
            new = sock < 0
            assert (w == 1.0).all() and (arr[new] >= 1).all()
            src = t + arr[new] - days[s, arr[new]] * day
            i = -1 - sock[new]
            np.testing.assert_array_equal(e[new], data.arrival_need_kwh[src, i])
            np.testing.assert_array_equal(end[new] - arr[new], data.arrival_stay_steps[src, i])
            ks = np.flatnonzero(days[s] > 0)
            assert len(e[new]) == int((data.arrival_stay_steps[t + ks - days[s, ks] * day] > 0).sum())


def test_moer_scenarios_are_the_forecasts_past_errors():
    """With MOER scenarios, scenario k's MOER is the outlook plus the error the outlook issued k + 1 days earlier made
    at each lead (realised MOER minus that outlook), for leads realised before the hour; the outlook beyond."""
    site = make_site(days=10, n_sockets=4)
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3, moer_scenarios=True, keep_plans=True)
    t, H = 8 * 24 + 5, 24
    b = site.config.bess
    for u in range(t):  # the outlooks issued before t (from a plain state: what is issued depends on u alone)
        m.plan(u, b.soc_min * b.capacity_kwh, np.zeros(4), np.zeros(4, dtype=np.int64))
    outlook = m.moer_outlook(t, H)
    got = m.scenario_moer(t, H, outlook)
    for k in range(3):
        u = t - (k + 1) * 24
        issued = m._issued[u]
        want = np.maximum(outlook + data.moer[u : u + H] - issued, 0.0)
        np.testing.assert_allclose(got[k], want)
    assert not np.allclose(got[0], outlook)
    off = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3)
    np.testing.assert_array_equal(off.scenario_moer(t, H, outlook), np.tile(outlook, (3, 1)))


def test_never_reads_data_after_the_hour():
    """Changing the MOER and the sessions from step ``last + 1`` on leaves every action up to ``last`` unchanged (MOER
    scenarios on), and the change matters afterwards."""
    site = make_site(days=10, n_sockets=4)
    last = (REGRESSION_WARMUP_DAYS + 1) * 24 + 5
    runs = []
    for s in (site, changed_future(site, "train", last + 1)):
        data = s.split("train")
        params = dataclasses.replace(scenario.base_params(data.config), horizon_h=12)
        m = ScenarioMPC(data, params, n_scenarios=3, recency_half_life=2.0, moer_scenarios=True, keep_plans=True)
        _run(s, "train", m)
        runs.append(m.plans)
    a, b = runs
    for pa, pb in zip(a[: last + 1], b[: last + 1]):
        np.testing.assert_array_equal(pa.action, pb.action, err_msg=f"step {pa.t}")
    assert any(not np.array_equal(pa.action, pb.action) for pa, pb in zip(a[last + 1 :], b[last + 1 :]))


def test_first_step_is_what_the_env_does_serving_every_car_above_the_oracle():
    site = make_site(days=8, n_sockets=4, grid={"import_limit_kw": 9.0}, bess={"power_kw": 5.0})
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=5, keep_plans=True)
    kpi, traces = _run(site, "train", m)
    planned = {
        "grid_import_kw": [p.grid_import_kw for p in m.plans],
        "pv_curtailed_kw": [p.pv_curtailed_kw for p in m.plans],
        "bess_charge_kw": [p.bess_charge_kw for p in m.plans],
        "bess_discharge_kw": [p.bess_discharge_kw for p in m.plans],
        "ev_charge_kw": [p.ev_kw.sum() for p in m.plans],
    }
    for col, v in planned.items():
        np.testing.assert_allclose(traces[col].to_numpy(), v, atol=1e-5, err_msg=col)
    assert balance_residual(traces).max() < 1e-4
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-6
    assert float(solve_oracle(site, "train")[0].co2_kg.iloc[0]) <= float(kpi.co2_kg.iloc[0]) + 1e-6
    assert m.lp_shape[0] > 0 and m.solves == data.num_steps


def test_registry_row_and_runner(capsys):
    c = registry.get("mpc_scenario")
    assert c.causal and c.runner is scenario.simulate and not c.tuned and not c.seeded
    assert "mpc_scenario" in registry.simulated(make_site(days=15).config, tuned=False)
    assert "mpc_scenario" not in registry.simulated(make_site(days=4).config)  # too short to draw past days from
    site = make_site(days=4, n_sockets=4, mpc={"horizon_h": 6})
    kpi, traces = scenario.simulate(site, "test", n_scenarios=2)
    assert kpi.controller.iloc[0] == "mpc_scenario" and len(traces) == site.split("test").num_steps
    assert "mpc_scenario test: K 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="n_scenarios"):
        ScenarioMPC(site.split("test"), n_scenarios=0)
