"""``algos/dqn.py``'s own pieces (epsilon schedule, TD target with and without double-Q, target update, replay-buffer
wraparound, the device-side buffer write, the compiled step, greedy hub policy, ``--amp`` on the CPU, the non-finite
stop, the out-of-memory shrink rule) and other gymnasium envs: Snake-v0 (torch-batched, CNN), CartPole-v1
(gymnasium's vector envs, sync and async with overlapped stepping), the async fallback, per-env defaults, a wrong
action space. What every agent promises (the tiny run on a synthetic site, resume, ``--help``, ``--cudagraphs``
without CUDA, ``--compile`` on the CPU, ``gpu_stats`` on the CPU) is checked in ``tests/test_algo_contracts.py``.
:func:`evaluate_snake` scores a Snake policy (the learning measurement; not run as a slow CI test)."""

from __future__ import annotations

import copy
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DQN_TINY, ROOT, load_algo, make_site, run_algo

from algos import harness
from envs.evhub import EVHubVectorEnv, discrete_action_table
from envs.kpis import evaluate_policy
from envs.vector import RecordEpisodeStatistics, make_vec

SCRIPT = ROOT / "algos" / "dqn.py"

TINY = DQN_TINY
"""Tiny budget: 4 envs x 2 steps (8 env steps) and 2 gradient steps per iteration (``conftest.DQN_TINY``)."""


load_dqn = partial(load_algo, "dqn")
run_dqn = partial(run_algo, "dqn")


def cli(*argv: str):
    """``dqn.Args`` as the command line ``argv`` gives them (presets and env defaults first)."""
    dqn = load_dqn()
    return harness.cli(dqn.Args, dqn.PRESETS, dqn.ENV_DEFAULTS, list(argv))


def test_epsilon_schedule_is_linear_then_constant():
    dqn = load_dqn()
    t = torch.tensor([0.0, 50.0, 100.0, 150.0, 1e9])
    eps = dqn.linear_schedule(1.0, 0.1, 100, t)
    torch.testing.assert_close(eps, torch.tensor([1.0, 0.55, 0.1, 0.1, 0.1]))
    assert dqn.linear_schedule(1.0, 0.1, 100, torch.tensor(25.0)).shape == ()


def test_td_target_plain_and_double_q():
    dqn = load_dqn()
    rewards = torch.tensor([1.0, -1.0])
    dones = torch.tensor([0.0, 1.0])
    next_q_target = torch.tensor([[1.0, 5.0, 2.0], [3.0, 0.0, 4.0]])
    next_q_online = torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # online prefers action 0 in row 0
    gamma = 0.5
    plain = dqn.td_target(rewards, dones, next_q_target, None, gamma)
    # row 0: 1 + 0.5 * max(1, 5, 2) = 3.5; row 1: terminal, -1
    torch.testing.assert_close(plain, torch.tensor([3.5, -1.0]))
    double = dqn.td_target(rewards, dones, next_q_target, next_q_online, gamma)
    # row 0: online argmax 0 -> target Q 1.0: 1 + 0.5 = 1.5; row 1: terminal, -1
    torch.testing.assert_close(double, torch.tensor([1.5, -1.0]))


def test_target_update_hard_and_polyak():
    dqn = load_dqn()
    online = dqn.QNetwork((4,), 3, 8)
    target = dqn.QNetwork((4,), 3, 8)
    online.obs_norm.mean.fill_(2.0)
    before = [p.detach().clone() for p in target.parameters()]
    dqn.target_update(target, online, 0.25)
    for b, t, o in zip(before, target.parameters(), online.parameters()):
        torch.testing.assert_close(t, 0.75 * b + 0.25 * o)
    assert torch.equal(target.obs_norm.mean, online.obs_norm.mean)  # buffers are copied
    dqn.target_update(target, online, 1.0)
    for t, o in zip(target.parameters(), online.parameters()):
        assert torch.equal(t, o)


@pytest.mark.slow
def test_act_step_store_compiles_as_one_graph_and_follows_the_eager_step():
    """Epsilon-greedy action (observation statistics updated, then frozen), EVHub-v0 step and buffer write trace as
    one graph (``fullgraph=True``: a graph break fails) and write the rows the eager function writes."""
    dqn = load_dqn()
    site = make_site(days=3, n_sockets=4)
    torch.manual_seed(0)
    qnet = dqn.QNetwork((EVHubVectorEnv(1, site=site).single_observation_space.shape[0],), 15, 16)
    epsilon = torch.tensor(0.5)
    runs = []
    for compiled in (False, True):
        env = RecordEpisodeStatistics(make_vec("EVHub-v0", 4, "cpu", site=site, split="train", action_mode="discrete"))
        obs, _ = env.reset(seed=3)
        rb, net = harness.ReplayBuffer(10, obs.shape[1], torch.device("cpu")), copy.deepcopy(qnet)
        steps = {}
        for update_norm in (True, False):
            steps[update_norm] = partial(
                dqn.act_step_store,
                partial(dqn.act, net),
                net,
                env,
                rb,
                update_norm=update_norm,
                bootstrap_truncation=True,
                reward_scale=10.0,
            )
            if compiled:
                torch._inductor.config.fallback_random = True  # eager's random numbers, as harness.bind sets
                steps[update_norm] = torch.compile(steps[update_norm], fullgraph=True)
        torch.manual_seed(1)
        for t in range(7):  # 28 rows into 10: the write position wraps twice
            obs = steps[t < 4](obs, epsilon)
            rb.advance(4)
        runs.append((obs, rb, net))
    (obs_e, rb_e, net_e), (obs_c, rb_c, net_c) = runs
    assert rb_c.pos_t.tolist() == rb_e.pos_t.tolist() == [rb_e.pos] == [8]
    torch.testing.assert_close(obs_c, obs_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net_c.obs_norm.mean, net_e.obs_norm.mean)
    assert float(net_c.obs_norm.count) == float(net_e.obs_norm.count)
    for key in harness.ReplayBuffer.FIELDS:
        torch.testing.assert_close(rb_c.data[key], rb_e.data[key], rtol=1e-5, atol=1e-6, msg=key)


def test_act_is_greedy_at_epsilon_zero_and_random_at_one():
    dqn = load_dqn()
    torch.manual_seed(0)
    qnet = dqn.QNetwork((4,), 15, 8, norm_obs=False)
    obs = torch.randn(2000, 4)
    greedy = qnet(obs).argmax(1)
    assert torch.equal(dqn.act(qnet, obs, torch.tensor(0.0)), greedy)
    rand = dqn.act(qnet, obs, torch.tensor(1.0))
    assert rand.min() >= 0 and rand.max() <= 14 and len(set(rand.tolist())) == 15


def test_greedy_hub_policy_equals_the_discrete_env(site):
    """The exported hub action, run in the hub mode, reproduces the discrete env stepped with the argmax index."""
    dqn = load_dqn()
    torch.manual_seed(0)
    n = 4
    hub = EVHubVectorEnv(n, site=site, action_mode="hub", dtype=torch.float64)
    disc = EVHubVectorEnv(n, site=site, action_mode="discrete", dtype=torch.float64)
    qnet = dqn.QNetwork(hub.single_observation_space.shape, 15, 16, norm_obs=False)
    policy = dqn.GreedyHubPolicy(qnet, discrete_action_table())
    starts = [0, 30, 60, 90]
    o1, _ = hub.reset(options={"start_steps": starts})
    o2, _ = disc.reset(options={"start_steps": starts})
    for _ in range(48):
        a_hub = policy(o1.float()).clamp(-1, 1).double()  # what envs.kpis.load_policy does
        o1, r1, _, _, _ = hub.step(a_hub)
        o2, r2, _, _, _ = disc.step(qnet(o2.float()).argmax(1))
        assert torch.equal(o1, o2) and torch.equal(r1, r2)
    row, _ = evaluate_policy(lambda obs, env: policy(obs.float()).to(obs.dtype), site, "test", "dqn", "hub")
    assert row.co2_kg.iloc[0] > 0


def test_amp_smoke_on_cpu(site_toml, tmp_path):
    """``--amp`` (bf16 autocast on CPU) trains to finite losses and exports the policy."""
    proc = run_dqn(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path),
        "--total-timesteps",
        "128",
        "--amp",
        "--eval-split",
        "none",
        *TINY,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "policy.pt2").is_file()
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert np.isfinite(metrics.td_loss.iloc[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flags", [["--cudagraphs"], ["--amp"], ["--cudagraphs", "--amp"]])
def test_gpu_switches(site_toml, tmp_path, flags):
    tiny_gpu = [a for a in TINY if a != "--no-cuda"]
    proc = run_dqn(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path),
        "--total-timesteps",
        "256",
        *flags,
        *tiny_gpu,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pd.read_parquet(tmp_path / "metrics.parquet")
    assert np.isfinite(metrics[["td_loss", "q_values"]].to_numpy()).all()
    kpi = pd.read_parquet(tmp_path / "eval_test.parquet")
    assert kpi.co2_kg.iloc[0] > 0


def test_non_finite_loss_stops_without_exporting(site_toml, tmp_path):
    # an infinite learning rate turns the weights into inf/NaN after the first optimizer step
    proc = run_dqn(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path),
        "--total-timesteps",
        "128",
        "--learning-rate",
        "inf",
        *TINY,
    )
    assert proc.returncode != 0
    assert "NonFiniteLossError" in proc.stderr and "td_loss" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "policy.pt2").exists()


# ---------------------------------------------------------------------------------------------- any gymnasium env
GYM_TINY = [
    "--num-envs", "4",
    "--num-steps", "2",
    "--gradient-steps", "1",
    "--batch-size", "16",
    "--buffer-size", "200",
    "--learning-starts", "32",
    "--target-network-frequency", "40",
    "--hidden-size", "16",
    "--log-every", "8",
    "--checkpoint-every", "0",
    "--no-cuda",
]  # fmt: skip
"""Tiny budget for the non-EVHub envs: 8 env steps and 1 gradient step per iteration."""

EVHUB_ONLY = ("policy.json", "eval_test.parquet", "eval_test_traces.parquet")
"""Outputs written for EVHub-v0 only."""


def assert_generic_run(out: Path, proc: subprocess.CompletedProcess, total: int) -> pd.DataFrame:
    """A non-EVHub run finished: curves with episode returns, checkpoint and policy, no EVHub-only outputs."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == total
    assert np.isfinite(metrics.episodic_return).any() and np.isfinite(metrics.episodic_length).any()
    assert metrics.episodic_co2_kg.isna().all() and metrics.episodic_unserved_kwh.isna().all()
    assert metrics.gpu_mem_allocated_gb.isna().all()  # CPU run
    assert (out / "checkpoint.pt").is_file() and (out / "policy.pt2").is_file()
    for name in EVHUB_ONLY:
        assert not (out / name).exists(), name
    assert "no split evaluation" in proc.stdout  # eval_split="test" (the default) is ignored with a note
    return metrics


def evaluate_snake(policy, episodes: int = 1000, seed: int = 0, device: str = "cpu") -> dict[str, float]:
    """Run ``episodes`` Snake-v0 episodes (default board), one per env of a vector env seeded with ``seed``, each
    until its first end; ``policy`` maps obs float32 ``(N, 3, H, W)`` to actions ``(N,)``, or is None for uniformly
    random actions (a torch generator seeded with ``seed``). Returns the mean ``score`` (foods per episode), the
    mean ``length`` (steps) and the mean ``return``.

    Used for the learning measurement (not a CI test), e.g. with the exported policy::

        evaluate_snake(torch.export.load("policy.pt2").module())
    """
    from envs.snake import SnakeVectorEnv

    env = SnakeVectorEnv(episodes, device=device)
    obs, _ = env.reset(seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    running = torch.ones(episodes, dtype=torch.bool, device=device)
    score = torch.zeros(episodes, device=device)
    ret = torch.zeros(episodes, device=device)
    length = torch.zeros(episodes, device=device)
    with torch.no_grad():
        while bool(running.any()):
            if policy is None:
                action = torch.randint(0, 4, (episodes,), generator=gen, device=device)
            else:
                action = policy(obs)
            obs, reward, terminated, truncated, info = env.step(action)
            score += info["food"] * running
            ret += reward * running
            length += running.float()
            running &= ~(terminated | truncated)
    return {"score": float(score.mean()), "length": float(length.mean()), "return": float(ret.mean())}


def test_snake_smoke_run_uses_the_cnn_and_exports_an_action_policy(tmp_path):
    proc = run_dqn(
        "--env-id",
        "Snake-v0",
        "--output-dir",
        str(tmp_path),
        "--total-timesteps",
        "256",
        "--cnn-channels",
        "4",
        "8",
        *GYM_TINY,
    )
    assert_generic_run(tmp_path, proc, 256)
    assert "torch-batched" in proc.stdout and "(CNN)" in proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.startswith("args: "))
    shown = [item.split("=")[0] for item in line.removeprefix("args: ").split(", ")]
    assert "cnn_channels" in shown and not set(harness.EVHUB_ONLY_ARGS) & set(shown)  # no site options for Snake
    assert "|field|cpu*|gpu|Snake-v0|used|" in proc.stdout  # the preset table, with Snake's own defaults
    assert "|cnn_channels|||(16, 32)|(4, 8)|" in proc.stdout  # the flag wins over them
    policy = torch.export.load(tmp_path / "policy.pt2").module()
    action = policy(torch.rand(3, 3, 10, 10))
    assert action.shape == (3,) and action.dtype == torch.int64 and 0 <= int(action.min()) and int(action.max()) < 4
    assert set(evaluate_snake(policy, episodes=8)) == {"score", "length", "return"}


def test_cartpole_smoke_run_through_gymnasium_vector_envs(tmp_path):
    proc = run_dqn("--env-id", "CartPole-v1", "--output-dir", str(tmp_path), "--total-timesteps", "256", *GYM_TINY)
    metrics = assert_generic_run(tmp_path, proc, 256)
    assert "vector_mode=sync" in proc.stdout and "(MLP)" in proc.stdout
    assert (metrics.episodic_length.dropna() >= 8).all()  # CartPole episodes last at least 8 steps
    policy = torch.export.load(tmp_path / "policy.pt2").module()
    assert policy(torch.zeros(5, 4)).shape == (5,)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["env"]["env"] is None  # a gymnasium env's state is not stored (only the episode statistics)


@pytest.mark.slow
def test_cartpole_async_overlaps_stepping_with_learning(tmp_path):
    proc = run_dqn(
        "--env-id",
        "CartPole-v1",
        "--output-dir",
        str(tmp_path),
        "--total-timesteps",
        "256",
        "--vector-mode",
        "async",
        *GYM_TINY,
        "--num-envs",
        "2",
    )
    assert_generic_run(tmp_path, proc, 256)
    assert "vector_mode=async" in proc.stdout and "overlapped with the gradient steps" in proc.stdout


def test_resume_with_a_gymnasium_env_starts_new_episodes(tmp_path):
    dqn = load_dqn()
    argv = ["--env-id", "CartPole-v1", "--output-dir", str(tmp_path), "--eval-split", "none", *GYM_TINY]
    dqn.main(cli(*argv, "--total-timesteps", "128"))
    result = dqn.main(cli(*argv, "--total-timesteps", "192", "--resume"))
    assert result["global_step"] == 192
    assert list(pd.read_parquet(tmp_path / "metrics.parquet").global_step) == [64, 128, 192]


def test_a_non_discrete_action_space_is_a_clear_error(tmp_path):
    dqn = load_dqn()
    args = cli("--env-id", "Pendulum-v1", "--output-dir", str(tmp_path), *GYM_TINY)
    with pytest.raises(ValueError, match=r"Pendulum-v1 has Box\(-2.0, 2.0"):
        dqn.main(args)


def test_async_start_failure_falls_back_to_sync_with_a_warning(tmp_path, monkeypatch, capsys):
    import gymnasium as gym

    dqn = load_dqn()

    def broken(*args, **kwargs):
        raise RuntimeError("cannot start worker processes (injected)")

    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", broken)
    args = cli(
        "--env-id",
        "CartPole-v1",
        "--output-dir",
        str(tmp_path),
        "--vector-mode",
        "async",
        "--total-timesteps",
        "64",
        "--eval-split",
        "none",
        *GYM_TINY,
    )
    result = dqn.main(args)
    assert result["global_step"] == 64 and result["vector_mode"] == "sync" and args.vector_mode == "async"
    captured = capsys.readouterr()
    assert "falling back to --vector-mode sync" in captured.err and "injected" in captured.err
    assert "vector_mode=sync" in captured.out
    events = b"".join(p.read_bytes() for p in tmp_path.glob("events.out.tfevents.*"))
    assert b"falling back to --vector-mode sync" in events  # TensorBoard text "warnings"


def test_env_defaults_apply_to_unset_fields_only():
    dqn = load_dqn()
    resolve = partial(harness.preset_args, dqn.Args, dqn.PRESETS, dqn.ENV_DEFAULTS, preset="cpu")
    snake = resolve(env_id="Snake-v0", output_dir="x")
    assert snake.gamma == 0.99 and snake.reward_scale == 1.0 and snake.norm_obs is False
    assert snake.cnn_channels == dqn.ENV_DEFAULTS["Snake-v0"]["cnn_channels"]
    overridden = resolve(env_id="Snake-v0", gamma=0.9, num_envs=8, output_dir="x")
    assert overridden.gamma == 0.9 and overridden.num_envs == 8
    evhub = resolve(output_dir="x")
    assert (evhub.gamma, evhub.reward_scale, evhub.target_network_frequency, evhub.norm_obs) == (0.95, 10.0, 5000, True)
    assert snake.num_envs == dqn.ENV_DEFAULTS["Snake-v0/cpu"]["num_envs"]  # the env's own sizes for the preset
    cartpole = resolve(env_id="CartPole-v1")
    assert cartpole.target_network_frequency == 500 and cartpole.learning_starts == 10_000
    assert "CartPole-v1_seed1" in str(harness.output_dir(cartpole, "dqn"))
    assert "|field|cpu*|gpu|CartPole-v1|used|" in harness.presets_table(dqn.PRESETS, dqn.ENV_DEFAULTS, cartpole)


def test_cnn_torso_is_chosen_for_image_observations():
    dqn = load_dqn()
    cnn = dqn.QNetwork((3, 6, 5), 4, 16, cnn_channels=(4, 8))
    assert isinstance(cnn.mlp[0], torch.nn.Conv2d) and cnn(torch.rand(2, 3, 6, 5)).shape == (2, 4)
    mlp = dqn.QNetwork((4,), 2, 16)
    assert isinstance(mlp.mlp[0], torch.nn.Linear) and mlp(torch.rand(2, 4)).shape == (2, 2)
    rb = harness.ReplayBuffer(5, (3, 6, 5), torch.device("cpu"))
    assert rb.data["obs"].shape == rb.data["next_obs"].shape == (5, 3, 6, 5)
