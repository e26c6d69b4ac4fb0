"""Soft Actor-Critic for continuous actions, CleanRL style: one file, everything on one device. Trains on
``EVHub-v0`` by default and on any gymnasium env with a ``Box`` action space (``--env-id``).

Twin Q networks with Polyak-averaged target copies, a tanh-squashed Gaussian actor, and automatic entropy
tuning (``log_alpha`` with target entropy ``-act_dim``). Each iteration steps ``num_envs`` env copies once,
writes their transitions into a replay buffer preallocated on the training device (circular tensors,
sampled with ``torch.randint`` on the device) and then takes ``gradient_steps`` gradient steps, so the
update-to-data ratio is ``gradient_steps / num_envs``. Episode statistics are summed on the device; the host
reads numbers back only every ``log_every`` iterations.

The hot paths (:func:`sample_action`, :func:`update_critic`, :func:`update_actor`, :func:`soft_update`) are
plain functions; ``--compile`` rebinds them once with ``torch.compile`` and ``--cudagraphs`` once more with a
CUDA-graph replay (:class:`CudaGraphFn`), LeanRL-style. ``--amp`` runs the network forward passes under
bf16 autocast.

The site never terminates (episodes end by time limit only, and the env resets in the same step), so by
default the truncation is treated as non-terminal: the target bootstraps into the next window.

Other environments (``--env-id``, any registered id, also ``"my_module:MyEnv-v0"``):

* Torch-batched envs (a ``vector_entry_point`` in their spec) are built with
  ``gym.make_vec(..., vectorization_mode="vector_entry_point", device=...)``; the site arguments (``--site``,
  ``--action-mode``, ``--bess-action``) go to ``EVHub-v0`` only, and ``--vector-mode`` is ignored for them.
* Any other env is vectorised by gymnasium (``--vector-mode sync``: ``SyncVectorEnv``; ``async``:
  ``AsyncVectorEnv``, one worker process per env, for slow CPU- or I/O-bound envs; if the workers cannot start
  the run falls back to sync with a warning) with same-step autoreset, behind :class:`GymVectorAdapter`, which
  gives the loop tensors on the training device. Actions in [-1, 1] are rescaled to the env's ``Box`` bounds;
  on a truncation the Bellman target bootstraps from the episode's true last observation (``final_obs``).
  Observations must be flat (a 1-D ``Box``; SAC has no CNN torso: image observations stop with an error).
* The action space must be a bounded ``Box``; any other stops with a ``ValueError``.
* Site-only parts are skipped elsewhere: the split evaluation (``--eval-split``, ``--eval-every``), the
  ``policy.json`` spec, the socket / weekday feature selection and the ``co2_kg`` / ``unserved_kwh`` statistics
  (NaN in ``metrics.parquet``). The policy is still exported and checkpoints are written; a resumed run restores
  networks, optimizers, counters and RNG, but a gymnasium env's state cannot be stored, so its envs start new
  episodes.

Stepping order. Synchronously (``--vector-mode sync``, and every torch-batched env) an iteration is: act, step
the envs, store the transitions, then the gradient steps. With ``--vector-mode async`` the env step overlaps the
learning: act, ``env.step_async(actions)``, the gradient steps (on the transitions stored up to the previous
iteration) while the workers step, ``env.step_wait()``, then store the transitions. An iteration then takes
about max(env step, gradient steps) instead of their sum; the updates see the new transitions one iteration
later, so they also start one iteration later (once the buffer holds ``learning_starts`` rows before the step).

Run (defaults: ``caltech`` site, ``hub`` actions, a preset sized to the device)::

    python algos/sac.py
    python algos/sac.py --preset cpu --site path/to/site.toml --total-timesteps 200000 --seed 2
    python algos/sac.py --env-id Pendulum-v1 --num-envs 4 --total-timesteps 20000 --learning-starts 1000
    python algos/sac.py --env-id IOBound-v0 --num-envs 8 --vector-mode async
    tensorboard --logdir outputs/

Writes into ``output_dir``: TensorBoard events, ``metrics.parquet`` (the same curves; ``perf/gpu_*`` columns are
NaN on the CPU), ``checkpoint.pt`` (networks, optimizers, counters, RNG and env state, optionally the replay buffer;
``--resume`` continues from it), ``policy.pt2`` (the deterministic actor ``tanh(mean)`` as a ``torch.export``
program: obs float32 ``(B, obs_dim)`` -> action ``(B, act_dim)``, in [-1, 1] for ``EVHub-v0``, rescaled to the
env's action bounds for other envs), and for ``EVHub-v0`` the deterministic evaluation over ``eval_split``:
``eval_{split}.parquet`` (one KPI row, controller ``"sac"``) and ``eval_{split}_traces.parquet``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
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
import torch.nn.functional as F
import tyro
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/sac.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.files import atomic_write
from envs.kpis import evaluate_policy, write_parquet, write_policy_spec

EVHUB_ONLY_ARGS = ("site", "bess_action", "socket_features", "weekday_features", "eval_split")
"""Arguments that only EVHub-v0 reads: left out of the printed and logged hyperparameters of other envs."""


PRESETS = {
    # 2 CPU cores: a few dozen envs, a small net, a few gradient steps per iteration; 2.5 to 4 minutes
    # on the caltech site, evaluation included
    "cpu": {
        "num_envs": 32,
        "total_timesteps": 300_000,
        "buffer_size": 300_000,
        "batch_size": 256,
        "gradient_steps": 4,
        "learning_starts": 5_000,
        "hidden_size": 128,
        "log_every": 168,
        "threads": 1,
    },
    # one GPU: hundreds of envs, wide batches and nets, more gradient steps per iteration
    "gpu": {
        "num_envs": 256,
        "total_timesteps": 5_000_000,
        "buffer_size": 2_000_000,
        "batch_size": 2048,
        "gradient_steps": 8,
        "learning_starts": 25_600,
        "hidden_size": 256,
        "log_every": 168,
        "threads": 0,
    },
}
"""Values per preset for the fields left at ``None``; any of them can be set on the command line."""


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
    """default values of the fields left unset: 'cpu', 'gpu' or 'auto' (by the device)"""
    env_id: str = "EVHub-v0"
    """the id of the environment: any registered gymnasium id with a bounded Box action space (also
    'my_module:MyEnv-v0'); torch-batched envs (EVHub-v0) run on the device, others through gymnasium's vector envs"""
    vector_mode: Literal["sync", "async"] = "sync"
    """how gymnasium vectorises an env without a torch-batched vector entry point: 'sync' (one process) or 'async'
    (one worker process per env, stepped while the gradient steps run; falls back to sync with a warning if the
    workers cannot start); ignored for torch-batched envs such as EVHub-v0"""
    site: str = "caltech"
    """EVHub-v0 only: site to train on, a shipped site name or a path to a site TOML file"""
    action_mode: str = "hub"
    """EVHub-v0 only: 'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket); SAC needs
    continuous actions"""
    bess_action: Literal["surplus", "setpoint"] = "surplus"
    """EVHub-v0 only: meaning of the BESS action: 'surplus' (the PV surplus is always stored; -1 = cover the deficit, the
    self-consumption rule; 0 = hold at a deficit; +1 = charge at full power) or 'setpoint' (a_bess times the
    BESS power limit)"""
    total_timesteps: int | None = None
    """total env steps of the experiment (None: preset, 300,000 cpu, 5,000,000 gpu)"""
    num_envs: int | None = None
    """the number of parallel env copies stepped per iteration (None: preset, 32 cpu, 256 gpu)"""
    buffer_size: int | None = None
    """the replay memory buffer size, in transitions (None: preset, 300,000 cpu, 2,000,000 gpu)"""
    gamma: float = 0.9
    """the discount factor gamma (0.9: a horizon of about ten hourly steps, enough to carry noon PV to the evening;
    on caltech 0.9 evaluated better than 0.95, 0.98 and 0.8 within the CPU budget)"""
    tau: float = 0.005
    """target smoothing coefficient (Polyak averaging: target <- (1 - tau) * target + tau * online)"""
    batch_size: int | None = None
    """the batch size of a sample from the replay memory (None: preset, 256 cpu, 2048 gpu)"""
    learning_starts: int | None = None
    """env steps of uniform random actions before learning starts (None: preset, 5,000 cpu, 25,600 gpu)"""
    gradient_steps: int | None = None
    """gradient steps per iteration of num_envs env steps (update-to-data ratio gradient_steps / num_envs;
    None: preset, 4 cpu, 8 gpu)"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training the policy (delayed), in gradient steps; the policy then takes that many steps"""
    target_network_frequency: int = 1
    """the frequency of updates for the target networks, in gradient steps"""
    alpha: float = 0.2
    """entropy regularization coefficient (initial value when autotune is on)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient (target entropy = -act_dim)"""
    hidden_size: int | None = None
    """width of the two hidden layers of actor and critics (None: preset, 128 cpu, 256 gpu)"""
    reward_scale: float = 1.0
    """constant factor on the env reward before it enters the replay buffer (statistics use the raw reward)"""
    socket_features: bool | None = None
    """EVHub-v0 only: feed the per-socket observations to the networks (None: only in 'socket' mode; in 'hub' mode the site
    aggregates (energy needed, deadline floor and cap power) carry what the hub action needs, at a fraction of
    the cost of the first layers)"""
    weekday_features: bool = False
    """EVHub-v0 only: feed the day-of-week features (sin/cos) to the networks (off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal: on EVHub-v0 (the site never terminates) bootstrap through
    the autoreset into the next window, on gymnasium envs from the episode's last observation (final_obs); False
    treats it as terminal"""
    compile: bool = False
    """torch.compile the action sampling, the critic and actor updates and the target update"""
    cudagraphs: bool = False
    """capture the action sampling and the updates in CUDA graphs (needs CUDA; capturable Adam, tensor learning rates)"""
    amp: bool = False
    """bf16 autocast of the network forward passes (losses and optimizer state stay float32)"""
    threads: int | None = None
    """torch intra-op CPU threads (None: preset, 1 cpu: these small nets run fastest on one thread; 0: torch's default)"""
    log_every: int | None = None
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar; None: preset,
    168: one caltech episode, so every log sees the envs' episodes end)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed} on EVHub-v0,
    outputs/runs/{exp_name}_{env_id}_seed{seed} otherwise)"""
    checkpoint_every: int = 2_000
    """iterations between checkpoints (0: only at the end)"""
    save_buffer: bool = False
    """also store the replay buffer in the checkpoint (large); without it a resumed run refills the buffer
    for learning_starts steps with the current policy before updating again"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (networks, optimizers, counters, RNG and env state, and the replay
    buffer if it was stored; a gymnasium env's state is not stored: its envs start new episodes)"""
    eval_split: str = "test"
    """EVHub-v0 only: split for the final deterministic evaluation ('none' skips it)"""
    eval_every: int = 0
    """EVHub-v0 only: iterations between deterministic evaluations on eval_split during training (0: only the final one); each
    is logged as eval/co2_kg etc. and added to eval_curve.parquet with the training wall time so far, which
    leaves the evaluations out"""
    max_oom_retries: int = 3
    """halvings allowed after CUDA out-of-memory errors: in the gradient steps batch_size halves while it stays
    >= 64, then num_envs; stepping the envs (or at setup) num_envs halves, which rebuilds the envs (the replay buffer
    is kept). Each warns and trains on to total_timesteps; one more error stops the run with OutOfMemoryBackoffError,
    its last checkpoint kept (0: stop at the first). A replay buffer that does not fit at setup is halved apart
    from these, down to max(num_envs, batch_size) rows"""

    # filled in at runtime
    num_iterations: int = 0
    """the number of iterations (computed in runtime: total_timesteps // num_envs)"""


OBS_WEEKDAY = (2, 3)
"""Indices of the day-of-week features (sin, cos) in EVHub-v0's observation."""

LOSS_NAMES = ("qf_loss", "actor_loss", "alpha_loss")
"""Quantities checked for finiteness after each update, in the order of the ``bad`` flags."""

LOG_STD_MAX = 2.0
LOG_STD_MIN = -5.0

OOM_MIN_BATCH_SIZE = 64
"""The smallest batch_size the out-of-memory back-off halves to; below it, num_envs halves instead."""


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class NonFiniteLossError(RuntimeError):
    """A loss became NaN or infinite; training stops, the last checkpoint is kept."""


class OutOfMemoryBackoffError(RuntimeError):
    """CUDA ran out of memory and the back-off cannot go on (``max_oom_retries`` halvings made, or nothing left to
    halve); training stops, the last checkpoint is kept."""


# ---------------------------------------------------------------------------------------------- pure pieces
def squashed_gaussian_sample(
    mean: torch.Tensor, log_std: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reparameterised sample of ``tanh(N(mean, exp(log_std)))`` from standard-normal ``noise``.

    Returns:
        ``(action, log_prob)``: action in (-1, 1) ``(B, act_dim)`` and its log-density ``(B,)``, the Gaussian
        log-density minus the tanh change of variables ``sum log(1 - tanh(u)^2)``, written in the stable form
        ``2 * (log 2 - u - softplus(-2u))``.
    """
    std = log_std.exp()
    u = mean + std * noise
    gauss = (-0.5 * noise.square() - log_std - 0.5 * math.log(2.0 * math.pi)).sum(-1)
    log_det = (2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))).sum(-1)
    return torch.tanh(u), gauss - log_det


@torch.no_grad()
def soft_update(target: list[torch.Tensor], source: list[torch.Tensor], tau: float) -> None:
    """Polyak averaging in place: ``target <- (1 - tau) * target + tau * source`` for each pair of tensors."""
    torch._foreach_lerp_(target, source, tau)


class ReplayBuffer:
    """Circular replay memory of preallocated tensors on ``device``.

    ``add`` writes a batch of ``n`` transitions at the write position (wrapping around past the end, where
    they overwrite the oldest rows); ``sample`` draws rows uniformly with replacement among the filled ones.
    The write position and fill level are host integers that advance by known amounts, so neither reads
    anything back from the device.
    """

    FIELDS = ("obs", "actions", "rewards", "next_obs", "dones")

    def __init__(self, capacity: int, obs_dim: int, act_dim: int, device: torch.device, dtype=torch.float32):
        self.capacity, self.device = int(capacity), torch.device(device)
        z = lambda *s: torch.zeros(self.capacity, *s, device=device, dtype=dtype)  # noqa: E731
        self.data = {"obs": z(obs_dim), "actions": z(act_dim), "rewards": z(), "next_obs": z(obs_dim), "dones": z()}
        self.pos, self.size = 0, 0

    def add(self, obs, actions, rewards, next_obs, dones) -> None:
        n = obs.shape[0]
        if n > self.capacity:
            raise ValueError(f"cannot add {n} transitions to a buffer of {self.capacity}")
        idx = torch.arange(self.pos, self.pos + n, device=self.device) % self.capacity
        for key, value in zip(self.FIELDS, (obs, actions, rewards, next_obs, dones)):
            self.data[key].index_copy_(0, idx, value.to(self.data[key].dtype))
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if self.size == 0:
            raise ValueError("sample from an empty replay buffer")
        idx = torch.randint(0, self.size, (batch_size,), device=self.device, generator=generator)
        return {key: value.index_select(0, idx) for key, value in self.data.items()}

    def state_dict(self) -> dict:
        """``pos`` and ``size`` (ints) and the ``size`` filled rows of each field, copied to the CPU with their own
        storage (a slice of the preallocated tensor would make ``torch.save`` write all ``capacity`` rows)."""
        rows = {k: v[: self.size].to("cpu", copy=True) for k, v in self.data.items()}
        return {"pos": self.pos, "size": self.size, **rows}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` in place; into a smaller buffer only its first ``capacity`` rows."""
        n = min(int(state["size"]), self.capacity)
        for key in self.FIELDS:
            self.data[key][:n].copy_(state[key][:n])
        # a smaller buffer keeps the first rows and writes over them from the start
        self.size = n
        self.pos = int(state["pos"]) % self.capacity if n == int(state["size"]) else 0


# ---------------------------------------------------------------------------------------------- networks
class Select(nn.Module):
    """Keeps the observation features listed in ``keep`` (the networks' inputs)."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


def mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


class SoftQNetwork(nn.Module):
    """Q(s, a): an MLP over the selected observation features and the action."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, inputs: list[int]):
        super().__init__()
        self.select = Select(inputs) if len(inputs) < obs_dim else nn.Identity()
        self.net = mlp(len(inputs) + act_dim, hidden, 1)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([self.select(obs), act.to(obs.dtype)], -1)).squeeze(-1)


class Actor(nn.Module):
    """Gaussian policy over the pre-squash action; ``log_std`` is state-dependent and squashed into
    ``[LOG_STD_MIN, LOG_STD_MAX]``. The env's action box is [-1, 1], so tanh needs no rescaling."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, inputs: list[int]):
        super().__init__()
        self.select = Select(inputs) if len(inputs) < obs_dim else nn.Identity()
        self.trunk = nn.Sequential(nn.Linear(len(inputs), hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.fc_mean = nn.Linear(hidden, act_dim)
        self.fc_logstd = nn.Linear(hidden, act_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(self.select(obs))
        log_std = torch.tanh(self.fc_logstd(h))
        return self.fc_mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)

    def get_action(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sampled action, its log-prob, deterministic action tanh(mean))``, all float32."""
        mean, log_std = self(obs)
        mean, log_std = mean.float(), log_std.float()
        action, log_prob = squashed_gaussian_sample(mean, log_std, torch.randn_like(mean))
        return action, log_prob, torch.tanh(mean)


class DeterministicActor(nn.Module):
    """The deterministic policy: raw obs float32 ``(B, obs_dim)`` -> ``tanh(mean)`` ``(B, act_dim)`` in [-1, 1].

    With ``low`` and ``high`` (float32 ``(act_dim,)``, finite) the action is rescaled from [-1, 1] to
    ``[low, high]`` (the env's ``Box`` bounds), as :class:`GymVectorAdapter` does in training.
    """

    def __init__(self, actor: Actor, low: torch.Tensor | None = None, high: torch.Tensor | None = None):
        super().__init__()
        self.actor = actor
        self.rescale = low is not None
        if self.rescale:
            self.register_buffer("low", torch.as_tensor(low, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(high, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        action = torch.tanh(self.actor(obs)[0])
        if self.rescale:
            action = self.low + 0.5 * (action + 1.0) * (self.high - self.low)
        return action


# ---------------------------------------------------------------------------------------------- hot paths
def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def sample_action(actor: Actor, obs: torch.Tensor, amp: bool) -> torch.Tensor:
    """A stochastic action of the current policy for each env (the exploration of the rollout)."""
    with torch.no_grad(), autocast(obs.device, amp):
        return actor.get_action(obs)[0]


def update_critic(
    obs: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    next_obs: torch.Tensor,
    dones: torch.Tensor,
    *,
    actor: Actor,
    qf1: SoftQNetwork,
    qf2: SoftQNetwork,
    qf1_target: SoftQNetwork,
    qf2_target: SoftQNetwork,
    log_alpha: torch.Tensor,
    q_optimizer: torch.optim.Optimizer,
    gamma: float,
    amp: bool,
) -> dict[str, torch.Tensor]:
    """One gradient step of both Q networks on the soft Bellman target of the target networks."""
    with torch.no_grad():
        with autocast(obs.device, amp):
            next_actions, next_log_pi, _ = actor.get_action(next_obs)
            q1_next = qf1_target(next_obs, next_actions).float()
            q2_next = qf2_target(next_obs, next_actions).float()
        min_q_next = torch.minimum(q1_next, q2_next) - log_alpha.exp() * next_log_pi
        target = rewards + (1.0 - dones) * gamma * min_q_next
    with autocast(obs.device, amp):
        q1 = qf1(obs, actions).float()
        q2 = qf2(obs, actions).float()
    qf1_loss = F.mse_loss(q1, target)
    qf2_loss = F.mse_loss(q2, target)
    qf_loss = qf1_loss + qf2_loss
    q_optimizer.zero_grad(set_to_none=True)
    params = [p for group in q_optimizer.param_groups for p in group["params"]]
    torch.autograd.backward(qf_loss, inputs=params)
    q_optimizer.step()
    return {
        "qf1_values": q1.detach().mean(),
        "qf2_values": q2.detach().mean(),
        "qf1_loss": qf1_loss.detach(),
        "qf2_loss": qf2_loss.detach(),
        "qf_loss": qf_loss.detach() / 2.0,
        "bad": ~torch.isfinite(qf_loss.detach()),
    }


def update_actor(
    obs: torch.Tensor,
    *,
    actor: Actor,
    qf1: SoftQNetwork,
    qf2: SoftQNetwork,
    log_alpha: torch.Tensor,
    actor_optimizer: torch.optim.Optimizer,
    a_optimizer: torch.optim.Optimizer | None,
    target_entropy: float,
    amp: bool,
) -> dict[str, torch.Tensor]:
    """One gradient step of the actor (maximise min Q - alpha log pi) and, with autotune, of ``log_alpha``."""
    with autocast(obs.device, amp):
        pi, log_pi, _ = actor.get_action(obs)
        min_q = torch.minimum(qf1(obs, pi), qf2(obs, pi)).float()
    alpha = log_alpha.exp().detach()
    actor_loss = (alpha * log_pi - min_q).mean()
    actor_optimizer.zero_grad(set_to_none=True)
    # gradients only into the actor: the critics' grads are left alone (they belong to the critic step)
    torch.autograd.backward(actor_loss, inputs=list(actor.parameters()))
    actor_optimizer.step()
    if a_optimizer is not None:
        alpha_loss = (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()
        a_optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(alpha_loss, inputs=[log_alpha])
        a_optimizer.step()
    else:
        alpha_loss = torch.zeros((), device=obs.device)
    return {
        "actor_loss": actor_loss.detach(),
        "alpha": log_alpha.detach().exp(),
        "alpha_loss": alpha_loss.detach(),
        "bad": ~torch.isfinite(torch.stack([actor_loss.detach(), alpha_loss.detach()])),
    }


def record_episode_stats(stats: dict, reward: torch.Tensor, info: dict, episode_end: torch.Tensor) -> None:
    """Add one step to the per-env episode sums; fold the envs whose episode ended into the log sums.

    ``reward`` float32 ``(N,)`` (raw, unscaled), ``episode_end`` bool ``(N,)``; ``info["co2_kg"]`` and
    ``info["unserved_kwh"]`` (``(N,)``) are added where the env reports them (``EVHub-v0``), else left at 0.
    """
    end = episode_end.to(torch.float64)
    stats["ep_return"] += reward
    if "co2_kg" in info:
        stats["ep_co2_kg"] += info["co2_kg"]
        stats["ep_unserved_kwh"] += info["unserved_kwh"]
    stats["ep_length"] += 1.0
    stats["n_done"] += end.sum()
    for key in ("return", "co2_kg", "unserved_kwh", "length"):
        stats[f"sum_{key}"] += (stats[f"ep_{key}"] * end).sum()
        stats[f"ep_{key}"] *= 1.0 - end


class CudaGraphFn:
    """Replays ``fn`` as a CUDA graph: the first call warms ``fn`` up on a side stream (``warmup`` real calls),
    captures one call on static copies of the arguments and replays it; later calls copy the arguments into
    the static inputs and replay. The returned tensors are the static outputs, overwritten by the next call.
    """

    def __init__(self, fn, warmup: int = 3):
        self.fn, self.warmup = fn, warmup
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, *args):
        if self.graph is None:
            self.static_in = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, args)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    self.fn(*self.static_in)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.fn(*self.static_in)
        else:
            for dst, src in zip(tree_flatten(self.static_in)[0], tree_flatten(args)[0]):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
        self.graph.replay()
        return self.static_out



# ---------------------------------------------------------------------------------------------- environments
def is_torch_batched(env_id: str) -> bool:
    """Whether ``env_id`` is a torch-batched env such as ``EVHub-v0``: its spec has a ``vector_entry_point`` whose
    constructor takes a ``device``. Gymnasium's own NumPy vector entry points (``CartPole-v1`` has one) take none
    and are vectorised by ``--vector-mode`` like any other env.

    Raises:
        gymnasium.error.Error: ``env_id`` is not registered (a ``"module:EnvId"`` id imports its module first).
    """
    entry = gym.spec(env_id).vector_entry_point
    if entry is None:
        return False
    creator = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
    try:
        return "device" in inspect.signature(creator).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def check_action_space(env_id: str, space: gym.Space) -> None:
    """SAC needs a bounded ``Box`` action space.

    Raises:
        ValueError: naming ``env_id`` and ``space``: not a ``Box``, or a ``Box`` with an infinite bound.
    """
    if not isinstance(space, gym.spaces.Box):
        raise ValueError(
            f"SAC needs a continuous (Box) action space, but {env_id} has {space}; use algos/dqn.py for discrete actions"
        )
    if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise ValueError(
            f"SAC squashes its actions into the action bounds, but {env_id} has an unbounded action space {space}"
        )


def check_observation_space(env_id: str, space: gym.Space) -> None:
    """SAC's networks are MLPs over flat observations.

    Raises:
        ValueError: naming ``env_id`` and ``space``: not a ``Box``, or image-shaped (3-D, e.g. ``(C, H, W)``:
            SAC has no CNN torso) or otherwise not 1-D.
    """
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
        kind = "image observations (3-D)" if isinstance(space, gym.spaces.Box) and len(space.shape) == 3 else "this"
        raise ValueError(
            f"SAC's networks take flat observations (a 1-D Box), but {env_id} has {space}: {kind} is not supported "
            f"(algos/dqn.py has a CNN torso for image observations)"
        )


class GymVectorAdapter:
    """A gymnasium vector env (NumPy, same-step autoreset) behind the tensor interface of the torch-batched envs.

    ``reset`` and ``step`` / ``step_wait`` return ``obs`` float32 ``(N, obs_dim)`` on ``device``, ``reward`` float32
    ``(N,)``, ``terminated`` / ``truncated`` bool ``(N,)`` and ``info`` holding ``"final_obs"``: float32
    ``(N, obs_dim)``, the observation each env actually reached (its episode's last observation where the episode
    ended in this step, the returned ``obs`` elsewhere), the ``next_obs`` of the Bellman target. ``step`` and
    ``step_async`` take actions float32 ``(N, act_dim)`` in [-1, 1] on any device, rescale them linearly to the
    ``Box``'s ``[low, high]`` (clipped there) and send them as the space's dtype and shape.

    Episode statistics are kept by the training loop on the device from the rewards (what
    ``RecordEpisodeStatistics`` would give), since that wrapper cannot split a step into ``step_async`` and
    ``step_wait``. The env's state is not part of checkpoints (``state_dict`` is None).

    Args:
        env: a ``gymnasium.vector.VectorEnv`` (``SyncVectorEnv`` or ``AsyncVectorEnv``) with a ``Box`` action space.
        device: where the returned tensors live.
        mode: ``"sync"`` or ``"async"``, the kind of ``env`` (``overlap`` is True for ``"async"``).
    """

    def __init__(self, env, device: torch.device, mode: str):
        self.env, self.device, self.mode = env, torch.device(device), mode
        self.overlap = mode == "async"
        self.num_envs = env.num_envs
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        space = env.single_action_space  # checked by the caller (check_action_space): others have no bounds
        box = isinstance(space, gym.spaces.Box)
        self.low = np.asarray(space.low, np.float32).reshape(-1) if box else None
        self.high = np.asarray(space.high, np.float32).reshape(-1) if box else None
        self._pending = False

    def _obs(self, obs: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(obs, np.float32).reshape(self.num_envs, -1), device=self.device)

    def _actions(self, actions: torch.Tensor) -> np.ndarray:
        a = actions.detach().to("cpu", torch.float32).numpy().reshape(self.num_envs, -1)
        a = np.clip(self.low + 0.5 * (a + 1.0) * (self.high - self.low), self.low, self.high)
        space = self.single_action_space
        return a.astype(space.dtype).reshape(self.num_envs, *space.shape)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every env (env ``i`` seeded with ``seed + i``); returns ``(obs, {})``."""
        obs, _ = self.env.reset(seed=seed)
        return self._obs(obs), {}

    def step_async(self, actions: torch.Tensor) -> None:
        """Send the actions to the envs and return at once (an ``AsyncVectorEnv``'s workers step meanwhile)."""
        a = self._actions(actions)
        if hasattr(self.env, "step_async"):
            self.env.step_async(a)
        else:  # SyncVectorEnv: no split, step now
            self._result = self.env.step(a)
        self._pending = True

    def step_wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Wait for the step sent by :meth:`step_async`; returns ``(obs, reward, terminated, truncated, info)``."""
        self._pending = False
        if hasattr(self.env, "step_wait"):
            obs, reward, terminated, truncated, info = self.env.step_wait()
        else:
            obs, reward, terminated, truncated, info = self._result
            self._result = None
        final = np.array(obs, np.float32, copy=True).reshape(self.num_envs, -1)
        if "_final_obs" in info:
            for i in np.flatnonzero(info["_final_obs"]):
                final[i] = np.asarray(info["final_obs"][i], np.float32).reshape(-1)
        t = lambda x, dtype: torch.as_tensor(np.asarray(x), dtype=dtype, device=self.device)  # noqa: E731
        out = {"final_obs": t(final, torch.float32)}
        return self._obs(obs), t(reward, torch.float32), t(terminated, torch.bool), t(truncated, torch.bool), out

    def step(self, actions: torch.Tensor):
        """:meth:`step_async` then :meth:`step_wait`."""
        self.step_async(actions)
        return self.step_wait()

    def state_dict(self) -> None:
        """None: a gymnasium env's state cannot be stored."""
        return None

    def close(self) -> None:
        """Close the envs (and an ``AsyncVectorEnv``'s workers; a step still in flight is waited for first)."""
        if self._pending:
            with contextlib.suppress(Exception):
                self.step_wait()
        self.env.close()


def make_gym_vector_env(env_id: str, num_envs: int, mode: str, device: torch.device, warnings: list[str]):
    """``gym.make_vec(env_id, num_envs, vectorization_mode=mode)`` with same-step autoreset, in a
    :class:`GymVectorAdapter`.

    If the ``"async"`` workers cannot start (no fork, an env factory that cannot be pickled, ...), warn on stderr,
    append the warning to ``warnings`` (the caller logs it to TensorBoard) and build the ``"sync"`` env instead.
    """
    kwargs = {"vector_kwargs": {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}}
    if mode == "async":
        try:
            return GymVectorAdapter(gym.make_vec(env_id, num_envs, vectorization_mode="async", **kwargs), device, "async")
        except Exception as exc:  # noqa: BLE001 - any failure to start the workers falls back to sync
            message = (
                f"--vector-mode async: the {num_envs} worker processes for {env_id} did not start "
                f"({type(exc).__name__}: {exc}); falling back to --vector-mode sync"
            )
            print(f"warning: {message}", file=sys.stderr, flush=True)
            warnings.append(message)
    return GymVectorAdapter(gym.make_vec(env_id, num_envs, vectorization_mode="sync", **kwargs), device, "sync")


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory and utilisation for the log, read without a device sync.

    On CUDA: ``perf/gpu_mem_allocated_gb``, ``perf/gpu_mem_reserved_gb`` and ``perf/gpu_mem_peak_gb`` (the caching
    allocator's host-side counters ``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated``,
    in GB = 1e9 bytes) and ``perf/gpu_util_pct`` (percent of the last sample period the GPU was busy, from NVML via
    ``pynvml``; NaN when that does not import or fails). On any other device every value is NaN. Never raises.
    """
    keys = ("perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct")
    out = dict.fromkeys(keys, math.nan)
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return out
    try:
        out["perf/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        out["perf/gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        out["perf/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring must never stop training
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.device(device).index
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if index is None else index)
        out["perf/gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no pynvml, or no NVML on this machine
        pass
    return out


# ---------------------------------------------------------------------------------------------- helpers
def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the preset and compute the runtime sizes."""
    name = args.preset.lower()
    if name == "auto":
        name = "gpu" if device.type == "cuda" else "cpu"
    if name == "cuda":
        name = "gpu"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: expected 'auto', 'cpu' or 'gpu'")
    args.preset = name
    for key, value in PRESETS[name].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    evhub = args.env_id == "EVHub-v0"
    if evhub and args.action_mode not in ("hub", "socket"):
        raise ValueError(f"SAC needs continuous actions: action_mode 'hub' or 'socket', not {args.action_mode!r}")
    if args.output_dir is None:
        if evhub:
            name = f"{args.exp_name}_{Path(args.site).stem}_{args.action_mode}_seed{args.seed}"
        else:
            name = f"{args.exp_name}_{''.join(c if c.isalnum() or c in '-_.' else '_' for c in args.env_id)}_seed{args.seed}"
        args.output_dir = str(Path("outputs") / "runs" / name)
    if args.socket_features is None:
        args.socket_features = args.action_mode == "socket"
    args.num_iterations = max(1, args.total_timesteps // args.num_envs)
    if args.buffer_size < args.num_envs:
        raise ValueError(f"buffer_size={args.buffer_size} is smaller than num_envs={args.num_envs}")
    return args


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


def make_buffer(
    args: Args, obs_dim: int, act_dim: int, device: torch.device, notes: list[str] | None = None
) -> ReplayBuffer:
    """Allocate the replay buffer of ``args.buffer_size`` rows; on CUDA out-of-memory halve ``args.buffer_size``
    (in place) and retry, down to ``max(num_envs, batch_size)`` rows, with a warning on stderr for each halving
    (also appended to ``notes``).

    Raises:
        OutOfMemoryBackoffError: not even a buffer of that many rows fits.
    """
    while True:
        try:
            return ReplayBuffer(args.buffer_size, obs_dim, act_dim, device)
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
    otherwise, and at setup or while stepping the envs, num_envs halves (the caller rebuilds the envs; the
    update-to-data ratio ``gradient_steps / num_envs`` doubles).

    Args:
        args: the run's resolved arguments, changed in place.
        history: the warnings of the halvings made so far in this run (their number counts against
            ``args.max_oom_retries``); the new warning is appended.
        where: where the error struck, e.g. ``"at setup"`` or ``"at global_step 1024 (iteration 256), ..."``.
        error: the first line of the out-of-memory error (see :func:`out_of_memory_message`).
        ckpt: the run's checkpoint path, named in the error.
        in_update: the error struck in the gradient steps.

    Returns:
        the warning: the old and the new value.

    Raises:
        OutOfMemoryBackoffError: ``max_oom_retries`` halvings were made already, or there is nothing left to halve
            (one env, and in the gradient steps a batch at its floor); ``args`` is left as it was.
    """
    n, b, g = args.num_envs, args.batch_size, args.gradient_steps
    if len(history) >= args.max_oom_retries:
        reason = f"max_oom_retries={args.max_oom_retries} halvings were made already"
    elif in_update and b // 2 >= OOM_MIN_BATCH_SIZE:
        message = f"CUDA out of memory {where}: batch_size {b} -> {b // 2}; continuing"
        args.batch_size = b // 2
        history.append(message)
        return message
    elif n >= 2:
        message = (
            f"CUDA out of memory {where}: num_envs {n} -> {n // 2} (update-to-data ratio {g / n:.3g} -> "
            f"{g / (n // 2):.3g}); continuing"
        )
        args.num_envs = n // 2
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


def rng_state(env) -> dict:
    """Python, NumPy, torch (and CUDA) RNG states and, for a torch-batched env, its ``_generator``'s."""
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


def check_finite(bad_any: torch.Tensor, first_bad_step: torch.Tensor, ckpt: Path) -> None:
    """Raise :class:`NonFiniteLossError` if any update produced a non-finite loss (one host sync)."""
    step = int(first_bad_step)
    if step >= 0:
        names = [n for n, b in zip(LOSS_NAMES, bad_any.tolist()) if b]
        kept = f"the last good checkpoint {ckpt} is left untouched" if ckpt.exists() else "no checkpoint was written"
        raise NonFiniteLossError(f"non-finite {', '.join(names)} in the update at global_step {step}; training stopped, {kept}")


def export_policy(actor: Actor, obs_dim: int, out_dir: Path, low=None, high=None) -> Path:
    """Save the deterministic actor (``torch.export`` with a dynamic batch to ``policy.pt2``; TorchScript
    ``policy.pt`` if export fails), written atomically (temporary file, then rename). Returns the written path.

    ``low`` / ``high`` (float32 ``(act_dim,)``): the env's action bounds, built into the exported program (see
    :class:`DeterministicActor`); None keeps actions in [-1, 1]."""
    module = DeterministicActor(copy.deepcopy(actor), low, high).cpu().float().eval()
    example = torch.zeros(2, obs_dim)
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


def preset_table(args: Args) -> str:
    """The preset values as one text table: each field, its value in every preset and the value used (``*`` where
    the command line set another value than the chosen preset's)."""
    names = list(PRESETS)
    rows = [("field", *names, f"used ({args.preset})")]
    for key in PRESETS[names[0]]:
        used = getattr(args, key)
        mark = "" if used == PRESETS.get(args.preset, {}).get(key) else " *"
        rows.append((key, *(str(PRESETS[n][key]) for n in names), f"{used}{mark}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "presets (* set on the command line):\n" + "\n".join("  " + line for line in lines)


LOSS_KEYS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha", "alpha_loss")
"""Columns of metrics.parquet / ``losses/*`` scalars (NaN before learning starts)."""


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
    if args.cudagraphs and device.type != "cuda":
        raise SystemExit("--cudagraphs needs CUDA (no CUDA device is available or --no-cuda was given)")
    args = resolve_args(args, device)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "checkpoint.pt"
    if args.resume and not ckpt_path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before the first GEMM
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    evhub = args.env_id == "EVHub-v0"
    torch_batched = is_torch_batched(args.env_id)
    site = envs.load_site(args.site) if evhub else None
    env_warnings: list[str] = []  # e.g. the fall-back from async to sync, for TensorBoard text "warnings"
    if torch_batched and args.vector_mode != "sync":
        print(f"note: --vector-mode {args.vector_mode} is ignored: {args.env_id} is torch-batched (steps on {device})")

    def build_envs() -> tuple:
        """The envs and the episode statistics, sized by num_envs: ``(env, stats)``."""
        if torch_batched:
            site_kwargs = (
                dict(site=site, split="train", action_mode=args.action_mode, bess_action=args.bess_action) if evhub else {}
            )
            env = gym.make_vec(
                args.env_id,
                num_envs=args.num_envs,
                vectorization_mode="vector_entry_point",
                device=device,
                **site_kwargs,
            )
            env = getattr(env, "unwrapped", env)
        else:
            env = make_gym_vector_env(args.env_id, args.num_envs, args.vector_mode, device, env_warnings)
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
    try:
        check_action_space(args.env_id, env.single_action_space)
        check_observation_space(args.env_id, env.single_observation_space)
    except ValueError:
        if not torch_batched:
            env.close()
        raise
    if oom_history:  # num_envs was halved: the iterations of the run change size
        args.num_iterations = max(1, args.total_timesteps // args.num_envs)
    obs_dim = int(np.prod(env.single_observation_space.shape))
    act_dim = int(np.prod(env.single_action_space.shape))
    # the exported policy acts in the env's units (EVHub-v0's box is [-1, 1] already)
    act_low = act_high = None
    if not torch_batched:
        act_low, act_high = torch.as_tensor(env.low), torch.as_tensor(env.high)

    if evhub:
        inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
        if not args.weekday_features:
            inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    else:
        inputs = list(range(obs_dim))
    actor = Actor(obs_dim, act_dim, args.hidden_size, inputs).to(device)
    qf1 = SoftQNetwork(obs_dim, act_dim, args.hidden_size, inputs).to(device)
    qf2 = SoftQNetwork(obs_dim, act_dim, args.hidden_size, inputs).to(device)
    qf1_target, qf2_target = copy.deepcopy(qf1), copy.deepcopy(qf2)
    for p in [*qf1_target.parameters(), *qf2_target.parameters()]:
        p.requires_grad_(False)
    log_alpha = torch.full((), math.log(args.alpha), device=device, requires_grad=args.autotune)
    target_entropy = -float(act_dim)

    def lr(value: float):  # a device tensor under CUDA graphs, so a change of it needs no re-capture
        return torch.tensor(value, device=device) if args.cudagraphs else value

    adam = functools.partial(torch.optim.Adam, capturable=args.cudagraphs)
    q_optimizer = adam([*qf1.parameters(), *qf2.parameters()], lr=lr(args.q_lr))
    actor_optimizer = adam(list(actor.parameters()), lr=lr(args.policy_lr))
    a_optimizer = adam([log_alpha], lr=lr(args.q_lr)) if args.autotune else None
    rb = make_buffer(args, obs_dim, act_dim, device, oom_notes)

    obs, _ = env.reset(seed=args.seed)
    obs = obs.to(torch.float32)
    global_step, start_iteration, train_wall_prev, n_updates = 0, 1, 0.0, 0
    rows: list[dict] = []
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file
        for name, module in (("actor", actor), ("qf1", qf1), ("qf2", qf2), ("qf1_target", qf1_target), ("qf2_target", qf2_target)):
            module.load_state_dict(ckpt[name])
        with torch.no_grad():
            log_alpha.copy_(ckpt["log_alpha"])
        q_optimizer.load_state_dict(ckpt["q_optimizer"])
        actor_optimizer.load_state_dict(ckpt["actor_optimizer"])
        if a_optimizer is not None and ckpt.get("a_optimizer") is not None:
            a_optimizer.load_state_dict(ckpt["a_optimizer"])
        for opt, value in ((q_optimizer, args.q_lr), (actor_optimizer, args.policy_lr), (a_optimizer, args.q_lr)):
            for group in [] if opt is None else opt.param_groups:  # the command line's learning rates win
                group["lr"] = lr(value)
        global_step, start_iteration = int(ckpt["global_step"]), int(ckpt["iteration"]) + 1
        n_updates = int(ckpt.get("n_updates", 0))
        train_wall_prev = float(ckpt.get("train_wall_s", 0.0))
        set_rng_state(env, ckpt["rng"])
        if ckpt.get("replay_buffer") is not None:
            rb.load_state_dict(ckpt["replay_buffer"])
        if ckpt.get("env_state") is None or not torch_batched:
            print(f"resume: the state of a gymnasium env ({args.env_id}) is not stored; envs start new episodes")
        elif ckpt.get("num_envs") == args.num_envs:
            env.load_state_dict(ckpt["env_state"])
            obs = ckpt["obs"].to(device)
            for key, value in ckpt["episode_stats"].items():
                stats[key].copy_(value)
        else:
            print(f"resume: num_envs changed ({ckpt.get('num_envs')} -> {args.num_envs}); envs start new episodes")
        if (out_dir / "metrics.parquet").is_file():
            old = pd.read_parquet(out_dir / "metrics.parquet")
            rows = old[old.global_step <= global_step].to_dict("records")
        print(f"resumed from {ckpt_path} at global_step {global_step}, iteration {start_iteration - 1}, buffer {rb.size:,} rows")
        # the steps left, in iterations of this run's num_envs (the checkpoint's may differ: another --num-envs, or
        # a run that halved num_envs after running out of memory)
        args.num_iterations = start_iteration - 1 + max(0, args.total_timesteps - global_step) // args.num_envs
    # updates begin once the buffer holds learning_starts rows (a resumed run without its buffer refills it)
    updates_from_step = global_step + max(0, args.learning_starts - rb.size) if args.resume else args.learning_starts

    q_params = [*qf1.parameters(), *qf2.parameters()]
    q_target_params = [*qf1_target.parameters(), *qf2_target.parameters()]

    def bind_hot_functions() -> tuple:
        """The hot paths bound to the networks and optimizers, then compiled / CUDA-graphed as the speed switches
        say: ``(policy_step, critic_step, actor_step, target_step)``. Called again after a halving of batch_size or
        num_envs: graphs are captured for one shape."""
        policy_step = functools.partial(sample_action, actor, amp=args.amp)
        critic_step = functools.partial(
            update_critic,
            actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target, log_alpha=log_alpha,
            q_optimizer=q_optimizer, gamma=args.gamma, amp=args.amp,
        )  # fmt: skip
        actor_step = functools.partial(
            update_actor,
            actor=actor, qf1=qf1, qf2=qf2, log_alpha=log_alpha, actor_optimizer=actor_optimizer,
            a_optimizer=a_optimizer, target_entropy=target_entropy, amp=args.amp,
        )  # fmt: skip
        target_step = functools.partial(soft_update, q_target_params, q_params, args.tau)
        if args.compile:
            # random numbers from eager's kernels: a seed gives the same run with and without --compile
            torch._inductor.config.fallback_random = True
            policy_step = torch.compile(policy_step)
            critic_step = torch.compile(critic_step)
            actor_step = torch.compile(actor_step)
            target_step = torch.compile(target_step)
        if args.cudagraphs:
            policy_step = CudaGraphFn(policy_step)
            critic_step = CudaGraphFn(critic_step)
            actor_step = CudaGraphFn(actor_step)
            target_step = CudaGraphFn(target_step)
        return policy_step, critic_step, actor_step, target_step

    policy_step, critic_step, actor_step, target_step = bind_hot_functions()

    def shown_args() -> dict:
        """The resolved arguments this env reads (all but :data:`EVHUB_ONLY_ARGS` for envs other than EVHub-v0)."""
        return {k: v for k, v in vars(args).items() if evhub or k not in EVHUB_ONLY_ARGS}

    def hyperparameters() -> str:
        """The resolved arguments as a Markdown table (TensorBoard text)."""
        return "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in shown_args().items()))

    writer = SummaryWriter(str(out_dir))
    writer.add_text("hyperparameters", hyperparameters())
    for message in oom_notes:  # halvings at setup
        writer.add_text("oom", message, global_step)
    for message in env_warnings:  # e.g. async -> sync
        writer.add_text("warnings", message, global_step)
    print(preset_table(args))
    where = f"site={args.site} action_mode={args.action_mode}" if evhub else (
        f"{'torch-batched' if torch_batched else f'vector_mode={env.mode}'}"
    )
    print(
        f"SAC on {args.env_id} {where} device={device} preset={args.preset}: "
        f"{args.num_envs} envs, {args.gradient_steps} gradient steps per iteration (UTD {args.gradient_steps / args.num_envs:.3g}), "
        f"batch {args.batch_size}, buffer {args.buffer_size:,}, {args.num_iterations} iterations, "
        f"{args.total_timesteps:,} steps; output {out_dir}"
    )
    print("args: " + ", ".join(f"{k}={v}" for k, v in shown_args().items()), flush=True)

    def checkpoint(iteration: int, train_wall: float) -> None:
        check_finite(bad_any, first_bad_step, ckpt_path)
        save_checkpoint(
            ckpt_path,
            actor=actor.state_dict(),
            qf1=qf1.state_dict(),
            qf2=qf2.state_dict(),
            qf1_target=qf1_target.state_dict(),
            qf2_target=qf2_target.state_dict(),
            log_alpha=log_alpha.detach(),
            q_optimizer=q_optimizer.state_dict(),
            actor_optimizer=actor_optimizer.state_dict(),
            a_optimizer=None if a_optimizer is None else a_optimizer.state_dict(),
            global_step=global_step,
            iteration=iteration,
            n_updates=n_updates,
            train_wall_s=train_wall,
            args=dataclasses.asdict(args),
            num_envs=args.num_envs,
            rng=rng_state(env),
            env_state=env.state_dict() if torch_batched else None,
            obs=obs if torch_batched else None,
            episode_stats=stats,
            replay_buffer=rb.state_dict() if args.save_buffer else None,
        )

    deterministic = DeterministicActor(actor)  # shares the actor's weights

    def evaluate(**extra: float) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Run the current deterministic policy over the whole eval split: ``(KPI row, hourly traces)``."""

        def policy(obs_: torch.Tensor, env_) -> torch.Tensor:
            return deterministic(obs_.float()).to(obs_.dtype)

        return evaluate_policy(
            policy, site, args.eval_split, "sac", args.action_mode, device, bess_action=args.bess_action, **extra
        )

    curve: list[dict] = []  # evaluations during training (--eval-every)
    if args.resume and (out_dir / "eval_curve.parquet").is_file():
        old = pd.read_parquet(out_dir / "eval_curve.parquet")
        curve = old[old.global_step <= global_step].to_dict("records")

    bad_any = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    out_q: dict = {}
    out_pi: dict = {}
    overlap = getattr(env, "overlap", False)  # async gymnasium envs step while the gradient steps run

    def learn() -> str | None:
        """``gradient_steps`` updates on uniform samples of the replay buffer; returns the first line of a CUDA
        out-of-memory error that stopped them (the remaining steps are skipped), else None."""
        nonlocal out_q, out_pi, n_updates, first_bad_step, bad_any, data
        try:
            for _ in range(args.gradient_steps):
                data = rb.sample(args.batch_size)
                out_q = critic_step(data["obs"], data["actions"], data["rewards"], data["next_obs"], data["dones"])
                bad = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
                bad[0] = out_q["bad"]
                n_updates += 1
                if n_updates % args.policy_frequency == 0:  # delayed policy updates, TD3-style
                    for _ in range(args.policy_frequency):
                        out_pi = actor_step(data["obs"])
                        bad[1:] |= out_pi["bad"]
                if n_updates % args.target_network_frequency == 0:
                    target_step()
                first_bad_step = torch.where((first_bad_step < 0) & bad.any(), global_step, first_bad_step)
                bad_any |= bad
        except RuntimeError as exc:
            error = out_of_memory_message(exc)
            if error is None:
                raise
            return error
        return None

    data = None
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
        desc="sac",
    )
    try:
        while iteration < args.num_iterations:
            iteration += 1
            if iteration == half_iteration:
                steady_start = (synced_clock(device), global_step)
            oom_error, oom_in_update = None, False
            # ---- act: uniform random actions before learning starts, then the stochastic policy. Synchronously the
            # envs step, the transitions are stored, then the gradient steps run; with overlap (async gymnasium envs)
            # the gradient steps run between step_async and step_wait, on the transitions stored so far.
            try:
                if global_step < args.learning_starts:
                    actions = torch.rand(args.num_envs, act_dim, device=device) * 2.0 - 1.0
                else:
                    actions = policy_step(obs)
                if overlap:
                    env.step_async(actions)
                    if global_step >= max(updates_from_step, 1):  # before this step's transitions are stored
                        oom_error = learn()
                        oom_in_update = oom_error is not None
                    next_obs, reward, terminated, truncated, info = env.step_wait()
                else:
                    next_obs, reward, terminated, truncated, info = env.step(actions)
                next_obs = next_obs.to(torch.float32)
                reward = reward.to(torch.float32)
                dones = terminated if args.bootstrap_truncation else terminated | truncated
                # gymnasium envs: the target's next obs is the episode's last one where it ended (EVHub-v0
                # bootstraps through the autoreset into the next window)
                target_obs = info["final_obs"] if "final_obs" in info else next_obs
                rb.add(obs, actions, reward * args.reward_scale, target_obs, dones.to(torch.float32))
                record_episode_stats(stats, reward, info, terminated | truncated)
            except RuntimeError as exc:
                oom_error, oom_in_update = out_of_memory_message(exc), False
                if oom_error is None:
                    raise

            # ---- learn: gradient_steps updates on uniform samples of the replay buffer
            if oom_error is None or oom_in_update:
                obs = next_obs
                global_step += args.num_envs
                if not overlap and global_step >= updates_from_step:
                    oom_error = learn()
                    oom_in_update = oom_error is not None

            if oom_error is not None:
                # out of memory. Stepping the envs: that step is dropped (not counted), the envs are rebuilt with
                # half as many copies and the iteration is repeated. In the gradient steps: the env step stands, the
                # iteration's remaining gradient steps are skipped, and batch_size halves (at its floor: num_envs,
                # as above). The replay buffer is kept; the totals of finished episodes carry over.
                where = f"at global_step {global_step} (iteration {iteration}), " + (
                    "in the gradient steps" if oom_in_update else "stepping the envs"
                )
                if not oom_in_update:
                    iteration -= 1
                n_envs = args.num_envs
                policy_step = critic_step = actor_step = target_step = data = None
                message = halve_after_oom(args, oom_history, where, oom_error, ckpt_path, oom_in_update)
                print(f"warning: {message}", file=sys.stderr, flush=True)
                oom_notes.append(message)
                if args.num_envs != n_envs:
                    # the new envs go on drawing windows where these stopped
                    generator = env._generator.get_state() if torch_batched else None
                    totals = {k: v for k, v in stats.items() if k == "n_done" or k.startswith("sum_")}
                    if not torch_batched:
                        env.close()
                    env = stats = obs = next_obs = actions = None
                    free_device_memory(device)
                    env, stats = build_envs_backing_off(where)
                    if generator is not None:
                        env._generator.set_state(generator)
                    overlap = getattr(env, "overlap", False)
                    for key, value in totals.items():
                        stats[key].copy_(value)
                    obs, _ = env.reset()
                    obs = obs.to(torch.float32)
                else:
                    free_device_memory(device)
                policy_step, critic_step, actor_step, target_step = bind_hot_functions()
                args.num_iterations = iteration + max(1, (args.total_timesteps - global_step) // args.num_envs)
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
                losses = {k: float(out_q[k]) if k in out_q else math.nan for k in LOSS_KEYS[:5]}
                losses.update({k: float(out_pi[k]) if k in out_pi else math.nan for k in LOSS_KEYS[5:]})
                n_done = float(stats["n_done"])
                ep = {k: float(stats[f"sum_{k}"]) / n_done if n_done else math.nan for k in ("return", "co2_kg", "unserved_kwh", "length")}
                if not evhub:  # the site's KPIs do not exist elsewhere
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
                gpu = gpu_stats(device)
                for key, value in gpu.items():
                    if math.isfinite(value):
                        writer.add_scalar(key, value, global_step)
                if out_q:
                    for key in LOSS_KEYS:
                        if math.isfinite(losses[key]):
                            writer.add_scalar(f"losses/{key}", losses[key], global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                rows.append(
                    {
                        "global_step": global_step,
                        "wall_s": train_wall_prev + wall,
                        "sps": sps,
                        "episodic_return": ep["return"],
                        "episodic_length": ep["length"],
                        "episodic_co2_kg": ep["co2_kg"],
                        "episodic_unserved_kwh": ep["unserved_kwh"],
                        **losses,
                        "learning_rate": args.q_lr,
                        "policy_lr": args.policy_lr,
                        "gradient_steps": n_updates,
                        "num_envs": args.num_envs,
                        "batch_size": args.batch_size,
                        **{key.split("/", 1)[1]: value for key, value in gpu.items()},
                    }
                )
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", **({"co2": f"{ep['co2_kg']:.1f}"} if evhub else {}), refresh=False)
                if (bar.disable and (iteration // args.log_every) % max(1, args.num_iterations // args.log_every // 10) == 0) or last:
                    site_kpis = f"co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} " if evhub else ""
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} "
                        f"return {ep['return']:.2f} {site_kpis}"
                        f"qf_loss {losses['qf_loss']:.4f} q1 {losses['qf1_values']:.2f} alpha {losses['alpha']:.4f}",
                        flush=True,
                    )
            if evhub and args.eval_every and iteration % args.eval_every == 0 and not last and args.eval_split.lower() != "none":
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
    except BaseException:
        writer.close()
        bar.close()
        if not torch_batched and env is not None:
            env.close()
        raise
    bar.close()
    if not torch_batched:
        env.close()
    if oom_notes:  # the sizes actually used at the end
        writer.add_text("hyperparameters", hyperparameters(), global_step)

    end_time = synced_clock(device)
    sps_steady = (global_step - steady_start[1]) / max(end_time - steady_start[0], 1e-9) if steady_start else sps
    train_wall = train_wall_prev + end_time - start_time
    checkpoint(iteration, train_wall)
    policy_path = export_policy(actor, obs_dim, out_dir, act_low, act_high)
    if evhub:
        write_policy_spec(out_dir, args.env_id, args.action_mode, args.bess_action)
    print(f"training: {global_step:,} steps, {n_updates:,} gradient steps in {train_wall:.1f} s ({sps:.0f} SPS, {sps_steady:.0f} over the second half); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "sps_steady": sps_steady,
              "policy": str(policy_path), "num_envs": args.num_envs, "batch_size": args.batch_size,
              "buffer_size": args.buffer_size}
    if not evhub and args.eval_split.lower() != "none":
        print(f"note: no split evaluation for {args.env_id} (eval_split={args.eval_split!r} applies to EVHub-v0 only)")
    if evhub and args.eval_split.lower() != "none":
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
