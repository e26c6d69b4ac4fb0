"""The site at steps below the hour (15 and 5 minutes) and its physics at 5 minutes: the step is checked where it is
set, the env's invariants hold at every step (energy balance, batched equals single, causality), and a controller's
decisions held over a finer physics are what the env documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_site, observations, perturbed_future

from envs import timestep
from envs.config import ConfigError, config_from_dict
from envs.evhub import INFO_KEYS, EVHubEnv, EVHubVectorEnv
from envs.kpis import BALANCE_TOL, balance_residual, evaluate_policy
from pipeline.control.baselines import rule_based, uncontrolled

STEPS = (0.25, 5 / 60)
"""The steps below the hour checked here: 15 and 5 minutes."""


# --------------------------------------------------------------------------------------------- the step


@pytest.mark.parametrize("dt_h", [0.3, 7 / 60, 0.0, -0.25, 2.0, 1 / 120])
def test_a_step_that_does_not_divide_the_hour_is_refused_naming_the_key(dt_h):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"dt_h": dt_h}, "site.toml")
    msg = str(info.value)
    assert "site.toml" in msg and "'dt_h'" in msg
    if dt_h > 0:
        assert "divide the hour" in msg or "whole minutes" in msg


@pytest.mark.parametrize("written, minutes", [(1.0, 60), (0.5, 30), (0.25, 15), (0.0833333, 5), (1 / 12, 5)])
def test_a_step_is_read_to_any_precision_and_kept_exact(written, minutes):
    cfg = config_from_dict({"dt_h": written}, "site.toml")
    assert cfg.dt_h == minutes / 60
    assert timestep.step_minutes(cfg.dt_h) == minutes


def test_the_episode_is_set_in_hours_and_the_old_key_is_named():
    assert config_from_dict({"dt_h": 0.25}, "s").episode_steps == 168 * 4
    assert config_from_dict({"dt_h": 1.0, "episode": {"train_h": 48}}, "s").episode_steps == 48
    with pytest.raises(ConfigError, match=r"episode\.train_steps.*replaced by episode\.train_h"):
        config_from_dict({"episode": {"train_steps": 168}}, "s")


def test_durations_in_hours_become_steps_in_one_place():
    assert [timestep.steps_per_day(d) for d in (1.0, 0.25, 5 / 60)] == [24, 96, 288]
    assert timestep.steps(24, 0.25) == 96 and timestep.steps(0.1, 1.0) == 1
    assert timestep.per_step(0.99, 0.25) ** 4 == pytest.approx(0.99, rel=1e-12)
    assert timestep.substeps(0.25, 5 / 60) == 3
    with pytest.raises(timestep.StepError):
        timestep.substeps(5 / 60, 0.25)


# --------------------------------------------------------------------------------------- the env's invariants


@pytest.fixture(scope="module", params=STEPS, ids=["15min", "5min"])
def fine(request):
    return make_site(days=4, dt_h=request.param)


@pytest.mark.parametrize("action_mode", ["hub", "socket"])
def test_energy_balance_under_random_actions(fine, action_mode):
    num_envs = 16
    env = EVHubVectorEnv(num_envs, site=fine, action_mode=action_mode, dtype=torch.float64)
    env.reset(seed=3)
    gen = torch.Generator().manual_seed(0)
    b, dt = fine.config.bess, fine.config.dt_h
    for _ in range(3 * env.episode_steps // 2):  # crosses an episode's end
        a = torch.rand(num_envs, env.single_action_space.shape[0], generator=gen, dtype=torch.float64) * 2.4 - 1.2
        before = env.energy_kwh.clone()
        _, reward, _, truncated, info = env.step(a)
        assert balance_residual(info).max() < 1e-9
        expected = before + (b.eta_charge * info["bess_charge_kw"] - info["bess_discharge_kw"] / b.eta_discharge) * dt
        assert torch.allclose(env.energy_kwh[~truncated], expected[~truncated], atol=1e-9)
        assert (reward <= 0).all()


@pytest.mark.parametrize("action_mode", ["hub", "socket"])
def test_batched_env_equals_single_envs(fine, action_mode):
    n = 3
    starts = [0, 9, 40]
    vec = EVHubVectorEnv(n, site=fine, action_mode=action_mode, dtype=torch.float64)
    obs_v, _ = vec.reset(options={"start_steps": starts})
    singles = [EVHubEnv(site=fine, action_mode=action_mode) for _ in range(n)]
    obs_s = [e.reset(seed=i, options={"start_step": s})[0] for i, (e, s) in enumerate(zip(singles, starts))]
    np.testing.assert_allclose(obs_v.numpy(), np.stack(obs_s), rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(1)
    for _ in range(80):
        a = rng.uniform(-1, 1, (n, vec.single_action_space.shape[0]))
        _, rew_v, _, trunc_v, info_v = vec.step(torch.as_tensor(a))
        for i, e in enumerate(singles):
            _, r, _, tr, info = e.step(a[i].astype(np.float32).astype(np.float64))
            assert not tr and r == pytest.approx(float(rew_v[i]), rel=1e-5, abs=1e-7)
            for k in INFO_KEYS:
                assert info[k] == pytest.approx(float(info_v[k][i]), rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("dt_h", STEPS, ids=["15min", "5min"])
def test_future_changes_no_observation_up_to_then(dt_h):
    site = make_site(days=6, dt_h=dt_h)
    cut = timestep.steps(30, dt_h)  # 30 hours into the test split
    future = perturbed_future(site, "test", cut)
    kw = dict(num_envs=1, full_split=True, action_mode="socket", bess_action="surplus")
    a = observations(site, "test", cut + 24, **kw)
    b = observations(future, "test", cut + 24, **kw)
    torch.testing.assert_close(a[: cut + 1], b[: cut + 1], rtol=0, atol=0)
    assert not torch.equal(a[cut + 1 :], b[cut + 1 :]), "the perturbation must reach the observation afterwards"


def test_the_observation_reads_hours_at_every_step():
    """A car's time to departure and the MOER of the last hour are read in hours: a car leaving in 6 hours reads 6/24
    at 60, 15 and 5-minute steps."""
    for dt in (1.0, 0.25, 5 / 60):
        env = EVHubVectorEnv(1, site=make_site(days=3, dt_h=dt), dtype=torch.float64)
        env.reset(seed=0, options={"start_steps": [0]})
        env.ev_steps_left[0, 0] = timestep.steps(6, dt)
        env.ev_need_kwh[0, 0] = 5.0
        layout = env.observation_layout["sockets"]
        n = env.n_sockets
        assert float(env._observe()[0, layout[2 * n]]) == pytest.approx(6 / 24)


# ---------------------------------------------------------------------------- the physics at 5 minutes


@pytest.mark.parametrize("dt_h", [1.0, 0.25], ids=["60min", "15min"])
def test_uncontrolled_at_five_minute_physics_is_the_same_whatever_the_step(dt_h):
    """Held full power is full power: the uncontrolled site simulated at 5 minutes is the same whether its (trivial)
    decisions come every hour, every 15 minutes or every 5 minutes; a controller that decides is not (rule_based)."""
    five = make_site(days=4, dt_h=5 / 60)
    coarse = make_site(days=4, dt_h=dt_h)
    k5, t5 = evaluate_policy(uncontrolled, five, "train", "u")
    kc, tc = evaluate_policy(uncontrolled, coarse, "train", "u", physics_dt_h=5 / 60)
    assert kc.co2_kg.iloc[0] == pytest.approx(k5.co2_kg.iloc[0], rel=1e-12)
    assert kc.ev_energy_delivered_kwh.iloc[0] == pytest.approx(k5.ev_energy_delivered_kwh.iloc[0], rel=1e-12)
    assert kc.sessions_rejected.iloc[0] == k5.sessions_rejected.iloc[0]
    assert len(tc) == coarse.split("train").num_steps and balance_residual(tc).max() < BALANCE_TOL
    r5, _ = evaluate_policy(rule_based, five, "train", "r", action_mode="hub", bess_action="setpoint")
    rc, _ = evaluate_policy(rule_based, coarse, "train", "r", physics_dt_h=5 / 60)
    assert rc.co2_kg.iloc[0] != pytest.approx(r5.co2_kg.iloc[0], rel=1e-9)


def test_a_finer_physics_holds_the_decision_and_serves_the_cars():
    """Decisions held over 5-minute sub-steps: balance in every step, each car's energy served (the floors at the
    sub-steps), a battery set-point never exceeded, and the step's CO2 the sum of its sub-steps'."""
    site = make_site(days=4, dt_h=0.25)
    hold = lambda obs, env: torch.tensor([[0.4] + [0.2] * env.n_sockets], dtype=obs.dtype)  # noqa: E731
    k, tr = evaluate_policy(hold, site, "train", "hold", action_mode="socket", physics_dt_h=5 / 60)
    assert balance_residual(tr).max() < BALANCE_TOL
    assert k.unserved_kwh.iloc[0] == pytest.approx(0.0, abs=1e-6)
    assert k.ev_energy_delivered_kwh.iloc[0] == pytest.approx(k.ev_energy_requested_kwh.iloc[0], rel=1e-9)
    assert tr.bess_charge_kw.max() <= 0.4 * site.config.bess.power_kw + 1e-9
    physics = site.physics_split("train")
    assert k.sessions_rejected.iloc[0] == physics.sessions.rejected.sum()
    with pytest.raises(ValueError, match="full_split"):
        EVHubVectorEnv(2, site=site, physics_dt_h=5 / 60)
    with pytest.raises(ValueError, match="5 minutes"):
        EVHubVectorEnv(1, site=make_site(days=4), full_split=True, physics_dt_h=0.25)


# ------------------------------------------------------------------------------------ the planners at 15 minutes


def _actions(site, split: str, policy, **kw) -> np.ndarray:
    """The socket actions ``policy`` (a planner: set-point BESS actions) takes over the whole split,
    ``(T, 1 + n_sockets)``."""
    kw = dict(action_mode="socket", bess_action="setpoint", full_split=True, dtype=torch.float64, **kw)
    env = EVHubVectorEnv(1, site=site, split=split, **kw)
    obs, _ = env.reset(seed=0)
    out = []
    for _ in range(env.data.num_steps):
        a = policy(obs, env)
        out.append(a[0].numpy().copy())
        obs, *_ = env.step(a)
    return np.stack(out)


@pytest.mark.parametrize("perfect", [False, True], ids=["mpc", "mpc_perfect"])
def test_the_planner_at_15_minutes_never_reads_the_future(perfect):
    """Data after step k (MOER, its forecasts, sessions) change no action up to k: the hourly forecast issued at the
    hour's start, the 5-minute forecasts issued at the step, the hold between plans and the plans on arrivals."""
    from conftest import changed_future

    from pipeline.control.forecast import REGRESSION_WARMUP_DAYS
    from pipeline.control.mpc import MPCController, PlannerParams

    site = make_site(days=10, n_sockets=4, dt_h=0.25)
    params = PlannerParams(horizon_h=6)
    H = timestep.steps(params.horizon_h, 0.25)
    last = (REGRESSION_WARMUP_DAYS + 1) * 96 + 6  # the regression in use, the step within an hour
    cut = last + H if perfect else last + 1
    a = _actions(site, "train", MPCController(site.split("train"), params, perfect=perfect))
    changed = changed_future(site, "train", cut)
    b = _actions(changed, "train", MPCController(changed.split("train"), params, perfect=perfect))
    np.testing.assert_array_equal(a[: last + 1], b[: last + 1])
    assert not np.array_equal(a[last + 1 :], b[last + 1 :])


def test_no_controller_beats_the_oracle_at_15_minutes_or_at_5_minute_physics():
    """At 15-minute steps and on the 5-minute site (a 4-day split), every causal controller serves every car and emits
    no less than the oracle of that resolution; planning every step at full resolution is the same planner without
    blocking."""
    from pipeline.control import scenario
    from pipeline.control.mpc import MPCController
    from pipeline.control.oracle import solve_oracle

    site = make_site(days=4, n_sockets=4, dt_h=0.25)
    for physics in (None, 5 / 60):
        oracle = solve_oracle(site, "test", physics_dt_h=physics)[0].co2_kg.iloc[0]
        runs = {
            "uncontrolled": (uncontrolled, {}),
            "rule_based": (rule_based, {}),
            "mpc": (MPCController(site.split("test")), {"action_mode": "socket", "bess_action": "setpoint"}),
            "mpc_scenario": (scenario.controller(site.split("test")), {"action_mode": "socket"}),
            "mpc_every_step": (
                MPCController(site.split("test"), replan="step", fine_h=None),
                {"action_mode": "socket", "bess_action": "setpoint"},
            ),
        }
        for name, (policy, kw) in runs.items():
            k, tr = evaluate_policy(policy, site, "test", name, physics_dt_h=physics, **kw)
            assert k.unserved_kwh.iloc[0] == pytest.approx(0.0, abs=1e-6), name
            assert k.co2_kg.iloc[0] >= oracle - 1e-6, (name, physics)
            assert balance_residual(tr).max() < BALANCE_TOL


def test_a_bad_step_is_refused_in_one_line_where_it_is_given(tmp_path, monkeypatch, capsys):
    """From the site TOML (ingestion's command line: one line, exit 1, no traceback) and from the study's setting
    (the doit variable's environment variable), a step that does not divide the hour is named with where it came from;
    the study at another step reads a copy of the site TOML at that step."""
    from pipeline.data.ingest import main
    from pipeline.study.config import PipelineConfig, from_environment

    toml = tmp_path / "bad.toml"
    toml.write_text('name = "bad"\ndt_h = 0.3\n')
    assert main(["--site", str(toml)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key 'dt_h' = 0.3" in err and "Traceback" not in err
    monkeypatch.setenv("EVHUB_DT_H", "0.3")
    with pytest.raises(ValueError, match=r"environment variable EVHUB_DT_H='0\.3'.*divide the hour"):
        from_environment()
    hourly = PipelineConfig(dt_h=1.0, output_dir=str(tmp_path))
    assert hourly.experiment == "caltech_60min"
    assert _step_of(hourly.site_toml) == 1.0 and PipelineConfig(output_dir=str(tmp_path)).dt_h is None


def _step_of(toml) -> float:
    from envs.site import load_site

    return load_site(toml).config.dt_h
