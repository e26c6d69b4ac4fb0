"""The CO2 comparison report: table layout, relative KPIs, figures and Markdown, from real env rollouts."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_site

from envs.kpis import KPI_COLUMNS, TRACE_COLUMNS, evaluate_policy, write_parquet
from pipeline.report import SEED_COLUMNS, kpi_markdown_table, read_kpi_files, summary_paragraph, write_report

CONTROLLERS = ("ppo", "uncontrolled", "a2c", "oracle")  # deliberately not in report order
SPLITS = ("test", "train")


def _uncontrolled(obs: torch.Tensor, env) -> torch.Tensor:
    return torch.tensor([[0.0, 1.0]], dtype=obs.dtype, device=obs.device)


def _latest_charging(obs: torch.Tensor, env) -> torch.Tensor:
    """Stand-in for a second agent: EVs at their least-laxity floor only (as late as possible), BESS idle."""
    return torch.tensor([[0.0, -1.0]], dtype=obs.dtype, device=obs.device)


def _random_linear(seed: int):
    """Stand-in for a trained agent: a fixed random linear policy ``tanh(obs @ W)``."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[int, torch.Tensor] = {}

    def policy(obs: torch.Tensor, env) -> torch.Tensor:
        if obs.shape[1] not in weights:
            weights[obs.shape[1]] = torch.randn(obs.shape[1], 2, generator=gen, dtype=torch.float64) * 0.3
        a = torch.tanh(obs.to(torch.float64) @ weights[obs.shape[1]])
        a[:, 1] = 0.5 + 0.5 * a[:, 1]  # mostly charging, so it serves most EV energy
        return a.to(obs.dtype)

    return policy


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """KPI and trace Parquet files for 4 controllers x 2 splits of the synthetic site, plus metrics."""
    root = tmp_path_factory.mktemp("report_inputs")
    site = make_site()
    kpi_files, trace_files, rows = [], {}, {}
    for split in SPLITS:
        # random linear seed 3 has the lowest CO2 of seeds 0-7 on both splits: the stand-in oracle
        policies = {"uncontrolled": _uncontrolled, "oracle": _random_linear(3), "ppo": _random_linear(1), "a2c": _latest_charging}
        for name in CONTROLLERS:
            extra = {"train_wall_s": 12.5} if name == "ppo" else {}
            kpi, traces = evaluate_policy(policies[name], site, split, name, **extra)
            kpi["seed"] = 1  # an extra column the report must drop
            kpi_files.append(write_parquet(kpi, root / f"kpi_{name}_{split}.parquet"))
            trace_files[(name, split)] = write_parquet(traces, root / f"traces_{name}_{split}.parquet")
            rows[(name, split)] = kpi.iloc[0]
    steps = np.arange(1, 41) * 480
    metrics = pd.DataFrame(
        {
            "global_step": steps,
            "wall_s": steps / 1000.0,
            "sps": np.full(len(steps), 1000.0),
            "episodic_return": -np.linspace(50, 20, len(steps)),
            "episodic_co2_kg": np.linspace(40, 25, len(steps)) + np.sin(steps),
            "episodic_unserved_kwh": np.linspace(10, 1, len(steps)),
        }
    )
    metrics_files = {"ppo": write_parquet(metrics, root / "ppo_metrics.parquet"), "sac": root / "missing.parquet"}
    return {"kpi_files": kpi_files, "trace_files": trace_files, "metrics_files": metrics_files, "rows": rows, "site": site}


@pytest.fixture(scope="module")
def report(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "out"
    return write_report(
        inputs["kpi_files"],
        inputs["trace_files"],
        inputs["metrics_files"],
        out,
        "Synthetic site: CO2 comparison",
        {"site": "synthetic", "PV": "10 kWp", "BESS": "20 kWh / 10 kW", "timezone": "America/Los_Angeles"},
    )


def test_files_exist(report: Path):
    out = report.parent
    assert report.name == "report.md"
    for name in ("co2_comparison.parquet", "co2_by_controller.png", "test_week_traces.png", "learning_curves.png", "report.md"):
        assert (out / name).is_file(), name
        assert (out / name).stat().st_size > 1000 or name == "co2_comparison.parquet", name
    for name in ("co2_by_controller.png", "test_week_traces.png", "learning_curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not list(out.glob(".*.tmp")), "temporary files left behind"


def test_comparison_table(report: Path, inputs):
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    assert list(table.columns) == ["controller", "split", *KPI_COLUMNS, *SEED_COLUMNS]
    assert (table.n_seeds == 1).all() and table.co2_kg_std.isna().all()  # one seed each: no spread
    # one row per controller x split, ordered train then test, uncontrolled / rule_based / oracle / agents
    order = ["uncontrolled", "oracle", "a2c", "ppo"]
    assert list(zip(table.split, table.controller)) == [(s, c) for s in ("train", "test") for c in order]
    for _, r in table.iterrows():
        src = inputs["rows"][(r.controller, r.split)]
        assert r.co2_kg == pytest.approx(src.co2_kg)
        assert r.unserved_kwh == pytest.approx(src.unserved_kwh)
    by = table.set_index(["controller", "split"])
    for split in SPLITS:
        base, orc, ppo = (by.loc[(c, split)] for c in ("uncontrolled", "oracle", "ppo"))
        assert orc.co2_kg < ppo.co2_kg < base.co2_kg  # the stand-ins keep the study's order
        assert base.co2_reduction_pct == 0.0
        assert base.oracle_gap_closed_pct == 0.0
        assert orc.oracle_gap_closed_pct == pytest.approx(100.0)
        assert ppo.co2_reduction_pct == pytest.approx(100 * (base.co2_kg - ppo.co2_kg) / base.co2_kg)
        assert ppo.oracle_gap_closed_pct == pytest.approx(100 * (base.co2_kg - ppo.co2_kg) / (base.co2_kg - orc.co2_kg))
    assert by.loc[("ppo", "test"), "train_wall_s"] == 12.5
    assert math.isnan(by.loc[("uncontrolled", "test"), "train_wall_s"])


def test_markdown(report: Path, inputs):
    text = report.read_text()
    assert text.startswith("# Synthetic site: CO2 comparison")
    for name in CONTROLLERS:
        assert f"| {name} |" in text
    assert "- **PV**: 10 kWp" in text
    assert "### train split" in text and "### test split" in text
    assert "CO2 (kg)" in text and "Unserved energy (kWh)" in text and "Sessions rejected" in text
    assert "lowest CO2 apart from the oracle" in text
    for split in SPLITS:  # the sentence names the non-oracle controller with the least CO2 on each split
        co2 = {name: float(row.co2_kg) for (name, sp), row in inputs["rows"].items() if sp == split and name != "oracle"}
        best = min(co2, key=co2.get)
        assert f"On the **{split}** split the lowest CO2 apart from the oracle is **{best}**'s" in text
    assert "Every agent delivers at least 99% of the EV energy" in text
    assert "Unserved energy always stands beside CO2" in text
    for png in ("co2_by_controller.png", "test_week_traces.png", "learning_curves.png"):
        assert f"]({png})" in text


def test_week_is_monday_with_most_ev_energy(report: Path, inputs):
    """The synthetic test split (2019-05-15..28) has exactly one whole local Monday week: from 05-20."""
    assert "test-split week from 2019-05-20" in report.read_text()


def test_missing_metrics_and_traces_are_skipped(inputs, tmp_path: Path):
    empty = write_parquet(pd.DataFrame({"global_step": pd.Series([], dtype="int64")}), tmp_path / "empty.parquet")
    md = write_report(inputs["kpi_files"], {}, {"ppo": empty, "dqn": tmp_path / "nope.parquet"}, tmp_path / "out", "T", {})
    assert (tmp_path / "out" / "co2_by_controller.png").is_file()
    assert not (tmp_path / "out" / "learning_curves.png").exists()
    assert not (tmp_path / "out" / "test_week_traces.png").exists()
    assert "learning curves are omitted" in md.read_text()


def test_missing_kpi_column_names_file(inputs, tmp_path: Path):
    bad = pd.read_parquet(inputs["kpi_files"][0]).drop(columns=["unserved_kwh"])
    bad_path = write_parquet(bad, tmp_path / "broken_kpis.parquet")
    with pytest.raises(ValueError, match=r"broken_kpis\.parquet.*unserved_kwh"):
        write_report([*inputs["kpi_files"][1:], bad_path], {}, {}, tmp_path / "out", "T", {})


def test_duplicate_controller_split_rejected(inputs, tmp_path: Path):
    dup = write_parquet(pd.read_parquet(inputs["kpi_files"][0]), tmp_path / "dup.parquet")
    with pytest.raises(ValueError, match="dup.parquet"):
        write_report([*inputs["kpi_files"], dup], {}, {}, tmp_path / "out", "T", {})


def test_trace_file_missing_column_names_file(inputs, tmp_path: Path):
    key = ("uncontrolled", "test")
    tr = pd.read_parquet(inputs["trace_files"][key])
    assert list(tr.columns) == list(TRACE_COLUMNS)
    bad = write_parquet(tr.drop(columns=["soc"]), tmp_path / "bad_traces.parquet")
    with pytest.raises(ValueError, match=r"bad_traces\.parquet.*soc"):
        write_report(inputs["kpi_files"], {key: bad}, {}, tmp_path / "out", "T", {})


def test_summary_flags_agent_that_starves_evs(report: Path):
    table = pd.read_parquet(report.parent / "co2_comparison.parquet")
    rows = table[table.split == "test"].copy()
    base = float(rows.loc[rows.controller == "uncontrolled", "ev_energy_delivered_kwh"].iloc[0])
    starving = rows.controller == "a2c"
    rows.loc[starving, "ev_energy_delivered_kwh"] = 0.9 * base
    rows.loc[starving, "co2_kg"] = 1.0  # a CO2 "saving" bought by not charging
    text = summary_paragraph("test", rows)
    assert "lowest CO2 apart from the oracle is **a2c**" in text
    assert "Not every agent serves the EVs" in text and "a2c (90.0%)" in text and "ppo" not in text.split("are ")[-1]


def test_seeds_are_averaged_with_their_spread(tmp_path):
    def kpi(controller, co2, seed=None, served=100.0):
        row = {"controller": controller, "split": "test", **{k: 1.0 for k in KPI_COLUMNS}, "co2_kg": co2,
               "ev_energy_served_pct": served}
        if seed is not None:
            row["seed"] = float(seed)
        return write_parquet(pd.DataFrame([row]), tmp_path / f"{controller}_{seed}.parquet")

    files = [kpi("uncontrolled", 1000.0), kpi("oracle", 500.0), kpi("ppo", 700.0, 1), kpi("ppo", 800.0, 2),
             kpi("ppo", 900.0, 3, served=99.0), kpi("dqn", 650.0, 1)]
    table = read_kpi_files(files).set_index("controller")
    ppo, dqn = table.loc["ppo"], table.loc["dqn"]
    assert ppo.n_seeds == 3 and ppo.co2_kg == pytest.approx(800.0) and ppo.co2_kg_std == pytest.approx(100.0)
    assert ppo.ev_energy_served_pct == pytest.approx(99 + 2 / 3)
    # relative KPIs per seed, then averaged: (1000 - co2) / (1000 - 500) -> 60, 40, 20 %
    assert ppo.oracle_gap_closed_pct == pytest.approx(40.0) and ppo.oracle_gap_closed_pct_std == pytest.approx(20.0)
    assert dqn.n_seeds == 1 and math.isnan(dqn.co2_kg_std)
    assert table.loc["uncontrolled"].n_seeds == 1
    md = kpi_markdown_table(table.reset_index())
    assert "| ppo | 3 | 800.0 ± 100.0 |" in md
    assert "| dqn | 1 (single seed) | 650.0 |" in md
    assert "| uncontrolled | – | 1,000.0 |" in md
    with pytest.raises(ValueError, match="with seed 2"):
        read_kpi_files([*files, shutil.copy(files[3], tmp_path / "again.parquet")])


def test_report_shows_a_shipped_site_config_relative_to_the_project(tmp_path):
    from pipeline.config import PROJECT_ROOT, shown_path

    assert shown_path(PROJECT_ROOT / "envs" / "sites" / "caltech.toml") == "envs/sites/caltech.toml"
    assert shown_path(tmp_path / "site.toml") == str(tmp_path / "site.toml")  # a user's own file: as given
