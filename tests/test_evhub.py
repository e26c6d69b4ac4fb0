"""Physics and API of EVHub-v0: energy balance, SOC bounds, batched == single, gymnasium compliance."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import make_site
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers EVHub-v0)
from envs.evhub import INFO_KEYS, EVHubEnv, EVHubVectorEnv
from envs.kpis import BALANCE_TOL, balance_residual, evaluate_policy


@pytest.mark.parametrize("action_mode", ["hub", "socket"])
def test_energy_balance_and_bounds_under_random_actions(site, action_mode):
    """Balance, SOC bounds and non-negative flows hold in every step of many envs under random actions."""
    num_envs, steps = 64, 400  # 25,600 env steps, crossing several episode ends
    env = EVHubVectorEnv(num_envs, site=site, action_mode=action_mode, dtype=torch.float64)
    env.reset(seed=3)
    gen = torch.Generator().manual_seed(0)
    b = site.config.bess
    total_ev = 0.0
    for _ in range(steps):
        a = torch.rand(num_envs, env.single_action_space.shape[0], generator=gen, dtype=torch.float64) * 2.4 - 1.2
        energy_before = env.energy_kwh.clone()
        obs, reward, terminated, truncated, info = env.step(a)
        assert set(info) == set(INFO_KEYS)
        for k in INFO_KEYS:
            assert info[k].shape == (num_envs,)
            assert (info[k] >= -1e-9).all(), k
        assert balance_residual(info).max() < 1e-9
        assert (info["pv_curtailed_kw"] <= info["pv_kw"] + 1e-9).all()
        assert (info["grid_import_kw"] <= site.config.grid.import_limit_kw + 1e-9).all()
        assert (info["bess_charge_kw"] <= b.power_kw + 1e-9).all()
        assert (info["bess_discharge_kw"] <= b.power_kw + 1e-9).all()
        # BESS energy follows E' = E + eta_c P_ch dt - P_dis dt / eta_d (envs not reset this step)
        expected = energy_before + b.eta_charge * info["bess_charge_kw"] - info["bess_discharge_kw"] / b.eta_discharge
        live = ~truncated
        assert torch.allclose(env.energy_kwh[live], expected[live], atol=1e-9)
        soc = env.soc
        assert ((soc >= b.soc_min - 1e-9) & (soc <= b.soc_max + 1e-9)).all()
        assert torch.isfinite(obs).all() and obs.shape == (num_envs, env.single_observation_space.shape[0])
        assert torch.isfinite(reward).all() and (reward <= 0).all()
        assert not terminated.any()
        total_ev += float(info["ev_charge_kw"].sum())
    assert total_ev > 0


def test_deadline_floor_serves_every_ev_even_when_the_agent_never_charges(site):
    """With the deadline floor, a policy that asks for no EV power still delivers all capped EV energy."""
    never = lambda obs, env: torch.tensor([[0.0, -1.0]], dtype=obs.dtype)  # noqa: E731
    full = lambda obs, env: torch.tensor([[0.0, 1.0]], dtype=obs.dtype)  # noqa: E731
    k_never, _ = evaluate_policy(never, site, "train", "never")
    k_full, _ = evaluate_policy(full, site, "train", "full")
    requested = k_full.ev_energy_requested_kwh.iloc[0]
    assert requested > 0
    assert k_full.unserved_kwh.iloc[0] == pytest.approx(0.0, abs=1e-9)
    assert k_never.unserved_kwh.iloc[0] == pytest.approx(0.0, abs=1e-9)
    assert k_never.ev_energy_delivered_kwh.iloc[0] == pytest.approx(requested, rel=1e-9)


def test_without_floor_unserved_energy_is_counted_and_penalised():
    site = make_site(ev={"deadline_floor": False})
    never = lambda obs, env: torch.tensor([[0.0, -1.0]], dtype=obs.dtype)  # noqa: E731
    k, traces = evaluate_policy(never, site, "train", "never")
    assert k.ev_energy_delivered_kwh.iloc[0] == 0.0
    assert k.unserved_kwh.iloc[0] == pytest.approx(k.ev_energy_requested_kwh.iloc[0], rel=1e-9)


def test_grid_limit_cuts_ev_power_first():
    site = make_site(grid={"import_limit_kw": 5.0}, pv={"kwp": 0.0})
    full = lambda obs, env: torch.tensor([[1.0, 1.0]], dtype=obs.dtype)  # noqa: E731
    k, traces = evaluate_policy(full, site, "train", "full")
    assert traces.grid_import_kw.max() <= 5.0 + 1e-9
    assert k.unserved_kwh.iloc[0] > 0  # the cap makes some energy undeliverable
    assert (traces.bess_charge_kw[traces.ev_charge_kw > 0] <= 1e-9).all() or traces.grid_import_kw.max() < 5.0


@pytest.mark.parametrize("action_mode", ["hub", "socket"])
def test_batched_env_equals_single_envs(site, action_mode):
    """N envs stepped together give the same results as N separate single envs with the same actions."""
    n, steps = 5, 120
    starts = [0, 7, 30, 101, 200]
    vec = EVHubVectorEnv(n, site=site, action_mode=action_mode, dtype=torch.float64)
    obs_v, _ = vec.reset(options={"start_steps": starts})
    singles = [EVHubEnv(site=site, action_mode=action_mode) for _ in range(n)]
    obs_s = [e.reset(seed=i, options={"start_step": s})[0] for i, (e, s) in enumerate(zip(singles, starts))]
    np.testing.assert_allclose(obs_v.numpy(), np.stack(obs_s), rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        a = rng.uniform(-1, 1, (n, vec.single_action_space.shape[0]))
        obs_v, rew_v, _, trunc_v, info_v = vec.step(torch.as_tensor(a))
        for i, e in enumerate(singles):
            o, r, _, tr, info = e.step(a[i].astype(np.float32).astype(np.float64))
            if tr:
                # both auto-reset to a random window: compare the step's outcome, then re-pin the start
                o = e.reset(options={"start_step": int(vec.t[i])})[0]
            assert r == pytest.approx(float(rew_v[i]), rel=1e-5, abs=1e-7)
            assert tr == bool(trunc_v[i])
            for k in INFO_KEYS:
                assert info[k] == pytest.approx(float(info_v[k][i]), rel=1e-5, abs=1e-6), k
            np.testing.assert_allclose(o, obs_v[i].numpy(), rtol=1e-5, atol=1e-5)


def test_check_env_and_make(site):
    env = gym.make("EVHub-v0", site=site)
    check_env(env.unwrapped)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    obs, r, term, trunc, info = env.step(env.action_space.sample())
    assert set(info) == set(INFO_KEYS) and isinstance(r, float)


def test_make_vec_vector_entry_point(site):
    vec = gym.make_vec("EVHub-v0", num_envs=32, vectorization_mode="vector_entry_point", site=site, device="cpu")
    obs, _ = vec.reset(seed=0)
    assert obs.shape == (32, vec.single_observation_space.shape[0])
    obs, r, term, trunc, info = vec.step(torch.zeros(32, 2))
    assert r.shape == (32,) and set(info) == set(INFO_KEYS)
    assert vec.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP


def test_episode_windows_truncate_and_reset(site):
    env = EVHubVectorEnv(4, site=site, episode_steps=10)
    env.reset(seed=0)
    for i in range(10):
        _, _, _, trunc, _ = env.step(torch.zeros(4, 2))
        assert bool(trunc.all()) == (i == 9)
    assert (env.elapsed == 0).all()


def test_full_split_is_deterministic_and_balanced(site):
    rule = lambda obs, env: torch.tensor([[0.3, 0.5]], dtype=obs.dtype)  # noqa: E731
    k1, t1 = evaluate_policy(rule, site, "test", "x")
    k2, t2 = evaluate_policy(rule, site, "test", "x")
    assert len(t1) == site.split("test").num_steps
    assert balance_residual(t1).max() < BALANCE_TOL
    assert k1.co2_kg.iloc[0] == k2.co2_kg.iloc[0]


def test_float32_env_balance(site):
    env = EVHubVectorEnv(256, site=site, action_mode="socket")
    env.reset(seed=1)
    for _ in range(100):
        _, _, _, _, info = env.step(torch.rand(256, env.single_action_space.shape[0]) * 2 - 1)
        assert balance_residual({k: v.double() for k, v in info.items()}).max() < BALANCE_TOL


def test_discrete_mode_equals_hub_mode_with_the_table_action(site):
    from envs.evhub import discrete_action_table

    table = discrete_action_table()
    n = 6
    hub = EVHubVectorEnv(n, site=site, action_mode="hub", dtype=torch.float64)
    disc = EVHubVectorEnv(n, site=site, action_mode="discrete", dtype=torch.float64)
    assert disc.single_action_space == gym.spaces.Discrete(len(table))
    starts = [0, 10, 20, 30, 40, 50]
    hub.reset(options={"start_steps": starts})
    disc.reset(options={"start_steps": starts})
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        k = torch.randint(0, len(table), (n,), generator=gen)
        o1, r1, _, _, i1 = hub.step(table[k])
        o2, r2, _, _, i2 = disc.step(k)
        assert torch.equal(o1, o2) and torch.equal(r1, r2)
        assert all(torch.equal(i1[key], i2[key]) for key in INFO_KEYS)


def test_check_env_discrete(site):
    check_env(EVHubEnv(site=site, action_mode="discrete"))
