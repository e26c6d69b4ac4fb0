"""``algos/a2c.py``'s own pieces: n-step returns and GAE (with truncation), the optimizer choice, the presets, the
out-of-memory shrink rule and the speed switches; gymnasium envs (Pendulum-v1 in sync and async vector modes, the
spaces refused, the async-start fallback, resume, the final_obs bootstrap), Discrete actions (CartPole-v1: a smoke run,
resume, learning; the ``start`` offset) and image observations (Snake-v0 through the CNN torso: a smoke run, resume,
the hyperparameters shown, the env defaults; the CNN agent and a gymnasium image env). What every agent promises (the
tiny run on a synthetic site and its exported policy, resume, the non-finite stop, ``--help``, ``--compile`` on the
CPU, ``gpu_stats``) is checked in ``tests/test_algo_contracts.py``."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import subprocess
import types
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import A2C_TINY, ROOT, load_algo, make_site, run_algo

import envs
from algos import harness
from envs.vector import GymTorchVecEnv, NormalizeReward, RecordEpisodeStatistics, TorchVecEnv

SCRIPT = ROOT / "algos" / "a2c.py"

TINY = A2C_TINY
"""Tiny budget: 4 envs x 8 steps per update; a log row every 6 updates = 48 steps, one synthetic episode
(``conftest.A2C_TINY``)."""


load_a2c = partial(load_algo, "a2c")
run_a2c = partial(run_algo, "a2c")


def a2c_gpu_columns() -> tuple[str, ...]:
    """The metrics.parquet columns of ``gpu_stats``."""
    return tuple(key.removeprefix("perf/") for key in harness.GPU_STAT_KEYS)


@pytest.fixture
def trained(tiny_runs) -> tuple[Path, subprocess.CompletedProcess]:
    """A2C's tiny EVHub-v0 run (``conftest.tiny_runs``, shared with ``tests/test_algo_contracts.py``)."""
    return tiny_runs("a2c")


# ---------------------------------------------------------------------------------------------- pure pieces
# Two envs, three steps, gamma 0.9. Env 0 is truncated at step 1 (the only way EVHub episodes end): the
# observation stored at step 2 is already the next window's first (SAME_STEP autoreset).
REWARDS = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])
VALUES = torch.tensor([[0.5, 0.0], [1.0, 0.0], [1.5, 0.0]])
NEXT_VALUE = torch.tensor([2.0, 1.0])
DONES = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
NO_TERMINALS = torch.zeros(3, 2)


def test_n_step_returns_bootstrap_through_truncation():
    a2c = load_a2c()
    adv, ret = a2c.compute_gae(REWARDS, VALUES, NEXT_VALUE, NO_TERMINALS, DONES, 0.9, 1.0)
    # env 0: step 2: 3 + 0.9*2 = 4.8; step 1 ends its episode, bootstraps from V(s_2) = 1.5: 2 + 0.9*1.5 = 3.35;
    #        step 0: 1 + 0.9*3.35 = 4.015 (nothing of the next episode enters)
    # env 1: no episode end: 1 + 0.9*1 = 1.9; 0.9*1.9 = 1.71; 0.9*1.71 = 1.539
    expected_ret = torch.tensor([[4.015, 1.539], [3.35, 1.71], [4.8, 1.9]])
    torch.testing.assert_close(ret, expected_ret)
    torch.testing.assert_close(adv, expected_ret - VALUES)


def test_n_step_returns_with_truncation_as_terminal():
    a2c = load_a2c()
    _, ret = a2c.compute_gae(REWARDS, VALUES, NEXT_VALUE, DONES, DONES, 0.9, 1.0)
    # env 0, step 1 does not bootstrap: 2; step 0: 1 + 0.9*2 = 2.8; env 1 unchanged
    torch.testing.assert_close(ret, torch.tensor([[2.8, 1.539], [2.0, 1.71], [4.8, 1.9]]))


def test_gae_matches_a_hand_computed_example():
    a2c = load_a2c()
    gamma, lam = 0.9, 0.8
    adv, ret = a2c.compute_gae(REWARDS, VALUES, NEXT_VALUE, NO_TERMINALS, DONES, gamma, lam)
    # env 0: d2 = 3 + 1.8 - 1.5 = 3.3; d1 = 2 + 0.9*1.5 - 1 = 2.35 (trace cut after it); d0 = 1 + 0.9 - 0.5 = 1.4
    #        A2 = 3.3, A1 = 2.35, A0 = 1.4 + 0.72*2.35 = 3.092
    # env 1: d2 = 1 + 0.9 = 1.9, d1 = d0 = 0: A2 = 1.9, A1 = 0.72*1.9 = 1.368, A0 = 0.72*1.368 = 0.98496
    expected = torch.tensor([[3.092, 0.98496], [2.35, 1.368], [3.3, 1.9]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + VALUES)
    # lambda = 0: one-step TD errors
    adv0, _ = a2c.compute_gae(REWARDS, VALUES, NEXT_VALUE, NO_TERMINALS, DONES, gamma, 0.0)
    torch.testing.assert_close(adv0, torch.tensor([[1.4, 0.0], [2.35, 0.0], [3.3, 1.9]]))


@pytest.mark.parametrize("bootstrap", [True, False])
def test_rollout_flags_the_truncations_of_the_env(bootstrap):
    """The env only truncates: ``dones`` mark the window ends; ``terminals`` too unless bootstrapping."""
    a2c = load_a2c()
    torch.manual_seed(0)
    site = make_site(days=3, n_sockets=4)  # 48-step windows
    dev = torch.device("cpu")
    stats = RecordEpisodeStatistics(TorchVecEnv(envs.EVHubVectorEnv(3, site=site, split="train"), dev))
    env = NormalizeReward(stats, 0.98, reset_on_truncation=True)
    obs, _ = env.reset(seed=0)
    agent = a2c.Agent(env.single_observation_space.shape[0], 2, 8)
    storage = a2c.make_storage(50, 3, obs.shape[1], 2, dev)
    a2c.rollout(
        functools.partial(a2c.policy_step, agent), env, obs, storage=storage, gamma=0.98, bootstrap_truncation=bootstrap
    )
    expected = torch.zeros(50, 3)
    expected[47] = 1.0
    torch.testing.assert_close(storage["dones"], expected)
    torch.testing.assert_close(storage["terminals"], torch.zeros(50, 3) if bootstrap else expected)
    n_done, _, length, co2_kg, _ = stats.pop().tolist()
    assert n_done == 3 and length == 3 * 48 and co2_kg > 0
    assert torch.isfinite(storage["rewards"]).all() and torch.isfinite(storage["obs"]).all()


def test_optimizer_choice():
    a2c = load_a2c()
    params = [torch.nn.Parameter(torch.zeros(3))]
    lr = torch.tensor(7e-4)
    rms = a2c.make_optimizer(params, "rmsprop", lr, alpha=0.99, eps=1e-5)
    assert isinstance(rms, torch.optim.RMSprop)
    group = rms.param_groups[0]
    assert group["alpha"] == 0.99 and group["eps"] == 1e-5 and not group["centered"] and group["momentum"] == 0
    adam = a2c.make_optimizer(params, "adam", lr, eps=1e-5)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["eps"] == 1e-5
    with pytest.raises(ValueError, match="unknown optimizer"):
        a2c.make_optimizer(params, "sgd", lr)
    defaults = a2c.Args()
    assert (defaults.optimizer, defaults.rmsprop_alpha, defaults.optimizer_eps) == ("rmsprop", 0.99, 1e-5)
    # the learning rate is a tensor annealed in place: the optimizer sees the new value
    params[0].grad = torch.ones(3)
    lr.fill_(0.0)
    rms.step()
    assert (params[0] == 0).all()
    lr.fill_(1e-2)
    rms.step()
    assert (params[0] < 0).all()


@pytest.mark.parametrize("amp", [False, True])
def test_update_takes_one_finite_step(amp):
    a2c = load_a2c()
    torch.manual_seed(0)
    T, N, obs_dim = 5, 6, 7
    agent = a2c.Agent(obs_dim, 2, 16)
    opt = a2c.make_optimizer(agent.parameters(), "rmsprop", torch.tensor(1e-3))
    before = [p.detach().clone() for p in agent.parameters()]
    out = a2c.update(
        agent,
        opt,
        torch.randn(T, N, obs_dim),
        torch.randn(T, N, 2),
        torch.randn(T, N),
        torch.randn(T, N),
        torch.zeros(T, N),
        torch.zeros(T, N),
        torch.randn(N, obs_dim),
        gamma=0.9,
        gae_lambda=1.0,
        vf_coef=0.5,
        ent_coef=0.01,
        max_grad_norm=0.5,
        norm_adv=True,
        amp=amp,
    )
    assert not out["bad"].any()
    for key in ("value_loss", "policy_loss", "entropy", "grad_norm", "explained_variance"):
        assert out[key].shape == () and torch.isfinite(out[key]), key
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))


def test_cudagraphs_needs_cuda_and_presets_apply():
    a2c = load_a2c()
    with pytest.raises(ValueError, match="needs CUDA"):
        harness.setup(a2c.Args(cudagraphs=True, cuda=False))
    preset_args = functools.partial(harness.preset_args, a2c.Args, a2c.PRESETS, a2c.ENV_DEFAULTS, cuda=False)
    args = preset_args()
    assert args.preset == "cpu" and args.num_envs == a2c.PRESETS["cpu"]["num_envs"]
    args = preset_args(preset="gpu", num_envs=7)
    assert args.num_envs == 7 and args.hidden_size == a2c.PRESETS["gpu"]["hidden_size"]
    with pytest.raises(ValueError, match="num_envs, num_steps and log_every must be >= 1"):
        a2c.main(preset_args(num_envs=0))


def test_out_of_memory_back_off_halves_num_envs_and_the_batch():
    a2c = load_a2c()
    sizes, change = a2c.halve_num_envs(a2c.Sizes(4, 32))
    assert sizes == a2c.Sizes(2, 16) and change == "num_envs 4 -> 2 (batch 32 -> 16)"
    assert a2c.halve_num_envs(a2c.Sizes(3, 24))[1] == "num_envs 3 -> 1 (batch 24 -> 8)"
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved"):
        a2c.halve_num_envs(a2c.Sizes(1, 8))


@pytest.mark.slow
def test_act_and_step_compiles_as_one_graph_and_the_rollout_follows_the_eager_one():
    """Policy step and EVHub-v0 step (reward normaliser included) trace as one graph (``fullgraph=True``: a graph break
    fails), and a rollout of the compiled step fills the storage the eager one does."""
    a2c = load_a2c()
    site = make_site(days=3, n_sockets=4)
    torch.manual_seed(0)
    agent = a2c.Agent(envs.EVHubVectorEnv(1, site=site).single_observation_space.shape[0], 2, 8)
    runs = []
    for compiled in (False, True):
        stats = RecordEpisodeStatistics(TorchVecEnv(envs.EVHubVectorEnv(3, site=site, split="train"), "cpu"))
        env = NormalizeReward(stats, 0.98, reset_on_truncation=True)
        obs, _ = env.reset(seed=0)
        agent_copy = a2c.Agent(obs.shape[1], 2, 8)
        agent_copy.load_state_dict(agent.state_dict())  # the running statistics are updated in place
        policy, step = functools.partial(a2c.policy_step, agent_copy), a2c.act_and_step
        if compiled:  # as bind_hot_functions compiles it: policy and env are arguments of the compiled function
            torch._inductor.config.fallback_random = True  # eager's random numbers, as harness.bind sets
            step = torch.compile(step, fullgraph=True)
        storage = a2c.make_storage(60, 3, obs.shape[1], 2, torch.device("cpu"))
        torch.manual_seed(1)
        next_obs = a2c.rollout(policy, env, obs, storage=storage, gamma=0.98, bootstrap_truncation=True, step=step)
        runs.append((next_obs, storage, env.rn["var"].clone()))
    (obs_e, storage_e, var_e), (obs_c, storage_c, var_c) = runs
    torch.testing.assert_close(obs_c, obs_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var_c, var_e)  # the normaliser's in-place updates are kept under compile
    for key, value in storage_e.items():
        torch.testing.assert_close(storage_c[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert storage_e["dones"][47].all()  # the 48-step windows ended inside the rollout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flags", [["--cudagraphs"], ["--amp"], ["--cudagraphs", "--amp", "--optimizer", "adam"]])
def test_speed_switches_on_cuda(site_toml, tmp_path, flags):
    tiny_cuda = [a for a in TINY if a != "--no-cuda"]
    proc = run_a2c(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path / "g"),
        "--total-timesteps",
        "384",
        *flags,
        *tiny_cuda,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device=cuda" in proc.stdout
    metrics = pd.read_parquet(tmp_path / "g" / "metrics.parquet")
    # gpu_util_pct needs pynvml (nvidia-ml-py), an optional dependency: NaN without it
    assert np.isfinite(metrics.drop(columns=["gpu_util_pct"]).to_numpy(dtype=float)).all(), metrics.T
    assert (metrics.gpu_mem_allocated_gb > 0).all() and (metrics.gpu_mem_peak_gb >= metrics.gpu_mem_allocated_gb).all()
    assert (tmp_path / "g" / "policy.pt2").is_file()


# ---------------------------------------------------------------------------------------------- gymnasium envs
GYM_TINY = ["--num-envs", "2", "--num-steps", "8", "--hidden-size", "16", "--log-every", "15", "--no-cuda"]
"""Pendulum-v1 (200-step episodes) with 2 envs x 8 steps per update: a log row every 15 updates = 240 steps."""


def tensorboard(out):
    """The run's TensorBoard scalars and text (an ``EventAccumulator``, loaded)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out))
    acc.Reload()
    return acc


def tensorboard_bytes(out) -> bytes:
    """The bytes of the run's TensorBoard event files (text summaries are stored verbatim)."""
    return b"".join(p.read_bytes() for p in sorted(Path(out).glob("events.out.tfevents.*")))


def train_in_process(out, *argv: str) -> dict:
    """``algos/a2c.py``'s ``main`` in this process with ``argv`` (output into ``out``); returns its result."""
    a2c = load_a2c()
    return a2c.main(harness.cli(a2c.Args, a2c.PRESETS, a2c.ENV_DEFAULTS, ["--output-dir", str(out), *argv]))


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_pendulum_trains_in_both_vector_modes(mode, tmp_path):
    out = tmp_path / mode
    proc = run_a2c(
        "--env-id",
        "Pendulum-v1",
        "--vector-mode",
        mode,
        "--output-dir",
        str(out),
        "--total-timesteps",
        "480",
        *GYM_TINY,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"vector_mode={mode}" in proc.stdout
    assert "no split evaluation for Pendulum-v1" in proc.stdout  # eval_split is left at "test": a note, no evaluation
    assert "|field|cpu*|gpu|used|" in proc.stdout  # the presets, printed as one table

    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [240, 480]
    last = metrics.iloc[-1]  # the first episodes (200 steps per env) ended before step 480
    assert math.isfinite(last.episodic_return) and last.episodic_return < 0 and last.episodic_length == 200
    assert metrics[["episodic_co2_kg", "episodic_unserved_kwh", *a2c_gpu_columns()]].isna().all().all()
    assert np.isfinite(metrics[["value_loss", "policy_loss", "entropy", "learning_rate"]].to_numpy()).all()
    tags = set(tensorboard(out).Tags()["scalars"])
    assert {"charts/episodic_return", "charts/episodic_length", "losses/value_loss"} <= tags
    assert not any("co2" in t or "unserved" in t or t.startswith("perf/gpu") for t in tags), tags

    # the deterministic policy, in Pendulum's units (torque in [-2, 2]), and the checkpoint; no EVHub outputs
    policy = torch.export.load(out / "policy.pt2").module()
    action = policy(torch.randn(5, 3) * 10)
    assert action.shape == (5, 1) and (action.abs() <= 2.0).all()
    assert (out / "checkpoint.pt").is_file()
    assert not (out / "policy.json").exists() and not list(out.glob("eval_*.parquet"))


def test_unsupported_spaces_are_a_clear_error():
    a2c = load_a2c()
    flat = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    # images (C, H, W) take the CNN torso, 2-D Boxes are flattened; 4-D ones (stacked frames) are refused
    a2c.check_spaces("Image-v0", gym.spaces.Box(0.0, 1.0, (3, 8, 8), np.float32), gym.spaces.Discrete(4))
    a2c.check_spaces("Matrix-v0", gym.spaces.Box(-1.0, 1.0, (2, 5), np.float32), gym.spaces.Discrete(4))
    frames = gym.spaces.Box(0.0, 1.0, (4, 3, 8, 8), np.float32)
    with pytest.raises(
        ValueError,
        match=r"flat observations \(MLPs\) or images \(C, H, W\) \(CNN torso\), but "
        r"Frames-v0 has observations of 4 dims .*ReshapeObservation",
    ):
        a2c.check_spaces("Frames-v0", frames, gym.spaces.Discrete(4))
    with pytest.raises(
        ValueError,
        match=r"takes flat \(obs_dim,\) or image \(C, H, W\) observations, got shape "
        r"\(4, 3, 8, 8\)",
    ):
        a2c.Agent(4 * 3 * 8 * 8, 4, 8, discrete=True, obs_shape=(4, 3, 8, 8))
    for space in (
        gym.spaces.MultiDiscrete([3, 2]),
        gym.spaces.MultiBinary(3),
        gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
    ):
        with pytest.raises(
            ValueError,
            match=r"supports Box actions .* and Discrete actions .*, but Toy-v0 has "
            r"action space (MultiDiscrete|MultiBinary|Dict)",
        ):
            a2c.check_spaces("Toy-v0", flat, space)
    with pytest.raises(
        ValueError,
        match=r"flat Box observations and images .* only, but Toy-v0 has observation "
        r"space Dict",
    ):
        a2c.check_spaces("Toy-v0", gym.spaces.Dict({"x": flat}), gym.spaces.Discrete(2))
    # torch-batched envs get the indices as they are: a Discrete space must start at 0 there (the vector env says so)
    shifted = types.SimpleNamespace(
        num_envs=1, single_observation_space=flat, single_action_space=gym.spaces.Discrete(3, start=-1)
    )
    with pytest.raises(ValueError, match=r"takes the action indices 0\.\.n-1"):
        TorchVecEnv(shifted, torch.device("cpu"))
    a2c.check_spaces("Toy-v0", flat, gym.spaces.Discrete(3, start=-1))  # gymnasium envs: the vector env adds start


def test_async_that_cannot_start_falls_back_to_sync(tmp_path, monkeypatch, capsys):
    def no_subprocesses(*args, **kwargs):
        raise OSError("cannot start worker processes here")

    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", no_subprocesses)
    result = train_in_process(
        tmp_path,
        "--env-id",
        "Pendulum-v1",
        "--vector-mode",
        "async",
        "--total-timesteps",
        "240",
        "--eval-split",
        "none",
        *GYM_TINY,
    )
    captured = capsys.readouterr()
    assert "warning: --vector-mode async could not start 2 worker processes for Pendulum-v1" in captured.err
    assert "cannot start worker processes here" in captured.err and "falling back to --vector-mode sync" in captured.err
    assert "vector_mode=sync" in captured.out
    assert result["global_step"] == 240 and (tmp_path / "policy.pt2").is_file()
    assert b"falling back to --vector-mode sync" in tensorboard_bytes(tmp_path)  # TensorBoard text "warnings"


def test_resume_with_a_gymnasium_env_starts_new_episodes(tmp_path, capsys):
    common = ["--env-id", "Pendulum-v1", "--eval-split", "none", "--checkpoint-every", "5", *GYM_TINY]
    train_in_process(tmp_path, "--total-timesteps", "240", *common)
    result = train_in_process(tmp_path, "--total-timesteps", "480", "--resume", *common)
    out = capsys.readouterr().out
    assert "envs start new episodes" in out and "resumed from" in out and "global_step 240" in out
    assert result["global_step"] == 480
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(metrics.global_step) == [240, 480]
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 480 and ckpt["env"]["env"]["env"] is None  # (reward norm, episode stats, env)


def test_gym_env_rescales_actions_and_truncations_bootstrap_from_final_obs():
    a2c = load_a2c()
    vec = gym.make_vec(
        "Pendulum-v1",
        2,
        vectorization_mode="sync",
        max_episode_steps=3,
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    vec = GymTorchVecEnv(vec, torch.device("cpu"), "sync")
    np.testing.assert_allclose(vec.action_to_env(torch.tensor([[-1.0], [0.5]])), [[-2.0], [1.0]])
    np.testing.assert_allclose(vec.action_to_env(torch.tensor([[-3.0], [1.5]])), [[-2.0], [2.0]])  # clipped first
    torch.manual_seed(0)
    agent = a2c.Agent(3, 1, 8, norm_obs=False)  # no running statistics: both rollouts act alike
    act = functools.partial(a2c.policy_step, agent)
    storages = []
    for value_fn in (None, lambda obs: torch.full((obs.shape[0],), 10.0)):
        env = RecordEpisodeStatistics(vec, info_keys=())  # episode sums from 0
        obs, _ = env.reset(seed=0)
        assert obs.dtype == torch.float32 and obs.shape == (2, 3)
        storage = a2c.make_storage(4, 2, 3, 1, torch.device("cpu"))
        torch.manual_seed(1)
        a2c.rollout(
            act,
            env,
            obs,
            storage=storage,
            gamma=0.9,
            bootstrap_truncation=True,
            value_fn=value_fn,
        )
        n_done, _, length = env.pop().tolist()
        assert n_done == 2 and length == 6
        storages.append(storage)
    plain, boot = storages
    truncation = torch.zeros(4, 2)
    truncation[2] = 1.0  # the third step truncates both envs
    torch.testing.assert_close(plain["dones"], truncation)
    torch.testing.assert_close(plain["terminals"], torch.zeros(4, 2))  # no final_obs bootstrap: V(next obs)
    torch.testing.assert_close(boot["terminals"], truncation)  # the bootstrap is in the reward
    torch.testing.assert_close(boot["rewards"], plain["rewards"] + 0.9 * 10.0 * truncation)
    env.close()


# ---------------------------------------------------------------------------------------------- Discrete actions
CARTPOLE_TINY = [
    "--env-id",
    "CartPole-v1",
    "--num-envs",
    "4",
    "--num-steps",
    "5",
    "--hidden-size",
    "16",
    "--log-every",
    "25",
    "--eval-split",
    "none",
    "--no-cuda",
]
"""CartPole-v1 with 4 envs x 5 steps per update: a log row every 25 updates = 500 steps."""


def test_cartpole_trains_with_a_categorical_policy(tmp_path):
    out = tmp_path / "cartpole"
    proc = run_a2c("--output-dir", str(out), "--total-timesteps", "1000", "--checkpoint-every", "25", *CARTPOLE_TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vector_mode=sync" in proc.stdout

    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [500, 1000]
    assert (metrics.episodic_length >= 8).all() and (metrics.episodic_return == metrics.episodic_length).all()
    assert np.isfinite(metrics[["value_loss", "policy_loss", "entropy", "grad_norm"]].to_numpy()).all()
    assert (metrics.entropy <= math.log(2) + 1e-6).all()  # a Categorical over 2 actions
    assert "charts/episodic_length" in set(tensorboard(out).Tags()["scalars"])

    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 1000
    assert ckpt["agent"]["actor_logits.5.weight"].shape == (2, 16) and "actor_logstd" not in ckpt["agent"]
    policy = torch.export.load(out / "policy.pt2").module()
    for batch in (1, 7):  # dynamic batch dimension
        action = policy(torch.randn(batch, 4) * 2)
        assert action.shape == (batch,) and action.dtype == torch.int64
        assert ((action >= 0) & (action <= 1)).all()


def test_resume_of_a_cartpole_run_reaches_the_full_step_count(tmp_path, capsys):
    common = ["--checkpoint-every", "10", *CARTPOLE_TINY]
    first = train_in_process(tmp_path, "--total-timesteps", "500", *common)
    assert first["global_step"] == 500
    before = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    result = train_in_process(tmp_path, "--total-timesteps", "1000", "--resume", *common)
    out = capsys.readouterr().out
    assert "envs start new episodes" in out and "resumed from" in out and "global_step 500" in out
    assert result["global_step"] == 1000
    assert list(pd.read_parquet(tmp_path / "metrics.parquet").global_step) == [500, 1000]
    after = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert after["global_step"] == 1000 and after["iteration"] == 50 and after["env"]["env"]["env"] is None
    assert not torch.equal(after["agent"]["actor_logits.5.weight"], before["agent"]["actor_logits.5.weight"])
    assert torch.export.load(tmp_path / "policy.pt2").module()(torch.zeros(3, 4)).dtype == torch.int64


def cartpole_mean_return(act, episodes: int = 20) -> float:
    """Mean return of ``act(obs) -> int action`` over ``episodes`` CartPole-v1 episodes, reset with seeds 1000, ..."""
    env = gym.make("CartPole-v1")
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=1000 + episode)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def test_cartpole_greedy_policy_beats_a_random_one(tmp_path):
    """30k steps of 8 envs x 5 steps, gamma 0.99 (seed 1; about 2.5 s of training on 2 CPU cores), then the greedy
    policy.pt2 on 20 CartPole-v1 episodes. Measured with seeds 1, 2, 3: mean greedy return 500, 241, 484; a
    uniform-random policy gets about 22."""
    result = train_in_process(
        tmp_path,
        "--env-id",
        "CartPole-v1",
        "--num-envs",
        "8",
        "--num-steps",
        "5",
        "--gamma",
        "0.99",
        "--hidden-size",
        "64",
        "--total-timesteps",
        "30000",
        "--log-every",
        "250",
        "--eval-split",
        "none",
        "--no-cuda",
    )
    assert result["global_step"] == 30000
    policy = torch.export.load(tmp_path / "policy.pt2").module()
    start = gym.make("CartPole-v1").action_space.start

    def greedy(obs: np.ndarray) -> int:
        with torch.no_grad():
            return int(policy(torch.as_tensor(obs, dtype=torch.float32)[None])[0]) + int(start)

    space = gym.spaces.Discrete(2, seed=0)
    greedy_return, random_return = cartpole_mean_return(greedy), cartpole_mean_return(lambda obs: int(space.sample()))
    message = f"mean greedy return {greedy_return:.1f} vs uniform-random {random_return:.1f} (20 episodes)"
    assert random_return < 40, message
    assert greedy_return >= 100 and greedy_return > 4 * random_return, message


class RecordActions(gym.Env):
    """A one-step env with actions ``Discrete(3, start=-1)`` that records the actions it gets."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3, start=-1)

    def __init__(self, log: list):
        self.log = log

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.log.append(action)
        return np.zeros(2, np.float32), 0.0, True, False, {}


def test_gym_env_gets_discrete_actions_as_ints_offset_by_start():
    a2c = load_a2c()
    log: list = []
    vec = gym.vector.SyncVectorEnv([lambda: RecordActions(log)] * 3, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    env = RecordEpisodeStatistics(GymTorchVecEnv(vec, torch.device("cpu"), "sync"), info_keys=())
    np.testing.assert_array_equal(env.action_to_env(torch.tensor([0, 1, 2])), [-1, 0, 1])
    assert env.action_to_env(torch.tensor([2, 0, 1])).dtype == np.int64
    env.reset(seed=0)
    _, _, terminated, _, info = env.step(torch.tensor([0, 2, 1]))  # the indices a Categorical policy samples
    assert [int(a) for a in log] == [-1, 1, 0]
    assert all(isinstance(a, (int, np.integer)) for a in log)
    assert terminated.all() and info["final_obs"].shape == (3, 2)
    # the rollout stores the indices (int64) and hands them to the adapter unchanged
    agent = a2c.Agent(2, 3, 8, norm_obs=False, discrete=True)
    storage = a2c.make_storage(4, 3, 2, 1, torch.device("cpu"), discrete=True)
    assert storage["actions"].dtype == torch.int64 and storage["actions"].shape == (4, 3)
    log.clear()
    obs, _ = env.reset(seed=0)
    policy = functools.partial(a2c.policy_step, agent)
    a2c.rollout(policy, env, obs, storage=storage, gamma=0.9, bootstrap_truncation=True)
    assert [int(a) for a in log] == (storage["actions"].reshape(-1) - 1).tolist()
    assert set(storage["actions"].unique().tolist()) <= {0, 1, 2}
    env.close()


# ---------------------------------------------------------------------------------------------- image observations
SNAKE_TINY = [
    "--env-id",
    "Snake-v0",
    "--num-envs",
    "4",
    "--num-steps",
    "8",
    "--hidden-size",
    "16",
    "--cnn-channels",
    "4",
    "8",
    "--log-every",
    "4",
    "--no-cuda",
]
"""Snake-v0 (10 x 10 boards) with 4 envs x 8 steps per update and a tiny CNN: a log row every 4 updates = 128 steps."""


def shown_args(stdout: str) -> dict[str, str]:
    """The ``args: k=v, ...`` line a run prints, as a dict of the printed values."""
    line = next(line for line in stdout.splitlines() if line.startswith("args: "))
    pairs = re.split(r", (?=\w+=)", line[len("args: ") :])
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.fixture(scope="module")
def snake_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("a2c_snake")
    proc = run_a2c("--output-dir", str(out), "--total-timesteps", "256", "--checkpoint-every", "4", *SNAKE_TINY)
    return out, proc


def test_snake_trains_through_the_cnn_and_exports_an_action_policy(snake_run):
    out, proc = snake_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = next(line for line in proc.stdout.splitlines() if line.startswith("A2C on Snake-v0"))
    assert "torch-batched" in start and "obs (3, 10, 10) (CNN 4-8)" in start and "4 envs x 8 steps" in start
    assert "|field|cpu*|gpu|Snake-v0|used|" in proc.stdout  # the env's defaults, a column of the preset table
    assert "|gamma|||0.99|0.99|" in proc.stdout and "|cnn_channels|||(16, 32)|(4, 8)|" in proc.stdout
    assert "no split evaluation for Snake-v0" in proc.stdout

    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [128, 256]
    assert np.isfinite(
        metrics[
            ["episodic_return", "episodic_length", "value_loss", "policy_loss", "entropy", "grad_norm", "learning_rate"]
        ].to_numpy()
    ).all(), metrics.T
    assert (metrics.episodic_length >= 1).all() and (metrics.episodic_return >= -1).all()
    assert (metrics.entropy <= math.log(4) + 1e-6).all()  # a Categorical over Snake's 4 actions
    assert metrics[["episodic_co2_kg", "episodic_unserved_kwh", *a2c_gpu_columns()]].isna().all().all()

    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 256 and ckpt["env"]["env"] is not None  # a torch-batched env: its state is stored
    agent = ckpt["agent"]
    assert agent["network.0.weight"].shape == (4, 3, 3, 3) and agent["network.2.weight"].shape == (8, 4, 3, 3)
    assert agent["network.5.weight"].shape == (16, 8 * 10 * 10)  # Linear(c2 * H * W, hidden_size)
    assert agent["actor_logits.weight"].shape == (4, 16) and agent["critic.weight"].shape == (1, 16)
    assert not any(k.startswith("obs_norm.") for k in agent)  # images are not standardised by default
    assert ckpt["args"]["norm_obs"] is False and ckpt["args"]["norm_reward"] is False

    policy = torch.export.load(out / "policy.pt2").module()
    for batch in (1, 6):  # dynamic batch dimension
        action = policy(torch.rand(batch, 3, 10, 10))
        assert action.shape == (batch,) and action.dtype == torch.int64
        assert ((action >= 0) & (action <= 3)).all()
    assert not (out / "policy.json").exists() and not list(out.glob("eval_*.parquet"))


def test_snake_hyperparameters_leave_out_the_evhub_only_options(snake_run, trained):
    a2c = load_a2c()
    out, proc = snake_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(harness.EVHUB_ONLY_ARGS) == {
        "site",
        "train_split",
        "train_window_end",
        "action_mode",
        "bess_action",
        "socket_features",
        "weekday_features",
        "context_features",
        "dc_prior",
        "exo_prior",
        "eval_split",
        "eval_every",
    }
    assert set(harness.EVHUB_ONLY_ARGS) <= {f.name for f in dataclasses.fields(a2c.Args)}
    shown = shown_args(proc.stdout)
    assert shown["env_id"] == "Snake-v0" and shown["cnn_channels"] == "(4, 8)" and shown["gamma"] == "0.99"
    assert not set(harness.EVHUB_ONLY_ARGS) & set(shown), shown
    text = tensorboard(out).Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "|cnn_channels|(4, 8)|" in text and not any(f"|{k}|" in text for k in harness.EVHUB_ONLY_ARGS), text
    # EVHub-v0 runs show them all, with the EVHub-v0 values of the env-dependent fields
    evhub_shown = shown_args(trained[1].stdout)
    assert set(harness.EVHUB_ONLY_ARGS) <= set(evhub_shown)
    assert (evhub_shown["gamma"], evhub_shown["ent_coef"], evhub_shown["norm_obs"], evhub_shown["norm_reward"]) == (
        "0.98",
        "0.0",
        "True",
        "True",
    )


def test_resume_of_a_snake_run_reaches_the_full_step_count(snake_run, tmp_path, capsys):
    out, first = snake_run
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "snake"
    run.mkdir()
    for name in ("checkpoint.pt", "metrics.parquet"):
        (run / name).write_bytes((out / name).read_bytes())
    before = torch.load(run / "checkpoint.pt", weights_only=False)
    result = train_in_process(
        run, "--total-timesteps", "512", "--resume", "--checkpoint-every", "4", "--eval-split", "none", *SNAKE_TINY
    )
    stdout = capsys.readouterr().out
    assert "resumed from" in stdout and "global_step 256" in stdout and "start new episodes" not in stdout
    assert result["global_step"] == 512
    assert list(pd.read_parquet(run / "metrics.parquet").global_step) == [128, 256, 384, 512]
    after = torch.load(run / "checkpoint.pt", weights_only=False)
    assert after["global_step"] == 512 and after["iteration"] == 16 and after["env"]["env"] is not None
    assert not torch.equal(after["agent"]["network.0.weight"], before["agent"]["network.0.weight"])
    action = torch.export.load(run / "policy.pt2").module()(torch.rand(2, 3, 10, 10))
    assert action.dtype == torch.int64 and action.shape == (2,)


def test_snake_defaults_come_from_env_defaults_and_every_flag_wins():
    a2c = load_a2c()
    preset_args = functools.partial(harness.preset_args, a2c.Args, a2c.PRESETS, a2c.ENV_DEFAULTS, cuda=False)
    args = preset_args(env_id="Snake-v0")
    snake = {**a2c.ENV_DEFAULTS["Snake-v0"], **a2c.ENV_DEFAULTS["Snake-v0/cpu"]}
    for key, value in snake.items():
        assert getattr(args, key) == value, key
    assert (args.gamma, args.norm_obs, args.norm_reward, args.learning_rate) == (0.99, False, False, 7e-4)
    assert args.log_every == a2c.PRESETS["cpu"]["log_every"]  # what the env leaves open comes from the preset
    flags = dict(
        gamma=0.9,
        ent_coef=0.0,
        norm_obs=True,
        norm_reward=True,
        cnn_channels=(2, 3),
        num_envs=3,
        total_timesteps=96,
        hidden_size=8,
    )
    args = preset_args(env_id="Snake-v0", **flags)
    assert {k: getattr(args, k) for k in flags} == flags
    gpu = preset_args(env_id="envs:Snake-v0", preset="gpu")  # a module prefix is fine
    assert (gpu.num_envs, gpu.cnn_channels, gpu.gamma) == (512, (32, 64), 0.99)
    # envs without an entry keep the EVHub-v0 values
    for env_id in ("EVHub-v0", "CartPole-v1"):
        args = preset_args(env_id=env_id)
        assert (args.gamma, args.ent_coef, args.norm_reward, args.norm_obs) == (0.98, 0.0, True, True)
        assert args.num_envs == a2c.PRESETS["cpu"]["num_envs"] and args.cnn_channels == (32, 64)
        table = harness.presets_table(a2c.PRESETS, a2c.ENV_DEFAULTS, args)
        assert "Snake" not in table and table.startswith("|field|cpu*|gpu|used|")


def test_cnn_agent_shares_its_torso_and_takes_box_actions_too():
    a2c = load_a2c()
    torch.manual_seed(0)
    agent = a2c.Agent(3 * 6 * 5, 4, 16, norm_obs=False, discrete=True, obs_shape=(3, 6, 5), cnn_channels=(2, 4))
    assert agent.image and isinstance(agent.actor_logits, torch.nn.Linear) and isinstance(agent.critic, torch.nn.Linear)
    assert agent.actor_logits.weight.abs().max() < 0.05  # policy head: orthogonal, std 0.01
    obs = torch.rand(7, 3, 6, 5)
    dist, value = agent.dist_and_value(obs)
    assert dist.logits.shape == (7, 4) and value.shape == (7,)
    value.sum().backward()  # the critic's loss reaches the shared torso
    assert agent.network[0].weight.grad is not None and agent.network[0].weight.grad.abs().sum() > 0
    assert agent.actor_logits.weight.grad is None
    # one update over a rollout of images; Box actions: a Gaussian head on the same torso
    T, N = 3, 2
    box = a2c.Agent(3 * 6 * 5, 2, 16, init_logstd=-0.5, obs_shape=(3, 6, 5), cnn_channels=(2, 4))
    assert isinstance(box.obs_norm, harness.RunningObsNorm) and box.obs_norm.mean.shape == (3, 6, 5)  # per pixel
    opt = a2c.make_optimizer(box.parameters(), "rmsprop", torch.tensor(1e-3))
    storage = a2c.make_storage(T, N, (3, 6, 5), 2, torch.device("cpu"))
    assert storage["obs"].shape == (T, N, 3, 6, 5)
    obs_n, action, _ = a2c.policy_step(box, torch.rand(N, 3, 6, 5))
    assert obs_n.shape == (N, 3, 6, 5) and action.shape == (N, 2)
    before = box.network[0].weight.detach().clone()
    out = a2c.update(
        box,
        opt,
        torch.rand(T, N, 3, 6, 5),
        torch.randn(T, N, 2),
        torch.randn(T, N),
        torch.randn(T, N),
        torch.zeros(T, N),
        torch.zeros(T, N),
        torch.rand(N, 3, 6, 5),
        gamma=0.9,
        gae_lambda=1.0,
        vf_coef=0.5,
        ent_coef=0.01,
        max_grad_norm=0.5,
        norm_adv=True,
        amp=False,
    )
    assert not out["bad"].any() and not torch.equal(before, box.network[0].weight)


class ToyImageEnv(gym.Env):
    """Images ``(2, 4, 3)`` filled with the step count / 10, Discrete(3) actions, reward 1, truncated after 3 steps."""

    observation_space = gym.spaces.Box(0.0, 1.0, (2, 4, 3), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros((2, 4, 3), np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full((2, 4, 3), self.t / 10, np.float32), 1.0, False, self.t >= 3, {}


def test_gym_image_env_keeps_its_observations_and_bootstraps_from_their_final_obs():
    a2c = load_a2c()
    vec = gym.vector.SyncVectorEnv([ToyImageEnv] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    env = GymTorchVecEnv(vec, torch.device("cpu"), "sync")
    assert env.obs_shape == (2, 4, 3)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, 2, 4, 3) and obs.dtype == torch.float32
    torch.manual_seed(0)
    agent = a2c.Agent(24, 3, 8, norm_obs=False, discrete=True, obs_shape=(2, 4, 3), cnn_channels=(2, 2))
    storage = a2c.make_storage(4, 2, (2, 4, 3), 1, torch.device("cpu"), discrete=True)
    finals = []

    def value_fn(final_obs):
        finals.append(final_obs)
        return torch.full((final_obs.shape[0],), 10.0)

    policy = functools.partial(a2c.policy_step, agent)
    a2c.rollout(policy, env, obs, storage=storage, gamma=0.9, bootstrap_truncation=True, value_fn=value_fn)
    assert len(finals) == 1 and finals[0].shape == (2, 2, 4, 3)
    torch.testing.assert_close(finals[0], torch.full((2, 2, 4, 3), 0.3))  # the last image of each episode
    torch.testing.assert_close(storage["rewards"][2], torch.full((2,), 1.0 + 0.9 * 10.0))
    assert storage["obs"][3].abs().sum() == 0  # SAME_STEP autoreset: the next episode's first image
    env.close()
