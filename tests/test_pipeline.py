"""The study end to end through doit and Dask, on a small synthetic site with a tiny training budget.

Bad input stopping the study before any output: ``test_bad_input.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, doit, make_site, write_site

WORK_HEADER = "work of this command's Dask tasks (compute time on the workers, by kind):\n"


def _copy_project(dst):
    """The code and shipped sites of the project (what ``doit`` runs) copied to ``dst``; returns ``dst``."""
    for part in ("envs", "pipeline", "algos"):
        shutil.copytree(ROOT / part, dst / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "dodo.py", dst / "dodo.py")
    return dst


@pytest.mark.slow
def test_pipeline_end_to_end_then_up_to_date_then_a_config_change_then_retuned_after_an_env_edit(tmp_path):
    """The whole study through doit and Dask on a small synthetic site: enough train days for the learned planners
    (15) and a short test split (4 days), the ``tiny`` tuning budget, an on- and an off-policy agent. The report has
    every row on both splits, none below the oracle, the learned planners serve every car and stand beside their
    starts; a second run finds every task up to date and tunes and trains nothing; a changed site config makes what
    depends on it stale (and the same text again, up to date); an edit of a file of ``envs/`` makes the cached tuning
    stale, so ``tune`` runs CMA-ES again."""
    project = _copy_project(tmp_path / "project")  # a copy whose envs/ the test may edit
    # 15 train days (what the learned planners need), a test split of 4 of the 15 days after them
    test_days = {"test": ["2019-05-16", "2019-05-19"]}
    site_toml = write_site(make_site(days=15, n_sockets=4, mpc={"horizon_h": 6}, splits=test_days), tmp_path / "site")
    out = tmp_path / "outputs"
    env = {"EVHUB_ALGOS": "ppo,dqn", "EVHUB_TOTAL_TIMESTEPS": "1024", "EVHUB_TUNE_BUDGET": "tiny"}
    first = doit(["run", "pipeline"], site_toml, out, cwd=project, **env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "tune: seeds [1], budget 'tiny'" in first.stdout and "mpc_rl seed 1: 14 days of PPO" in first.stdout
    report = out / "synthetic" / "report"
    table = pd.read_parquet(report / "co2_comparison.parquet")
    assert {"uncontrolled", "rule_based", "oracle", "ppo", "dqn"} <= set(table.controller)
    assert set(table.split) == {"train", "test"}
    assert table.loc[table.controller == "uncontrolled", "co2_reduction_pct"].abs().max() < 1e-9
    text = (report / "report.md").read_text()
    assert "ppo" in text and "oracle" in text and f"synthetic ({site_toml})" in text
    assert any(report.glob("*.png"))
    assert any((out / "synthetic" / "runs" / "ppo_seed1").glob("events.out.tfevents.*"))
    # the run ends with its tasks' wall times, then its Dask tasks' work by kind
    clock, work = first.stdout.split("wall time of this command's tasks:\n")[1].split(WORK_HEADER)
    clock, work = clock.splitlines(), work.strip().splitlines()
    tasks = {row.split()[0] for row in clock[1:]}
    assert tasks >= {"validate", "baselines", "train:ppo", "train:dqn", "evaluate:ppo", "evaluate:dqn", "report"}
    assert tasks >= {"physics_baselines", "physics_planners", "physics_agents:ppo", "physics_agents:dqn"}
    assert clock[-1].split()[:2] == ["whole", "command"], clock
    kinds = {row.split()[0]: (int(row.split()[1]), float(row.split()[2])) for row in work[1:]}
    # 2 agents x 2 splits x (site step, 5-minute physics); the three inputs
    assert kinds["evaluate_agent"][0] == 8 and kinds["validate"][0] == 3, work
    # each simulated controller on both splits (>=: a baseline the planners stage asks for before its file is written
    # runs again)
    simulated = list((out / "synthetic" / "baselines").glob("*_test.parquet"))
    assert kinds["simulate"][0] >= 2 * len(simulated) > 0, work
    assert {"train", "run_controller", "run_window", "_report"} <= set(kinds), work
    assert kinds.pop("all")[0] == sum(n for n, _ in kinds.values()) and kinds["train"][1] > 0, work
    # every row scored again on the 5-minute site, none below that site's oracle
    physics = pd.read_parquet(report / "co2_physics_5min.parquet")
    assert sorted(zip(physics.controller, physics.split)) == sorted(zip(table.controller, table.split))
    for split, rows in physics.groupby("split"):
        oracle = rows.loc[rows.controller == "oracle", "co2_5min_kg"].iloc[0]
        assert (rows.co2_5min_kg >= oracle - 1e-6).all(), (split, rows)
    assert "## At 5-minute physics" in text
    names = ("mpc_tuned_start", "mpc_tuned", "mpc_adaptive", "mpc_rl_start", "mpc_rl")
    learned = table[table.controller.isin(names)]
    assert sorted(zip(learned.controller, learned.split)) == sorted((c, s) for c in names for s in ("test", "train"))
    assert (learned.ev_energy_served_pct > 100 - 1e-6).all() and (learned.unserved_kwh < 1e-6).all(), learned
    by = table.set_index(["controller", "split"])
    for name, start in (("mpc_tuned", "mpc_tuned_start"), ("mpc_adaptive", "mpc_tuned"), ("mpc_rl", "mpc_rl_start")):
        for split in ("train", "test"):  # each learned row beside its untrained start
            row = by.loc[(name, split)]
            assert row.start == start
            assert row.co2_vs_start_kg == pytest.approx(row.co2_kg - by.loc[(start, split), "co2_kg"])
    for _split, rows in table.groupby("split"):  # no causal row beats the oracle
        assert (rows.co2_kg >= rows.loc[rows.controller == "oracle", "co2_kg"].iloc[0] - 1e-6).all()
    tuned = out / "synthetic" / "tuned"
    summary = json.loads((tuned / "mpc_tuned_seed1.json").read_text())
    assert summary["budget"] == "tiny" and (tuned / "mpc_rl_seed1" / "policy.pt2").is_file()

    # nothing changed: every task is up to date, neither the tuning nor mpc_rl's training runs again
    second = doit(["run", "pipeline"], site_toml, out, cwd=project, **env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    for task in ("validate", "baselines", "tune:mpc_tuned", "tune:mpc_rl", "planners", "train:ppo", "evaluate:ppo"):
        assert f"-- {task}" in second.stdout, second.stdout
    assert "-- report" in second.stdout, second.stdout
    assert "tune: seeds" not in second.stdout and "days of PPO" not in second.stdout
    assert WORK_HEADER not in second.stdout  # no Dask task ran

    # a tuning that kept its start: mpc_tuned is mpc_tuned_start's run, read from the baselines' files (written for
    # the same site, data and code), not simulated again
    (tuned / "mpc_tuned_seed1.json").write_text(json.dumps({**summary, "params": summary["start"]}))
    kept = doit(["run", "planners"], site_toml, out, cwd=project, **env)
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
    for split in ("train", "test"):
        assert f"mpc_tuned seed 1 {split}: mpc_tuned_start's run" in kept.stdout, kept.stdout[-3000:]
        assert f"mpc_tuned_start {split}:" not in kept.stdout  # read, not simulated
        start = pd.read_parquet(out / "synthetic" / "baselines" / f"mpc_tuned_start_{split}.parquet")
        tuned_row = pd.read_parquet(out / "synthetic" / "planners" / f"mpc_tuned_seed1_{split}.parquet")
        rows = [start, tuned_row]
        assert rows[1].co2_kg.iloc[0] == rows[0].co2_kg.iloc[0] and rows[1].controller.iloc[0] == "mpc_tuned"

    # a changed site config makes what depends on it stale (doit's own status: R = would run, U = up to date), and
    # the same text again makes it up to date: doit compares the file's content
    stale = ("validate", "baselines", "tune:mpc_tuned", "tune:mpc_rl", "planners", "train:ppo", "evaluate:dqn")

    def status() -> dict:  # one `doit list` for all of them
        listed = doit(["list", "--status", "--all"], site_toml, out, cwd=project, **env)
        assert listed.returncode == 0, listed.stderr[-3000:]
        every = dict(reversed(line.split()[:2]) for line in listed.stdout.splitlines() if line[:2] in ("R ", "U "))
        return {task: every[task] for task in stale}

    text = site_toml.read_text()
    assert status() == dict.fromkeys(stale, "U")
    site_toml.write_text(text.replace("kwp = 10.0", "kwp = 12.0"))
    assert status() == dict.fromkeys(stale, "R")
    site_toml.write_text(text)
    assert status() == dict.fromkeys(stale, "U")

    # a comment appended to a file of envs/ (what the backtests run): the cached tuning is stale and is made again
    evhub = project / "envs" / "evhub.py"
    evhub.write_text(evhub.read_text() + "\n# an edit\n")
    third = doit(["run", "tune:mpc_tuned"], site_toml, out, cwd=project, **env)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "tune: seeds [1], budget 'tiny'" in third.stdout, third.stdout
    assert json.loads((tuned / "mpc_tuned_seed1.json").read_text())["fingerprint"] != summary["fingerprint"]


def test_the_agents_budget_and_inputs_become_their_flags_and_the_report_names_them(tmp_path, monkeypatch):
    """``agent_budget=large`` puts ``--preset gpu`` and ``agent_inputs=context`` puts ``--context-features --dc-prior``
    before the user's flags of every agent script (which still win), the defaults add nothing, an unknown name is
    refused with the known ones, and the report says which budget and inputs the agents trained with."""
    from doit import doit_cmd

    from envs.files import write_parquet
    from envs.kpis import KPI_COLUMNS
    from pipeline.study.config import from_environment
    from pipeline.study.tasks import make_report

    monkeypatch.delenv("EVHUB_AGENT_BUDGET", raising=False)
    monkeypatch.delenv("EVHUB_AGENT_INPUTS", raising=False)
    assert from_environment(site="caltech", extra_algo_args=("--compile",)).algo_args == ("--compile",)
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"agent_budget": "large", "algo_args": "--preset cpu"})
    large = from_environment(site="caltech")
    assert large.agent_budget == "large" and large.algo_args == ("--preset", "gpu", "--preset", "cpu")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"agent_budget": "huge"})
    with pytest.raises(ValueError, match=r"agent_budget='huge': unknown budget \(known: preset, large\)"):
        from_environment(site="caltech")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"agent_inputs": "context", "agent_budget": "large"})
    both = from_environment(site="caltech")
    assert both.algo_args == ("--preset", "gpu", "--context-features", "--dc-prior")
    monkeypatch.setattr(doit_cmd, "_CMDLINE_VARS", {"agent_inputs": "everything"})
    with pytest.raises(ValueError, match=r"agent_inputs='everything': unknown inputs \(known: plain, context\)"):
        from_environment(site="caltech")

    toml = write_site(make_site(days=7), tmp_path / "site")
    kpis = []
    for controller in ("uncontrolled", "rule_based", "oracle", "ppo"):
        for split in ("train", "test"):
            row = {"controller": controller, "split": split, **{k: 1.0 for k in KPI_COLUMNS}}
            kpis.append(str(write_parquet(pd.DataFrame([row]), tmp_path / "kpis" / f"{controller}_{split}.parquet")))
    for budget, said in (("large", "`large`: each script's gpu preset"), (None, "`preset`: each script's preset")):
        cfg = {"site_toml": str(toml), "algos": ["ppo"], **({"agent_budget": budget} if budget else {})}
        md = Path(make_report(cfg, kpis, {}, {}, str(tmp_path / "report"))).read_text()
        assert f"**agents' training budget**: {said}" in md, md[:3000]
        assert "**agents' inputs**: `plain`: the observation without its context features" in md, md[:3000]
    cfg = {"site_toml": str(toml), "algos": ["ppo"], "agent_inputs": "context"}
    md = Path(make_report(cfg, kpis, {}, {}, str(tmp_path / "report"))).read_text()
    assert "**agents' inputs**: `context`: the observation with its context features" in md, md[:3000]
