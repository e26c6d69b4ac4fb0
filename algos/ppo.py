"""PPO with a Gaussian policy for ``EVHub-v0``, CleanRL style: one file, everything on one device.

The whole rollout stays on the device: the torch-batched env steps ``num_envs`` copies of the site, the
agent samples actions from tensors, rollout storage is preallocated, and episode statistics are summed
on the device; the host reads numbers back only every ``log_every`` iterations. The hot paths
(:func:`rollout`, :func:`compute_gae`, :func:`update`) are plain module-level functions so that a later
``--compile`` / ``--cudagraphs`` switch can rebind them once.

Run (defaults: ``caltech`` site, ``hub`` actions, a preset sized to the device)::

    python algos/ppo.py
    python algos/ppo.py --site path/to/site.toml --total-timesteps 200000 --seed 2
    tensorboard --logdir outputs/

Writes into ``output_dir``: TensorBoard events, ``metrics.parquet`` (the same curves), ``checkpoint.pt``
(model, optimizer, counters, RNG and env state; ``--resume`` continues from it), ``policy.pt2`` (the
deterministic actor as a ``torch.export`` program: obs float32 ``(B, obs_dim)`` -> action in [-1, 1]
``(B, act_dim)``; load with ``torch.export.load(path).module()``), and the deterministic evaluation over
``eval_split``: ``eval_{split}.parquet`` (one KPI row, controller ``"ppo"``) and
``eval_{split}_traces.parquet`` (hourly traces).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import tyro
from torch.distributions.normal import Normal
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:
    import envs
except ModuleNotFoundError:  # run as `python algos/ppo.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs
from envs.kpis import evaluate_policy, write_parquet

PRESETS = {
    # 2 CPU cores: ~100 envs, a small net; about 2 minutes on the caltech site, evaluation included
    "cpu": {"num_envs": 128, "num_steps": 168, "total_timesteps": 4_000_000, "hidden_size": 64},
    # one GPU: thousands of envs, a wider net
    "cuda": {"num_envs": 2048, "num_steps": 168, "total_timesteps": 50_000_000, "hidden_size": 256},
}
"""Defaults per device for the fields left at ``None``; any of them can be set on the command line."""


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the default output folder)"""
    seed: int = 1
    """seed of the experiment (Python, NumPy, torch and the env's window draws)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, use CUDA when it is available (agent and env on the same device)"""
    env_id: str = "EVHub-v0"
    """the id of the environment"""
    site: str = "caltech"
    """site to train on: a shipped site name or a path to a site TOML file"""
    action_mode: str = "hub"
    """'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket)"""
    total_timesteps: int | None = None
    """total env steps of the experiment (None: device preset, 4,000,000 on CPU, 50,000,000 on CUDA)"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    num_envs: int | None = None
    """the number of parallel env copies (None: device preset, 128 on CPU, 2048 on CUDA)"""
    num_steps: int | None = None
    """the number of steps per env in each rollout (None: device preset, 168 = one episode)"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear to zero over the run)"""
    gamma: float = 0.98
    """the discount factor gamma (0.98: a horizon of about two days of hourly steps)"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 8
    """the number of mini-batches per epoch"""
    update_epochs: int = 5
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold (early stop of the epochs; costs one host sync per epoch)"""
    hidden_size: int | None = None
    """width of the two hidden layers of actor and critic (None: device preset, 64 on CPU, 256 on CUDA)"""
    init_logstd: float = -0.5
    """initial log standard deviation of the Gaussian policy (state-independent, learned)"""
    socket_features: bool = True
    """feed the per-socket observations to the networks (False: only the site-level features before them)"""
    weekday_features: bool = False
    """feed the day-of-week features (sin/cos) to the networks (off: the policy reads the EV demand from the
    sockets instead of learning the weekday pattern of the training year, which transfers worse to other years)"""
    norm_obs: bool = True
    """standardise observations with running statistics kept in the agent (CleanRL's NormalizeObservation)"""
    norm_reward: bool = True
    """scale rewards by a running std of the discounted return (CleanRL's NormalizeReward, on device)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal (the site never terminates): bootstrap through the
    autoreset into the next window; False treats it as terminal like CleanRL"""
    log_every: int = 1
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar)"""
    output_dir: str | None = None
    """run folder (None: outputs/runs/{exp_name}_{site}_{action_mode}_seed{seed})"""
    checkpoint_every: int = 25
    """iterations between checkpoints (0: only at the end)"""
    resume: bool = False
    """continue from output_dir/checkpoint.pt (model, optimizer, counters, RNG and env state)"""
    eval_split: str = "test"
    """split for the final deterministic evaluation ('none' skips it)"""

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

ENV_STATE = ("t", "elapsed", "energy_kwh", "ev_need_kwh", "ev_steps_left")
"""EVHubVectorEnv state tensors saved in the checkpoint, so that ``--resume`` continues the same episodes."""


class NonFiniteLossError(RuntimeError):
    """A loss (or the gradient norm) became NaN or infinite; training stops, the last checkpoint is kept."""


# ---------------------------------------------------------------------------------------------- agent
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class RunningObsNorm(nn.Module):
    """Running mean/variance of the observations (CleanRL's NormalizeObservation, as buffers on the device).

    ``forward`` standardises and clips to ``[-clip, clip]``; :meth:`update` folds a batch into the statistics
    in place (no host sync). Being part of the agent, it travels with the checkpoint and the exported policy.
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
    """Keeps the observation features listed in ``keep`` (the networks' inputs)."""

    def __init__(self, keep: list[int]):
        super().__init__()
        self.register_buffer("keep", torch.as_tensor(keep, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.keep)


class Agent(nn.Module):
    """Separate actor and critic MLPs; Gaussian actor with a tanh-free mean and a state-independent log-std.

    ``obs_norm`` (running standardisation, or identity) maps raw env observations to the network inputs;
    the rollout stores normalised observations, so the PPO update works on those.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: int,
        init_logstd: float = 0.0,
        norm_obs: bool = True,
        inputs: list[int] | None = None,
    ):
        super().__init__()
        inputs = list(range(obs_dim)) if inputs is None else list(inputs)
        n_in = len(inputs)
        self.obs_norm = RunningObsNorm(obs_dim) if norm_obs else nn.Identity()
        self.critic = nn.Sequential(
            Select(inputs) if n_in < obs_dim else nn.Identity(),
            layer_init(nn.Linear(n_in, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            Select(inputs) if n_in < obs_dim else nn.Identity(),
            layer_init(nn.Linear(n_in, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden)),
            nn.Tanh(),
            layer_init(nn.Linear(hidden, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_logstd)))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        """Sample (or score ``action``) from the policy at normalised observations ``x``, and the value."""
        action_mean = self.actor_mean(x)
        action_std = torch.exp(self.actor_logstd.expand_as(action_mean))
        probs = Normal(action_mean, action_std, validate_args=False)  # validation would sync with the host
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class DeterministicActor(nn.Module):
    """The deterministic policy: raw obs float32 ``(B, obs_dim)`` -> clipped mean action ``(B, act_dim)`` in [-1, 1].

    Observation normalisation (frozen statistics) is part of it, so callers pass the env's observations as is.
    """

    def __init__(self, obs_norm: nn.Module, actor_mean: nn.Module):
        super().__init__()
        self.obs_norm = obs_norm
        self.actor_mean = actor_mean

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor_mean(self.obs_norm(obs)).clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------- state
def make_storage(num_steps: int, num_envs: int, obs_dim: int, act_dim: int, device: torch.device) -> dict:
    """Preallocated rollout storage on ``device``: ``(num_steps, num_envs, ...)`` tensors."""
    z = lambda *s: torch.zeros(num_steps, num_envs, *s, device=device)  # noqa: E731
    return {
        "obs": z(obs_dim),
        "actions": z(act_dim),
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


# ---------------------------------------------------------------------------------------------- hot paths
def rollout(
    env,
    agent: Agent,
    next_obs: torch.Tensor,
    next_done: torch.Tensor,
    storage: dict,
    stats: dict,
    rn: dict | None,
    gamma: float,
    bootstrap_truncation: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collect ``num_steps`` steps of every env into ``storage`` (in place); no host sync.

    ``next_obs`` is the raw env observation; the agent's observation normaliser is updated with each one
    and the normalised observations are stored.

    Returns:
        ``(next_obs, next_done)`` after the last step, for bootstrapping and the next rollout.
    """
    num_steps = storage["obs"].shape[0]
    norm = isinstance(agent.obs_norm, RunningObsNorm)
    for step in range(num_steps):
        if norm:
            agent.obs_norm.update(next_obs)
        with torch.no_grad():
            obs_n = agent.obs_norm(next_obs)
            action, logprob, _, value = agent.get_action_and_value(obs_n)
        storage["obs"][step] = obs_n
        storage["dones"][step] = next_done
        storage["values"][step] = value.flatten()
        storage["actions"][step] = action
        storage["logprobs"][step] = logprob
        next_obs, reward, terminated, truncated, info = env.step(action.clamp(-1.0, 1.0))
        next_obs = next_obs.to(torch.float32)
        reward = reward.to(torch.float32)
        episode_end = (terminated | truncated).to(torch.float64)
        next_done = (terminated if bootstrap_truncation else terminated | truncated).to(torch.float32)
        # episode statistics: raw reward, CO2 and unserved energy summed per env, recorded at episode end
        stats["ep_return"] += reward
        stats["ep_co2_kg"] += info["co2_kg"]
        stats["ep_unserved_kwh"] += info["unserved_kwh"]
        stats["ep_length"] += 1.0
        stats["n_done"] += episode_end.sum()
        for key in ("return", "co2_kg", "unserved_kwh", "length"):
            stats[f"sum_{key}"] += (stats[f"ep_{key}"] * episode_end).sum()
            stats[f"ep_{key}"] *= 1.0 - episode_end
        if rn is not None:
            reward = normalize_reward(rn, reward, next_done, gamma)
        storage["rewards"][step] = reward
    return next_obs, next_done


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
        rewards, values, dones: ``(num_steps, num_envs)``; ``dones[t]`` is 1 where the observation of step
            ``t`` began a new episode after a terminal step (so step ``t-1`` must not bootstrap from it).
        next_value, next_done: ``(num_envs,)`` value and done flag of the observation after the last step.

    Returns:
        ``(advantages, returns)``, each ``(num_steps, num_envs)``; ``returns = advantages + values``.
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


def update(
    agent: Agent,
    optimizer: torch.optim.Optimizer,
    b_obs: torch.Tensor,
    b_actions: torch.Tensor,
    b_logprobs: torch.Tensor,
    b_advantages: torch.Tensor,
    b_returns: torch.Tensor,
    b_values: torch.Tensor,
    args: Args,
) -> dict[str, torch.Tensor]:
    """PPO's clipped-surrogate update over the flattened batch: ``update_epochs`` epochs of minibatches.

    Returns:
        device tensors: the last minibatch's ``value_loss, policy_loss, entropy, old_approx_kl, approx_kl``,
        ``clipfrac`` (mean over all minibatches), ``explained_variance`` of the batch, and ``bad``: a
        ``(len(LOSS_NAMES),)`` bool tensor, True where that quantity was non-finite in some minibatch.
    """
    device = b_obs.device
    batch_size = b_obs.shape[0]
    mb_size = args.minibatch_size
    clipfrac_sum = torch.zeros((), device=device)
    n_mb = 0
    bad = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    for _epoch in range(args.update_epochs):
        perm = torch.randperm(batch_size, device=device)
        for start in range(0, batch_size, mb_size):
            mb = perm[start : start + mb_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
            logratio = newlogprob - b_logprobs[mb]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfrac_sum += ((ratio - 1.0).abs() > args.clip_coef).float().mean()
                n_mb += 1

            mb_adv = b_advantages[mb]
            if args.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss1 = -mb_adv * ratio
            pg_loss2 = -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()

            newvalue = newvalue.view(-1)
            if args.clip_vloss:
                v_loss_unclipped = (newvalue - b_returns[mb]) ** 2
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -args.clip_coef, args.clip_coef)
                v_loss_clipped = (v_clipped - b_returns[mb]) ** 2
                v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
            else:
                v_loss = 0.5 * ((newvalue - b_returns[mb]) ** 2).mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                bad |= ~torch.isfinite(torch.stack([v_loss, pg_loss, entropy_loss, grad_norm]).detach())

        if args.target_kl is not None and approx_kl > args.target_kl:  # host sync, only when asked for
            break

    with torch.no_grad():
        var_y = b_returns.var()
        explained_var = 1.0 - (b_returns - b_values).var() / var_y
        explained_var = torch.where(var_y == 0, torch.full_like(var_y, float("nan")), explained_var)
    return {
        "value_loss": v_loss.detach(),
        "policy_loss": pg_loss.detach(),
        "entropy": entropy_loss.detach(),
        "old_approx_kl": old_approx_kl,
        "approx_kl": approx_kl,
        "clipfrac": clipfrac_sum / max(n_mb, 1),
        "explained_variance": explained_var,
        "bad": bad,
    }


# ---------------------------------------------------------------------------------------------- helpers
def resolve_args(args: Args, device: torch.device) -> Args:
    """Fill the fields left at ``None`` from the device preset and compute the runtime sizes."""
    preset = PRESETS["cuda" if device.type == "cuda" else "cpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.output_dir is None:
        args.output_dir = str(Path("outputs") / "runs" / f"{args.exp_name}_{Path(args.site).stem}_{args.action_mode}_seed{args.seed}")
    args.batch_size = int(args.num_envs * args.num_steps)
    args.minibatch_size = int(args.batch_size // args.num_minibatches)
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    if args.minibatch_size < 1:
        raise ValueError(f"num_minibatches={args.num_minibatches} exceeds the batch size {args.batch_size}")
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


def export_policy(agent: Agent, obs_dim: int, out_dir: Path) -> Path:
    """Save the deterministic actor for code that does not import ``algos``.

    ``torch.export`` with a dynamic batch dimension to ``policy.pt2``; if export fails, a TorchScript trace to
    ``policy.pt``. Returns the written path.
    """
    actor = DeterministicActor(copy.deepcopy(agent.obs_norm), copy.deepcopy(agent.actor_mean)).cpu().float().eval()
    example = torch.zeros(2, obs_dim)
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(actor, (example,), dynamic_shapes={"obs": {0: batch}})
        path = out_dir / "policy.pt2"
        torch.export.save(program, path)
    except Exception as exc:  # noqa: BLE001 - any export failure falls back to TorchScript
        print(f"torch.export failed ({type(exc).__name__}: {exc}); saving a TorchScript trace instead", file=sys.stderr)
        path = out_dir / "policy.pt"
        torch.jit.trace(actor, example).save(str(path))
    return path


def metrics_row(global_step: int, wall_s: float, sps: float, ep: dict, losses: dict, lr: float) -> dict:
    return {
        "global_step": global_step,
        "wall_s": wall_s,
        "sps": sps,
        "episodic_return": ep["return"],
        "episodic_co2_kg": ep["co2_kg"],
        "episodic_unserved_kwh": ep["unserved_kwh"],
        "value_loss": losses["value_loss"],
        "policy_loss": losses["policy_loss"],
        "entropy": losses["entropy"],
        "approx_kl": losses["approx_kl"],
        "clipfrac": losses["clipfrac"],
        "explained_variance": losses["explained_variance"],
        "learning_rate": lr,
    }


# ---------------------------------------------------------------------------------------------- main
def main(args: Args) -> dict:
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
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    site = envs.load_site(args.site)
    env = gym.make_vec(
        args.env_id,
        num_envs=args.num_envs,
        vectorization_mode="vector_entry_point",
        site=site,
        split="train",
        action_mode=args.action_mode,
        device=device,
    )
    env = getattr(env, "unwrapped", env)
    obs_dim = int(np.prod(env.single_observation_space.shape))
    act_dim = int(np.prod(env.single_action_space.shape))

    inputs = list(range(obs_dim if args.socket_features else obs_dim - 3 * env.n_sockets))
    if not args.weekday_features:
        inputs = [i for i in inputs if i not in OBS_WEEKDAY]
    agent = Agent(obs_dim, act_dim, args.hidden_size, args.init_logstd, args.norm_obs, inputs).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    storage = make_storage(args.num_steps, args.num_envs, obs_dim, act_dim, device)
    stats = make_episode_stats(args.num_envs, device)
    rn = make_reward_norm(args.num_envs, device) if args.norm_reward else None

    next_obs, _ = env.reset(seed=args.seed)
    next_obs = next_obs.to(torch.float32)
    next_done = torch.zeros(args.num_envs, device=device)
    global_step, start_iteration, train_wall_prev = 0, 1, 0.0
    rows: list[dict] = []
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file
        agent.load_state_dict(ckpt["agent"])
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step, start_iteration = int(ckpt["global_step"]), int(ckpt["iteration"]) + 1
        train_wall_prev = float(ckpt.get("train_wall_s", 0.0))
        set_rng_state(env, ckpt["rng"])
        if ckpt.get("num_envs") == args.num_envs:
            for name, value in ckpt["env_state"].items():
                setattr(env, name, value.to(device))
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

    writer = SummaryWriter(str(out_dir))
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % ("\n".join(f"|{k}|{v}|" for k, v in vars(args).items())),
    )
    print(
        f"PPO on {args.env_id} site={args.site} action_mode={args.action_mode} device={device}: "
        f"{args.num_envs} envs x {args.num_steps} steps, {args.num_iterations} iterations, "
        f"{args.total_timesteps:,} steps; output {out_dir}"
    )

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
            env_state={name: getattr(env, name) for name in ENV_STATE},
            next_obs=next_obs,
            next_done=next_done,
            episode_stats=stats,
            reward_norm=rn,
        )

    bad_any = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    start_time = time.perf_counter()
    session_start_step = global_step
    losses_host: dict = {}
    sps = float(rows[-1]["sps"]) if rows else 0.0  # a resumed run that has nothing left to train keeps its SPS
    iteration = start_iteration - 1
    bar = tqdm(
        range(start_iteration, args.num_iterations + 1),
        initial=start_iteration - 1,
        total=args.num_iterations,
        disable=not sys.stderr.isatty(),
        desc="ppo",
    )
    try:
        for iteration in bar:
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate
            lr_now = optimizer.param_groups[0]["lr"]

            next_obs, next_done = rollout(
                env, agent, next_obs, next_done, storage, stats, rn, args.gamma, args.bootstrap_truncation
            )
            global_step += args.batch_size
            with torch.no_grad():
                next_value = agent.get_value(agent.obs_norm(next_obs)).flatten()
            advantages, returns = compute_gae(
                storage["rewards"], storage["values"], storage["dones"], next_value, next_done, args.gamma, args.gae_lambda
            )
            out = update(
                agent,
                optimizer,
                storage["obs"].reshape(-1, obs_dim),
                storage["actions"].reshape(-1, act_dim),
                storage["logprobs"].reshape(-1),
                advantages.reshape(-1),
                returns.reshape(-1),
                storage["values"].reshape(-1),
                args,
            )
            bad = out.pop("bad")
            first_bad_step = torch.where((first_bad_step < 0) & bad.any(), global_step, first_bad_step)
            bad_any |= bad

            last = iteration == args.num_iterations
            if iteration % args.log_every == 0 or last:
                check_finite(bad_any, first_bad_step, ckpt_path)  # host sync
                losses_host = {k: float(v) for k, v in out.items()}
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
                writer.add_scalar("charts/learning_rate", lr_now, global_step)
                for key in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "explained_variance"):
                    writer.add_scalar(f"losses/{key}", losses_host[key], global_step)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                rows.append(metrics_row(global_step, train_wall_prev + wall, sps, ep, losses_host, lr_now))
                write_parquet(pd.DataFrame(rows), out_dir / "metrics.parquet")
                bar.set_postfix(sps=int(sps), ret=f"{ep['return']:.1f}", co2=f"{ep['co2_kg']:.1f}", refresh=False)
                if (bar.disable and iteration % max(1, args.num_iterations // 10) == 0) or last:
                    print(
                        f"iter {iteration}/{args.num_iterations} step {global_step} SPS {int(sps)} "
                        f"return {ep['return']:.2f} co2_kg {ep['co2_kg']:.1f} unserved_kwh {ep['unserved_kwh']:.2f} "
                        f"v_loss {losses_host['value_loss']:.4f} ev {losses_host['explained_variance']:.3f}",
                        flush=True,
                    )
            if args.checkpoint_every and iteration % args.checkpoint_every == 0 and not last:
                checkpoint(iteration, train_wall_prev + time.perf_counter() - start_time)
    except NonFiniteLossError:
        writer.close()
        bar.close()
        raise
    bar.close()

    train_wall = train_wall_prev + time.perf_counter() - start_time
    checkpoint(iteration, train_wall)
    policy_path = export_policy(agent, obs_dim, out_dir)
    print(f"training: {global_step:,} steps in {train_wall:.1f} s ({sps:.0f} SPS); policy saved to {policy_path}")

    result = {"global_step": global_step, "train_wall_s": train_wall, "sps": sps, "policy": str(policy_path)}
    if args.eval_split.lower() != "none":
        actor = DeterministicActor(agent.obs_norm, agent.actor_mean).eval()

        def policy(obs: torch.Tensor, env_) -> torch.Tensor:
            return actor(obs.float()).to(obs.dtype)

        row, traces = evaluate_policy(
            policy,
            site,
            args.eval_split,
            "ppo",
            args.action_mode,
            device,
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
