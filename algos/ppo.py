"""PPO for ``EVHub-v0`` or any gymnasium env with Box actions (a Gaussian policy) or Discrete actions (a Categorical
policy), flat or image observations (an MLP or a CNN torso), CleanRL style: one file.

The whole rollout stays on the device: the torch-batched env steps ``num_envs`` copies of the site, the
agent samples actions from tensors, rollout storage is preallocated, and episode statistics are summed
on the device; the host reads numbers back only every ``log_every`` iterations.

Hot paths are plain module-level functions -- :func:`policy_step` (observation normalisation + action
selection), :func:`estimate_advantages` (bootstrap value + GAE) and :func:`update_minibatch` (the clipped
surrogate loss and one gradient step on one minibatch) -- bound to the agent once with
:func:`functools.partial`; :func:`update` runs them over ``update_epochs`` epochs of minibatches drawn by a
device-side permutation. ``--compile`` rebinds the bound functions to ``torch.compile`` versions,
``--cudagraphs`` to CUDA-graph replays (:class:`CudaGraphed`, with a capturable optimizer and a device-tensor
learning rate), ``--amp`` runs the network forward passes under bf16 autocast. No host sync inside the loop,
except ``--target-kl``'s early stop (one read per epoch; refused with ``--cudagraphs``).

Run (defaults: ``caltech`` site, ``hub`` actions, a preset sized to the device)::

    python algos/ppo.py
    python algos/ppo.py --site path/to/site.toml --total-timesteps 200000 --seed 2
    python algos/ppo.py --preset gpu --compile --cudagraphs
    tensorboard --logdir outputs/
    python algos/ppo.py --env-id Pendulum-v1 --vector-mode async --num-envs 8 --total-timesteps 200000
    python algos/ppo.py --env-id CartPole-v1 --num-envs 8 --num-steps 128 --total-timesteps 100000
    python algos/ppo.py --env-id Snake-v0

Other environments (``--env-id``: any registered gymnasium id, a user's own too as ``"module:EnvId-v0"``): an id
with a ``vector_entry_point`` that takes a ``device`` (the torch-batched envs of this repo) is built by it on the
device; any other is stepped by gymnasium's ``SyncVectorEnv`` or, with ``--vector-mode async``, ``AsyncVectorEnv``
(one worker process per env, for CPU- or I/O-bound envs; if it cannot start, the run warns and falls back to sync)
with the same-step autoreset of our envs, wrapped in :class:`GymVecEnv` (numpy <-> device tensors, Box actions in
[-1, 1] rescaled to the Box's bounds, Discrete actions sent as int64 indices plus the space's ``start``, truncations
bootstrapped from ``final_obs``). The action space, read once at start-up, is a ``Box`` (Gaussian policy with a
state-independent log-std; the env gets the sampled action clipped to [-1, 1]) or a ``Discrete(n, start)``
(Categorical policy over ``n`` logits; actions are int64 indices ``0..n-1`` in the rollout; a torch-batched env gets
them as they are, so its space must start at 0); any other kind (MultiDiscrete, MultiBinary, Dict, ...) is refused
with a ValueError. Observations must be a Box. The torso is picked from its shape, once:

* flat (1-D, or 0-D / 2-D, flattened to ``(obs_dim,)``): separate actor and critic MLPs (two tanh layers of
  ``hidden_size``), observations standardised by running statistics (``norm_obs``, on by default);
* an image (3-D, ``(C, H, W)``, e.g. ``Snake-v0``'s float32 ``(3, 10, 10)`` boards in [0, 1]): one CNN torso shared
  by actor and critic as in CleanRL's ``ppo_atari.py`` -- ``Conv2d(C, c1, 3, padding=1)-ReLU-Conv2d(c1, c2, 3,
  padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden_size)-ReLU`` with ``(c1, c2) = --cnn-channels`` (the layers of
  ``algos/dqn.py``'s ``QNetwork``), then a policy head (gain 0.01) and a value head (gain 1). ``norm_obs`` is off
  by default for images; turned on, it standardises each pixel with running statistics;
* 4-D or more (stacked frames, ...): refused with a ValueError.

Settings that suit an env better than the EVHub-v0 defaults come from :data:`ENV_DEFAULTS` (``Snake-v0``: gamma
0.99, an entropy bonus, a smaller CNN and sizes that learn on 2 CPU cores); each is overridable by its flag, and
the preset table printed at the start shows them. The EVHub-only parts (site split, socket/weekday feature
selection, KPI episode statistics, ``policy.json``, the evaluation on ``eval_split``) are skipped for other envs,
and their options (:data:`EVHUB_ONLY_ARGS`) are left out of the printed and logged hyperparameters; checkpoint and
``policy.pt2`` are written for every env. Resuming a gymnasium env starts new episodes (its state cannot be saved);
a torch-batched env (EVHub-v0, Snake-v0) resumes exactly where it stopped.

Writes into ``output_dir``: TensorBoard events, ``metrics.parquet`` (the same curves), ``checkpoint.pt``
(model, optimizer, counters, RNG and env state; ``--resume`` continues from it), ``policy.pt2`` (the
deterministic actor as a ``torch.export`` program, load with ``torch.export.load(path).module()``: obs float32
``(B, obs_dim)``, or ``(B, C, H, W)`` for images -> for a Box, the mean action float32 ``(B, act_dim)`` clipped to
[-1, 1] (the env gets it rescaled to its bounds); for a Discrete(n, start), the argmax action int64 ``(B,)`` in
``0..n-1`` (the env gets it plus ``start``)), and the deterministic evaluation over ``eval_split``:
``eval_{split}.parquet`` (one KPI row, controller ``"ppo"``) and ``eval_{split}_traces.parquet`` (hourly traces).

Every log interval also records ``perf/gpu_mem_allocated_gb``, ``perf/gpu_mem_reserved_gb``,
``perf/gpu_mem_peak_gb`` and (where ``pynvml`` imports) ``perf/gpu_util_pct`` on CUDA (:func:`gpu_stats`; NaN on
the CPU), in TensorBoard and ``metrics.parquet``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import importlib.util
import inspect
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import tyro
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/ppo.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet, write_policy_spec

PRESETS = {
    # 2 CPU cores: ~100 envs, a small net, one torch thread; about 2 minutes on the caltech site, evaluation included
    "cpu": {"num_envs": 128, "num_steps": 168, "total_timesteps": 4_000_000, "hidden_size": 64, "num_threads": 1},
    # one GPU: thousands of envs, a wider net
    "gpu": {"num_envs": 2048, "num_steps": 168, "total_timesteps": 50_000_000, "hidden_size": 256, "num_threads": 0},
}
"""Defaults per preset for the fields left at ``None``; any of them can be set on the command line."""

ENV_DEFAULTS = {
    # Snake: rewards of +1 (food) / -1 (death), boards of (3, 10, 10) in [0, 1]; a small CNN on 2 CPU cores. The
    # rewards are left as they are: the return normaliser hurt here (greedy score 0.76 vs 1.41 foods per episode
    # after 500k steps at a learning rate of 2.5e-4). The learning rate stays at the field's 1e-3 (17.8 foods after
    # 500k steps; 2.5e-4, CleanRL's Atari value, learned far slower)
    "Snake-v0": {
        "gamma": 0.99,
        "ent_coef": 0.01,
        "norm_obs": False,
        "norm_reward": False,
        "cnn_channels": (16, 32),
        "num_minibatches": 4,
        "update_epochs": 4,
    },
    # Snake on the cpu preset: about 3 minutes on a free CPU core (2,700 steps/s), a greedy score of ~18 foods
    "Snake-v0/cpu": {"num_envs": 16, "num_steps": 128, "total_timesteps": 500_000, "hidden_size": 128},
    # Snake on one GPU: more envs, CleanRL's Atari widths
    "Snake-v0/gpu": {"num_envs": 256, "num_steps": 128, "total_timesteps": 10_000_000, "hidden_size": 512,
                     "cnn_channels": (32, 64)},
}
"""Per-env defaults for the fields left at ``None`` (by env id, a ``module:`` prefix dropped), with sizes for one
device preset under ``"<env_id>/<preset>"``; applied before :data:`PRESETS`, and anything set on the command line
wins. An env without an entry (EVHub-v0, Pendulum-v1, CartPole-v1, ...) takes the preset and
:data:`FIELD_DEFAULTS`."""

FIELD_DEFAULTS = {
    "gamma": 0.98,
    "num_minibatches": 8,
    "update_epochs": 5,
    "ent_coef": 0.0,
    "norm_reward": True,
    "cnn_channels": (32, 64),
}
"""Values of the fields left at ``None`` that neither :data:`ENV_DEFAULTS` nor the preset set (the EVHub-v0 values;
``norm_obs`` left at None is decided by the observations: on for flat ones, off for images)."""

EVHUB_ONLY_ARGS = (
    "site", "action_mode", "bess_action", "socket_features", "weekday_features", "eval_split", "eval_every"
)  # fmt: skip
"""Arguments that only EVHub-v0 reads: left out of the printed and logged hyperparameters of other envs."""


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the default output folder)"""
    seed: int = 1
    """seed of the experiment (Python, NumPy, torch and the env's window draws)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    deterministic_algorithms: bool = False
    """bitwise-reproducible CUDA runs (slower): `torch.use_deterministic_algorithms(True)` and
    `CUBLAS_WORKSPACE_CONFIG=:4096:8`; an op without a deterministic CUDA kernel then stops the run with PyTorch's
    error. CPU runs repeat exactly without it"""
    cuda: bool = True
    """if toggled, use CUDA when it is available (agent and env on the same device)"""
    preset: Literal["auto", "cpu", "gpu"] = "auto"
    """size preset for the fields left at None: 'auto' picks 'gpu' on CUDA and 'cpu' otherwise"""
    num_threads: int | None = None
    """torch intra-op CPU threads, 0 keeps torch's default (None: preset, 1 on cpu: the tensors of a few hundred
    envs are too small to gain from more, and spinning threads cost a lot on a busy machine; 0 on gpu)"""
    env_id: str = "EVHub-v0"
    """the id of the environment: any registered gymnasium id with a Box action space (Gaussian policy, e.g.
    Pendulum-v1) or a Discrete one (Categorical policy, e.g. CartPole-v1) and flat (MLP) or image (C, H, W) (CNN,
    e.g. Snake-v0) Box observations, a user's own too as 'module:EnvId-v0'; the site options below apply to
    EVHub-v0 only"""
    vector_mode: Literal["sync", "async"] = "sync"
    """how a gymnasium env without a vector entry point is vectorised: 'sync' (SyncVectorEnv, one process) or
    'async' (AsyncVectorEnv, one worker process per env, for CPU- or I/O-bound envs; falls back to sync with a
    warning if the workers cannot start); ignored for the torch-batched envs (EVHub-v0, Snake-v0)"""
    site: str = "caltech"
    """site to train on (EVHub-v0 only): a shipped site name or a path to a site TOML file"""
    action_mode: str = "hub"
    """'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket); EVHub-v0 only"""
    bess_action: Literal["surplus", "setpoint"] = "surplus"
    """meaning of the BESS action (EVHub-v0 only): 'surplus' (the PV surplus is always stored; -1 = cover the
    deficit, the self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess
    times the BESS power limit)"""
    total_timesteps: int | None = None
    """total env steps of the experiment (None: preset, 4,000,000 on cpu, 50,000,000 on gpu; Snake-v0: 500,000 on
    cpu, 10,000,000 on gpu)"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    num_envs: int | None = None
    """the number of parallel env copies (None: preset, 128 on cpu, 2048 on gpu; Snake-v0: 16 on cpu, 256 on gpu)"""
    num_steps: int | None = None
    """the number of steps per env in each rollout (None: preset, 168 = one episode; 128 on Snake-v0)"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear to zero over the run)"""
    gamma: float | None = None
    """the discount factor gamma (None: 0.98, a horizon of about two days of hourly steps; 0.99 on Snake-v0)"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int | None = None
    """the number of mini-batches per epoch (None: 8; 4 on Snake-v0)"""
    update_epochs: int | None = None
    """the K epochs to update the policy (None: 5; 4 on Snake-v0)"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float | None = None
    """coefficient of the entropy (None: 0.0; 0.01 on Snake-v0)"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold (early stop of the epochs; one host sync per epoch, so not with
    --cudagraphs)"""
    hidden_size: int | None = None
    """width of the two hidden layers of actor and critic, or of the CNN torso's linear layer for image observations
    (None: preset, 64 on cpu, 256 on gpu; Snake-v0: 128 on cpu, 512 on gpu)"""
    cnn_channels: tuple[int, int] | None = None
    """output channels (C1 C2) of the two 3x3 convolutions of the CNN torso, used for image observations (C, H, W)
    only (None: 32 64; 16 32 on Snake-v0 with the cpu preset)"""
    init_logstd: float = -0.5
    """initial log standard deviation of the Gaussian policy (state-independent, learned); Box actions only"""
    socket_features: bool = True
    """feed the per-socket observations to the networks (False: only the site-level features before them);
    EVHub-v0 only"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the networks (EVHub-v0 only; off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    norm_obs: bool | None = None
    """standardise observations with running statistics kept in the agent (CleanRL's NormalizeObservation; per pixel
    for images) (None: on for flat observations, off for images such as Snake-v0's, already in [0, 1])"""
    norm_reward: bool | None = None
    """scale rewards by a running std of the discounted return (CleanRL's NormalizeReward, on device) (None: on;
    off on Snake-v0, whose rewards are already +-1)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal: EVHub-v0 (the site never terminates) bootstraps through
    the autoreset into the next window, a gymnasium env adds gamma * V(final_obs) to the truncated step's reward;
    False treats it as terminal like CleanRL"""
    compile: bool = False
    """torch.compile the hot functions (action selection, bootstrap + GAE, the minibatch update)"""
    cudagraphs: bool = False
    """capture action selection, GAE and the minibatch update in CUDA graphs (capturable optimizer, device-tensor
    LR); needs CUDA, equal minibatches and no --target-kl"""
    amp: bool = False
    """bf16 autocast of the network forward passes (CUDA or CPU)"""
    log_every: int = 1
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed} for EVHub-v0,
    outputs/runs/{exp_name}_{env_id}_seed{seed} otherwise)"""
    checkpoint_every: int = 25
    """iterations between checkpoints (0: only at the end)"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (model, optimizer, counters, RNG and env state)"""
    eval_split: str = "test"
    """split for the final deterministic evaluation ('none' skips it); EVHub-v0 only (other envs: a note)"""
    eval_every: int = 0
    """iterations between deterministic evaluations on eval_split during training (0: only the final one;
    EVHub-v0 only); each
    is logged as eval/co2_kg etc. and added to eval_curve.parquet with the training wall time so far, which
    leaves the evaluations out"""
    max_oom_retries: int = 3
    """halvings of num_envs allowed after CUDA out-of-memory errors: each one rebuilds the envs and the rollout
    storage with half as many envs (the batch halves, and so does each of the num_minibatches minibatches), warns
    and trains on to total_timesteps; one more error stops the run with OutOfMemoryBackoffError, its last checkpoint
    kept (0: stop at the first)"""

    # filled in at runtime
    batch_size: int = 0
    """the batch size (computed in runtime: num_envs * num_steps)"""
    minibatch_size: int = 0
    """the mini-batch size (computed in runtime: batch_size // num_minibatches)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime: total_timesteps // batch_size)"""


OBS_WEEKDAY = (2, 3)
"""Indices of the day-of-week features (sin, cos) in EVHub-v0's observation."""

LOSS_NAMES = ("value_loss", "policy_loss", "entropy", "grad_norm")
"""Quantities checked for finiteness after each update, in the order of the update's ``bad`` flags."""


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class NonFiniteLossError(RuntimeError):
    """A loss (or the gradient norm) became NaN or infinite; training stops, the last checkpoint is kept."""


class OutOfMemoryBackoffError(RuntimeError):
    """CUDA ran out of memory and halving num_envs cannot go on (``max_oom_retries`` halvings made, or nothing left
    to halve); training stops, the last checkpoint is kept."""


# ---------------------------------------------------------------------------------------------- environments
EVHUB_ID = "EVHub-v0"
"""The site env: the only one with a site, splits, KPIs and ``policy.json``."""

EVHUB_KWARGS = ("site", "split", "action_mode", "bess_action")
"""Keyword arguments of ``gym.make_vec`` that only ``EVHub-v0`` takes."""


class GymVecEnv:
    """Gives a gymnasium vector env of a plain gymnasium env the tensor interface of the torch-batched envs.

    ``env`` is a ``SyncVectorEnv`` or ``AsyncVectorEnv`` with ``AutoresetMode.SAME_STEP`` (the observation returned
    at an episode end already begins the next episode, as in ``EVHub-v0``), usually wrapped in
    ``gymnasium.wrappers.vector.RecordEpisodeStatistics``. Observations become float32 tensors on ``device``:
    ``(num_envs, C, H, W)`` for an image space (3-D), else ``(num_envs, obs_dim)`` (flattened). Actions, by the
    action space (read once, here): for a ``Box``, float tensors ``(num_envs, act_dim)`` in [-1, 1], rescaled
    affinely to the Box's ``[low, high]`` where both bounds are finite (else passed as they are) and handed to the
    env as numpy arrays of the space's dtype; for a ``Discrete(n, start)``, int64 tensors ``(num_envs,)`` of indices
    in ``0..n-1``, handed to the env as a numpy int64 array ``(num_envs,)`` plus ``start`` (no rescaling). Rewards
    float32 ``(num_envs,)``; terminated/truncated bool ``(num_envs,)``. ``step``'s info is ``{"final_obs": float32
    tensor of the observations' shape (the last observation of each episode that ended, the returned observation
    elsewhere), "any_truncated": bool, "env_info": the env's own info dict}``. There is no ``state_dict``: the envs
    cannot be checkpointed.

    Raises:
        ValueError: the action space is neither a Box nor a Discrete, or the observation space is not a Box or has
            4 dimensions or more (see :func:`check_spaces`).
    """

    def __init__(self, env: gym.vector.VectorEnv, device: torch.device, env_id: str):
        check_spaces(env_id, env.single_observation_space, env.single_action_space)
        self.env = env
        self._obs_shape = torso_shape(env.single_observation_space.shape)  # one env's observation as the agent takes it
        self.device = device
        self.num_envs = int(env.num_envs)
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        space = env.single_action_space
        self.discrete = isinstance(space, gym.spaces.Discrete)
        if self.discrete:  # indices 0..n-1 -> start..start+n-1
            self._start = np.int64(space.start)
        else:  # [-1, 1] -> [low, high]
            self._act_shape = space.shape
            self._act_dtype = space.dtype
            low, high = np.asarray(space.low, np.float64).reshape(-1), np.asarray(space.high, np.float64).reshape(-1)
            finite = np.isfinite(low) & np.isfinite(high)
            self._low, self._high = low, high
            self._mid = np.where(finite, (high + low) / 2.0, 0.0)
            self._half = np.where(finite, (high - low) / 2.0, 1.0)
            self._finite = finite

    def _obs(self, obs) -> torch.Tensor:
        """numpy ``(num_envs, *space shape)`` -> float32 ``(num_envs, C, H, W)`` (an image) or ``(num_envs, obs_dim)``
        tensor on the device."""
        flat = np.asarray(obs, dtype=np.float32).reshape(self.num_envs, *self._obs_shape)
        return torch.as_tensor(flat).to(self.device)

    def action_to_env(self, action: torch.Tensor) -> np.ndarray:
        """Box: actions float ``(num_envs, act_dim)`` in [-1, 1] -> numpy ``(num_envs, *act_shape)`` of the Box's
        dtype, in ``[low, high]`` (dimensions with an infinite bound are passed unscaled). Discrete: indices int64
        ``(num_envs,)`` in ``0..n-1`` -> numpy int64 ``(num_envs,)``, plus the space's ``start``."""
        if self.discrete:
            return action.detach().to("cpu", torch.int64).numpy().reshape(self.num_envs) + self._start
        a = action.detach().to("cpu", torch.float64).numpy().reshape(self.num_envs, -1)
        a = self._mid + self._half * a
        a = np.where(self._finite, np.clip(a, self._low, self._high), a)
        return a.reshape(self.num_envs, *self._act_shape).astype(self._act_dtype)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every env (env ``i`` seeded with ``seed + i``); returns ``(obs (num_envs, *obs_shape), info)``."""
        obs, info = self.env.reset(seed=seed)
        return self._obs(obs), info

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """One step of every env with ``action`` (Box: float ``(num_envs, act_dim)`` in [-1, 1]; Discrete: int64
        ``(num_envs,)`` indices); see the class docstring."""
        obs, reward, terminated, truncated, info = self.env.step(self.action_to_env(action))
        next_obs = self._obs(obs)
        final_obs = next_obs
        ended = info.get("_final_obs")
        if ended is not None and np.any(ended):
            flat = np.asarray(obs, dtype=np.float32).reshape(self.num_envs, *self._obs_shape).copy()
            for i in np.flatnonzero(ended):
                flat[i] = np.asarray(info["final_obs"][i], dtype=np.float32).reshape(self._obs_shape)
            final_obs = torch.as_tensor(flat).to(self.device)
        truncated = np.asarray(truncated, dtype=bool)
        return (
            next_obs,
            torch.as_tensor(np.asarray(reward, dtype=np.float32)).to(self.device),
            torch.as_tensor(np.asarray(terminated, dtype=bool)).to(self.device),
            torch.as_tensor(truncated).to(self.device),
            {"final_obs": final_obs, "any_truncated": bool(truncated.any()), "env_info": info},
        )

    def close(self) -> None:
        """Close the vector env (ends the worker processes of an AsyncVectorEnv)."""
        self.env.close()


def check_spaces(env_id: str, obs_space: gym.Space, act_space: gym.Space) -> None:
    """Check that PPO can drive an env with these single-env spaces.

    Raises:
        ValueError: the action space is neither a ``Box`` (Gaussian policy) nor a ``Discrete`` (Categorical policy),
            e.g. a MultiDiscrete, MultiBinary or Dict; or the observation space is not a ``Box``, or has 4 dimensions
            or more (flat ones go to the MLP, images ``(C, H, W)`` to the CNN torso); each names the env id, the space
            and what is supported.
    """
    if not isinstance(act_space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise ValueError(
            f"PPO supports a Box (continuous, Gaussian policy) or a Discrete (Categorical policy) action space, but "
            f"{env_id} has {act_space}; algos/sac.py (Box) and algos/dqn.py (Discrete) take no other kind either: "
            f"wrap the env to expose a single Box or Discrete action space"
        )
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(
            f"PPO needs a Box observation space (flat, or flattened to (obs_dim,)), but {env_id} has {obs_space}"
        )
    if len(obs_space.shape) > 3:
        raise ValueError(
            f"PPO takes flat Box observations (an MLP) or images (C, H, W) (a CNN torso), but {env_id} has "
            f"{len(obs_space.shape)}-D observations {obs_space}; wrap the env to give (C, H, W) images (e.g. stacked "
            f"frames merged into the channels) or flat vectors"
        )


def torso_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One env's observation as the agent takes it, from the shape of a Box checked by :func:`check_spaces`: an image
    ``(C, H, W)`` as it is (the CNN torso), anything else flattened to ``(obs_dim,)`` (the MLP)."""
    shape = tuple(int(x) for x in shape)
    return shape if len(shape) == 3 else (int(np.prod(shape)),)


def action_head(space: gym.Space) -> tuple[bool, int]:
    """``(discrete, act_dim)`` of a single-env action space checked by :func:`check_spaces`: ``(True, n)`` for a
    ``Discrete(n)`` (a Categorical over ``n`` logits), ``(False, prod(shape))`` for a ``Box`` (a Gaussian)."""
    if isinstance(space, gym.spaces.Discrete):
        return True, int(space.n)
    return False, int(np.prod(space.shape))


def is_torch_batched(env_id: str) -> bool:
    """True where ``env_id``'s gymnasium spec has a ``vector_entry_point`` whose constructor takes a ``device``
    argument: the torch-batched envs of this repo (and a user's own built the same way). Gymnasium's own numpy
    vector envs (e.g. ``CartPole-v1``'s) have a vector entry point without one; they are stepped as gymnasium
    envs (``--vector-mode``).

    Raises:
        gymnasium.error.Error: the id is not registered (or its ``module:`` part cannot be imported).
    """
    entry_point = gym.spec(env_id).vector_entry_point
    if entry_point is None:
        return False
    creator = entry_point if callable(entry_point) else gym.envs.registration.load_env_creator(entry_point)
    try:
        return "device" in inspect.signature(creator).parameters
    except (TypeError, ValueError):  # no signature to read: trust the vector entry point
        return True


def make_gym_vector_env(env_id: str, num_envs: int, mode: str) -> tuple[gym.vector.VectorEnv, str | None]:
    """``gym.make_vec`` of a plain gymnasium env with same-step autoreset, wrapped in ``RecordEpisodeStatistics``.

    ``mode`` is ``"sync"`` or ``"async"``; if the async workers fail to start (no fork, an env factory that cannot
    be pickled, ...), the env is built with ``"sync"`` instead. Returns ``(env, warning)``: the warning text of a
    fallback, else None.
    """
    kwargs = {"vector_kwargs": {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}}
    warning = None
    if mode == "async":
        try:
            env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="async", **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure to start the workers falls back to sync
            warning = (
                f"--vector-mode async could not start {num_envs} worker processes for {env_id} "
                f"({type(exc).__name__}: {exc}); falling back to --vector-mode sync"
            )
        else:
            return gym.wrappers.vector.RecordEpisodeStatistics(env), None
    env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync", **kwargs)
    return gym.wrappers.vector.RecordEpisodeStatistics(env), warning


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory and utilisation of ``device`` for the log: TensorBoard tag -> value.

    Keys: ``perf/gpu_mem_allocated_gb``, ``perf/gpu_mem_reserved_gb``, ``perf/gpu_mem_peak_gb`` (GB = 1e9 bytes;
    ``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated``: host-side counters of the
    caching allocator, no GPU sync) and ``perf/gpu_util_pct`` (percent of the last sample period with a kernel
    running, via NVML: NaN unless ``pynvml`` (nvidia-ml-py) imports). Every value is NaN on a non-CUDA device.
    Never raises: a failed reading is NaN.
    """
    stats = {key: math.nan for key in GPU_STAT_KEYS}
    if device.type != "cuda":
        return stats
    try:
        stats["perf/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        stats["perf/gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        stats["perf/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring must not stop training
        pass
    if _HAVE_PYNVML:
        try:
            stats["perf/gpu_util_pct"] = float(torch.cuda.utilization(device))
        except Exception:  # noqa: BLE001
            pass
    return stats


GPU_STAT_KEYS = ("perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct")
"""The TensorBoard tags of :func:`gpu_stats`; ``metrics.parquet`` has them as columns without ``perf/``."""

_HAVE_PYNVML = importlib.util.find_spec("pynvml") is not None


def env_defaults(env_id: str, preset: str) -> dict:
    """The :data:`ENV_DEFAULTS` of ``env_id`` (a ``module:`` prefix dropped; ``{}`` for an env without an entry) with
    its ``"<env_id>/<preset>"`` sizes on top."""
    name = env_id.split(":")[-1]
    return {**ENV_DEFAULTS.get(name, {}), **ENV_DEFAULTS.get(f"{name}/{preset}", {})}


def presets_table(chosen: str, args: Args | None = None) -> str:
    """The PRESETS table as Markdown: one row per field, one column per preset, and the value in use when ``args``
    (resolved) is given; the ``chosen`` preset's column is marked with ``*``. When ``args.env_id`` has
    :data:`ENV_DEFAULTS`, a column named after the env holds them (for the ``chosen`` preset), with a row for each
    field they set."""
    names = list(PRESETS)
    env = env_defaults(args.env_id, chosen) if args is not None else {}
    keys = list(dict.fromkeys([k for p in PRESETS.values() for k in p] + list(env)))
    head = ["field"] + [f"{n}*" if n == chosen else n for n in names]
    head += ([args.env_id.split(":")[-1]] if env else []) + (["used"] if args is not None else [])
    lines = ["|" + "|".join(head) + "|", "|" + "|".join("-" for _ in head) + "|"]
    for key in keys:
        row = [key] + [str(PRESETS[n].get(key, "")) for n in names]
        if env:
            row.append(str(env.get(key, "")))
        if args is not None:
            row.append(str(getattr(args, key)))
        lines.append("|" + "|".join(row) + "|")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- agent
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights with gain ``std`` and constant bias, in place (CleanRL's PPO init); returns ``layer``."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningObsNorm(nn.Module):
    """Running mean/variance of the observations (CleanRL's NormalizeObservation, as buffers on the device).

    ``forward`` standardises and clips to ``[-clip, clip]``; :meth:`update` folds a batch into the statistics
    in place (no host sync). Being part of the agent, it travels with the checkpoint and the exported policy.
    ``dim`` is the shape of one observation: ``obs_dim`` (flat) or ``(C, H, W)`` (an image: one mean and variance
    per pixel).
    """

    def __init__(self, dim: int | tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.full((), 1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``x`` float32 ``(B, *dim)`` into the running mean/variance (Chan et al.'s parallel update)."""
        n = x.shape[0]
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
        delta = b_mean - self.mean
        tot = self.count + n
        m2 = self.var * self.count + b_var * n + delta.square() * self.count * n / tot
        self.mean.copy_(self.mean + delta * n / tot)
        self.var.copy_(m2 / tot)
        self.count.copy_(tot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standardised and clipped ``x``: float32 ``(B, *dim)`` -> ``(B, *dim)``."""
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)


class Select(nn.Module):
    """Keeps the observation features listed in ``keep`` (the networks' inputs)."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, obs_dim)`` -> ``(B, len(keep))``."""
        return x.index_select(-1, self.keep)


class Agent(nn.Module):
    """Actor and critic with the torso of the observations and the policy head of the action space.

    Flat observations (``obs_shape`` None or 1-D, float32 ``(B, obs_dim)``): separate actor and critic MLPs (two
    tanh layers of ``hidden`` units each; ``network`` is the identity). Image observations (``obs_shape`` 3-D
    ``(C, H, W)``, float32 ``(B, C, H, W)``): one CNN torso ``network`` shared by actor and critic (CleanRL's
    ``ppo_atari.py``): ``Conv2d(C, c1, 3, padding=1)-ReLU-Conv2d(c1, c2, 3, padding=1)-ReLU-Flatten-Linear(c2 * H * W,
    hidden)-ReLU`` with ``(c1, c2) = cnn_channels`` (the padding keeps the board size, so every cell stays in place up
    to the linear layer), then one linear layer per head; ``inputs`` does not apply to images.

    Box actions (``discrete=False``): a Gaussian actor, ``actor_mean`` (a tanh-free mean, width ``act_dim``) and a
    state-independent ``actor_logstd``. Discrete actions (``discrete=True``): a Categorical actor, ``actor`` (the
    logits, width ``act_dim`` = the number of actions ``n``). Both heads end in a layer with orthogonal init of gain
    0.01, the critic in one of gain 1, the other layers have gain sqrt(2). ``discrete`` and the torso are fixed at
    construction: the methods branch on Python values, never on a tensor.

    ``obs_norm`` (running standardisation, or identity) maps raw env observations to the network inputs;
    the rollout stores normalised observations, so the PPO update works on those.

    Raises:
        ValueError: ``obs_shape`` has neither 1 nor 3 dimensions, or ``cnn_channels`` is not two positive ints.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: int,
        init_logstd: float = 0.0,
        norm_obs: bool = True,
        inputs: list[int] | None = None,
        discrete: bool = False,
        obs_shape: tuple[int, ...] | None = None,
        cnn_channels: tuple[int, int] = (32, 64),
    ):
        super().__init__()
        self.discrete = bool(discrete)
        obs_shape = (int(obs_dim),) if obs_shape is None else tuple(int(x) for x in obs_shape)
        if len(obs_shape) not in (1, 3):
            raise ValueError(f"Agent takes flat (obs_dim,) or image (C, H, W) observations, got shape {obs_shape}")
        self.image = len(obs_shape) == 3
        if self.image:
            c, h, w = obs_shape
            channels = tuple(int(x) for x in cnn_channels)
            if len(channels) != 2 or min(channels) < 1:
                raise ValueError(f"cnn_channels must be two positive channel counts (C1 C2), got {cnn_channels}")
            c1, c2 = channels
            self.obs_norm = RunningObsNorm(obs_shape) if norm_obs else nn.Identity()
            self.network = nn.Sequential(
                layer_init(nn.Conv2d(c, c1, 3, padding=1)),
                nn.ReLU(),
                layer_init(nn.Conv2d(c1, c2, 3, padding=1)),
                nn.ReLU(),
                nn.Flatten(),
                layer_init(nn.Linear(c2 * h * w, hidden)),
                nn.ReLU(),
            )
            actor = layer_init(nn.Linear(hidden, act_dim), std=0.01)
            self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)
        else:
            inputs = list(range(obs_dim)) if inputs is None else list(inputs)
            n_in = len(inputs)
            self.obs_norm = RunningObsNorm(obs_dim) if norm_obs else nn.Identity()
            self.network = nn.Identity()
            self.critic = nn.Sequential(
                Select(inputs) if n_in < obs_dim else nn.Identity(),
                layer_init(nn.Linear(n_in, hidden)),
                nn.Tanh(),
                layer_init(nn.Linear(hidden, hidden)),
                nn.Tanh(),
                layer_init(nn.Linear(hidden, 1), std=1.0),
            )
            actor = nn.Sequential(
                Select(inputs) if n_in < obs_dim else nn.Identity(),
                layer_init(nn.Linear(n_in, hidden)),
                nn.Tanh(),
                layer_init(nn.Linear(hidden, hidden)),
                nn.Tanh(),
                layer_init(nn.Linear(hidden, act_dim), std=0.01),
            )
        if self.discrete:
            self.actor = actor  # logits of the Categorical
        else:
            self.actor_mean = actor
            self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_logstd)))

    @property
    def policy_head(self) -> nn.Module:
        """Normalised observations -> logits (Discrete) or Gaussian mean (Box): the actor network ``actor`` /
        ``actor_mean`` itself for flat observations, ``Sequential(network, actor)`` (the shared CNN torso, then the
        head; the same weights) for images."""
        head = self.actor if self.discrete else self.actor_mean
        return nn.Sequential(self.network, head) if self.image else head

    def get_value(self, x: torch.Tensor, amp: bool = False) -> torch.Tensor:
        """Value float32 ``(B,)`` at normalised observations ``x`` float32 ``(B, obs_dim)`` or ``(B, C, H, W)``;
        ``amp``: bf16 forward."""
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            value = self.critic(self.network(x))
        return value.float().squeeze(-1)

    def dist_and_value(self, x: torch.Tensor, amp: bool = False) -> tuple[Normal | Categorical, torch.Tensor]:
        """Policy distribution and value float32 ``(B,)`` at normalised observations ``x`` float32 ``(B, obs_dim)``
        or ``(B, C, H, W)`` (one pass through the shared CNN torso for images); ``amp``: bf16 forward passes. The
        distribution is a ``Normal`` of batch shape ``(B, act_dim)`` (Box) or a ``Categorical`` of batch shape
        ``(B,)`` over float32 logits ``(B, n)`` (Discrete); neither validates its arguments (a host sync)."""
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            hidden = self.network(x)
            head = (self.actor if self.discrete else self.actor_mean)(hidden)
            value = self.critic(hidden)
        if self.discrete:
            return Categorical(logits=head.float(), validate_args=False), value.float().squeeze(-1)
        mean = head.float()
        std = torch.exp(self.actor_logstd.expand_as(mean))
        return Normal(mean, std, validate_args=False), value.float().squeeze(-1)  # validation would sync


class DeterministicActor(nn.Module):
    """The deterministic policy: raw obs float32 ``(B, obs_dim)`` (flat) or ``(B, C, H, W)`` (images) -> for a Box,
    the mean action float32 ``(B, act_dim)`` clipped to [-1, 1]; for a Discrete (``discrete=True``, ``head`` gives
    the logits), the argmax action int64 ``(B,)`` in ``0..n-1`` (the env receives it plus the space's ``start``).
    ``head`` is :attr:`Agent.policy_head` (for images: the CNN torso and the head).

    Observation normalisation (frozen statistics) is part of it, so callers pass the env's observations as is.
    """

    def __init__(self, obs_norm: nn.Module, head: nn.Module, discrete: bool = False):
        super().__init__()
        self.discrete = bool(discrete)
        self.obs_norm = obs_norm
        if self.discrete:
            self.actor = head
        else:
            self.actor_mean = head

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Raw observations float32 ``(B, obs_dim)`` or ``(B, C, H, W)`` -> actions float32 ``(B, act_dim)`` in
        [-1, 1] (Box) or int64 ``(B,)`` in ``0..n-1`` (Discrete)."""
        if self.discrete:
            return self.actor(self.obs_norm(obs)).argmax(-1)
        return self.actor_mean(self.obs_norm(obs)).clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------- state
def make_storage(
    num_steps: int,
    num_envs: int,
    obs_dim: int | tuple[int, ...],
    act_dim: int,
    device: torch.device,
    discrete: bool = False,
) -> dict:
    """Preallocated rollout storage on ``device``: ``(num_steps, num_envs, ...)`` tensors, float32 but for the
    actions: observations ``(num_steps, num_envs, obs_dim)``, or ``(num_steps, num_envs, C, H, W)`` when ``obs_dim``
    is an image shape ``(C, H, W)``; actions float32 ``(num_steps, num_envs, act_dim)`` for a Box, int64
    ``(num_steps, num_envs)`` for a Discrete (``act_dim``, the number of actions, is then unused)."""
    z = lambda *s: torch.zeros(num_steps, num_envs, *s, device=device)  # noqa: E731
    obs_shape = (int(obs_dim),) if isinstance(obs_dim, (int, np.integer)) else tuple(obs_dim)
    return {
        "obs": z(*obs_shape),
        "actions": torch.zeros(num_steps, num_envs, dtype=torch.int64, device=device) if discrete else z(act_dim),
        "logprobs": z(),
        "rewards": z(),
        "dones": z(),
        "values": z(),
    }


def make_episode_stats(num_envs: int, device: torch.device) -> dict:
    """Per-env running sums of the current episode and device sums over the episodes finished since the last log."""
    z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float64)  # noqa: E731
    return {
        "ep_return": z(num_envs),
        "ep_co2_kg": z(num_envs),
        "ep_unserved_kwh": z(num_envs),
        "ep_length": z(num_envs),
        "n_done": z(()),
        "sum_return": z(()),
        "sum_co2_kg": z(()),
        "sum_unserved_kwh": z(()),
        "sum_length": z(()),
    }


def make_reward_norm(num_envs: int, device: torch.device) -> dict:
    """State of the running return normaliser: per-env discounted return and its running mean/var/count."""
    return {
        "ret": torch.zeros(num_envs, device=device, dtype=torch.float64),
        "mean": torch.zeros((), device=device, dtype=torch.float64),
        "var": torch.ones((), device=device, dtype=torch.float64),
        "count": torch.full((), 1e-4, device=device, dtype=torch.float64),
    }


def normalize_reward(rn: dict, reward: torch.Tensor, done: torch.Tensor, gamma: float, eps: float = 1e-8) -> torch.Tensor:
    """Update the running variance of the discounted return (in place) and return ``reward / std``."""
    ret = rn["ret"] * gamma * (1.0 - done) + reward.to(torch.float64)
    rn["ret"].copy_(ret)
    n = ret.numel()
    b_mean, b_var = ret.mean(), ret.var(unbiased=False)
    delta = b_mean - rn["mean"]
    tot = rn["count"] + n
    m2 = rn["var"] * rn["count"] + b_var * n + delta.square() * rn["count"] * n / tot
    rn["mean"].copy_(rn["mean"] + delta * n / tot)
    rn["var"].copy_(m2 / tot)
    rn["count"].copy_(tot)
    return (reward / torch.sqrt(rn["var"] + eps)).to(reward.dtype)


# ---------------------------------------------------------------------------------------------- pure pieces
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    next_done: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a rollout.

    Args:
        rewards, values, dones: float32 ``(num_steps, num_envs)``; ``dones[t]`` is 1 where the observation of step
            ``t`` began a new episode after a terminal step (so step ``t-1`` must not bootstrap from it).
        next_value, next_done: float32 ``(num_envs,)`` value and done flag of the observation after the last step.

    Returns:
        ``(advantages, returns)``, each float32 ``(num_steps, num_envs)``; ``returns = advantages + values``.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def explained_variance(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - Var[y - y_pred] / Var[y]`` of float ``(B,)`` tensors as a device scalar (NaN where ``Var[y] == 0``)."""
    var_y = y.var()
    ev = 1.0 - (y - y_pred).var() / var_y
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), ev)


# ---------------------------------------------------------------------------------------------- hot paths
def policy_step(
    agent: Agent, obs: torch.Tensor, amp: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold raw ``obs`` float32 ``(B, *obs_shape)`` (``(B, obs_dim)`` or ``(B, C, H, W)``) into the running
    normaliser, normalise, sample an action; no host sync.

    Returns:
        ``(obs_normalised (B, *obs_shape), action, logprob (B,), value (B,))``, float32 but for a Discrete action.
        The action is float32 ``(B, act_dim)`` for a Box, unclipped (the env gets it clipped), or int64 ``(B,)`` in
        ``0..n-1`` for a Discrete.
    """
    with torch.no_grad():
        if isinstance(agent.obs_norm, RunningObsNorm):
            agent.obs_norm.update(obs)
        obs_n = agent.obs_norm(obs)
        dist, value = agent.dist_and_value(obs_n, amp)
        if agent.discrete:
            # the Gumbel-max draw of Categorical.sample() (argmax of probs / Exp(1) noise) without its host-side
            # check of the probabilities (a sync, and no CUDA-graph capture); on the CPU both draw the same numbers
            probs = dist.probs
            action = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
            return obs_n, action, dist.log_prob(action), value
        # mean + std * noise rather than dist.sample(): torch.normal checks std >= 0 on the host (a sync, and no
        # CUDA-graph capture); on the CPU both draw the same numbers
        action = dist.loc + dist.scale * torch.randn_like(dist.loc)
        return obs_n, action, dist.log_prob(action).sum(1), value


def bootstrap_value(agent: Agent, obs: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Value float32 ``(B,)`` of raw observations ``obs`` float32 ``(B, *obs_shape)`` (normalised with the running
    statistics, which it does not update); no host sync. Used for the ``final_obs`` of truncated episodes."""
    with torch.no_grad():
        return agent.get_value(agent.obs_norm(obs), amp)


def estimate_advantages(
    agent: Agent,
    next_obs: torch.Tensor,
    next_done: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
    amp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bootstrap value of the raw ``next_obs`` float32 ``(num_envs, *obs_shape)``, then :func:`compute_gae`; no host
    sync.

    Returns:
        ``(advantages, returns)``, each float32 ``(num_steps, num_envs)``.
    """
    with torch.no_grad():
        next_value = agent.get_value(agent.obs_norm(next_obs), amp)
        return compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda)


def update_minibatch(
    agent: Agent,
    optimizer: torch.optim.Optimizer,
    obs: torch.Tensor,
    actions: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    *,
    clip_coef: float,
    norm_adv: bool,
    clip_vloss: bool,
    ent_coef: float,
    vf_coef: float,
    max_grad_norm: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """PPO's clipped-surrogate loss and one gradient step on one minibatch; no host sync.

    Args:
        obs: normalised observations float32 ``(M, *obs_shape)``; actions: as sampled, float32 ``(M, act_dim)``
            (Box) or int64 ``(M,)`` (Discrete); logprobs, advantages, returns, values: float32 ``(M,)`` from the
            rollout and GAE.

    Returns:
        float32 device scalars ``value_loss, policy_loss, entropy, old_approx_kl, approx_kl, clipfrac`` and
        ``bad``: a bool ``(len(LOSS_NAMES),)`` tensor, True where that quantity (or the gradient norm) is non-finite.
    """
    dist, newvalue = agent.dist_and_value(obs, amp)
    if agent.discrete:
        newlogprob, entropy = dist.log_prob(actions), dist.entropy()
    else:
        newlogprob = dist.log_prob(actions).sum(1)
        entropy = dist.entropy().sum(1)
    logratio = newlogprob - logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()

    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    if clip_vloss:
        v_loss_unclipped = (newvalue - returns) ** 2
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        out = torch.stack([v_loss, pg_loss, entropy_loss, grad_norm]).detach()
        return {
            "value_loss": out[0],
            "policy_loss": out[1],
            "entropy": out[2],
            "old_approx_kl": old_approx_kl,
            "approx_kl": approx_kl,
            "clipfrac": clipfrac,
            "bad": ~torch.isfinite(out),
        }


def update(
    learn,
    b_obs: torch.Tensor,
    b_actions: torch.Tensor,
    b_logprobs: torch.Tensor,
    b_advantages: torch.Tensor,
    b_returns: torch.Tensor,
    b_values: torch.Tensor,
    *,
    update_epochs: int,
    minibatch_size: int,
    target_kl: float | None = None,
) -> dict[str, torch.Tensor]:
    """PPO's update over the flattened batch: ``update_epochs`` epochs of minibatches, one ``learn`` step each.

    ``learn`` is :func:`update_minibatch` bound to the agent and optimizer (or its compiled / CUDA-graphed
    version). Each epoch draws a permutation of the batch on the device; the batch is cut into minibatches of
    ``minibatch_size`` rows (the last one shorter when the size does not divide the batch). No host sync unless
    ``target_kl`` is set: then the last minibatch's ``approx_kl`` is read after each epoch to stop early.

    Args:
        b_obs: normalised observations float32 ``(B, *obs_shape)``; b_actions: float32 ``(B, act_dim)`` (Box) or
            int64 ``(B,)`` (Discrete); b_logprobs, b_advantages, b_returns, b_values: float32 ``(B,)``.

    Returns:
        device tensors: the last minibatch's ``value_loss, policy_loss, entropy, old_approx_kl, approx_kl``,
        ``clipfrac`` (mean over all minibatches), ``explained_variance`` of the batch, and ``bad``: a
        ``(len(LOSS_NAMES),)`` bool tensor, True where that quantity was non-finite in some minibatch.
    """
    device = b_obs.device
    batch_size = b_obs.shape[0]
    clipfrac_sum = torch.zeros((), device=device)
    n_mb = 0
    bad = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    for _epoch in range(update_epochs):
        perm = torch.randperm(batch_size, device=device)
        for start in range(0, batch_size, minibatch_size):
            mb = perm[start : start + minibatch_size]
            out = learn(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb], b_values[mb])
            clipfrac_sum += out["clipfrac"]
            bad |= out["bad"]
            n_mb += 1
        if target_kl is not None and out["approx_kl"] > target_kl:  # host sync, only when asked for
            break
    # copies: under --cudagraphs the outputs are the graph's static buffers, overwritten by the next replay
    last = {k: out[k].clone() for k in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl")}
    with torch.no_grad():
        explained_var = explained_variance(b_values, b_returns)
    return {**last, "clipfrac": clipfrac_sum / max(n_mb, 1), "explained_variance": explained_var, "bad": bad}


class CudaGraphed:
    """Replays ``fn(*tensors)`` from a CUDA graph: ``warmup`` eager calls on a side stream, then capture.

    Inputs are copied into static buffers before each replay; the returned tensors are the graph's static
    outputs, overwritten by the next call (use them before calling again). ``fn`` must not sync with the host,
    and every call must pass tensors of the shapes of the captured call.
    """

    def __init__(self, fn, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: tuple[torch.Tensor, ...] = ()
        self.static_out = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is not None:
            for dst, src in zip(self.static_in, args):
                dst.copy_(src)
            self.graph.replay()
            return self.static_out
        self.calls += 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if self.calls <= self.warmup:
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        self.static_in = tuple(a.clone() for a in args)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self.fn(*self.static_in)
        self.graph.replay()  # capture records the work without running it
        return self.static_out


def record_step(stats: dict, reward: torch.Tensor, info: dict, episode_end: torch.Tensor) -> None:
    """Add one step to the per-env episode sums; move the sums of finished episodes into the totals.

    ``reward`` float32 ``(num_envs,)``, ``info["co2_kg"]``/``info["unserved_kwh"]`` ``(num_envs,)`` (EVHub-v0;
    where an env's info has no such key, its sums stay 0), ``episode_end`` bool ``(num_envs,)`` (terminated or
    truncated).
    """
    end = episode_end.to(torch.float64)
    stats["ep_return"] += reward
    for key in ("co2_kg", "unserved_kwh"):
        if key in info:
            stats[f"ep_{key}"] += info[key]
    stats["ep_length"] += 1.0
    stats["n_done"] += end.sum()
    for key in ("return", "co2_kg", "unserved_kwh", "length"):
        stats[f"sum_{key}"] += (stats[f"ep_{key}"] * end).sum()
        stats[f"ep_{key}"] *= 1.0 - end


def rollout(
    env,
    act,
    next_obs: torch.Tensor,
    next_done: torch.Tensor,
    storage: dict,
    stats: dict,
    rn: dict | None,
    gamma: float,
    bootstrap_truncation: bool,
    final_value=None,
    discrete: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collect ``num_steps`` steps of every env into ``storage`` (in place) with ``act`` (:func:`policy_step`
    bound to the agent); no host sync (beyond what a host env's step needs).

    The env gets each sampled action clipped to [-1, 1] (Box), or as it is with ``discrete`` (int64 indices
    ``(num_envs,)``; :class:`GymVecEnv` adds the space's ``start``).

    ``next_obs`` is the raw env observation float32 ``(num_envs, *obs_shape)`` (``(num_envs, obs_dim)`` or
    ``(num_envs, C, H, W)``); ``act`` updates the agent's observation normaliser with each one, and the normalised
    observations are stored.

    ``final_value`` (a :class:`GymVecEnv` with ``bootstrap_truncation``; :func:`bootstrap_value` bound to the
    agent): every episode end is a done (no bootstrap across the autoreset), and on a step that truncates an
    episode without terminating it, ``gamma * final_value(info["final_obs"])`` is added to the (normalised) reward.
    Without it, ``bootstrap_truncation`` makes only ``terminated`` a done (EVHub-v0's bootstrap through the
    autoreset into the next window).

    Returns:
        ``(next_obs, next_done)`` after the last step (float32 ``(num_envs, *obs_shape)`` and ``(num_envs,)``), for
        bootstrapping and the next rollout.
    """
    for step in range(storage["obs"].shape[0]):
        obs_n, action, logprob, value = act(next_obs)
        storage["obs"][step] = obs_n
        storage["dones"][step] = next_done
        storage["values"][step] = value
        storage["actions"][step] = action
        storage["logprobs"][step] = logprob
        next_obs, reward, terminated, truncated, info = env.step(action if discrete else action.clamp(-1.0, 1.0))
        next_obs = next_obs.to(torch.float32)
        reward = reward.to(torch.float32)
        if final_value is None:
            next_done = (terminated if bootstrap_truncation else terminated | truncated).to(torch.float32)
        else:
            next_done = (terminated | truncated).to(torch.float32)
        # episode statistics: raw reward, CO2 and unserved energy summed per env, recorded at episode end
        record_step(stats, reward, info, terminated | truncated)
        if rn is not None:
            reward = normalize_reward(rn, reward, next_done, gamma)
        if final_value is not None and info["any_truncated"]:
            # a time limit is not terminal: bootstrap from the value of the episode's last observation
            cut = (truncated & ~terminated).to(torch.float32)
            reward = reward + gamma * cut * final_value(info["final_obs"])
        storage["rewards"][step] = reward
    return next_obs, next_done


# ---------------------------------------------------------------------------------------------- helpers
def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the env's defaults (:func:`env_defaults`), then the preset
    (:data:`PRESETS`), then :data:`FIELD_DEFAULTS`, and compute the runtime sizes. ``norm_obs`` left at None stays
    None here: :func:`main` decides it from the observation space (on for flat observations, off for images).

    Raises:
        ValueError: ``--cudagraphs`` without CUDA, with ``--target-kl`` (its early stop reads the device) or with
            unequal minibatches; or a bad size.
    """
    if args.cudagraphs and device.type != "cuda":
        raise ValueError("--cudagraphs needs CUDA (no CUDA device in use); drop the flag or run on a GPU")
    if args.cudagraphs and args.target_kl is not None:
        raise ValueError(
            "--cudagraphs cannot be combined with --target-kl: its early stop reads approx_kl on the host after "
            "every epoch; drop one of the two"
        )
    name = args.preset if args.preset != "auto" else ("gpu" if device.type == "cuda" else "cpu")
    args.preset = name
    for defaults in (env_defaults(args.env_id, name), PRESETS[name], FIELD_DEFAULTS):
        for key, value in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.cnn_channels = tuple(int(c) for c in args.cnn_channels)
    if len(args.cnn_channels) != 2 or min(args.cnn_channels) < 1:
        raise ValueError(f"--cnn-channels takes two positive channel counts (C1 C2), got {args.cnn_channels}")
    if args.output_dir is None and args.env_id == EVHUB_ID:
        args.output_dir = str(Path("outputs") / "runs" / f"{args.exp_name}_{Path(args.site).stem}_{args.action_mode}_seed{args.seed}")
    elif args.output_dir is None:
        env_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.env_id)
        args.output_dir = str(Path("outputs") / "runs" / f"{args.exp_name}_{env_name}_seed{args.seed}")
    if min(args.num_envs, args.num_steps, args.log_every) < 1:
        raise ValueError("num_envs, num_steps and log_every must be >= 1")
    args.batch_size = int(args.num_envs * args.num_steps)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    if args.minibatch_size < 1:
        raise ValueError(f"num_minibatches={args.num_minibatches} exceeds the batch size {args.batch_size}")
    if args.cudagraphs and args.batch_size % args.num_minibatches:
        raise ValueError(
            f"--cudagraphs needs equal minibatches: the batch size {args.batch_size} (num_envs * num_steps) must be "
            f"a multiple of num_minibatches={args.num_minibatches}"
        )
    return args


def rng_state(env) -> dict:
    """The Python, NumPy, torch (CPU and CUDA) and env generator states, for the checkpoint (no env generator for a
    :class:`GymVecEnv`: its envs are reseeded on resume)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if hasattr(env, "_generator"):
        state["env_generator"] = env._generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(env, state: dict) -> None:
    """Restore the generator states saved by :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if hasattr(env, "_generator") and "env_generator" in state:
        env._generator.set_state(state["env_generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, lr: torch.Tensor) -> None:
    """Load a saved optimizer ``state`` but keep this run's learning-rate tensor ``lr`` and ``capturable`` flag.

    ``load_state_dict`` also restores the saved param-group settings: a checkpoint written on another device, or
    by a version with a float LR, would bring a ``capturable`` flag this device cannot use (CPU) or a setting
    that CUDA graphs and the tensor LR cannot use (CUDA), and a LR other than the command line's.
    """
    groups = [
        {**saved, "capturable": group["capturable"]} for saved, group in zip(state["param_groups"], optimizer.param_groups)
    ]
    optimizer.load_state_dict({**state, "param_groups": groups})
    for group in optimizer.param_groups:  # load_state_dict copies the saved LR; the annealed tensor must be the one
        group["lr"] = lr


def save_checkpoint(path: Path, **payload) -> None:
    """Write the checkpoint atomically (temporary file, then rename), so a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def check_finite(bad_any: torch.Tensor, first_bad_step: torch.Tensor, ckpt: Path) -> None:
    """Raise :class:`NonFiniteLossError` if any update produced a non-finite loss (one host sync)."""
    step = int(first_bad_step)
    if step >= 0:
        names = [n for n, b in zip(LOSS_NAMES, bad_any.tolist()) if b]
        kept = f"the last good checkpoint {ckpt} is left untouched" if ckpt.exists() else "no checkpoint was written"
        raise NonFiniteLossError(
            f"non-finite {', '.join(names)} in the update at global_step {step}; training stopped, {kept}"
        )


def out_of_memory_message(exc: BaseException) -> str | None:
    """The first line of the CUDA out-of-memory error behind ``exc``, or None if ``exc`` has none behind it.

    Looks at ``exc`` and the errors it was raised from or while handling (``__cause__``, ``__context__``): a failed
    torch.compile or CUDA-graph capture raises its own error on top of the allocator's ``torch.OutOfMemoryError``.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return (str(exc).strip().splitlines() or ["CUDA out of memory"])[0]
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return None


def free_device_memory(device: torch.device) -> None:
    """Hand the memory of dropped tensors and CUDA graphs back: a garbage collection (tracebacks keep frames alive
    in cycles), then, on CUDA, the caching allocator's unused blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def halve_num_envs(args: Args, history: list[str], where: str, error: str, ckpt: Path) -> str:
    """Back off after a CUDA out-of-memory error: halve ``args.num_envs`` and the sizes that follow from it.

    The batch (``num_envs * num_steps``) halves; ``num_minibatches`` stays, so each minibatch halves too.

    Args:
        args: the run's resolved arguments, changed in place (``num_envs``, ``batch_size``, ``minibatch_size``).
        history: the warnings of the halvings made so far in this run (their number counts against
            ``args.max_oom_retries``); the new warning is appended.
        where: where the error struck, e.g. ``"at setup"`` or ``"at global_step 1024 (iteration 3)"``.
        error: the first line of the out-of-memory error (see :func:`out_of_memory_message`).
        ckpt: the run's checkpoint path, named in the error.

    Returns:
        the warning: the old and the new sizes.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` halvings were made already, or num_envs cannot be halved (one
            env, or, under ``--cudagraphs``, a batch that would not split into equal minibatches); ``args`` is left
            as it was.
    """
    n_envs = args.num_envs // 2
    batch = n_envs * args.num_steps
    if len(history) >= args.max_oom_retries:
        reason = f"max_oom_retries={args.max_oom_retries} halvings of num_envs were made already"
    elif n_envs < 1 or batch < args.num_minibatches:
        reason = f"num_envs {args.num_envs} cannot be halved (num_minibatches={args.num_minibatches})"
    elif args.cudagraphs and batch % args.num_minibatches:
        reason = (
            f"--cudagraphs needs equal minibatches and {n_envs} envs x {args.num_steps} steps do not split into "
            f"num_minibatches={args.num_minibatches}"
        )
    else:
        message = (
            f"CUDA out of memory {where}: num_envs {args.num_envs} -> {n_envs} (batch {args.batch_size} -> {batch}, "
            f"minibatch {args.minibatch_size} -> {batch // args.num_minibatches}); continuing"
        )
        args.num_envs, args.batch_size, args.minibatch_size = n_envs, batch, batch // args.num_minibatches
        history.append(message)
        return message
    kept = f"the last good checkpoint {ckpt} is left untouched" if ckpt.exists() else "no checkpoint was written"
    tried = "".join(f"\n  {h}" for h in history) if history else " none"
    raise OutOfMemoryBackoffError(
        f"CUDA out of memory {where} with num_envs {args.num_envs} (batch {args.batch_size}, minibatch "
        f"{args.minibatch_size}), and no further back-off: {reason}. Training stopped; {kept}.\n"
        f"Halvings made:{tried}\n"
        f"Ask for less memory: a smaller --num-envs (or --num-steps, --hidden-size), more --num-minibatches, no "
        f"--cudagraphs or --compile; or allow more halvings with --max-oom-retries.\n"
        f"The error: {error}"
    )


def export_policy(agent: Agent, obs_dim: int | tuple[int, ...], out_dir: Path) -> Path:
    """Save the deterministic actor (:class:`DeterministicActor`) for code that does not import ``algos``.

    ``obs_dim`` is the size of flat observations or the shape ``(C, H, W)`` of images. The program maps raw
    observations float32 ``(B, obs_dim)`` or ``(B, C, H, W)`` to, for a Box action space, the mean action float32
    ``(B, act_dim)`` clipped to [-1, 1] (the env takes it rescaled to its bounds), or, for a Discrete(n, start)
    (``agent.discrete``), the argmax action int64 ``(B,)`` in ``0..n-1`` (the env takes it plus ``start``).
    ``torch.export`` with a dynamic batch dimension to ``policy.pt2``; if export fails, a TorchScript trace to
    ``policy.pt``. Either is written atomically (temporary file, then rename). Returns the written path.
    """
    actor = DeterministicActor(copy.deepcopy(agent.obs_norm), copy.deepcopy(agent.policy_head), agent.discrete)
    actor = actor.cpu().float().eval()
    example = torch.zeros(2, *((int(obs_dim),) if isinstance(obs_dim, (int, np.integer)) else tuple(obs_dim)))
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(actor, (example,), dynamic_shapes={"obs": {0: batch}})
        path = out_dir / "policy.pt2"
        atomic_write(path, lambda tmp: torch.export.save(program, tmp), suffix=".tmp.pt2")
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        traced = torch.jit.trace(actor, example)
        atomic_write(path, lambda tmp: traced.save(str(tmp)))
    return path


def eval_curve_row(kpis: pd.DataFrame, global_step: int, train_wall_s: float) -> dict:
    """One row of ``eval_curve.parquet``: env steps so far, training wall time so far (s, evaluations left out)
    and the evaluation's ``co2_kg`` (kg), ``unserved_kwh`` (kWh) and ``ev_energy_served_pct`` (%)."""
    k = kpis.iloc[0]
    return {
        "global_step": int(global_step),
        "train_wall_s": float(train_wall_s),
        "co2_kg": float(k["co2_kg"]),
        "unserved_kwh": float(k["unserved_kwh"]),
        "ev_energy_served_pct": float(k["ev_energy_served_pct"]),
    }


def metrics_row(
    global_step: int, wall_s: float, sps: float, ep: dict, losses: dict, lr: float, num_envs: int, gpu: dict | None = None
) -> dict:
    """One row of ``metrics.parquet`` from host numbers: episode means ``ep`` (``co2_kg``/``unserved_kwh`` NaN for
    envs other than EVHub-v0), update ``losses``, learning rate, the number of envs of the iteration (less than asked
    for after a halving for lack of memory) and the :func:`gpu_stats` reading ``gpu`` (NaN where absent)."""
    gpu = gpu or {}
    return {
        "global_step": global_step,
        "wall_s": wall_s,
        "sps": sps,
        "episodic_return": ep["return"],
        "episodic_length": ep["length"],
        "episodic_co2_kg": ep["co2_kg"],
        "episodic_unserved_kwh": ep["unserved_kwh"],
        "value_loss": losses["value_loss"],
        "policy_loss": losses["policy_loss"],
        "entropy": losses["entropy"],
        "approx_kl": losses["approx_kl"],
        "clipfrac": losses["clipfrac"],
        "explained_variance": losses["explained_variance"],
        "learning_rate": lr,
        "num_envs": num_envs,
        **{key.removeprefix("perf/"): float(gpu.get(key, math.nan)) for key in GPU_STAT_KEYS},
    }


# ---------------------------------------------------------------------------------------------- main
def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy"}`` (path of the exported policy),
        ``"num_envs"`` and ``"batch_size"`` (the sizes trained with at the end: smaller than asked for after
        halvings for lack of CUDA memory), ``"vector_mode"`` (the one used: "sync" after an async fallback; None for
        a torch-batched env) and, for EVHub-v0 unless ``eval_split`` is ``"none"``, ``"eval"``: the KPI row (a
        one-row DataFrame).

    Raises:
        ValueError: the env's action space is neither a Box nor a Discrete, or its observations are not a Box of at
            most 3 dimensions (:func:`check_spaces`); or a torch-batched env's Discrete action space does not start
            at 0; or a bad size (:func:`resolve_args`).
        NonFiniteLossError: a loss became NaN or infinite.
        OutOfMemoryBackoffError: CUDA ran out of memory once more after ``max_oom_retries`` halvings of num_envs
            (or with nothing left to halve); the last checkpoint is kept.
    """
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    args = resolve_args(args, device)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    if args.resume and not ckpt_path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before the first GEMM
        torch.use_deterministic_algorithms(True)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    is_evhub = args.env_id == EVHUB_ID
    torch_batched = is_torch_batched(args.env_id)
    site = envs.load_site(args.site) if is_evhub else None
    run_warnings: list[str] = []  # shown on stderr at once and written to TensorBoard text "warnings"
    if torch_batched and args.vector_mode != "sync":
        print(f"note: --vector-mode {args.vector_mode} is ignored: {args.env_id} is a torch-batched env (vector_entry_point)")

    def build_envs() -> tuple:
        """The envs and all the state sized by num_envs: ``(env, storage, episode stats, reward normaliser)``."""
        if torch_batched:
            evhub_kwargs = {}
            if is_evhub:
                evhub_kwargs = dict(site=site, split="train", action_mode=args.action_mode, bess_action=args.bess_action)
            env = gym.make_vec(
                args.env_id,
                num_envs=args.num_envs,
                vectorization_mode="vector_entry_point",
                device=device,
                **evhub_kwargs,
            )
            env = getattr(env, "unwrapped", env)
            try:
                check_spaces(args.env_id, env.single_observation_space, env.single_action_space)
                space = env.single_action_space
                if isinstance(space, gym.spaces.Discrete) and int(space.start) != 0:
                    raise ValueError(
                        f"PPO steps a torch-batched env with the action indices 0..n-1, but {args.env_id} has {space} "
                        f"(start != 0)"
                    )
            except ValueError:
                getattr(env, "close", lambda: None)()
                raise
        else:
            vec, warning = make_gym_vector_env(args.env_id, args.num_envs, args.vector_mode)
            if warning is not None:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
                run_warnings.append(warning)
                args.vector_mode = "sync"
            try:
                env = GymVecEnv(vec, device, args.env_id)
            except ValueError:
                vec.close()
                raise
        discrete, act_dim = action_head(env.single_action_space)
        storage = make_storage(
            args.num_steps, args.num_envs, torso_shape(env.single_observation_space.shape), act_dim, device, discrete
        )
        stats = make_episode_stats(args.num_envs, device)
        rn = make_reward_norm(args.num_envs, device) if args.norm_reward else None
        return env, storage, stats, rn

    oom_history: list[str] = []  # one warning per halving of num_envs after a CUDA out-of-memory error

    def build_envs_backing_off(where: str, error: str | None) -> tuple:
        """:func:`build_envs`, first halving num_envs if ``error`` (an out-of-memory message) is given, and again
        after each out-of-memory error while building; raises :class:`OutOfMemoryBackoffError` when that must stop."""
        while True:
            if error is not None:
                free_device_memory(device)
                message = halve_num_envs(args, oom_history, where, error, ckpt_path)
                print(f"warning: {message}", file=sys.stderr, flush=True)
            try:
                return build_envs()
            except RuntimeError as exc:
                error = out_of_memory_message(exc)
                if error is None:
                    raise

    env, storage, stats, rn = build_envs_backing_off("at setup", None)
    if oom_history:  # num_envs was halved: the iterations of the run change size
        args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    obs_dim = int(np.prod(env.single_observation_space.shape))
    # the torso, decided once from the observation shape: (C, H, W) images go to the CNN, the rest (flattened) to
    # the MLP
    obs_shape = torso_shape(env.single_observation_space.shape)
    image = len(obs_shape) == 3
    if args.norm_obs is None:  # images (e.g. Snake's boards, in [0, 1]) are fed as they are unless asked
        args.norm_obs = not image
    # the action space's kind, decided once: every action path below branches on this Python bool
    discrete, act_dim = action_head(env.single_action_space)

    inputs = None  # every feature: the EVHub-v0 feature selection below applies to the site's observation only
    if is_evhub:
        inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
        if not args.weekday_features:
            inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    agent = Agent(
        obs_dim, act_dim, args.hidden_size, args.init_logstd, args.norm_obs, inputs, discrete,
        obs_shape=obs_shape, cnn_channels=args.cnn_channels,
    ).to(device)  # fmt: skip
    # a device-tensor learning rate, annealed in place: no recompilation, and CUDA graphs see the new value. On CUDA
    # Adam takes a tensor LR only as capturable (its foreach path needs it; graphs need it too). On the CPU it is
    # float64: Adam reads it back as a Python number there, so the steps are those of a plain float LR.
    lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
    lr_t = torch.tensor(args.learning_rate, device=device, dtype=lr_dtype)
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr_t, eps=1e-5, capturable=device.type == "cuda")

    next_obs, _ = env.reset(seed=args.seed)
    next_obs = next_obs.to(torch.float32)
    next_done = torch.zeros(args.num_envs, device=device)
    global_step, start_iteration, train_wall_prev = 0, 1, 0.0
    rows: list[dict] = []
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file
        agent.load_state_dict(ckpt["agent"])
        load_optimizer_state(optimizer, ckpt["optimizer"], lr_t)
        global_step, start_iteration = int(ckpt["global_step"]), int(ckpt["iteration"]) + 1
        train_wall_prev = float(ckpt.get("train_wall_s", 0.0))
        set_rng_state(env, ckpt["rng"])
        if not torch_batched:
            # a gymnasium env's state cannot be saved: fresh episodes (other seeds than the first start's), fresh
            # episode sums; the running return statistics carry over
            print("resume: the state of a gymnasium env cannot be checkpointed; envs start new episodes")
            next_obs, _ = env.reset(seed=args.seed + global_step)
            if rn is not None and ckpt.get("reward_norm") is not None:
                for key in ("mean", "var", "count"):
                    rn[key].copy_(ckpt["reward_norm"][key])
        elif ckpt.get("num_envs") == args.num_envs:
            env.load_state_dict(ckpt["env_state"])
            next_obs, next_done = ckpt["next_obs"].to(device), ckpt["next_done"].to(device)
            for key, value in ckpt["episode_stats"].items():
                stats[key].copy_(value)
            if rn is not None and ckpt.get("reward_norm") is not None:
                for key, value in ckpt["reward_norm"].items():
                    rn[key].copy_(value)
        else:
            print(f"resume: num_envs changed ({ckpt.get('num_envs')} -> {args.num_envs}); envs start new episodes")
        if (out_dir / "metrics.parquet").is_file():
            old = pd.read_parquet(out_dir / "metrics.parquet")
            rows = old[old.global_step <= global_step].to_dict("records")
        print(f"resumed from {ckpt_path} at global_step {global_step}, iteration {start_iteration - 1}")
        # the steps left, in batches of this run's size (the checkpoint's may differ: another --num-envs, or a run
        # that halved num_envs after running out of memory)
        args.num_iterations = start_iteration - 1 + max(0, args.total_timesteps - global_step) // args.batch_size
    # the global step at which training ends: the learning rate anneals over the steps up to it
    end_step = global_step + (args.num_iterations - start_iteration + 1) * args.batch_size

    def bind_hot_functions() -> tuple:
        """The hot functions bound to the agent and optimizer, then compiled / CUDA-graphed as the speed switches
        say: ``(act, gae, learn)``. Called again after a halving of num_envs: graphs are captured for one shape."""
        act = functools.partial(policy_step, agent, amp=args.amp)
        final_value = None
        if not torch_batched and args.bootstrap_truncation:
            final_value = functools.partial(bootstrap_value, agent, amp=args.amp)
        gae = functools.partial(estimate_advantages, agent, gamma=args.gamma, gae_lambda=args.gae_lambda, amp=args.amp)
        learn = functools.partial(
            update_minibatch,
            agent,
            optimizer,
            clip_coef=args.clip_coef,
            norm_adv=args.norm_adv,
            clip_vloss=args.clip_vloss,
            ent_coef=args.ent_coef,
            vf_coef=args.vf_coef,
            max_grad_norm=args.max_grad_norm,
            amp=args.amp,
        )
        if args.compile:
            # random numbers from eager's kernels: a seed gives the same run with and without --compile
            torch._inductor.config.fallback_random = True
            act = torch.compile(act)
            final_value = final_value and torch.compile(final_value)
            gae = torch.compile(gae)
            learn = torch.compile(learn)
        if args.cudagraphs:
            act = CudaGraphed(act)
            final_value = final_value and CudaGraphed(final_value)
            gae = CudaGraphed(gae)
            learn = CudaGraphed(learn)
        return act, gae, learn, final_value

    act, gae, learn, final_value = bind_hot_functions()

    def shown_args() -> dict:
        """The resolved arguments this env reads (all but :data:`EVHUB_ONLY_ARGS` for envs other than EVHub-v0)."""
        return {k: v for k, v in vars(args).items() if is_evhub or k not in EVHUB_ONLY_ARGS}

    def hyperparameters() -> str:
        """The resolved arguments as a Markdown table (TensorBoard text)."""
        return "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in shown_args().items()))

    writer = SummaryWriter(str(out_dir))
    writer.add_text("hyperparameters", hyperparameters())
    writer.add_text("presets", presets_table(args.preset, args))
    for message in oom_history:  # halvings at setup
        writer.add_text("oom", message, global_step)
    for message in run_warnings:  # an async start that fell back to sync
        writer.add_text("warnings", message, global_step)
    where = f"site={args.site} action_mode={args.action_mode}" if is_evhub else (
        f"vector_mode={args.vector_mode}" if not torch_batched else "torch-batched")
    c1, c2 = args.cnn_channels
    torso = f"obs {obs_shape} (CNN {c1}-{c2} channels)" if image else f"obs {obs_shape} (MLP)"
    print(
        f"PPO on {args.env_id} {where} {torso} {'Categorical' if discrete else 'Gaussian'} policy, "
        f"device={device} preset={args.preset}: "
        f"{args.num_envs} envs x {args.num_steps} steps, {args.num_iterations} iterations, "
        f"{args.total_timesteps:,} steps; output {out_dir}"
    )
    env_column = f", {args.env_id.split(':')[-1]} = its own defaults" if env_defaults(args.env_id, args.preset) else ""
    print(f"presets (* = {args.preset}{env_column}; any field can be set on the command line):\n"
          + presets_table(args.preset, args))
    print("args: " + ", ".join(f"{k}={v}" for k, v in shown_args().items()), flush=True)
    if not is_evhub and args.eval_split.lower() != "none":
        print(f"note: no split evaluation for {args.env_id} (eval_split={args.eval_split!r} applies to {EVHUB_ID} only)")

    def checkpoint(iteration: int, train_wall: float) -> None:
        check_finite(bad_any, first_bad_step, ckpt_path)
        save_checkpoint(
            ckpt_path,
            agent=agent.state_dict(),
            optimizer=optimizer.state_dict(),
            global_step=global_step,
            iteration=iteration,
            train_wall_s=train_wall,
            args=dataclasses.asdict(args),
            num_envs=args.num_envs,
            rng=rng_state(env),
            env_state=env.state_dict() if torch_batched else None,
            next_obs=next_obs,
            next_done=next_done,
            episode_stats=stats,
            reward_norm=rn,
        )

    actor = DeterministicActor(agent.obs_norm, agent.policy_head, discrete)  # shares the agent's weights

    def evaluate(**extra: float) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Run the current deterministic policy over the whole eval split: ``(KPI row, hourly traces)``."""

        def policy(obs: torch.Tensor, env_) -> torch.Tensor:
            return actor(obs.float()).to(obs.dtype)

        return evaluate_policy(
            policy, site, args.eval_split, "ppo", args.action_mode, device, bess_action=args.bess_action, **extra
        )

    curve: list[dict] = []  # evaluations during training (--eval-every)
    if args.resume and (out_dir / "eval_curve.parquet").is_file():
        old = pd.read_parquet(out_dir / "eval_curve.parquet")
        curve = old[old.global_step <= global_step].to_dict("records")

    bad_any = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    start_time = time.perf_counter()
    session_start_step = global_step
    losses_host: dict = {}
    sps = float(rows[-1]["sps"]) if rows else 0.0  # a resumed run that has nothing left to train keeps its SPS
    iteration = start_iteration - 1
    n_oom_logged = len(oom_history)
    # steady-state SPS: timed over the second half of this session's iterations, past compilation, CUDA-graph
    # capture and the first updates (after a halving of num_envs: of the iterations left)
    half_iteration = start_iteration + (args.num_iterations - start_iteration + 1) // 2
    steady_start: tuple[float, int] | None = None
    bar = tqdm(
        initial=start_iteration - 1,
        total=args.num_iterations,
        disable=not sys.stderr.isatty(),
        desc="ppo",
    )
    try:
        while iteration < args.num_iterations:
            iteration += 1
            if iteration == half_iteration:
                steady_start = (synced_clock(device), global_step)
            if args.anneal_lr:
                frac = 1.0 - global_step / end_step
                lr_t.fill_(frac * args.learning_rate)

            oom_error = None
            try:
                next_obs, next_done = rollout(
                    env, act, next_obs, next_done, storage, stats, rn, args.gamma, args.bootstrap_truncation,
                    final_value=final_value, discrete=discrete,
                )
                advantages, returns = gae(next_obs, next_done, storage["rewards"], storage["values"], storage["dones"])
                out = update(
                    learn,
                    storage["obs"].reshape(-1, *obs_shape),
                    storage["actions"].reshape(-1) if discrete else storage["actions"].reshape(-1, act_dim),
                    storage["logprobs"].reshape(-1),
                    advantages.reshape(-1),
                    returns.reshape(-1),
                    storage["values"].reshape(-1),
                    update_epochs=args.update_epochs,
                    minibatch_size=args.minibatch_size,
                    target_kl=args.target_kl,
                )
            except RuntimeError as exc:
                oom_error = out_of_memory_message(exc)
                if oom_error is None:
                    raise
            if oom_error is not None:
                # out of memory: this iteration's rollout is dropped (its steps are not counted; the minibatch
                # steps already taken on it stay), the envs are rebuilt with half as many copies, and the iteration
                # is repeated at the new size; the totals of finished episodes and the return statistics carry over
                where = f"at global_step {global_step} (iteration {iteration})"
                iteration -= 1
                # the new envs go on drawing windows where these stopped
                generator = env._generator.get_state() if hasattr(env, "_generator") else None
                if not torch_batched:
                    env.close()
                totals = {k: v for k, v in stats.items() if k == "n_done" or k.startswith("sum_")}
                rn_totals = None if rn is None else {k: rn[k] for k in ("mean", "var", "count")}
                env = storage = stats = rn = next_obs = next_done = advantages = returns = out = None
                act = gae = learn = final_value = None
                env, storage, stats, rn = build_envs_backing_off(where, oom_error)
                if generator is not None:
                    env._generator.set_state(generator)
                for key, value in totals.items():
                    stats[key].copy_(value)
                for key, value in (rn_totals or {}).items():
                    rn[key].copy_(value)
                next_obs, _ = env.reset()
                next_obs = next_obs.to(torch.float32)
                next_done = torch.zeros(args.num_envs, device=device)
                act, gae, learn, final_value = bind_hot_functions()
                args.num_iterations = iteration + max(1, (args.total_timesteps - global_step) // args.batch_size)
                end_step = global_step + (args.num_iterations - iteration) * args.batch_size
                half_iteration, steady_start = iteration + 1 + (args.num_iterations - iteration) // 2, None
                bar.total = args.num_iterations
                for message in oom_history[n_oom_logged:]:
                    writer.add_text("oom", message, global_step)
                n_oom_logged = len(oom_history)
                continue
            global_step += args.batch_size
            bar.update()
            bad = out.pop("bad")
            first_bad_step = torch.where((first_bad_step < 0) & bad.any(), global_step, first_bad_step)
            bad_any |= bad

            last = iteration == args.num_iterations
            if iteration % args.log_every == 0 or last:
                check_finite(bad_any, first_bad_step, ckpt_path)  # host sync
                losses_host = {k: float(v) for k, v in out.items()}
                lr_now = float(lr_t)
                n_done = float(stats["n_done"])
                ep = {k: float(stats[f"sum_{k}"]) / n_done if n_done else math.nan for k in ("return", "co2_kg", "unserved_kwh", "length")}
                if not is_evhub:  # the KPIs exist for the site only
                    ep["co2_kg"] = ep["unserved_kwh"] = math.nan
                gpu = gpu_stats(device)
                for key in ("n_done", "sum_return", "sum_co2_kg", "sum_unserved_kwh", "sum_length"):
                    stats[key].zero_()
                wall = time.perf_counter() - start_time
                sps = (global_step - session_start_step) / max(wall, 1e-9)
                if n_done:
                    writer.add_scalar("charts/episodic_return", ep["return"], global_step)
                    writer.add_scalar("charts/episodic_length", ep["length"], global_step)
                    if is_evhub:
                        writer.add_scalar("charts/episodic_co2_kg", ep["co2_kg"], global_step)
                        writer.add_scalar("charts/episodic_unserved_kwh", ep["unserved_kwh"], global_step)
                writer.add_scalar("charts/learning_rate", lr_now, global_step)
                for key in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "explained_variance"):
                    writer.add_scalar(f"losses/{key}", losses_host[key], global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                for key, value in gpu.items():
                    if not math.isnan(value):
                        writer.add_scalar(key, value, global_step)
                rows.append(metrics_row(global_step, train_wall_prev + wall, sps, ep, losses_host, lr_now, args.num_envs, gpu))
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", co2=f"{ep['co2_kg']:.1f}", refresh=False)
                if (bar.disable and iteration % max(1, args.num_iterations // 10) == 0) or last:
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} "
                        f"return {ep['return']:.2f} length {ep['length']:.1f} "
                        + (f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if is_evhub else "")
                        + f"v_loss {losses_host['value_loss']:.4f} ev {losses_host['explained_variance']:.3f}",
                        flush=True,
                    )
            if (args.eval_every and iteration % args.eval_every == 0 and not last and args.eval_split.lower() != "none"
                    and is_evhub):
                # the evaluation's time is left out of the training clock (and out of the steady-state SPS)
                eval_start = synced_clock(device)
                row, _ = evaluate()
                curve.append(eval_curve_row(row, global_step, train_wall_prev + eval_start - start_time))
                write_parquet(pd.DataFrame(curve), out_dir / "eval_curve.parquet")
                writer.add_scalar("eval/co2_kg", curve[-1]["co2_kg"], global_step)
                writer.add_scalar("eval/unserved_kwh", curve[-1]["unserved_kwh"], global_step)
                paused = time.perf_counter() - eval_start
                start_time += paused
                if steady_start is not None:
                    steady_start = (steady_start[0] + paused, steady_start[1])
            if args.checkpoint_every and iteration % args.checkpoint_every == 0 and not last:
                checkpoint(iteration, train_wall_prev + time.perf_counter() - start_time)
    except (NonFiniteLossError, OutOfMemoryBackoffError):
        writer.close()
        bar.close()
        if not torch_batched:
            env.close()
        raise
    bar.close()
    if oom_history:  # the sizes actually used at the end
        writer.add_text("hyperparameters", hyperparameters(), global_step)

    end_time = synced_clock(device)
    sps_steady = (global_step - steady_start[1]) / max(end_time - steady_start[0], 1e-9) if steady_start else sps
    train_wall = train_wall_prev + end_time - start_time
    checkpoint(iteration, train_wall)
    policy_path = export_policy(agent, obs_shape if image else obs_dim, out_dir)
    if is_evhub:
        write_policy_spec(out_dir, args.env_id, args.action_mode, args.bess_action)
    if not torch_batched:
        env.close()
    print(f"training: {global_step:,} steps in {train_wall:.1f} s ({sps:.0f} SPS, {sps_steady:.0f} over the second half); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "sps_steady": sps_steady,
              "policy": str(policy_path), "num_envs": args.num_envs, "batch_size": args.batch_size,
              "vector_mode": None if torch_batched else args.vector_mode}
    if args.eval_split.lower() != "none" and is_evhub:
        row, traces = evaluate(train_wall_s=train_wall, env_steps=float(global_step), steps_per_s=sps)
        write_parquet(row, out_dir / f"eval_{args.eval_split}.parquet")
        write_parquet(traces, out_dir / f"eval_{args.eval_split}_traces.parquet")
        kpis = row.iloc[0]
        print(f"deterministic evaluation on the {args.eval_split} split:")
        for key in ("co2_kg", "grid_import_kwh", "pv_self_consumption_pct", "ev_energy_served_pct", "unserved_kwh", "peak_import_kw"):
            print(f"  {key:<26} {kpis[key]:.2f}")
            writer.add_scalar(f"eval/{key}", float(kpis[key]), global_step)
        result["eval"] = row
        if args.eval_every:
            curve.append(eval_curve_row(row, global_step, train_wall))
            write_parquet(pd.DataFrame(curve), out_dir / "eval_curve.parquet")
    writer.close()
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
