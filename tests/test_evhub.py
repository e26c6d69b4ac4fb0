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
    site = make_site(ev={"deadline_floor": False, "surplus_to_ev": False})
    never = lambda obs, env: torch.tensor([[0.0, -1.0]], dtype=obs.dtype)  # noqa: E731
    k, traces = evaluate_policy(never, site, "train", "never")
    assert k.ev_energy_delivered_kwh.iloc[0] == 0.0
    assert k.unserved_kwh.iloc[0] == pytest.approx(k.ev_energy_requested_kwh.iloc[0], rel=1e-9)


def test_surplus_pv_charges_plugged_evs_before_it_is_curtailed():
    """With ``ev.surplus_to_ev`` no PV is curtailed while a plugged EV could still take power, and a policy
    that never asks for EV power emits less than without it (free PV replaces later grid energy)."""
    on = make_site(bess={"capacity_kwh": 0.0})  # no battery: every surplus goes to the EVs or is curtailed
    off = make_site(bess={"capacity_kwh": 0.0}, ev={"surplus_to_ev": False})
    env = EVHubVectorEnv(8, site=on, dtype=torch.float64)
    env.reset(seed=0)
    never = torch.tensor([[0.0, -1.0]], dtype=torch.float64).repeat(8, 1)
    curtailed_steps = absorbed_steps = 0
    for _ in range(300):
        _, cap = env._ev_bounds()
        cap_total = cap.sum(1)
        _, _, _, _, info = env.step(never)
        assert balance_residual(info).max() < 1e-9
        curtailing = info["pv_curtailed_kw"] > 1e-9
        # curtailment only where the plugged EVs already charge at their caps
        assert torch.allclose(info["ev_charge_kw"][curtailing], cap_total[curtailing], atol=1e-9)
        assert (info["ev_charge_kw"] <= cap_total + 1e-9).all()
        curtailed_steps += int(curtailing.sum())
        absorbed_steps += int(((info["ev_charge_kw"] > 1e-9) & (info["pv_kw"] > info["load_kw"])).sum())
    assert absorbed_steps > 0 and curtailed_steps > 0  # both cases occur on the synthetic site
    k_on, t_on = evaluate_policy(lambda obs, env: never[:1], on, "train", "never")
    k_off, t_off = evaluate_policy(lambda obs, env: never[:1], off, "train", "never")
    assert k_on.co2_kg.iloc[0] < k_off.co2_kg.iloc[0]
    assert t_on.pv_curtailed_kw.sum() < t_off.pv_curtailed_kw.sum()
    assert k_on.ev_energy_delivered_kwh.iloc[0] == pytest.approx(k_off.ev_energy_delivered_kwh.iloc[0], rel=1e-9)


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


def test_session_thinning_keeps_the_drawn_share_of_arrivals_in_training_only():
    """``episode.session_keep_min`` thins training arrivals by the per-window keep probability; full-split
    runs (evaluation) keep every session."""
    site = make_site(days=28, n_sockets=8, episode={"train_h": 24 * 7, "session_keep_min": 0.2})
    num_envs = 256
    env = EVHubVectorEnv(num_envs, site=site, dtype=torch.float64)
    env.reset(seed=0)
    keep = env.session_keep.clone()
    assert ((keep >= 0.2) & (keep <= 1.0)).all() and keep.std() > 0.1
    plugged = torch.zeros(num_envs, dtype=torch.float64)
    offered = torch.zeros(num_envs, dtype=torch.float64)
    stay_table = env._arrival_stay
    for _ in range(env.episode_steps - 1):  # stay inside the first window of every env
        steps_before = env.ev_steps_left.clone()
        env.step(torch.tensor([[0.0, 1.0]]).expand(num_envs, 2))
        arriving = stay_table.index_select(0, env.t) > 0
        offered += arriving.sum(1)
        plugged += (arriving & (env.ev_steps_left == stay_table.index_select(0, env.t)) & (steps_before <= 1)).sum(1)
    share = plugged.sum() / offered.sum()
    assert share == pytest.approx(float(keep.mean()), abs=0.05)
    low, high = keep < 0.5, keep > 0.8
    assert plugged[low].sum() / offered[low].sum() < plugged[high].sum() / offered[high].sum()

    full = EVHubVectorEnv(1, site=site, full_split=True)
    full.reset(seed=0)
    assert full.session_keep.item() == 1.0
    assert not full._thinning


def test_session_keep_min_is_checked():
    from envs.config import ConfigError

    with pytest.raises(ConfigError, match="episode.session_keep_min"):
        make_site(episode={"session_keep_min": 0.0})


def test_outlook_features_pv_next_day_and_causal_demand(site):
    """Obs 17 is the PV energy of the next 24 h (per kWp / 8); obs 18 the EV energy requested per day over
    the past week, which must not see sessions that have not arrived yet."""
    env = EVHubVectorEnv(1, site=site, full_split=True, dtype=torch.float64)
    obs, _ = env.reset(seed=0)
    d = env.data
    kwp = site.config.pv.kwp
    for t in range(60):
        expected_pv = d.pv_kw[t : t + 24].sum() / kwp / 8.0
        assert obs[0, 17].item() == pytest.approx(expected_pv, rel=1e-9)
        obs, *_ = env.step(torch.tensor([[0.0, 1.0]]))
    assert env.single_observation_space.shape[0] == 19 + 3 * env.n_sockets + 2 * len(site.config.ev.groups) + 3

    first_arrival = int(np.flatnonzero(d.arrival_need_kwh.sum(1) > 0)[0])
    demand = env._demand_obs
    assert (demand[: first_arrival + 1] == 0).all()  # nothing has arrived yet at those steps
    assert demand[first_arrival + 1] > 0


def test_state_dict_round_trip_resumes_the_same_trajectory(site):
    env = EVHubVectorEnv(8, site=site, dtype=torch.float64)
    env.reset(seed=5)
    for _ in range(30):
        env.step(torch.rand(8, 2, dtype=torch.float64) * 2 - 1)
    state = env.state_dict()
    actions = [torch.rand(8, 2, dtype=torch.float64) * 2 - 1 for _ in range(200)]
    first = [env.step(a)[0] for a in actions]
    other = EVHubVectorEnv(8, site=site, dtype=torch.float64)
    other.reset(seed=123)
    other.load_state_dict(state)
    second = [other.step(a)[0] for a in actions]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="shape"):
        EVHubVectorEnv(4, site=site).load_state_dict(state)


def test_surplus_bess_action_expresses_the_rule_based_controller(site):
    """In ``bess_action="surplus"`` mode, -1 reproduces the self-consumption rule exactly, and 0 stores the
    surplus but never discharges."""
    from pipeline.control.baselines import rule_based

    cover = lambda obs, env: torch.tensor([[-1.0, 1.0]], dtype=obs.dtype)  # noqa: E731
    hold = lambda obs, env: torch.tensor([[0.0, 1.0]], dtype=obs.dtype)  # noqa: E731
    for split in ("train", "test"):
        k_rule, t_rule = evaluate_policy(rule_based, site, split, "rule_based")
        k_sc, t_sc = evaluate_policy(cover, site, split, "sc", bess_action="surplus")
        assert k_sc.co2_kg.iloc[0] == pytest.approx(k_rule.co2_kg.iloc[0], rel=1e-12)
        np.testing.assert_allclose(t_sc.bess_charge_kw, t_rule.bess_charge_kw, atol=1e-12)
        np.testing.assert_allclose(t_sc.soc, t_rule.soc, atol=1e-12)
        _, t_hold = evaluate_policy(hold, site, split, "hold", bess_action="surplus")
        assert (t_hold.bess_discharge_kw == 0).all() and t_hold.bess_charge_kw.sum() > 0
        surplus = t_hold.pv_kw - t_hold.load_kw - t_hold.ev_charge_kw
        assert (t_hold.bess_charge_kw <= surplus.clip(lower=0) + 1e-9).all()  # PV only, never from the grid
        # the battery takes all the surplus it has room for: PV is only curtailed when the battery is full
        # (SOC at its upper bound after the step) or charges at its power limit
        limited = (t_hold.soc >= site.config.bess.soc_max - 1e-9) | (
            t_hold.bess_charge_kw >= site.config.bess.power_kw - 1e-9
        )
        assert (t_hold.pv_curtailed_kw[~limited] <= 1e-9).all()
        assert t_hold.pv_curtailed_kw[limited].sum() > 0  # the synthetic site does fill the battery


def test_surplus_bess_action_spans_the_rule_to_full_charge_monotonically(site):
    """In ``bess_action="surplus"`` mode ``a_bess`` = -1 is the rule's set-point and +1 full charge (as +1 in
    ``"setpoint"`` mode), and the set-point grows with ``a_bess`` in between, in both modes."""
    num_envs = 21
    levels = torch.linspace(-1, 1, num_envs, dtype=torch.float64)
    results = {}
    for mode in ("setpoint", "surplus", "rule"):
        env = EVHubVectorEnv(
            num_envs, site=site, dtype=torch.float64, bess_action="setpoint" if mode == "rule" else mode
        )
        env.reset(seed=0, options={"start_steps": [12] * num_envs})  # mid-day: PV and some EVs
        env.energy_kwh[:] = 0.5 * site.config.bess.capacity_kwh
        look = env.power_outlook()
        a_bess = levels
        if mode == "rule":
            a_bess = ((look["pv_kw"] - look["load_kw"] - look["ev_max_kw"]) / site.config.bess.power_kw).clamp(-1, 1)
        _, _, _, _, info = env.step(torch.stack([a_bess, torch.ones(num_envs, dtype=torch.float64)], 1))
        results[mode] = info["bess_charge_kw"] - info["bess_discharge_kw"]
    for mode in ("setpoint", "surplus"):
        assert (results[mode][1:] >= results[mode][:-1] - 1e-12).all(), mode
    torch.testing.assert_close(results["surplus"][0], results["rule"][0])
    torch.testing.assert_close(results["surplus"][-1], results["setpoint"][-1])
    assert results["surplus"][-1] > results["surplus"][0]
    with pytest.raises(ValueError, match="bess_action"):
        EVHubVectorEnv(1, site=site, bess_action="bogus")


def test_policy_spec_round_trip_and_bad_specs(tmp_path):
    from envs.kpis import read_policy_spec, write_policy_spec

    # no file: the scripts' defaults, the rule a policy without a record was trained under
    assert read_policy_spec(tmp_path) == {"action_mode": "hub", "bess_action": "surplus"}
    write_policy_spec(tmp_path, "EVHub-v0", "socket", "surplus")
    assert read_policy_spec(tmp_path) == {"action_mode": "socket", "bess_action": "surplus"}
    (tmp_path / "policy.json").write_text('{"action_mode": "hub", "bess_action": "fancy"}')
    with pytest.raises(ValueError, match="policy.json.*bess_action"):
        read_policy_spec(tmp_path)
    (tmp_path / "policy.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="policy.json.*JSON object"):
        read_policy_spec(tmp_path)


def test_a_binding_import_limit_cuts_battery_charging_before_any_car():
    # no PV, a large battery told to charge at full power, every car asking for full power, a tight service limit
    site = make_site(
        days=7,
        n_sockets=6,
        pv={"kwp": 0.0},
        bess={"capacity_kwh": 400.0, "power_kw": 50.0},
        grid={"import_limit_kw": 14.0},
    )
    env = EVHubVectorEnv(1, site=site, split="train", full_split=True, dtype=torch.float64, bess_action="setpoint")
    env.reset(seed=0)
    limit, binding, starved = 14.0, 0, 0
    for _ in range(env.data.num_steps):
        floor, cap = (x.sum(1).item() for x in env._ev_bounds())
        _, _, _, _, info = env.step(torch.tensor([[1.0, 1.0]], dtype=torch.float64))
        grid, charge, ev = (info[k].item() for k in ("grid_import_kw", "bess_charge_kw", "ev_charge_kw"))
        assert grid <= limit + 1e-9
        if charge > 1e-9:  # the battery charges only with every car served as asked
            assert ev == pytest.approx(cap, abs=1e-9)
        if ev < cap - 1e-9:  # a car gets less than asked only with the battery idle and the limit binding
            binding += 1
            assert charge <= 1e-9 and grid == pytest.approx(limit, abs=1e-9)
            assert ev >= min(floor, limit) - 1e-9  # the deadline floors go last
        starved += ev < floor - 1e-9
    assert binding > 10  # the limit did bind, often
    k, _ = evaluate_policy(
        lambda obs, e: torch.tensor([[1.0, 1.0]], dtype=obs.dtype), site, "train", "full", bess_action="setpoint"
    )
    # what is left unserved comes from floors above the limit alone: without any floor cut, nothing is unserved
    assert (k.unserved_kwh.item() > 0) == (starved > 0)
