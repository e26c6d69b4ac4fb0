"""DQN for ``EVHub-v0``'s discrete actions, CleanRL style: one file, env, agent and replay buffer on one device.

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
    """the id of the environment (trained in its 'discrete' action mode)"""
    site: str = "caltech"
    """site to train on: a shipped site name or a path to a site TOML file"""
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
    gamma: float = 0.95
    """the discount factor gamma (0.95: a horizon of about a day of hourly steps)"""
    tau: float = 1.0
    """the target network update rate (1.0: hard copy; below 1: Polyak blend at each target update)"""
    target_network_frequency: int = 5_000
    """env steps between target network updates (checked once per iteration)"""
    batch_size: int | None = None
    """the batch size of a gradient step, sampled from the replay memory (None: preset, 256 on cpu, 4096 on gpu)"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total_timesteps` it takes from start_e to go end_e"""
    learning_starts: int | None = None
    """env steps before learning starts (None: preset, 10,000 on cpu, 100,000 on gpu)"""
    double_q: bool = True
    """use the double-DQN target (online network picks the next action, target network scores it)"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    hidden_size: int | None = None
    """width of the two hidden layers of the Q network (None: preset, 128 on cpu, 256 on gpu)"""
    reward_scale: float = 10.0
    """multiplies the env reward before it is stored (the episodic_return curve stays unscaled); 10 brings the
    TD errors to about 1, where the Huber loss turns from quadratic to linear"""
    socket_features: bool = False
    """feed the per-socket observations to the Q network (off: only the site-level features before them, with
    the EV aggregates; on caltech the 165 per-socket inputs let DQN fit the 2019 sessions and transfer worse
    to the 2021 test split: 1,368 vs 1,060 kg CO2 after 1M steps in tuning runs)"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the Q network (off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    norm_obs: bool = True
    """standardise observations with statistics gathered during the first learning_starts steps, then frozen"""
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
    """run folder (None: outputs/runs/{exp_name}_{site}_discrete_seed{seed})"""
    checkpoint_every: int = 2_000
    """iterations between checkpoints (0: only at the end)"""
    save_buffer: bool = False
    """also store the replay buffer in the checkpoint (its filled rows, write position and fill level; large);
    without it a resumed run refills the buffer for learning_starts steps before updating again"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (networks, optimizer, counters, RNG and env state, and the replay
    buffer if it was stored)"""
    eval_split: str = "test"
    """split for the final deterministic evaluation ('none' skips it)"""
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
    """Raw observations ``(B, obs_dim)`` -> Q values ``(B, n_actions)``: normalisation, feature choice, MLP."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, norm_obs: bool = True, inputs: list[int] | None = None):
        super().__init__()
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


def make_replay_buffer(size: int, obs_dim: int, device: torch.device, obs_dtype: torch.dtype = torch.float32) -> dict:
    """Circular replay memory preallocated on ``device``.

    Tensors ``obs``, ``next_obs`` ``(size, obs_dim)``, ``actions`` int64, ``rewards``, ``dones`` ``(size,)``;
    ``pos`` (next row written) and ``count`` (rows filled) are host ints that only the writer changes, and
    ``count_t`` is ``count`` as a device tensor, which the sampler reads (so sampling never syncs and a
    captured update sees the buffer grow).
    """
    return {
        "obs": torch.zeros(size, obs_dim, device=device, dtype=obs_dtype),
        "next_obs": torch.zeros(size, obs_dim, device=device, dtype=obs_dtype),
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
        if update_norm and isinstance(qnet.obs_norm, ObsNorm):
            qnet.obs_norm.update(next_obs)
        action = act_fn(qnet, next_obs, epsilon, amp)
        obs2, reward, terminated, truncated, info = env.step(action)
        obs2 = obs2.to(torch.float32)
        reward = reward.to(torch.float32)
        done = terminated if bootstrap_truncation else terminated | truncated
        buffer_add(rb, next_obs, action, reward * reward_scale, obs2, done)
        episode_end = (terminated | truncated).to(torch.float64)
        stats["ep_return"] += reward
        stats["ep_co2_kg"] += info["co2_kg"]
        stats["ep_unserved_kwh"] += info["unserved_kwh"]
        stats["ep_length"] += 1.0
        stats["n_done"] += episode_end.sum()
        for key in ("return", "co2_kg", "unserved_kwh", "length"):
            stats[f"sum_{key}"] += (stats[f"ep_{key}"] * episode_end).sum()
            stats[f"ep_{key}"] *= 1.0 - episode_end
        next_obs = obs2
    return next_obs


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


def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the preset and compute the runtime sizes."""
    preset = args.preset.lower()
    if preset == "auto":
        preset = "gpu" if device.type == "cuda" else "cpu"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: expected 'auto', 'cpu' or 'gpu'")
    args.preset = preset
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.output_dir is None:
        args.output_dir = str(Path("outputs") / "runs" / f"{args.exp_name}_{Path(args.site).stem}_discrete_seed{args.seed}")
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


def make_buffer(args: Args, obs_dim: int, device: torch.device, notes: list[str] | None = None) -> dict:
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


def export_policy(qnet: QNetwork, obs_dim: int, out_dir: Path) -> Path:
    """Save the greedy hub-action policy (:class:`GreedyHubPolicy`) for code that does not import ``algos``.

    ``torch.export`` with a dynamic batch dimension to ``policy.pt2``; if export fails, a TorchScript trace to
    ``policy.pt``. Either is written atomically (temporary file, then rename). Returns the written path.
    """
    module = GreedyHubPolicy(copy.deepcopy(qnet), discrete_action_table()).cpu().float().eval()
    example = torch.zeros(2, obs_dim)
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(module, (example,), dynamic_shapes={"obs": {0: batch}})
        path = out_dir / "policy.pt2"
        atomic_write(path, lambda tmp: torch.export.save(program, tmp))
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        traced = torch.jit.trace(module, example)
        atomic_write(path, lambda tmp: traced.save(str(tmp)))
    return path


def metrics_row(
    global_step: int, wall_s: float, sps: float, ep: dict, losses: dict, epsilon: float, lr: float, num_envs: int,
    batch_size: int,
) -> dict:
    """One row of ``metrics.parquet`` from host numbers: episode means ``ep``, update ``losses``, epsilon, learning
    rate and the sizes in use (smaller than asked for after a halving for lack of memory)."""
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

    site = envs.load_site(args.site)

    def build_envs() -> tuple:
        """The envs and the episode statistics, sized by num_envs: ``(env, stats)``."""
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
    obs_dim = int(np.prod(env.single_observation_space.shape))
    n_actions = int(env.single_action_space.n)

    inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
    if not args.weekday_features:
        inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    qnet = QNetwork(obs_dim, n_actions, args.hidden_size, args.norm_obs, inputs).to(device)
    target = copy.deepcopy(qnet)
    for p in target.parameters():
        p.requires_grad_(False)
    lr = torch.tensor(args.learning_rate, device=device) if args.cudagraphs else args.learning_rate
    optimizer = torch.optim.Adam(qnet.parameters(), lr=lr, capturable=args.cudagraphs)
    rb = make_buffer(args, obs_dim, device, oom_notes)

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
        if ckpt.get("num_envs") == args.num_envs:
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

    def hyperparameters() -> str:
        """The resolved arguments as a Markdown table (TensorBoard text)."""
        return "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in dataclasses.asdict(args).items()))

    hparams = dataclasses.asdict(args)
    writer = SummaryWriter(str(out_dir))
    writer.add_text("hyperparameters", hyperparameters())
    for message in oom_notes:  # halvings at setup
        writer.add_text("oom", message, global_step)
    print(f"DQN on {args.env_id} (discrete, {n_actions} actions) site={args.site} device={device} preset={args.preset}")
    print("  " + " ".join(f"{k}={v}" for k, v in hparams.items()))
    print(
        f"  {args.num_envs} envs x {args.num_steps} steps + {args.gradient_steps} gradient steps per iteration, "
        f"{args.num_iterations} iterations, {args.total_timesteps:,} steps; output {out_dir}",
        flush=True,
    )

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
            env_state=env.state_dict(),
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
            try:
                next_obs = rollout(
                    env, qnet, next_obs, rb, stats, epsilon, args.num_steps, not norm_frozen,
                    args.bootstrap_truncation, args.reward_scale, args.amp, act_fn=act_fn,
                )  # fmt: skip
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
                    env = stats = next_obs = None
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
                for key in ("n_done", "sum_return", "sum_co2_kg", "sum_unserved_kwh", "sum_length"):
                    stats[key].zero_()
                wall = time.perf_counter() - start_time
                sps = (global_step - session_start_step) / max(wall, 1e-9)
                if n_done:
                    writer.add_scalar("charts/episodic_return", ep["return"], global_step)
                    writer.add_scalar("charts/episodic_length", ep["length"], global_step)
                    writer.add_scalar("charts/episodic_co2_kg", ep["co2_kg"], global_step)
                    writer.add_scalar("charts/episodic_unserved_kwh", ep["unserved_kwh"], global_step)
                if global_step >= learn_from:
                    writer.add_scalar("losses/td_loss", losses_host["td_loss"], global_step)
                    writer.add_scalar("losses/q_values", losses_host["q_values"], global_step)
                    writer.add_scalar("losses/grad_norm", losses_host["grad_norm"], global_step)
                writer.add_scalar("charts/epsilon", eps_host, global_step)
                writer.add_scalar("charts/learning_rate", args.learning_rate, global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                rows.append(
                    metrics_row(
                        global_step, train_wall_prev + wall, sps, ep, losses_host, eps_host, args.learning_rate,
                        args.num_envs, args.batch_size,
                    )
                )
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", co2=f"{ep['co2_kg']:.1f}", eps=f"{eps_host:.2f}", refresh=False)
                if (bar.disable and iteration % max(1, args.num_iterations // 10) < args.log_every) or last:
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} eps {eps_host:.3f} "
                        f"return {ep['return']:.2f} co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} "
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
    policy_path = export_policy(qnet, obs_dim, out_dir)
    write_policy_spec(out_dir, args.env_id, "hub", args.bess_action)
    print(f"training: {global_step:,} steps in {train_wall:.1f} s ({sps:.0f} SPS, {sps_steady:.0f} over the second half); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "sps_steady": sps_steady,
              "policy": str(policy_path), "num_envs": args.num_envs, "batch_size": args.batch_size,
              "buffer_size": args.buffer_size}
    if args.eval_split.lower() != "none":
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
