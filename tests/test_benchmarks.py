"""The training, speed-switch, profile, checkpoint and report benchmarks at tiny sizes (no timing assertions)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import make_site, write_site

from benchmarks import profile, report, switches, training

REFERENCE = {"uncontrolled_kg": 1806.4, "oracle_kg": 511.2}  # test split, from the study's report


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    curve = pd.DataFrame(
        {
            "global_step": [10, 20, 30, 40],
            "train_wall_s": [1.0, 2.0, 3.0, 4.0],
            "co2_kg": [1500.0, 1100.0, 1200.0, 900.0],
        }
    )
    assert training.time_to_target(curve, 1158.8) == (2.0, 20.0)
    assert training.time_to_target(curve, 900.0) == (4.0, 40.0)
    t, s = training.time_to_target(curve, 800.0)
    assert math.isnan(t) and math.isnan(s)


@pytest.mark.slow
def test_sb3_and_ours_runs_produce_eval_curves(tmp_path):
    """Each library's run on a two-week synthetic site (``--site``): its evaluations over the site's test split are
    off the training clock, its curve ends at the budget."""
    site = str(write_site(make_site(days=14, n_sockets=6), tmp_path / "site"))
    runs = (
        ("sb3_sac_study", 300, 60.0, 150),
        ("ours_ppo_study", 8192, 0.0, 4096),
        ("ours_sac_preset", 640, 0.0, 320),
    )
    results = {}
    for name, steps, secs, every in runs:
        results[name] = training.run_one(name, "cpu", steps, secs, every, seed=1, out_dir=tmp_path, site=site)
    for name, steps, _, _ in runs:
        res = results[name]
        curve = pd.DataFrame(res["curve"])
        assert res["env_steps"] == steps
        assert res["sps"] > 0 and res["train_wall_s"] > 0 and res["peak_rss_mb"] > 0
        assert len(curve) == 2 and curve.global_step.iloc[-1] == steps
        assert curve.train_wall_s.is_monotonic_increasing
        assert curve.train_wall_s.iloc[-1] <= res["train_wall_s"] + 1e-6  # evaluations are off the clock
        assert ((curve.co2_kg > 0) & (curve.co2_kg < 5000)).all()
    assert [results[n]["num_envs"] for n, *_ in runs] == [1, 8, 32]


@pytest.mark.slow
def test_training_run_writes_its_tables(tmp_path):
    site = str(write_site(make_site(days=14, n_sockets=6), tmp_path / "site"))
    summary, curves = training.run(
        ["ours_ppo_study"], "cpu", scale=0.0205, out_dir=tmp_path, reference=REFERENCE, site=site
    )
    r = summary.iloc[0]
    assert r.status == "ok" and r.config == "ours_ppo_study" and r.num_envs == 8
    target = REFERENCE["uncontrolled_kg"] - 0.5 * (REFERENCE["uncontrolled_kg"] - REFERENCE["oracle_kg"])
    assert r.target_co2_kg == pytest.approx(target)
    assert r.best_co2_kg == pytest.approx(curves.co2_kg.min())
    assert math.isnan(r.sps_vs_sb3)  # no SB3 run of PPO in this table
    reached = math.isfinite(r.time_to_target_s)
    assert reached == bool((curves.co2_kg <= target).any())
    back = pd.read_parquet(tmp_path / "training.parquet")
    pd.testing.assert_frame_equal(back, summary)
    assert (tmp_path / "training_curves.parquet").is_file()
    assert "| ours_ppo_study | cpu | 8 |" in training.markdown(summary)


def test_training_rejects_unknown_or_misplaced_configs(tmp_path):
    with pytest.raises(ValueError, match="unknown training benchmark config"):
        training.run(["ours_dqn_study"], "cpu", out_dir=tmp_path, reference=REFERENCE)
    with pytest.raises(ValueError, match="does not run on 'cpu'"):
        training.run(["ours_ppo_gpu_max"], "cpu", out_dir=tmp_path, reference=REFERENCE)


@pytest.mark.slow
def test_switches_on_cpu_measure_eager_and_skip_cuda_graphs(tmp_path):
    df = switches.run(["a2c"], ["eager", "compile+cudagraphs"], "cpu", scale=0.05, out_dir=tmp_path)
    assert list(df.switches) == ["eager", "compile+cudagraphs"]
    eager, graphs = df.iloc[0], df.iloc[1]
    assert eager.status == "ok" and eager.sps > 0 and eager.sps_steady > 0 and eager.speedup_vs_eager == 1.0
    assert eager.env_steps > 0 and eager.num_envs == 128
    assert graphs.status.startswith("skipped") and math.isnan(graphs.sps)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "switches.parquet"), df)
    with pytest.raises(ValueError, match="unknown switch set"):
        switches.run(["a2c"], ["turbo"], "cpu", out_dir=tmp_path)


def test_env_profile_on_cpu(tmp_path):
    df = profile.run(("env",), "cpu", num_envs=8, out_dir=tmp_path)
    r = df.iloc[0]
    assert r.target == "env_eager" and r.num_envs == 8 and r.wall_s > 0
    assert r.ops_per_step > 50  # eager: one host call per operator of the step
    assert r.kernel_launches == 0 and math.isnan(r.gpu_busy_pct)  # no CUDA here
    assert "aten::" in (tmp_path / "profile_env_cpu.txt").read_text()
    with pytest.raises(ValueError, match="unknown profile target"):
        profile.run(("snake",), "cpu", out_dir=tmp_path)


@pytest.mark.slow
def test_the_compiled_env_step_is_a_handful_of_host_calls(tmp_path):
    compiled = profile.run(("env_compile",), "cpu", num_envs=8, out_dir=tmp_path).iloc[0]
    eager = profile.run(("env_eager",), "cpu", num_envs=8, out_dir=tmp_path).iloc[0]
    assert compiled.ops_per_step <= 20 < eager.ops_per_step / 10, (compiled.ops_per_step, eager.ops_per_step)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        profile.run(("env_cudagraph",), "cpu", num_envs=8, out_dir=tmp_path)


def test_report_checks_targets_against_the_tables(tmp_path):
    env = pd.DataFrame(
        {
            "impl": ["ours", "sb3_dummy"],
            "num_envs": [256, 256],
            "steps_per_s": [3e5, 3e3],
            "speedup_vs": [1.0, 100.0],
            "status": ["ok", "ok"],
        }
    )
    tr = pd.DataFrame(
        {
            "config": ["sb3_ppo_study", "ours_ppo_preset"],
            "library": ["sb3", "ours"],
            "algo": ["ppo", "ppo"],
            "sps": [1000.0, 8000.0],
            "sps_vs_sb3": [1.0, 8.0],
            "status": ["ok", "ok"],
        }
    )
    env.to_parquet(tmp_path / "env_throughput.parquet")
    tr.to_parquet(tmp_path / "training.parquet")
    t = report.targets(tmp_path)
    assert list(t.met) == [True, False, None]  # 100x >= 50x met; 8x < 10x missed; no compiled env row
    assert t.measured.iloc[1] == "8.0x"
    graphed = pd.DataFrame(
        {
            "impl": ["ours", "ours_compile"],
            "num_envs": [4096, 4096],
            "steps_per_s": [1e5, 3e5],
            "speedup_vs": [1.0, 1 / 3],
            "status": ["ok", "ok"],
        }
    )
    pd.concat([env, graphed]).to_parquet(tmp_path / "env_throughput.parquet")
    t = report.targets(tmp_path)
    assert t.met.iloc[2] == True and t.measured.iloc[2] == "3.0x"  # noqa: E712  # compiled 3x the eager step at 4,096 envs
    sw = pd.DataFrame(
        {"algo": ["sac"], "switches": ["compile+cudagraphs"], "speedup_vs_eager": [np.nan], "status": ["failed: x"]}
    )
    sw.to_parquet(tmp_path / "switches_cuda.parquet")
    t = report.targets(tmp_path)
    assert t.measured.iloc[-1] == "not measured" and t.met.iloc[-1] is None


def test_checkpoint_benchmark_rebuilds_the_buffer_it_measures(tmp_path):
    from benchmarks import checkpoint

    site = write_site(make_site(days=3, n_sockets=4), tmp_path / "site")
    table = checkpoint.run(
        checkpoint.Args(
            site=str(site), presets=("cpu",), repeats=1, replay=True, num_envs=4, buffer_size=50, out_dir=str(tmp_path)
        )
    )
    assert list(table.algo) == ["dqn", "sac"] and (tmp_path / "checkpoint.parquet").is_file()
    assert (table.log_mb < table.rows_mb).all() and (table.rebuild_env_steps >= 50 // 4).all()


def test_ppo_vs_sb3_trains_both_alike_and_tabulates(tmp_path):
    pytest.importorskip("stable_baselines3")
    from benchmarks import ppo_vs_sb3

    evhub = ppo_vs_sb3.sb3_kwargs(ppo_vs_sb3.ours_args("EVHub-v0", 1))  # discounts per 15-minute step, as ours
    assert evhub["gamma"] == pytest.approx(0.98**0.25) and evhub["normalize"]["gamma"] == evhub["gamma"]
    assert evhub["gae_lambda"] == pytest.approx(0.95**0.25) and evhub["batch_size"] == 256
    rows, small = [], {"num_steps": 128, "num_minibatches": 8}
    for library in ppo_vs_sb3.LIBRARIES:  # one rollout each (4 envs x 128 steps), one evaluation episode
        row = ppo_vs_sb3.run_one(library, "Pendulum-v1", 1, 1e-6, 1, tmp_path, small)
        assert row["env_steps"] == 512 and row["sps"] > 0 and -2000 < row["eval_return"] <= 0
        assert json.loads(row["settings"])["batch_size"] == 64
        rows.append(row | {"status": "ok", "machine": ""})
    assert rows[0]["settings"] == rows[1]["settings"]
    table = ppo_vs_sb3.runs_table(rows + [rows[1] | {"seed": 2, "eval_return": -100.0}])
    s = ppo_vs_sb3.summary(table).set_index("library")
    assert s.loc["ours", "sps_vs_sb3"] == pytest.approx(rows[0]["sps"] / rows[1]["sps"])
    assert s.loc["ours", "verdict"] in ("within", "above", "below") and s.loc["sb3", "return_max"] == -100.0
    assert "| Pendulum-v1 | ours | 1 | 512 |" in ppo_vs_sb3.markdown(table)
    with pytest.raises(ValueError, match="unknown library"):
        ppo_vs_sb3.run_one("sb2", "Pendulum-v1", 1)
