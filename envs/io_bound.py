"""``IOBound-v0``: a tiny single env whose ``step`` waits on simulated I/O, the stand-in for an environment
that calls out to a slow service (a simulator behind a network API, a database, a device).

Each ``step`` and ``reset`` sleeps ``latency_s`` seconds (default 5 ms), which needs no CPU: N such envs
stepped one after another (``gymnasium.vector.SyncVectorEnv``) take N x ``latency_s`` per vector step, while
N worker processes (``gymnasium.vector.AsyncVectorEnv``, ``--vector-mode async`` in the agent scripts) wait at
the same time and take about ``latency_s``. ``benchmarks/vector_io.py`` measures that speed-up and
``tests/test_vector_io.py`` checks it.

Dynamics (deliberately trivial, so only the waiting costs time): the observation is a point ``x`` in
``[-1, 1]^2`` (float32 ``(2,)``); the action (float32 ``(2,)`` in ``[-1, 1]``) moves it by ``0.1 * action``
(clipped to the box); the reward is ``-||x||`` after the move. Episodes are truncated after ``max_steps``
steps (default 50) and never terminate. The start point is uniform in the box, drawn from the env's
``np_random`` (seeded through ``reset(seed=...)``).
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np


class IOBoundEnv(gym.Env):
    """A 2-D point env whose ``step`` and ``reset`` wait ``latency_s`` seconds on simulated I/O.

    Args:
        latency_s: seconds each ``step`` and ``reset`` sleeps (>= 0).
        max_steps: steps per episode before truncation (>= 1).

    Raises:
        ValueError: negative ``latency_s`` or ``max_steps < 1``.
    """

    metadata = {"render_modes": []}

    def __init__(self, latency_s: float = 0.005, max_steps: int = 50):
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.latency_s = float(latency_s)
        self.max_steps = int(max_steps)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._x = np.zeros(2, np.float32)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode at a uniform random point; waits ``latency_s``. Returns ``(obs float32 (2,), {})``."""
        super().reset(seed=seed)
        time.sleep(self.latency_s)
        self._x = self.np_random.uniform(-1.0, 1.0, 2).astype(np.float32)
        self._t = 0
        return self._x.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Move by ``0.1 * clip(action, -1, 1)``; waits ``latency_s``. Returns gymnasium's 5-tuple."""
        time.sleep(self.latency_s)
        a = np.clip(np.asarray(action, np.float32).reshape(2), -1.0, 1.0)
        self._x = np.clip(self._x + 0.1 * a, -1.0, 1.0).astype(np.float32)
        self._t += 1
        reward = -float(np.linalg.norm(self._x))
        return self._x.copy(), reward, False, self._t >= self.max_steps, {}
