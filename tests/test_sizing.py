"""The sizing study (``doit run sizing``, pipeline/study/sizing.py): one row per point x controller x split, CO2 falling
with PV and battery, the oracle below the causal controllers, figures embedded in the page, costs as defined,
and bad ``[sizing]`` tables or variables stopped with a message naming the TOML and the key."""

from __future__ import annotations

import base64
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, make_site, write_site

from envs.config import ConfigError
from pipeline.study.sizing import (
    COLUMNS,
    SizingCosts,
    build_table,
    headline,
    pareto_mask,
    parse_sizing,
    report_summary,
    sizing_spec,
)

COSTS = {
    "capex_per_kwp": 1000.0,
    "capex_per_kwh": 300.0,
    "capex_per_kw": 100.0,
    "lifetime_years": 20,
    "discount_rate": 0.05,
}
TOL = 1e-6


def _doit(args: list[str], site_toml: Path, out: Path) -> subprocess.CompletedProcess:
    """``python -m doit <args>`` on ``site_toml`` with outputs under ``out`` and the experiment's own doit state."""
    env = {**os.environ, "EVHUB_SITE": str(site_toml), "EVHUB_OUTPUT_DIR": str(out)}
    for k in ("DASK_SCHEDULER_ADDRESS", "EVHUB_EXPERIMENT", "EVHUB_WORKERS") + tuple(
        k for k in os.environ if k.startswith("EVHUB_SIZING_")
    ):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "doit", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """``doit run sizing`` on a 2-day synthetic site over a 2 x 2 grid (the TOML says kwp = [0, 5], the doit variable
    kwp=0,10 wins) on 2 workers; returns the site TOML, the output root and the doit process."""
    folder = tmp_path_factory.mktemp("sizing")
    sizing = {"kwp": [0, 5], "bess_kwh": [0, 20], "bess_kw_per_kwh": 0.5, **COSTS}
    toml = write_site(make_site(days=2, n_sockets=4, sizing=sizing), folder / "site")
    out = folder / "outputs"
    proc = _doit(["run", "sizing", "kwp=0,10", "workers=2"], toml, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return toml, out / "synthetic", proc


def test_one_row_per_point_controller_and_split(study):
    _, root, proc = study
    table = pd.read_parquet(root / "sizing" / "sizing.parquet")
    assert list(table.columns) == list(COLUMNS)
    assert len(table) == 2 * 2 * 4 * 2
    assert not table.duplicated(["kwp", "bess_kwh", "controller", "split"]).any()
    assert set(table.kwp) == {0.0, 10.0} and set(table.bess_kwh) == {0.0, 20.0}  # the doit variable won
    assert set(table.controller) == {"uncontrolled", "rule_based", "mpc", "oracle"} and set(table.split) == {
        "train",
        "test",
    }
    np.testing.assert_allclose(table.bess_kw, 0.5 * table.bess_kwh)
    assert (table.wall_s > 0).all() and (table.task_wall_s >= table.wall_s).all()
    assert (table.unserved_kwh < 1e-6).all()
    # progress: a line per point, the workers and the wall time; the experiment's own doit state
    assert (
        proc.stdout.count("/4] ") == 4 and "2 Dask worker(s)" in proc.stdout and "s wall on 2 worker(s)" in proc.stdout
    )
    assert (root / ".doit.sqlite3").is_file()


def test_co2_falls_with_pv_and_battery_and_the_oracle_is_lowest(study):
    table = pd.read_parquet(study[1] / "sizing" / "sizing.parquet")
    for (controller, split), rows in table.groupby(["controller", "split"]):
        if controller not in ("rule_based", "oracle"):
            continue
        grid = rows.pivot_table(index="bess_kwh", columns="kwp", values="co2_kg")
        tol = TOL * (1.0 + float(grid.abs().max().max()))
        assert (np.diff(grid.to_numpy(), axis=1) <= tol).all(), (controller, split, grid)  # more PV
        assert (np.diff(grid.to_numpy(), axis=0) <= tol).all(), (controller, split, grid)  # more battery
    co2 = table.pivot_table(index=["split", "kwp", "bess_kwh"], columns="controller", values="co2_kg")
    assert (co2.oracle <= co2.rule_based + TOL * (1 + co2.rule_based.abs())).all(), co2
    assert (co2.oracle <= co2.mpc + TOL * (1 + co2.mpc.abs())).all(), co2
    assert (co2.oracle < co2.uncontrolled).all()


def test_figures_and_the_page_embed_every_figure(study):
    folder = study[1] / "sizing"
    html = (folder / "sizing.html").read_text(encoding="utf-8")
    md = (folder / "sizing.md").read_text(encoding="utf-8")
    for name in ("co2_saved.png", "pareto.png"):
        png = (folder / name).read_bytes()
        assert png.startswith(b"\x89PNG")
        assert base64.b64encode(png).decode("ascii") in html  # embedded, nothing fetched
        assert f"]({name})" in md
    assert html.count("<img ") == 2 and "default-src 'none'" in html
    assert "## Headline" in md and "Cheapest point per tonne of CO2 avoided" in md and "USD/t" in md
    assert "<h2>Headline</h2>" in html
    assert not list(folder.glob(".*.tmp"))


def test_up_to_date_until_the_grid_changes_and_the_main_report_mentions_it(study):
    toml, root, _ = study
    info = _doit(["info", "sizing", "kwp=0,10"], toml, root.parent)
    assert info.returncode == 0 and "up-to-date" in info.stdout, info.stdout + info.stderr
    assert "PV kWp x BESS kWh grid" in info.stdout  # the line `doit list` shows
    changed = _doit(["info", "sizing", "kwp=0,20"], toml, root.parent)
    assert changed.returncode == 1 and "status     : run" in changed.stdout and "up-to-date" not in changed.stdout, (
        changed.stdout
    )

    # the main report of the experiment shows the sizing headline and points to the sizing page
    from envs.files import write_parquet
    from envs.kpis import KPI_COLUMNS
    from pipeline.study.tasks import make_report

    kpis = []
    for controller in ("uncontrolled", "oracle"):
        for split in ("train", "test"):
            row = {"controller": controller, "split": split, **{k: 1.0 for k in KPI_COLUMNS}}
            kpis.append(str(write_parquet(pd.DataFrame([row]), root / "kpis" / f"{controller}_{split}.parquet")))
    md = Path(make_report({"site_toml": str(toml), "algos": []}, kpis, {}, {}, str(root / "report"))).read_text()
    assert "## Sizing results" in md and "../sizing/sizing.html" in md and "cost per t CO2 avoided (USD/t)" in md


def test_costs_per_tonne_pareto_and_headline():
    spec = parse_sizing({"kwp": [0, 10], "bess_kwh": [0, 20], "bess_kw_per_kwh": 0.5, **COSTS}, "site.toml")
    rows = []
    co2 = {(0, 0): 100.0, (0, 20): 100.0, (10, 0): 60.0, (10, 20): 58.0}  # kg over a 876-hour split
    for (p, e), kg in co2.items():
        for c, delta in (("uncontrolled", 0.0), ("oracle", -5.0)):
            rows.append(
                {
                    "kwp": float(p),
                    "bess_kwh": float(e),
                    "bess_kw": 0.5 * e,
                    "controller": c,
                    "split": "train",
                    "hours": 876.0,
                    "co2_kg": kg + delta,
                    "wall_s": 1.0,
                    "task_wall_s": 2.0,
                    **{
                        k: 0.0
                        for k in (
                            "unserved_kwh",
                            "ev_energy_requested_kwh",
                            "ev_energy_delivered_kwh",
                            "ev_energy_served_pct",
                            "grid_import_kwh",
                            "grid_export_kwh",
                            "pv_generation_kwh",
                            "pv_self_consumption_pct",
                            "peak_import_kw",
                        )
                    },
                }
            )
    table = build_table(rows, spec).set_index(["controller", "kwp", "bess_kwh"])
    crf20 = 0.05 * 1.05**20 / (1.05**20 - 1)
    assert SizingCosts.crf(0.05, 20) == pytest.approx(crf20) and SizingCosts.crf(0.0, 20) == pytest.approx(0.05)
    r = table.loc[("uncontrolled", 10.0, 20.0)]
    assert r.capex == pytest.approx(1000 * 10 + 300 * 20 + 100 * 10)
    assert r.annualised_cost == pytest.approx(r.capex * crf20)
    assert r.co2_t_per_year == pytest.approx(58.0 * 10 / 1000)  # 8760 / 876 = 10 splits a year
    assert r.co2_avoided_t_per_year == pytest.approx(42.0 * 10 / 1000) and r.co2_avoided_pct == pytest.approx(42.0)
    assert r.cost_per_t_avoided == pytest.approx(r.annualised_cost / 0.42)
    assert math.isnan(table.loc[("uncontrolled", 0.0, 0.0)].cost_per_t_avoided)  # nothing avoided
    assert table.loc[("oracle", 0.0, 0.0)].cost_per_t_avoided == 0.0  # avoided without capex
    assert table.loc[("uncontrolled", 0.0, 0.0)].pareto and not table.loc[("uncontrolled", 0.0, 20.0)].pareto
    head = headline(build_table(rows, spec)).set_index("controller")
    best = table.loc["uncontrolled"].query("capex > 0").cost_per_t_avoided.idxmin()
    assert (head.loc["uncontrolled", "kwp"], head.loc["uncontrolled", "bess_kwh"]) == best == (10.0, 0.0)
    assert head.loc["oracle", "free_avoided_pct"] == pytest.approx(5.0)
    assert len(report_summary(build_table(rows, spec))) == 2
    assert pareto_mask(np.array([0, 1, 1, 2]), np.array([5, 4, 3, 3])).tolist() == [True, False, True, False]


@pytest.mark.parametrize(
    "table, key, words",
    [
        ({"capex_per_kwp": -1.0}, "sizing.capex_per_kwp", ">= 0"),
        ({"capex_per_kwh": -5}, "sizing.capex_per_kwh", ">= 0"),
        ({"kwp": []}, "sizing.kwp", "empty grid"),
        ({"kwp": None}, "sizing.kwp", "missing"),
        ({"bess_kwh": [0, -40]}, "sizing.bess_kwh", ">= 0 kWh"),
        ({"capex_per_kwpp": 1.0}, "sizing.capex_per_kwpp", "did you mean 'sizing.capex_per_kwp'"),
        ({"bess_kw_per_kwh": 0}, "sizing.bess_kw_per_kwh", "> 0"),
        ({"lifetime_years": 0}, "sizing.lifetime_years", "> 0 years"),
        ({"discount_rate": 1.5}, "sizing.discount_rate", "[0, 1)"),
        ({"controllers": ["rule_base"]}, "sizing.controllers", "did you mean 'rule_based'"),
        ({"kwp": "20"}, "sizing.kwp", "number"),
        ({"capex_per_kwh": None}, "sizing.capex_per_kwh", "missing"),
    ],
    ids=[
        "negative-pv-cost",
        "negative-bess-cost",
        "empty-grid",
        "no-grid",
        "negative-size",
        "unknown-key",
        "zero-c-rate",
        "zero-lifetime",
        "discount-rate",
        "unknown-controller",
        "string-size",
        "partial-costs",
    ],
)
def test_bad_sizing_values_name_the_toml_and_the_key(tmp_path, table, key, words):
    sizing = {"kwp": [0, 10], "bess_kwh": [0, 20], **COSTS}
    for k, v in table.items():
        if v is None:
            sizing.pop(k)
        else:
            sizing[k] = v
    toml = write_site(make_site(days=2, n_sockets=2, sizing=sizing), tmp_path)
    with pytest.raises(ConfigError) as err:
        sizing_spec(toml, lambda name: None)
    message = str(err.value)
    assert str(toml) in message and f"'{key}'" in message and words in message, message


def test_bad_variables_name_the_variable_and_a_bad_table_stops_doit_run_sizing(tmp_path):
    sizing = {"kwp": [0, 10], "bess_kwh": [0, 20], **COSTS}
    toml = write_site(make_site(days=2, n_sockets=2, sizing=sizing), tmp_path / "site")
    given = {"kwp": ("0,x", "doit variable kwp='0,x'")}
    with pytest.raises(ConfigError, match=r"doit variable kwp='0,x': kwp must be comma-separated numbers"):
        sizing_spec(toml, given.get)
    given = {"bess_kwh": ("-40", "environment variable EVHUB_SIZING_BESS_KWH='-40'")}
    with pytest.raises(ConfigError, match=r"EVHUB_SIZING_BESS_KWH='-40' must be >= 0 kWh"):
        sizing_spec(toml, given.get)
    spec = sizing_spec(toml, {"kwp": ("10,20", "doit variable kwp='10,20'")}.get)
    assert spec.kwp == (0.0, 10.0, 20.0) and spec.notes  # the reference point (0, 0) is always in the grid

    bad = write_site(make_site(days=2, n_sockets=2, sizing={**sizing, "capex_per_kwp": -1.0}), tmp_path / "bad")
    out = tmp_path / "outputs"
    proc = _doit(["run", "sizing"], bad, out)
    assert proc.returncode != 0
    assert str(bad) in proc.stdout + proc.stderr and "sizing.capex_per_kwp" in proc.stdout + proc.stderr
    assert not (out / "synthetic" / "sizing").exists()


@pytest.mark.parametrize("site", ["caltech", "iquitos"])
def test_the_shipped_sites_state_a_grid_and_unit_costs(site):
    spec = sizing_spec(site, lambda name: None)
    assert len(spec.points()) >= 16 and spec.kwp[0] == 0 and spec.bess_kwh[0] == 0 and not spec.notes
    assert spec.costs is not None and spec.costs.capex_per_kwp > 0 and spec.costs.capex_per_kwh > 0
    assert spec.controllers == ("uncontrolled", "rule_based", "mpc", "oracle")
