"""An environment whose step waits on I/O: stepping N copies in N worker processes (``AsyncVectorEnv``, the
agent scripts' ``--vector-mode async``) gives close to N times the steps/s of stepping them one after another.

Waiting needs no CPU, so the ratio holds on a 2-core CI machine; the bound asserted (half of N) leaves room for
the cost of passing actions and observations between processes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from benchmarks import vector_io
from envs.io_bound import IOBoundEnv


def test_io_bound_env_follows_the_gymnasium_api():
    check_env(IOBoundEnv(latency_s=0.0), skip_render_check=True)
    env = gym.make("IOBound-v0", latency_s=0.0, max_steps=3)
    obs, _ = env.reset(seed=1)
    for _t in range(3):
        obs, reward, terminated, truncated, _ = env.step(np.ones(2, np.float32))
        assert reward == pytest.approx(-np.linalg.norm(obs)) and not terminated
    assert truncated
    with pytest.raises(ValueError, match="latency_s"):
        IOBoundEnv(latency_s=-1.0)


@pytest.mark.slow
def test_async_steps_waiting_envs_about_n_times_faster_than_sync(tmp_path):
    n = 8
    df = vector_io.run(num_envs=[n], latency_s=0.01, repeats=3, min_seconds=0.3, out_dir=tmp_path)
    sync = df[df["mode"] == "sync"].iloc[0]
    fast = df[df["mode"] == "async"].iloc[0]
    # sync is bound by the waits: N envs x 10 ms per vector step -> at most 100 env steps/s
    assert sync.steps_per_s <= 100.0 * 1.05
    assert fast.speedup >= n / 2, df
    assert (tmp_path / "vector_io.parquet").is_file()
