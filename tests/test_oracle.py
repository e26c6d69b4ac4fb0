"""The perfect-foresight oracle (pipeline/control/oracle.py) on the small synthetic site.

The oracle is a relaxation of the env: no controller run through ``evaluate_policy`` may beat its
objective (CO2 + penalty * unserved), and when the controller serves all EV energy, not its CO2 either.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_site

from envs.kpis import TRACE_COLUMNS, balance_residual, evaluate_policy
from pipeline.control.oracle import UNSERVED_PENALTY, build_lp, solve_oracle

TOL = 1e-6  # kg, relative to the CO2 totals (~100 kg) this is far below any real difference


def constant(action):
    def policy(obs, env):
        return torch.tensor([action], dtype=torch.float64)

    return policy


def random_policy(seed: int, dim: int):
    gen = torch.Generator().manual_seed(seed)

    def policy(obs, env):
        return torch.rand(1, dim, generator=gen, dtype=torch.float64) * 2.0 - 1.0

    return policy


def rule_based(obs, env):
    """BESS follows the net load (charge surplus, discharge deficit); EVs at full power."""
    o = env.power_outlook()
    net = o["pv_kw"] - o["load_kw"] - o["ev_max_kw"]
    a_bess = (net / env.cfg.bess.power_kw).clamp(-1.0, 1.0)
    return torch.stack([a_bess, torch.ones_like(a_bess)], dim=1).to(torch.float64)


@pytest.fixture(scope="module")
def site():
    return make_site()


@pytest.fixture(scope="module")
def oracle(site):
    return solve_oracle(site, "train")


def test_oracle_beats_every_controller(site, oracle):
    kpi, _ = oracle
    runs = [evaluate_policy(constant([0.0, 1.0]), site, "train", "uncontrolled")[0]]
    runs.append(evaluate_policy(constant([-1.0, 0.0]), site, "train", "floor_only")[0])
    runs.append(evaluate_policy(rule_based, site, "train", "rule_based")[0])
    n = site.config.ev.n_sockets
    for seed in range(20):
        mode, dim = ("hub", 2) if seed % 2 == 0 else ("socket", 1 + n)
        bess_action = "surplus" if seed % 4 < 2 else "setpoint"
        policy = random_policy(seed, dim)
        runs.append(evaluate_policy(policy, site, "train", f"random{seed}", mode, bess_action=bess_action)[0])
    oracle_co2 = float(kpi.co2_kg.iloc[0])
    for row in runs:
        # the deadline floor makes every controller deliver all EV energy on this site
        assert float(row.unserved_kwh.iloc[0]) < 1e-6, row.controller.iloc[0]
        assert oracle_co2 <= float(row.co2_kg.iloc[0]) + TOL, row.controller.iloc[0]
    # and the oracle is strictly better than the uncontrolled baseline here (PV and BESS to shift)
    assert oracle_co2 < float(runs[0].co2_kg.iloc[0]) - 1.0


def test_oracle_serves_all_and_balances(oracle, site):
    kpi, traces = oracle
    data = site.split("train")
    assert list(traces.columns) == list(TRACE_COLUMNS)
    assert len(traces) == data.num_steps
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-6
    assert float(kpi.ev_energy_served_pct.iloc[0]) == pytest.approx(100.0, abs=1e-6)
    assert kpi.controller.iloc[0] == "oracle" and kpi.split.iloc[0] == "train"
    assert float(kpi.env_steps.iloc[0]) == data.num_steps
    assert balance_residual(traces).max() < 1e-6
    np.testing.assert_allclose(traces.co2_kg, traces.grid_import_kw * traces.moer_kg_per_kwh * site.config.dt_h)
    assert (traces.grid_export_kw == 0).all()  # export not allowed on this site
    assert (traces.grid_import_kw <= site.config.grid.import_limit_kw + 1e-6).all()


def test_soc_within_bounds(oracle, site):
    _, traces = oracle
    b = site.config.bess
    assert traces.soc.between(b.soc_min - 1e-9, b.soc_max + 1e-9).all()
    # the SOC trace follows the flows from the initial SOC
    delta = (b.eta_charge * traces.bess_charge_kw - traces.bess_discharge_kw / b.eta_discharge) * site.config.dt_h
    soc = (b.soc_initial * b.capacity_kwh + delta.cumsum()) / b.capacity_kwh
    np.testing.assert_allclose(traces.soc, soc, atol=1e-6)


def test_no_pv_no_battery_is_cheapest_hours_per_session():
    """Without PV and BESS (and a non-binding import limit) each session fills its lowest-MOER hours."""
    site = make_site(days=5, pv={"kwp": 0.0}, bess={"capacity_kwh": 0.0})
    data = site.split("train")
    kpi, traces = solve_oracle(site, "train")
    cfg, dt = site.config, site.config.dt_h
    expected = 0.0
    for s in data.sessions[~data.sessions.rejected].itertuples():
        moer = np.sort(data.moer[s.arrival_step : s.departure_step])
        left = s.need_kwh
        for m in moer:
            e = min(left, cfg.ev.socket_kw * dt)
            expected += e * m
            left -= e
        assert left < 1e-9  # need_kwh is capped at what the socket can deliver
    assert float(kpi.co2_kg.iloc[0]) == pytest.approx(expected, rel=1e-7, abs=1e-6)
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-6
    assert (traces.bess_discharge_kw * dt <= 1e-6).all()


def test_objective_bound_with_binding_import_limit():
    """With a tight grid limit some EV energy cannot be served; the oracle's objective still bounds all."""
    site = make_site(days=5, grid={"import_limit_kw": 8.0}, bess={"power_kw": 5.0})
    kpi, traces = solve_oracle(site, "train")
    assert (traces.grid_import_kw <= 8.0 + 1e-6).all()
    assert balance_residual(traces).max() < 1e-6
    bound = float(kpi.co2_kg.iloc[0]) + UNSERVED_PENALTY * float(kpi.unserved_kwh.iloc[0])
    n = site.config.ev.n_sockets
    policies = [("hub", constant([0.0, 1.0])), ("hub", rule_based)]
    policies += [("socket", random_policy(s, 1 + n)) for s in range(3)]
    for mode, policy in policies:
        row, _ = evaluate_policy(policy, site, "train", "c", action_mode=mode)
        cost = float(row.co2_kg.iloc[0]) + UNSERVED_PENALTY * float(row.unserved_kwh.iloc[0])
        assert bound <= cost + 1e-6


def test_zero_moer_hours_do_not_import_while_curtailing():
    """Hours with MOER = 0 make importing free; the traces must not import and curtail at once."""
    site = make_site(days=4)
    site.series.loc[site.series.index % 4 == 0, "moer_kg_per_kwh"] = 0.0
    kpi, traces = solve_oracle(site, "train")
    assert not ((traces.grid_import_kw > 1e-9) & (traces.pv_curtailed_kw > 1e-9)).any()
    assert balance_residual(traces).max() < 1e-6
    assert float(kpi.unserved_kwh.iloc[0]) < 1e-6


def test_unknown_split_raises(site):
    with pytest.raises(KeyError):
        solve_oracle(site, "validation")


def test_lp_matrix_is_scipys_canonical_csc():
    """The LP matrix built in one sort equals scipy's COO -> CSR -> CSC of the same triplets, duplicates summed."""
    import scipy.sparse as sp

    from pipeline.control.oracle import _csc

    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, 40, 600), rng.integers(0, 70, 600)  # many repeated (row, column) pairs
    vals = rng.normal(size=600)
    ours = _csc(rows, cols, vals, (40, 70))
    ref = sp.csr_matrix((vals, (rows, cols)), shape=(40, 70)).tocsc()
    assert ours.has_sorted_indices and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.indptr, ref.indptr)
    np.testing.assert_array_equal(ours.indices, ref.indices)
    np.testing.assert_allclose(ours.data, ref.data, rtol=0, atol=1e-12)


def test_the_oracles_lp_is_one_block_without_deferral(site):
    """``build_lp``'s :class:`LP` is one block: its layout fields say so (no session moved, no block beyond the
    first, no non-anticipativity rows) and ``defer`` is absent; its columns are ``[p, ch, dis, E, g, u, x, slack]``."""
    data = site.split("train")
    lp = build_lp(data)
    T, S, n_p = lp.T, lp.S, lp.n_p
    assert (T, lp.K, lp.nonanticipativity_rows) == (data.num_steps, 1, 0) and lp.off.defer is None
    np.testing.assert_array_equal(lp.p_col, np.arange(n_p))
    np.testing.assert_array_equal(lp.s_local, np.arange(S))
    np.testing.assert_array_equal(lp.row_off, [0])
    assert not lp.col_block.any() and len(lp.col_block) == len(lp.c) == n_p + 6 * T + S
    off = lp.off.block(0)
    assert [off.p, *off.per_step(), off.slack] == [0, *(n_p + i * T for i in range(6)), n_p + 6 * T]
    assert lp.A_eq.shape == (2 * T + S, len(lp.c)) and lp.bounds.shape == (len(lp.c), 2) and len(lp.b_eq) == 2 * T + S
