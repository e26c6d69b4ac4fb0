"""One torch-facing vector env for every training script: the torch-batched envs of this package and any other
gymnasium id, with one meaning of actions, ``final_obs``, episode statistics and reward normalisation.

:func:`make_vec` returns a :class:`TorchVecEnv` (our envs, stepped on the device) or a :class:`GymTorchVecEnv`
(gymnasium's ``SyncVectorEnv`` / ``AsyncVectorEnv`` with same-step autoreset, NumPy on the host); both give:

* observations float32 ``(num_envs, *obs_shape)`` on ``device``, ``obs_shape`` being ``(C, H, W)`` for an image
  Box (3-D) and ``(obs_dim,)`` (flattened) for anything else;
* actions: for a ``Box``, float ``(num_envs, act_dim)`` in [-1, 1], clipped to [-1, 1] and then rescaled affinely
  to the Box's ``[low, high]`` where both bounds are finite (an infinite bound passes the value unscaled); for a
  ``Discrete(n, start)``, int64 indices ``(num_envs,)`` in ``0..n-1``, handed on as ``index + start``;
* rewards float32 ``(num_envs,)``, ``terminated`` / ``truncated`` bool ``(num_envs,)``;
* ``info["final_obs"]``: float32 like the observations, the last observation of each episode that ended in this
  step where the env gives it (gymnasium envs), the returned observation elsewhere. ``has_final_obs`` says which:
  the torch-batched envs (``EVHub-v0``, ``Snake-v0``) give none, so a truncation there is bootstrapped through the
  autoreset (the next window's first observation), a stated approximation;
* ``state_dict`` / ``load_state_dict``: the whole dynamic state of a torch-batched env, its random generator
  included (None for gymnasium envs, whose state cannot be saved).

Device-side wrappers, in the manner of purejaxrl's ``LogWrapper`` and ``NormalizeVecReward``:
:class:`RecordEpisodeStatistics` (per-env sums of return, length and the site's KPIs, read once per log interval)
and :class:`NormalizeReward` (rewards divided by a running std of the discounted return). Both keep their state
on the device, never sync with the host in ``step``, and checkpoint through ``state_dict``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys

import gymnasium as gym
import numpy as np
import torch

from envs.errors import InputError

EVHUB_ID = "EVHub-v0"
"""The site env: the only one with a site, splits, KPIs and ``policy.json``."""


def env_name(env_id: str) -> str:
    """``env_id`` without a ``module:`` prefix (``"envs:Snake-v0"`` -> ``"Snake-v0"``)."""
    return env_id.split(":")[-1]


def is_evhub(env_id: str) -> bool:
    """True for ``EVHub-v0`` (with or without a ``module:`` prefix)."""
    return env_name(env_id) == EVHUB_ID


def spec_of(env_id: str) -> gym.envs.registration.EnvSpec:
    """gymnasium's spec of ``env_id``; a ``module:`` prefix is imported first (it registers the id), as ``gym.make``
    does.

    Raises:
        gymnasium.error.Error: the id is not registered. ModuleNotFoundError: its ``module:`` part cannot be imported.
    """
    if ":" in env_id:
        importlib.import_module(env_id.split(":")[0])
    return gym.spec(env_name(env_id))


def is_torch_batched(env_id: str) -> bool:
    """True where ``env_id``'s gymnasium spec has a ``vector_entry_point`` whose constructor takes a ``device``: the
    torch-batched envs of this package (and a user's own built the same way). Gymnasium's own NumPy vector envs (e.g.
    ``CartPole-v1``'s) take none; they are stepped as gymnasium envs.

    Raises:
        gymnasium.error.Error: the id is not registered (or its ``module:`` part cannot be imported).
    """
    entry_point = spec_of(env_id).vector_entry_point
    if entry_point is None:
        return False
    creator = entry_point if callable(entry_point) else gym.envs.registration.load_env_creator(entry_point)
    try:
        return "device" in inspect.signature(creator).parameters
    except (TypeError, ValueError):  # no signature to read: trust the vector entry point
        return True


class SpaceError(InputError):
    """An env's observation or action space that the scripts cannot drive; the message names the env, the space and
    what to do."""


FLATTENED_SPACES = (
    gym.spaces.Dict,
    gym.spaces.Tuple,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)
"""Observation spaces the scripts take flattened to one float vector by gymnasium's ``FlattenObservation`` (a
``Discrete`` becomes its one-hot vector, a ``Dict`` its entries' flattenings in key order)."""


def flatten_observation(env: gym.Env) -> gym.Env:
    """``env`` as the networks can read it: as it is for a ``Box`` observation, wrapped in gymnasium's
    ``FlattenObservation`` for a :data:`FLATTENED_SPACES` one (with :attr:`flattened` naming the original space).

    Raises:
        SpaceError: any other observation space (``Graph``, ``Sequence``, ``Text``, or a ``Dict`` / ``Tuple`` holding
            one), which has no fixed-size flat vector.
    """
    space = env.observation_space
    if isinstance(space, gym.spaces.Box):
        return env
    spec = getattr(env, "spec", None)
    name = spec.id if spec is not None else type(env.unwrapped).__name__
    try:
        if not isinstance(space, FLATTENED_SPACES):
            raise NotImplementedError
        gym.spaces.flatdim(space)
    except (NotImplementedError, ValueError, TypeError):
        raise SpaceError(
            f"{name}'s observation space {space} cannot be flattened to a fixed-size vector (the scripts take a Box, "
            f"or a Dict, Tuple, Discrete, MultiDiscrete or MultiBinary one, flattened); wrap the env in a "
            f"gymnasium.ObservationWrapper that gives a Box and register the wrapped env under an id of its own"
        ) from None
    wrapped = gym.wrappers.FlattenObservation(env)
    wrapped.flattened = space
    return wrapped


def obs_shape_of(space: gym.Space) -> tuple[int, ...]:
    """One env's observation as the networks take it: an image Box ``(C, H, W)`` as it is, anything else flattened
    to ``(obs_dim,)``.

    Raises:
        SpaceError: a space without a shape (a ``Dict`` that was not flattened by :func:`flatten_observation`).
    """
    if space.shape is None:
        raise SpaceError(f"observation space {space} has no shape: flatten it first (envs.vector.flatten_observation)")
    shape = tuple(int(x) for x in space.shape)
    return shape if len(shape) == 3 else (int(np.prod(shape)),)


class BoxScaling:
    """The affine map of Box actions from [-1, 1] to ``[low, high]`` (finite bounds only; an infinite bound passes the
    value unscaled): ``mid + half * a``, with ``mid`` and ``half`` float64 ``(act_dim,)`` arrays. With a ``device``,
    float32 copies of them live there too (:meth:`torch`), made once."""

    def __init__(self, space: gym.spaces.Box, device: torch.device | None = None):
        low = np.asarray(space.low, np.float64).reshape(-1)
        high = np.asarray(space.high, np.float64).reshape(-1)
        finite = np.isfinite(low) & np.isfinite(high)
        self.identity = bool(np.all(finite & (low == -1.0) & (high == 1.0)))
        self.mid = np.where(finite, (high + low) / 2.0, 0.0)
        self.half = np.where(finite, (high - low) / 2.0, 1.0)
        if device is not None:
            self.mid_t = torch.as_tensor(self.mid, dtype=torch.float32, device=device)
            self.half_t = torch.as_tensor(self.half, dtype=torch.float32, device=device)

    def numpy(self, a: np.ndarray) -> np.ndarray:
        """``(N, act_dim)`` float64 in [-1, 1] -> in ``[low, high]``."""
        return self.mid + self.half * a

    def torch(self, a: torch.Tensor) -> torch.Tensor:
        """The same map on the device (identity for a [-1, 1] Box: no extra kernel)."""
        return a if self.identity else self.mid_t + self.half_t * a


class _VectorEnv:
    """What both vector envs below hold: the wrapped env, the device, the spaces and the observation shape."""

    def __init__(self, env, device: torch.device):
        self.env = env
        self.device = torch.device(device)
        self.num_envs = int(env.num_envs)
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.obs_shape = obs_shape_of(env.single_observation_space)
        self.discrete = isinstance(env.single_action_space, gym.spaces.Discrete)


class TorchVecEnv(_VectorEnv):
    """A torch-batched env (``EVHub-v0``, ``Snake-v0``, or a user's own with a ``device`` vector entry point) with the
    contract of the module docstring. The wrapped env is :attr:`env`; attributes it has and this class has not (e.g.
    ``n_sockets``, ``observation_layout``, ``data``) are read through.

    Raises:
        ValueError: a Discrete action space that does not start at 0 (the env takes the indices as they are).
    """

    has_final_obs = False
    torch_batched = True
    vector_mode = None

    def __init__(self, env, device: torch.device):
        super().__init__(env, device)
        space = env.single_action_space
        if self.discrete and int(space.start) != 0:
            raise ValueError(f"a torch-batched env takes the action indices 0..n-1, but its space is {space}")
        self._scale = BoxScaling(space, self.device) if isinstance(space, gym.spaces.Box) else None

    def __getattr__(self, name: str):
        if name == "env":  # not set yet (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def _obs(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.to(torch.float32).reshape(self.num_envs, *self.obs_shape)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every env; returns ``(obs, info)``."""
        obs, info = self.env.reset(seed=seed)
        return self._obs(obs), info

    def step(self, action: torch.Tensor):
        """One step of every env; returns ``(obs, reward, terminated, truncated, info)`` (module docstring)."""
        if self._scale is not None:
            action = self._scale.torch(action.clamp(-1.0, 1.0))
        obs, reward, terminated, truncated, info = self.env.step(action)
        obs = self._obs(obs)
        return obs, reward.to(torch.float32), terminated, truncated, {**info, "final_obs": obs}

    step_async = None
    """Torch-batched envs step in place: no split into ``step_async`` / ``step_wait`` (``overlap`` is False)."""
    overlap = False

    def state_dict(self) -> dict:
        """The env's own :meth:`state_dict` (dynamic state and random generator)."""
        return self.env.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; raises ValueError on tensors shaped for another ``num_envs``."""
        self.env.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release (the env's tensors go with it)."""
        getattr(self.env, "close", lambda: None)()


class GymTorchVecEnv(_VectorEnv):
    """A gymnasium vector env (``SyncVectorEnv`` / ``AsyncVectorEnv``, same-step autoreset) behind the contract of the
    module docstring. ``overlap`` is True for an async env: :meth:`step_async` returns at once and the workers step
    while the caller computes (SAC's and DQN's gradient steps); :meth:`step_wait` collects the step.
    """

    has_final_obs = True
    torch_batched = False

    def __init__(self, env: gym.vector.VectorEnv, device: torch.device, vector_mode: str):
        super().__init__(env, device)
        self.vector_mode = vector_mode
        self.overlap = vector_mode == "async"
        space = env.single_action_space
        if self.discrete:
            self._start = np.int64(space.start)
        elif isinstance(space, gym.spaces.Box):
            self._scale = BoxScaling(space)
        self._pending = None

    def _obs(self, obs) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, np.float32).reshape(self.num_envs, *self.obs_shape)).to(self.device)

    def action_to_env(self, action: torch.Tensor) -> np.ndarray:
        """Device actions -> what the gymnasium env takes (module docstring)."""
        if self.discrete:
            return action.detach().to("cpu", torch.int64).numpy().reshape(self.num_envs) + self._start
        space = self.single_action_space
        a = action.detach().to("cpu", torch.float64).numpy().reshape(self.num_envs, -1)
        a = self._scale.numpy(np.clip(a, -1.0, 1.0))
        return a.reshape(self.num_envs, *space.shape).astype(space.dtype)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every env (env ``i`` seeded with ``seed + i``); returns ``(obs, info)``."""
        obs, info = self.env.reset(seed=seed)
        return self._obs(obs), info

    def step_async(self, action: torch.Tensor) -> None:
        """Send the actions and return at once (a ``SyncVectorEnv`` steps here already)."""
        a = self.action_to_env(action)
        if self.overlap:
            self.env.step_async(a)
            self._pending = True
        else:
            self._pending = self.env.step(a)

    def step_wait(self):
        """The step sent by :meth:`step_async`: ``(obs, reward, terminated, truncated, info)``."""
        result = self.env.step_wait() if self._pending is True else self._pending
        self._pending = None
        obs, reward, terminated, truncated, info = result
        next_obs = final_obs = self._obs(obs)
        ended = info.get("_final_obs")
        if ended is not None and np.any(ended):
            flat = np.asarray(obs, np.float32).reshape(self.num_envs, *self.obs_shape).copy()
            for i in np.flatnonzero(ended):
                flat[i] = np.asarray(info["final_obs"][i], np.float32).reshape(self.obs_shape)
            final_obs = torch.as_tensor(flat).to(self.device)
        t = lambda x, dtype: torch.as_tensor(np.asarray(x, dtype)).to(self.device)  # noqa: E731
        info = {k: v for k, v in info.items() if k not in ("final_obs", "_final_obs", "final_info", "_final_info")}
        # numeric per-env entries (gymnasium stacks them as NumPy arrays) become device tensors, as the batched envs'
        info = {
            k: t(v, np.float64)
            if isinstance(v, np.ndarray) and v.dtype.kind in "fiu" and v.shape == (self.num_envs,)
            else v
            for k, v in info.items()
        }
        return (
            next_obs,
            t(reward, np.float32),
            t(terminated, bool),
            t(truncated, bool),
            {**info, "final_obs": final_obs},
        )

    def step(self, action: torch.Tensor):
        """:meth:`step_async` then :meth:`step_wait`."""
        self.step_async(action)
        return self.step_wait()

    def state_dict(self) -> None:
        """None: a gymnasium env's state cannot be stored."""
        return None

    def close(self) -> None:
        """Close the envs (and an ``AsyncVectorEnv``'s workers; a step in flight is collected first)."""
        if self._pending is True:
            with contextlib.suppress(Exception):
                self.env.step_wait()
        self._pending = None
        self.env.close()


def make_vec(
    env_id: str, num_envs: int, device: str | torch.device, vector_mode: str = "sync", **env_kwargs
) -> TorchVecEnv | GymTorchVecEnv:
    """``num_envs`` copies of ``env_id`` behind the contract of the module docstring; ``env_kwargs`` go to the env's
    constructor.

    A torch-batched id is built by its vector entry point on ``device`` (e.g. EVHub-v0's ``site``, ``split``,
    ``action_mode``, ``bess_action``) and ``vector_mode`` is ignored. Any other id goes through ``gym.make_vec`` with
    ``vector_mode`` ``"sync"`` or ``"async"`` (one worker process per env), each copy's observation flattened where
    it is not a Box (:func:`flatten_observation`; the returned env's ``flattened`` holds the original space, else
    None); if the async workers cannot start (no fork, an env that does not pickle), a warning goes to stderr and the
    env is built ``"sync"`` (the returned env's ``vector_mode`` says which, ``warning`` holds the text).

    Raises:
        gymnasium.error.Error: an unknown id. InputError: the env's constructor refused ``env_kwargs`` (a missing or
        unknown argument). SpaceError: an observation space that cannot be flattened.
    """
    device = torch.device(device)
    if is_torch_batched(env_id):
        env = _built(
            env_id,
            env_kwargs,
            lambda: gym.make_vec(
                env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", device=device, **env_kwargs
            ),
        )
        env = TorchVecEnv(getattr(env, "unwrapped", env), device)
        env.warning = env.flattened = None
        return env
    kwargs = {
        "vector_kwargs": {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        "wrappers": [flatten_observation],
        **env_kwargs,
    }
    warning = None
    if vector_mode == "async":
        probe = flatten_observation(_built(env_id, env_kwargs, lambda: gym.make(env_id, **env_kwargs)))
        flattened = getattr(probe, "flattened", None)  # the env's errors are raised here, in this process
        probe.close()
        try:
            env = GymTorchVecEnv(gym.make_vec(env_id, num_envs, vectorization_mode="async", **kwargs), device, "async")
        except Exception as exc:  # noqa: BLE001 - any failure to start the workers falls back to sync
            warning = (
                f"--vector-mode async could not start {num_envs} worker processes for {env_id} "
                f"({type(exc).__name__}: {exc}); falling back to --vector-mode sync"
            )
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        else:
            env.warning, env.flattened = None, flattened
            return env
    built = _built(env_id, env_kwargs, lambda: gym.make_vec(env_id, num_envs, vectorization_mode="sync", **kwargs))
    env = GymTorchVecEnv(built, device, "sync")
    env.warning, env.flattened = warning, getattr(built.envs[0], "flattened", None)
    return env


def _built(env_id: str, env_kwargs: dict, build):
    """``build()``, with a constructor's ``TypeError`` (a missing or unknown argument) as an :class:`InputError` that
    names the env, the keyword arguments given and how to give others."""
    try:
        return build()
    except TypeError as exc:
        given = json.dumps(env_kwargs) if env_kwargs else "none"
        raise InputError(
            f"{env_id} could not be built with the keyword arguments {given} ({exc}); pass its constructor's "
            f"arguments with --env-kwargs as a JSON object, e.g. --env-kwargs '{{\"name\": 1.0}}'"
        ) from exc


def fold_moments(mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, x: torch.Tensor) -> None:
    """Fold a batch ``x`` ``(B, *shape)`` into running moments ``mean``/``var`` ``shape`` and ``count``, in place, by
    Chan et al.'s parallel update (Chan, Golub & LeVeque 1979), as CleanRL's running normalisers do; no host sync."""
    n = x.shape[0]
    b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
    delta = b_mean - mean
    tot = count + n
    m2 = var * count + b_var * n + delta.square() * count * n / tot
    mean.copy_(mean + delta * n / tot)
    var.copy_(m2 / tot)
    count.copy_(tot)


class _Wrapper:
    """Passes everything it does not define through to the wrapped env."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name: str):
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def step(self, action):
        """The wrapped env's ``step``, passed through this wrapper's bookkeeping (``_on_step``)."""
        return self._on_step(*self.env.step(action))

    def step_async(self, action) -> None:
        """The wrapped env's ``step_async``; :meth:`step_wait` collects it."""
        self.env.step_async(action)

    def step_wait(self):
        """The wrapped env's ``step_wait``, passed through this wrapper's bookkeeping."""
        return self._on_step(*self.env.step_wait())


class RecordEpisodeStatistics(_Wrapper):
    """Per-env episode sums on the device, like purejaxrl's ``LogWrapper``.

    Each step adds the (raw) reward, 1 to the length and the info entries named in ``info_keys`` (``(num_envs,)``
    tensors; ``EVHub-v0``'s ``co2_kg`` in kg and ``unserved_kwh`` in kWh; absent keys add 0); an episode that ends
    (terminated or truncated) moves its sums into the totals. :meth:`pop` returns the totals as one stacked tensor and
    zeroes them. State in float64: ``ep`` ``(num_envs, 2 + len(info_keys))`` and ``totals`` ``(3 + len(info_keys),)``.
    """

    def __init__(self, env, info_keys: tuple[str, ...] = ("co2_kg", "unserved_kwh")):
        super().__init__(env)
        self.info_keys = tuple(info_keys)
        self.names = ("return", "length", *self.info_keys)
        self.ep = torch.zeros(env.num_envs, len(self.names), dtype=torch.float64, device=env.device)
        self.totals = torch.zeros(1 + len(self.names), dtype=torch.float64, device=env.device)

    def _on_step(self, obs, reward, terminated, truncated, info):
        zero = torch.zeros_like(reward)
        parts = [reward, torch.ones_like(reward)] + [info.get(k, zero) for k in self.info_keys]
        self.ep += torch.stack([p.to(torch.float64) for p in parts], dim=1)
        end = (terminated | truncated).to(torch.float64)
        self.totals[0] += end.sum()
        self.totals[1:] += (self.ep * end[:, None]).sum(0)
        self.ep *= (1.0 - end)[:, None]
        return obs, reward, terminated, truncated, info

    def pop(self) -> torch.Tensor:
        """``[episodes finished, their summed return, length, *info_keys]`` since the last call, float64 on the device
        (read it with one ``.tolist()``); the totals restart at 0."""
        out = self.totals.clone()
        self.totals.zero_()
        return out

    def episode_means(self, totals: list[float]) -> dict[str, float]:
        """Host means per finished episode from a :meth:`pop` read: ``{name: value}`` (NaN where none finished)."""
        n = totals[0]
        return {name: (s / n if n else float("nan")) for name, s in zip(self.names, totals[1:])}

    def state_dict(self) -> dict:
        """The wrapped env's state plus the episode sums (``"episode_stats"``)."""
        inner = self.env.state_dict()
        return {"env": inner, "episode_stats": {"ep": self.ep.clone(), "totals": self.totals.clone()}}

    def load_state_dict(self, state: dict, statistics_only: bool = False) -> None:
        """Restore :meth:`state_dict`; ``statistics_only`` (envs that start new episodes: another ``num_envs``, or a
        gymnasium env) keeps this env's state and open episodes and restores only what passes on to them: the totals
        of the episodes finished since the last :meth:`pop` (not per env)."""
        self.totals.copy_(state["episode_stats"]["totals"])
        if not statistics_only:
            self.env.load_state_dict(state["env"])
            self.ep.copy_(state["episode_stats"]["ep"])
        elif isinstance(self.env, _Wrapper):
            self.env.load_state_dict(state["env"], statistics_only=True)


class NormalizeReward(_Wrapper):
    """Rewards divided by a running std of the discounted return, on the device (CleanRL's ``NormalizeReward``,
    purejaxrl's ``NormalizeVecReward``).

    The per-env discounted return restarts after a terminated step, and also after a truncated one when
    ``reset_on_truncation`` (a gymnasium env, whose truncation is bootstrapped from ``final_obs``); EVHub-v0 runs on
    through its truncations. Running mean/variance by Chan et al.'s parallel update, float64.
    """

    def __init__(self, env, gamma: float, reset_on_truncation: bool, eps: float = 1e-8):
        super().__init__(env)
        self.gamma, self.reset_on_truncation, self.eps = float(gamma), bool(reset_on_truncation), eps
        dev = env.device
        # the statistics as 1-element tensors, not 0-d ones: torch.compile drops in-place updates of 0-d CPU tensors
        # held in a dict (they are taken for constants), and the reward normaliser runs inside the compiled rollout
        self.rn = {
            "ret": torch.zeros(env.num_envs, device=dev, dtype=torch.float64),
            "mean": torch.zeros(1, device=dev, dtype=torch.float64),
            "var": torch.ones(1, device=dev, dtype=torch.float64),
            "count": torch.full((1,), 1e-4, device=dev, dtype=torch.float64),
        }

    def _on_step(self, obs, reward, terminated, truncated, info):
        done = (terminated | truncated) if self.reset_on_truncation else terminated
        rn = self.rn
        ret = rn["ret"] * self.gamma * (1.0 - done.to(torch.float32)) + reward.to(torch.float64)
        rn["ret"].copy_(ret)
        fold_moments(rn["mean"], rn["var"], rn["count"], ret)
        return obs, (reward / torch.sqrt(rn["var"] + self.eps)).to(reward.dtype), terminated, truncated, info

    def state_dict(self) -> dict:
        """The wrapped env's state plus the normaliser's (``"reward_norm"``)."""
        return {"env": self.env.state_dict(), "reward_norm": {k: v.clone() for k, v in self.rn.items()}}

    def load_state_dict(self, state: dict, statistics_only: bool = False) -> None:
        """Restore :meth:`state_dict`; ``statistics_only`` keeps this env's per-env returns (another ``num_envs``,
        or a gymnasium env that starts new episodes) and the wrapped env's state."""
        for key, value in state["reward_norm"].items():
            if not (statistics_only and key == "ret"):
                self.rn[key].copy_(value.reshape(self.rn[key].shape))
        if not statistics_only or isinstance(self.env, _Wrapper):
            self.env.load_state_dict(state["env"], **({"statistics_only": True} if statistics_only else {}))
