"""What forecasting what is worth (pipeline/study/information.py): the planner given the truth of one unknown at a
time (MPCController's perfect_moer and perfect_arrivals), the table against rule_based and the oracle, and its place
in the report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from conftest import make_site, write_site

from envs.kpis import evaluate_policy
from envs.site import load_site
from pipeline.control import registry, rl_planner
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.study import information, results
from pipeline.study.document import render_markdown


@pytest.fixture(scope="module")
def tiny():
    return make_site(days=4, n_sockets=4, mpc={"horizon_h": 12})


def _params(data) -> PlannerParams:
    return dataclasses.replace(PlannerParams.of_site(data.config), horizon_h=12)


def _actions(mpc: MPCController, site, split: str) -> tuple[np.ndarray, float]:
    """The actions of ``mpc`` over the whole split (every plan kept) and its CO2, kg."""
    kpi, _ = evaluate_policy(mpc, site, split, "mpc", action_mode="socket", bess_action="setpoint")
    return np.stack([p.action for p in mpc.plans]), float(kpi.co2_kg.iloc[0])


def test_both_truths_are_perfect(tiny):
    data = tiny.split("test")
    both = MPCController(data, _params(data), perfect_moer=True, perfect_arrivals=True, keep_plans=True)
    perfect = MPCController(data, _params(data), perfect=True, keep_plans=True)
    assert both.perfect and perfect.perfect_moer and perfect.perfect_arrivals
    a, co2_a = _actions(both, tiny, "test")
    b, co2_b = _actions(perfect, tiny, "test")
    np.testing.assert_array_equal(a, b)
    assert co2_a == co2_b


def test_one_truth_at_a_time(tiny):
    data = tiny.split("test")
    params = dataclasses.replace(_params(data), expected_demand_weight=0.5, moer_contrast=1.5)
    causal = MPCController(data, params)
    moer = MPCController(data, params, perfect_moer=True)
    arrivals = MPCController(data, params, perfect_arrivals=True)
    perfect = MPCController(data, params, perfect=True)
    assert moer.forecaster is None and not moer.perfect and arrivals.forecaster is not None
    t, H = 30, 12  # from 06:00 local of the second day: the window holds arrivals, the day before too
    np.testing.assert_array_equal(moer.moer_outlook(t, H), data.moer[t : t + H])  # the truth, not its contrast
    np.testing.assert_array_equal(arrivals.moer_outlook(t, H), causal.moer_outlook(t, H))
    assert not np.array_equal(causal.moer_outlook(t, H), data.moer[t : t + H])
    need, left = np.zeros(data.config.ev.n_sockets), np.zeros(data.config.ev.n_sockets, np.int64)
    for a, b in ((arrivals, perfect), (moer, causal)):  # the true arrivals, each a whole car; the expected demand
        x, y = a.sessions(t, H, need, left), b.sessions(t, H, need, left)
        for f in dataclasses.fields(x):
            np.testing.assert_array_equal(getattr(x, f.name), getattr(y, f.name))
    truth, expected = perfect.sessions(t, H, need, left), causal.sessions(t, H, need, left)
    assert len(truth) > 0 and len(expected) > 0 and (truth.weight == 1).all() and (expected.weight < 1).all()


@pytest.fixture(scope="module")
def tables(tiny):
    """The table of the test split, and the registry's mpc_rl_start and mpc_perfect rows of it."""
    rows = information.value_of_information(tiny, "test")
    own = {c: registry.get(c).simulate(tiny, "test")[0] for c in ("mpc_rl_start", "mpc_perfect")}
    return rows, own


def test_the_table_rows_are_the_registrys(tables):
    rows, own = tables
    assert list(rows.columns) == list(information.COLUMNS)
    assert list(rows.variant) == list(information.VARIANTS) and set(rows.split) == {"test"}
    by = rows.set_index("variant")
    for variant, controller in (("forecasts", "mpc_rl_start"), ("both_true", "mpc_perfect")):
        assert by.controller[variant] == controller
        assert by.co2_kg[variant] == float(own[controller].co2_kg.iloc[0])
        assert by.unserved_kwh[variant] == float(own[controller].unserved_kwh.iloc[0])


def test_gap_shares(tables):
    rows, _ = tables
    r = rows.iloc[0]
    assert r.rule_based_co2_kg > r.oracle_co2_kg
    gap = 100 * (r.rule_based_co2_kg - rows.co2_kg) / (r.rule_based_co2_kg - r.oracle_co2_kg)
    np.testing.assert_allclose(rows.gap_closed_vs_rule_pct, gap)
    # no planner beats the oracle while serving every car, and none of them leaves a car short here
    assert (rows.co2_kg >= r.oracle_co2_kg - 1e-6).all() and (rows.gap_closed_vs_rule_pct <= 100 + 1e-6).all()
    assert (rows.unserved_kwh < 1e-6).all() and (rows.ev_energy_served_pct > 99.9).all()


def test_reading_and_page(tables):
    rows, _ = tables
    line = information.reading(rows, "test")
    by = rows.set_index("variant").gap_closed_vs_rule_pct
    assert line.startswith("On this site's test split, knowing the arrivals is worth ")
    assert (
        f"{by['true_arrivals'] - by['forecasts']:+.1f} points, the MOER {by['true_moer'] - by['forecasts']:+.1f}"
        in line
    )
    md = render_markdown(information.page_blocks(rows))
    assert "## What forecasting is worth" in md and "| forecast MOER, the true arrivals |" in md and line in md


def test_study_rows_are_read_where_current(tiny, tmp_path, monkeypatch):
    toml = write_site(tiny, tmp_path)
    site = load_site(toml)
    base = tmp_path / "study" / "baselines"
    for c in information.REFERENCES:  # the study's rows, written after the site and the code
        kpi, traces = registry.get(c).simulate(site, "test")
        for df, f in zip((kpi, traces), results.files(base, c, "test")):
            f.parent.mkdir(parents=True, exist_ok=True)
            df.to_parquet(f)
    ran = []

    def simulate(site, split, controller):  # a stand-in for the planner's runs
        ran.append(controller)
        row = {"controller": controller, "split": split, "co2_kg": 6.0, "ev_energy_served_pct": 100.0}
        return pd.DataFrame([row | {"unserved_kwh": 0.0}]), None

    monkeypatch.setattr(information, "simulate", simulate)
    rows = information.value_of_information(toml, "test", study_dir=tmp_path / "study")
    assert ran == [v.controller for v in information.VARIANTS.values()]  # the references were read
    assert information.reusable([base], "mpc_perfect", "test", toml) is None
    old = results.files(base, "oracle", "test")[0]
    toml.touch()  # a site edited after the study's run: its rows are stale
    assert information.reusable([base], "oracle", "test", toml) is None and old.is_file()
    assert rows.oracle_co2_kg.iloc[0] == float(pd.read_parquet(old).co2_kg.iloc[0])


def test_run_fans_the_runs_out_writes_the_page_and_reads_them_back(tiny, tmp_path, monkeypatch):
    from distributed import Client

    toml = write_site(tiny, tmp_path)
    ran = []

    def simulate(site, split, controller):  # a stand-in for every run: CO2 by controller
        ran.append((controller, split))
        co2 = {"rule_based": 10.0, "oracle": 5.0, "mpc_perfect": 5.5, "mpc_rl_start": 9.0}.get(controller, 8.0)
        row = {"controller": controller, "split": split, "co2_kg": co2, "ev_energy_served_pct": 100.0}
        traces = pd.DataFrame({"co2_kg": [co2]})
        return pd.DataFrame([row | {"unserved_kwh": 0.0}]), traces

    monkeypatch.setattr(information, "simulate", simulate)
    lines = []
    with Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as client:
        paths = information.run(toml, tmp_path / "study", client=client, log=lines.append)
        assert paths == information.outputs(tmp_path / "study") and all(p.is_file() for p in paths)
        assert sorted(ran) == sorted((c, s) for c in information.controllers() for s in ("train", "test"))
        rows = pd.read_parquet(paths[0])
        assert rows.gap_closed_vs_rule_pct.tolist() == [20.0, 40.0, 40.0, 90.0] * 2
        line = "On this site's test split, knowing the arrivals is worth +20.0 points, the MOER +20.0, both +70.0"
        assert line in paths[1].read_text() and any(x.startswith(line) for x in lines)
        ran.clear()
        information.run(toml, tmp_path / "study", client=client, log=lines.append)
        assert ran == []  # every row read back: written after the site and the code


def test_unknown_run_and_missing_rows(tiny):
    with pytest.raises(KeyError, match="not a run of the value-of-information table"):
        information.simulate(tiny, "test", "mpc")
    with pytest.raises(ValueError, match="test split: no row of mpc_rl_start, .*, oracle$"):
        information.table(pd.DataFrame({"controller": ["rule_based"], "split": ["test"], "co2_kg": [1.0]}))


def test_report_shows_the_table_when_there(tables, tmp_path):
    from pipeline.study.comparison import read_kpi_files
    from pipeline.study.report import report_blocks

    rows, _ = tables
    kpi = registry.get("rule_based").simulate(make_site(days=2), "test")[0]
    kpi.to_parquet(tmp_path / "rule_based_test.parquet")
    table = read_kpi_files([tmp_path / "rule_based_test.parquet"])
    with_it = render_markdown(report_blocks("t", {}, table, [], information=rows))
    assert "## What forecasting is worth" in with_it and information.reading(rows, "test") in with_it
    assert "What forecasting is worth" not in render_markdown(report_blocks("t", {}, table, []))


def test_start_params_are_the_planners(tiny):
    p = rl_planner.start_params(tiny)
    assert p.expected_demand_weight == 0.5 and p.terminal_value == 1.0 and p.demand_day_type
