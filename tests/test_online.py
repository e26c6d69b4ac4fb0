"""The online agents (``pipeline/study/online.py``): training windows that end where asked, a fine-tuning that starts
from another run's networks, and the online agent's causality (changing the data after a step leaves its actions up to
that step unchanged)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DQN_TINY, load_algo, make_site, write_site

from algos import harness
from envs.evhub import EVHubVectorEnv
from envs.site import Site


def test_training_windows_end_where_asked():
    site = make_site(days=21)
    env = EVHubVectorEnv(64, site=site, split="test", episode_steps=48, window_end=200)
    starts = []
    for seed in range(10):
        env.reset(seed=64 * seed)  # 640 streams of their own
        starts += env.t.tolist()
    assert min(starts) == 0 and 140 <= max(starts) <= 200 - 48  # starts over all that fit, none after
    for _ in range(60):  # windows that end and restart stay inside too
        env.step(torch.zeros(64, 2))
        assert int(env.t.max()) < 200
    for bad in (47, 21 * 24 + 1):
        with pytest.raises(ValueError, match=f"window_end={bad} must lie in"):
            EVHubVectorEnv(2, site=site, split="test", episode_steps=48, window_end=bad)


def _dqn(*argv: str):
    dqn = load_algo("dqn")
    return dqn, harness.cli(dqn.Args, dqn.PRESETS, dqn.ENV_DEFAULTS, list(argv))


def test_init_from_starts_from_the_runs_networks(tmp_path):
    toml = write_site(make_site(days=14), tmp_path / "site")
    common = ["--site", str(toml), "--eval-split", "none", "--no-norm-obs", *DQN_TINY]
    dqn, args = _dqn(*common, "--output-dir", str(tmp_path / "a"), "--total-timesteps", "160")
    dqn.main(args)
    # fewer steps than learning_starts: no gradient step, so the networks are the ones it started from
    _, args = _dqn(*common, "--output-dir", str(tmp_path / "b"), "--total-timesteps", "16", "--init-from",
                   str(tmp_path / "a"))  # fmt: skip
    result = dqn.main(args)
    assert result["global_step"] == 16  # its own counters
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    for name in ("qnet", "target"):
        assert a[name].keys() == b[name].keys()
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])
    fresh = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)  # a run from scratch differs
    _, args = _dqn(*common, "--output-dir", str(tmp_path / "c"), "--total-timesteps", "16", "--seed", "2")
    dqn.main(args)
    c = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=False)
    assert not all(torch.equal(fresh["qnet"][k], c["qnet"][k]) for k in fresh["qnet"])
    # networks of another size: a clear error naming the file
    _, args = _dqn(*common, "--hidden-size", "8", "--output-dir", str(tmp_path / "d"), "--total-timesteps", "16",
                   "--init-from", str(tmp_path / "a"))  # fmt: skip
    with pytest.raises(harness.CheckpointError, match=r"--init-from .*a/checkpoint.pt: it does not fit"):
        dqn.main(args)


def _changed_after(site: Site, split: str, k: int) -> Site:
    """``site`` with the MOER and the sessions of ``split`` from step ``k + 1`` on changed."""
    start = site.split(split).time[k + 1]  # UTC
    hourly = site.series.copy()
    later = hourly.time >= start
    hourly.loc[later, ["moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]] *= 3.0
    sessions = site.sessions.copy()
    sessions = sessions[pd.to_datetime(sessions.arrival) < start]  # the later sessions never come
    return Site(site.config, hourly, sessions.reset_index(drop=True), dict(site.source))


def _acts_on_the_past_alone(tmp_path, algo: str, run: str, site: Site, k: int, steps: int, weeks: list[str]) -> None:
    """``<algo>_online`` over the test split of ``site`` as it is and with its data after step ``k`` changed: both runs
    fine-tune in ``weeks`` (their week folders), and every action up to step ``k`` is the same while later ones
    differ."""
    from pipeline.study import online

    traces = {}
    for name, s in (("as is", site), ("changed", _changed_after(site, "test", k))):
        path = str(write_site(s, tmp_path / f"site {name}"))
        files = online.evaluate_online(algo, 1, run, path, "test", str(tmp_path / name), str(tmp_path / name), steps)
        traces[name] = pd.read_parquet(files[1])
        row = pd.read_parquet(files[0]).iloc[0]
        assert row.controller == f"{algo}_online" and row.update_s > 0 and row.ev_energy_served_pct > 99.9
        assert sorted(p.parent.name for p in (tmp_path / name / f"{algo}_test_seed1").glob("week*/policy.pt2")) == weeks
    a, b = traces["as is"], traces["changed"]
    acted = ["bess_charge_kw", "bess_discharge_kw", "ev_charge_kw"]
    pd.testing.assert_frame_equal(a.iloc[: k + 1][acted], b.iloc[: k + 1][acted])  # up to step k: the same
    assert not a.iloc[k + 1 :][acted].equals(b.iloc[k + 1 :][acted])  # after it: the change is seen


@pytest.mark.slow
def test_the_online_agent_acts_on_the_past_alone(tmp_path):
    """Weeks of 168 steps: the fine-tunings at steps 168 and 336 read the windows before them; the data after step
    336 changed leave every action up to step 336 as it was, and change later ones."""
    from pipeline.study import tasks

    site = make_site(days=21)
    toml = write_site(site, tmp_path / "site")
    tiny = ("--learning-starts", "64", "--num-envs", "4", "--hidden-size", "16", "--buffer-size", "2000")
    run = tasks.train_agent("dqn", 1, str(toml), str(tmp_path / "run"), 800, tiny, echo=False)
    _acts_on_the_past_alone(tmp_path, "dqn", run, site, 336, 1500, ["week001", "week002"])


def test_planner_episodes_lie_in_the_window_asked(tmp_path, monkeypatch):
    """``EVHubPlanner-v0``'s episodes start at local midnights from the split's second week on and end (with the one
    step the env reads after them) by the window's end: what ``mpc_rl_online``'s fine-tunings read of the past."""
    from pipeline.control import rl_planner

    site = make_site(days=29, n_sockets=4, mpc={"horizon_h": 6})
    toml = write_site(site, tmp_path / "site")
    day = 24
    assert rl_planner.episode_starts(site, "test", 0, 336).size == 0  # no whole week after the first before 336
    np.testing.assert_array_equal(rl_planner.episode_starts(site, "test", 0, 504), np.arange(168, 313, day))
    np.testing.assert_array_equal(rl_planner.episode_starts(site, "test", 200, 673), np.arange(216, 505, day))
    monkeypatch.setenv("EVHUB_PLANNER_SPLIT", "test")
    monkeypatch.setenv("EVHUB_PLANNER_WINDOW", "300:600")
    env = rl_planner.PlannerEnv(str(toml))
    assert env.split == "test"
    np.testing.assert_array_equal(env.starts, [312, 336, 360, 384, 408])
    assert all(s % day == 0 and s + 7 * day + 1 <= 600 for s in env.starts)
    with pytest.raises(ValueError, match=r"no whole week after its first within steps \[0, 300\)"):
        rl_planner.PlannerEnv(str(toml), window=(0, 300))
    monkeypatch.setenv("EVHUB_PLANNER_WINDOW", "600:300")
    with pytest.raises(ValueError, match="EVHUB_PLANNER_WINDOW='600:300'"):
        rl_planner.PlannerEnv(str(toml))


@pytest.mark.slow
def test_the_online_planner_acts_on_the_past_alone(tmp_path):
    """``mpc_rl_online`` on a 29-day test split: its day-level policy is fine-tuned at steps 504 and 672 (the weeks
    with a whole backtest week of the split's past before them) from ``mpc_rl``'s run; the data after step 600
    changed leave every action up to step 600 as it was, and change later ones."""
    from pipeline.study import tasks

    site = make_site(days=29, n_sockets=4, mpc={"horizon_h": 6})
    toml = write_site(site, tmp_path / "site")
    run = tasks.train_rl_planner(str(toml), 1, str(tmp_path / "run"), 14)
    _acts_on_the_past_alone(tmp_path, "mpc_rl", run, site, 600, 14, ["week003", "week004"])


def test_every_online_form_has_its_fine_tuning_budget():
    """The study's list of online forms (which names the ``online`` task's files) and the online module's budgets
    name the same controllers."""
    from pipeline.study import online, results

    assert tuple(online.FINE_TUNE_STEPS) == results.ONLINE_FORMS
    assert results.online_algos(("ppo", "sac", "a2c", "dqn", "mpc_rl")) == ("ppo", "dqn")
