"""The scenario MPC (pipeline/control/scenario.py): ``mpc``'s LP when given ``mpc``'s one future, one first step for
every scenario, causal, its scenarios drawn from what was realised before the hour, consistent with the env."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import changed_future, make_site

from envs.kpis import balance_residual, evaluate_policy
from envs.site import Site, load_site
from pipeline.control import registry, scenario
from pipeline.control.forecast import REGRESSION_WARMUP_DAYS
from pipeline.control.mpc import STEP_KINDS, KeyKind, MPCController, PlannerParams, WindowSessions, lp_key, plugged_evs
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
    """With one scenario equal to ``mpc``'s expected demand and its MOER outlook, every plan is ``mpc``'s (both
    solved from a cold start, so HiGHS takes the same path to the same vertex)."""
    site = make_site(days=9, n_sockets=4, **overrides)
    data = site.split("train")
    params = dataclasses.replace(PlannerParams.of_site(data.config), horizon_h=12)
    a = MPCController(data, params, presolve=False, keep_plans=True)
    b = _OneMean(data, params, presolve=False, keep_plans=True, n_scenarios=1, warm_start=False)
    ka, _ = _run(site, "train", a)
    kb, _ = _run(site, "train", b)
    assert len(a.plans) == len(b.plans) == data.num_steps
    for pa, pb in zip(a.plans, b.plans):
        np.testing.assert_array_equal(pa.action, pb.action, err_msg=f"step {pa.t}")
        np.testing.assert_array_equal(pa.bess_kw_steps, pb.bess_kw_steps, err_msg=f"step {pa.t}")
        np.testing.assert_array_equal(pa.ev_kw_steps, pb.ev_kw_steps, err_msg=f"step {pa.t}")
        assert pa.co2_planned_kg == pb.co2_planned_kg
    assert float(ka.co2_kg.iloc[0]) == float(kb.co2_kg.iloc[0])


def test_a_warm_start_reaches_each_hours_optimum_in_fewer_iterations(monkeypatch):
    """The basis carried from hour to hour (``warm_start``) changes how HiGHS gets to each LP's optimum, not the
    optimum: every hour's warm-started objective equals a cold solve of the same LP, and the split takes fewer simplex
    iterations in all."""
    site = make_site(days=9, n_sockets=4)
    data = site.split("train")
    iterations = {True: 0, False: 0}
    solve = MPCController.solve

    def checked(self, c, A_eq, b_eq, bounds, t, strict=True, keys=None):
        z = solve(self, c, A_eq, b_eq, bounds, t, strict, keys)
        iterations[self.warm_start] += self.solver.highs.getInfo().simplex_iteration_count
        if keys is not None and self.warm_start:
            cold = solve(self, c, A_eq, b_eq, bounds, t, strict)
            assert float(c @ z) == pytest.approx(float(c @ cold), rel=1e-9, abs=1e-9), f"step {t}"
        return z

    monkeypatch.setattr(MPCController, "solve", checked)
    runs = {}
    for warm in (False, True):
        m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=5, warm_start=warm)
        runs[warm], _ = _run(site, "train", m)
    assert iterations[True] < 0.7 * iterations[False]
    # the runs themselves may part where an hour's LP has several optimal vertices (another first step at the same
    # planned cost), so only what every run must do is checked
    for kpi in runs.values():
        assert float(kpi.unserved_kwh.iloc[0]) < 1e-6


def test_the_basis_kept_for_the_next_hour_is_the_one_highs_reports(monkeypatch):
    """``warm_start`` keeps each solve's basis as statuses read off the solution (``highs.basis_status``); they are
    exactly the statuses ``Highs.getBasis`` reports, column by column and row by row, in every hour of a split."""
    site = make_site(days=9, n_sockets=4, grid={"export_allowed": True, "export_credit": "moer"}, pv={"kwp": 25.0})
    data = site.split("train")
    solve, checked = MPCController.solve, []

    def compare(self, c, A_eq, b_eq, bounds, t, strict=True, keys=None):
        z = solve(self, c, A_eq, b_eq, bounds, t, strict, keys)
        if keys is not None:
            basis, kept = self.solver.highs.getBasis(), self.solver.basis
            np.testing.assert_array_equal(kept.col_status, [int(s) for s in basis.col_status], err_msg=f"step {t}")
            np.testing.assert_array_equal(kept.row_status, [int(s) for s in basis.row_status], err_msg=f"step {t}")
            checked.append(t)
        return z

    monkeypatch.setattr(MPCController, "solve", compare)
    _run(site, "train", ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=5))
    assert len(checked) == data.num_steps
    # six hours of the shipped site (15-minute steps: its plans at the hours and on arrivals), whose LPs hold fixed
    # columns at a zero dual (which HiGHS reports at their lower bound)
    r = scenario.run_window(load_site("caltech"), "train", 20000, 24)
    assert r.solves >= 6 and len(checked) == data.num_steps + r.solves


def test_appended_rows_are_scipys_stacked_csc_bit_for_bit():
    """``two_stage`` appends its non-anticipativity rows to the assembled CSC directly; the arrays are those of
    ``scipy.sparse.vstack`` then ``tocsc`` (so HiGHS gets the same LP as before the shortcut)."""
    rng = np.random.default_rng(3)
    for m, n, n_new in ((7, 11, 4), (30, 50, 12), (1, 3, 1)):
        A = sp.random(m, n, density=0.3, format="csc", random_state=rng)
        pairs = rng.choice(n_new * n, size=min(2 * n_new, n_new * n), replace=False)
        rows, cols = pairs // n, pairs % n
        vals = rng.normal(size=len(rows))
        got = scenario._append_rows(A, rows, cols, vals, n_new)
        want = sp.vstack([A, sp.csr_matrix((vals, (rows, cols)), shape=(n_new, n))], format="csr").tocsc()
        for name in ("indptr", "indices", "data"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert got.shape == want.shape


def test_the_scenarios_lp_is_their_window_lps_stacked():
    """The ``K`` scenarios' window LP built in one go equals each scenario's LP built alone (``mpc``'s window LP) and
    stacked block-diagonally: the same columns, rows, costs and bounds, bit for bit."""
    site = make_site(days=10, n_sockets=4, grid={"export_allowed": True, "export_credit": "moer"}, pv={"kwp": 25.0})
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=5)
    need = np.array([12.0, 0.0, 4.0, 20.0])
    left = np.array([6, 0, 2, 9], dtype=np.int64)
    bounds = m.step0_bounds(need, left)
    rng = np.random.default_rng(0)
    for t in (8 * 24 + 7, 9 * 24 + 20):
        H = min(m.H, data.num_steps - t)
        sessions = m.scenario_sessions(t, H, need, left)
        moers = m.moer_outlook(t, H) * rng.uniform(0.5, 1.5, (5, H))  # each scenario its own MOER
        merged = WindowSessions.concat(sessions, blocks=True)
        np.testing.assert_array_equal(merged.block, np.repeat(np.arange(5), [len(x) for x in sessions]))
        lp = m.window_lp(t, H, moers, 30.0, merged, bounds).lp
        alone = [m.window_lp(t, H, moers[k], 30.0, x, bounds).lp for k, x in enumerate(sessions)]
        A, B = lp.A_eq.tocsc(), sp.block_diag([a.A_eq for a in alone], format="csc")
        for x, y in ((A.indptr, B.indptr), (A.indices, B.indices), (A.data, B.data)):
            np.testing.assert_array_equal(x, y)
        for name in ("c", "b_eq", "bounds"):
            np.testing.assert_array_equal(getattr(lp, name), np.concatenate([getattr(a, name) for a in alone]))
        assert lp.K == 5 and lp.off.defer is not None and lp.nonanticipativity_rows == 0


def test_plans_within_the_hour_are_mpcs_deterministic_plans_and_hour_plans_stay_two_stage():
    """At 15-minute steps a plan made within the hour (on an arrival) is ``mpc``'s deterministic plan of the same
    planner parameters from the same state, bit for bit (both HiGHS cold on their first solve); a plan at the hour's
    start is the two-stage one, as every plan is with ``deterministic_within_hour=False``."""
    site = make_site(days=10, n_sockets=4, dt_h=0.25)
    data = site.split("train")
    params = scenario.base_params(data.config)
    need = np.array([6.0, 0.0, 2.0, 9.0])
    left = np.array([16, 0, 8, 30], dtype=np.int64)
    hour = 8 * 96 + 4 * 7
    within = hour + 2

    def made(t, **kw):
        m = ScenarioMPC(data, params, n_scenarios=4, presolve=False, **kw)
        return m.plan(t, 10.0, need, left), m.lp_shape

    det = MPCController(data, params, presolve=False).plan(within, 10.0, need, left)
    p, one_block = made(within)
    for name in ("action", "bess_kw_steps", "ev_kw_steps"):
        np.testing.assert_array_equal(getattr(p, name), getattr(det, name), err_msg=name)
    assert p.co2_planned_kg == det.co2_planned_kg
    assert made(within, deterministic_within_hour=False)[1] != one_block  # the two-stage LP of four scenarios
    (h, shape), (h2, shape2) = made(hour), made(hour, deterministic_within_hour=False)
    assert shape == shape2 and shape[0] > 2 * one_block[0]  # four blocks and the rows that tie their step 0
    for name in ("action", "bess_kw_steps", "ev_kw_steps"):
        np.testing.assert_array_equal(getattr(h, name), getattr(h2, name), err_msg=name)


def test_the_first_step_is_shared_and_the_rest_is_each_scenarios_own():
    """In the stacked LP's optimum every scenario's step 0 (battery, grid, curtailment, each plugged EV) is the same,
    while later steps differ; without the non-anticipativity rows the scenarios' step 0 would differ."""
    site = make_site(days=10, n_sockets=4)
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=4)
    t, H = 8 * 24 + 7, m.H
    need = np.array([12.0, 0.0, 4.0, 20.0])
    left = np.array([6, 0, 2, 9], dtype=np.int64)
    bounds = m.step0_bounds(need, left)
    moer = m.moer_outlook(t, H)
    sessions = m.scenario_sessions(t, H, need, left)
    assert len({len(x) for x in sessions}) > 1  # the scenarios' arrivals differ
    w = m.window_lp(t, H, np.tile(moer, (4, 1)), 10.0, WindowSessions.concat(sessions, blocks=True), bounds)
    prob = m.probabilities()
    lp = m.two_stage(w, prob)
    assert lp.nonanticipativity_rows == (5 + len(w.blocks[0].col0)) * 3 == len(lp.b_eq) - len(w.lp.b_eq)
    z = m.solve(lp.c, lp.A_eq, lp.b_eq, lp.bounds, t)

    def step0(zz, v):
        return np.r_[[zz[v.off.ch], zz[v.off.dis], zz[v.off.g], zz[v.off.u], zz[v.off.x]], zz[v.col0]]

    first = [step0(z, v) for v in w.blocks]
    for f in first[1:]:
        np.testing.assert_allclose(f, first[0], atol=1e-7)
    later = [z[v.off.ch + 1 : v.off.ch + H] for v in w.blocks]
    assert any(not np.allclose(x, later[0], atol=1e-6) for x in later[1:])
    # each scenario alone plans another first step: the shared one is a compromise
    alone = []
    for x in sessions:
        one = m.window_lp(t, H, moer, 10.0, x, bounds)
        o = one.lp
        alone.append(step0(m.solve(o.c, o.A_eq, o.b_eq, o.bounds, t), one.blocks[0]))
    assert any(not np.allclose(x, alone[0], atol=1e-6) for x in alone[1:])
    np.testing.assert_allclose(prob, np.full(4, 0.25))
    # with the battery's first 3 steps shared: its charge and discharge there are one schedule for every scenario
    lp3 = m.two_stage(w, prob, 3)
    assert lp3.nonanticipativity_rows == lp.nonanticipativity_rows + 2 * 2 * 3
    z3 = m.solve(lp3.c, lp3.A_eq, lp3.b_eq, lp3.bounds, t)
    bess = [np.r_[z3[v.off.ch : v.off.ch + 3], z3[v.off.dis : v.off.dis + 3]] for v in w.blocks]
    for b in bess[1:]:
        np.testing.assert_allclose(b, bess[0], atol=1e-7)
    assert lp3.c @ z3 >= lp.c @ z - 1e-6  # a constrained plan never expects less CO2
    with pytest.raises(ValueError, match="shared_bess_steps"):
        ScenarioMPC(data, scenario.base_params(data.config), shared_bess_steps=0)
    m2 = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3, recency_half_life=1.0)
    np.testing.assert_allclose(m2.probabilities(), np.array([4, 2, 1]) / 7)


def test_warm_start_keys_name_what_each_column_and_row_stands_for():
    """The two-stage LP's keys (:func:`lp_key`: kind, block, a, b from the highest bits) name each column's and row's
    :class:`KeyKind` and block as the LP's layout places them, the step of a per-step one, and number the
    non-anticipativity rows after the blocks' rows."""
    assert lp_key(KeyKind.DEFER, 3, 5, 7) == (9 << 59) | (3 << 50) | (5 << 30) | 7
    site = make_site(days=10, n_sockets=4)
    data = site.split("train")
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3)
    t = 8 * 24 + 7
    need, left = np.array([12.0, 0.0, 4.0, 20.0]), np.array([6, 0, 2, 9], dtype=np.int64)
    np.testing.assert_array_equal(plugged_evs(need, left), [0, 2, 3])
    H = min(m.H, data.num_steps - t)
    moers, sessions = m.window_futures(t, H, m.moer_outlook(t, H), need, left)
    w = m.window_lp(t, H, moers, 10.0, sessions, m.step0_bounds(need, left))
    lp = m.decision_lp(w)
    cols, rows = m.lp_keys(t, lp, sessions)
    block = sessions.block
    kind, blk, b = cols >> 59, cols >> 50 & 511, cols & ((1 << 30) - 1)
    np.testing.assert_array_equal(blk, lp.col_block)
    for k, first in zip(STEP_KINDS, lp.off.per_step()):
        c = (first[:, None] + np.arange(H)).ravel()
        assert (kind[c] == k).all() and (b[c] == np.tile(t + np.arange(H), 3)).all()
    plugged = ~sessions.expected[lp.p_sess]
    assert (kind[lp.p_col[plugged]] == KeyKind.PLUGGED_EV).all()
    assert (kind[lp.p_col[~plugged]] == KeyKind.ARRIVING_EV).all() and (~plugged).any()
    assert (kind[lp.off.slack[block] + lp.s_local] == KeyKind.SLACK).all()
    assert (kind[lp.off.defer[block] + lp.s_local] == KeyKind.DEFER).all()
    n = lp.nonanticipativity_rows
    assert n == (5 + 3) * 2
    np.testing.assert_array_equal(rows[-n:], lp_key(KeyKind.NONANTICIPATIVITY, 0, 0, np.arange(n)))
    assert set((rows[:-n] >> 59).tolist()) == {KeyKind.BALANCE, KeyKind.STORAGE, KeyKind.EV_ENERGY}


def test_scenario_days_are_the_days_mpcs_expected_demand_by_day_type_reads():
    """One selector (:meth:`MPCController.past_days`) chooses both: with ``K`` scenarios and ``K`` days of expected
    demand by day type, each window step's scenarios are the days the expected demand reads there."""
    site = make_site(days=14, n_sockets=4)
    data = site.split("train")
    K = 4
    params = dataclasses.replace(
        scenario.base_params(data.config), expected_demand_days=K, expected_demand_weight=1.0, demand_day_type=True
    )
    m = ScenarioMPC(data, params, n_scenarios=K)
    for t in (3 * 24 + 5, 12 * 24 + 20):
        H = min(m.H, data.num_steps - t)
        used: dict[int, list[int]] = {}
        for shift, (_, ks) in m._same_day_type_sources(t, H):
            for k in ks:
                used.setdefault(int(k), []).append((t - shift) // 24)
        days = m.scenario_days(t, H)
        for k in range(1, H):
            js = used.get(k, [])
            assert list(days[: len(js), k]) == js and (len(js) > 0 or (days[:, k] == 0).all())


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
        for s, x in enumerate(sessions):
            arr, end, e, sock, new = x.arrival, x.departure, x.energy_kwh, x.socket, x.expected
            assert arr[0] == 0 and sock[0] == 0 and e[0] == 3.0 and end[0] == 4 and not new[0]  # the plugged EV first
            assert (x.weight == 1.0).all() and (arr[new] >= 1).all()
            src = t + arr[new] - days[s, arr[new]] * day
            i = sock[new]
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


def test_moer_revisions_are_the_outlooks_past_hourly_revisions_centred():
    """With ``moer_revisions = s``, scenario k's MOER at leads from 1 is the outlook plus ``s`` times the revision
    the outlook issued k + 1 days earlier underwent an hour later, less those revisions' mean over the scenarios
    (clipped at 0); lead 0 and the scenarios' mean are the outlook's (no clipping here); revisions together with
    the past errors are refused."""
    site = make_site(days=10, n_sockets=4)
    data = site.split("train")
    t, H, s = 8 * 24 + 5, 24, 0.7
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=3, moer_revisions=s)
    b = site.config.bess
    for u in range(t):  # the outlooks issued before t (what is issued depends on u alone)
        m.plan(u, b.soc_min * b.capacity_kwh, np.zeros(4), np.zeros(4, dtype=np.int64))
    outlook = m.moer_outlook(t, H)
    got = m.scenario_moer(t, H, outlook)
    rev = np.stack([m._issued[t - (k + 1) * 24 + 1][: H - 1] - m._issued[t - (k + 1) * 24][1:] for k in range(3)])
    want = np.maximum(outlook[1:] + s * (rev - rev.mean(0)), 0.0)
    np.testing.assert_allclose(got[:, 1:], want, rtol=1e-12)
    np.testing.assert_array_equal(got[:, 0], outlook[0])
    assert (want > 0).all() and np.abs(rev).max() > 1e-3
    np.testing.assert_allclose(got.mean(0), outlook, atol=1e-12)
    with pytest.raises(ValueError, match="moer_revisions"):
        ScenarioMPC(data, scenario.base_params(data.config), moer_revisions=1.0, moer_scenarios=True)


@pytest.mark.parametrize(
    "today_bandwidth, near, shared, revisions",
    [(0.0, 1.0, 1, 0.0), (1.0, 1.0, 1, 0.0), (0.0, 1.6, 1, 0.0), (0.0, 1.0, 3, 0.0), (0.0, 1.0, 1, 1.0)],
    ids=["equal_weights", "weights_by_today", "near", "shared_battery", "moer_revisions"],
)
def test_never_reads_data_after_the_hour(today_bandwidth, near, shared, revisions):
    """Changing the MOER and the sessions from step ``last + 1`` on leaves every action up to ``last`` unchanged (MOER
    scenarios on, or the outlook's revisions in their place; with the weights by today, the outlook's contrast at
    leads 1-5 h, or the battery's first hours shared, too), and the change matters afterwards."""
    site = make_site(days=10, n_sockets=4)
    last = (REGRESSION_WARMUP_DAYS + 1) * 24 + 5
    runs = []
    for s in (site, changed_future(site, "train", last + 1)):
        data = s.split("train")
        params = dataclasses.replace(
            scenario.base_params(data.config),
            horizon_h=12,
            moer_near_contrast_1_2h=near,
            moer_near_contrast_3_5h=1.0 / near,
        )
        m = ScenarioMPC(
            data,
            params,
            n_scenarios=3,
            recency_half_life=2.0,
            moer_scenarios=revisions == 0,
            moer_revisions=revisions,
            today_bandwidth=today_bandwidth,
            shared_bess_steps=shared,
            keep_plans=True,
        )
        _run(s, "train", m)
        runs.append(m.plans)
    a, b = runs
    for pa, pb in zip(a[: last + 1], b[: last + 1]):
        np.testing.assert_array_equal(pa.action, pb.action, err_msg=f"step {pa.t}")
    assert any(not np.array_equal(pa.action, pb.action) for pa, pb in zip(a[last + 1 :], b[last + 1 :]))


def test_the_near_contrast_scales_leads_1_to_5_hours_about_the_current_hours_outlook():
    """Leads 1-2 h and 3-5 h of the MOER outlook are planned on as ``f_0 + a * (f_k - f_0)`` (clipped at 0), the
    others as forecast; contrasts of 1 give the forecast itself."""
    site = make_site(days=10, n_sockets=3)
    data = site.split("train")
    base = scenario.base_params(data.config)
    t, H = (REGRESSION_WARMUP_DAYS + 1) * 24 + 7, 24
    plain = ScenarioMPC(data, base, n_scenarios=2).moer_outlook(t, H)
    ones = dataclasses.replace(base, moer_near_contrast_1_2h=1.0, moer_near_contrast_3_5h=1.0)
    np.testing.assert_array_equal(ScenarioMPC(data, ones, n_scenarios=2).moer_outlook(t, H), plain)
    near = dataclasses.replace(base, moer_near_contrast_1_2h=1.8, moer_near_contrast_3_5h=0.5)
    got = ScenarioMPC(data, near, n_scenarios=2).moer_outlook(t, H)
    want = plain.copy()
    want[1:3] = np.maximum(plain[0] + 1.8 * (plain[1:3] - plain[0]), 0.0)
    want[3:6] = plain[0] + 0.5 * (plain[3:6] - plain[0])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert not np.allclose(got[1:6], plain[1:6]) and np.array_equal(got[[0, *range(6, H)]], plain[[0, *range(6, H)]])


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
    assert c.causal and c.run_function is scenario.simulate and not c.tuned and not c.seeded
    assert "mpc_scenario" in registry.simulated(make_site(days=15).config, tuned=False)
    assert "mpc_scenario" not in registry.simulated(make_site(days=4).config)  # too short to draw past days from
    site = make_site(days=4, n_sockets=4, mpc={"horizon_h": 6})
    kpi, traces = scenario.simulate(site, "test", n_scenarios=2)
    assert kpi.controller.iloc[0] == "mpc_scenario" and len(traces) == site.split("test").num_steps
    assert "mpc_scenario test: K 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="n_scenarios"):
        ScenarioMPC(site.split("test"), n_scenarios=0)


@pytest.mark.parametrize("flag", ["perfect", "perfect_moer", "perfect_arrivals"])
def test_a_scenario_planner_given_the_truth_is_refused(flag):
    """Its scenarios are its forecast: a ``perfect`` flag of the one-mean planner has no meaning here, and is refused
    rather than ignored."""
    data = make_site(days=3, n_sockets=2).split("train")
    with pytest.raises(ValueError, match="perfect"):
        ScenarioMPC(data, scenario.base_params(data.config), **{flag: True})


def test_session_model_scenarios_are_causal_and_seeded():
    """With ``scenario_source = "session_model"`` the scenarios are the session model's draws, after the plugged EVs:
    changing the data from step k + 1 on leaves the actions up to k unchanged, and a seed gives the same run twice."""
    site = make_site(days=12, n_sockets=4)
    k = 9 * 24 + 5

    def actions(s: Site, seed: int = 1) -> np.ndarray:
        data = s.split("train")
        m = ScenarioMPC(
            data,
            scenario.base_params(data.config),
            n_scenarios=3,
            scenario_source="session_model",
            seed=seed,
            keep_plans=True,
        )
        _run(s, "train", m)
        return np.array([p.action for p in m.plans])

    a = actions(site)
    np.testing.assert_array_equal(a, actions(site))
    b = actions(changed_future(site, "train", k + 1))
    np.testing.assert_array_equal(a[: k + 1], b[: k + 1])
    assert not np.array_equal(a, actions(site, seed=2))
    with pytest.raises(ValueError, match="scenario_source"):
        ScenarioMPC(site.split("train"), scenario.base_params(site.config), scenario_source="past_weeks")


def test_tuning_searches_the_scenario_planners_own_parameters_from_its_planner():
    """``scenario.tune`` runs CMA-ES over :data:`scenario.TUNED_SPACE` from ``mpc_scenario``'s planner, every candidate
    backtested by the scenario planner itself; the parameters outside that space stay the planner's, and the result
    costs no more than the start on the validation weeks."""
    site = make_site(days=21, n_sockets=3)
    seen = []

    def window(site_, split, start, steps, params):
        seen.append(PlannerParams.from_dict(params) if isinstance(params, dict) else params)
        return scenario.run_window(site_, split, start, steps, params, n_scenarios=2)

    from pipeline.control import tuning

    (res,) = scenario.tune(site, (1,), "tiny", evaluate=tuning.local_evaluator(site, "train", window))
    base = scenario.base_params(site.config)
    assert res.start == base and seen
    tuned = {p.name for p in scenario.TUNED_SPACE}
    for p in [*seen, res.params]:
        assert {k: v for k, v in p.as_dict().items() if k not in tuned} == {
            k: v for k, v in base.as_dict().items() if k not in tuned
        }
    assert len({tuple(p.as_dict()[k] for k in tuned) for p in seen}) > 2  # CMA-ES moved the tuned ones
    h = res.history
    valid = h[h.generation == h.generation.max()].reset_index(drop=True)  # the start and the last means
    best = valid.iloc[int(np.argmin(valid.cost_kg.to_numpy()))]
    assert PlannerParams.from_dict({k: best[k] for k in base.as_dict()}) == res.params
    assert best.cost_kg <= float(valid[valid.candidate == "start"].cost_kg.iloc[0])


def test_weights_by_today_are_a_kernel_of_todays_arrivals_and_sum_to_one():
    """With a bandwidth, each scenario's probability is proportional to ``exp(-d / (2 h^2))``, ``d`` the chi-square
    distance between the arrivals per socket group since the last local midnight up to the hour, today and on the
    scenario's day (counted here from the sessions table); they sum to one, and a day that looks like today weighs
    more than one that does not."""
    site = make_site(days=14, n_sockets=4)
    data = site.split("train")
    h, K = 1.5, 6
    m = ScenarioMPC(data, scenario.base_params(data.config), n_scenarios=K, today_bandwidth=h)
    arrived = data.sessions[~data.sessions.rejected]
    for t in (9 * 24 + 9, 12 * 24 + 11, 13 * 24 + 0):
        days = m.scenario_days(t, min(m.H, data.num_steps - t))
        m0 = data.last_midnight(t)

        def count(a, b):
            return float(((arrived.arrival_step >= max(a, 0)) & (arrived.arrival_step <= b)).sum())

        x = count(m0, t)
        d = np.array([(x - (y := count(m0 - j * 24, t - j * 24))) ** 2 / (x + y + 1.0) for j in days[:, 1]])
        np.testing.assert_allclose(m.today_distance(t, days), d)
        p = m.probabilities(t)
        want = np.exp(-d / (2 * h * h))
        np.testing.assert_allclose(p, want / want.sum())
        assert abs(p.sum() - 1.0) < 1e-12 and (p > 0).all()
        if d.max() > d.min():
            assert p[d.argmin()] > p[d.argmax()]


def test_weights_by_today_with_a_flat_kernel_are_mpc_scenario_exactly_and_a_narrow_one_plans_otherwise():
    """A bandwidth so wide that every weight is 1 gives ``1 / K`` and the same actions as equal weights, bit for bit;
    a narrow one changes the plans (the weights reach the LP and the plan)."""
    site = make_site(days=8, n_sockets=4)
    params = dataclasses.replace(scenario.base_params(site.config), horizon_h=12)
    plans = {}
    for bw in (0.0, 1e12, 0.5):
        m = ScenarioMPC(site.split("train"), params, n_scenarios=4, today_bandwidth=bw, keep_plans=True)
        _run(site, "train", m)
        plans[bw] = np.stack([p.action for p in m.plans])
    np.testing.assert_array_equal(plans[0.0], plans[1e12])
    assert not np.array_equal(plans[0.0], plans[0.5])


def test_weights_by_today_are_refused_without_past_days():
    data = make_site(days=4, n_sockets=4).split("train")
    for kw in ({"today_bandwidth": -1.0}, {"today_bandwidth": 1.0, "scenario_source": "session_model"}):
        with pytest.raises(ValueError, match="today_bandwidth"):
            ScenarioMPC(data, scenario.base_params(data.config), **kw)
