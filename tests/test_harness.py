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
from envs.files import atomic_write
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
    n = env.obs_shape[0]
    assert layout["context"] == list(range(n - 5, n))  # one socket group: two windows and three MOER leads
    assert layout["sockets"] == list(range(n - 20, n - 5))
    assert layout["site"] == list(range(n - 20))
    assert set(layout["day_of_week"]) < set(layout["site"]) and set(layout["hour_of_day"]) < set(layout["site"])
    args = load_algo("ppo").Args(env_id="EVHub-v0", socket_features=False, weekday_features=False)
    kept = harness.network_inputs(env, args)
    assert not set(kept) & (set(layout["sockets"]) | set(layout["day_of_week"]) | set(layout["context"]))
    everything = load_algo("ppo").Args(weekday_features=True, context_features=True)
    assert harness.network_inputs(env, everything) == list(range(n))
    assert harness.network_inputs(env, load_algo("ppo").Args(weekday_features=True)) == list(range(n - 5))


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


# ---------------------------------------------------------------------------------------------- replay memory
def batch(start: int, n: int, act_dim: int | None = 1):
    """``n`` transitions numbered ``start ..``: obs = number, next_obs = number + 0.5, reward = number."""
    v = torch.arange(start, start + n, dtype=torch.float32)
    actions = v.long() if act_dim is None else v[:, None].repeat(1, act_dim)
    return v[:, None].repeat(1, 2), actions, v, v[:, None].repeat(1, 2) + 0.5, torch.zeros(n)


def test_replay_buffer_wraps_around_and_samples_only_filled_rows():
    rb = harness.ReplayBuffer(5, 2, torch.device("cpu"), (1,), torch.float32)
    rb.add(*batch(1, 3))
    assert (rb.pos, rb.size, float(rb.size_t)) == (3, 3, 3.0)
    gen = torch.Generator().manual_seed(0)
    drawn = rb.sample(1000, generator=gen)
    assert set(drawn["rewards"].tolist()) == {1.0, 2.0, 3.0}  # never the empty rows (zeros)
    torch.testing.assert_close(drawn["obs"][:, 0], drawn["rewards"])  # fields of one row stay together
    torch.testing.assert_close(drawn["next_obs"][:, 1], drawn["rewards"] + 0.5)
    rb.add(*batch(4, 3))  # rows 4, 5 fill the end, 6 wraps to the front over 1
    assert (rb.pos, rb.size) == (1, 5) and rb.pos_t.tolist() == [1]
    assert rb.data["rewards"].tolist() == [6.0, 2.0, 3.0, 4.0, 5.0]
    assert rb.rows("rewards", 1, 6).tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]  # transition j sits in row j % capacity
    rb.add(*batch(7, 5))  # a whole capacity at once, starting at pos 1
    assert rb.data["rewards"].tolist() == [11.0, 7.0, 8.0, 9.0, 10.0]
    assert set(rb.sample(1000, generator=gen)["rewards"].tolist()) == {7.0, 8.0, 9.0, 10.0, 11.0}
    # DQN's sampler reads the filled-row count from the device
    obs, actions, rewards, next_obs, dones = load_algo("dqn").buffer_sample(rb, 1000)
    assert set(rewards.tolist()) == {7.0, 8.0, 9.0, 10.0, 11.0}
    torch.testing.assert_close(obs[:, 0], rewards)
    with pytest.raises(ValueError, match="buffer_size 5"):
        rb.add(*batch(0, 6))


def test_replay_buffer_write_moves_only_the_device_position():
    """The tensor half of ``add`` (what a compiled or captured env step runs) moves ``pos_t`` alone; ``advance`` then
    moves the host counters; a restored buffer writes on where it stopped."""
    rb = harness.ReplayBuffer(5, 2, torch.device("cpu"))  # DQN's: int64 action indices
    for k in range(2):  # rows 0, 1, 2 | 3, 4, 0
        rb.write(*batch(3 * k, 3, act_dim=None))
        assert (rb.pos, rb.size) == (0, 0) and rb.pos_t.tolist() == [3 * (k + 1) % 5]
    assert rb.data["actions"].tolist() == [5, 1, 2, 3, 4] and rb.data["actions"].dtype == torch.int64
    rb.advance(3)
    rb.advance(3)
    assert (rb.pos, rb.size, float(rb.size_t)) == (1, 5, 5.0)
    restored = harness.ReplayBuffer(5, 2, torch.device("cpu"))
    restored.load_state_dict(rb.state_dict())
    assert restored.pos_t.tolist() == [1]
    restored.add(*batch(9, 1, act_dim=None))
    assert restored.data["actions"].tolist() == [5, 9, 2, 3, 4]


@pytest.mark.parametrize("writes", [2, 4, 5])  # 8 of 10 rows filled; full at pos 6; full at pos 0
def test_stored_replay_buffer_rows_restore_identically(writes, tmp_path):
    saved = harness.ReplayBuffer(10, 2, torch.device("cpu"), (1,), torch.float32)
    for k in range(writes):
        saved.add(*batch(4 * k, 4))
    path = tmp_path / "checkpoint.pt"
    atomic_write(path, lambda tmp: torch.save({"replay_buffer": saved.state_dict()}, tmp))
    state = torch.load(path, weights_only=False)["replay_buffer"]
    size = min(4 * writes, 10)
    assert (state["pos"], state["size"], state["capacity"]) == (4 * writes % 10, size, 10)
    for key in harness.ReplayBuffer.FIELDS:  # only the filled rows are written, not the whole preallocated tensor
        assert state[key].shape[0] == size
        assert state[key].untyped_storage().nbytes() == state[key].numel() * state[key].element_size()
    restored = harness.ReplayBuffer(10, 2, torch.device("cpu"), (1,), torch.float32)
    restored.load_state_dict(state)
    assert (restored.pos, restored.size, float(restored.size_t)) == (saved.pos, saved.size, size)
    for key in harness.ReplayBuffer.FIELDS:
        assert torch.equal(restored.data[key], saved.data[key]), key  # every row, the unfilled zeros included


def test_stored_replay_buffer_into_another_capacity_keeps_the_newest_transitions():
    saved = harness.ReplayBuffer(10, 2, torch.device("cpu"), (1,), torch.float32)
    for k in range(4):  # 16 writes into 10 rows: the newest 10 (6 .. 15) start at pos 6
        saved.add(*batch(4 * k, 4))
    state = saved.state_dict()
    small = harness.ReplayBuffer(6, 2, torch.device("cpu"), (1,), torch.float32)
    small.load_state_dict(state)
    assert (small.pos, small.size) == (0, 6) and small.data["rewards"].tolist() == list(range(10, 16))
    big = harness.ReplayBuffer(16, 2, torch.device("cpu"), (1,), torch.float32)
    big.load_state_dict(state)
    assert (big.pos, big.size) == (10, 10) and big.data["rewards"][:10].tolist() == list(range(6, 16))
    with pytest.raises(ValueError, match="obs"):
        harness.ReplayBuffer(10, 5, torch.device("cpu"), (1,), torch.float32).load_state_dict(state)


def _logged_run(site, capacity: int, num_envs: int, num_steps: int, iterations: int, action_mode: str):
    """Random actions on EVHub-v0 into a buffer with its log, as a script's loop runs them: ``(env, rb, log, obs)``
    after ``iterations`` iterations of ``num_steps`` env steps."""
    env = RecordEpisodeStatistics(
        make_vec("EVHub-v0", num_envs, "cpu", site=site, split="train", action_mode=action_mode)
    )
    obs, _ = env.reset(seed=5)
    discrete = action_mode == "discrete"
    act_dim = None if discrete else env.single_action_space.shape[0]
    rb = harness.ReplayBuffer(
        capacity,
        obs.shape[1],
        torch.device("cpu"),
        () if discrete else (act_dim,),
        torch.int64 if discrete else torch.float32,
    )
    log = harness.ReplayLog(rb, num_envs * num_steps)
    g = torch.Generator().manual_seed(1)
    for i in range(iterations):
        log.mark(env, obs, i * num_envs * num_steps)
        for _ in range(num_steps):
            a = (
                torch.randint(0, 15, (num_envs,), generator=g)
                if discrete
                else torch.rand(num_envs, act_dim, generator=g) * 2 - 1
            )
            obs = harness.store(rb, obs, a, env.step(a), True, 0.5)
    return env, rb, log, obs


@pytest.mark.parametrize(
    "capacity, num_envs, num_steps, iterations, action_mode",
    [
        (40, 4, 1, 3, "hub"),  # not yet full: replayed from the start
        (40, 4, 1, 37, "hub"),  # wrapped three times, laps aligned with the steps
        (30, 4, 2, 29, "discrete"),  # a capacity that is no multiple of an iteration: steps straddle the wrap
        (24, 3, 8, 17, "discrete"),  # an iteration the size of the buffer
    ],
)
def test_replay_log_rebuilds_the_buffer_and_itself_exactly(capacity, num_envs, num_steps, iterations, action_mode):
    site = make_site(days=3, n_sockets=4)
    env, rb, log, obs = _logged_run(site, capacity, num_envs, num_steps, iterations, action_mode)
    step = iterations * num_envs * num_steps
    saved = harness.checkpoint_buffer(rb, log, step, rows=False)["log"]
    # at most about two buffers of actions and a few snapshots, the first at or before the oldest row
    assert saved["snapshots"][0].step <= step - rb.size and len(saved["snapshots"]) <= 3
    assert saved["actions"].shape[0] == step - saved["snapshots"][0].step <= 2 * capacity + num_envs * num_steps
    final_state = env.state_dict()

    fresh_env = RecordEpisodeStatistics(
        make_vec("EVHub-v0", num_envs, "cpu", site=site, split="train", action_mode=action_mode)
    )
    fresh_env.reset(seed=99)  # another state: the rebuild loads the snapshot
    rebuilt = harness.ReplayBuffer(
        capacity, rb.data["obs"].shape[1], torch.device("cpu"), rb.data["actions"].shape[1:], rb.data["actions"].dtype
    )
    fresh_log = harness.ReplayLog(rebuilt, num_envs * num_steps)

    def replay(o, a):
        return harness.store(rebuilt, o, a, fresh_env.step(a), True, 0.5)

    torch.manual_seed(123)
    before = torch.get_rng_state()
    message, exact = harness.restore_buffer(
        rebuilt, fresh_log, {"log": saved}, fresh_env, replay, num_envs, final_state, obs
    )
    assert exact and "the same as the interrupted run's" in message, message
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is left as it was
    assert (rebuilt.pos, rebuilt.size) == (rb.pos, rb.size) and rebuilt.pos_t.tolist() == rb.pos_t.tolist()
    for key in harness.ReplayBuffer.FIELDS:
        assert torch.equal(rebuilt.data[key][: rb.size], rb.data[key][: rb.size]), key
    # the env is back at the checkpoint's state, and the log holds what the uninterrupted one holds from its anchor
    assert all(torch.equal(a, b) for a, b in zip(flat(fresh_env.state_dict()), flat(final_state)))
    again = fresh_log.state(step)
    assert [s.step for s in again["snapshots"]] == [s.step for s in saved["snapshots"]]
    assert torch.equal(again["actions"], saved["actions"]) and again["logged_to"] == saved["logged_to"] == log.end


def flat(tree) -> list[torch.Tensor]:
    """The tensors of a nested state dict, in key order."""
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in flat(tree[k])]
    return [tree] if isinstance(tree, torch.Tensor) else []


def test_replay_log_cannot_rebuild_rows_from_before_its_first_snapshot():
    """A log started on a buffer that already holds rows (a hand-over after an out-of-memory error) covers them only
    once they have all been written over; until then a checkpoint keeps the rows, or nothing."""
    site = make_site(days=3, n_sockets=4)
    env, rb, _, obs = _logged_run(site, 20, 4, 1, 7, "hub")  # 28 transitions, buffer full
    log = harness.ReplayLog(rb, 4)
    g = torch.Generator().manual_seed(2)
    for i in range(7, 13):
        log.mark(env, obs, 4 * i)
        a = torch.rand(4, rb.data["actions"].shape[1], generator=g) * 2 - 1
        obs = harness.store(rb, obs, a, env.step(a), True, 0.5)
        covered = 4 * (i + 1) - 20 >= 28  # every row written after the log's first snapshot (step 28)
        saved = harness.checkpoint_buffer(rb, log, 4 * (i + 1), rows=False)
        assert (saved is not None) == covered, i
    assert "rows" in harness.checkpoint_buffer(rb, log, 52, rows=True)
    message, exact = harness.restore_buffer(rb, log, None, env, None, 4, None, obs)
    assert not exact and "refilling" in message
