"""Rules and API of Snake-v0: food, growth, death, time limits, auto-reset, batched == single, gymnasium compliance."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers Snake-v0)
from envs.snake import INFO_KEYS, WALL, SnakeEnv, SnakeVectorEnv

UP, RIGHT, DOWN, LEFT = range(4)


def padded(env: SnakeVectorEnv, r: int, c: int) -> int:
    """Padded flat index of board cell (r, c)."""
    return (r + 1) * (env.width + 2) + c + 1


def set_snake(env: SnakeVectorEnv, i: int, cells, food, direction: int) -> None:
    """Put a snake with ``cells`` (tail to head, (row, col)) and a food at ``food`` into env ``i``."""
    env.expiry[i] = WALL
    env.expiry[i, env._board_index] = 0
    for j, (r, c) in enumerate(cells):
        env.expiry[i, padded(env, r, c)] = j + 1
    env.tau[i] = 0
    env.length[i] = len(cells)
    env.head[i] = padded(env, *cells[-1])
    env.direction[i] = direction
    env.food[i] = padded(env, *food)
    env.elapsed[i] = 0
    env.hunger[i] = 0


def cells_of(channel: torch.Tensor) -> set[tuple[int, int]]:
    """The (row, col) cells where a ``(height, width)`` channel is non-zero."""
    return {tuple(rc) for rc in torch.nonzero(channel).tolist()}


def step(env: SnakeVectorEnv, action: int):
    return env.step(torch.full((env.num_envs,), action, dtype=torch.int64))


def check_obs(obs: torch.Tensor) -> None:
    """One head inside the body, one food off the body, body values in (0, 1], nothing else."""
    head, body, food = obs[:, 0], obs[:, 1], obs[:, 2]
    assert obs.dtype == torch.float32
    assert (head.sum((1, 2)) == 1).all() and (food.sum((1, 2)) == 1).all()
    assert ((head == 0) | (head == 1)).all() and ((food == 0) | (food == 1)).all()
    assert (body[head == 1] == 1).all()
    assert (body[food == 1] == 0).all()
    assert ((body >= 0) & (body <= 1)).all()


LOOP = [(0, 0), (0, 1), (1, 1), (1, 0)]  # a 2x2 ring chasing its tail, heading left; then up, right, down, left
LOOP_ACTIONS = [UP, RIGHT, DOWN, LEFT]


# ---------------------------------------------------------------------------------------------- rules
def test_start_state_and_observation_channels():
    env = SnakeVectorEnv(4)
    obs, info = env.reset(seed=0)
    assert info == {} and obs.shape == (4, 3, 10, 10) and env.observation_space.contains(obs.numpy())
    check_obs(obs)
    for i in range(4):
        assert cells_of(obs[i, 0]) == {(5, 5)}
        assert cells_of(obs[i, 1]) == {(5, 3), (5, 4), (5, 5)}
        torch.testing.assert_close(obs[i, 1, 5, 3:6], torch.tensor([1 / 3, 2 / 3, 1.0]))
    assert (env.length == 3).all() and (env.direction == RIGHT).all()


def test_eating_grows_the_snake_rewards_and_places_new_food():
    env = SnakeVectorEnv(64)
    env.reset(seed=1)
    env.food.copy_(env.head + 1)  # right in front of every head
    obs, reward, terminated, truncated, info = step(env, RIGHT)
    assert set(info) == set(INFO_KEYS)
    assert (reward == 1).all() and (info["food"] == 1).all() and (info["length"] == 4).all()
    assert not terminated.any() and not truncated.any()
    assert (env.length == 4).all() and (env.hunger == 0).all()
    check_obs(obs)
    for i in range(64):
        assert cells_of(obs[i, 0]) == {(5, 6)}
        assert cells_of(obs[i, 1]) == {(5, 3), (5, 4), (5, 5), (5, 6)}  # the tail stayed
        torch.testing.assert_close(obs[i, 1, 5, 3:7], torch.tensor([0.25, 0.5, 0.75, 1.0]))
    assert len({tuple(torch.nonzero(o[2]).flatten().tolist()) for o in obs}) > 10  # new food spread out
    # no food ahead now: moving on keeps the length and the reward at 0
    env.food.fill_(padded(env, 0, 0))
    obs, reward, *_ = step(env, RIGHT)
    assert (reward == 0).all() and (env.length == 4).all()
    assert all(cells_of(o[1]) == {(5, 4), (5, 5), (5, 6), (5, 7)} for o in obs)


def test_food_is_never_placed_on_the_snake_under_random_play():
    num_envs, steps = 256, 300
    env = SnakeVectorEnv(num_envs, height=5, width=5, max_steps_without_food=40)
    obs, _ = env.reset(seed=2)
    gen = torch.Generator().manual_seed(0)
    eaten = 0.0
    longest = 0
    for _ in range(steps):
        obs, reward, terminated, truncated, info = env.step(torch.randint(0, 4, (num_envs,), generator=gen))
        check_obs(obs)
        assert not (terminated & truncated).any()
        assert (reward == info["food"] - terminated.float() * (info["length"] < 25)).all()
        eaten += float(info["food"].sum())
        longest = max(longest, int(info["length"].max()))
    assert eaten > 500 and longest >= 8


def test_first_food_is_uniform_over_the_free_cells():
    env = SnakeVectorEnv(4096)
    obs, _ = env.reset(seed=0)
    counts = obs[:, 2].sum(0)
    body = obs[0, 1] > 0
    assert (counts[body] == 0).all()
    free = counts[~body]
    expected = 4096 / free.numel()
    chi2 = float(((free - expected) ** 2 / expected).sum())
    assert (free > 0).all() and chi2 < 96 + 6 * (2 * 96) ** 0.5  # 96 degrees of freedom


SERPENTINE_3X4 = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]


def test_food_goes_to_the_last_free_cell_and_filling_the_board_wins():
    num_envs = 64
    env = SnakeVectorEnv(num_envs, height=3, width=4)
    env.reset(seed=3)
    for i in range(num_envs):
        set_snake(env, i, SERPENTINE_3X4[:10], food=(2, 2), direction=RIGHT)
    obs, reward, terminated, truncated, info = step(env, RIGHT)
    assert (reward == 1).all() and not terminated.any() and (env.length == 11).all()
    assert all(cells_of(o[2]) == {(2, 3)} for o in obs)  # the only free cell, in every stream
    obs, reward, terminated, truncated, info = step(env, RIGHT)
    assert (reward == 1).all() and terminated.all() and not truncated.any()
    assert (info["length"] == 12).all() and (info["food"] == 1).all()
    # auto-reset: a fresh snake
    check_obs(obs)
    assert (env.length == 3).all()
    assert all(cells_of(o[1]) == {(1, 0), (1, 1), (1, 2)} for o in obs)


@pytest.mark.parametrize(
    "direction, cells",
    [
        (UP, [(1, 4), (0, 4)]),
        (RIGHT, [(4, 8), (4, 9)]),
        (DOWN, [(8, 4), (9, 4)]),
        (LEFT, [(4, 1), (4, 0)]),
    ],
)
def test_death_on_hitting_a_wall(direction, cells):
    env = SnakeVectorEnv(2)
    env.reset(seed=4)
    walls = env.expiry[0] == WALL
    for i in range(2):
        set_snake(env, i, cells, food=(5, 5), direction=direction)
    obs, reward, terminated, truncated, info = step(env, direction)
    assert terminated.all() and not truncated.any() and (reward == -1).all()
    assert (info["length"] == 2).all() and (info["food"] == 0).all()
    assert (env.expiry[:, walls] == WALL).all()  # the wall ring is intact
    check_obs(obs)


def test_walking_straight_from_the_start_dies_at_the_wall_and_resets():
    env = SnakeVectorEnv(256)
    env.reset(seed=5)
    for t in range(6):  # head row 5 -> 0 in five steps, the sixth leaves the board
        obs, reward, terminated, truncated, _ = step(env, UP)
        assert bool(terminated.all()) == bool(terminated.any()) == (t == 5)
        assert not truncated.any()
    assert (reward == -1).all()
    check_obs(obs)
    assert (env.length == 3).all() and (env.elapsed == 0).all() and (env.hunger == 0).all()
    assert (env.direction == RIGHT).all()
    for o in obs:
        assert cells_of(o[0]) == {(5, 5)} and cells_of(o[1]) == {(5, 3), (5, 4), (5, 5)}
    # the fresh snake plays on normally
    obs, reward, terminated, _, _ = step(env, RIGHT)
    assert not terminated.any() and all(cells_of(o[0]) == {(5, 6)} for o in obs)


def test_death_on_hitting_its_own_body():
    env = SnakeVectorEnv(1)
    env.reset(seed=6)
    set_snake(env, 0, [(5, 3), (5, 4), (5, 5), (5, 6), (5, 7)], food=(9, 9), direction=RIGHT)
    for action in (UP, LEFT):
        _, reward, terminated, truncated, _ = step(env, action)
        assert not terminated.any() and not truncated.any() and (reward == 0).all()
    _, reward, terminated, truncated, info = step(env, DOWN)  # into (5, 6): still body
    assert terminated.all() and not truncated.any() and (reward == -1).all() and (info["length"] == 5).all()


def test_moving_into_the_cell_the_tail_leaves_is_allowed():
    env = SnakeVectorEnv(1)
    env.reset(seed=7)
    set_snake(env, 0, LOOP, food=(9, 9), direction=LEFT)
    for t in range(40):
        obs, reward, terminated, truncated, _ = step(env, LOOP_ACTIONS[t % 4])
        assert not terminated.any() and not truncated.any() and (reward == 0).all()
        assert cells_of(obs[0, 1]) == set(LOOP)


def test_reversal_into_the_neck_is_ignored():
    env = SnakeVectorEnv(1)
    obs, _ = env.reset(seed=8)
    env.food.fill_(padded(env, 9, 9))
    obs, reward, terminated, *_ = step(env, LEFT)  # heading right: ignored, moves right
    assert cells_of(obs[0, 0]) == {(5, 6)} and not terminated.any() and (env.direction == RIGHT).all()
    obs, *_ = step(env, UP)
    obs, reward, terminated, *_ = step(env, DOWN)  # heading up: ignored, moves up
    assert cells_of(obs[0, 0]) == {(3, 6)} and not terminated.any() and (env.direction == UP).all()


def test_starvation_limit_truncates_and_eating_restarts_it():
    env = SnakeVectorEnv(1, max_steps_without_food=5)
    env.reset(seed=9)
    env.food.copy_(env.head + 1)
    _, reward, *_ = step(env, RIGHT)  # eats at (5, 6): body (5, 3)..(5, 6)
    assert reward.item() == 1 and env.hunger.item() == 0
    env.food.fill_(padded(env, 9, 9))
    for t, action in enumerate([UP, LEFT, DOWN, RIGHT, UP]):  # a 2x2 ring: alive, never eats
        obs, reward, terminated, truncated, _ = step(env, action)
        assert not terminated.any() and bool(truncated.all()) == (t == 4) and reward.item() == 0
    assert env.length.item() == 3 and env.elapsed.item() == 0 and cells_of(obs[0, 0]) == {(5, 5)}


def test_total_step_limit_truncates():
    env = SnakeVectorEnv(3, max_steps=7, max_steps_without_food=1000)
    env.reset(seed=10)
    for i in range(3):
        set_snake(env, i, LOOP, food=(9, 9), direction=LEFT)
    for t in range(7):
        _, _, terminated, truncated, _ = step(env, LOOP_ACTIONS[t % 4])
        assert not terminated.any() and bool(truncated.all()) == bool(truncated.any()) == (t == 6)
    assert (env.elapsed == 0).all() and (env.length == 3).all()


# ---------------------------------------------------------------------------------------------- API
@pytest.mark.parametrize("seed", [[3, 17, 99, 0, 5, 2**40], 11])
def test_batched_env_equals_single_envs(seed):
    """N envs stepped together give the same trajectories as N single envs with the matching seeds."""
    n, steps = 6, 400
    kwargs = dict(height=5, width=6, max_steps_without_food=30)
    vec = SnakeVectorEnv(n, **kwargs)
    obs_v, _ = vec.reset(seed=seed)
    seeds = seed if isinstance(seed, list) else [seed + i for i in range(n)]
    singles = [SnakeEnv(**kwargs) for _ in range(n)]
    obs_s = [e.reset(seed=s)[0] for e, s in zip(singles, seeds)]
    np.testing.assert_array_equal(obs_v.numpy(), np.stack(obs_s))
    rng = np.random.default_rng(1)
    ends = 0
    for _ in range(steps):
        a = rng.integers(0, 4, n)
        obs_v, rew_v, term_v, trunc_v, info_v = vec.step(torch.as_tensor(a))
        for i, e in enumerate(singles):
            o, r, term, trunc, info = e.step(a[i])
            np.testing.assert_array_equal(o, obs_v[i].numpy())
            assert (r, term, trunc) == (float(rew_v[i]), bool(term_v[i]), bool(trunc_v[i]))
            assert info == {k: float(v[i]) for k, v in info_v.items()}
        ends += int((term_v | trunc_v).sum())
    assert ends > 50  # the comparison crossed many auto-resets


def test_reset_seed_reproducibility():
    a, b = SnakeVectorEnv(32), SnakeVectorEnv(32)
    gen = torch.Generator().manual_seed(0)
    actions = torch.randint(0, 4, (100, 32), generator=gen)
    first = [a.reset(seed=7)[0]] + [a.step(x)[0] for x in actions]
    second = [b.reset(seed=7)[0]] + [b.step(x)[0] for x in actions]
    for x, y in zip(first, second):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    other, _ = b.reset(seed=8)
    assert not torch.equal(other, first[0])
    again, _ = a.reset(seed=7)
    torch.testing.assert_close(again, first[0], rtol=0, atol=0)
    going_on, _ = a.reset()  # no seed: the streams go on, so the food moves
    assert not torch.equal(going_on[:, 2], first[0][:, 2]) and torch.equal(going_on[:, :2], first[0][:, :2])
    fresh, _ = SnakeVectorEnv(32).reset()  # a new env starts as if seeded with 0
    torch.testing.assert_close(fresh, SnakeVectorEnv(32).reset(seed=0)[0], rtol=0, atol=0)


def test_state_dict_round_trip_resumes_the_same_trajectory():
    env = SnakeVectorEnv(16, height=6, width=6)
    env.reset(seed=5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        env.step(torch.randint(0, 4, (16,), generator=gen))
    state = env.state_dict()
    actions = torch.randint(0, 4, (200, 16), generator=gen)
    first = [env.step(x) for x in actions]
    other = SnakeVectorEnv(16, height=6, width=6)
    other.reset(seed=123)
    other.load_state_dict(state)
    second = [other.step(x) for x in actions]
    for x, y in zip(first, second):
        for u, v in zip(x[:4], y[:4]):
            torch.testing.assert_close(u, v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="shape"):
        SnakeVectorEnv(4, height=6, width=6).load_state_dict(state)
    with pytest.raises(ValueError, match="shape"):
        SnakeVectorEnv(16).load_state_dict(state)
    with pytest.raises(ValueError, match="misses"):
        SnakeVectorEnv(16, height=6, width=6).load_state_dict({"tau": state["tau"]})


def test_check_env_and_make():
    single = gym.make("Snake-v0").unwrapped
    assert isinstance(single, SnakeEnv)
    check_env(single)
    check_env(gym.make("Snake-v0", render_mode="ansi", height=6, width=7).unwrapped)
    env = gym.make("Snake-v0", height=8, width=8)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (3, 8, 8) and obs.dtype == np.float32 and env.observation_space.contains(obs)
    obs, r, term, trunc, info = env.step(env.action_space.sample())
    assert set(info) == set(INFO_KEYS) and isinstance(r, float)
    with pytest.raises(ValueError, match="action"):
        env.step(4)
    text = SnakeEnv(render_mode="ansi")
    text.reset(seed=0)
    board = text.render().splitlines()
    assert len(board) == 12 and board[6] == "#...ooH....#" and sum(line.count("*") for line in board) == 1


def test_make_vec_vector_entry_point():
    vec = gym.make_vec("Snake-v0", num_envs=32, vectorization_mode="vector_entry_point", device="cpu")
    obs, _ = vec.reset(seed=0)
    assert obs.shape == (32, 3, 10, 10) and vec.single_observation_space.shape == (3, 10, 10)
    assert vec.single_action_space == gym.spaces.Discrete(4)
    obs, r, term, trunc, info = vec.step(torch.zeros(32, dtype=torch.int64))
    assert r.shape == (32,) and r.dtype == torch.float32 and term.dtype == torch.bool and set(info) == set(INFO_KEYS)
    assert vec.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    # the whole random state is the per-env streams in state_dict: no torch.Generator to checkpoint besides them
    unwrapped = getattr(vec, "unwrapped", vec)
    assert not any(isinstance(v, torch.Generator) for v in vars(unwrapped).values())
    assert "rng" in unwrapped.state_dict()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_envs": 0}, "num_envs"),
        ({"height": 0}, "at least 1 x 1"),
        ({"initial_length": 0}, "initial_length"),
        ({"width": 2}, "does not fit"),
        ({"height": 1, "width": 3}, "no free cell"),
        ({"max_steps_without_food": 0}, "max_steps_without_food"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SnakeVectorEnv(**kwargs)


def test_bad_seeds_are_rejected():
    env = SnakeVectorEnv(3)
    with pytest.raises(ValueError, match="seeds for 3 envs"):
        env.reset(seed=[1, 2])
    with pytest.raises(ValueError, match="seed"):
        env.reset(seed=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_follows_the_cpu_trajectories_also_when_replayed_from_a_cuda_graph():
    """Integer dynamics: CUDA and CPU envs with the same seeds stay identical. ``step`` has no host sync and
    updates its state in place, so it can be captured once as a CUDA graph and replayed."""
    n, kwargs = 512, dict(height=6, width=6, max_steps_without_food=30)
    cpu, gpu = SnakeVectorEnv(n, **kwargs), SnakeVectorEnv(n, device="cuda", **kwargs)
    cpu.reset(seed=3)
    gpu.reset(seed=3)
    actions = torch.randint(0, 4, (200, n), generator=torch.Generator().manual_seed(0))

    def same(out_c, out_g):
        for x, y in zip(out_c[:4], out_g[:4]):
            torch.testing.assert_close(x, y.cpu(), rtol=0, atol=1e-6)
        for k in cpu.STATE_KEYS:
            assert torch.equal(getattr(cpu, k), getattr(gpu, k).cpu()), k

    for a in actions[:100]:
        same(cpu.step(a), gpu.step(a.cuda()))
    static_actions = actions[100].cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph requires
        for a in actions[100:103]:
            static_actions.copy_(a)
            same(cpu.step(a), gpu.step(static_actions))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gpu.step(static_actions)
    for a in actions[103:]:
        static_actions.copy_(a)
        graph.replay()
        same(cpu.step(a), static_out)


def test_step_compiles_as_one_graph_and_matches_eager():
    """``torch.compile(step, fullgraph=True)`` traces ``step`` without a graph break (so it can be fused into a
    few kernels on a GPU) and follows the eager env exactly, across deaths, foods and auto-resets."""
    n, kwargs = 64, dict(height=5, width=6, max_steps_without_food=30)
    eager, compiled = SnakeVectorEnv(n, **kwargs), SnakeVectorEnv(n, **kwargs)
    eager.reset(seed=4)
    compiled.reset(seed=4)
    torch._dynamo.reset()
    step = torch.compile(compiled.step, fullgraph=True)
    actions = torch.randint(0, 4, (150, n), generator=torch.Generator().manual_seed(2))
    ends = foods = 0
    for a in actions:
        out_e, out_c = eager.step(a), step(a)
        for x, y in zip(out_e[:4], out_c[:4]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        assert out_e[4].keys() == out_c[4].keys()
        for k in out_e[4]:
            torch.testing.assert_close(out_e[4][k], out_c[4][k], rtol=0, atol=0)
        ends += int((out_e[2] | out_e[3]).sum())
        foods += int(out_e[4]["food"].sum())
    for k in eager.STATE_KEYS:
        assert torch.equal(getattr(eager, k), getattr(compiled, k)), k
    assert ends > 50 and foods > 20  # the comparison crossed auto-resets and food placements
