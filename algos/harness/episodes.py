"""Evaluation on any gymnasium env: the deterministic policy's episodic return over N episodes, with gymnasium's own
``RecordEpisodeStatistics`` (:func:`evaluate_episodes`), for a run at its end (``--eval-episodes``) and for a finished
run (``python -m algos.harness.evaluate RUN_DIR``, :mod:`algos.harness.evaluate`). EVHub-v0 is evaluated on its
site's splits instead (:meth:`algos.harness.Run.evaluate`)."""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
import pandas as pd
import torch

from envs.errors import InputError
from envs.vector import flatten_observation, is_evhub, obs_shape_of

EVAL_SEED = 1_000_000
"""Episode ``i`` of an evaluation is reset with seed ``EVAL_SEED + seed + i``: away from the training envs' seeds
(``seed``, ``seed + 1``, ...)."""


def evaluate_episodes(
    policy: Callable[[torch.Tensor], torch.Tensor], env_id: str, env_kwargs: dict, episodes: int, seed: int
) -> pd.DataFrame:
    """Run ``policy`` (observations -> actions in the env's units, :func:`load_policy`) for ``episodes`` whole
    episodes of ``gym.make(env_id, **env_kwargs)``, its observations flattened as in training
    (:func:`envs.vector.flatten_observation`), inside gymnasium's ``RecordEpisodeStatistics``; episode ``i`` is reset
    with seed ``EVAL_SEED + seed + i``.

    Returns:
        one row per episode: ``episode`` (int), ``seed`` (int), ``return`` (float, the summed reward) and ``length``
        (int, steps).

    Raises:
        InputError: ``episodes < 1``, or EVHub-v0 (evaluated on its splits instead).
    """
    if episodes < 1:
        raise InputError(f"--eval-episodes must be at least 1, got {episodes}")
    if is_evhub(env_id):
        raise InputError("EVHub-v0 is evaluated on its site's splits (--eval-split), not by episodes")
    env = gym.wrappers.RecordEpisodeStatistics(flatten_observation(gym.make(env_id, **env_kwargs)))
    shape = obs_shape_of(env.observation_space)
    action_shape = env.action_space.shape
    rows = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=EVAL_SEED + seed + i)
            while True:
                with torch.no_grad():
                    action = policy(torch.as_tensor(np.asarray(obs, np.float32).reshape(1, *shape)))[0].numpy()
                if isinstance(env.action_space, gym.spaces.Discrete):
                    action = int(action)
                else:
                    action = action.reshape(action_shape).astype(env.action_space.dtype)
                obs, _, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    episode = info["episode"]
                    rows.append(
                        {
                            "episode": i,
                            "seed": EVAL_SEED + seed + i,
                            "return": float(episode["r"]),
                            "length": int(episode["l"]),
                        }
                    )
                    break
    finally:
        env.close()
    return pd.DataFrame(rows)
