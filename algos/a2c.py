"""Synchronous advantage actor-critic (A2C), CleanRL style: ``EVHub-v0`` or any gymnasium environment with a Box
action space (a Gaussian policy) or a Discrete one (a Categorical policy), with flat observations (MLPs) or image
observations (a CNN torso, e.g. ``Snake-v0``).

One file, everything on one device. Each iteration steps ``num_envs`` copies of the env for a short
rollout of ``num_steps`` steps, computes returns and advantages by GAE (``gae_lambda=1`` gives the classic
n-step returns bootstrapped from the value of the observation after the rollout) and takes ONE gradient
step on ``policy_loss + vf_coef * value_loss - ent_coef * entropy`` with RMSprop (``alpha=0.99, eps=1e-5``
as in Stable-Baselines3 / CleanRL) or Adam, clipped to ``max_grad_norm``. Observations and rewards are
normalised with running statistics kept on the device, as in ``algos/ppo.py`` (by default flat observations only,
and not ``Snake-v0``'s rewards; see :data:`ENV_DEFAULTS`).

Environments (``--env-id``, any registered id, also a user's own as ``"my_module:MyEnv-v0"``):

* torch-batched envs (a ``vector_entry_point`` in their spec that takes a ``device``, e.g. ``EVHub-v0``,
  ``Snake-v0``) are built directly on the device; the site options (``--site``, ``--action-mode``,
  ``--bess-action``), the socket/weekday feature selection, the split evaluation and ``policy.json`` exist for
  ``EVHub-v0`` only. ``--vector-mode`` does not apply to them.
* any other env (also one with a NumPy ``vector_entry_point`` such as ``CartPole-v1``'s) runs as ``--vector-mode sync`` (gymnasium's ``SyncVectorEnv``) or ``async`` (``AsyncVectorEnv``,
  one subprocess per env: for CPU-bound or I/O-bound envs; if it cannot start, the run warns and falls back to
  sync) with SAME_STEP autoreset, behind :class:`GymVectorAdapter` (NumPy <-> device tensors; Box actions
  produced in [-1, 1] are rescaled to the Box's bounds, Discrete action indices ``0..n-1`` get the space's
  ``start`` added). Observations are handed on flat (a 1-D or 2-D Box, flattened) or as images (a 3-D Box).
  The value of ``final_obs`` bootstraps truncated episodes. Env state is not checkpointed: ``--resume`` starts new
  episodes.

Action spaces (decided once at start-up, a Python bool; see :func:`check_spaces`):

* ``Box``: Gaussian policy, an unsquashed mean (``actor_mean``) and a state-independent learned log-std
  (``actor_logstd``); rollout actions float32 ``(num_steps, num_envs, act_dim)``, clipped to [-1, 1] for the env.
* ``Discrete(n, start=s)``: Categorical policy over the logits of ``actor_logits`` (width ``n``, CleanRL
  ``ppo.py``'s ``actor``), sampled with the Gumbel-max trick (no host sync); rollout actions int64
  ``(num_steps, num_envs)``, the indices ``0..n-1`` (the env receives index + ``s``).

Observation spaces (decided once at start-up from the Box's shape, a Python bool ``agent.image``):

* flat (a Box of 1 or 2 dims, flattened to ``obs_dim``): separate actor and critic MLPs (two tanh layers of
  ``hidden_size``), observations standardised with running statistics (``--norm-obs``, on by default).
* images (a Box of 3 dims ``(C, H, W)``, e.g. ``Snake-v0``'s float32 ``(3, 10, 10)`` boards in [0, 1]): one CNN torso
  shared by actor and critic, as CleanRL's ``ppo_atari.py``, with the architecture of ``algos/dqn.py``'s:
  ``Conv2d(C, c1, 3, padding=1)-ReLU-Conv2d(c1, c2, 3, padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden_size)-ReLU``
  with ``(c1, c2) = --cnn-channels``, then a policy head (``Linear(hidden_size, n)`` logits or the Gaussian mean,
  orthogonal init std 0.01) and a value head (``Linear(hidden_size, 1)``, std 1). No observation normalisation by
  default (images are expected in a fixed range, such as [0, 1]); ``--norm-obs True`` standardises every pixel
  with running statistics of shape ``(C, H, W)`` (gymnasium's ``NormalizeObservation``).

Other spaces (MultiDiscrete, MultiBinary, Dict, Box observations of 4 or more dims, ...) are refused with a
``ValueError``.

Settings that suit an env better than the EVHub-v0 defaults come from :data:`ENV_DEFAULTS` (``Snake-v0``: gamma 0.99,
an entropy bonus, no observation normalisation, a small CNN and sizes that learn in minutes on a CPU), applied to the
fields left at ``None`` before the device preset (:data:`PRESETS`), then :data:`FIELD_DEFAULTS`; every one of them is
a flag, and the resolved values are printed and logged at start (the EVHub-only options, :data:`EVHUB_ONLY_ARGS`, for
EVHub-v0 only).

Hot paths are plain module-level functions -- :func:`policy_step` (observation normalisation + action
selection), :func:`update` (bootstrap value, GAE, loss, gradient step) -- bound to the agent once with
:func:`functools.partial`; ``--compile`` rebinds them to ``torch.compile`` versions, ``--cudagraphs`` to
CUDA-graph replays (:class:`CudaGraphed`, with a capturable optimizer and a device-tensor learning rate),
``--amp`` runs the network forward passes under bf16 autocast (for gymnasium envs all three apply to these
network functions only; the env step is host code). No host sync inside the loop (torch-batched envs):
statistics are summed on the device and read every ``log_every`` iterations, together with the GPU memory
counters (:func:`gpu_stats`).

Run (defaults: ``EVHub-v0`` on the ``caltech`` site, ``hub`` actions, a preset sized to the device)::

    python algos/a2c.py
    python algos/a2c.py --site path/to/site.toml --total-timesteps 200000 --optimizer adam --gae-lambda 0.95
    python algos/a2c.py --env-id Pendulum-v1 --num-envs 8 --num-steps 8 --total-timesteps 200000
    python algos/a2c.py --env-id CartPole-v1 --num-envs 8 --num-steps 5 --gamma 0.99 --total-timesteps 100000
    python algos/a2c.py --env-id Snake-v0
    python algos/a2c.py --env-id IOBound-v0 --vector-mode async --num-envs 8
    tensorboard --logdir outputs/

Writes into ``output_dir``: TensorBoard events, ``metrics.parquet`` (the same curves; ``episodic_co2_kg`` and
``episodic_unserved_kwh`` are NaN for envs other than EVHub-v0, the ``gpu_*`` columns NaN on the CPU),
``checkpoint.pt`` (model, optimizer, counters, RNG and, for torch-batched envs, env state; ``--resume`` continues
from it), ``policy.pt2`` (the deterministic actor as a ``torch.export`` program: obs float32 ``(B, obs_dim)``
(flattened), or ``(B, C, H, W)`` for images, -> for Box actions the mean action float32 ``(B, act_dim)``, in [-1, 1]
for torch-batched envs, in the Box's bounds for gymnasium envs; for Discrete actions the greedy (argmax) action
int64 ``(B,)`` in ``0..n-1``, to which the env's ``start`` is to be added; load with
``torch.export.load(path).module()``, for EVHub-v0 with ``envs.kpis.load_policy``) and, for EVHub-v0,
``policy.json`` and the deterministic evaluation over ``eval_split``: ``eval_{split}.parquet`` (one KPI row,
controller ``"a2c"``) and ``eval_{split}_traces.parquet`` (hourly traces).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
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
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/a2c.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet, write_policy_spec

PRESETS = {
    # 2 CPU cores: ~100 envs, short rollouts, a small net; a few minutes on the caltech site with evaluation
    "cpu": {"num_envs": 128, "num_steps": 16, "total_timesteps": 4_000_000, "hidden_size": 64, "log_every": 50,
            "num_threads": 1},
    # one GPU: thousands of envs, a wider net
    "gpu": {"num_envs": 2048, "num_steps": 16, "total_timesteps": 64_000_000, "hidden_size": 256, "log_every": 50,
            "num_threads": 0},
}
"""Defaults per preset for the fields left at ``None``; any of them can be set on the command line."""

ENV_DEFAULTS = {
    # Snake: rewards of +1 (food) / -1 (death), long episodes, image observations in [0, 1]
    "Snake-v0": {
        "gamma": 0.99,
        "ent_coef": 0.01,
        "norm_obs": False,
        "norm_reward": False,
        "cnn_channels": (16, 32),
    },
    # Snake on the cpu preset: about 5 minutes on 2 CPU cores (10,000 steps/s); seed 1 scored 39 foods per episode
    # with the greedy policy (1,000 episodes; uniform-random actions: 0.155)
    "Snake-v0/cpu": {
        "num_envs": 64,
        "num_steps": 8,
        "total_timesteps": 3_000_000,
        "hidden_size": 128,
    },
    # Snake on one GPU (sizes not tuned): batches of 4,096 steps, a wider torso, about as many updates as on the cpu
    "Snake-v0/gpu": {
        "num_envs": 512,
        "num_steps": 8,
        "total_timesteps": 20_000_000,
        "hidden_size": 256,
        "cnn_channels": (32, 64),
    },
}
"""Per-env defaults for the fields left at ``None`` (the env id without a ``module:`` prefix; its
``"<env_id>/<preset>"`` entry, sizes for one device preset, on top), applied before :data:`PRESETS`; an env without
an entry (EVHub-v0, CartPole-v1, ...) gets the preset and :data:`FIELD_DEFAULTS`. Anything set on the command line
wins, and the values used are printed at start (:func:`preset_table`)."""

FIELD_DEFAULTS = {
    "gamma": 0.98,
    "ent_coef": 0.0,
    "norm_reward": True,
    "cnn_channels": (32, 64),
}
"""Values of the env-dependent fields left at ``None`` that neither :data:`ENV_DEFAULTS` nor the preset set (the
EVHub-v0 values). ``norm_obs`` left at ``None`` is decided from the observation space once the env is built: on for
flat observations, off for images."""

EVHUB_ONLY_ARGS = ("site", "action_mode", "bess_action", "socket_features", "weekday_features", "eval_split")
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
    """the id of the environment: any registered gymnasium id with a Box action space (Gaussian policy) or a
    Discrete one (Categorical policy, e.g. CartPole-v1) and flat Box observations (MLPs) or image ones (C, H, W)
    (a CNN torso, e.g. Snake-v0), also 'my_module:MyEnv-v0' (imports my_module, which registers it)"""
    vector_mode: Literal["sync", "async"] = "sync"
    """how gymnasium envs other than the torch-batched ones are vectorised: 'sync' (SyncVectorEnv, one process) or
    'async' (AsyncVectorEnv, one subprocess per env; falls back to sync with a warning if it cannot start);
    ignored for torch-batched envs such as EVHub-v0"""
    site: str = "caltech"
    """site to train on (EVHub-v0 only): a shipped site name or a path to a site TOML file"""
    action_mode: str = "hub"
    """EVHub-v0 only: 'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket)"""
    bess_action: Literal["surplus", "setpoint"] = "surplus"
    """EVHub-v0 only: meaning of the BESS action: 'surplus' (the PV surplus is always stored; -1 = cover the deficit, the
    self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess times the
    BESS power limit)"""
    total_timesteps: int | None = None
    """total env steps of the experiment (None: preset, 4,000,000 on cpu, 64,000,000 on gpu; Snake-v0: 3,000,000 on
    cpu, 20,000,000 on gpu)"""
    learning_rate: float = 7e-4
    """the learning rate of the optimizer"""
    num_envs: int | None = None
    """the number of parallel env copies (None: preset, 128 on cpu, 2048 on gpu; Snake-v0: 64 on cpu, 512 on gpu)"""
    num_steps: int | None = None
    """the number of steps per env in each rollout, one gradient step per rollout (None: preset, 16; Snake-v0: 8)"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear to zero over the run)"""
    optimizer: Literal["rmsprop", "adam"] = "rmsprop"
    """the optimizer: 'rmsprop' (alpha=rmsprop_alpha, eps=optimizer_eps, as SB3/CleanRL A2C) or 'adam'"""
    rmsprop_alpha: float = 0.99
    """the smoothing constant alpha of RMSprop"""
    optimizer_eps: float = 1e-5
    """the epsilon of the optimizer (RMSprop and Adam)"""
    gamma: float | None = None
    """the discount factor gamma (None: 0.98, a horizon of about two days of hourly steps; 0.99 on Snake-v0)"""
    gae_lambda: float = 1.0
    """the lambda of the generalised advantage estimation (1.0: plain n-step returns, as SB3's A2C)"""
    norm_adv: bool = False
    """toggles advantage normalisation over the batch (off in SB3's A2C)"""
    ent_coef: float | None = None
    """coefficient of the entropy (None: 0.0; 0.01 on Snake-v0)"""
    vf_coef: float = 0.5
    """coefficient of the value loss (mean squared error of value and return)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    hidden_size: int | None = None
    """width of the two hidden layers of actor and critic, or of the layer after the CNN torso for images (None:
    preset, 64 on cpu, 256 on gpu; Snake-v0: 128 on cpu, 256 on gpu)"""
    cnn_channels: tuple[int, int] | None = None
    """image observations (C, H, W): output channels of the CNN torso's two 3x3 convolutions (None: 32 64; Snake-v0:
    16 32 on cpu, 32 64 on gpu); not used for flat observations"""
    init_logstd: float = -0.5
    """initial log standard deviation of the Gaussian policy (state-independent, learned; Box actions only)"""
    socket_features: bool = True
    """EVHub-v0 only: feed the per-socket observations to the networks (False: only the site-level features
    before them)"""
    weekday_features: bool = False
    """EVHub-v0 only: feed the day-of-week features (sin/cos) to the networks (off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    norm_obs: bool | None = None
    """standardise observations with running statistics kept in the agent (CleanRL's NormalizeObservation; per
    pixel for images). None: on for flat observations, off for images (C, H, W)"""
    norm_reward: bool | None = None
    """scale rewards by a running std of the discounted return (CleanRL's NormalizeReward, on device). None: on;
    off on Snake-v0 (its rewards are +-1 already)"""
    bootstrap_truncation: bool = True
    """bootstrap through time-limit truncations (torch-batched envs: with SAME_STEP autoreset the value of the
    next episode's first observation stands in for the lost final one, exact where, as for EVHub-v0, the windows
    are alike; gymnasium envs: from the value of info['final_obs']); False: truncation is terminal"""
    compile: bool = False
    """torch.compile the hot functions (action selection and the update)"""
    cudagraphs: bool = False
    """capture action selection and the update in CUDA graphs (capturable optimizer, device-tensor LR); needs CUDA"""
    amp: bool = False
    """bf16 autocast of the network forward passes (CUDA or CPU)"""
    log_every: int | None = None
    """iterations between host reads of the statistics: TensorBoard, metrics.parquet, progress (None: preset, 50)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed} for EVHub-v0,
    outputs/runs/{exp_name}_{env_id}_seed{seed} otherwise)"""
    checkpoint_every: int = 1000
    """iterations between checkpoints (0: only at the end)"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (model, optimizer, counters, RNG and the state of torch-batched
    envs; gymnasium envs start new episodes)"""
    eval_split: str = "test"
    """EVHub-v0 only: split for the final deterministic evaluation ('none' skips it; other envs have no splits
    and skip it with a note)"""
    max_oom_retries: int = 3
    """halvings of num_envs allowed after CUDA out-of-memory errors: each one rebuilds the envs and the rollout
    storage with half as many envs (so the batch of the update halves), warns and trains on to total_timesteps; one
    more error stops the run with OutOfMemoryBackoffError, its last checkpoint kept (0: stop at the first)"""

    # filled in at runtime
    batch_size: int = 0
    """the batch size of one update (computed in runtime: num_envs * num_steps)"""
    num_iterations: int = 0
    """the number of iterations = updates (computed in runtime: total_timesteps // batch_size)"""


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


# ---------------------------------------------------------------------------------------------- agent
def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    """Orthogonal weights of gain ``std`` and constant biases (CleanRL's ``layer_init``), for a ``Linear`` or a
    ``Conv2d``; returns the layer."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningObsNorm(nn.Module):
    """Running mean/variance of the observations (as buffers on the device, updated without host sync).

    ``forward`` standardises and clips to ``[-clip, clip]``; :meth:`update` folds a batch into the statistics
    in place. Being part of the agent, it travels with the checkpoint and the exported policy.

    ``dim``: the size of flat observations ``(B, dim)``, or the shape of one observation, e.g. ``(C, H, W)`` for
    images ``(B, C, H, W)`` (statistics per pixel). Statistics are float32 of that shape, ``count`` a scalar.
    """

    def __init__(self, dim: int | tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
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
    """Keeps the observation features listed in ``keep`` (the networks' inputs)."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


def mlp(n_in: int, hidden: int, n_out: int, out_std: float, select: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        select,
        layer_init(nn.Linear(n_in, hidden)),
        nn.Tanh(),
        layer_init(nn.Linear(hidden, hidden)),
        nn.Tanh(),
        layer_init(nn.Linear(hidden, n_out), std=out_std),
    )


def cnn_torso(obs_shape: tuple[int, int, int], channels: tuple[int, int], hidden: int) -> nn.Sequential:
    """The CNN torso of image observations (``algos/dqn.py``'s architecture, CleanRL's ``layer_init``): float32
    ``(B, C, H, W)`` -> features float32 ``(B, hidden)``, ``Conv2d(C, c1, 3, padding=1)-ReLU-Conv2d(c1, c2, 3,
    padding=1)-ReLU-Flatten-Linear(c2 * H * W, hidden)-ReLU`` with ``(c1, c2) = channels``. The padding keeps the
    board size, so every cell stays in its place up to the linear layer."""
    c, h, w = (int(x) for x in obs_shape)
    c1, c2 = (int(x) for x in channels)
    return nn.Sequential(
        layer_init(nn.Conv2d(c, c1, 3, padding=1)),
        nn.ReLU(),
        layer_init(nn.Conv2d(c1, c2, 3, padding=1)),
        nn.ReLU(),
        nn.Flatten(),
        layer_init(nn.Linear(c2 * h * w, hidden)),
        nn.ReLU(),
    )


class Agent(nn.Module):
    """Actor and critic over flat observations (separate MLPs) or images (one shared CNN torso).

    Box actions (``discrete=False``): a Gaussian actor with an unsquashed mean (``actor_mean``, ``act_dim`` outputs)
    and a state-independent log-std (``actor_logstd``). Discrete actions (``discrete=True``): a Categorical actor
    over the logits of ``actor_logits`` (``act_dim`` = the number of actions ``n``); both output layers are
    initialised orthogonally with std 0.01.

    Flat observations (``obs_shape`` None or of 1 dim): ``critic`` and ``actor_mean``/``actor_logits`` are MLPs of two
    tanh layers of ``hidden`` units over the ``inputs`` features of ``obs_dim`` (all by default). Images
    (``obs_shape`` ``(C, H, W)``, CleanRL ``ppo_atari.py`` style): ``network`` is the shared :func:`cnn_torso` with
    ``cnn_channels``, ``actor_mean``/``actor_logits`` and ``critic`` are single ``Linear`` heads on its ``hidden``
    features (std 0.01 and 1); ``inputs`` is not used.

    ``obs_norm`` (running standardisation, or identity) maps raw env observations to the network inputs;
    the rollout stores normalised observations, so the update works on those. ``discrete`` and ``image`` are plain
    Python attributes: the hot functions branch on them, never on a tensor value.

    Raises:
        ValueError: ``obs_shape`` has neither 1 nor 3 dims.
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
        if obs_shape is not None and len(obs_shape) not in (1, 3):
            raise ValueError(f"Agent takes flat (obs_dim,) or image (C, H, W) observations, got shape {obs_shape}")
        self.image = obs_shape is not None and len(obs_shape) == 3
        if self.image:
            obs_shape = tuple(int(x) for x in obs_shape)
            self.discrete = discrete
            self.obs_norm = RunningObsNorm(obs_shape) if norm_obs else nn.Identity()
            self.network = cnn_torso(obs_shape, cnn_channels, hidden)
            if discrete:
                self.actor_logits = layer_init(nn.Linear(hidden, act_dim), std=0.01)
            else:
                self.actor_mean = layer_init(nn.Linear(hidden, act_dim), std=0.01)
                self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_logstd)))
            self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)
            return
        inputs = list(range(obs_dim)) if inputs is None else list(inputs)
        n_in = len(inputs)
        sel = (lambda: Select(inputs)) if n_in < obs_dim else nn.Identity
        self.discrete = discrete
        self.obs_norm = RunningObsNorm(obs_dim) if norm_obs else nn.Identity()
        self.critic = mlp(n_in, hidden, 1, 1.0, sel())
        if discrete:
            self.actor_logits = mlp(n_in, hidden, act_dim, 0.01, sel())
        else:
            self.actor_mean = mlp(n_in, hidden, act_dim, 0.01, sel())
            self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_logstd)))

    def actor_net(self) -> nn.Module:
        """The module from normalised observations to the policy's logits ``(B, n)`` or mean ``(B, act_dim)``: the
        actor MLP, or for images the torso followed by the policy head (sharing the agent's parameters)."""
        head = self.actor_logits if self.discrete else self.actor_mean
        return nn.Sequential(self.network, head) if self.image else head

    def dist_and_value(self, x: torch.Tensor, amp: bool = False) -> tuple[Normal | Categorical, torch.Tensor]:
        """Policy distribution and value ``(B,)`` at normalised observations ``x`` float32 ``(B, n_in)`` (flat) or
        ``(B, C, H, W)`` (images): a ``Normal`` over ``(B, act_dim)`` (Box) or a ``Categorical`` over ``n`` actions,
        batch ``(B,)`` (Discrete); ``amp``: bf16 forward passes (the distribution's parameters are float32)."""
        if self.discrete:
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
                if self.image:
                    x = self.network(x)  # the features shared by both heads
                logits = self.actor_logits(x)
                value = self.critic(x)
            return Categorical(logits=logits.float(), validate_args=False), value.float().squeeze(-1)
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            if self.image:
                x = self.network(x)
            mean = self.actor_mean(x)
            value = self.critic(x)
        mean = mean.float()
        std = torch.exp(self.actor_logstd.expand_as(mean))
        return Normal(mean, std, validate_args=False), value.float().squeeze(-1)  # validation would sync


class DeterministicActor(nn.Module):
    """The deterministic policy: raw obs float32 ``(B, obs_dim)`` (or ``(B, C, H, W)``, with an ``actor_mean`` that
    starts with the CNN torso) -> clipped mean action ``(B, act_dim)`` in [-1, 1].

    Observation normalisation (frozen statistics) is part of it, so callers pass the env's observations as is.
    With ``low``/``high`` (float32 ``(act_dim,)``, the env's Box bounds; NaN where a bound is infinite) the
    action is rescaled linearly from [-1, 1] to ``[low, high]`` (left in [-1, 1] where NaN), as
    :class:`GymVectorAdapter` does.
    """

    def __init__(
        self, obs_norm: nn.Module, actor_mean: nn.Module, low: torch.Tensor | None = None, high: torch.Tensor | None = None
    ):
        super().__init__()
        self.obs_norm = obs_norm
        self.actor_mean = actor_mean
        self.rescale = low is not None
        if self.rescale:
            finite = torch.isfinite(low) & torch.isfinite(high)
            self.register_buffer("scale", torch.where(finite, (high - low) / 2, torch.ones_like(low)).float())
            self.register_buffer("offset", torch.where(finite, (high + low) / 2, torch.zeros_like(low)).float())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        action = self.actor_mean(self.obs_norm(obs)).clamp(-1.0, 1.0)
        return self.offset + self.scale * action if self.rescale else action


class GreedyActor(nn.Module):
    """The deterministic policy for Discrete actions: raw obs float32 ``(B, obs_dim)`` (or ``(B, C, H, W)``, with an
    ``actor_logits`` that starts with the CNN torso) -> the action of the largest logit, int64 ``(B,)`` in
    ``0..n-1`` (the index; the env receives index + its space's ``start``).

    Observation normalisation (frozen statistics) is part of it, so callers pass the env's observations as is.
    """

    def __init__(self, obs_norm: nn.Module, actor_logits: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.actor_logits = actor_logits

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor_logits(self.obs_norm(obs)).argmax(-1)


def make_optimizer(
    params, name: str, lr: torch.Tensor | float, alpha: float = 0.99, eps: float = 1e-5, capturable: bool = False
) -> torch.optim.Optimizer:
    """The optimizer by name: ``"rmsprop"`` (PyTorch RMSprop, ``alpha``, ``eps``, as SB3/CleanRL A2C) or ``"adam"``.

    ``lr`` may be a device tensor (updated in place for annealing, as CUDA graphs and torch.compile need);
    ``capturable`` keeps the optimizer state on the device for CUDA-graph capture.

    Raises:
        ValueError: unknown ``name``.
    """
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps, capturable=capturable)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps, capturable=capturable)
    raise ValueError(f"unknown optimizer {name!r}: expected 'rmsprop' or 'adam'")


# ---------------------------------------------------------------------------------------------- environments
def find_env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registered spec of ``env_id``; ``"module:EnvId-v0"`` first imports ``module`` (which registers it).

    Raises:
        ModuleNotFoundError: the module part cannot be imported.
        gymnasium.error.Error: no env is registered under that id.
    """
    module, name = env_id.split(":", 1) if ":" in env_id else (None, env_id)
    if module:
        import importlib

        importlib.import_module(module)
    return gym.spec(name)


def is_torch_batched(spec: gym.envs.registration.EnvSpec) -> bool:
    """Whether ``spec`` is a torch-batched env: a ``vector_entry_point`` whose constructor takes a ``device``
    (``EVHub-v0``, ``Snake-v0``). Gymnasium's NumPy vector entry points (``CartPole-v1``'s) take none: such envs
    are vectorised with ``--vector-mode`` like any other."""
    if spec.vector_entry_point is None:
        return False
    import inspect

    creator = spec.vector_entry_point
    if isinstance(creator, str):
        creator = gym.envs.registration.load_env_creator(creator)
    try:
        params = inspect.signature(creator).parameters
    except (TypeError, ValueError):  # a builtin or an object without a signature: assume ours
        return True
    return "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_spaces(
    env_id: str, observation_space: gym.Space, action_space: gym.Space, torch_batched: bool = False
) -> None:
    """Check that A2C can drive a single env with these spaces: a Box action space (Gaussian policy) or a Discrete
    one (Categorical policy), and a Box observation space of 1 or 2 dims (flattened, MLPs) or of 3 dims (an image
    ``(C, H, W)``, the CNN torso). ``torch_batched``: the env is torch-batched, which gets the action indices as is,
    so its Discrete space must start at 0.

    Raises:
        ValueError: naming ``env_id``, the offending space and the spaces supported.
    """
    if not isinstance(action_space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise ValueError(
            f"A2C supports Box actions (Gaussian policy) and Discrete actions (Categorical policy), but {env_id} "
            f"has action space {action_space}; wrap the env to expose a Box or a Discrete action space "
            f"(e.g. flatten a MultiDiscrete space into one Discrete space)"
        )
    if torch_batched and isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        raise ValueError(
            f"A2C passes action indices 0..n-1 to torch-batched envs as is, but {env_id} has action space "
            f"{action_space} (start {int(action_space.start)}); give it a Discrete space that starts at 0"
        )
    if not isinstance(observation_space, gym.spaces.Box):
        raise ValueError(
            f"A2C supports flat Box observations and images (C, H, W) only, but {env_id} has observation space "
            f"{observation_space}; flatten it with a wrapper (e.g. gymnasium.wrappers.FlattenObservation)"
        )
    if len(observation_space.shape) > 3:
        raise ValueError(
            f"A2C takes flat observations (MLPs) or images (C, H, W) (CNN torso), but {env_id} has observations of "
            f"{len(observation_space.shape)} dims {observation_space}; stack extra axes into the channels, e.g. "
            f"(T, C, H, W) frames as (T * C, H, W) (gymnasium.wrappers.ReshapeObservation), or flatten them "
            f"(gymnasium.wrappers.FlattenObservation)"
        )


def network_obs_shape(env) -> tuple[int, ...]:
    """The shape of one observation as the networks take it: ``(C, H, W)`` for a 3-D Box observation space (an
    image, kept as it is), else ``(obs_dim,)`` (the Box flattened)."""
    shape = tuple(int(x) for x in env.single_observation_space.shape)
    return shape if len(shape) == 3 else (int(np.prod(shape)),)


class GymVectorAdapter:
    """The tensor interface of the torch-batched envs around a gymnasium vector env (NumPy, host side).

    ``env`` must use SAME_STEP autoreset (the observation returned where an episode ends is the next episode's
    first; the last one is in ``info["final_obs"]``), a Box or Discrete action space and a Box observation space.

    * ``reset(seed)`` / ``step(action)`` return observations as float32 tensors ``(num_envs, obs_dim)`` on
      ``device`` (flattened; images of a 3-D Box keep their shape, ``(num_envs, C, H, W)``), rewards float32
      ``(num_envs,)``, ``terminated``/``truncated`` bool ``(num_envs,)``.
    * Box: ``step`` takes float actions ``(num_envs, act_dim)`` in [-1, 1] (any device) and rescales them
      linearly to the Box's ``[low, high]`` (dimensions with an infinite bound get the action as is), cast to the
      Box's dtype and shape (:meth:`scale_action`).
    * Discrete(n, start=s): ``step`` takes integer action indices ``(num_envs,)`` in ``0..n-1`` (any device) and
      passes them to the env as a NumPy int64 array ``(num_envs,)`` plus ``s`` (:meth:`offset_action`); no
      rescaling.
    * ``info`` of ``step`` holds, only where some episode ended in that step, ``"final_obs"``: float32
      ``(num_envs, obs_dim)`` (images ``(num_envs, C, H, W)``) on ``device``, the last observation of each env that
      ended (zeros elsewhere). The env's other info entries are dropped.

    Args:
        env: a gymnasium vector env (e.g. from ``gym.make_vec`` in sync or async mode).
        device: where the returned tensors live.
    """

    def __init__(self, env: gym.vector.VectorEnv, device: torch.device):
        self.env = env
        self.device = device
        self.num_envs = env.num_envs
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        space = env.single_action_space
        self.discrete = isinstance(space, gym.spaces.Discrete)
        if self.discrete:
            self._start = np.int64(space.start)
        else:
            low, high = space.low.astype(np.float64).ravel(), space.high.astype(np.float64).ravel()
            self._finite = np.isfinite(low) & np.isfinite(high)
            self._low = np.where(self._finite, low, -1.0)
            self._high = np.where(self._finite, high, 1.0)
        self._obs_dim = int(np.prod(env.single_observation_space.shape))
        shape = tuple(int(x) for x in env.single_observation_space.shape)
        self._obs_shape = shape if len(shape) == 3 else (self._obs_dim,)

    def _obs(self, obs) -> torch.Tensor:
        array = np.asarray(obs, dtype=np.float32).reshape(self.num_envs, *self._obs_shape)
        return torch.from_numpy(array).to(self.device)

    def scale_action(self, action: np.ndarray) -> np.ndarray:
        """Actions ``(num_envs, act_dim)`` in [-1, 1] -> the Box's bounds, shape ``(num_envs, *shape)`` and dtype."""
        a = np.asarray(action, dtype=np.float64)
        a = np.where(self._finite, self._low + 0.5 * (a + 1.0) * (self._high - self._low), a)
        space = self.single_action_space
        return a.reshape(self.num_envs, *space.shape).astype(space.dtype)

    def offset_action(self, action: np.ndarray) -> np.ndarray:
        """Discrete action indices ``(num_envs,)`` in ``0..n-1`` -> the env's actions: int64 ``(num_envs,)``, the
        index plus the space's ``start``."""
        return np.asarray(action, dtype=np.int64).reshape(self.num_envs) + self._start

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every env (env ``i`` seeded with ``seed + i``); returns ``(obs, {})``."""
        obs, _ = self.env.reset(seed=seed)
        return self._obs(obs), {}

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Step every env with ``action`` (Box: float ``(num_envs, act_dim)`` in [-1, 1]; Discrete: indices
        ``(num_envs,)``); returns ``(obs, reward, terminated, truncated, info)``."""
        if self.discrete:
            a = self.offset_action(action.detach().to("cpu", torch.int64).numpy())
        else:
            a = self.scale_action(action.detach().to("cpu", torch.float64).numpy())
        obs, reward, terminated, truncated, info = self.env.step(a)
        out = {}
        ended = np.asarray(info.get("_final_obs", np.zeros(self.num_envs, bool)), dtype=bool)
        if ended.any():
            final = np.zeros((self.num_envs, *self._obs_shape), np.float32)
            for i in np.flatnonzero(ended):
                final[i] = np.asarray(info["final_obs"][i], dtype=np.float32).reshape(self._obs_shape)
            out["final_obs"] = torch.from_numpy(final).to(self.device)
        return (
            self._obs(obs),
            torch.from_numpy(np.asarray(reward, dtype=np.float32)).to(self.device),
            torch.from_numpy(np.asarray(terminated, dtype=bool)).to(self.device),
            torch.from_numpy(np.asarray(truncated, dtype=bool)).to(self.device),
            out,
        )

    def close(self) -> None:
        """Close the vector env (ends the worker processes of an async one)."""
        self.env.close()


def make_gym_vector_env(env_id: str, num_envs: int, vector_mode: str, warnings: list[str]) -> gym.vector.VectorEnv:
    """``gym.make_vec`` of a gymnasium env without vector entry point, SAME_STEP autoreset, wrapped in
    ``RecordEpisodeStatistics``.

    ``vector_mode`` ``"async"`` that fails to start (no fork, an env factory that does not pickle, a worker that
    dies) falls back to ``"sync"``: the warning is printed to stderr and appended to ``warnings``.
    """
    kwargs = {"vector_kwargs": {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}}
    env = None
    if vector_mode == "async":
        try:
            env = gym.make_vec(env_id, num_envs, vectorization_mode="async", **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever stops the workers, sync still works
            message = (
                f"--vector-mode async could not start {num_envs} worker processes for {env_id} "
                f"({type(exc).__name__}: {exc}); falling back to --vector-mode sync"
            )
            print(f"warning: {message}", file=sys.stderr, flush=True)
            warnings.append(message)
    if env is None:
        env = gym.make_vec(env_id, num_envs, vectorization_mode="sync", **kwargs)
    return gym.wrappers.vector.RecordEpisodeStatistics(env)


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory (and, where ``pynvml`` imports, utilisation) of ``device`` for the logs.

    The memory figures are the caching allocator's host-side counters (``torch.cuda.memory_allocated``,
    ``memory_reserved``, ``max_memory_allocated``): reading them does not synchronise with the GPU.

    Returns:
        ``{"gpu_mem_allocated_gb", "gpu_mem_reserved_gb", "gpu_mem_peak_gb"}`` in GB (1e9 bytes) and
        ``"gpu_util_pct"`` (0-100, NVML's utilisation over its last sample period); every value is NaN on a
        non-CUDA device, ``gpu_util_pct`` also where ``pynvml`` is missing or NVML fails. Never raises.
    """
    stats = dict.fromkeys(GPU_STATS, math.nan)
    if device.type != "cuda":
        return stats
    try:
        stats["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        stats["gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        stats["gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring must never stop training
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        stats["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no pynvml, no NVML, or a device NVML numbers differently
        pass
    return stats


GPU_STATS = ("gpu_mem_allocated_gb", "gpu_mem_reserved_gb", "gpu_mem_peak_gb", "gpu_util_pct")
"""Keys of :func:`gpu_stats`: metrics.parquet columns, TensorBoard scalars ``perf/<key>``."""


# ---------------------------------------------------------------------------------------------- state
def make_storage(
    num_steps: int,
    num_envs: int,
    obs_dim: int | tuple[int, ...],
    act_dim: int,
    device: torch.device,
    discrete: bool = False,
) -> dict:
    """Preallocated rollout storage on ``device``: float32 ``(num_steps, num_envs, ...)`` tensors.

    ``obs`` is float32 ``(num_steps, num_envs, obs_dim)``, or ``(num_steps, num_envs, *obs_dim)`` where ``obs_dim`` is
    a shape such as an image's ``(C, H, W)``.
    ``actions`` is float32 ``(num_steps, num_envs, act_dim)`` for Box actions and, with ``discrete``, int64
    ``(num_steps, num_envs)`` (the action indices; ``act_dim`` is not used). ``terminals[t]``/``dones[t]`` flag the
    transition of step ``t``: no bootstrap from its next observation / the episode ended there (the advantage trace
    is cut).
    """
    z = lambda *s: torch.zeros(num_steps, num_envs, *s, device=device)  # noqa: E731
    obs_shape = (obs_dim,) if isinstance(obs_dim, int) else tuple(obs_dim)
    return {
        "obs": z(*obs_shape),
        "actions": torch.zeros(num_steps, num_envs, dtype=torch.int64, device=device) if discrete else z(act_dim),
        "rewards": z(),
        "values": z(),
        "terminals": z(),
        "dones": z(),
    }


EVHUB_KPIS = ("co2_kg", "unserved_kwh")
"""Per-step ``info`` entries of EVHub-v0 summed per episode and logged (``charts/episodic_<key>``)."""


def make_episode_stats(num_envs: int, device: torch.device, kpis: tuple[str, ...] = EVHUB_KPIS) -> dict:
    """Per-env running sums of the current episode and device sums over the episodes finished since the last log
    (float64): return, length and each of ``kpis`` (per-step ``info`` entries; ``()`` for envs other than
    EVHub-v0)."""
    z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float64)  # noqa: E731
    keys = ("return", *kpis, "length")
    return {**{f"ep_{k}": z(num_envs) for k in keys}, "n_done": z(()), **{f"sum_{k}": z(()) for k in keys}}


def make_reward_norm(num_envs: int, device: torch.device) -> dict:
    """State of the running return normaliser: per-env discounted return and its running mean/var/count."""
    return {
        "ret": torch.zeros(num_envs, device=device, dtype=torch.float64),
        "mean": torch.zeros((), device=device, dtype=torch.float64),
        "var": torch.ones((), device=device, dtype=torch.float64),
        "count": torch.full((), 1e-4, device=device, dtype=torch.float64),
    }


def normalize_reward(rn: dict, reward: torch.Tensor, done: torch.Tensor, gamma: float, eps: float = 1e-8) -> torch.Tensor:
    """Fold ``reward`` into the discounted return (restarted after ``done``), update its running variance
    in place and return ``reward / std``."""
    ret = rn["ret"] * gamma * (1.0 - done.to(torch.float64)) + reward.to(torch.float64)
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
    next_value: torch.Tensor,
    terminals: torch.Tensor,
    dones: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a rollout; ``gae_lambda=1`` gives n-step returns.

    Args:
        rewards, values: ``(num_steps, num_envs)``; ``values[t]`` is the value of the observation of step ``t``.
        next_value: ``(num_envs,)`` value of the observation after the last step.
        terminals: ``(num_steps, num_envs)``, 1 where the transition of step ``t`` is terminal (no bootstrap
            from the next observation).
        dones: ``(num_steps, num_envs)``, 1 where the episode ended at step ``t`` (terminated or truncated):
            the advantage trace stops there. Where ``dones`` but not ``terminals`` (a truncation to bootstrap
            through), step ``t`` bootstraps from the next stored value, ``gamma * V(s_{t+1})``, and nothing of the
            following episode enters its return.

    Returns:
        ``(advantages, returns)``, each ``(num_steps, num_envs)``; ``returns = advantages + values``.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        nextvalues = next_value if t == num_steps - 1 else values[t + 1]
        delta = rewards[t] + gamma * nextvalues * (1.0 - terminals[t]) - values[t]
        lastgaelam = delta + gamma * gae_lambda * (1.0 - dones[t]) * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def explained_variance(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - Var[y - y_pred] / Var[y]`` as a device scalar (NaN where ``Var[y] == 0``)."""
    var_y = y.var()
    ev = 1.0 - (y - y_pred).var() / var_y
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), ev)


# ---------------------------------------------------------------------------------------------- hot paths
def policy_step(agent: Agent, obs: torch.Tensor, amp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold raw ``obs`` float32 ``(B, obs_dim)`` (images ``(B, C, H, W)``) into the running normaliser, normalise,
    sample an action; no host sync.

    Returns:
        ``(obs_normalised, action, value)``: for Box actions the action float32 ``(B, act_dim)``, unclipped (the
        env gets it clipped); for Discrete actions the action index int64 ``(B,)`` in ``0..n-1``.
    """
    with torch.no_grad():
        if isinstance(agent.obs_norm, RunningObsNorm):
            agent.obs_norm.update(obs)
        obs_n = agent.obs_norm(obs)
        dist, value = agent.dist_and_value(obs_n, amp)
        if agent.discrete:
            # Gumbel-max: argmax(logits + Gumbel noise) is a sample of the Categorical, without torch.multinomial
            # (whose CUDA kernel checks the probabilities; the uniform draws are clamped away from 0, log(0))
            u = torch.rand_like(dist.logits).clamp_(min=torch.finfo(dist.logits.dtype).tiny)
            return obs_n, (dist.logits - torch.log(-torch.log(u))).argmax(-1), value
        # mean + std * noise rather than dist.sample(): torch.normal checks std >= 0 on the host (a sync on CUDA,
        # and an exception before the NaN check could name the bad update)
        return obs_n, dist.loc + dist.scale * torch.randn_like(dist.loc), value


def state_value(agent: Agent, obs: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Value ``(B,)`` of raw observations ``obs`` ``(B, obs_dim)`` or ``(B, C, H, W)`` (normalised with the current
    statistics, which it does not update); no gradient."""
    with torch.no_grad():
        return agent.dist_and_value(agent.obs_norm(obs), amp)[1]


def update(
    agent: Agent,
    optimizer: torch.optim.Optimizer,
    obs: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminals: torch.Tensor,
    dones: torch.Tensor,
    next_obs: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
    vf_coef: float,
    ent_coef: float,
    max_grad_norm: float,
    norm_adv: bool,
    amp: bool,
) -> dict[str, torch.Tensor]:
    """One A2C step: bootstrap value of ``next_obs`` (raw), GAE returns, one gradient step on the whole batch.

    ``obs`` float32 ``(num_steps, num_envs, obs_dim)`` or ``(num_steps, num_envs, C, H, W)`` (normalised),
    ``actions`` float32 ``(num_steps, num_envs, act_dim)`` (Box) or int64 ``(num_steps, num_envs)`` (Discrete, as
    ``agent.discrete`` says), ``rewards``/``values``/``terminals``/``dones`` float32 ``(num_steps, num_envs)``,
    ``next_obs`` float32 ``(num_envs, obs_dim)`` or ``(num_envs, C, H, W)`` (raw).

    Returns:
        device tensors ``value_loss, policy_loss, entropy, grad_norm, explained_variance`` and ``bad``: a
        ``(len(LOSS_NAMES),)`` bool tensor, True where that quantity is non-finite.
    """
    with torch.no_grad():
        _, next_value = agent.dist_and_value(agent.obs_norm(next_obs), amp)
        advantages, returns = compute_gae(rewards, values, next_value, terminals, dones, gamma, gae_lambda)
    b_obs = obs.reshape(-1, *obs.shape[2:])
    b_actions = actions.reshape(-1) if agent.discrete else actions.reshape(-1, actions.shape[-1])
    b_adv, b_returns = advantages.reshape(-1), returns.reshape(-1)
    if norm_adv:
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)

    dist, new_value = agent.dist_and_value(b_obs, amp)
    if agent.discrete:
        logprob = dist.log_prob(b_actions)
        entropy = dist.entropy().mean()
    else:
        logprob = dist.log_prob(b_actions).sum(1)
        entropy = dist.entropy().sum(1).mean()
    pg_loss = -(b_adv * logprob).mean()
    v_loss = F.mse_loss(new_value, b_returns)
    loss = pg_loss + vf_coef * v_loss - ent_coef * entropy

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        out = torch.stack([v_loss, pg_loss, entropy, grad_norm]).detach()
        return {
            "value_loss": out[0],
            "policy_loss": out[1],
            "entropy": out[2],
            "grad_norm": out[3],
            "explained_variance": explained_variance(values.reshape(-1), b_returns),
            "bad": ~torch.isfinite(out),
        }


class CudaGraphed:
    """Replays ``fn(*tensors)`` from a CUDA graph: ``warmup`` eager calls on a side stream, then capture.

    Inputs are copied into static buffers before each replay; the returned tensors are the graph's static
    outputs, overwritten by the next call (use them before calling again). ``fn`` must not sync with the host.
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
    """Add one step to the per-env episode sums (the raw reward, 1 to the length, ``info[key]`` for the KPIs in
    ``stats``); move the sums of finished episodes into the totals."""
    end = episode_end.to(torch.float64)
    keys = [k[len("ep_") :] for k in stats if k.startswith("ep_")]
    stats["ep_return"] += reward
    for key in keys:
        if key not in ("return", "length"):
            stats[f"ep_{key}"] += info[key]
    stats["ep_length"] += 1.0
    stats["n_done"] += end.sum()
    for key in keys:
        stats[f"sum_{key}"] += (stats[f"ep_{key}"] * end).sum()
        stats[f"ep_{key}"] *= 1.0 - end


def rollout(
    env,
    act,
    next_obs: torch.Tensor,
    storage: dict,
    stats: dict,
    rn: dict | None,
    gamma: float,
    bootstrap_truncation: bool,
    value_fn=None,
    discrete: bool = False,
) -> torch.Tensor:
    """Collect ``num_steps`` steps of every env into ``storage`` (in place) with ``act`` (:func:`policy_step`
    bound to the agent); no host sync in it. Returns the raw observation after the last step.

    Box actions are clipped to [-1, 1] for the env (stored unclipped); with ``discrete`` the action indices int64
    ``(num_envs,)`` go to the env as they are (:class:`GymVectorAdapter` adds the space's ``start``).

    Where the env reports ``info["final_obs"]`` (:class:`GymVectorAdapter`) and ``bootstrap_truncation`` holds,
    a truncated (not terminated) step gets ``gamma * value_fn(final_obs)`` added to its (normalised) reward and is
    stored as terminal, as Stable-Baselines3 does; ``value_fn`` (:func:`state_value` bound to the agent) maps raw
    observations ``(B, obs_dim)`` (or ``(B, C, H, W)``) to values ``(B,)``. Without ``final_obs`` (torch-batched
    envs) truncated steps bootstrap from the next stored value, the next episode's first observation.
    """
    for step in range(storage["obs"].shape[0]):
        obs_n, action, value = act(next_obs)
        storage["obs"][step] = obs_n
        storage["actions"][step] = action
        storage["values"][step] = value
        next_obs, reward, terminated, truncated, info = env.step(action if discrete else action.clamp(-1.0, 1.0))
        next_obs = next_obs.to(torch.float32)
        reward = reward.to(torch.float32)
        episode_end = terminated | truncated
        record_step(stats, reward, info, episode_end)
        if rn is not None:
            reward = normalize_reward(rn, reward, episode_end, gamma)
        final_obs = info.get("final_obs") if bootstrap_truncation and value_fn is not None else None
        if final_obs is not None:
            cut = (truncated & ~terminated).to(reward.dtype)
            reward = reward + gamma * cut * value_fn(final_obs).to(reward.dtype)
            storage["terminals"][step] = episode_end
        else:
            storage["terminals"][step] = terminated if bootstrap_truncation else episode_end
        storage["rewards"][step] = reward
        storage["dones"][step] = episode_end
    return next_obs


# ---------------------------------------------------------------------------------------------- helpers
def preset_table(args: Args) -> str:
    """The :data:`PRESETS` as one Markdown table: a row per field, a column per preset and the value in use
    (``args`` resolved; the preset picked is marked with ``*``). For an env with :data:`ENV_DEFAULTS` (e.g.
    ``Snake-v0``) a column of its defaults on the preset picked comes before ``used``, with rows for the fields
    that only it sets."""
    names = list(PRESETS)
    env = env_defaults(args.env_id, args.preset)
    keys = list(PRESETS[names[0]]) + [k for k in env if k not in PRESETS[names[0]]]
    env_col = [args.env_id.split(":")[-1]] if env else []
    head = "|field|" + "|".join([*(f"{n}{'*' if n == args.preset else ''}" for n in names), *env_col]) + "|used|"
    rows = [f"|{key}|" + "|".join([*(str(PRESETS[n].get(key, "")) for n in names), *(str(env.get(key, ""))
            for _ in env_col)]) + f"|{getattr(args, key)}|" for key in keys]  # fmt: skip
    return "\n".join([head, "|-" * (len(names) + len(env_col) + 2) + "|", *rows])


def is_evhub(env_id: str) -> bool:
    """Whether ``env_id`` names ``EVHub-v0`` (also as ``"module:EVHub-v0"``): the site options apply."""
    return env_id.split(":")[-1] == "EVHub-v0"


def env_defaults(env_id: str, preset: str) -> dict:
    """The :data:`ENV_DEFAULTS` of ``env_id`` (without its ``module:`` prefix; ``{}`` for an env without an entry),
    with its ``"<env_id>/<preset>"`` entry (sizes for one device preset) on top."""
    name = env_id.split(":")[-1]
    return {**ENV_DEFAULTS.get(name, {}), **ENV_DEFAULTS.get(f"{name}/{preset}", {})}


def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the env's defaults (:func:`env_defaults`), then the preset
    (:data:`PRESETS`), then :data:`FIELD_DEFAULTS`, and compute the runtime sizes. ``norm_obs`` left at ``None``
    stays so: :func:`main` decides it from the observation space.

    Raises:
        ValueError: ``--cudagraphs`` without CUDA, or a bad size.
    """
    if args.cudagraphs and device.type != "cuda":
        raise ValueError("--cudagraphs needs CUDA (no CUDA device in use); drop the flag or run on a GPU")
    name = args.preset if args.preset != "auto" else ("gpu" if device.type == "cuda" else "cpu")
    args.preset = name
    for source in (env_defaults(args.env_id, name), PRESETS[name], FIELD_DEFAULTS):
        for key, value in source.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.cnn_channels = tuple(int(c) for c in args.cnn_channels)
    if args.output_dir is None:
        if is_evhub(args.env_id):
            run = f"{args.exp_name}_{Path(args.site).stem}_{args.action_mode}_seed{args.seed}"
        else:
            run = f"{args.exp_name}_{args.env_id.replace(':', '_').replace('/', '_')}_seed{args.seed}"
        args.output_dir = str(Path("outputs") / "runs" / run)
    if min(args.num_envs, args.num_steps, args.log_every) < 1:
        raise ValueError("num_envs, num_steps and log_every must be >= 1")
    if len(args.cnn_channels) != 2 or min(args.cnn_channels) < 1:
        raise ValueError(f"cnn_channels must be two channel counts >= 1, got {args.cnn_channels}")
    args.batch_size = int(args.num_envs * args.num_steps)
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    return args


def rng_state(env) -> dict:
    """Python, NumPy, torch (and CUDA) RNG states, and the env's ``_generator`` where it has one (torch-batched)."""
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
    """Restore what :func:`rng_state` saved (the env generator only where both have one)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if hasattr(env, "_generator") and "env_generator" in state:
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
    """Back off after a CUDA out-of-memory error: halve ``args.num_envs`` and the batch (``num_envs * num_steps``).

    Args:
        args: the run's resolved arguments, changed in place (``num_envs``, ``batch_size``).
        history: the warnings of the halvings made so far in this run (their number counts against
            ``args.max_oom_retries``); the new warning is appended.
        where: where the error struck, e.g. ``"at setup"`` or ``"at global_step 1024 (iteration 3)"``.
        error: the first line of the out-of-memory error (see :func:`out_of_memory_message`).
        ckpt: the run's checkpoint path, named in the error.

    Returns:
        the warning: the old and the new sizes.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` halvings were made already, or num_envs is 1; ``args`` is left
            as it was.
    """
    n_envs = args.num_envs // 2
    if len(history) >= args.max_oom_retries:
        reason = f"max_oom_retries={args.max_oom_retries} halvings of num_envs were made already"
    elif n_envs < 1:
        reason = f"num_envs {args.num_envs} cannot be halved"
    else:
        batch = n_envs * args.num_steps
        message = (
            f"CUDA out of memory {where}: num_envs {args.num_envs} -> {n_envs} (batch {args.batch_size} -> {batch}); "
            f"continuing"
        )
        args.num_envs, args.batch_size = n_envs, batch
        history.append(message)
        return message
    kept = f"the last good checkpoint {ckpt} is left untouched" if ckpt.exists() else "no checkpoint was written"
    tried = "".join(f"\n  {h}" for h in history) if history else " none"
    raise OutOfMemoryBackoffError(
        f"CUDA out of memory {where} with num_envs {args.num_envs} (batch {args.batch_size}), and no further "
        f"back-off: {reason}. Training stopped; {kept}.\n"
        f"Halvings made:{tried}\n"
        f"Ask for less memory: a smaller --num-envs (or --num-steps, --hidden-size), no --cudagraphs or --compile; "
        f"or allow more halvings with --max-oom-retries.\n"
        f"The error: {error}"
    )


def export_policy(
    agent: Agent,
    obs_dim: int | tuple[int, ...],
    out_dir: Path,
    action_space: gym.spaces.Box | gym.spaces.Discrete | None = None,
) -> Path:
    """Save the deterministic actor (float32, CPU) for code that does not import ``algos``.

    ``torch.export`` with a dynamic batch dimension to ``policy.pt2``; if export fails, a TorchScript trace to
    ``policy.pt``. Either is written atomically (temporary file, then rename). Returns the written path.
    The program maps raw obs float32 ``(B, obs_dim)`` (flattened; ``obs_dim`` may be a shape, e.g. an image's
    ``(C, H, W)``: then ``(B, C, H, W)``, through the CNN torso) to:

    * Box actions (:class:`DeterministicActor`): the clipped mean action float32 ``(B, act_dim)``; with
      ``action_space`` (gymnasium envs, a Box) rescaled to its bounds, flattened; None: in [-1, 1].
    * Discrete actions (``agent.discrete``, :class:`GreedyActor`): the argmax action index int64 ``(B,)`` in
      ``0..n-1``; the env receives index + ``action_space.start`` (``action_space`` is not used).
    """
    if agent.discrete:
        actor = GreedyActor(copy.deepcopy(agent.obs_norm), copy.deepcopy(agent.actor_net()))
    else:
        bounds = {}
        if action_space is not None:
            bounds = {k: torch.as_tensor(np.asarray(b, np.float64).ravel()) for k, b in
                      (("low", action_space.low), ("high", action_space.high))}  # fmt: skip
        actor = DeterministicActor(copy.deepcopy(agent.obs_norm), copy.deepcopy(agent.actor_net()), **bounds)
    actor = actor.cpu().float().eval()
    example = torch.zeros(2, *((obs_dim,) if isinstance(obs_dim, int) else tuple(obs_dim)))
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


def metrics_row(
    global_step: int, wall_s: float, sps: float, ep: dict, losses: dict, lr: float, num_envs: int, gpu: dict | None = None
) -> dict:
    """One row of ``metrics.parquet`` from host numbers: episode means ``ep`` (NaN for the EVHub KPIs of other
    envs), update ``losses``, learning rate, the number of envs of the update (less than asked for after a halving
    for lack of memory) and the :func:`gpu_stats` (NaN on the CPU)."""
    gpu = gpu if gpu is not None else dict.fromkeys(GPU_STATS, math.nan)
    return {
        "global_step": global_step,
        "wall_s": wall_s,
        "sps": sps,
        "episodic_return": ep["return"],
        "episodic_co2_kg": ep["co2_kg"],
        "episodic_unserved_kwh": ep["unserved_kwh"],
        "episodic_length": ep["length"],
        "value_loss": losses["value_loss"],
        "policy_loss": losses["policy_loss"],
        "entropy": losses["entropy"],
        "grad_norm": losses["grad_norm"],
        "explained_variance": losses["explained_variance"],
        "learning_rate": lr,
        "num_envs": num_envs,
        **{key: float(gpu.get(key, math.nan)) for key in GPU_STATS},
    }


# ---------------------------------------------------------------------------------------------- main
def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy"}`` (path of the exported policy),
        ``"num_envs"`` and ``"batch_size"`` (the sizes trained with at the end: smaller than asked for after
        halvings for lack of CUDA memory) and, unless ``eval_split`` is ``"none"``, ``"eval"``: the KPI row (a
        one-row DataFrame).

    Raises:
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

    evhub = is_evhub(args.env_id)
    torch_batched = is_torch_batched(find_env_spec(args.env_id))
    site = envs.load_site(args.site) if evhub else None
    run_warnings: list[str] = []  # shown on stderr when they happen, and as TensorBoard text "warnings"
    if torch_batched and args.vector_mode != "sync":
        print(f"note: --vector-mode {args.vector_mode} is ignored: {args.env_id} is a torch-batched env (one "
              f"vector env on {device})")  # fmt: skip

    def build_envs() -> tuple:
        """The envs and all the state sized by num_envs: ``(env, storage, episode stats, reward normaliser)``."""
        if torch_batched:
            evhub_kwargs = {"site": site, "split": "train", "action_mode": args.action_mode,
                            "bess_action": args.bess_action} if evhub else {}  # fmt: skip
            env = gym.make_vec(
                args.env_id,
                num_envs=args.num_envs,
                vectorization_mode="vector_entry_point",
                device=device,
                **evhub_kwargs,
            )
            env = getattr(env, "unwrapped", env)
        else:
            env = make_gym_vector_env(args.env_id, args.num_envs, args.vector_mode, run_warnings)
        try:
            check_spaces(args.env_id, env.single_observation_space, env.single_action_space, torch_batched)
        except ValueError:
            env.close()
            raise
        if not torch_batched:
            env = GymVectorAdapter(env, device)
        discrete = isinstance(env.single_action_space, gym.spaces.Discrete)
        act_dim = 1 if discrete else int(np.prod(env.single_action_space.shape))
        storage = make_storage(args.num_steps, args.num_envs, network_obs_shape(env), act_dim, device, discrete)
        stats = make_episode_stats(args.num_envs, device, EVHUB_KPIS if evhub else ())
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
    # the branch on the observation space, a Python bool: a CNN torso for images (C, H, W), MLPs for flat obs
    obs_shape = network_obs_shape(env)
    image = len(obs_shape) == 3
    if args.norm_obs is None:  # images are expected in a fixed range ([0, 1] on Snake-v0): not standardised
        args.norm_obs = not image
    # the one branch on the action space, a Python bool: Categorical policy over n actions (Discrete) or Gaussian
    discrete = isinstance(env.single_action_space, gym.spaces.Discrete)
    act_dim = int(env.single_action_space.n) if discrete else int(np.prod(env.single_action_space.shape))

    inputs = None  # every feature (the selection below is EVHub-v0's observation layout)
    if evhub:
        inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
        if not args.weekday_features:
            inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    agent = Agent(
        obs_dim, act_dim, args.hidden_size, args.init_logstd, args.norm_obs, inputs, discrete,
        obs_shape if image else None, args.cnn_channels,
    ).to(device)  # fmt: skip
    # a device-tensor learning rate, annealed in place: no recompilation, and CUDA graphs see the new value.
    # On CUDA the optimizers take a tensor LR only as capturable (their foreach paths need it; graphs need it too).
    lr_t = torch.tensor(args.learning_rate, device=device)
    optimizer = make_optimizer(
        agent.parameters(), args.optimizer, lr_t, args.rmsprop_alpha, args.optimizer_eps, capturable=device.type == "cuda"
    )

    next_obs, _ = env.reset(seed=args.seed)
    next_obs = next_obs.to(torch.float32)
    global_step, start_iteration, train_wall_prev = 0, 1, 0.0
    rows: list[dict] = []
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step, start_iteration = int(ckpt["global_step"]), int(ckpt["iteration"]) + 1
        train_wall_prev = float(ckpt.get("train_wall_s", 0.0))
        set_rng_state(env, ckpt["rng"])
        if not torch_batched:
            # the state of gymnasium envs is not stored: new episodes (seeded apart from the first session's), the
            # totals of finished episodes and the return statistics carry over
            print(f"resume: the state of {args.env_id} cannot be stored; envs start new episodes")
            next_obs, _ = env.reset(seed=args.seed + global_step)
            for key, value in ckpt["episode_stats"].items():
                if key == "n_done" or key.startswith("sum_"):
                    stats[key].copy_(value)
            if rn is not None and ckpt.get("reward_norm") is not None:
                for key in ("mean", "var", "count"):
                    rn[key].copy_(ckpt["reward_norm"][key])
        elif ckpt.get("num_envs") == args.num_envs:
            env.load_state_dict(ckpt["env_state"])
            next_obs = ckpt["next_obs"].to(device)
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
    for group in optimizer.param_groups:  # load_state_dict replaces the LR; the command line's value holds
        group["lr"] = lr_t
    # the global step at which training ends: the learning rate anneals over the steps up to it
    end_step = global_step + (args.num_iterations - start_iteration + 1) * args.batch_size

    def bind_hot_functions() -> tuple:
        """The hot functions bound to the agent and optimizer, then compiled / CUDA-graphed as the speed switches
        say: ``(act, learn)``. Called again after a halving of num_envs: graphs are captured for one shape."""
        act = functools.partial(policy_step, agent, amp=args.amp)
        learn = functools.partial(
            update,
            agent,
            optimizer,
            gamma=args.gamma,
            gae_lambda=args.gae_lambda,
            vf_coef=args.vf_coef,
            ent_coef=args.ent_coef,
            max_grad_norm=args.max_grad_norm,
            norm_adv=args.norm_adv,
            amp=args.amp,
        )
        if args.compile:
            # random numbers from eager's kernels: a seed gives the same run with and without --compile
            torch._inductor.config.fallback_random = True
            act = torch.compile(act)
            learn = torch.compile(learn)
        if args.cudagraphs:
            act = CudaGraphed(act)
            learn = CudaGraphed(learn)
        return act, learn

    act, learn = bind_hot_functions()

    def shown_args() -> dict:
        """The resolved arguments this env reads (all but :data:`EVHUB_ONLY_ARGS` for envs other than EVHub-v0)."""
        return {k: v for k, v in vars(args).items() if evhub or k not in EVHUB_ONLY_ARGS}

    def hyperparameters() -> str:
        """The resolved arguments as a Markdown table (TensorBoard text)."""
        return "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in shown_args().items()))

    # the value of final observations (gymnasium envs' truncations); eager: called only in steps where one ends
    value_fn = None if torch_batched else functools.partial(state_value, agent, amp=args.amp)

    writer = SummaryWriter(str(out_dir))
    writer.add_text("hyperparameters", hyperparameters())
    writer.add_text("presets", preset_table(args))
    for message in oom_history:  # halvings at setup
        writer.add_text("oom", message, global_step)
    for message in run_warnings:  # e.g. the async vector env fell back to sync
        writer.add_text("warnings", message, global_step)
    env_desc = f"site={args.site} action_mode={args.action_mode}" if evhub else (
        "torch-batched" if torch_batched else f"vector_env={type(env.env.unwrapped).__name__}")
    net_desc = f"obs {obs_shape} " + (f"(CNN {args.cnn_channels[0]}-{args.cnn_channels[1]})" if image else "(MLP)")
    print(
        f"A2C on {args.env_id} {env_desc} {net_desc} device={device} preset={args.preset}: "
        f"{args.num_envs} envs x {args.num_steps} steps, {args.num_iterations} updates, "
        f"{args.total_timesteps:,} steps; output {out_dir}"
    )
    print(preset_table(args))
    print("args: " + ", ".join(f"{k}={v}" for k, v in shown_args().items()), flush=True)

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
            episode_stats=stats,
            reward_norm=rn,
        )

    bad_any = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    start_time = time.perf_counter()
    session_start_step = global_step
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
        desc="a2c",
    )
    try:
        while iteration < args.num_iterations:
            iteration += 1
            if iteration == half_iteration:
                steady_start = (synced_clock(device), global_step)
            if args.anneal_lr:
                lr_t.fill_((1.0 - global_step / end_step) * args.learning_rate)

            oom_error = None
            try:
                next_obs = rollout(
                    env, act, next_obs, storage, stats, rn, args.gamma, args.bootstrap_truncation, value_fn, discrete
                )
                out = learn(
                    storage["obs"],
                    storage["actions"],
                    storage["rewards"],
                    storage["values"],
                    storage["terminals"],
                    storage["dones"],
                    next_obs,
                )
            except RuntimeError as exc:
                oom_error = out_of_memory_message(exc)
                if oom_error is None:
                    raise
            if oom_error is not None:
                # out of memory: this iteration's rollout is dropped (its steps are not counted), the envs are
                # rebuilt with half as many copies and the iteration is repeated at the new size; the totals of
                # finished episodes and the return statistics carry over
                where = f"at global_step {global_step} (iteration {iteration})"
                iteration -= 1
                # the new envs go on drawing windows where these stopped (torch-batched envs)
                generator = env._generator.get_state() if hasattr(env, "_generator") else None
                if not torch_batched:
                    env.close()  # ends an async env's workers
                totals = {k: v for k, v in stats.items() if k == "n_done" or k.startswith("sum_")}
                rn_totals = None if rn is None else {k: rn[k] for k in ("mean", "var", "count")}
                env = storage = stats = rn = next_obs = out = act = learn = None
                env, storage, stats, rn = build_envs_backing_off(where, oom_error)
                if generator is not None:
                    env._generator.set_state(generator)
                for key, value in totals.items():
                    stats[key].copy_(value)
                for key, value in (rn_totals or {}).items():
                    rn[key].copy_(value)
                # gymnasium envs draw no windows from a generator: new episodes, seeded apart from the first ones
                next_obs, _ = env.reset() if torch_batched else env.reset(seed=args.seed + global_step)
                next_obs = next_obs.to(torch.float32)
                act, learn = bind_hot_functions()
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
            bad = out["bad"]
            first_bad_step = torch.where((first_bad_step < 0) & bad.any(), global_step, first_bad_step)
            bad_any |= bad

            last = iteration == args.num_iterations
            if iteration % args.log_every == 0 or last:
                check_finite(bad_any, first_bad_step, ckpt_path)  # host sync
                losses = {k: float(v) for k, v in out.items() if k != "bad"}
                lr_now = float(lr_t)
                n_done = float(stats["n_done"])
                ep = {k: float(stats[f"sum_{k}"]) / n_done if n_done and f"sum_{k}" in stats else math.nan
                      for k in ("return", "co2_kg", "unserved_kwh", "length")}  # fmt: skip
                for key in stats:
                    if key == "n_done" or key.startswith("sum_"):
                        stats[key].zero_()
                gpu = gpu_stats(device)  # host-side counters: no GPU sync
                wall = time.perf_counter() - start_time
                sps = (global_step - session_start_step) / max(wall, 1e-9)
                if n_done:
                    writer.add_scalar("charts/episodic_return", ep["return"], global_step)
                    writer.add_scalar("charts/episodic_length", ep["length"], global_step)
                    if evhub:
                        writer.add_scalar("charts/episodic_co2_kg", ep["co2_kg"], global_step)
                        writer.add_scalar("charts/episodic_unserved_kwh", ep["unserved_kwh"], global_step)
                for key, value in gpu.items():
                    if math.isfinite(value):
                        writer.add_scalar(f"perf/{key}", value, global_step)
                writer.add_scalar("charts/learning_rate", lr_now, global_step)
                for key in ("value_loss", "policy_loss", "entropy", "grad_norm", "explained_variance"):
                    writer.add_scalar(f"losses/{key}", losses[key], global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                rows.append(metrics_row(global_step, train_wall_prev + wall, sps, ep, losses, lr_now, args.num_envs, gpu))
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", co2=f"{ep['co2_kg']:.1f}", refresh=False)
                n_logs = max(1, args.num_iterations // args.log_every)
                if (bar.disable and (iteration // args.log_every) % max(1, n_logs // 10) == 0) or last:
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} "
                        f"return {ep['return']:.2f} "
                        + (f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if evhub else "")
                        + f"length {ep['length']:.1f} "
                        f"v_loss {losses['value_loss']:.4f} ev {losses['explained_variance']:.3f} "
                        f"entropy {losses['entropy']:.3f}",
                        flush=True,
                    )
            if args.checkpoint_every and iteration % args.checkpoint_every == 0 and not last:
                checkpoint(iteration, train_wall_prev + time.perf_counter() - start_time)
    except (NonFiniteLossError, OutOfMemoryBackoffError):
        writer.close()
        bar.close()
        raise
    finally:
        if not torch_batched and env is not None:
            env.close()  # ends an async env's workers; the envs are not stepped after training
    bar.close()
    if oom_history:  # the sizes actually used at the end
        writer.add_text("hyperparameters", hyperparameters(), global_step)

    end_time = synced_clock(device)
    sps_steady = (global_step - steady_start[1]) / max(end_time - steady_start[0], 1e-9) if steady_start else sps
    train_wall = train_wall_prev + end_time - start_time
    checkpoint(iteration, train_wall)
    policy_path = export_policy(agent, obs_shape, out_dir, None if torch_batched else env.single_action_space)
    if evhub:
        write_policy_spec(out_dir, args.env_id, args.action_mode, args.bess_action)
    print(f"training: {global_step:,} steps in {train_wall:.1f} s ({sps:.0f} SPS, {sps_steady:.0f} over the second half); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "sps_steady": sps_steady,
              "policy": str(policy_path), "num_envs": args.num_envs, "batch_size": args.batch_size}
    if not evhub and args.eval_split.lower() != "none":
        print(f"note: {args.env_id} has no data splits: no evaluation on eval_split={args.eval_split!r} (pass "
              f"--eval-split none to silence this note); the deterministic policy is in {policy_path}")  # fmt: skip
    elif args.eval_split.lower() != "none":
        actor = DeterministicActor(agent.obs_norm, agent.actor_mean).eval()

        def policy(obs: torch.Tensor, env_) -> torch.Tensor:
            return actor(obs.float()).to(obs.dtype)

        row, traces = evaluate_policy(
            policy,
            site,
            args.eval_split,
            "a2c",
            args.action_mode,
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
