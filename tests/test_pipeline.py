"""The study end to end through doit and Dask, on a small synthetic site with a tiny training budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import make_site, write_site

ROOT = Path(__file__).resolve().parent.parent


def doit(args: list[str], site_toml: Path, out: Path, **env) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "EVHUB_SITE": str(site_toml),
        "EVHUB_OUTPUT_DIR": str(out),
        "EVHUB_TOTAL_TIMESTEPS": "4096",
        **env,
    }
    environ.pop("DASK_SCHEDULER_ADDRESS", None)
    cmd = [sys.executable, "-m", "doit", args[0], "--db-file", str(out.parent / "doit.db"), *args[1:]]
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.slow
def test_tiny_pipeline_end_to_end_then_up_to_date_then_config_change(tmp_path):
    site_toml = write_site(make_site(days=14), tmp_path / "site")
    out = tmp_path / "outputs"
    first = doit(["run", "pipeline"], site_toml, out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = out / "synthetic" / "report"
    table = pd.read_parquet(report / "co2_comparison.parquet")
    assert {"uncontrolled", "rule_based", "oracle", "ppo"} <= set(table.controller)
    assert set(table.split) == {"train", "test"}
    for split, rows in table.groupby("split"):
        oracle = rows.loc[rows.controller == "oracle", "co2_kg"].iloc[0]
        assert (rows.co2_kg >= oracle - 1e-6).all(), rows[["controller", "co2_kg"]]
        assert rows.loc[rows.controller == "uncontrolled", "co2_reduction_pct"].iloc[0] == pytest.approx(0.0)
    text = (report / "report.md").read_text()
    assert "ppo" in text and "oracle" in text
    assert any(report.glob("*.png"))
    assert any((out / "synthetic" / "runs" / "ppo_seed1").glob("events.out.tfevents.*"))

    # nothing changed: every task is up to date
    second = doit(["run", "pipeline"], site_toml, out)
    assert second.returncode == 0, second.stderr[-3000:]
    for task in ("validate", "baselines", "train:ppo", "evaluate", "report"):
        assert f"-- {task}" in second.stdout, second.stdout

    # a changed site config re-runs what depends on it
    site_toml.write_text(site_toml.read_text().replace("kwp = 10.0", "kwp = 12.0"))
    third = doit(["run", "baselines"], site_toml, out)
    assert third.returncode == 0, third.stderr[-3000:]
    assert ".  validate" in third.stdout and ".  baselines" in third.stdout, third.stdout


@pytest.mark.parametrize(
    "corrupt, needle",
    [
        (lambda h, s: (h, s.assign(energy_kwh=s.energy_kwh.where(s.index != 3, -5.0))), "energy_kwh"),
        (lambda h, s: (h.drop(index=10), s), "time"),
        (lambda h, s: (h.assign(moer_kg_per_kwh=h.moer_kg_per_kwh * 1000), s), "moer_kg_per_kwh"),
    ],
    ids=["negative-energy", "gap-in-hourly-index", "carbon-in-g-per-kwh"],
)
def test_bad_input_stops_before_any_output(tmp_path, corrupt, needle):
    site = make_site(days=7)
    hourly, sessions = corrupt(site.hourly.copy(), site.sessions.copy())
    site.hourly, site.sessions = hourly.reset_index(drop=True), sessions
    site_toml = write_site(site, tmp_path / "site")
    out = tmp_path / "outputs"
    result = doit(["run", "pipeline"], site_toml, out)
    assert result.returncode != 0
    message = result.stdout + result.stderr
    data_file = "sessions.parquet" if needle == "energy_kwh" else "hourly.parquet"
    assert data_file in message and needle in message, message[-3000:]
    assert files_under(out) == []


def test_bad_config_stops_before_any_output(tmp_path):
    site_toml = write_site(make_site(days=7), tmp_path / "site")
    site_toml.write_text(site_toml.read_text().replace("soc_min = 0.1", "soc_min = 0.95"))
    out = tmp_path / "outputs"
    result = doit(["run", "pipeline"], site_toml, out)
    assert result.returncode != 0
    message = result.stdout + result.stderr
    assert "bess.soc_min" in message and str(site_toml) in message, message[-3000:]
    assert files_under(out) == []
