"""``algos/ppo.py``'s own pieces: GAE, the minibatch update, the presets and the speed switches; gymnasium envs
(Pendulum-v1, sync and async vector envs, the async-start fallback, the final_obs bootstrap, refused spaces), Discrete
actions (CartPole-v1: a run, resume, the out-of-memory back-off, learning; the Categorical head and the adapter's
``start`` offset) and image observations (Snake-v0 through the CNN torso: a run, resume, the printed hyperparameters,
its defaults, ``--norm-obs``, the out-of-memory back-off; the shared torso). What every agent promises (the tiny run on
a synthetic site, resume, the non-finite stop, ``--help``, ``--compile`` on the CPU, ``gpu_stats``) is checked in
``tests/test_algo_contracts.py``."""

from __future__ import annotations

import math
import subprocess
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import PPO_TINY, ROOT, load_algo, run_algo

from algos import harness
from envs.vector import GymTorchVecEnv, NormalizeReward, RecordEpisodeStatistics, make_vec, obs_shape_of

SCRIPT = ROOT / "algos" / "ppo.py"

TINY = PPO_TINY
"""Tiny budget: 4 envs x 48 steps (one synthetic episode) per iteration (``conftest.PPO_TINY``)."""


load_ppo = partial(load_algo, "ppo")
run_ppo = partial(run_algo, "ppo")


def preset_args(**fields):
    """``Args`` as the command line builds them: the preset's and the env's own defaults under ``fields``."""
    ppo = load_ppo()
    return harness.preset_args(ppo.Args, ppo.PRESETS, ppo.ENV_DEFAULTS, **fields)


def make_agent(
    obs_shape: tuple[int, ...],
    act_dim: int,
    hidden: int,
    *,
    discrete: bool = False,
    norm_obs: bool = True,
    init_logstd: float = 0.0,
    cnn_channels: tuple[int, int] = (32, 64),
):
    """A PPO ``Agent`` for one env's observation shape and action width, with these network settings."""
    ppo = load_ppo()
    args = ppo.Args(hidden_size=hidden, norm_obs=norm_obs, init_logstd=init_logstd, cnn_channels=cnn_channels)
    return ppo.Agent(tuple(obs_shape), act_dim, discrete, args, None)


@pytest.fixture
def trained(tiny_runs) -> tuple[Path, subprocess.CompletedProcess]:
    """PPO's tiny EVHub-v0 run (``conftest.tiny_runs``, shared with ``tests/test_algo_contracts.py``)."""
    return tiny_runs("ppo")


def test_gae_matches_a_hand_computed_example():
    ppo = load_algo("ppo")
    gamma, lam = 0.9, 0.8
    # env 0: a terminal step at t=1 (dones[2] = 1), bootstraps from next_value after t=2
    # env 1: no episode end inside, the observation after the rollout is terminal (next_done = 1)
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0]])
    values = torch.tensor([[0.5, 0.0], [1.0, 0.0], [1.5, 0.0]])
    dones = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    next_value = torch.tensor([2.0, 1.0])
    next_done = torch.tensor([0.0, 1.0])
    adv, ret = ppo.compute_gae(rewards, values, dones, next_value, next_done, gamma, lam)
    # env 0: d2 = 3 + 0.9*2 - 1.5 = 3.3; d1 = 2 - 1 = 1 (no bootstrap); d0 = 1 + 0.9*1 - 0.5 = 1.4
    #        A2 = 3.3, A1 = 1.0, A0 = 1.4 + 0.72 * 1.0 = 2.12
    # env 1: d2 = 1 (next obs terminal), d1 = d0 = 0: A2 = 1, A1 = 0.72, A0 = 0.72^2
    expected = torch.tensor([[2.12, 0.5184], [1.0, 0.72], [3.3, 1.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


class RewardsOnly:
    """A stand-in vector env of ``len(rewards[0])`` envs that returns the rows of ``rewards`` in turn, no episode
    ending."""

    device = torch.device("cpu")

    def __init__(self, rewards: torch.Tensor):
        self.rewards, self.num_envs, self.t = rewards, rewards.shape[1], 0

    def step(self, action):
        reward, self.t = self.rewards[self.t], self.t + 1
        no = torch.zeros(self.num_envs, dtype=torch.bool)
        return torch.zeros(self.num_envs, 1), reward, no, no, {}


def test_running_normalisers_match_batch_statistics():
    torch.manual_seed(0)
    data = torch.randn(5, 64, 3) * torch.tensor([1.0, 5.0, 0.1]) + torch.tensor([0.0, 2.0, -1.0])
    norm = harness.RunningObsNorm(3)
    for batch in data:
        norm.update(batch)
    flat = data.reshape(-1, 3)
    torch.testing.assert_close(norm.mean, flat.mean(0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norm.var, flat.var(0, unbiased=False), rtol=1e-3, atol=1e-4)
    assert norm(flat).abs().max() <= norm.clip

    rewards = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    env = NormalizeReward(RewardsOnly(rewards), gamma=0.5, reset_on_truncation=True)
    returns = []
    ret = torch.zeros(2, dtype=torch.float64)
    for r in rewards:
        _, scaled, *_ = env.step(torch.zeros(2, 1))
        ret = ret * 0.5 + r.double()
        returns.append(ret.clone())
        assert scaled.dtype == r.dtype
    torch.testing.assert_close(env.rn["ret"], ret)
    var = torch.stack(returns).reshape(-1).var(unbiased=False)
    torch.testing.assert_close(env.rn["var"], var.reshape(1), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(scaled, rewards[-1] / torch.sqrt(var + 1e-8).float(), rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------------------------- hot paths
def test_policy_step_draws_what_the_distribution_samples():
    """``mean + std * noise`` (no host sync) draws the numbers ``Normal.sample`` would, so seeds keep their runs."""
    ppo = load_ppo()
    torch.manual_seed(0)
    agent = make_agent((7,), 2, 16, init_logstd=-0.5)
    obs = torch.randn(5, 7)
    rng = torch.get_rng_state()
    obs_n, action, logprob, value = ppo.policy_step(agent, obs)
    assert obs_n.shape == (5, 7) and action.shape == (5, 2) and logprob.shape == (5,) and value.shape == (5,)
    torch.set_rng_state(rng)
    dist, value2 = agent.dist_and_value(obs_n)
    torch.testing.assert_close(action, dist.sample(), rtol=0, atol=0)
    torch.testing.assert_close(logprob, dist.log_prob(action).sum(1))
    torch.testing.assert_close(value, value2)


def minibatch(m: int = 12, obs_dim: int = 7) -> tuple[torch.Tensor, ...]:
    """Random ``(obs, actions, logprobs, advantages, returns, values)`` of ``m`` rows."""
    return torch.randn(m, obs_dim), torch.randn(m, 2), torch.randn(m), torch.randn(m), torch.randn(m), torch.randn(m)


COEFS = dict(clip_coef=0.2, norm_adv=True, clip_vloss=True, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5)


@pytest.mark.parametrize("amp", [False, True])
def test_update_takes_one_finite_step(amp):
    ppo = load_ppo()
    torch.manual_seed(0)
    agent = make_agent((7,), 2, 16)
    opt = torch.optim.Adam(agent.parameters(), lr=torch.tensor(1e-3, dtype=torch.float64), eps=1e-5)
    before = [p.detach().clone() for p in agent.parameters()]
    out = ppo.update_minibatch(agent, opt, *minibatch(), **COEFS, amp=amp)
    assert out["bad"].shape == (len(ppo.LOSS_NAMES),) and not out["bad"].any()
    for key in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac"):
        assert out[key].shape == () and torch.isfinite(out[key]), key
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))


def test_update_covers_the_batch_in_minibatches_and_stops_at_target_kl():
    ppo = load_ppo()
    torch.manual_seed(0)
    batch = minibatch(10)
    seen: list[torch.Tensor] = []

    def learn(obs, *rest):  # a stand-in for the bound update_minibatch
        seen.append(obs)
        z = torch.zeros(())
        return {
            "value_loss": z,
            "policy_loss": z,
            "entropy": z,
            "old_approx_kl": z,
            "approx_kl": torch.tensor(0.5),
            "clipfrac": torch.tensor(0.25),
            "bad": torch.zeros(len(ppo.LOSS_NAMES), dtype=torch.bool),
        }

    out = ppo.update(learn, *batch, update_epochs=3, minibatch_size=4)
    assert [len(o) for o in seen] == [4, 4, 2] * 3  # the last minibatch of an epoch takes the rest
    for epoch in range(3):  # each epoch visits every row once, in a fresh order
        rows = torch.cat(seen[3 * epoch : 3 * epoch + 3])
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, batch[0].tolist()))
    assert float(out["clipfrac"]) == 0.25 and torch.isfinite(out["explained_variance"])
    assert not out["bad"].any()
    seen.clear()
    ppo.update(learn, *batch, update_epochs=3, minibatch_size=4, target_kl=0.1)  # approx_kl 0.5 > 0.1: one epoch
    assert len(seen) == 3


def test_resumed_optimizer_keeps_this_runs_lr_tensor_and_device_flags():
    """A checkpoint from a CUDA run (capturable Adam) resumes on the CPU; the annealed LR tensor stays in charge."""
    param = torch.nn.Parameter(torch.zeros(3))
    saved_opt = torch.optim.Adam([param], lr=0.5)
    param.grad = torch.ones(3)
    saved_opt.step()
    state = saved_opt.state_dict()
    state["param_groups"][0]["capturable"] = True  # as written on a GPU
    lr = torch.tensor(1e-2, dtype=torch.float64)
    opt = torch.optim.Adam([param], lr=lr, eps=1e-5)
    harness.load_optimizer_state(opt, state, lr)
    group = opt.param_groups[0]
    assert group["lr"] is lr and not group["capturable"]
    before = param.detach().clone()
    lr.fill_(0.0)
    opt.step()  # a capturable Adam would refuse CPU parameters
    assert torch.equal(param, before)
    lr.fill_(1e-2)
    opt.step()
    assert (param < before).all()


def test_presets_and_cudagraphs_needs_cuda(monkeypatch):
    ppo = load_ppo()
    # the cpu preset keeps the sizes of the runs made before presets had names (same seed, same numbers)
    assert ppo.PRESETS["cpu"] == {
        "num_envs": 128,
        "num_steps": 168,
        "total_timesteps": 4_000_000,
        "hidden_size": 64,
        "num_threads": 1,
    }
    args = preset_args(cuda=False)  # auto without CUDA in use: cpu
    assert args.preset == "cpu" and (args.num_envs, args.hidden_size, args.num_threads) == (128, 64, 1)
    sizes = ppo.check_args(args)
    batch = 128 * 168
    assert (sizes.batch_size, sizes.minibatch_size, args.total_timesteps // sizes.batch_size) == (
        batch,
        batch // 8,
        4_000_000 // batch,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preset_args().preset == "gpu"  # auto picks by device
    assert preset_args(cuda=False).preset == "cpu"
    monkeypatch.undo()
    args = preset_args(preset="gpu", num_envs=7, cuda=False)
    assert args.num_envs == 7 and args.hidden_size == ppo.PRESETS["gpu"]["hidden_size"]


def test_cudagraphs_needs_cuda(tmp_path):
    ppo = load_ppo()
    with pytest.raises(ValueError, match="--cudagraphs needs CUDA"):
        ppo.main(ppo.Args(cudagraphs=True, cuda=False, output_dir=str(tmp_path)))
    # target_kl's early stop reads the device after each epoch: refused under CUDA graphs (no GPU needed to check)
    with pytest.raises(ValueError, match="target-kl"):
        ppo.check_args(ppo.Args(cudagraphs=True, target_kl=0.02))
    with pytest.raises(ValueError, match="equal minibatches"):
        ppo.check_args(ppo.Args(cudagraphs=True, num_envs=3, num_steps=5, num_minibatches=2))
    assert isinstance(ppo.check_args(ppo.Args(cudagraphs=True)), ppo.Sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "flags", [["--cudagraphs"], ["--amp"], ["--cudagraphs", "--amp"], ["--compile", "--cudagraphs", "--amp"]]
)
def test_speed_switches_on_cuda(site_toml, tmp_path, flags):
    tiny_cuda = [a for a in TINY if a != "--no-cuda"]
    # 5 iterations: the once-per-iteration GAE is captured at its 4th call and replayed at its 5th
    proc = run_ppo(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path / "g"),
        "--total-timesteps",
        "960",
        *flags,
        *tiny_cuda,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device=cuda" in proc.stdout
    metrics = pd.read_parquet(tmp_path / "g" / "metrics.parquet")
    assert len(metrics) == 5 and np.isfinite(metrics.to_numpy(dtype=float)).all()
    assert (tmp_path / "g" / "policy.pt2").is_file()


# ---------------------------------------------------------------------------------------------- gymnasium envs
PENDULUM = [
    "--env-id", "Pendulum-v1",
    "--num-envs", "2",
    "--num-steps", "100",
    "--total-timesteps", "400",
    "--num-minibatches", "2",
    "--update-epochs", "1",
    "--hidden-size", "16",
    "--checkpoint-every", "1",
    "--no-cuda",
]  # fmt: skip
"""Tiny Pendulum budget: 2 envs x 100 steps per iteration, 2 iterations (one 200-step episode per env)."""


def assert_gym_run(out: Path, proc: subprocess.CompletedProcess) -> pd.DataFrame:
    """A finished Pendulum run: episodic return logged, metrics, checkpoint and policy written, no EVHub outputs."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [200, 400]
    last = metrics.iloc[-1]
    assert -2000 < last.episodic_return < 0 and last.episodic_length == 200
    assert math.isnan(last.episodic_co2_kg) and math.isnan(last.episodic_unserved_kwh)  # EVHub KPIs only
    assert "return -" in proc.stdout and "co2_kg" not in proc.stdout.split("args:")[1].split("\n", 1)[1]
    assert (out / "checkpoint.pt").is_file() and list(out.glob("events.out.tfevents.*"))
    policy = torch.export.load(out / "policy.pt2").module()
    action = policy(torch.randn(5, 3))  # Pendulum: obs (3,), action (1,) in [-1, 1] (the env gets it x 2)
    assert action.shape == (5, 1) and (action.abs() <= 1.0).all()
    assert not (out / "policy.json").exists() and not list(out.glob("eval_*.parquet"))
    assert "no split evaluation" in proc.stdout
    return metrics


@pytest.mark.slow
def test_pendulum_async_vector_env_trains_and_exports(tmp_path):
    out = tmp_path / "async"
    proc = run_ppo("--vector-mode", "async", "--output-dir", str(out), *PENDULUM)
    assert_gym_run(out, proc)
    assert "vector_mode=async" in proc.stdout and "falling back" not in proc.stderr


@pytest.mark.slow
def test_pendulum_sync_vector_env_trains_and_resumes_with_new_episodes(tmp_path):
    out = tmp_path / "sync"
    proc = run_ppo("--vector-mode", "sync", "--output-dir", str(out), *PENDULUM)
    assert_gym_run(out, proc)
    assert "vector_mode=sync" in proc.stdout
    proc = run_ppo("--output-dir", str(out), "--resume", *PENDULUM[:-3], "--total-timesteps", "600", "--no-cuda")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "envs start new episodes" in proc.stdout and "resumed from" in proc.stdout
    assert list(pd.read_parquet(out / "metrics.parquet").global_step) == [200, 400, 600]


def pendulum_args(out: Path, **overrides):
    """``Args`` of a tiny in-process Pendulum run into ``out`` (preset and env defaults under these fields)."""
    fields = dict(
        env_id="Pendulum-v1",
        num_envs=2,
        num_steps=100,
        total_timesteps=200,
        num_minibatches=2,
        update_epochs=1,
        hidden_size=16,
        cuda=False,
        output_dir=str(out),
        eval_split="none",
    )
    return preset_args(**{**fields, **overrides})


def test_async_start_failure_falls_back_to_sync_with_a_warning(tmp_path, monkeypatch, capsys):
    import gymnasium as gym

    ppo = load_ppo()

    def no_workers(*args, **kwargs):
        raise RuntimeError("cannot pickle the env factory (injected by the test)")

    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", no_workers)
    result = ppo.main(pendulum_args(tmp_path, vector_mode="async"))
    assert result["vector_mode"] == "sync" and result["global_step"] == 200
    err = capsys.readouterr().err
    assert "warning: --vector-mode async could not start" in err and "falling back to --vector-mode sync" in err
    events = b"".join(p.read_bytes() for p in tmp_path.glob("events.out.tfevents.*"))
    assert b"injected by the test" in events  # TensorBoard text "warnings"
    assert (tmp_path / "policy.pt2").is_file()


class MultiDiscreteToy(gym.Env):
    """A one-step env with a MultiDiscrete action space, which PPO does not support."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.MultiDiscrete([2, 3])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, True, False, {}


class StackedFramesToy(gym.Env):
    """A one-step env with 4-D observations (stacked image frames), which PPO does not support."""

    observation_space = gym.spaces.Box(0.0, 1.0, (2, 3, 8, 8), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((2, 3, 8, 8), np.float32), {}

    def step(self, action):
        return np.zeros((2, 3, 8, 8), np.float32), 0.0, True, False, {}


@pytest.mark.parametrize(
    "env_id, message",
    [
        (
            "StackedFramesToy-v0",
            r"flat Box observations .* images \(C, H, W\) .* StackedFramesToy-v0 has Box\(.*\(2, 3, 8, 8\)",
        ),
        ("MultiDiscreteToy-v0", r"a Box \(.*Gaussian.* or a Discrete .* MultiDiscreteToy-v0 has MultiDiscrete"),
    ],
)
def test_an_unsupported_space_is_a_clear_error(env_id, message, tmp_path, monkeypatch):
    ppo = load_ppo()
    for toy in (MultiDiscreteToy, StackedFramesToy):
        spec = gym.envs.registration.EnvSpec(f"{toy.__name__}-v0", entry_point=toy)
        monkeypatch.setitem(gym.envs.registry, spec.id, spec)
    with pytest.raises(ValueError, match=message):
        ppo.main(pendulum_args(tmp_path, env_id=env_id))


@pytest.mark.parametrize("space", ["MultiBinary", "Dict", "Tuple"])
def test_other_action_spaces_are_refused_naming_what_is_supported(space):
    ppo = load_ppo()
    act = {
        "MultiBinary": gym.spaces.MultiBinary(3),
        "Dict": gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
        "Tuple": gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(2))),
    }[space]
    obs = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    with pytest.raises(ValueError, match=f"Toy-v0 has {space}") as info:
        ppo.check_spaces("Toy-v0", obs, act)
    assert "Box" in str(info.value) and "Discrete" in str(info.value) and "algos/dqn.py" in str(info.value)
    ppo.check_spaces("Toy-v0", obs, gym.spaces.Discrete(4, start=2))  # both kinds pass
    ppo.check_spaces("Toy-v0", obs, gym.spaces.Box(-1.0, 1.0, (2,), np.float32))


def test_observations_of_four_dims_are_refused_images_and_flat_ones_pass():
    ppo = load_ppo()
    act = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    frames = gym.spaces.Box(0.0, 1.0, (4, 3, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"Frames-v0 has Box\(.*\(4, 3, 8, 8\)") as info:  # its 4-D shape
        ppo.check_spaces("Frames-v0", frames, act)
    assert "(C, H, W)" in str(info.value)
    for shape, torso in (((3, 8, 8), (3, 8, 8)), ((5,), (5,)), ((2, 3), (6,)), ((), (1,))):
        space = gym.spaces.Box(0.0, 1.0, shape, np.float32)
        ppo.check_spaces("Ok-v0", space, act)  # images go to the CNN, the rest is flattened for the MLP
        assert obs_shape_of(space) == torso


def test_gym_adapter_rescales_actions_to_the_box():
    import gymnasium as gym

    env = make_vec("Pendulum-v1", 3, torch.device("cpu"), "sync")
    try:
        assert isinstance(env, GymTorchVecEnv) and env.warning is None and env.vector_mode == "sync"
        action = env.action_to_env(torch.tensor([[-1.0], [0.25], [1.0]]))
        assert action.dtype == np.float32 and action.shape == (3, 1)
        np.testing.assert_allclose(action[:, 0], [-2.0, 0.5, 2.0])
        obs, _ = env.reset(seed=0)
        assert obs.dtype == torch.float32 and obs.shape == (3, 3)
        obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 1))
        assert reward.dtype == torch.float32 and terminated.dtype == torch.bool and truncated.dtype == torch.bool
        assert torch.equal(info["final_obs"], obs) and not truncated.any()
    finally:
        env.close()
    assert isinstance(env.env.unwrapped, gym.vector.SyncVectorEnv)


def test_rollout_bootstraps_truncations_from_final_obs():
    """A gymnasium env's truncated step gets ``gamma * V(final_obs)`` added and ends the GAE chain (done = 1)."""
    ppo = load_ppo()

    class TwoEnvs:  # env 0 truncates at its first step, env 1 terminates; both give reward 1
        num_envs, device = 2, torch.device("cpu")

        def step(self, action):
            obs = torch.zeros(2, 3)
            final = torch.tensor([[7.0, 7.0, 7.0], [0.0, 0.0, 0.0]])
            return obs, torch.ones(2), torch.tensor([False, True]), torch.tensor([True, False]), {"final_obs": final}

    def act(obs):
        return obs, torch.zeros(2, 1), torch.zeros(2), torch.zeros(2)

    storage = ppo.make_storage(
        ppo.Sizes(num_envs=2, num_steps=1, num_minibatches=1), (3,), 1, False, torch.device("cpu")
    )
    env = RecordEpisodeStatistics(TwoEnvs())  # the training env's episode statistics
    seen = []

    def final_value(obs):
        seen.append(obs)
        return torch.full((2,), 10.0)

    _, next_done = ppo.rollout(
        act,
        env,
        torch.zeros(2, 3),
        torch.zeros(2),
        storage=storage,
        gamma=0.5,
        bootstrap_truncation=True,
        final_value=final_value,
    )
    torch.testing.assert_close(storage["rewards"][0], torch.tensor([1.0 + 0.5 * 10.0, 1.0]))
    torch.testing.assert_close(next_done, torch.ones(2))
    assert float(seen[0][0, 0]) == 7.0
    n_done, sum_return = env.pop().tolist()[:2]
    assert n_done == 2 and sum_return == 2.0  # raw rewards in the statistics


def test_presets_table_lists_every_preset_and_the_values_used():
    ppo = load_ppo()
    args = preset_args(num_envs=3, cuda=False)
    table = harness.presets_table(ppo.PRESETS, ppo.ENV_DEFAULTS, args)
    assert table.splitlines()[0] == "|field|cpu*|gpu|used|"
    assert "|num_envs|128|2048|3|" in table


# ---------------------------------------------------------------------------------------------- Discrete actions
CARTPOLE = [
    "--env-id", "CartPole-v1",
    "--vector-mode", "sync",
    "--num-envs", "4",
    "--num-steps", "64",
    "--total-timesteps", "512",
    "--num-minibatches", "2",
    "--update-epochs", "2",
    "--hidden-size", "16",
    "--checkpoint-every", "1",
    "--no-cuda",
]  # fmt: skip
"""Tiny CartPole budget: 4 envs x 64 steps per iteration, 2 iterations (episodes of a random policy: ~20 steps)."""


def cartpole_args(out: Path, **overrides):
    """``Args`` of a tiny in-process CartPole-v1 run into ``out`` (preset and env defaults under these fields)."""
    fields = dict(
        env_id="CartPole-v1",
        num_envs=4,
        num_steps=64,
        total_timesteps=512,
        num_minibatches=2,
        update_epochs=2,
        hidden_size=16,
        cuda=False,
        output_dir=str(out),
        eval_split="none",
    )
    return preset_args(**{**fields, **overrides})


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cartpole") / "run"
    return out, run_ppo("--output-dir", str(out), *CARTPOLE)


@pytest.mark.slow
def test_cartpole_trains_and_exports_an_argmax_policy(cartpole):
    out, proc = cartpole
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PPO on CartPole-v1 vector_mode=sync" in proc.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [256, 512]
    last = metrics.iloc[-1]
    assert last.episodic_length >= 8 and last.episodic_return == last.episodic_length  # reward 1 per step
    assert np.isfinite(metrics[["value_loss", "policy_loss", "entropy", "approx_kl"]].to_numpy()).all()
    assert 0.0 < last.entropy <= math.log(2)  # a Categorical over 2 actions
    assert math.isnan(last.episodic_co2_kg)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 512
    assert ckpt["agent"]["actor.5.weight"].shape == (2, 16) and "actor_logstd" not in ckpt["agent"]
    policy = torch.export.load(out / "policy.pt2").module()
    for batch in (1, 7):  # dynamic batch dimension
        action = policy(torch.randn(batch, 4) * 2)  # CartPole: obs (4,), Discrete(2)
        assert action.dtype == torch.int64 and action.shape == (batch,)
        assert ((action >= 0) & (action <= 1)).all()
    assert not (out / "policy.json").exists() and not list(out.glob("eval_*.parquet"))


def resume_a_copy(finished, tmp_path: Path, *argv: str):
    """Copy the checkpoint and metrics of a ``finished`` run (``(out_dir, proc)``) into ``tmp_path/resumed`` and run
    ``ppo.py --resume`` there with ``argv``; returns ``(out_dir, the copied checkpoint, proc)``, the run succeeded."""
    first, proc = finished
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "resumed"
    out.mkdir()
    for name in ("checkpoint.pt", "metrics.parquet"):
        (out / name).write_bytes((first / name).read_bytes())
    saved = torch.load(out / "checkpoint.pt", weights_only=False)
    proc = run_ppo("--output-dir", str(out), "--resume", *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, saved, proc


@pytest.mark.slow
def test_cartpole_resumes_from_its_checkpoint_to_the_full_step_count(cartpole, tmp_path):
    out, saved, proc = resume_a_copy(cartpole, tmp_path, *CARTPOLE, "--total-timesteps", "768")
    saved = saved["agent"]
    assert "resumed from" in proc.stdout and "global_step 512" in proc.stdout
    assert "envs start new episodes" in proc.stdout
    assert list(pd.read_parquet(out / "metrics.parquet").global_step) == [256, 512, 768]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 768 and ckpt["iteration"] == 3
    assert not torch.equal(ckpt["agent"]["actor.5.weight"], saved["actor.5.weight"])  # trained on from the weights
    assert torch.export.load(out / "policy.pt2").module()(torch.zeros(3, 4)).dtype == torch.int64


def fail_second_update_with_oom(ppo, monkeypatch) -> None:
    """Make the second call of ``ppo.update`` raise a CUDA out-of-memory error (as the allocator would)."""
    real, calls = ppo.update, []

    def update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ppo, "update", update)


def test_cartpole_backs_off_from_an_out_of_memory_error(tmp_path, monkeypatch, capsys):
    """The Discrete storage is rebuilt at half the envs after an out-of-memory error, and the run finishes."""
    ppo = load_ppo()
    fail_second_update_with_oom(ppo, monkeypatch)
    result = ppo.main(cartpole_args(tmp_path, total_timesteps=768, checkpoint_every=1))
    assert result["num_envs"] == 2 and result["global_step"] == 768
    assert "num_envs 4 -> 2" in capsys.readouterr().err
    assert list(pd.read_parquet(tmp_path / "metrics.parquet").global_step) == [256, 384, 512, 640, 768]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["global_step"] == 768


def greedy_cartpole_return(policy, episodes: int = 20) -> float:
    """Mean return of ``policy`` (obs float32 ``(1, 4)`` -> action int64 ``(1,)``) on gymnasium's CartPole-v1 over
    ``episodes`` episodes seeded 1000, 1001, ...; ``policy=None`` draws uniformly random actions (seeded)."""
    env = gym.make("CartPole-v1")
    env.action_space.seed(0)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=1000 + episode)
        total, done = 0.0, False
        while not done:
            if policy is None:
                action = env.action_space.sample()
            else:
                action = int(policy(torch.as_tensor(obs, dtype=torch.float32)[None])[0])
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


@pytest.mark.slow
def test_cartpole_greedy_policy_beats_a_random_one(tmp_path):
    """40,960 steps (8 envs x 128 steps, 40 iterations, about 5 s of training on 2 CPU cores); seeds 1 to 6 gave a
    greedy mean return of 500, 463, 500, 256, 500 and 450 over these 20 episodes, a random policy about 22."""
    ppo = load_ppo()
    # the cpu preset's width (64), not the tiny runs' 16
    args = cartpole_args(
        tmp_path,
        num_envs=8,
        num_steps=128,
        total_timesteps=40_960,
        num_minibatches=4,
        update_epochs=4,
        hidden_size=ppo.PRESETS["cpu"]["hidden_size"],
        checkpoint_every=0,
        seed=1,
    )
    result = ppo.main(args)
    assert result["global_step"] == 40_960
    greedy = greedy_cartpole_return(torch.export.load(tmp_path / "policy.pt2").module())
    random_ = greedy_cartpole_return(None)
    assert greedy >= 150.0 and greedy > 5 * random_, f"greedy mean return {greedy:.1f} vs random {random_:.1f}"


def test_gym_adapter_passes_discrete_actions_as_ints_offset_by_start():
    class Shifted(gym.Env):  # Discrete(3, start=-1): actions -1, 0, 1; the observation echoes the action
        observation_space = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
        action_space = gym.spaces.Discrete(3, start=-1)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.received = []
            return np.zeros(2, np.float32), {}

        def step(self, action):
            assert self.action_space.contains(action), action
            self.received.append(action)
            return np.full(2, action, np.float32), 1.0, False, False, {}

    vec = gym.vector.SyncVectorEnv([Shifted] * 3, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    try:
        env = GymTorchVecEnv(vec, torch.device("cpu"), "sync")
        assert env.discrete
        host = env.action_to_env(torch.tensor([0, 1, 2]))
        assert host.dtype == np.int64 and host.shape == (3,)
        np.testing.assert_array_equal(host, [-1, 0, 1])
        env.reset(seed=0)
        obs, reward, *_ = env.step(torch.tensor([2, 0, 1]))  # as the rollout passes them: int64 indices, unclipped
        assert [e.received for e in vec.envs] == [[1], [-1], [0]]
        assert all(isinstance(e.received[0], np.integer) for e in vec.envs)
        torch.testing.assert_close(obs[:, 0], torch.tensor([1.0, -1.0, 0.0]))
    finally:
        vec.close()


def test_discrete_head_samples_scores_and_updates():
    """The Categorical head: logits of width n (gain 0.01), int64 actions drawn as ``Categorical.sample`` draws
    them, log-probabilities and entropy without a sum over action dimensions, a finite update, int64 storage and an
    argmax deterministic actor."""
    ppo = load_ppo()
    torch.manual_seed(0)
    agent = make_agent((7,), 3, 16, discrete=True)
    assert agent.discrete and agent.policy_head is agent.actor and not hasattr(agent, "actor_logstd")
    head = agent.actor[-1].weight  # orthogonal rows of norm 0.01
    torch.testing.assert_close(head @ head.T, 1e-4 * torch.eye(3))
    obs = torch.randn(5, 7)
    rng = torch.get_rng_state()
    obs_n, action, logprob, value = ppo.policy_step(agent, obs)
    assert action.dtype == torch.int64 and action.shape == (5,) and logprob.shape == (5,) and value.shape == (5,)
    torch.set_rng_state(rng)
    dist, _ = agent.dist_and_value(obs_n)
    torch.testing.assert_close(action, dist.sample(), rtol=0, atol=0)
    torch.testing.assert_close(logprob, torch.log_softmax(agent.actor(obs_n), -1).gather(1, action[:, None])[:, 0])

    storage = ppo.make_storage(
        ppo.Sizes(num_envs=5, num_steps=2, num_minibatches=1), (7,), 3, True, torch.device("cpu")
    )
    assert storage["actions"].dtype == torch.int64 and storage["actions"].shape == (2, 5)
    storage["actions"][0] = action
    opt = torch.optim.Adam(agent.parameters(), lr=torch.tensor(1e-3, dtype=torch.float64), eps=1e-5)
    before = [p.detach().clone() for p in agent.parameters()]
    out = ppo.update_minibatch(agent, opt, obs_n, storage["actions"][0], logprob, *torch.randn(3, 5), **COEFS)
    assert not out["bad"].any() and 0.0 < float(out["entropy"]) <= math.log(3)
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))

    actor = ppo.DeterministicActor(agent)
    torch.testing.assert_close(actor(obs), agent.actor(agent.obs_norm(obs)).argmax(-1))


# ---------------------------------------------------------------------------------------------- image observations
SNAKE = [
    "--env-id", "Snake-v0",
    "--num-envs", "4",
    "--num-steps", "32",
    "--total-timesteps", "256",
    "--num-minibatches", "2",
    "--update-epochs", "2",
    "--hidden-size", "16",
    "--cnn-channels", "4", "8",
    "--checkpoint-every", "1",
    "--no-cuda",
]  # fmt: skip
"""Tiny Snake budget: 4 boards x 32 steps per iteration, 2 iterations, a CNN torso of 4 and 8 channels."""


def snake_args(out: Path, **overrides):
    """``Args`` of a tiny in-process Snake-v0 run into ``out`` (the fields of :data:`SNAKE`, Snake's own defaults
    under them, as on the command line)."""
    fields = dict(
        env_id="Snake-v0",
        num_envs=4,
        num_steps=32,
        total_timesteps=256,
        num_minibatches=2,
        update_epochs=2,
        hidden_size=16,
        cnn_channels=(4, 8),
        checkpoint_every=1,
        cuda=False,
        output_dir=str(out),
    )
    return preset_args(**{**fields, **overrides})


@pytest.fixture(scope="module")
def snake(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("snake") / "run"
    return out, run_ppo("--output-dir", str(out), *SNAKE)


def shown_args(stdout: str) -> list[str]:
    """The names on the ``args: name=value, ...`` line a run prints at its start."""
    import re

    line = next(line for line in stdout.splitlines() if line.startswith("args: "))
    return re.findall(r"(?:^args: |, )(\w+)=", line)


@pytest.mark.slow
def test_snake_trains_with_a_cnn_torso_and_exports_an_argmax_policy(snake):
    out, proc = snake
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = next(line for line in proc.stdout.splitlines() if line.startswith("PPO on "))
    # the headline names the env, the observations, the torso and the policy head
    assert start.startswith("PPO on Snake-v0 torch-batched"), start
    assert "obs (3, 10, 10)" in start and "CNN" in start and "Categorical" in start, start

    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [128, 256] and metrics.num_envs.tolist() == [4, 4]
    losses = metrics[["value_loss", "policy_loss", "entropy", "approx_kl", "clipfrac", "explained_variance"]]
    assert np.isfinite(losses.to_numpy()).all()
    assert ((metrics.entropy > 0) & (metrics.entropy <= math.log(4))).all()  # a Categorical over 4 directions
    # a random snake dies within a few dozen steps: episodes end in each iteration, -1 for the death plus any food
    assert (metrics.episodic_length >= 1).all() and (metrics.episodic_return >= -1).all()
    assert metrics.episodic_co2_kg.isna().all()

    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 256 and ckpt["iteration"] == 2
    weights = ckpt["agent"]
    assert weights["network.0.weight"].shape == (4, 3, 3, 3) and weights["network.2.weight"].shape == (8, 4, 3, 3)
    assert weights["network.5.weight"].shape == (16, 8 * 10 * 10)  # Linear(c2 * H * W, hidden)
    assert weights["actor.weight"].shape == (4, 16) and weights["critic.weight"].shape == (1, 16)
    assert not any(k.startswith("obs_norm") for k in weights)  # images are fed as they are by default
    assert ckpt["next_obs"].shape == (4, 3, 10, 10) and ckpt["env"]["env"] is not None  # Snake's own state
    assert ckpt["args"]["cnn_channels"] == (4, 8) and ckpt["args"]["gamma"] == 0.99  # Snake's own defaults

    policy = torch.export.load(out / "policy.pt2").module()
    agent = make_agent((3, 10, 10), 4, 16, norm_obs=False, discrete=True, cnn_channels=(4, 8))
    agent.load_state_dict(weights)
    for batch in (1, 5):  # dynamic batch dimension
        obs = torch.rand(batch, 3, 10, 10)
        action = policy(obs)
        assert action.dtype == torch.int64 and action.shape == (batch,)
        assert ((action >= 0) & (action <= 3)).all()
        torch.testing.assert_close(action, agent.policy_head(obs).argmax(-1), rtol=0, atol=0)
    from envs.snake import SnakeVectorEnv

    env = SnakeVectorEnv(3)
    obs, _ = env.reset(seed=0)
    env.step(policy(obs))  # the greedy actions of real boards drive the env
    assert not (out / "policy.json").exists() and not list(out.glob("eval_*.parquet"))


@pytest.mark.slow
def test_snake_resumes_where_it_stopped_to_the_full_step_count(snake, tmp_path):
    out, saved, proc = resume_a_copy(snake, tmp_path, *SNAKE, "--total-timesteps", "384")
    assert "resumed from" in proc.stdout and "global_step 256" in proc.stdout
    assert "envs start new episodes" not in proc.stdout  # a torch-batched env goes on from its saved state
    assert list(pd.read_parquet(out / "metrics.parquet").global_step) == [128, 256, 384]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 384 and ckpt["iteration"] == 3
    assert not torch.equal(ckpt["agent"]["network.0.weight"], saved["agent"]["network.0.weight"])  # trained on
    action = torch.export.load(out / "policy.pt2").module()(torch.zeros(2, 3, 10, 10))
    assert action.dtype == torch.int64 and action.shape == (2,)


@pytest.mark.slow
def test_snake_hyperparameters_leave_out_the_evhub_only_options(snake, trained):
    assert {"site", "bess_action", "socket_features", "weekday_features", "eval_split"} <= set(harness.EVHUB_ONLY_ARGS)
    out, proc = snake
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shown = shown_args(proc.stdout)
    assert {"env_id", "cnn_channels", "gamma", "ent_coef", "norm_obs", "norm_reward", "num_envs"} <= set(shown)
    assert not set(harness.EVHUB_ONLY_ARGS) & set(shown), shown
    events = b"".join(p.read_bytes() for p in out.glob("events.out.tfevents.*"))  # the TensorBoard text too
    assert b"|cnn_channels|(4, 8)|" in events and b"|env_id|Snake-v0|" in events
    assert not any(f"|{name}|".encode() in events for name in harness.EVHUB_ONLY_ARGS)
    # the preset table shows Snake's own defaults beside the presets and the values used
    assert "|field|cpu*|gpu|Snake-v0|used|" in proc.stdout and "|gamma|||0.99|0.99|" in proc.stdout
    assert "|cnn_channels|||(16, 32)|(4, 8)|" in proc.stdout
    # EVHub-v0 runs still show them
    evhub_out, evhub_proc = trained
    assert evhub_proc.returncode == 0, evhub_proc.stderr[-3000:]
    assert set(harness.EVHUB_ONLY_ARGS) <= set(shown_args(evhub_proc.stdout))


def test_snake_defaults_fill_only_the_fields_left_unset(tmp_path):
    ppo = load_ppo()
    snake = preset_args(env_id="Snake-v0", cuda=False)
    expected = {**ppo.ENV_DEFAULTS["Snake-v0"], **ppo.ENV_DEFAULTS["Snake-v0/cpu"]}
    prefixed = preset_args(env_id="envs:Snake-v0", cuda=False)  # a module: prefix finds the same defaults
    assert {key: getattr(prefixed, key) for key in expected} == expected
    assert {key: getattr(snake, key) for key in expected} == expected
    assert snake.gamma == 0.99 and snake.norm_obs is False and snake.norm_reward is False
    assert snake.num_threads == ppo.PRESETS["cpu"]["num_threads"]  # what Snake leaves unset comes from the preset
    sizes = ppo.check_args(snake)
    assert (sizes.batch_size, sizes.minibatch_size) == (
        snake.num_envs * snake.num_steps,
        snake.num_envs * snake.num_steps // snake.num_minibatches,
    )
    assert snake.total_timesteps // sizes.batch_size == 500_000 // (16 * 128)
    custom = preset_args(
        env_id="Snake-v0",
        gamma=0.9,
        num_envs=3,
        cnn_channels=(4, 8),
        norm_reward=True,
        learning_rate=3e-4,
        update_epochs=1,
        cuda=False,
    )
    assert (custom.gamma, custom.num_envs, custom.cnn_channels, custom.norm_reward) == (0.9, 3, (4, 8), True)
    assert (custom.learning_rate, custom.update_epochs, custom.ent_coef) == (3e-4, 1, 0.01)
    gpu = preset_args(env_id="Snake-v0", preset="gpu")
    assert (gpu.num_envs, gpu.hidden_size, gpu.cnn_channels) == (256, 512, (32, 64))
    # other envs keep the values the fields had before the env defaults existed (norm_obs: on, as it was for their
    # flat observations)
    for env_id in ("EVHub-v0", "CartPole-v1", "Pendulum-v1"):
        args = preset_args(env_id=env_id, cuda=False)
        assert (
            args.learning_rate,
            args.gamma,
            args.num_minibatches,
            args.update_epochs,
            args.ent_coef,
            args.norm_reward,
            args.cnn_channels,
            args.norm_obs,
        ) == (1e-3, 0.98, 8, 5, 0.0, True, (32, 64), True)
    with pytest.raises(ValueError, match="--cnn-channels takes two positive"):
        ppo.main(snake_args(tmp_path, cnn_channels=(0, 8)))


@pytest.mark.parametrize("discrete", [True, False])
def test_cnn_agent_shares_one_torso_between_its_heads(discrete, tmp_path):
    """The image torso (CleanRL's ppo_atari layout with dqn.py's layers): both heads read one CNN, the policy head
    has gain 0.01 and the value head gain 1; sampling, the update and the exported policy take (B, C, H, W)."""
    ppo = load_ppo()
    torch.manual_seed(0)
    n = 4 if discrete else 2
    agent = make_agent((3, 6, 5), n, 32, norm_obs=False, discrete=discrete, cnn_channels=(4, 8))
    assert agent.image and isinstance(agent.obs_norm, torch.nn.Identity)
    convs = [m for m in agent.network if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (3, 4, (3, 3), (1, 1)),
        (4, 8, (3, 3), (1, 1)),
    ]
    assert (agent.network[5].in_features, agent.network[5].out_features) == (8 * 6 * 5, 32)
    head = (agent.actor if discrete else agent.actor_mean).weight
    torch.testing.assert_close(head @ head.T, 1e-4 * torch.eye(n))  # orthogonal rows of norm 0.01
    torch.testing.assert_close(agent.critic.weight.norm(), torch.tensor(1.0))
    assert discrete != hasattr(agent, "actor_logstd")

    obs = torch.rand(6, 3, 6, 5)
    obs_n, action, logprob, value = ppo.policy_step(agent, obs)
    assert obs_n.shape == (6, 3, 6, 5) and logprob.shape == (6,) and value.shape == (6,)
    assert (action.dtype, action.shape) == ((torch.int64, (6,)) if discrete else (torch.float32, (6, n)))
    for loss in ("value", "policy"):  # each head's loss reaches the shared torso
        agent.zero_grad(set_to_none=True)
        dist, v = agent.dist_and_value(obs)
        (v.sum() if loss == "value" else dist.log_prob(action).sum()).backward()
        assert agent.network[0].weight.grad.abs().sum() > 0, loss
    torch.testing.assert_close(agent.get_value(obs), v.detach())

    storage = ppo.make_storage(
        ppo.Sizes(num_envs=6, num_steps=2, num_minibatches=1), (3, 6, 5), n, discrete, torch.device("cpu")
    )
    assert storage["obs"].shape == (2, 6, 3, 6, 5)
    opt = torch.optim.Adam(agent.parameters(), lr=torch.tensor(1e-3, dtype=torch.float64), eps=1e-5)
    before = agent.network[0].weight.detach().clone()
    out = ppo.update_minibatch(agent, opt, obs_n, action, logprob, *torch.randn(3, 6), **COEFS)
    assert not out["bad"].any() and not torch.equal(before, agent.network[0].weight)

    space = gym.spaces.Discrete(n) if discrete else gym.spaces.Box(-1.0, 1.0, (n,), np.float32)
    path = harness.export_policy(ppo.DeterministicActor(agent), (3, 6, 5), space, tmp_path, None)
    policy = torch.export.load(path).module()
    expected = ppo.DeterministicActor(agent)(obs)
    torch.testing.assert_close(policy(obs), expected)
    assert policy(obs).shape == ((6,) if discrete else (6, n))


def test_snake_with_norm_obs_on_standardises_each_pixel(tmp_path):
    """``--norm-obs True`` works for images: per-pixel running statistics in the agent, the checkpoint and the
    exported policy."""
    ppo = load_ppo()
    result = ppo.main(snake_args(tmp_path, norm_obs=True, total_timesteps=128))
    assert result["global_step"] == 128
    weights = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["agent"]
    assert weights["obs_norm.mean"].shape == (3, 10, 10) and float(weights["obs_norm.count"]) > 128
    assert 0.0 < float(weights["obs_norm.mean"][2].sum()) < 1.1  # the food channel: one cell in 100 per board
    action = torch.export.load(tmp_path / "policy.pt2").module()(torch.rand(3, 3, 10, 10))
    assert action.dtype == torch.int64 and action.shape == (3,)


def test_snake_backs_off_from_an_out_of_memory_error(tmp_path, monkeypatch, capsys):
    """The image storage is rebuilt at half the boards after an out-of-memory error, and the run finishes."""
    ppo = load_ppo()
    fail_second_update_with_oom(ppo, monkeypatch)
    result = ppo.main(snake_args(tmp_path, total_timesteps=384))
    assert result["num_envs"] == 2 and result["global_step"] == 384
    assert "num_envs 4 -> 2" in capsys.readouterr().err
    assert list(pd.read_parquet(tmp_path / "metrics.parquet").global_step) == [128, 192, 256, 320, 384]
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 384 and ckpt["next_obs"].shape == (2, 3, 10, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flags", [["--cudagraphs"], ["--compile", "--cudagraphs", "--amp"]])
def test_snake_speed_switches_on_cuda(tmp_path, flags):
    tiny_cuda = [a for a in SNAKE if a != "--no-cuda"]
    # 5 iterations: the once-per-iteration GAE is captured at its 4th call and replayed at its 5th
    proc = run_ppo("--output-dir", str(tmp_path / "g"), *tiny_cuda, "--total-timesteps", "640", *flags, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device=cuda" in proc.stdout
    metrics = pd.read_parquet(tmp_path / "g" / "metrics.parquet")
    assert len(metrics) == 5 and np.isfinite(metrics[["value_loss", "policy_loss", "entropy"]].to_numpy()).all()
    action = torch.export.load(tmp_path / "g" / "policy.pt2").module()(torch.rand(3, 3, 10, 10))
    assert action.dtype == torch.int64 and action.shape == (3,)
