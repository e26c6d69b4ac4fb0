"""``Snake-v0``: the Snake grid game as a torch-batched gymnasium environment.

:class:`SnakeVectorEnv` steps ``num_envs`` boards at once with a fixed sequence of tensor operations on
one device: no Python loop over envs, no host sync and no data-dependent branching in ``step``; all state
lives in preallocated tensors that ``step`` updates in place. So ``step`` traces as one graph with
``torch.compile(env.step, fullgraph=True)`` and can be captured as a CUDA graph (both follow the eager env
exactly; ``tests/test_snake.py`` checks the first on any device, the second where CUDA is present).
:class:`SnakeEnv` wraps one board as a plain ``gymnasium.Env`` with NumPy spaces for tools that expect one
(``check_env``, Stable-Baselines3).

Rules (board of ``height`` x ``width`` cells, row 0 at the top):

* A new episode starts with a straight snake of ``initial_length`` cells in row ``height // 2``, its tail
  in column ``(width - initial_length) // 2``, heading right, and one food on a free cell.
* Actions: 4 absolute directions, ``0`` up, ``1`` right, ``2`` down, ``3`` left. The action opposite to
  the current heading (a reversal into the neck) is ignored: the snake keeps its heading.
* Each step the head moves one cell. Moving onto the food grows the snake by one cell (the tail stays)
  and places a new food uniformly at random on a cell the snake does not occupy. Otherwise the tail
  leaves its cell in the same step, so the head may move into the cell the tail is leaving.
* Death (``terminated``): the head leaves the board or moves onto its own body. Filling the whole board
  (length ``height * width``) also ends the episode as ``terminated`` (a win; there is no room for food).
* Time limits (``truncated``, never together with ``terminated``): ``max_steps_without_food`` steps since
  the last food or the episode start (default ``4 * height * width``), and optionally ``max_steps`` steps
  in all (default none). Episodes are bounded either way: at most ``height * width`` foods, each within the
  starvation limit.
* Reward: ``+1`` for eating (including the winning food), ``-1`` for death, ``0`` otherwise.
* ``autoreset_mode`` is SAME_STEP: the observation returned on the step that ends an episode is already
  the first of the next episode (as in ``EVHub-v0``; no ``final_obs`` is returned).

Observation: float32 ``(num_envs, 3, height, width)`` in [0, 1]: channel 0 the head (1 at the head's
cell), channel 1 the body including the head, each cell holding the number of steps it stays occupied
divided by the length (1 at the head, ``1 / length`` at the tail, so the order of the body and the
heading can be read off), channel 2 the food (1 at the food's cell).

``info`` of ``step`` holds ``"food"`` (1.0 where the snake ate this step) and ``"length"`` (the snake's
length after the move, before any auto-reset), float32 ``(num_envs,)`` each: the sum of ``"food"`` over an
episode is its score.

State representation (no per-cell Python lists): ``expiry`` is an int64 grid per env with a one-cell wall
ring around the board; a cell is occupied while ``expiry > tau``, where ``tau`` is a per-env clock that
advances each step except when the snake eats. The new head gets ``tau + length``, so the body cells hold
``tau + 1`` (tail) .. ``tau + length`` (head) and the tail frees itself by the clock alone; growth is the
clock standing still for one step. Wall cells hold ``2**62``. An auto-reset advances ``tau`` past the whole
old body and writes the fresh snake's cells, so no step touches the whole grid except food placement
(a cumulative count of free cells) and the observation.

Randomness and seeding: the only random event is food placement. Each env has its own 32-bit counter
stream (a Weyl sequence ``rng += 0x61C88647`` mod 2**32 passed through an integer hash; the k-th free
cell in row-major order is chosen with ``k = (u * n_free) >> 32``). ``reset(seed=s)`` seeds env ``i`` with
``s + i`` (gymnasium's convention for vector envs); ``reset(seed=[s_0, ..., s_{N-1}])`` seeds each env
separately; ``reset()`` without a seed continues the streams. Every env draws exactly one number per step
and one per ``reset``, whatever happens, so env ``i`` of a vector env follows exactly the trajectory of a
:class:`SnakeEnv` (or a 1-env vector env) seeded with the same seed and given the same actions, on any
device (integer arithmetic only). The streams of a new vector env start from seed 0: its first ``reset()``
without a seed equals ``reset(seed=0)``. The per-env streams are part of :meth:`SnakeVectorEnv.state_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv

from envs.rng import MASK32, WEYL, load_state_tensors, mix32, seeds_tensor, state_tensors, stream_keys

INFO_KEYS = ("food", "length")
"""Keys of the per-step ``info`` dict; each value is float32 ``(num_envs,)``: 1.0 where food was eaten,
and the snake's length in cells after the move (before an auto-reset)."""

N_ACTIONS = 4
ACTION_NAMES = ("up", "right", "down", "left")
"""Meaning of the discrete actions 0..3 (absolute directions on the board, row 0 at the top)."""

N_CHANNELS = 3
CHANNEL_NAMES = ("head", "body", "food")
"""Observation channels, in order."""

WALL = 2**62
"""``expiry`` value of the wall ring: never free."""

_START_DIRECTION = 1  # right


class SnakeVectorEnv(VectorEnv):
    """``num_envs`` Snake boards stepped together on ``device`` (rules in the module docstring).

    Args:
        num_envs: number of boards.
        height: board rows (default 10).
        width: board columns (default 10).
        initial_length: length of the snake at the start of an episode, cells (default 3).
        max_steps_without_food: truncate an episode after this many steps without eating (counted from the
            episode start or the last food). ``None``: ``4 * height * width``.
        max_steps: truncate every episode after this many steps in all. ``None``: no such limit.
        device: torch device of all state and returned tensors.

    ``step(actions)`` takes ``num_envs`` integers in ``{0, 1, 2, 3}`` (anything ``torch.as_tensor`` accepts).
    They are not range-checked, as that would sync with the host: 4 or more raises ``IndexError`` on the CPU
    (a device-side assert on CUDA), negative values wrap around as in Python indexing. ``step`` returns
    ``obs`` float32 ``(num_envs, 3, height, width)``, ``reward`` float32 ``(num_envs,)``, ``terminated`` and
    ``truncated`` bool ``(num_envs,)`` and ``info`` with exactly the keys of :data:`INFO_KEYS`. All returned
    tensors are new (none aliases the env's state).

    Raises:
        ValueError: ``num_envs < 1``, a board dimension < 1, ``initial_length < 1``, a snake wider than the
            board (``initial_length > width``), no free cell for the first food
            (``height * width <= initial_length``), or a step limit < 1.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    STATE_KEYS = ("expiry", "tau", "head", "direction", "length", "food", "elapsed", "hunger", "rng")
    """Tensors that make up the dynamic state of all envs (see :meth:`state_dict`): ``expiry`` int64
    ``(num_envs, (height + 2) * (width + 2))`` (padded row-major grid), the others int64 ``(num_envs,)``:
    clock ``tau``, padded flat cell index of the ``head`` and the ``food``, heading ``direction`` (0..3),
    ``length`` (cells), ``elapsed`` steps in the episode, ``hunger`` (steps since the last food) and the
    random stream's position ``rng``."""

    def __init__(
        self,
        num_envs: int = 1,
        height: int = 10,
        width: int = 10,
        initial_length: int = 3,
        max_steps_without_food: int | None = None,
        max_steps: int | None = None,
        device: str | torch.device = "cpu",
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if height < 1 or width < 1:
            raise ValueError(f"the board needs at least 1 x 1 cells, got height={height}, width={width}")
        if initial_length < 1:
            raise ValueError(f"initial_length must be >= 1, got {initial_length}")
        if initial_length > width:
            raise ValueError(f"initial_length={initial_length} does not fit in a row of width={width}")
        if height * width <= initial_length:
            raise ValueError(
                f"a {height} x {width} board has no free cell for food next to a snake of length {initial_length}"
            )
        if max_steps_without_food is None:
            max_steps_without_food = 4 * height * width
        if max_steps_without_food < 1:
            raise ValueError(f"max_steps_without_food must be >= 1, got {max_steps_without_food}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")

        self.num_envs = num_envs
        self.height, self.width = int(height), int(width)
        self.initial_length = int(initial_length)
        self.max_steps_without_food = int(max_steps_without_food)
        self.max_steps = None if max_steps is None else int(max_steps)
        self.device = torch.device(device)

        self.single_observation_space = gym.spaces.Box(0.0, 1.0, (N_CHANNELS, height, width), np.float32)
        self.single_action_space = gym.spaces.Discrete(N_ACTIONS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

        dev = self.device
        wp = width + 2
        self._num_cells = height * width
        self._padded_cells = (height + 2) * wp
        # heading after action a from heading d: a, unless a reverses d
        turn = [[d if a == (d + 2) % 4 else a for a in range(4)] for d in range(4)]
        self._turn = torch.tensor(turn, dtype=torch.int64, device=dev)
        self._delta = torch.tensor([-wp, 1, wp, -1], dtype=torch.int64, device=dev)  # up, right, down, left
        # padded flat index of each board cell, (height, width)
        rows = torch.arange(1, height + 1, device=dev)[:, None]
        cols = torch.arange(1, width + 1, device=dev)[None, :]
        board_index = (rows * wp + cols).reshape(-1)
        self._board_index = board_index  # padded cell of each board cell (row-major over height x width)
        # board cell (row-major over height x width) of each padded cell; 0 for the wall ring (never read)
        self._to_board = torch.zeros(self._padded_cells, dtype=torch.int64, device=dev)
        self._to_board[board_index] = torch.arange(height * width, device=dev)
        self._mark_offsets = torch.tensor([0, 2 * height * width], dtype=torch.int64, device=dev)  # channels 0, 2
        # the start snake, tail to head, and its expiry offsets 1..L
        row0 = height // 2
        tail_col = (width - initial_length) // 2
        start = [(row0 + 1) * wp + tail_col + 1 + j for j in range(initial_length)]
        self._start_head = start[-1]
        self._start_cells = torch.tensor(start, dtype=torch.int64, device=dev).expand(num_envs, -1).contiguous()
        self._start_offsets = torch.arange(1, initial_length + 1, dtype=torch.int64, device=dev)
        start_grid = torch.full((height + 2, wp), WALL, dtype=torch.int64, device=dev)
        start_grid[1:-1, 1:-1] = 0
        start_grid = start_grid.reshape(-1)
        start_grid[self._start_cells[0]] = self._start_offsets
        self._start_grid = start_grid
        # 0-dim constants for the in-place auto-reset (``torch.where(..., out=)`` takes no Python scalars)
        self._const = {
            name: torch.tensor(value, dtype=torch.int64, device=dev)
            for name, value in (
                ("length", initial_length),
                ("head", self._start_head),
                ("direction", _START_DIRECTION),
                ("zero", 0),
            )
        }

        B = num_envs
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=dev)  # noqa: E731
        self.expiry = z(B, self._padded_cells)
        self.tau = z(B)
        self.head = z(B)
        self.direction = z(B)
        self.length = z(B)
        self.food = z(B)
        self.elapsed = z(B)
        self.hunger = z(B)
        self.rng = z(B)
        self._seed_streams(0)
        self._reset_all()  # a valid state before the first reset ...
        self._seed_streams(0)  # ... whose draw the first reset() without a seed repeats

    # ------------------------------------------------------------------ state helpers
    def _seed_streams(self, seed: int | Sequence[int]) -> None:
        """Set each env's random stream from ``seed`` (:func:`envs.rng.seeds_tensor`: env i gets ``seed + i``)."""
        self.rng.copy_(stream_keys(seeds_tensor(seed, self.num_envs, self.device)))

    def _reset_all(self) -> None:
        self.expiry.copy_(self._start_grid.expand_as(self.expiry))
        self.tau.zero_()
        self.head.fill_(self._start_head)
        self.direction.fill_(_START_DIRECTION)
        self.length.fill_(self.initial_length)
        self.elapsed.zero_()
        self.hunger.zero_()
        self._place_food(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))

    def _place_food(self, where: torch.Tensor) -> None:
        """Draw one number from every env's stream; move the food of the envs in ``where`` (bool
        ``(num_envs,)``) to a uniformly drawn free cell. At least one cell must be free in those envs."""
        self.rng.add_(WEYL).bitwise_and_(MASK32)
        u = mix32(self.rng)
        free = (self._board() <= self.tau[:, None, None]).view(self.num_envs, -1)
        count = free.cumsum(1, dtype=torch.int32)  # count[:, j]: free board cells among 0..j
        k = (u * count[:, -1]) >> 32  # uniform in [0, n_free)
        cell = torch.searchsorted(count, (k + 1).to(torch.int32)[:, None]).squeeze(1)  # the (k+1)-th free cell
        torch.where(where, self._board_index.index_select(0, cell), self.food, out=self.food)

    def _observe(self) -> torch.Tensor:
        B, H, W = self.num_envs, self.height, self.width
        obs = torch.zeros(B, N_CHANNELS, H, W, dtype=torch.float32, device=self.device)
        # head and food: a 1 at their cells of channels 0 and 2
        marks = self._to_board.index_select(0, torch.stack([self.head, self.food], dim=1).view(-1)).view(B, 2)
        obs.view(B, -1).scatter_(1, marks + self._mark_offsets, 1.0)
        # body: steps each cell stays occupied, over the length
        body = obs[:, 1]
        body.copy_(self._board() - self.tau[:, None, None])  # exact in int64, then cast
        body.clamp_(min=0.0).div_(self.length.to(torch.float32)[:, None, None])
        return obs

    def _board(self) -> torch.Tensor:
        """View of ``expiry`` without the wall ring, ``(num_envs, height, width)``."""
        return self.expiry.view(self.num_envs, self.height + 2, self.width + 2)[:, 1:-1, 1:-1]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the dynamic state tensors (:data:`STATE_KEYS`, each ``(num_envs, ...)`` int64, including the
        per-env random streams ``rng``): what a checkpoint needs to resume mid-episode."""
        return state_tensors(self, self.STATE_KEYS)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a :meth:`state_dict` in place (:func:`envs.rng.load_state_tensors`).

        Raises:
            ValueError: a missing key, or tensors shaped for another ``num_envs`` or board size.
        """
        load_state_tensors(self, state, self.STATE_KEYS)

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        """Start new episodes in every env.

        Args:
            seed: int ``s`` seeds env ``i`` with ``s + i``; a sequence of ``num_envs`` ints seeds each env;
                ``None`` continues the random streams.
            options: unused (accepted for the gymnasium API).

        Returns:
            ``(obs, info)``: obs float32 ``(num_envs, 3, height, width)``; info is empty.

        Raises:
            ValueError: a negative seed or one >= 2**63, or a seed sequence whose length is not ``num_envs``.
        """
        if seed is not None:
            self._seed_streams(seed)
        self._reset_all()
        return self._observe(), {}

    def step(self, actions):
        """Advance every env by one step; see the class docstring for shapes and the module's for rules."""
        a = torch.as_tensor(actions, device=self.device).reshape(self.num_envs)
        if a.dtype != torch.int64:  # the dtype, not a tensor value
            a = a.long()
        direction = self._turn[self.direction, a]
        head = self.head + self._delta.index_select(0, direction)
        target = self.expiry.gather(1, head[:, None]).squeeze(1)
        ate = head == self.food  # the food is never on the body or a wall
        tau = self.tau + 1
        dead = target > tau  # occupied after the tail moved on (walls always are)
        grow = ate.long()
        tau = tau - grow  # eating: the clock stands still and the tail stays
        length = self.length + grow
        # the dead keep the cell's value, so a wall stays a wall
        self.expiry.scatter_(1, head[:, None], torch.where(dead, target, tau + length)[:, None])
        self.elapsed.add_(1)
        hunger = torch.where(ate, 0, self.hunger + 1)

        terminated = dead | (length >= self._num_cells)
        limit = hunger >= self.max_steps_without_food
        if self.max_steps is not None:  # a constructor setting, not a tensor value
            limit = limit | (self.elapsed >= self.max_steps)
        truncated = limit & ~terminated
        done = terminated | limit
        food = ate.to(torch.float32)
        reward = torch.where(dead, -1.0, food)
        info = {"food": food, "length": length.to(torch.float32)}

        # auto-reset: move the clock past the old body (it all frees itself), write a fresh snake
        torch.add(tau, torch.where(done, length, 0), out=self.tau)
        c = self._const
        torch.where(done, c["length"], length, out=self.length)
        torch.where(done, c["head"], head, out=self.head)
        torch.where(done, c["direction"], direction, out=self.direction)
        torch.where(done, c["zero"], self.elapsed, out=self.elapsed)
        torch.where(done, c["zero"], hunger, out=self.hunger)
        start = torch.where(
            done[:, None], self.tau[:, None] + self._start_offsets, self.expiry.gather(1, self._start_cells)
        )
        self.expiry.scatter_(1, self._start_cells, start)
        self._place_food(ate | done)
        return self._observe(), reward, terminated, truncated, info


class SnakeEnv(gym.Env):
    """One board of :class:`SnakeVectorEnv` as a plain ``gymnasium.Env`` with NumPy spaces.

    Takes the same keyword arguments as :class:`SnakeVectorEnv` (except ``num_envs``; ``device`` defaults to
    the CPU). ``reset(seed=s)`` gives the trajectory of env 0 of a vector env reset with seed ``s``; the first
    ``reset()`` without a seed draws one from ``np_random``. Observations are float32 ``(3, height, width)``
    NumPy arrays, ``info`` holds the :data:`INFO_KEYS` as Python floats. ``render_mode="ansi"`` renders the
    board as text (``#`` wall, ``H`` head, ``o`` body, ``*`` food, ``.`` empty).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 10}

    def __init__(self, render_mode: str | None = None, **kwargs: Any):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"unknown render_mode {render_mode!r}: expected None or 'ansi'")
        kwargs.setdefault("device", "cpu")
        self.vec = SnakeVectorEnv(num_envs=1, **kwargs)
        self.observation_space = self.vec.single_observation_space
        self.action_space = self.vec.single_action_space
        self.render_mode = render_mode
        self._seeded = False
        self._obs: np.ndarray | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode; returns a NumPy obs ``(3, height, width)`` and an empty info dict."""
        super().reset(seed=seed)
        if seed is None and not self._seeded:
            seed = int(self.np_random.integers(0, 2**62))
        self._seeded = True
        obs, _ = self.vec.reset(seed=seed)
        self._obs = obs[0].cpu().numpy()
        return self._obs.copy(), {}

    def step(self, action):
        """One step; returns NumPy obs, float reward, bools and a dict of floats.

        Raises:
            ValueError: an action outside ``{0, 1, 2, 3}``.
        """
        a = int(np.asarray(action).reshape(()))
        if not 0 <= a < N_ACTIONS:
            raise ValueError(f"action must be one of 0..3, got {a}")
        obs, reward, terminated, truncated, info = self.vec.step(torch.tensor([a]))
        self._obs = obs[0].cpu().numpy()
        return (
            self._obs.copy(),
            float(reward[0]),
            bool(terminated[0]),
            bool(truncated[0]),
            {k: float(v[0]) for k, v in info.items()},
        )

    def render(self) -> str | None:
        """The board as text (``render_mode="ansi"``), else ``None``."""
        if self.render_mode != "ansi" or self._obs is None:
            return None
        head, body, food = self._obs
        w = self.vec.width
        lines = ["#" * (w + 2)]
        for r in range(self.vec.height):
            row = "".join(
                "H" if head[r, c] else "o" if body[r, c] > 0 else "*" if food[r, c] else "." for c in range(w)
            )
            lines.append(f"#{row}#")
        lines.append(lines[0])
        return "\n".join(lines) + "\n"
