"""``algos/sac.py``'s own pieces: the Polyak update, the replay buffer, the squashed-Gaussian log-prob, the
out-of-memory shrink rule, the actor and updates, the compiled step and the speed switches; gymnasium envs
(Pendulum-v1 in sync and async vector modes, the fall-back from async to sync, a wrong action space, the vector env's
action rescaling and ``final_obs``) and ``harness.gpu_stats`` on CUDA. What every agent promises (the tiny run on a
synthetic site, resume, the non-finite stop, ``--help``, ``--cudagraphs`` without CUDA, ``--compile`` on the CPU,
``gpu_stats`` on the CPU) is checked in ``tests/test_algo_contracts.py``."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, SAC_TINY, load_algo, make_site, run_algo

import envs.evhub
from algos import harness
from envs.vector import RecordEpisodeStatistics, make_vec

SCRIPT = ROOT / "algos" / "sac.py"

TINY = SAC_TINY
"""Tiny budget: 4 envs; a log every 48 iterations (one synthetic episode); learning from step 64
(``conftest.SAC_TINY``)."""


PENDULUM = [
    "--env-id", "Pendulum-v1",
    "--preset", "cpu",
    "--num-envs", "2",
    "--hidden-size", "16",
    "--batch-size", "32",
    "--buffer-size", "1000",
    "--learning-starts", "64",
    "--gradient-steps", "1",
    "--log-every", "100",
    "--total-timesteps", "400",
    "--no-cuda",
]  # fmt: skip
"""Pendulum-v1 (200-step episodes): 2 envs, a log every 100 iterations (200 steps, one episode per env), learning
from step 64, 200 iterations."""

load_sac = partial(load_algo, "sac")
run_sac = partial(run_algo, "sac")


def parse(sac, argv: list[str]):
    """``sac.Args`` from a command line, with the presets applied as in ``python algos/sac.py``."""
    return harness.cli(sac.Args, sac.PRESETS, sac.ENV_DEFAULTS, argv=argv)


def test_soft_update_is_polyak_averaging():
    sac = load_sac()
    torch.manual_seed(0)
    target = [torch.randn(3, 4), torch.randn(5)]
    source = [torch.randn(3, 4), torch.randn(5)]
    expected = [0.9 * t + 0.1 * s for t, s in zip(target, source)]
    sac.soft_update(target, source, 0.1)
    for t, e in zip(target, expected):
        torch.testing.assert_close(t, e)
    sac.soft_update(target, source, 1.0)  # tau = 1 copies
    for t, s in zip(target, source):
        torch.testing.assert_close(t, s)


@pytest.mark.slow
def test_act_step_store_compiles_as_one_graph_and_follows_the_eager_step():
    """Action, EVHub-v0 step and buffer write trace as one graph (``fullgraph=True``: a graph break fails) and write
    the rows the eager function writes, the write position wrapping on the device."""
    sac = load_sac()
    site = make_site(days=3, n_sockets=4)
    torch.manual_seed(0)
    actor = sac.Actor(envs.evhub.EVHubVectorEnv(1, site=site).single_observation_space.shape[0], 2, 16, None)
    runs = []
    for compiled in (False, True):
        env = RecordEpisodeStatistics(make_vec("EVHub-v0", 4, "cpu", site=site, split="train", action_mode="hub"))
        obs, _ = env.reset(seed=3)
        rb = harness.ReplayBuffer(10, obs.shape[1], torch.device("cpu"), (2,), torch.float32)
        step = partial(
            sac.act_step_store, partial(sac.sample_action, actor), env, rb, reward_scale=2.0, bootstrap_truncation=True
        )
        if compiled:
            torch._inductor.config.fallback_random = True  # eager's random numbers, as harness.bind sets
            step = torch.compile(step, fullgraph=True)
        torch.manual_seed(1)
        for _ in range(7):  # 28 rows into 10: the write position wraps twice
            obs = step(obs)
            rb.advance(4)
        runs.append((obs, rb))
    (obs_e, rb_e), (obs_c, rb_c) = runs
    assert rb_c.pos_t.tolist() == rb_e.pos_t.tolist() == [rb_e.pos] == [8] and rb_c.size == 10
    torch.testing.assert_close(obs_c, obs_e, rtol=1e-5, atol=1e-6)
    for key in harness.ReplayBuffer.FIELDS:
        torch.testing.assert_close(rb_c.data[key], rb_e.data[key], rtol=1e-5, atol=1e-6, msg=key)


def test_out_of_memory_back_off_halves_the_batch_in_the_updates_then_the_envs():
    """SAC's back-off (the harness's off-policy rule) names the update-to-data ratio when num_envs halves."""
    sizes = harness.ReplaySizes(num_envs=2, batch_size=256, buffer_size=1000)
    sizes, change = harness.halve_batch_or_envs(sizes, True, gradient_steps=4)
    assert change == "batch_size 256 -> 128" and sizes == harness.ReplaySizes(2, 128, 1000)
    sizes, change = harness.halve_batch_or_envs(sizes, False, gradient_steps=4)  # stepping the envs: num_envs
    assert change == "num_envs 2 -> 1 (update-to-data ratio 2 -> 4)" and sizes == harness.ReplaySizes(1, 128, 1000)
    sizes, _ = harness.halve_batch_or_envs(sizes, True, gradient_steps=4)
    assert sizes.batch_size == harness.OOM_MIN_BATCH_SIZE == 64
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved and batch_size 64 would drop below 64"):
        harness.halve_batch_or_envs(sizes, True, gradient_steps=4)  # the batch is at its floor, one env left
    with pytest.raises(ValueError, match="num_envs 1 cannot be halved$"):
        harness.halve_batch_or_envs(sizes, False, gradient_steps=4)


def test_squashed_gaussian_log_prob_matches_the_change_of_variables():
    sac = load_sac()
    from torch.distributions import Normal, TransformedDistribution
    from torch.distributions.transforms import TanhTransform

    torch.manual_seed(0)
    mean = torch.randn(64, 3, dtype=torch.float64) * 2.0
    log_std = torch.rand(64, 3, dtype=torch.float64) * 3.0 - 2.0
    noise = torch.randn(64, 3, dtype=torch.float64)
    action, log_prob = sac.squashed_gaussian_sample(mean, log_std, noise)
    u = mean + log_std.exp() * noise
    torch.testing.assert_close(action, torch.tanh(u))
    # the naive formula, where it is still accurate
    naive = Normal(mean, log_std.exp()).log_prob(u).sum(-1) - torch.log(1.0 - torch.tanh(u) ** 2).sum(-1)
    torch.testing.assert_close(log_prob, naive, rtol=1e-6, atol=1e-6)
    # torch's own tanh-transformed distribution, evaluated at the pre-image
    dist = TransformedDistribution(Normal(mean, log_std.exp()), [TanhTransform()])
    torch.testing.assert_close(log_prob, dist.log_prob(torch.tanh(u)).sum(-1), rtol=1e-4, atol=1e-4)
    # stays finite where tanh saturates (|u| large: 1 - tanh(u)^2 underflows in the naive form)
    a, lp = sac.squashed_gaussian_sample(torch.full((1, 2), 30.0), torch.zeros(1, 2), torch.zeros(1, 2))
    assert torch.isfinite(lp).all() and (a <= 1.0).all()


def test_twin_critics_are_two_mlps_in_one_batched_network():
    """Same seed, same weights as two nn.Linear stacks made in turn, and the same values and gradients to the bit."""
    sac = load_sac()
    obs_dim, act_dim, hidden, inputs = 7, 2, 16, [0, 2, 3, 6]
    torch.manual_seed(3)
    twin = sac.TwinQNetwork(obs_dim, act_dim, hidden, inputs)
    torch.manual_seed(3)
    mlps = [
        torch.nn.Sequential(
            torch.nn.Linear(len(inputs) + act_dim, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        for _ in range(2)
    ]
    obs, act = torch.randn(32, obs_dim), torch.rand(32, act_dim, requires_grad=True)
    q = twin(obs, act)
    assert q.shape == (2, 32)
    x = torch.cat([obs[:, inputs], act], -1)
    for k, mlp in enumerate(mlps):
        assert torch.equal(q[k], mlp(x).squeeze(-1))
    (g_twin,) = torch.autograd.grad(torch.minimum(q[0], q[1]).sum(), act)
    ref = torch.minimum(mlps[0](x).squeeze(-1), mlps[1](x).squeeze(-1))
    (g_ref,) = torch.autograd.grad(ref.sum(), act)
    assert torch.allclose(g_twin, g_ref, rtol=0, atol=1e-6)
    layer0 = twin.weights[0]
    assert layer0.shape == (2, hidden, len(inputs) + act_dim)  # one matmul for both members per layer
    assert torch.equal(layer0[1], mlps[1][0].weight)


def test_gradient_steps_follow_the_delay_schedule_in_one_call():
    """One call does num_steps critic steps, policy_frequency actor steps at each policy_frequency-th update, the
    target update at each target_network_frequency-th, and ORs the non-finite flags of all of them."""
    sac = load_sac()
    calls = []

    def critic(*batch):
        calls.append("q")
        return {"qf_loss": torch.tensor(float(len(calls))), "bad": torch.tensor(len(calls) == 2)}

    def actor(obs):
        calls.append("pi")
        return {"actor_loss": torch.tensor(1.0), "bad": torch.tensor([False, False])}

    def target():
        calls.append("target")

    data = {k: torch.zeros(4) for k in ("obs", "actions", "rewards", "next_obs", "dones")}
    out = sac.gradient_steps(
        lambda: data,
        critic,
        actor,
        target,
        num_steps=4,
        first_update=0,
        policy_frequency=2,
        target_network_frequency=2,
    )
    assert calls == ["q", "q", "pi", "pi", "target", "q", "q", "pi", "pi", "target"]
    assert out["bad"].tolist() == [True, False, False] and float(out["qf_loss"]) == 7.0
    calls.clear()
    sac.gradient_steps(
        lambda: data,
        critic,
        actor,
        target,
        num_steps=1,
        first_update=1,
        policy_frequency=2,
        target_network_frequency=1,
    )
    assert calls == ["q", "pi", "pi", "target"]


def test_actor_and_updates_run_and_move_the_parameters():
    sac = load_sac()
    torch.manual_seed(0)
    obs_dim, act_dim, inputs = 7, 2, [0, 1, 4, 5, 6]
    actor = sac.Actor(obs_dim, act_dim, 8, inputs)
    qf, qt = sac.TwinQNetwork(obs_dim, act_dim, 8, inputs), sac.TwinQNetwork(obs_dim, act_dim, 8, inputs)
    log_alpha = torch.zeros((), requires_grad=True)
    q_opt = torch.optim.Adam(qf.parameters(), lr=1e-2)
    pi_opt = torch.optim.Adam(actor.parameters(), lr=1e-2)
    a_opt = torch.optim.Adam([log_alpha], lr=1e-2)
    obs, next_obs = torch.randn(16, obs_dim), torch.randn(16, obs_dim)
    actions, rewards, dones = torch.rand(16, act_dim) * 2 - 1, torch.randn(16), torch.zeros(16)
    q_before = [p.clone() for p in qf.parameters()]
    pi_before = [p.clone() for p in actor.parameters()]
    out = sac.update_critic(
        obs,
        actions,
        rewards,
        next_obs,
        dones,
        actor=actor,
        qf=qf,
        qf_target=qt,
        log_alpha=log_alpha,
        q_optimizer=q_opt,
        gamma=0.9,
        amp=False,
    )
    assert not bool(out["bad"]) and all(torch.isfinite(out[k]) for k in ("qf1_values", "qf_loss"))
    assert all(not torch.equal(a, b) for a, b in zip(q_before, qf.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(pi_before, actor.parameters()))  # the critic step leaves the actor
    q_after_critic = [p.clone() for p in qf.parameters()]
    out = sac.update_actor(
        obs,
        actor=actor,
        qf=qf,
        log_alpha=log_alpha,
        actor_optimizer=pi_opt,
        a_optimizer=a_opt,
        target_entropy=-float(act_dim),
        amp=False,
    )
    assert not bool(out["bad"].any())
    assert all(torch.equal(a, b) for a, b in zip(q_after_critic, qf.parameters()))  # the actor step leaves the critics
    assert any(not torch.equal(a, b) for a, b in zip(pi_before, actor.parameters()))
    assert float(log_alpha.detach()) != 0.0

    deterministic = sac.DeterministicActor(actor)
    action = deterministic(obs)
    assert action.shape == (16, act_dim) and (action.abs() <= 1.0).all()
    torch.testing.assert_close(action, actor.get_action(obs)[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flags", [["--cudagraphs"], ["--amp"], ["--cudagraphs", "--amp"]])
def test_cuda_speed_switches(site_toml, tmp_path, flags):
    args = [a for a in TINY if a != "--no-cuda"]
    proc = run_sac(
        "--site",
        str(site_toml),
        "--output-dir",
        str(tmp_path / "g"),
        "--total-timesteps",
        "384",
        "--eval-split",
        "test",
        *args,
        *flags,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = pd.read_parquet(tmp_path / "g" / "metrics.parquet")
    # gpu_util_pct is NaN where pynvml is not installed
    assert np.isfinite(metrics.drop(columns=["gpu_util_pct"]).to_numpy(dtype=float)).all(), metrics.T
    assert (tmp_path / "g" / "policy.pt2").is_file()
    assert (metrics.gpu_mem_peak_gb > 0).all() and (metrics.gpu_mem_reserved_gb >= metrics.gpu_mem_allocated_gb).all()


# ---------------------------------------------------------------------------------------------- gymnasium envs
def assert_gym_run_outputs(out: Path) -> pd.DataFrame:
    """A finished Pendulum-v1 run of :data:`PENDULUM` in ``out``: curves with the episodic return, the policy in the
    env's action units, a checkpoint, and none of EVHub-v0's outputs. Returns the metrics."""
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.global_step) == [200, 400]
    assert np.isfinite(metrics.episodic_return.iloc[-1]) and metrics.episodic_return.iloc[-1] < 0
    assert metrics.episodic_length.iloc[-1] == 200
    assert metrics.episodic_co2_kg.isna().all() and metrics.episodic_unserved_kwh.isna().all()
    assert np.isfinite(metrics.qf_loss.iloc[-1]) and metrics.gradient_steps.iloc[-1] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"charts/episodic_return", "charts/episodic_length", "losses/qf_loss"} <= tags
    assert "charts/episodic_co2_kg" not in tags
    assert (out / "checkpoint.pt").is_file()
    program = torch.export.load(str(out / "policy.pt2")).module()
    action = program(torch.randn(5, 3))  # obs (cos, sin, angular velocity) -> torque in [-2, 2]
    assert action.shape == (5, 1) and (action.abs() <= 2.0).all()
    for name in ("policy.json", "eval_test.parquet", "eval_test_traces.parquet", "eval_curve.parquet"):
        assert not (out / name).exists(), name
    return metrics


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_pendulum_trains_in_sync_and_async_vector_modes(mode, tmp_path):
    out = tmp_path / mode
    proc = run_sac("--output-dir", str(out), "--vector-mode", mode, *PENDULUM)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"vector_mode={mode}" in proc.stdout and "no split evaluation for Pendulum-v1" in proc.stdout
    assert "site=" not in proc.stdout and "bess_action=" not in proc.stdout  # EVHub-only options not shown
    assert "warning" not in proc.stderr.lower()  # async started: no fall-back
    metrics = assert_gym_run_outputs(out)
    # the updates start at step 64: synchronously after the 32nd step; overlapped, they run while the envs step,
    # before that step's transitions are stored, so from the 33rd step on (one iteration fewer)
    assert metrics.gradient_steps.iloc[-1] == (200 - 31 if mode == "sync" else 200 - 32)


def test_async_start_failure_falls_back_to_sync_with_a_warning(tmp_path, monkeypatch, capsys):
    import gymnasium as gym

    sac = load_sac()

    def no_workers(*args, **kwargs):
        raise RuntimeError("cannot start worker processes here")

    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", no_workers)
    argv = ["--output-dir", str(tmp_path), "--vector-mode", "async", *PENDULUM, "--total-timesteps", "200"]
    result = sac.main(parse(sac, argv))
    assert result["global_step"] == 200
    captured = capsys.readouterr()
    assert "warning: --vector-mode async" in captured.err and "falling back to --vector-mode sync" in captured.err
    assert "cannot start worker processes here" in captured.err
    assert "vector_mode=sync" in captured.out  # what actually ran
    events = b"".join(p.read_bytes() for p in tmp_path.glob("events.out.tfevents.*"))
    assert b"falling back to --vector-mode sync" in events  # TensorBoard text "warnings"
    assert (tmp_path / "policy.pt2").is_file()


@pytest.mark.parametrize("env_id, space", [("CartPole-v1", "Discrete(2)"), ("Snake-v0", "Discrete(4)")])
def test_a_discrete_action_space_stops_with_a_clear_error(env_id, space, tmp_path):
    sac = load_sac()
    args = parse(sac, ["--env-id", env_id, "--output-dir", str(tmp_path), "--no-cuda", "--num-envs", "2"])
    with pytest.raises(
        ValueError, match=re.escape(f"SAC needs a continuous (Box) action space, but {env_id} has {space}")
    ):
        sac.main(args)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_unbounded_actions_and_image_observations_are_refused():
    import gymnasium as gym

    sac = load_sac()
    sac.check_action_space("X-v0", gym.spaces.Box(-2.0, 2.0, (1,)))  # fine
    with pytest.raises(ValueError, match="X-v0 has an unbounded action space"):
        sac.check_action_space("X-v0", gym.spaces.Box(-np.inf, np.inf, (2,)))
    sac.check_observation_space("X-v0", gym.spaces.Box(-1.0, 1.0, (3,)))  # fine
    with pytest.raises(ValueError, match="X-v0 has .*image observations"):
        sac.check_observation_space("X-v0", gym.spaces.Box(0.0, 1.0, (3, 8, 8)))


def test_gym_vector_env_rescales_actions_and_returns_the_last_obs_on_truncation():
    import gymnasium as gym

    from envs.vector import GymTorchVecEnv

    vec = gym.make_vec(
        "IOBound-v0",
        2,
        vectorization_mode="sync",
        latency_s=0.0,
        max_steps=2,
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    env = GymTorchVecEnv(vec, torch.device("cpu"), "sync")
    assert not env.overlap and env.state_dict() is None
    a = [[-1.0, 1.0], [0.0, 0.5]]
    np.testing.assert_array_equal(env.action_to_env(torch.tensor(a)), a)  # a [-1, 1] box: as they are
    obs, _ = env.reset(seed=3)
    assert obs.dtype == torch.float32 and obs.shape == (2, 2)
    step = torch.tensor([[1.0, -1.0], [-1.0, 0.0]])
    obs1, reward, terminated, truncated, info = env.step(step)
    assert not truncated.any() and torch.equal(info["final_obs"], obs1)  # no episode ended: the next obs
    assert reward.dtype == torch.float32 and terminated.dtype == torch.bool
    obs2, _, _, truncated, info = env.step(step)
    assert truncated.all()  # max_steps=2: both truncated and reset in the same step
    expected = torch.clamp(obs1 + 0.1 * step, -1.0, 1.0)
    torch.testing.assert_close(info["final_obs"], expected)  # the last obs of the episode, for the bootstrap
    assert not torch.allclose(obs2, expected)  # the returned obs is the next episode's first
    env.close()

    pendulum = GymTorchVecEnv(gym.make_vec("Pendulum-v1", 1, vectorization_mode="sync"), torch.device("cpu"), "sync")
    np.testing.assert_allclose(pendulum.action_to_env(torch.tensor([[-1.0]])), [[-2.0]])
    np.testing.assert_allclose(pendulum.action_to_env(torch.tensor([[0.25]])), [[0.5]])
    np.testing.assert_allclose(pendulum.action_to_env(torch.tensor([[1.0]])), [[2.0]])
    np.testing.assert_allclose(pendulum.action_to_env(torch.tensor([[3.0]])), [[2.0]])  # clipped to [-1, 1] first
    pendulum.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stats_on_cuda_reads_the_allocator():
    x = torch.ones(1024, 1024, device="cuda")
    stats = harness.gpu_stats(torch.device("cuda"))
    assert stats["perf/gpu_mem_allocated_gb"] >= x.numel() * 4 / 1e9
    assert stats["perf/gpu_mem_peak_gb"] >= stats["perf/gpu_mem_allocated_gb"]
