"""``EVHub-v0`` as other libraries see it: the single env (``gym.make("EVHub-v0")``) ends an episode on its own last
observation and starts the next at ``reset()``; the vector env states its same-step autoreset; both default to the
training scripts' BESS action. On the shipped site ``caltech`` (one-week windows of 15-minute steps)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers EVHub-v0)
from envs.evhub import DEFAULT_BESS_ACTION, EVHubVectorEnv
from envs.site import load_site

START = 1000
"""Pinned first step of the episodes below (a training week well inside the split)."""


@pytest.fixture(scope="module")
def caltech():
    return load_site("caltech")


def run_to_truncation(env: gym.Env) -> list[np.ndarray]:
    """Reset ``env`` at :data:`START` and step it with zero actions through one episode; returns its observations
    (the reset's, then one per step). Checks that only the last step truncates and none terminates."""
    obs, _ = env.reset(seed=0, options={"start_step": START})
    seen = [obs]
    action = np.zeros(env.action_space.shape, np.float32)
    n = env.unwrapped.vec.episode_steps
    for i in range(n):
        obs, _, terminated, truncated, _ = env.step(action)
        seen.append(obs)
        assert not terminated and truncated == (i == n - 1)
    return seen


def hour_angle(obs: np.ndarray, layout: dict[str, list[int]]) -> float:
    """The local hour of an observation's time features as an angle, radians in (-pi, pi]."""
    s, c = obs[layout["hour_of_day"]]
    return float(np.arctan2(s, c))


def test_truncation_returns_the_episodes_own_last_observation(caltech):
    """At ``truncated=True`` the observation continues the week: its time features are one step on from the previous
    observation's (those of the split's next step), not those of another week's first step."""
    env = gym.make("EVHub-v0", site=caltech)
    vec = env.unwrapped.vec
    seen = run_to_truncation(env)
    layout = vec.observation_layout
    time = layout["hour_of_day"] + layout["day_of_week"]
    last = START + vec.episode_steps  # the step after the episode's last
    np.testing.assert_allclose(seen[-1][time], vec.data.time_features[last], rtol=0, atol=1e-6)
    step_angle = 2 * np.pi * vec.cfg.dt_h / 24
    turned = (hour_angle(seen[-1], layout) - hour_angle(seen[-2], layout)) % (2 * np.pi)
    assert turned == pytest.approx(step_angle, abs=1e-5)


def test_reset_after_truncation_starts_a_new_episode(caltech):
    """After the truncation ``reset()`` starts a fresh window: elapsed 0, SOC at its initial value, the window's own
    first observation, and a whole episode before the next truncation."""
    env = gym.make("EVHub-v0", site=caltech)
    vec = env.unwrapped.vec
    run_to_truncation(env)
    obs, info = env.reset(options={"start_step": START + 7})
    assert info == {} and env.observation_space.contains(obs)
    assert int(vec.elapsed[0]) == 0 and int(vec.t[0]) == START + 7
    assert float(vec.soc[0]) == pytest.approx(caltech.config.bess.soc_initial)
    time = vec.observation_layout["hour_of_day"] + vec.observation_layout["day_of_week"]
    np.testing.assert_allclose(obs[time], vec.data.time_features[START + 7], rtol=0, atol=1e-6)
    action = np.zeros(env.action_space.shape, np.float32)
    truncations = [env.step(action)[3] for _ in range(vec.episode_steps)]
    assert truncations == [False] * (vec.episode_steps - 1) + [True]


def test_vector_env_autoresets_in_the_same_step(caltech):
    """The vector env's ``autoreset_mode`` says what it does: the step that truncates returns the next window's first
    observation (no ``final_obs``)."""
    vec = EVHubVectorEnv(2, site=caltech, episode_steps=4)
    assert vec.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    vec.reset(seed=0, options={"start_steps": [START, START + 50]})
    for _ in range(4):
        obs, _, _, truncated, info = vec.step(torch.zeros(2, 2))
    assert truncated.all() and "final_obs" not in info
    assert (vec.elapsed == 0).all()
    first = torch.as_tensor(vec.data.time_features[vec.t.numpy()], dtype=obs.dtype)
    torch.testing.assert_close(obs[:, :4], first)


def test_default_bess_action_is_the_scripts(caltech):
    """``gym.make("EVHub-v0")`` and the vector env default to the BESS action the training scripts use."""
    from algos.harness.cli import RunArgs

    assert RunArgs().bess_action == DEFAULT_BESS_ACTION
    assert gym.make("EVHub-v0", site=caltech).unwrapped.bess_action == RunArgs().bess_action
    assert EVHubVectorEnv(1, site=caltech).bess_action == RunArgs().bess_action
    vec = gym.make_vec("EVHub-v0", num_envs=2, vectorization_mode="vector_entry_point", site=caltech)
    assert vec.unwrapped.bess_action == RunArgs().bess_action


def test_gymnasium_env_checker_passes(caltech):
    check_env(gym.make("EVHub-v0", site=caltech).unwrapped)
