"""The learned planners (pipeline/control/forecast.py, backtest.py, tuning.py, learned.py, rl_planner.py): causal,
repeatable, and the tuner finds what is known to be best."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_site, write_site

from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site
from pipeline.control import learned, tuning
from pipeline.control.backtest import run_window, weeks
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.tuned import tuning_files

FAST = tuning.Budget(generations=3, popsize=4, weeks=1, sigma0=0.3, validation_weeks=1)
"""A tuning budget a test can afford (14 week backtests)."""


def _periodic_site(days: int = 21, **overrides) -> Site:
    """A synthetic site whose sessions repeat every day (the first day's, at the same hours and stations)."""
    site = make_site(days=days, n_sockets=4, **overrides)
    s = site.sessions
    tz = site.config.timezone
    first_day = s.arrival.dt.tz_convert(tz).dt.normalize().min()
    day0 = s[s.arrival.dt.tz_convert(tz).dt.normalize() == first_day]
    copies = []
    for d in range(2 * days):
        c = day0.copy()
        c["arrival"] = c.arrival + pd.Timedelta(days=d)
        c["departure"] = c.departure + pd.Timedelta(days=d)
        c["session_id"] = [f"{i}_{d}" for i in c.session_id]
        copies.append(c)
    sessions = pd.concat(copies, ignore_index=True).sort_values("arrival").reset_index(drop=True)
    return Site(site.config, site.series, sessions, dict(site.source))


def test_a_backtest_is_the_env_run_of_the_window():
    """A backtested window's CO2 is the sum of the env's CO2 over those steps, it serves its cars, and a window outside
    the split is refused."""
    site = make_site(days=16)
    data = site.split("train")
    start, steps = weeks(data)[1]
    r = run_window(site, "train", start, steps, PlannerParams(horizon_h=6))
    assert r.steps == steps == 168 and r.solves == steps and r.co2_kg > 0 and r.unserved_kwh < 1e-6
    again = run_window(site, "train", start, steps, PlannerParams(horizon_h=6).as_dict())
    assert dataclasses.replace(r, solve_s=0.0) == dataclasses.replace(again, solve_s=0.0)  # deterministic
    with pytest.raises(ValueError, match="outside split"):
        run_window(site, "train", data.num_steps - 10, 168, PlannerParams())


def test_a_site_path_is_loaded_again_when_its_files_change(tmp_path):
    """A worker keeps a site it has loaded for the content of its files, not their path: the same window backtested
    after the site's data were written anew (a re-ingest) reads the new data."""
    site = make_site(days=16, n_sockets=4, mpc={"horizon_h": 6})
    toml = write_site(site, tmp_path)
    start, steps = weeks(site.split("train"))[1]
    params = PlannerParams(horizon_h=6)
    before = run_window(toml, "train", start, steps, params)
    assert run_window(toml, "train", start, steps, params).co2_kg == before.co2_kg
    hourly = site.series.copy()
    hourly["moer_kg_per_kwh"] = (hourly["moer_kg_per_kwh"] * 2).astype(np.float32)
    write_site(Site(site.config, hourly, site.sessions, dict(site.source)), tmp_path)  # the same paths, new data
    after = run_window(toml, "train", start, steps, params)
    assert after.co2_kg > 1.5 * before.co2_kg, (before.co2_kg, after.co2_kg)


def _memo_evaluator(site: Site) -> tuple[tuning.Evaluate, list[int]]:
    """:func:`tuning.local_evaluator` that backtests each distinct ``(params, start, steps)`` once (a backtest is
    deterministic: ``test_a_backtest_is_the_env_run_of_the_window``) and counts the backtests it ran."""
    run = tuning.local_evaluator(site, "train")
    seen: dict = {}
    ran = [0]

    def evaluate(jobs):
        new = [j for j in dict.fromkeys(jobs) if j not in seen]
        seen.update(zip(new, run(new)))
        ran[0] += len(new)
        return [seen[j] for j in jobs]

    return evaluate, ran


def test_tuning_with_a_seed_is_repeatable():
    """The same seed gives the same candidates, history and result; another seed other candidates; a seed tuned
    beside others the same as alone. The backtests are memoised (each distinct window and candidate run once): what
    is under test is the tuner's sampling, and a repeated tuning then costs no backtest."""
    site = make_site(days=15, mpc={"horizon_h": 6})
    evaluate, ran = _memo_evaluator(site)

    def tune(seeds):
        return tuning.tune(site, seeds=seeds, budget=FAST, progress=lambda line: None, evaluate=evaluate)

    np.random.seed(7)
    outside = np.random.get_state()
    a = tune((3,))[0]
    after = np.random.get_state()  # cma draws from each seed's own generator, not NumPy's global one
    assert all(np.array_equal(x, y) for x, y in zip(outside, after))
    first = ran[0]
    b = tune((3,))[0]
    assert ran[0] == first  # the same candidates on the same weeks: every backtest already run
    validation = a.history.candidate.str.startswith(("start", "mean after generation"))
    assert a.params == b.params and len(a.history) - validation.sum() == FAST.generations * FAST.popsize
    assert 2 <= validation.sum() <= 1 + tuning.VALIDATED_MEANS  # the start and the distinct means validated
    assert a.params.as_dict() in [
        row[list(a.params.as_dict())].to_dict() for _, row in a.history[validation].iterrows()
    ]
    pd.testing.assert_frame_equal(a.history, b.history)
    c = tune((4,))[0]
    assert not c.history.equals(a.history)  # another seed samples other candidates
    # a seed's tuning does not depend on the seeds tuned beside it (CMA-ES runs in lockstep, one batch a generation)
    d, e = tune((4, 3))
    pd.testing.assert_frame_equal(d.history, c.history)
    pd.testing.assert_frame_equal(e.history, a.history)


def test_tuning_samples_the_integer_and_yes_no_parameters_as_integers():
    """cma's integer handling: every candidate and every validated mean has whole days and hours and a yes/no day type;
    ``decode`` refuses a point that is not one."""
    site = make_site(days=15, mpc={"horizon_h": 6})
    result = tuning.tune(site, seeds=(5,), budget=FAST, progress=lambda line: None)[0]
    h = result.history[result.history.candidate != "start"]  # the start is the site's own (horizon 6 h)
    for name in ("expected_demand_days", "horizon_h"):
        assert (h[name] == h[name].round()).all() and h[name].between(*_range(name)).all(), h[name]
    assert set(h.demand_day_type) <= {True, False} and h.demand_day_type.nunique() == 2  # both answers sampled
    start = PlannerParams.learned_start(site.config)
    with pytest.raises(ValueError, match="expected_demand_days"):
        tuning.decode(tuning.encode(start) + np.eye(len(tuning.SPACE))[1] * 0.5, start)


def _range(name: str) -> tuple[float, float]:
    p = next(p for p in tuning.SPACE if p.name == name)
    return p.low, p.high


def test_planner_env_passes_gymnasiums_env_checker(tmp_path):
    """``EVHubPlanner-v0`` (mpc_rl's day-level env) is a gymnasium env that gymnasium's own checker accepts: spaces,
    seeded resets, step's return types; and an episode is the week it says."""
    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env

    from pipeline.control import rl_planner

    site_toml = write_site(make_site(days=15, n_sockets=4, mpc={"horizon_h": 6}), tmp_path)
    env = gym.make(rl_planner.ENV_ID, site=str(site_toml))
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (len(rl_planner.OBS_NAMES),)
    days = 0
    truncated = False
    while not truncated:
        obs, reward, terminated, truncated, info = env.step(np.zeros(2, np.float32))
        days += 1
        assert np.isfinite(reward) and not terminated and info["unserved_kwh"] < 1e-6
    assert days == rl_planner.EPISODE_DAYS


def test_tuner_finds_the_demand_weight_on_a_site_whose_arrivals_repeat_daily():
    """When every day's sessions are the same, planning for the past week's mean demand is planning for the true
    demand: weight 1 is known to be best. Started from weight 0, the tuner (the weight alone) moves to it."""
    site = _periodic_site(
        days=22,
        mpc={"horizon_h": 12, "expected_demand_weight": 0.0, "expected_demand_days": 3},
        bess={"capacity_kwh": 30.0, "power_kw": 10.0},
    )
    start, steps = weeks(site.split("train"))[1]
    costs = {
        w: run_window(
            site, "train", start, steps, PlannerParams(horizon_h=12, expected_demand_days=3, expected_demand_weight=w)
        ).cost
        for w in (0.0, 1.0)
    }
    assert costs[1.0] < costs[0.0] - 1.0  # the site is one where anticipating the demand pays
    space = (tuning.Param("expected_demand_weight", 0.0, 1.0),)
    budget = tuning.Budget(generations=4, popsize=4, weeks=2, sigma0=0.4, validation_weeks=2)
    result = tuning.tune(site, seeds=(1,), budget=budget, space=space, progress=lambda line: None)[0]
    assert result.start.expected_demand_weight == 0.0
    assert result.params.expected_demand_weight > 0.5  # most of the way from 0 to the known best, 1
    validation = result.history[result.history.candidate.str.startswith(("start", "mean after generation"))]
    kept = validation.expected_demand_weight == result.params.expected_demand_weight
    assert validation.cost_kg[kept].min() == validation.cost_kg.min() < validation.cost_kg.iloc[0]  # beats the start


def test_adaptive_choice_reads_only_weeks_before_it():
    """The week-w choice of mpc_adaptive is the candidate of least mean cost over the weeks before w: changing the
    table's rows of week w and later leaves the choices up to w unchanged."""
    rng = np.random.default_rng(0)
    table = pd.DataFrame(
        [{"candidate": c, "week": w, "cost_kg": float(rng.uniform(90, 110))} for c in range(4) for w in range(12)]
    )
    later = table.copy()
    later.loc[later.week >= 7, "cost_kg"] = later.loc[later.week >= 7, "cost_kg"][::-1].to_numpy() * 0.5
    for lookback in learned.LOOKBACKS:
        a, b = learned.schedule(table, lookback), learned.schedule(later, lookback)
        assert a[0] == b[0] == 0  # week 0: mpc_tuned's parameters
        np.testing.assert_array_equal(a[:8], b[:8])
        pivot = table.pivot(index="week", columns="candidate", values="cost_kg").to_numpy()
        assert a[5] == int(np.argmin(pivot[max(0, 5 - lookback) : 5].mean(0)))


def _actions(policy, site: Site, split: str, steps: int) -> np.ndarray:
    from envs.evhub import EVHubVectorEnv

    env = EVHubVectorEnv(
        1, site=site, split=split, action_mode="socket", full_split=True, dtype=torch.float64, bess_action="setpoint"
    )
    obs, _ = env.reset(seed=0)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            a = policy(obs, env)
            out.append(a[0].numpy().copy())
            obs, *_ = env.step(a)
    return np.array(out)


def _changed_after(site: Site, split: str, k: int) -> Site:
    """``site`` with the MOER, its forecasts (the 5-minute columns too) and the sessions of ``split`` changed after
    step ``k``."""
    data = site.split(split)
    cut = data.time[k + 1]
    hourly = site.series.copy()
    late = hourly.time >= cut
    for c in ("moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2", *MOER_5MIN_COLUMNS):
        hourly.loc[late, c] = (hourly.loc[late, c].to_numpy()[::-1] * 1.7).astype(np.float32)
    s = site.sessions
    sessions = s[s.arrival < cut].reset_index(drop=True)
    return Site(site.config, hourly, sessions, dict(site.source))


def test_learned_planners_are_causal(tmp_path):
    """Changing the test split after step k (MOER, forecasts, 5-minute values, sessions: what the forecaster with
    forgetting, the weekly re-tuning and the daily policy read) leaves mpc_tuned's, mpc_adaptive's and mpc_rl's
    actions up to step k unchanged."""
    from pipeline.control.rl_planner import OBS_NAMES, DailyPolicyPlanner

    weights = torch.linspace(-1.0, 1.0, 2 * len(OBS_NAMES), dtype=torch.float32).reshape(len(OBS_NAMES), 2)

    def day_policy(x, env):  # a fixed day-level policy that reads every observation feature
        return torch.tanh(x.to(torch.float32) @ weights)

    site = make_site(days=22, n_sockets=4, mpc={"horizon_h": 6})
    hourly = site.series.copy()  # the 5-minute columns of a WattTime source: here the hour's MOER, slightly off
    for i, c in enumerate(MOER_5MIN_COLUMNS):
        hourly[c] = (hourly["moer_kg_per_kwh"] * (0.98 + 0.003 * i)).astype(np.float32)
    site = Site(site.config, hourly, site.sessions, dict(site.source))
    k = 2 * 168 + 30  # in the third week: its choice reads the two weeks before
    changed = _changed_after(site, "test", k)
    tuned = PlannerParams(
        horizon_h=6, expected_demand_weight=0.5, demand_day_type=True, moer_half_life_days=3.0, moer_five_minute=True
    )
    cands = learned.candidates(tuned)
    runs = []
    for s in (site, changed):
        table = learned.week_table(s, "test", cands)
        chosen = learned.schedule(table, 2)
        runs.append(
            {
                "tuned": _actions(MPCController(s.split("test"), tuned, presolve=False), s, "test", k + 1),
                "adaptive": _actions(learned.AdaptivePlanner(s.split("test"), cands, chosen), s, "test", k + 1),
                "rl": _actions(DailyPolicyPlanner(s, "test", day_policy, tuned), s, "test", k + 1),
                "chosen": chosen,
            }
        )
    np.testing.assert_array_equal(runs[0]["chosen"][:3], runs[1]["chosen"][:3])
    for name in ("tuned", "adaptive", "rl"):
        np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)


def test_expected_demand_by_day_type_reads_the_last_days_of_the_same_type():
    """With ``demand_day_type`` an hour of a Saturday expects the sessions of the last Sunday and Saturday before it,
    an hour of a Friday those of Thursday and Wednesday (2 days each), every one of them realised by then."""
    site = make_site(days=21)
    data = site.split("train")
    local = data.time.tz_convert(site.config.timezone)
    t = int(np.flatnonzero((local.day_of_week == 4) & (local.hour == 20))[1])  # the second Friday, 20:00
    mpc = MPCController(
        data, PlannerParams(24, expected_demand_days=2, expected_demand_weight=1.0, demand_day_type=True)
    )
    used: dict[int, list[int]] = {}
    for shift, (share, ks) in mpc._same_day_type_sources(t, 24):
        j = (t - shift) // 24
        assert share == pytest.approx(0.5) and (t - shift) % 24 == 0
        for k in ks:
            assert t + k - j * 24 <= t  # realised by t
            used.setdefault(int(k), []).append(int(j))
    assert sorted(used) == list(range(1, 24))
    for k, js in used.items():
        target = local[t + k]
        assert len(js) == 2
        expected = [1, 2] if target.day_of_week < 5 else ([6, 7] if target.day_of_week == 5 else [1, 7])
        assert sorted(js) == expected, (k, target, js)
    # the flat expected demand (the shipped mpc's) is not changed by the option's existence
    flat = MPCController(data, PlannerParams(24, expected_demand_days=2, expected_demand_weight=1.0))
    plugged = (np.zeros(data.config.ev.n_sockets), np.zeros(data.config.ev.n_sockets, dtype=np.int64))
    a, b = flat.sessions(t, 24, *plugged), mpc.sessions(t, 24, *plugged)
    assert not np.array_equal(np.sort(a.arrival), np.sort(b.arrival)) or not np.allclose(
        np.sort(a.energy_kwh), np.sort(b.energy_kwh)
    )


def test_the_day_policys_action_range_sits_around_its_centre(monkeypatch):
    """``mpc_rl``'s action moves the weight and the terminal value ``width`` either side of a centre: by default
    :func:`base_params` (weight 0.5, terminal value 1) over the whole ranges, bit for bit the mapping ``(a0 + 1) / 2``,
    ``1 + a1 / 2``; with ``EVHUB_PLANNER_CENTRE`` / ``EVHUB_PLANNER_WIDTH`` around those, clipped to the ranges, and
    the centre's other parameters kept. A bad centre or width is refused by name."""
    import json

    from pipeline.control import rl_planner

    site = make_site(days=9, n_sockets=3)
    base, width = rl_planner.centre(site)
    assert base == rl_planner.base_params(site) and width == rl_planner.WIDTH
    assert rl_planner.start_params(site) == rl_planner.day_params(base, np.zeros(2))
    for a in np.random.default_rng(0).uniform(-1, 1, (200, 2)).astype(np.float32):
        p = rl_planner.day_params(base, a)
        a64 = a.astype(np.float64)
        assert p.expected_demand_weight == (a64[0] + 1.0) / 2.0 and p.terminal_value == 1.0 + a64[1] / 2.0
    tuned = dataclasses.replace(base, expected_demand_weight=0.9, terminal_value=0.6, horizon_h=30, moer_bias=0.05)
    monkeypatch.setenv("EVHUB_PLANNER_CENTRE", json.dumps(tuned.as_dict()))
    monkeypatch.setenv("EVHUB_PLANNER_WIDTH", "0.25")
    c, w = rl_planner.centre(site)
    assert c == tuned and w == 0.25
    assert rl_planner.day_params(c, np.zeros(2), w) == tuned
    hi, lo = rl_planner.day_params(c, np.ones(2), w), rl_planner.day_params(c, -np.ones(2), w)
    # 1.15 clipped to the weight's range, 0.35 to the terminal value's
    assert (hi.expected_demand_weight, hi.terminal_value) == pytest.approx((1.0, 0.85), abs=1e-12)
    assert (lo.expected_demand_weight, lo.terminal_value) == pytest.approx((0.65, 0.5), abs=1e-12)
    assert hi.horizon_h == lo.horizon_h == 30 and hi.moer_bias == 0.05
    monkeypatch.setenv("EVHUB_PLANNER_CENTRE", "")  # empty, as the study sets them: the shipped range
    monkeypatch.setenv("EVHUB_PLANNER_WIDTH", "")
    assert rl_planner.centre(site) == (rl_planner.base_params(site), rl_planner.WIDTH)
    monkeypatch.setenv("EVHUB_PLANNER_WIDTH", "0")
    with pytest.raises(ValueError, match="EVHUB_PLANNER_WIDTH"):
        rl_planner.centre(site)
    monkeypatch.setenv("EVHUB_PLANNER_WIDTH", "0.25")
    monkeypatch.setenv("EVHUB_PLANNER_CENTRE", '{"expected_demand_wieght": 0.5}')
    with pytest.raises(ValueError, match="EVHUB_PLANNER_CENTRE"):
        rl_planner.centre(site)


def test_a_tuning_that_kept_its_start_gives_mpc_tuned_the_starts_run(tmp_path):
    """Where the tuning ended at ``mpc_tuned_start``'s parameters, the study writes that run as ``mpc_tuned``'s
    (``tasks.run_as``, when the baseline's file names the inputs it was computed from): equal, row and traces, to
    simulating ``mpc_tuned`` itself."""
    import json

    from pipeline.study import tasks

    site = make_site(days=10, n_sockets=4, mpc={"horizon_h": 6})
    toml = str(write_site(site, tmp_path / "site"))
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    start = PlannerParams.learned_start(site.config)
    tuning_files(tuned, 2)[0].write_text(json.dumps({"params": start.as_dict()}))
    assert tuning.kept_start(tuned, 2, site.config)
    files = tasks.run_controller(toml, "mpc_tuned_start", "test", str(tmp_path / "baselines"), inputs="key 1")
    assert tasks.run_inputs(files) == "key 1"  # what the planners stage checks before it shares the run
    assert tasks.run_inputs([files[0], tmp_path / "missing.parquet"]) is None
    shared = tasks.run_as(files, "mpc_tuned", "test", str(tmp_path / "shared"), 2)
    assert tasks.run_inputs(shared) is None
    own = tasks.run_controller(toml, "mpc_tuned", "test", str(tmp_path / "own"), seed=2, tuned_dir=str(tuned))
    for a, b in zip(shared, own):
        pd.testing.assert_frame_equal(pd.read_parquet(a), pd.read_parquet(b))
    tuning_files(tuned, 2)[0].write_text(
        json.dumps({"params": dataclasses.replace(start, expected_demand_weight=0.5).as_dict()})
    )
    assert not tuning.kept_start(tuned, 2, site.config)
