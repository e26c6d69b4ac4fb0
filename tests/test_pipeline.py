"""The study end to end through doit and Dask, on a small synthetic site with a tiny training budget.

Bad input stopping the study before any output: ``test_bad_input.py``.
"""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import doit, make_site, write_site


@pytest.mark.slow
def test_tiny_pipeline_end_to_end_then_up_to_date_then_config_change(tmp_path):
    site_toml = write_site(make_site(days=14), tmp_path / "site")
    out = tmp_path / "outputs"
    first = doit(["run", "pipeline"], site_toml, out, EVHUB_ALGOS="ppo,dqn")  # an on- and an off-policy agent
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = out / "synthetic" / "report"
    table = pd.read_parquet(report / "co2_comparison.parquet")
    assert {"uncontrolled", "rule_based", "oracle", "ppo"} <= set(table.controller)
    assert set(table.split) == {"train", "test"}
    for _split, rows in table.groupby("split"):
        oracle = rows.loc[rows.controller == "oracle", "co2_kg"].iloc[0]
        assert (rows.co2_kg >= oracle - 1e-6).all(), rows[["controller", "co2_kg"]]
        assert rows.loc[rows.controller == "uncontrolled", "co2_reduction_pct"].iloc[0] == pytest.approx(0.0)
    text = (report / "report.md").read_text()
    assert "ppo" in text and "oracle" in text and f"synthetic ({site_toml})" in text
    assert any(report.glob("*.png"))
    assert any((out / "synthetic" / "runs" / "ppo_seed1").glob("events.out.tfevents.*"))
    clock = first.stdout.split("wall time of this command's tasks:\n")[1].splitlines()  # the run ends with its table
    assert {row.split()[0] for row in clock[1:]} >= {"validate", "baselines", "train:ppo", "train:dqn", "report"}
    assert clock[-1].split()[:2] == ["whole", "command"], clock

    # nothing changed: every task is up to date
    second = doit(["run", "pipeline"], site_toml, out, EVHUB_ALGOS="ppo,dqn")
    assert second.returncode == 0, second.stderr[-3000:]
    for task in ("validate", "baselines", "train:ppo", "evaluate", "report"):
        assert f"-- {task}" in second.stdout, second.stdout

    # a changed site config re-runs what depends on it
    site_toml.write_text(site_toml.read_text().replace("kwp = 10.0", "kwp = 12.0"))
    third = doit(["run", "baselines"], site_toml, out, EVHUB_ALGOS="ppo,dqn")
    assert third.returncode == 0, third.stderr[-3000:]
    assert ".  validate" in third.stdout and ".  baselines" in third.stdout, third.stdout
