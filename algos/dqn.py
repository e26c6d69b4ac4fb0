"""DQN for ``EVHub-v0``'s discrete actions, and for any gymnasium env with a ``Discrete`` action space, CleanRL
style: one file, env, agent and replay buffer on one device.

The agent picks one of the 15 rows of :func:`envs.evhub.discrete_action_table` (BESS levels x EV levels of the
hub mode) per env. Each iteration steps all ``num_envs`` copies ``num_steps`` times with an epsilon-greedy
policy (epsilon follows a linear schedule computed on the device; the choice is a ``torch.where``), writes the
transitions into a replay buffer preallocated on the device, then takes ``gradient_steps`` gradient steps of
Huber (smooth L1) TD loss with gradient-norm clipping against a target network (hard copy every
``target_network_frequency`` env steps, or a Polyak blend with ``tau < 1``), with the double-DQN target by
default. The host reads numbers back only every ``log_every`` iterations. The hot paths (:func:`act`,
:func:`update`) are plain module-level functions that ``--compile`` / ``--cudagraphs`` rebind once.

Run (defaults: ``caltech`` site, a preset sized to the device)::

    python algos/dqn.py
    python algos/dqn.py --site path/to/site.toml --total-timesteps 200000 --seed 2 --preset cpu
    tensorboard --logdir outputs/

Writes into ``output_dir``: TensorBoard events, ``metrics.parquet`` (the same curves), ``checkpoint.pt``
(networks, optimizer, counters, RNG and env state, and with ``--save-buffer`` the filled rows of the replay
buffer; ``--resume`` continues from it: with the stored buffer exactly where the run stopped, without it the
buffer is refilled for ``learning_starts`` steps before updating again), ``policy.pt2`` and the deterministic
evaluation over ``eval_split``: ``eval_{split}.parquet`` (one KPI row, controller ``"dqn"``) and
``eval_{split}_traces.parquet``.

The exported policy and the evaluation use the *hub* action mode: ``policy.pt2`` maps float32 observations
``(B, obs_dim)`` to the hub action of the greedy discrete action, i.e. the row ``discrete_action_table()[argmax_a
Q(obs, a)]``, shape ``(B, 2)`` in [-1, 1]. An action index would not survive ``envs.kpis.load_policy`` (it clamps
to [-1, 1]), the table row does, and stepping the hub mode with a table row is exactly the discrete mode with its
index (``tests/test_evhub.py`` checks discrete == hub with the table action). So the final evaluation runs the
env with ``action_mode="hub"`` and that same greedy module, and so can anyone who loads ``policy.pt2``.

Other environments (``--env-id``, any registered gymnasium id, or ``"module:EnvId-v0"`` to import a user's module
that registers it)::

    python algos/dqn.py --env-id Snake-v0
    python algos/dqn.py --env-id CartPole-v1 --vector-mode async --num-envs 8

* A torch-batched env (its spec has a ``vector_entry_point`` that takes a ``device``, e.g. ``Snake-v0``) is built with
  ``gym.make_vec(..., vectorization_mode="vector_entry_point", device=device)``; the EVHub-only keyword arguments
  (site, split, action_mode, bess_action) go to ``EVHub-v0`` only. ``--vector-mode`` does not apply to it.
* Any other env runs in gymnasium's ``SyncVectorEnv`` (``--vector-mode sync``) or ``AsyncVectorEnv`` (``async``:
  one subprocess per env) with the SAME_STEP autoreset of our envs, behind :class:`GymVectorAdapter`, which hands
  the loop torch tensors on the device. If the async env cannot start (no fork, an env factory that does not
  pickle) the run warns (stderr, TensorBoard text ``warnings``) and goes on with the sync one. A truncated episode
  bootstraps from its ``final_obs`` (``bootstrap_truncation``); a torch-batched env returns no ``final_obs``, so
  there it bootstraps from the next episode's first observation, as on EVHub (an approximation).
* The action space must be ``Discrete`` (else a ``ValueError`` naming the env and its space). Observations of
  shape ``(C, H, W)`` go through a small CNN torso (:class:`QNetwork`), flat ones through the MLP.
* EVHub-only parts are skipped for other envs: the site and its splits, the feature selection, the KPI curves
  (NaN in ``metrics.parquet``), ``policy.json`` and the final evaluation (a note is printed if ``eval_split`` is
  not ``"none"``). ``policy.pt2`` is the greedy policy: float32 observations ``(B, *obs_shape)`` -> action
  indices int64 ``(B,)``. Settings that suit the env better than the EVHub defaults come from :data:`ENV_DEFAULTS`
  (printed at the start, each overridable on the command line).
* Overlap of env stepping and learning (``--vector-mode async`` with a gymnasium env only): each iteration does its
  first ``num_steps - 1`` env steps as usual, then picks the last step's actions, sends them with
  ``env.step_async(actions)``, runs the iteration's gradient steps (and target update) while the worker processes
  step, then collects the result with ``env.step_wait()`` and only then stores that transition. So the gradient
  steps of an iteration sample the buffer without its newest ``num_envs`` transitions (they are stored right after).
  In sync mode and for torch-batched envs the order is unchanged: all ``num_steps`` steps stored, then the updates.
* ``--resume`` restores the networks, optimizer, counters and RNG as usual; a gymnasium env's state cannot be
  stored, so its envs start new episodes (a note is printed).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
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
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/dqn.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.evhub import discrete_action_table
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet, write_policy_spec

EVHUB_ONLY_ARGS = ("site", "bess_action", "socket_features", "weekday_features", "eval_split")
"""Arguments that only EVHub-v0 reads: left out of the printed and logged hyperparameters of other envs."""


PRESETS = {
    # 2 CPU cores: a few dozen envs, a small net, a replay ratio of 8 samples per env step
    "cpu": {
        "num_envs": 32,
        "total_timesteps": 1_000_000,
        "buffer_size": 200_000,
        "batch_size": 256,
        "num_steps": 2,
        "gradient_steps": 2,
        "learning_starts": 10_000,
        "hidden_size": 128,
        "torch_threads": 1,
    },
    # one GPU: thousands of envs, a wide net, big batches
    "gpu": {
        "num_envs": 1024,
        "total_timesteps": 20_000_000,
        "buffer_size": 2_000_000,
        "batch_size": 4096,
        "num_steps": 1,
        "gradient_steps": 2,
        "learning_starts": 100_000,
        "hidden_size": 256,
        "torch_threads": 0,
    },
}
"""Defaults per preset for the fields left at ``None``; any of them can be set on the command line."""

ENV_DEFAULTS = {
    # EVHub-v0: the defaults of the Args fields (tuned for the site env)
    "EVHub-v0": {},
    # Snake: rewards of +1/-1, long episodes; a small CNN on 2 CPU cores
    "Snake-v0": {
        "gamma": 0.99,
        "reward_scale": 1.0,
        "exploration_fraction": 0.2,
        "end_e": 0.02,
        "target_network_frequency": 20_000,
        "norm_obs": False,
        "cnn_channels": (16, 32),
    },
    # Snake on the cpu preset: sizes that learn in about 10 minutes on 2 CPU cores (800,000 steps)
    "Snake-v0/cpu": {
        "num_envs": 64,
        "total_timesteps": 800_000,
        "buffer_size": 100_000,
        "batch_size": 128,
        "num_steps": 1,
        "gradient_steps": 1,
        "learning_starts": 5_000,
        "hidden_size": 128,
    },
    # any other gymnasium env (CleanRL's classic-control settings)
    "*": {
        "gamma": 0.99,
        "reward_scale": 1.0,
        "exploration_fraction": 0.5,
        "target_network_frequency": 500,
        "learning_starts": 10_000,
    },
}
"""Per-env defaults for the fields left at ``None`` (env id, else ``"*"`` for any env other than EVHub-v0), applied
before the device preset; anything set on the command line wins, and the resolved values are printed at the start."""

FIELD_DEFAULTS = {
    "gamma": 0.95,
    "reward_scale": 10.0,
    "exploration_fraction": 0.5,
    "end_e": 0.05,
    "target_network_frequency": 5_000,
    "norm_obs": True,
    "cnn_channels": (32, 64),
}
"""Values of the env-dependent fields left at ``None`` that neither :data:`ENV_DEFAULTS` nor the preset set
(the EVHub-v0 values)."""


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
    """if toggled, use CUDA when it is available (agent, env and replay buffer on the same device)"""
    preset: str = "auto"
    """'auto' (by device), 'cpu' or 'gpu': the values of the fields left at None (see PRESETS)"""
    env_id: str = "EVHub-v0"
    """the id of the environment: EVHub-v0 (trained in its 'discrete' action mode), or any registered gymnasium id
    with a Discrete action space, e.g. Snake-v0 or CartPole-v1 ('module:EnvId-v0' imports module first)"""
    vector_mode: Literal["sync", "async"] = "sync"
    """gymnasium envs: 'sync' (SyncVectorEnv, one process) or 'async' (AsyncVectorEnv, one subprocess per env,
    and env stepping overlapped with the gradient steps); ignored for torch-batched envs (EVHub-v0, Snake-v0)"""
    site: str = "caltech"
    """EVHub-v0: site to train on: a shipped site name or a path to a site TOML file"""
    bess_action: Literal["surplus", "setpoint"] = "surplus"
    """meaning of the BESS action: 'surplus' (the PV surplus is always stored; -1 = cover the deficit, the
    self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess times the
    BESS power limit)"""
    total_timesteps: int | None = None
    """total env steps of the experiment (None: preset, 1,000,000 on cpu, 20,000,000 on gpu)"""
    learning_rate: float = 5e-4
    """the learning rate of the optimizer (Adam)"""
    num_envs: int | None = None
    """the number of parallel env copies (None: preset, 32 on cpu, 1024 on gpu)"""
    num_steps: int | None = None
    """env steps per env in each iteration, before the gradient steps (None: preset, 2 on cpu, 1 on gpu)"""
    gradient_steps: int | None = None
    """gradient steps per iteration (None: preset, 2 on cpu and gpu)"""
    buffer_size: int | None = None
    """the replay memory buffer size, transitions (None: preset, 200,000 on cpu, 2,000,000 on gpu)"""
    gamma: float | None = None
    """the discount factor gamma (None: 0.95 on EVHub-v0, a horizon of about a day of hourly steps; 0.99 on
    other envs)"""
    tau: float = 1.0
    """the target network update rate (1.0: hard copy; below 1: Polyak blend at each target update)"""
    target_network_frequency: int | None = None
    """env steps between target network updates, checked once per iteration (None: 5,000 on EVHub-v0, 20,000 on
    Snake-v0, 500 on other envs)"""
    batch_size: int | None = None
    """the batch size of a gradient step, sampled from the replay memory (None: preset, 256 on cpu, 4096 on gpu)"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float | None = None
    """the ending epsilon for exploration (None: 0.05; 0.02 on Snake-v0)"""
    exploration_fraction: float | None = None
    """the fraction of `total_timesteps` it takes from start_e to go end_e (None: 0.5; 0.2 on Snake-v0)"""
    learning_starts: int | None = None
    """env steps before learning starts (None: preset, 10,000 on cpu, 100,000 on gpu; 10,000 on gymnasium envs)"""
    double_q: bool = True
    """use the double-DQN target (online network picks the next action, target network scores it)"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    hidden_size: int | None = None
    """width of the hidden layers of the Q network (None: preset, 128 on cpu, 256 on gpu): the two of the MLP, or
    the one after the CNN torso"""
    cnn_channels: tuple[int, int] | None = None
    """image observations (C, H, W): output channels of the CNN torso's two 3x3 convolutions (None: 32 64; 16 32 on
    Snake-v0, which trains on a CPU)"""
    reward_scale: float | None = None
    """multiplies the env reward before it is stored (the episodic_return curve stays unscaled). None: 10 on
    EVHub-v0, which brings the TD errors to about 1, where the Huber loss turns from quadratic to linear; 1 on
    other envs"""
    socket_features: bool = False
    """feed the per-socket observations to the Q network (off: only the site-level features before them, with
    the EV aggregates; on caltech the 165 per-socket inputs let DQN fit the 2019 sessions and transfer worse
    to the 2021 test split: 1,368 vs 1,060 kg CO2 after 1M steps in tuning runs)"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the Q network (off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    norm_obs: bool | None = None
    """standardise flat observations with statistics gathered during the first learning_starts steps, then frozen
    (None: on, except Snake-v0; image observations are never standardised)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal (the site never terminates): bootstrap through the
    autoreset from the next window's first observation; False treats it as terminal like CleanRL"""
    torch_threads: int | None = None
    """torch CPU threads (None: preset, 1 on cpu: the small net gains nothing from a second thread, and on a busy
    machine spinning threads slowed a run twentyfold; 0 on gpu: torch's default)"""
    compile: bool = False
    """torch.compile the hot functions (action selection, update)"""
    cudagraphs: bool = False
    """capture action selection and the update as CUDA graphs (needs CUDA; capturable Adam, device-tensor lr)"""
    amp: bool = False
    """bf16 autocast of the Q network forward passes"""
    log_every: int = 100
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_discrete_seed{seed} on EVHub-v0, else
    outputs/runs/{exp_name}_{env_id}_seed{seed})"""
    checkpoint_every: int = 2_000
    """iterations between checkpoints (0: only at the end)"""
    save_buffer: bool = False
    """also store the replay buffer in the checkpoint (its filled rows, write position and fill level; large);
    without it a resumed run refills the buffer for learning_starts steps before updating again"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (networks, optimizer, counters, RNG and env state, and the replay
    buffer if it was stored)"""
    eval_split: str = "test"
    """EVHub-v0: split for the final deterministic evaluation ('none' skips it; other envs have none)"""
    max_oom_retries: int = 3
    """halvings allowed after CUDA out-of-memory errors: in the gradient steps batch_size halves while it stays
    >= 64, then num_envs; stepping the envs (or at setup) num_envs halves, which rebuilds the envs (the replay buffer
    is kept). Each warns and trains on to total_timesteps; one more error stops the run with OutOfMemoryBackoffError,
    its last checkpoint kept (0: stop at the first). A replay buffer that does not fit at setup is halved apart
    from these, down to max(num_envs, batch_size) rows"""

    # filled in at runtime
    iteration_steps: int = 0
    """env steps per iteration (computed in runtime: num_envs * num_steps)"""
    num_iterations: int = 0
    """the number of iterations (computed in runtime: total_timesteps // iteration_steps)"""


OBS_WEEKDAY = (2, 3)
"""Indices of the day-of-week features (sin, cos) in EVHub-v0's observation."""

LOSS_NAMES = ("td_loss", "q_values", "grad_norm")
"""Quantities checked for finiteness after each update, in the order of the update's ``bad`` flags."""

OOM_MIN_BATCH_SIZE = 64
"""The smallest batch_size the out-of-memory back-off halves to; below it, num_envs halves instead."""


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class OutOfMemoryBackoffError(RuntimeError):
    """CUDA ran out of memory and the back-off cannot go on (``max_oom_retries`` halvings made, or nothing left to
    halve); training stops, the last checkpoint is kept."""


class NonFiniteLossError(RuntimeError):
    """A loss (or the gradient norm) became NaN or infinite; training stops, the last checkpoint is kept."""


# ---------------------------------------------------------------------------------------------- networks
class ObsNorm(nn.Module):
    """Observation standardisation with running statistics (buffers on the device), frozen by the caller.

    ``update`` folds a batch into the mean/variance in place (no host sync); the training loop stops calling
    it when learning starts, so the Q network sees one fixed input mapping from then on.
    """

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.full((), 1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
        delta = b_mean - self.mean
        tot = self.count + n
        m2 = self.var * self.count + b_var * n + delta.square() * self.count * n / tot
        self.mean.copy_(self.mean + delta * n / tot)
        self.var.copy_(m2 / tot)
        self.count.copy_(tot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)


class Select(nn.Module):
    """Keeps the observation features listed in ``keep`` (the network's inputs)."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


class QNetwork(nn.Module):
    """Raw observations -> Q values ``(B, n_actions)`` float32.

    Flat observations ``(B, obs_dim)``: normalisation (:class:`ObsNorm`), feature choice (:class:`Select`), an MLP
    with two hidden layers of ``hidden`` units. Image observations (``obs_shape`` of 3 dims ``(C, H, W)``, e.g.
    Snake's boards) ``(B, C, H, W)``: a small CNN torso, ``Conv2d(C, c1, 3, padding=1)-ReLU-Conv2d(c1, c2, 3,
    padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden)-ReLU`` with ``(c1, c2) = cnn_channels``, then
    ``Linear(hidden, n_actions)``; the padding keeps the board size, so every cell (a wall next to the head,
    the food) stays in its place up to the linear layer. Images are fed as they are (no ``obs_norm``, no
    ``inputs``: both are ``nn.Identity``).
    """

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: int,
        norm_obs: bool = True,
        inputs: list[int] | None = None,
        obs_shape: tuple[int, ...] | None = None,
        cnn_channels: tuple[int, int] = (32, 64),
    ):
        super().__init__()
        if obs_shape is not None and len(obs_shape) == 3:
            c, h, w = (int(x) for x in obs_shape)
            c1, c2 = (int(x) for x in cnn_channels)
            self.obs_norm = nn.Identity()
            self.select = nn.Identity()
            self.mlp = nn.Sequential(
                nn.Conv2d(c, c1, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(c1, c2, 3, padding=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(c2 * h * w, hidden),
                nn.ReLU(),
                nn.Linear(hidden, n_actions),
            )
            return
        if obs_shape is not None and len(obs_shape) != 1:
            raise ValueError(f"QNetwork takes flat (obs_dim,) or image (C, H, W) observations, got shape {obs_shape}")
        inputs = list(range(obs_dim)) if inputs is None else list(inputs)
        self.obs_norm = ObsNorm(obs_dim) if norm_obs else nn.Identity()
        self.select = Select(inputs) if len(inputs) < obs_dim else nn.Identity()
        self.mlp = nn.Sequential(
            nn.Linear(len(inputs), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_actions),
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.select(self.obs_norm(obs)))


class GreedyHubPolicy(nn.Module):
    """The deterministic policy: obs float32 ``(B, obs_dim)`` -> hub action ``(B, 2)`` of the greedy discrete action.

    Returns ``table[argmax_a Q(obs, a)]`` (rows of :func:`envs.evhub.discrete_action_table`), which an env in
    ``action_mode="hub"`` executes exactly like the discrete env executes the index.
    """

    def __init__(self, qnet: QNetwork, table: torch.Tensor):
        super().__init__()
        self.qnet = qnet
        self.register_buffer("table", table.to(torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, self.qnet(obs).argmax(1))


class GreedyPolicy(nn.Module):
    """The deterministic policy of a non-EVHub env: obs float32 ``(B, *obs_shape)`` -> ``argmax_a Q(obs, a)``,
    action indices int64 ``(B,)``."""

    def __init__(self, qnet: QNetwork):
        super().__init__()
        self.qnet = qnet

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.qnet(obs).argmax(1)


# ---------------------------------------------------------------------------------------------- environments
def env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """gymnasium's spec of ``env_id``; ``"module:EnvId-v0"`` imports ``module`` first (which registers the id).

    Raises:
        gymnasium.error.Error: no env of that id is registered.
    """
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        import importlib

        importlib.import_module(module)
    return gym.spec(env_id)


class GymVectorAdapter:
    """A gymnasium vector env (NumPy) behind the tensor interface of our torch-batched envs.

    Args:
        env: a ``SyncVectorEnv`` or ``AsyncVectorEnv`` made with ``autoreset_mode=SAME_STEP`` (the observation of a
            step that ends an episode is the next episode's first; ``info["final_obs"]`` holds the last one).
        device: where observations, rewards and flags are returned.

    ``reset(seed=...)`` -> ``(obs, info)``, obs float32 ``(num_envs, *obs_shape)`` on ``device``. ``step(actions)``
    takes int64 action indices ``(num_envs,)`` (a tensor on any device; moved to the host as an int64 NumPy array)
    and returns obs float32, reward float32, terminated and truncated bool, all ``(num_envs, ...)`` on ``device``,
    and ``info`` with ``"next_obs_final"``: the observations with the rows of the envs that ended this step
    replaced by their ``final_obs`` (the true next state of the stored transition, for bootstrapping truncations).
    ``step_async(actions)`` / ``step_wait()`` split ``step`` in two (the work runs in the async env's workers in
    between). ``state_dict()`` is None: a NumPy env's state cannot be checkpointed. ``_generator`` is a torch
    generator kept only for the checkpoint's RNG record (the gymnasium envs draw from their own ``np_random``).
    """

    def __init__(self, env: gym.vector.VectorEnv, device: torch.device):
        self.env = env
        self.device = device
        self.num_envs = env.num_envs
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.metadata = env.metadata
        self._generator = torch.Generator()
        self._pending: np.ndarray | None = None

    def _tensor(self, x, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x), device=self.device).to(dtype)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[torch.Tensor, dict]:
        if seed is not None:
            self._generator.manual_seed(seed)
        obs, info = self.env.reset(seed=seed, options=options)
        return self._tensor(obs, torch.float32), info

    def _host_actions(self, actions: torch.Tensor) -> np.ndarray:
        return actions.detach().cpu().numpy().astype(np.int64).reshape(self.num_envs)

    def step_async(self, actions: torch.Tensor) -> None:
        if hasattr(self.env, "step_async"):  # AsyncVectorEnv: the workers start stepping now
            self.env.step_async(self._host_actions(actions))
        else:  # SyncVectorEnv: steps in step_wait
            self._pending = self._host_actions(actions)

    def step_wait(self) -> tuple:
        if hasattr(self.env, "step_async"):
            return self._to_tensors(*self.env.step_wait())
        actions, self._pending = self._pending, None
        return self._to_tensors(*self.env.step(actions))

    def step(self, actions: torch.Tensor) -> tuple:
        return self._to_tensors(*self.env.step(self._host_actions(actions)))

    def _to_tensors(self, obs, reward, terminated, truncated, info) -> tuple:
        obs_t = self._tensor(obs, torch.float32)
        next_obs = obs_t
        mask = info.get("_final_obs")
        if mask is not None and np.any(mask):
            final = np.asarray(obs, dtype=np.float32).copy()
            for i in np.flatnonzero(mask):
                final[i] = info["final_obs"][i]
            next_obs = self._tensor(final, torch.float32)
        info = {"next_obs_final": next_obs}
        return (
            obs_t,
            self._tensor(reward, torch.float32),
            self._tensor(terminated, torch.bool),
            self._tensor(truncated, torch.bool),
            info,
        )

    def state_dict(self) -> None:
        return None

    def close(self) -> None:
        self.env.close()


def make_gym_vector_env(env_id: str, num_envs: int, vector_mode: str, device: torch.device) -> tuple:
    """gymnasium vector env of ``num_envs`` copies of ``env_id`` (SAME_STEP autoreset) behind
    :class:`GymVectorAdapter`. ``vector_mode="async"`` tries ``AsyncVectorEnv`` and falls back to ``SyncVectorEnv``
    if it fails to start (e.g. no fork, or an env factory that does not pickle).

    Returns:
        ``(adapter, mode, warning)``: the mode in use ("sync" or "async") and the fallback's warning (None if none).
    """
    kwargs = {"vector_kwargs": {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}}
    warning = None
    if vector_mode == "async":
        try:
            return GymVectorAdapter(gym.make_vec(env_id, num_envs, vectorization_mode="async", **kwargs), device), "async", None
        except Exception as exc:  # noqa: BLE001 - any failure to start the workers falls back to sync
            warning = (
                f"--vector-mode async: the AsyncVectorEnv of {env_id} failed to start ({type(exc).__name__}: {exc}); "
                "falling back to --vector-mode sync"
            )
    return GymVectorAdapter(gym.make_vec(env_id, num_envs, vectorization_mode="sync", **kwargs), device), "sync", warning


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory and utilisation for logging: ``perf/gpu_mem_allocated_gb``, ``perf/gpu_mem_reserved_gb``,
    ``perf/gpu_mem_peak_gb`` (GB, 1e9 bytes: ``torch.cuda.memory_allocated`` / ``memory_reserved`` /
    ``max_memory_allocated``, host-side counters of the caching allocator, no GPU sync) and ``perf/gpu_util_pct``
    (percent, from NVML via ``pynvml`` where it imports, else NaN). On a non-CUDA device every value is NaN.
    Never raises.
    """
    keys = ("perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct")
    stats = dict.fromkeys(keys, math.nan)
    if device.type != "cuda":
        return stats
    try:
        stats["perf/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        stats["perf/gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        stats["perf/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring never stops training
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        stats["perf/gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no pynvml, no NVML, or another device numbering
        pass
    return stats


# ---------------------------------------------------------------------------------------------- pure pieces
def linear_schedule(start_e: float, end_e: float, duration: float, t: torch.Tensor) -> torch.Tensor:
    """Epsilon at env step ``t`` (a device tensor): linear from ``start_e`` to ``end_e`` over ``duration`` steps,
    then constant. No host sync."""
    slope = (end_e - start_e) / max(float(duration), 1.0)
    eps = start_e + slope * t.to(torch.float32)
    return eps.clamp(min(start_e, end_e), max(start_e, end_e))


def td_target(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    next_q_target: torch.Tensor,
    next_q_online: torch.Tensor | None,
    gamma: float,
) -> torch.Tensor:
    """One-step TD target ``r + gamma * (1 - done) * Q_target(s', a*)``.

    ``a* = argmax Q_online(s', .)`` (double DQN) when ``next_q_online`` is given, else ``argmax Q_target(s', .)``
    (plain DQN: the max of the target network). Shapes: rewards, dones ``(B,)``; Q tables ``(B, n_actions)``.
    """
    if next_q_online is None:
        next_value = next_q_target.max(1).values
    else:
        next_value = next_q_target.gather(1, next_q_online.argmax(1, keepdim=True)).squeeze(1)
    return rewards + gamma * (1.0 - dones) * next_value


@torch.no_grad()
def target_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """``target <- tau * online + (1 - tau) * target`` for parameters (in place; ``tau=1`` is a hard copy);
    buffers (the observation statistics) are copied."""
    for tp, p in zip(target.parameters(), online.parameters()):
        tp.lerp_(p, tau)
    for tb, b in zip(target.buffers(), online.buffers()):
        tb.copy_(b)


BUFFER_FIELDS = ("obs", "next_obs", "actions", "rewards", "dones")
"""The per-transition tensors of the replay buffer (:func:`make_replay_buffer`)."""


def make_replay_buffer(
    size: int, obs_dim: int | tuple[int, ...], device: torch.device, obs_dtype: torch.dtype = torch.float32
) -> dict:
    """Circular replay memory preallocated on ``device``.

    Tensors ``obs``, ``next_obs`` ``(size, obs_dim)`` (``(size, *obs_dim)`` when ``obs_dim`` is a shape tuple, e.g.
    ``(C, H, W)`` images), ``actions`` int64, ``rewards``, ``dones`` ``(size,)``;
    ``pos`` (next row written) and ``count`` (rows filled) are host ints that only the writer changes, and
    ``count_t`` is ``count`` as a device tensor, which the sampler reads (so sampling never syncs and a
    captured update sees the buffer grow).
    """
    shape = (obs_dim,) if isinstance(obs_dim, int) else tuple(obs_dim)
    return {
        "obs": torch.zeros(size, *shape, device=device, dtype=obs_dtype),
        "next_obs": torch.zeros(size, *shape, device=device, dtype=obs_dtype),
        "actions": torch.zeros(size, device=device, dtype=torch.int64),
        "rewards": torch.zeros(size, device=device),
        "dones": torch.zeros(size, device=device),
        "pos": 0,
        "count": 0,
        "count_t": torch.zeros((), device=device),
        "size": size,
    }


def buffer_add(rb: dict, obs, actions, rewards, next_obs, dones) -> None:
    """Write one batch of ``n`` transitions (one per env) at ``pos``, wrapping around; ``n <= size``."""
    n, size = obs.shape[0], rb["size"]
    if n > size:
        raise ValueError(f"buffer_size {size} is smaller than one batch of {n} transitions")
    idx = (torch.arange(n, device=rb["obs"].device) + rb["pos"]) % size
    rb["obs"].index_copy_(0, idx, obs.to(rb["obs"].dtype))
    rb["next_obs"].index_copy_(0, idx, next_obs.to(rb["obs"].dtype))
    rb["actions"].index_copy_(0, idx, actions.to(torch.int64))
    rb["rewards"].index_copy_(0, idx, rewards.to(torch.float32))
    rb["dones"].index_copy_(0, idx, dones.to(torch.float32))
    rb["pos"] = (rb["pos"] + n) % size
    rb["count"] = min(rb["count"] + n, size)
    rb["count_t"].fill_(rb["count"])


def buffer_state(rb: dict) -> dict:
    """The replay buffer's contents for a checkpoint: only the ``count`` filled rows, copied to the host.

    Returns ``{"pos", "count", "size"}`` (ints) and the tensors ``obs``, ``next_obs`` ``(count, obs_dim)``,
    ``actions`` int64, ``rewards``, ``dones`` ``(count,)`` on the CPU, each with its own storage (a slice of the
    preallocated tensor would make ``torch.save`` write all ``size`` rows). While the buffer has not wrapped
    around, its filled rows are ``0 .. count - 1``; once full, all ``size`` rows are filled.
    """
    n = rb["count"]
    state = {key: rb[key][:n].to("cpu", copy=True) for key in BUFFER_FIELDS}
    return {"pos": rb["pos"], "count": n, "size": rb["size"], **state}


def load_buffer_state(rb: dict, state: dict) -> None:
    """Restore :func:`buffer_state` into the buffer ``rb`` from :func:`make_replay_buffer` (in place).

    With the same ``size`` the rows, ``pos`` and ``count`` become exactly the saved ones. With another size the
    buffer gets the newest ``min(count, size)`` saved transitions, oldest first from row 0. Raises ``ValueError``
    if the stored rows do not fit the buffer (another ``obs_dim``) or ``count`` disagrees with the stored rows.
    """
    n, old_size, pos = int(state["count"]), int(state["size"]), int(state["pos"])
    for key in BUFFER_FIELDS:
        if state[key].shape[0] != n or state[key].shape[1:] != rb[key].shape[1:]:
            raise ValueError(
                f"stored replay buffer field {key!r} has shape {tuple(state[key].shape)}, expected "
                f"({n}, {', '.join(map(str, rb[key].shape[1:]))}) for this buffer"
            )
    if old_size == rb["size"]:
        for key in BUFFER_FIELDS:
            rb[key][:n].copy_(state[key])
        rb["pos"], rb["count"] = pos, n
    else:
        # chronological order: a full (wrapped) buffer's oldest row is at pos, a filling one's at row 0
        order = torch.arange(n) if n < old_size else (torch.arange(n) + pos) % n
        keep = order[max(0, n - rb["size"]) :]
        for key in BUFFER_FIELDS:
            rb[key][: len(keep)].copy_(state[key].index_select(0, keep.to(state[key].device)))
        rb["pos"], rb["count"] = len(keep) % rb["size"], len(keep)
    rb["count_t"].fill_(rb["count"])


def buffer_sample(rb: dict, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Uniform sample of ``batch_size`` filled rows (with replacement): ``obs, actions, rewards, next_obs, dones``."""
    u = torch.rand(batch_size, device=rb["obs"].device)
    idx = (u * rb["count_t"]).long().clamp(max=rb["size"] - 1)
    return (
        rb["obs"][idx].float(),
        rb["actions"][idx],
        rb["rewards"][idx],
        rb["next_obs"][idx].float(),
        rb["dones"][idx],
    )


# ---------------------------------------------------------------------------------------------- hot paths
def act(qnet: QNetwork, obs: torch.Tensor, epsilon: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Epsilon-greedy actions ``(B,)`` int64 for raw observations ``obs``; ``epsilon`` is a device scalar."""
    with torch.no_grad(), torch.autocast(obs.device.type, torch.bfloat16, enabled=amp):
        q = qnet(obs)
    greedy = q.argmax(1)
    random_actions = torch.randint(0, q.shape[1], greedy.shape, device=obs.device)
    explore = torch.rand(greedy.shape, device=obs.device) < epsilon
    return torch.where(explore, random_actions, greedy)


def update(
    qnet: QNetwork,
    target: QNetwork,
    optimizer: torch.optim.Optimizer,
    rb: dict,
    batch_size: int,
    gamma: float,
    double_q: bool,
    max_grad_norm: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """One gradient step of the Huber TD loss on a uniform replay sample.

    Returns device tensors ``td_loss``, ``q_values`` (mean Q of the taken actions), ``grad_norm`` (before
    clipping) and ``bad``: ``(len(LOSS_NAMES),)`` bools, True where that quantity is non-finite.
    """
    obs, actions, rewards, next_obs, dones = buffer_sample(rb, batch_size)
    device_type = obs.device.type
    with torch.no_grad():
        with torch.autocast(device_type, torch.bfloat16, enabled=amp):
            next_q_target = target(next_obs)
            next_q_online = qnet(next_obs) if double_q else None
        y = td_target(rewards, dones, next_q_target.float(), None if next_q_online is None else next_q_online.float(), gamma)
    with torch.autocast(device_type, torch.bfloat16, enabled=amp):
        q = qnet(obs)
    q_taken = q.float().gather(1, actions[:, None]).squeeze(1)
    loss = F.smooth_l1_loss(q_taken, y)
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(qnet.parameters(), max_grad_norm)
    optimizer.step()
    stats = torch.stack([loss.detach(), q_taken.detach().mean(), grad_norm.detach()])
    return {"td_loss": stats[0], "q_values": stats[1], "grad_norm": stats[2], "bad": ~torch.isfinite(stats)}


def rollout(
    env,
    qnet: QNetwork,
    next_obs: torch.Tensor,
    rb: dict,
    stats: dict,
    epsilon: torch.Tensor,
    num_steps: int,
    update_norm: bool,
    bootstrap_truncation: bool,
    reward_scale: float,
    amp: bool,
    act_fn=None,
) -> torch.Tensor:
    """Step every env ``num_steps`` times epsilon-greedily, storing the transitions; returns the last obs.

    No host sync. ``update_norm`` (a host flag: still before ``learning_starts``) folds each observation into
    the Q network's observation statistics. ``act_fn`` picks the actions: :func:`act` (the default) or its
    compiled / CUDA-graphed version, called as ``act_fn(qnet, obs, epsilon, amp)``.
    """
    act_fn = act if act_fn is None else act_fn
    for _ in range(num_steps):
        action = choose_actions(qnet, next_obs, epsilon, update_norm, amp, act_fn)
        next_obs = record_step(rb, stats, next_obs, action, env.step(action), bootstrap_truncation, reward_scale)
    return next_obs


def choose_actions(qnet: QNetwork, obs: torch.Tensor, epsilon: torch.Tensor, update_norm: bool, amp: bool, act_fn=None):
    """The epsilon-greedy actions ``(B,)`` int64 of one env step, first folding ``obs`` into the observation
    statistics while ``update_norm`` (see :func:`rollout`)."""
    if update_norm and isinstance(qnet.obs_norm, ObsNorm):
        qnet.obs_norm.update(obs)
    return (act if act_fn is None else act_fn)(qnet, obs, epsilon, amp)


def record_step(
    rb: dict, stats: dict, obs: torch.Tensor, action: torch.Tensor, result: tuple, bootstrap_truncation: bool,
    reward_scale: float,
) -> torch.Tensor:
    """Store the transition of one env step and update the episode statistics; returns the next observation.

    ``result`` is the env's ``(obs2, reward, terminated, truncated, info)``. The stored next state is
    ``info["next_obs_final"]`` where the env gives it (:class:`GymVectorAdapter`: ``final_obs`` of the envs that
    ended), else ``obs2`` (our torch-batched envs: the next episode's first observation after an auto-reset). The
    KPI sums (``co2_kg``, ``unserved_kwh``) are added only where ``info`` has them (EVHub-v0). No host sync.
    """
    obs2, reward, terminated, truncated, info = result
    obs2 = obs2.to(torch.float32)
    reward = reward.to(torch.float32)
    done = terminated if bootstrap_truncation else terminated | truncated
    stored_next = info["next_obs_final"] if "next_obs_final" in info else obs2
    buffer_add(rb, obs, action, reward * reward_scale, stored_next, done)
    episode_end = (terminated | truncated).to(torch.float64)
    stats["ep_return"] += reward
    if "co2_kg" in info:
        stats["ep_co2_kg"] += info["co2_kg"]
        stats["ep_unserved_kwh"] += info["unserved_kwh"]
    stats["ep_length"] += 1.0
    stats["n_done"] += episode_end.sum()
    for key in ("return", "co2_kg", "unserved_kwh", "length"):
        stats[f"sum_{key}"] += (stats[f"ep_{key}"] * episode_end).sum()
        stats[f"ep_{key}"] *= 1.0 - episode_end
    return obs2


class CudaGraphed:
    """Runs ``fn(*tensors)`` eagerly for ``warmup`` calls on a side stream, then captures it as a CUDA graph;
    later calls copy their tensor arguments into the captured inputs and replay. The outputs are the graph's
    static tensors (overwritten by the next call): read or copy them before calling again."""

    def __init__(self, fn, warmup: int = 3):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.graph = None
        self.static_in: tuple = ()
        self.static_out = None

    def __call__(self, *args: torch.Tensor):
        if self.graph is None:
            if self.calls < self.warmup:
                self.calls += 1
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    out = self.fn(*args)
                torch.cuda.current_stream().wait_stream(stream)
                return out
            self.static_in = tuple(a.clone() for a in args)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.fn(*self.static_in)
        for s, a in zip(self.static_in, args):
            s.copy_(a)
        self.graph.replay()
        return self.static_out


# ---------------------------------------------------------------------------------------------- helpers
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


def is_torch_batched(spec: gym.envs.registration.EnvSpec) -> bool:
    """Whether ``spec`` is a torch-batched env like ours: it has a ``vector_entry_point`` whose constructor takes a
    ``device`` argument (``EVHub-v0``, ``Snake-v0``). gymnasium's own vector entry points (``CartPole-v1``'s NumPy
    ``CartPoleVectorEnv``) take none; those envs run in gymnasium's Sync/AsyncVectorEnv like any other."""
    if spec.vector_entry_point is None:
        return False
    import inspect

    creator = spec.vector_entry_point
    if isinstance(creator, str):
        creator = gym.envs.registration.load_env_creator(creator)
    try:
        return "device" in inspect.signature(creator).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def is_evhub(env_id: str) -> bool:
    """Whether ``env_id`` names ``EVHub-v0`` (with or without a ``module:`` prefix)."""
    return env_id.split(":")[-1] == "EVHub-v0"


def env_defaults(env_id: str, preset: str) -> dict:
    """The :data:`ENV_DEFAULTS` of ``env_id`` (``"*"`` for an env without its own entry, EVHub-v0 excepted), with
    its ``"<env_id>/<preset>"`` entry (sizes for one device preset) on top."""
    name = env_id.split(":")[-1]
    base = ENV_DEFAULTS.get(name, ENV_DEFAULTS["*"])
    return {**base, **ENV_DEFAULTS.get(f"{name}/{preset}", {})}


def preset_table(args: Args) -> str:
    """The :data:`PRESETS` as one Markdown table: a row per field, a column per device preset (the one picked
    marked ``*``) and the value in use (``args`` resolved). For an env with its own defaults (:func:`env_defaults`,
    e.g. ``Snake-v0`` or any env other than EVHub-v0) a column of them comes before ``used``, with rows for the
    fields only they set; they take precedence over the preset's."""
    names = list(PRESETS)
    env = env_defaults(args.env_id, args.preset) if not is_evhub(args.env_id) else {}
    keys = list(PRESETS[names[0]]) + [k for k in env if k not in PRESETS[names[0]]]
    env_col = [args.env_id.split(":")[-1]] if env else []
    head = "|field|" + "|".join([*(f"{n}{'*' if n == args.preset else ''}" for n in names), *env_col]) + "|used|"
    rows = [
        f"|{key}|" + "|".join([*(str(PRESETS[n].get(key, "")) for n in names), *(str(env.get(key, "")) for _ in env_col)])
        + f"|{getattr(args, key)}|"
        for key in keys
    ]
    return "\n".join([head, "|-" * (len(names) + len(env_col) + 2) + "|", *rows])


def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the env's defaults (:func:`env_defaults`), then the preset
    (:data:`PRESETS`), then :data:`FIELD_DEFAULTS`, and compute the runtime sizes."""
    preset = args.preset.lower()
    if preset == "auto":
        preset = "gpu" if device.type == "cuda" else "cpu"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: expected 'auto', 'cpu' or 'gpu'")
    args.preset = preset
    for key, value in env_defaults(args.env_id, preset).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in FIELD_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cnn_channels = tuple(int(c) for c in args.cnn_channels)
    if args.output_dir is None:
        if is_evhub(args.env_id):
            name = f"{args.exp_name}_{Path(args.site).stem}_discrete_seed{args.seed}"
        else:
            name = f"{args.exp_name}_{args.env_id.replace(':', '_').replace('/', '_')}_seed{args.seed}"
        args.output_dir = str(Path("outputs") / "runs" / name)
    args.iteration_steps = int(args.num_envs * args.num_steps)
    args.num_iterations = max(1, args.total_timesteps // args.iteration_steps)
    if args.buffer_size < args.num_envs:
        raise ValueError(f"buffer_size={args.buffer_size} must hold at least one step of the {args.num_envs} envs")
    if args.cudagraphs and device.type != "cuda":
        raise ValueError("--cudagraphs needs CUDA (no CUDA device in use; drop --cudagraphs or enable --cuda)")
    return args


def rng_state(env) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "env_generator": env._generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(env, state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    env._generator.set_state(state["env_generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def make_buffer(args: Args, obs_dim: int | tuple[int, ...], device: torch.device, notes: list[str] | None = None) -> dict:
    """:func:`make_replay_buffer` of ``args.buffer_size`` rows; on CUDA out-of-memory halve ``args.buffer_size``
    (in place) and retry, down to ``max(num_envs, batch_size)`` rows, with a warning on stderr for each halving
    (also appended to ``notes``).

    Raises:
        OutOfMemoryBackoffError: not even a buffer of that many rows fits.
    """
    while True:
        try:
            return make_replay_buffer(args.buffer_size, obs_dim, device)
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
        floor = max(args.num_envs, args.batch_size)
        if args.buffer_size // 2 < floor:
            raise OutOfMemoryBackoffError(
                f"CUDA out of memory at setup for a replay buffer of {args.buffer_size:,} rows, and halving it would "
                f"leave fewer than max(num_envs, batch_size) = {floor:,}; the run stopped before training. Ask for "
                f"less memory: a smaller --buffer-size, --num-envs or --batch-size.\nThe error: {error}"
            )
        free_device_memory(device)
        message = (
            f"CUDA out of memory at setup: buffer_size {args.buffer_size:,} -> {args.buffer_size // 2:,}; continuing"
        )
        print(f"warning: {message}", file=sys.stderr, flush=True)
        if notes is not None:
            notes.append(message)
        args.buffer_size //= 2


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


def halve_after_oom(args: Args, history: list[str], where: str, error: str, ckpt: Path, in_update: bool) -> str:
    """Back off after a CUDA out-of-memory error: halve ``args.batch_size`` or ``args.num_envs`` (in place).

    In the gradient steps (``in_update``) the batch halves while it stays at least :data:`OOM_MIN_BATCH_SIZE`;
    otherwise, and at setup or while stepping the envs, num_envs halves, and with it ``iteration_steps`` (the
    caller rebuilds the envs; the gradient steps per env step double).

    Args:
        args: the run's resolved arguments, changed in place.
        history: the warnings of the halvings made so far in this run (their number counts against
            ``args.max_oom_retries``); the new warning is appended.
        where: where the error struck, e.g. ``"at setup"`` or ``"at global_step 1024 (iteration 128), ..."``.
        error: the first line of the out-of-memory error (see :func:`out_of_memory_message`).
        ckpt: the run's checkpoint path, named in the error.
        in_update: the error struck in the gradient steps.

    Returns:
        the warning: the old and the new value.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` halvings were made already, or there is nothing left to halve
            (one env, and in the gradient steps a batch at its floor); ``args`` is left as it was.
    """
    n, b = args.num_envs, args.batch_size
    if len(history) >= args.max_oom_retries:
        reason = f"max_oom_retries={args.max_oom_retries} halvings were made already"
    elif in_update and b // 2 >= OOM_MIN_BATCH_SIZE:
        message = f"CUDA out of memory {where}: batch_size {b} -> {b // 2}; continuing"
        args.batch_size = b // 2
        history.append(message)
        return message
    elif n >= 2:
        message = (
            f"CUDA out of memory {where}: num_envs {n} -> {n // 2} (env steps per iteration {args.iteration_steps} -> "
            f"{n // 2 * args.num_steps}); continuing"
        )
        args.num_envs, args.iteration_steps = n // 2, n // 2 * args.num_steps
        history.append(message)
        return message
    else:
        floor = f" and batch_size {b} would drop below {OOM_MIN_BATCH_SIZE}" if in_update else ""
        reason = f"num_envs {n} cannot be halved{floor}"
    kept = f"the last good checkpoint {ckpt} is left untouched" if ckpt.exists() else "no checkpoint was written"
    tried = "".join(f"\n  {h}" for h in history) if history else " none"
    raise OutOfMemoryBackoffError(
        f"CUDA out of memory {where} with num_envs {n}, batch_size {b} and buffer_size {args.buffer_size:,}, and no "
        f"further back-off: {reason}. Training stopped; {kept}.\n"
        f"Halvings made:{tried}\n"
        f"Ask for less memory: a smaller --num-envs, --batch-size, --buffer-size or --hidden-size, no --cudagraphs "
        f"or --compile; or allow more halvings with --max-oom-retries.\n"
        f"The error: {error}"
    )


def export_policy(qnet: QNetwork, obs_dim: int | tuple[int, ...], out_dir: Path, hub: bool = True) -> Path:
    """Save the greedy policy for code that does not import ``algos``: with ``hub`` the hub-action policy of
    EVHub-v0 (:class:`GreedyHubPolicy`), else the action-index policy (:class:`GreedyPolicy`); ``obs_dim`` is the
    observation size or shape.

    ``torch.export`` with a dynamic batch dimension to ``policy.pt2``; if export fails, a TorchScript trace to
    ``policy.pt``. Either is written atomically (temporary file, then rename). Returns the written path.
    """
    net = copy.deepcopy(qnet)
    module = (GreedyHubPolicy(net, discrete_action_table()) if hub else GreedyPolicy(net)).cpu().float().eval()
    example = torch.zeros(2, *((obs_dim,) if isinstance(obs_dim, int) else tuple(obs_dim)))
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(module, (example,), dynamic_shapes={"obs": {0: batch}})
        path = out_dir / "policy.pt2"
        atomic_write(path, lambda tmp: torch.export.save(program, tmp), suffix=".tmp.pt2")
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        traced = torch.jit.trace(module, example)
        atomic_write(path, lambda tmp: traced.save(str(tmp)))
    return path


def metrics_row(
    global_step: int, wall_s: float, sps: float, ep: dict, losses: dict, epsilon: float, lr: float, num_envs: int,
    batch_size: int, gpu: dict | None = None,
) -> dict:
    """One row of ``metrics.parquet`` from host numbers: episode means ``ep``, update ``losses``, epsilon, learning
    rate, the sizes in use (smaller than asked for after a halving for lack of memory) and the :func:`gpu_stats`
    ``gpu`` (columns without the ``perf/`` prefix; NaN on the CPU)."""
    gpu = gpu_stats(torch.device("cpu")) if gpu is None else gpu
    return {
        "global_step": global_step,
        "wall_s": wall_s,
        "sps": sps,
        "episodic_return": ep["return"],
        "episodic_co2_kg": ep["co2_kg"],
        "episodic_unserved_kwh": ep["unserved_kwh"],
        "td_loss": losses["td_loss"],
        "q_values": losses["q_values"],
        "grad_norm": losses["grad_norm"],
        "epsilon": epsilon,
        "learning_rate": lr,
        "num_envs": num_envs,
        "batch_size": batch_size,
        "episodic_length": ep.get("length", math.nan),
        **{key.removeprefix("perf/"): value for key, value in gpu.items()},
    }


# ---------------------------------------------------------------------------------------------- main
def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy"}`` (path of the exported policy),
        ``"num_envs"``, ``"batch_size"`` and ``"buffer_size"`` (the sizes trained with at the end: smaller than asked
        for after halvings for lack of CUDA memory) and, unless ``eval_split`` is ``"none"``, ``"eval"``: the KPI
        row (a one-row DataFrame).

    Raises:
        NonFiniteLossError: a loss became NaN or infinite.
        OutOfMemoryBackoffError: CUDA ran out of memory once more after ``max_oom_retries`` halvings (or with
            nothing left to halve); the last checkpoint is kept.
    """
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    spec = env_spec(args.env_id)  # imports the module of a "module:EnvId" id
    evhub = is_evhub(args.env_id)
    torch_batched = is_torch_batched(spec)
    args = resolve_args(args, device)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    if args.resume and not ckpt_path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before the first GEMM
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    site = envs.load_site(args.site) if evhub else None
    env_notes: list[str] = []  # warnings about the env set-up (async fallback), for TensorBoard text "warnings"
    if torch_batched and args.vector_mode != "sync":
        print(f"note: --vector-mode {args.vector_mode} is ignored for the torch-batched env {args.env_id}")

    def build_envs() -> tuple:
        """The envs and the episode statistics, sized by num_envs: ``(env, stats)``."""
        if evhub:
            env = gym.make_vec(
                args.env_id,
                num_envs=args.num_envs,
                vectorization_mode="vector_entry_point",
                site=site,
                split="train",
                action_mode="discrete",
                device=device,
                bess_action=args.bess_action,
            )
            env = getattr(env, "unwrapped", env)
        elif torch_batched:
            env = gym.make_vec(args.env_id, num_envs=args.num_envs, vectorization_mode="vector_entry_point", device=device)
            env = getattr(env, "unwrapped", env)
        else:
            env, mode, warning = make_gym_vector_env(args.env_id, args.num_envs, args.vector_mode, device)
            if warning is not None:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
                env_notes.append(warning)
                args.vector_mode = mode
        if not isinstance(env.single_action_space, gym.spaces.Discrete):
            if hasattr(env, "close"):
                env.close()
            raise ValueError(
                f"DQN needs a Discrete action space; {args.env_id} has {env.single_action_space}. "
                "Use algos/ppo.py, algos/a2c.py or algos/sac.py for continuous (Box) actions."
            )
        return env, make_episode_stats(args.num_envs, device)

    oom_history: list[str] = []  # one warning per halving of batch_size or num_envs after a CUDA out-of-memory error
    oom_notes: list[str] = []  # every out-of-memory warning, replay buffer included, for TensorBoard

    def build_envs_backing_off(where: str) -> tuple:
        """:func:`build_envs`, halving num_envs after each out-of-memory error while building; raises
        :class:`OutOfMemoryBackoffError` when that must stop."""
        while True:
            try:
                return build_envs()
            except RuntimeError as exc:
                error = out_of_memory_message(exc)
                if error is None:
                    raise
            free_device_memory(device)
            message = halve_after_oom(args, oom_history, where, error, ckpt_path, in_update=False)
            print(f"warning: {message}", file=sys.stderr, flush=True)
            oom_notes.append(message)

    env, stats = build_envs_backing_off("at setup")
    if oom_history:  # num_envs was halved: the iterations of the run change size
        args.num_iterations = max(1, args.total_timesteps // args.iteration_steps)
    obs_shape = tuple(int(x) for x in env.single_observation_space.shape)
    if len(obs_shape) not in (1, 3):
        raise ValueError(
            f"DQN takes flat (obs_dim,) or image (C, H, W) observations; {args.env_id} has {env.single_observation_space}"
        )
    obs_dim = int(np.prod(obs_shape))
    n_actions = int(env.single_action_space.n)
    # what the replay buffer and the exported policy take: the size of flat observations, the shape of images
    obs_size = obs_dim if len(obs_shape) == 1 else obs_shape
    overlap = not torch_batched and args.vector_mode == "async"  # env stepping overlapped with the gradient steps

    inputs = None
    if evhub:  # EVHub-v0's feature choice: the site-level features, optionally the sockets and the weekday
        inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
        if not args.weekday_features:
            inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    qnet = QNetwork(obs_dim, n_actions, args.hidden_size, args.norm_obs, inputs, obs_shape, args.cnn_channels).to(device)
    target = copy.deepcopy(qnet)
    for p in target.parameters():
        p.requires_grad_(False)
    lr = torch.tensor(args.learning_rate, device=device) if args.cudagraphs else args.learning_rate
    optimizer = torch.optim.Adam(qnet.parameters(), lr=lr, capturable=args.cudagraphs)
    rb = make_buffer(args, obs_size, device, oom_notes)

    next_obs, _ = env.reset(seed=args.seed)
    next_obs = next_obs.to(torch.float32)
    global_step, start_iteration, train_wall_prev = 0, 1, 0.0
    rows: list[dict] = []
    buffer_restored = False
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file
        qnet.load_state_dict(ckpt["qnet"])
        target.load_state_dict(ckpt["target"])
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step, start_iteration = int(ckpt["global_step"]), int(ckpt["iteration"]) + 1
        train_wall_prev = float(ckpt.get("train_wall_s", 0.0))
        set_rng_state(env, ckpt["rng"])
        if ckpt.get("env_state") is None:
            print(f"resume: the state of the gymnasium env {args.env_id} cannot be stored; envs start new episodes")
        elif ckpt.get("num_envs") == args.num_envs:
            env.load_state_dict(ckpt["env_state"])
            next_obs = ckpt["next_obs"].to(device)
            for key, value in ckpt["episode_stats"].items():
                stats[key].copy_(value)
        else:
            print(f"resume: num_envs changed ({ckpt.get('num_envs')} -> {args.num_envs}); envs start new episodes")
        if ckpt.get("replay_buffer") is not None:
            load_buffer_state(rb, ckpt["replay_buffer"])
            buffer_restored = True
        if (out_dir / "metrics.parquet").is_file():
            old = pd.read_parquet(out_dir / "metrics.parquet")
            rows = old[old.global_step <= global_step].to_dict("records")
        restored = f"buffer {rb['count']:,} rows restored" if buffer_restored else "buffer not stored, refilling it"
        print(f"resumed from {ckpt_path} at global_step {global_step}, iteration {start_iteration - 1}, {restored}")
        # the steps left, in iterations of this run's size (the checkpoint's may differ: another --num-envs, or a
        # run that halved num_envs after running out of memory)
        args.num_iterations = start_iteration - 1 + max(0, args.total_timesteps - global_step) // args.iteration_steps
    # a fresh run, or one resumed with its replay buffer, updates from learning_starts on (as if never stopped);
    # one resumed without the buffer refills it for learning_starts steps first
    learn_from = global_step + args.learning_starts if args.resume and not buffer_restored else args.learning_starts
    norm_frozen = global_step >= args.learning_starts

    def bind_hot_functions() -> tuple:
        """:func:`act` and :func:`update`, compiled / CUDA-graphed as the speed switches say: ``(act_fn, update_fn)``
        with their signatures. Called again after a halving of batch_size or num_envs: graphs are captured for one
        shape and batch size."""
        act_fn, update_fn = act, update
        if args.compile:
            # random numbers from eager's kernels: a seed gives the same run with and without --compile
            torch._inductor.config.fallback_random = True
            act_fn = torch.compile(act_fn)
            update_fn = torch.compile(update_fn)
        if args.cudagraphs:
            amp, bs, gamma, dq, mgn = args.amp, args.batch_size, args.gamma, args.double_q, args.max_grad_norm
            inner_act, inner_update = act_fn, update_fn
            graphed_act = CudaGraphed(lambda obs, eps: inner_act(qnet, obs, eps, amp))
            graphed_update = CudaGraphed(lambda: inner_update(qnet, target, optimizer, rb, bs, gamma, dq, mgn, amp))
            act_fn = lambda q, obs, eps, amp_=False: graphed_act(obs, eps)  # noqa: E731
            update_fn = lambda *a, **k: graphed_update()  # noqa: E731
        return act_fn, update_fn

    act_fn, update_fn = bind_hot_functions()

    def shown_args() -> dict:
        """The resolved arguments this env reads (all but :data:`EVHUB_ONLY_ARGS` for envs other than EVHub-v0)."""
        return {k: v for k, v in dataclasses.asdict(args).items() if evhub or k not in EVHUB_ONLY_ARGS}

    def hyperparameters() -> str:
        """The resolved arguments as a Markdown table (TensorBoard text)."""
        return "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in shown_args().items()))

    hparams = shown_args()
    writer = SummaryWriter(str(out_dir))
    writer.add_text("hyperparameters", hyperparameters())
    writer.add_text("presets", preset_table(args))
    for message in oom_notes:  # halvings at setup
        writer.add_text("oom", message, global_step)
    for message in env_notes:  # the async env fell back to sync
        writer.add_text("warnings", message, global_step)
    where = f"site={args.site}" if evhub else f"obs {obs_shape} ({'CNN' if len(obs_shape) == 3 else 'MLP'})"
    kind = "torch-batched" if torch_batched else f"gymnasium {args.vector_mode}{', overlapped' if overlap else ''}"
    print(f"DQN on {args.env_id} ({kind}, discrete, {n_actions} actions) {where} device={device} preset={args.preset}")
    print(f"presets (* = the one in use; any field can be set on the command line):\n{preset_table(args)}")
    width = max(len(k) for k in hparams)
    print("hyperparameters:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in hparams.items()))
    print(
        f"  {args.num_envs} envs x {args.num_steps} steps + {args.gradient_steps} gradient steps per iteration, "
        f"{args.num_iterations} iterations, {args.total_timesteps:,} steps; output {out_dir}",
        flush=True,
    )
    if not evhub and args.eval_split.lower() != "none":
        print(f"note: eval_split={args.eval_split!r} is ignored: {args.env_id} has no splits (no final evaluation)")

    def checkpoint(iteration: int, train_wall: float) -> None:
        check_finite(bad_any, first_bad_step, ckpt_path)
        save_checkpoint(
            ckpt_path,
            qnet=qnet.state_dict(),
            target=target.state_dict(),
            optimizer=optimizer.state_dict(),
            global_step=global_step,
            iteration=iteration,
            train_wall_s=train_wall,
            args=dataclasses.asdict(args),
            num_envs=args.num_envs,
            rng=rng_state(env),
            env_state=env.state_dict(),  # None for a gymnasium env
            next_obs=next_obs,
            episode_stats=stats,
            replay_buffer=buffer_state(rb) if args.save_buffer else None,
        )

    step_t = torch.full((), float(global_step), device=device)
    epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step_t)
    bad_any = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    nan = torch.full((), math.nan, device=device)
    out = {"td_loss": nan, "q_values": nan, "grad_norm": nan}
    start_time = time.perf_counter()
    session_start_step = global_step
    sps = float(rows[-1]["sps"]) if rows else 0.0  # a resumed run that has nothing left to train keeps its SPS
    iteration = start_iteration - 1
    n_oom_logged = len(oom_notes)
    # steady-state SPS: timed over the second half of this session's iterations, past compilation, CUDA-graph
    # capture and the first updates (after a halving of num_envs or batch_size: of the iterations left)
    half_iteration = start_iteration + (args.num_iterations - start_iteration + 1) // 2
    steady_start: tuple[float, int] | None = None
    bar = tqdm(
        initial=start_iteration - 1,
        total=args.num_iterations,
        disable=not sys.stderr.isatty(),
        desc="dqn",
    )
    try:
        while iteration < args.num_iterations:
            iteration += 1
            if iteration == half_iteration:
                steady_start = (synced_clock(device), global_step)
            epsilon.copy_(linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step_t))
            oom_error, oom_in_update = None, False
            pending = None  # overlap: the last step's (obs, actions), sent with step_async, collected after the updates
            try:
                next_obs = rollout(
                    env, qnet, next_obs, rb, stats, epsilon, args.num_steps - 1 if overlap else args.num_steps,
                    not norm_frozen, args.bootstrap_truncation, args.reward_scale, args.amp, act_fn=act_fn,
                )  # fmt: skip
                if overlap:
                    pending = (next_obs, choose_actions(qnet, next_obs, epsilon, not norm_frozen, args.amp, act_fn))
                    env.step_async(pending[1])
            except RuntimeError as exc:
                oom_error = out_of_memory_message(exc)
                if oom_error is None:
                    raise

            if oom_error is None:
                prev_step = global_step
                global_step += args.iteration_steps
                step_t += args.iteration_steps
                if global_step >= learn_from:
                    if not norm_frozen:  # the statistics freeze when learning starts; the target copies them
                        norm_frozen = True
                        target_update(target, qnet, 1.0)
                    try:
                        for _ in range(args.gradient_steps):
                            out = update_fn(qnet, target, optimizer, rb, args.batch_size, args.gamma, args.double_q, args.max_grad_norm, args.amp)
                            first_bad_step = torch.where((first_bad_step < 0) & out["bad"].any(), global_step, first_bad_step)
                            bad_any |= out["bad"]
                    except RuntimeError as exc:
                        oom_error, oom_in_update = out_of_memory_message(exc), True
                        if oom_error is None:
                            raise
                    if global_step // args.target_network_frequency > prev_step // args.target_network_frequency:
                        target_update(target, qnet, args.tau)
                if pending is not None:  # the overlapped env step: collect it, then store its transition
                    next_obs = record_step(
                        rb, stats, pending[0], pending[1], env.step_wait(), args.bootstrap_truncation, args.reward_scale
                    )
                    pending = None

            if oom_error is not None:
                # out of memory. Stepping the envs: those steps are dropped (not counted; the transitions already
                # stored stay in the buffer), the envs are rebuilt with half as many copies and the iteration is
                # repeated. In the gradient steps: the env steps stand, the iteration's remaining gradient steps are
                # skipped, and batch_size halves (at its floor: num_envs, as above). The replay buffer is kept; the
                # totals of finished episodes carry over.
                where = f"at global_step {global_step} (iteration {iteration}), " + (
                    "in the gradient steps" if oom_in_update else "stepping the envs"
                )
                if not oom_in_update:
                    iteration -= 1
                n_envs = args.num_envs
                act_fn = update_fn = None
                message = halve_after_oom(args, oom_history, where, oom_error, ckpt_path, oom_in_update)
                print(f"warning: {message}", file=sys.stderr, flush=True)
                oom_notes.append(message)
                if args.num_envs != n_envs:
                    generator = env._generator.get_state()  # the new envs go on drawing windows where these stopped
                    totals = {k: v for k, v in stats.items() if k == "n_done" or k.startswith("sum_")}
                    if pending is not None:  # an overlapped step still out: collect (and drop) it
                        env.step_wait()
                    if isinstance(env, GymVectorAdapter):
                        env.close()
                    env = stats = next_obs = pending = None
                    free_device_memory(device)
                    env, stats = build_envs_backing_off(where)
                    env._generator.set_state(generator)
                    for key, value in totals.items():
                        stats[key].copy_(value)
                    next_obs, _ = env.reset()
                    next_obs = next_obs.to(torch.float32)
                else:
                    free_device_memory(device)
                act_fn, update_fn = bind_hot_functions()
                args.num_iterations = iteration + max(1, (args.total_timesteps - global_step) // args.iteration_steps)
                half_iteration, steady_start = iteration + 1 + (args.num_iterations - iteration) // 2, None
                bar.total = args.num_iterations
                for message in oom_notes[n_oom_logged:]:
                    writer.add_text("oom", message, global_step)
                n_oom_logged = len(oom_notes)
                if not oom_in_update:
                    continue
            bar.update()

            last = iteration == args.num_iterations
            if iteration % args.log_every == 0 or last:
                check_finite(bad_any, first_bad_step, ckpt_path)  # host sync
                losses_host = {k: float(out[k]) for k in ("td_loss", "q_values", "grad_norm")}
                eps_host = float(epsilon)
                n_done = float(stats["n_done"])
                ep = {k: float(stats[f"sum_{k}"]) / n_done if n_done else math.nan for k in ("return", "co2_kg", "unserved_kwh", "length")}
                if not evhub:  # the KPIs exist only on EVHub-v0
                    ep["co2_kg"] = ep["unserved_kwh"] = math.nan
                for key in ("n_done", "sum_return", "sum_co2_kg", "sum_unserved_kwh", "sum_length"):
                    stats[key].zero_()
                wall = time.perf_counter() - start_time
                sps = (global_step - session_start_step) / max(wall, 1e-9)
                if n_done:
                    writer.add_scalar("charts/episodic_return", ep["return"], global_step)
                    writer.add_scalar("charts/episodic_length", ep["length"], global_step)
                    if evhub:
                        writer.add_scalar("charts/episodic_co2_kg", ep["co2_kg"], global_step)
                        writer.add_scalar("charts/episodic_unserved_kwh", ep["unserved_kwh"], global_step)
                if global_step >= learn_from:
                    writer.add_scalar("losses/td_loss", losses_host["td_loss"], global_step)
                    writer.add_scalar("losses/q_values", losses_host["q_values"], global_step)
                    writer.add_scalar("losses/grad_norm", losses_host["grad_norm"], global_step)
                writer.add_scalar("charts/epsilon", eps_host, global_step)
                writer.add_scalar("charts/learning_rate", args.learning_rate, global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                gpu = gpu_stats(device)
                if device.type == "cuda":
                    for key, value in gpu.items():
                        if math.isfinite(value):
                            writer.add_scalar(key, value, global_step)
                rows.append(
                    metrics_row(
                        global_step, train_wall_prev + wall, sps, ep, losses_host, eps_host, args.learning_rate,
                        args.num_envs, args.batch_size, gpu,
                    )
                )
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", co2=f"{ep['co2_kg']:.1f}", eps=f"{eps_host:.2f}", refresh=False)
                kpis = f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if evhub else f"length {ep['length']:.1f} "
                if (bar.disable and iteration % max(1, args.num_iterations // 10) < args.log_every) or last:
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} eps {eps_host:.3f} "
                        f"return {ep['return']:.2f} {kpis}"
                        f"td_loss {losses_host['td_loss']:.4f} q {losses_host['q_values']:.3f}",
                        flush=True,
                    )
            if args.checkpoint_every and iteration % args.checkpoint_every == 0 and not last:
                checkpoint(iteration, train_wall_prev + time.perf_counter() - start_time)
    except (NonFiniteLossError, OutOfMemoryBackoffError):
        writer.close()
        bar.close()
        raise
    bar.close()
    if oom_notes:  # the sizes actually used at the end
        writer.add_text("hyperparameters", hyperparameters(), global_step)

    end_time = synced_clock(device)
    sps_steady = (global_step - steady_start[1]) / max(end_time - steady_start[0], 1e-9) if steady_start else sps
    train_wall = train_wall_prev + end_time - start_time
    checkpoint(iteration, train_wall)
    policy_path = export_policy(qnet, obs_size, out_dir, hub=evhub)
    if evhub:
        write_policy_spec(out_dir, args.env_id, "hub", args.bess_action)
    if isinstance(env, GymVectorAdapter):
        env.close()
    print(f"training: {global_step:,} steps in {train_wall:.1f} s ({sps:.0f} SPS, {sps_steady:.0f} over the second half); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "sps_steady": sps_steady,
              "policy": str(policy_path), "num_envs": args.num_envs, "batch_size": args.batch_size,
              "buffer_size": args.buffer_size}
    if evhub and args.eval_split.lower() != "none":
        # the greedy policy as hub actions, evaluated in the hub mode (exactly the discrete mode; module docstring)
        greedy = GreedyHubPolicy(qnet, discrete_action_table()).to(device).eval()

        def policy(obs: torch.Tensor, env_) -> torch.Tensor:
            return greedy(obs.float()).to(obs.dtype)

        row, traces = evaluate_policy(
            policy,
            site,
            args.eval_split,
            "dqn",
            "hub",
            device,
            bess_action=args.bess_action,
            train_wall_s=train_wall,
            env_steps=float(global_step),
            steps_per_s=sps,
        )
        write_parquet(row, out_dir / f"eval_{args.eval_split}.parquet")
        write_parquet(traces, out_dir / f"eval_{args.eval_split}_traces.parquet")
        kpis = row.iloc[0]
        print(f"deterministic evaluation on the {args.eval_split} split:")
        for key in ("co2_kg", "grid_import_kwh", "pv_self_consumption_pct", "ev_energy_served_pct", "unserved_kwh", "peak_import_kw"):
            print(f"  {key:<26} {kpis[key]:.2f}")
            writer.add_scalar(f"eval/{key}", float(kpis[key]), global_step)
        result["eval"] = row
    writer.close()
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
