"""The training scripts' shared harness (``algos/harness/``) and vector env (``envs/vector.py``): one export
contract, one vector env per gymnasium id for every script, checkpoints that cannot be resumed from stop with a
message, presets that ``--help`` shows."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import load_algo, make_site, run_algo, write_site

import envs
from algos import harness
from envs.kpis import POLICY_SPEC, evaluate_policy, load_policy, read_policy_spec
from envs.vector import GymTorchVecEnv, NormalizeReward, RecordEpisodeStatistics, TorchVecEnv, make_vec

ALGOS = ("ppo", "a2c", "sac", "dqn")

TINY = {
    "ppo": ["--num-envs", "4", "--num-steps", "48", "--num-minibatches", "2", "--update-epochs", "1",
            "--hidden-size", "16", "--total-timesteps", "192"],
    "a2c": ["--num-envs", "4", "--num-steps", "8", "--hidden-size", "16", "--total-timesteps", "96"],
    "sac": ["--num-envs", "4", "--hidden-size", "16", "--batch-size", "16", "--buffer-size", "200",
            "--learning-starts", "32", "--gradient-steps", "1", "--total-timesteps", "96"],
    "dqn": ["--num-envs", "4", "--num-steps", "2", "--gradient-steps", "1", "--batch-size", "16", "--buffer-size",
            "200", "--learning-starts", "32", "--hidden-size", "16", "--total-timesteps", "96"],
}  # fmt: skip
"""A few iterations of each script on EVHub-v0: enough to export a policy that is not the initial one."""


def train(name: str, argv: list[str]) -> dict:
    """``algos/<name>.py``'s ``main`` in this process, parsed as its command line is."""
    module = load_algo(name)
    return module.main(harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, argv + ["--no-cuda"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGOS)
def test_an_exported_policy_gives_the_same_kpis_without_its_policy_json(name, site_toml, tmp_path):
    out = tmp_path / name
    train(name, ["--site", str(site_toml), "--output-dir", str(out), "--eval-split", "none", *TINY[name]])
    site = envs.load_site(site_toml)

    def kpis(run_dir) -> pd.DataFrame:
        spec = read_policy_spec(run_dir)
        row, _ = evaluate_policy(
            load_policy(run_dir / "policy.pt2"),
            site,
            "test",
            name,
            spec["action_mode"],
            bess_action=spec["bess_action"],
        )
        return row

    spec = read_policy_spec(out)
    assert spec["bess_action"] == load_algo(name).Args.bess_action == "surplus"  # one default everywhere
    with_json = kpis(out)
    (out / POLICY_SPEC).unlink()
    assert read_policy_spec(out) == spec  # the settings travel inside policy.pt2 too
    pd.testing.assert_frame_equal(kpis(out), with_json)
    # evaluated under the other BESS rule, the same policy gives other KPIs: the spec is what made them equal
    other, _ = evaluate_policy(
        load_policy(out / "policy.pt2"), site, "test", name, spec["action_mode"], bess_action="setpoint"
    )
    assert not math.isclose(float(other.co2_kg.iloc[0]), float(with_json.co2_kg.iloc[0]), rel_tol=1e-9)


# ---------------------------------------------------------------------------------------------- one vector env
FITS = {
    # which scripts take which env: SAC Box actions only, DQN Discrete only (EVHub-v0 in its discrete mode)
    "Pendulum-v1": ("ppo", "a2c", "sac"),
    "CartPole-v1": ("ppo", "a2c", "dqn"),
    "Snake-v0": ("ppo", "a2c", "dqn"),
    "EVHub-v0": ("ppo", "a2c", "sac", "dqn"),
}


class Built(Exception):
    """Stops a script right after it made its env."""


@pytest.mark.parametrize("env_id", list(FITS))
def test_the_scripts_make_the_same_vector_env_for_an_id(env_id, site_toml, tmp_path, monkeypatch):
    made: dict[str, tuple] = {}
    real = harness.make_env

    def spy(args, num_envs, device, action_mode=None):
        env = real(args, num_envs, device, action_mode=action_mode)
        made[current] = (env, action_mode)
        raise Built

    monkeypatch.setattr(harness, "make_env", spy)
    for current in FITS[env_id]:
        argv = ["--env-id", env_id, "--num-envs", "3", "--output-dir", str(tmp_path / current), "--eval-split", "none"]
        argv += ["--site", str(site_toml)] if env_id == "EVHub-v0" else []
        with pytest.raises(Built):
            train(current, argv)

    kinds = {name: type(env.env) for name, (env, _) in made.items()}
    assert all(isinstance(env, RecordEpisodeStatistics) for env, _ in made.values())
    assert set(kinds.values()) == {GymTorchVecEnv if env_id in ("Pendulum-v1", "CartPole-v1") else TorchVecEnv}
    for name, (env, mode) in made.items():
        if mode == "discrete":  # DQN's EVHub-v0: the hub mode's discrete table, the same site and observations
            assert isinstance(env.single_action_space, gym.spaces.Discrete)
            continue
        ref, _ = made["ppo"]
        assert env.single_observation_space == ref.single_observation_space, name
        assert env.single_action_space == ref.single_action_space, name
        assert (env.obs_shape, env.has_final_obs, env.discrete) == (ref.obs_shape, ref.has_final_obs, ref.discrete)
    # stepped with the same actions from the same seed, every script's env gives the same transitions
    envs_ = [(name, env) for name, (env, mode) in made.items() if mode != "discrete"]
    torch.manual_seed(0)
    ref = envs_[0][1]
    space = ref.single_action_space
    discrete = isinstance(space, gym.spaces.Discrete)
    actions = [torch.randint(0, space.n, (3,)) if discrete else torch.rand(3, *space.shape) * 3 - 1.5 for _ in range(5)]
    trajectories = {}
    for name, env in envs_:
        obs, _ = env.reset(seed=4)
        steps = [obs]
        for a in actions:
            steps.extend(t.float() for t in env.step(a)[:4])
        trajectories[name] = torch.cat([s.reshape(-1) for s in steps])
        env.close()
    for name, traj in trajectories.items():
        torch.testing.assert_close(traj, trajectories[envs_[0][0]], msg=f"{name} vs {envs_[0][0]}")


def test_box_actions_are_clipped_then_rescaled_to_the_bounds_and_final_obs_ends_the_episode():
    env = make_vec("Pendulum-v1", 2, "cpu")  # torque in [-2, 2], 200-step episodes
    assert env.has_final_obs and not env.torch_batched
    np.testing.assert_allclose(env.action_to_env(torch.tensor([[-3.0], [0.5]])), [[-2.0], [1.0]])
    obs, _ = env.reset(seed=0)
    for _t in range(200):
        obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 1))
    assert truncated.all() and not terminated.any()
    assert not torch.equal(info["final_obs"], obs)  # the episode's last observation, not the next one's first
    env.close()
    cart = make_vec("CartPole-v1", 2, "cpu")
    assert cart.discrete and cart.action_to_env(torch.tensor([1, 0])).tolist() == [1, 0]
    cart.close()


def test_episode_statistics_and_the_reward_normaliser_checkpoint_and_resume_exactly():
    site = make_site(days=3, n_sockets=3)
    make = lambda: NormalizeReward(  # noqa: E731
        RecordEpisodeStatistics(make_vec("EVHub-v0", 4, "cpu", site=site, split="train")), 0.98, False
    )
    a, b = make(), make()
    a.reset(seed=1)
    b.reset(seed=9)
    torch.manual_seed(0)
    for _ in range(70):
        a.step(torch.rand(4, 2) * 2 - 1)
    b.load_state_dict(a.state_dict())
    torch.manual_seed(1)
    actions = [torch.rand(4, 2) * 2 - 1 for _ in range(60)]
    out_a = [a.step(x) for x in actions]
    out_b = [b.step(x) for x in actions]
    for x, y in zip(out_a, out_b):
        for u, v in zip(x[:4], y[:4]):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
    torch.testing.assert_close(a.pop(), b.pop(), rtol=0, atol=0)
    assert a.pop()[0] == 0  # popped: the totals start again


def test_the_env_publishes_its_observation_layout_and_the_scripts_read_it():
    site = make_site(days=3, n_sockets=5)
    env = make_vec("EVHub-v0", 2, "cpu", site=site, split="train")
    layout = env.observation_layout
    assert layout["sockets"] == list(range(env.obs_shape[0] - 15, env.obs_shape[0]))
    assert layout["site"] == list(range(env.obs_shape[0] - 15))
    assert set(layout["day_of_week"]) < set(layout["site"]) and set(layout["hour_of_day"]) < set(layout["site"])
    args = load_algo("ppo").Args(env_id="EVHub-v0", socket_features=False, weekday_features=False)
    kept = harness.network_inputs(env, args)
    assert not set(kept) & set(layout["sockets"]) and not set(kept) & set(layout["day_of_week"])
    assert harness.network_inputs(env, load_algo("ppo").Args(weekday_features=True)) == list(range(env.obs_shape[0]))


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained(site_toml, tmp_path_factory):
    """A tiny PPO run with its checkpoint."""
    out = tmp_path_factory.mktemp("ckpt") / "ppo"
    train("ppo", ["--site", str(site_toml), "--output-dir", str(out), "--eval-split", "none", *TINY["ppo"]])
    return out


def resume(out, site_toml, tmp_path) -> str:
    """``--resume`` of a copy of ``out`` as a script; returns its stderr (it must fail)."""
    proc = run_algo(
        "ppo",
        "--site",
        str(site_toml),
        "--output-dir",
        str(out),
        "--eval-split",
        "none",
        "--resume",
        *TINY["ppo"][:-1],
        "384",
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "other version", "other site"])
def test_a_checkpoint_that_cannot_be_resumed_stops_with_the_file_the_cause_and_the_way_out(
    damage, trained, site_toml, tmp_path
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpt = out / "checkpoint.pt"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p != ckpt}
    site = site_toml
    if damage == "truncated":  # cut short by a full disk or a crash of the file system
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        cause = "cannot be read"
    elif damage == "other version":  # the layout of an older version: no format tag
        state = torch.load(ckpt, weights_only=False)
        torch.save({k: v for k, v in state.items() if k != "format"}, ckpt)
        cause = "another version"
    else:  # the same folder resumed on a site with more sockets: another observation size
        site = write_site(make_site(days=7, n_sockets=9), tmp_path / "bigger")
        cause = "does not fit"
    err = resume(out, site, tmp_path)
    assert "Traceback" not in err, err[-3000:]
    assert f"cannot resume from {ckpt}" in err and cause in err, err[-3000:]
    assert "Delete it" in err and "without --resume" in err
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p != ckpt}
    assert after == before  # nothing written: not the policy, nor the metrics, nor an event file


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ALGOS)
def test_presets_are_args_defaults_chosen_before_parsing(name):
    module = load_algo(name)
    cpu = harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, ["--preset", "cpu"])
    gpu = harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, ["--preset", "gpu"])
    assert cpu.preset == "cpu" and gpu.preset == "gpu"
    for field, value in module.PRESETS["gpu"].items():
        assert getattr(gpu, field) == value
    for field, value in module.PRESETS["cpu"].items():
        assert getattr(cpu, field) == value
    # a flag wins over the preset, and nothing is None waiting to be filled in
    first = next(iter(module.PRESETS["gpu"]))
    flag = "--" + first.replace("_", "-")
    assert (
        getattr(harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, ["--preset", "gpu", flag, "3"]), first)
        == 3
    )
    assert all(getattr(cpu, f) is not None for f in module.PRESETS["cpu"])


@pytest.mark.parametrize("name", ALGOS)
def test_help_prints_the_default_of_the_chosen_preset(name):
    proc = run_algo(name, "--preset", "gpu", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    module = load_algo(name)
    field = next(k for k, v in module.PRESETS["gpu"].items() if v != module.PRESETS["cpu"].get(k))
    help_text = " ".join(proc.stdout.split())
    flag = "--" + field.replace("_", "-")
    assert flag in help_text
    after = help_text.rsplit(flag, 1)[1][:600]  # the option table comes after the usage examples
    assert f"(default: {module.PRESETS['gpu'][field]})" in after, after
