"""Soft Actor-Critic (Haarnoja et al. 2018) for continuous actions, CleanRL style: one file, the algorithm only.
Trains on ``EVHub-v0`` by default and on any env with a bounded ``Box`` action space and flat observations.

Twin Q networks with Polyak-averaged target copies, a tanh-squashed Gaussian actor, and automatic entropy tuning
(``log_alpha``, target entropy ``-act_dim``). Each iteration steps ``num_envs`` env copies once, writes their
transitions into a replay buffer preallocated on the training device (circular tensors, sampled with
``torch.randint`` on the device), then takes ``gradient_steps`` gradient steps: the update-to-data ratio is
``gradient_steps / num_envs``. The host reads numbers back only every ``log_every`` iterations.

The hot functions (:func:`sample_action`, :func:`update_critic`, :func:`update_actor`, :func:`soft_update`) are plain
functions bound to the networks once; ``--compile`` and ``--cudagraphs`` rebind them (``harness.bind``), ``--amp``
runs the network forward passes under bf16 autocast. On a torch-batched env the action, the env step and the buffer
write of an iteration are one function (:func:`act_step_store`, from ``learning_starts`` on: the random actions before
it step eagerly), compiled as one graph and replayed as one CUDA graph; the gradient steps of an iteration (twin critics
as one batched network, each piece compiled once) are replayed as one CUDA graph.

Truncations. EVHub-v0 never terminates (episodes end by time limit, the env resets in the same step): by default
(``--bootstrap-truncation``) the target bootstraps through the autoreset into the next window. A gymnasium env
bootstraps from the episode's true last observation (``final_obs``).

Stepping order. Synchronously (torch-batched envs, ``--vector-mode sync``) an iteration is: act, step the envs,
store the transitions, then the gradient steps. With ``--vector-mode async`` the env step overlaps the learning:
act, ``step_async``, the gradient steps (on the transitions stored so far), ``step_wait``, store. An iteration then
takes about max(env step, gradient steps); the updates start one iteration later.

Run (defaults: ``caltech`` site, ``hub`` actions, a preset sized to the device)::

    python algos/sac.py
    python algos/sac.py --preset cpu --site path/to/site.toml --total-timesteps 200000 --seed 2
    python algos/sac.py --env-id Pendulum-v1 --num-envs 4 --total-timesteps 20000 --learning-starts 1000
    python algos/sac.py --env-id IOBound-v0 --num-envs 8 --vector-mode async
    tensorboard --logdir outputs/

Writes into the run folder: TensorBoard events, ``metrics.parquet``, ``checkpoint.pt`` (networks, optimizers,
counters, RNG and env state; on a torch-batched env the replay buffer's log, :class:`harness.ReplayLog`, from which
``--resume`` rebuilds the buffer exactly; with ``--save-buffer`` its rows; ``--resume`` continues from it),
``policy.pt2`` (the deterministic actor ``tanh(mean)``, actions in the env's units; ``policy.json`` beside it for
EVHub-v0) and, for EVHub-v0, the deterministic evaluation on ``eval_split``. What is not SAC (vector envs, logging,
checkpoints, export, speed switches, out-of-memory back-off) is ``algos/harness/`` and ``envs/vector.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from algos import harness
except ModuleNotFoundError:  # run as `python algos/sac.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from algos import harness
from envs.vector import SpaceError

PRESETS = {
    # one CPU core: a few dozen envs, a small net, a few gradient steps per iteration; about 70 s on the caltech site
    # (140,000 steps at ~2,000 steps/s), under the other agents' median; 200,000 steps evaluated no better on the train
    # split (docs/lab/model-free-agents.md)
    "cpu": {"num_envs": 32, "total_timesteps": 140_000, "buffer_size": 140_000, "batch_size": 256, "gradient_steps": 4,
            "learning_starts": 5_000, "hidden_size": 128, "log_every": 168, "num_threads": 1},
    # one GPU: hundreds of envs, wide batches and nets, more gradient steps per iteration
    "gpu": {"num_envs": 256, "total_timesteps": 5_000_000, "buffer_size": 2_000_000, "batch_size": 2048,
            "gradient_steps": 8, "learning_starts": 25_600, "hidden_size": 256, "log_every": 168, "num_threads": 0},
}  # fmt: skip
"""Args values per size preset, applied before the command line is read (which overrides any of them)."""

ENV_DEFAULTS: dict[str, dict] = {}
"""Args values of an env (none for SAC: the presets fit EVHub-v0 and the gymnasium Box envs alike)."""

LOSS_NAMES = ("qf_loss", "actor_loss", "alpha_loss")
"""Quantities checked for finiteness after each gradient step, in the order of the ``bad`` flags."""

LOG_STD_MAX = 2.0
LOG_STD_MIN = -5.0


@dataclass
class Args(harness.RunArgs):
    # RunArgs' exp_name, log_every and checkpoint_every (documented there) with this script's defaults
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    log_every: int = 168
    """iterations between host reads of the statistics (TensorBoard, metrics.parquet, the progress bar; 168: one
    caltech episode, so every log sees the envs' episodes end)"""
    checkpoint_every: int = 2_000
    action_mode: Literal["hub", "socket"] = "hub"
    """EVHub-v0 only: 'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket)"""
    total_timesteps: int = 140_000
    """total env steps of the experiment"""
    num_envs: int = 32
    """the number of parallel env copies stepped per iteration"""
    buffer_size: int = 140_000
    """the replay memory buffer size, in transitions; one that does not fit in CUDA memory at setup is halved, down
    to max(num_envs, batch_size) rows"""
    gamma: float = 0.99
    """the discount factor gamma, per hour of site time on EVHub-v0, per step on other envs (on caltech's train split,
    hourly steps, cpu preset: 0.99 evaluated best of 0.9, 0.95, 0.98 and 0.99; at 0.9 the policy defers EV charging
    towards the deadline floor, whose cost lies beyond its horizon, and ends above uncontrolled;
    docs/lab/model-free-agents.md)"""
    tau: float = 0.005
    """target smoothing coefficient (Polyak averaging: target <- (1 - tau) * target + tau * online)"""
    batch_size: int = 256
    """the batch size of a sample from the replay memory"""
    learning_starts: int = 5_000
    """env steps of uniform random actions before learning starts"""
    gradient_steps: int = 4
    """gradient steps per iteration of num_envs env steps (update-to-data ratio gradient_steps / num_envs)"""
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
    hidden_size: int = 128
    """width of the two hidden layers of actor and critics"""
    reward_scale: float = 1.0
    """constant factor on the env reward before it enters the replay buffer (statistics use the raw reward)"""
    socket_features: bool = False
    """EVHub-v0 only: feed the per-socket observations to the networks (off: in 'hub' mode the site aggregates
    (energy needed, deadline floor and cap power) carry what the hub action needs, at a fraction of the cost of the
    first layers; turn it on with --action-mode socket)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal: on EVHub-v0 (the site never terminates) bootstrap through
    the autoreset into the next window, on gymnasium envs from the episode's last observation (final_obs); False
    treats it as terminal"""
    save_buffer: bool = False
    """store the replay buffer's rows in the checkpoint (large) instead of its replay log; needed to resume a
    gymnasium env's run with its buffer (its state cannot be replayed; without it the run refills the buffer for
    learning_starts steps with the current policy). On a torch-batched env the log alone rebuilds the same buffer
    (harness.ReplayLog)"""


# ---------------------------------------------------------------------------------------------- networks
def squashed_gaussian_sample(mean: torch.Tensor, log_std: torch.Tensor, noise: torch.Tensor):
    """Reparameterised sample of ``tanh(N(mean, exp(log_std)))`` from standard-normal ``noise`` ``(B, act_dim)``.

    Returns ``(action, log_prob)``: the action in (-1, 1) ``(B, act_dim)`` and its log-density ``(B,)``, the Gaussian
    log-density minus the tanh change of variables ``sum log(1 - tanh(u)^2)``, in the stable form
    ``2 * (log 2 - u - softplus(-2u))``.
    """
    u = mean + log_std.exp() * noise
    gauss = (-0.5 * noise.square() - log_std - 0.5 * math.log(2.0 * math.pi)).sum(-1)
    log_det = (2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))).sum(-1)
    return torch.tanh(u), gauss - log_det


class TwinQNetwork(nn.Module):
    """The twin critics as one network: ``n`` (2) Q(s, a) MLPs of two ReLU layers of ``hidden`` units, their weights
    stacked, so each layer is one batched matmul (``torch.baddbmm``) for both. Raw obs float32 ``(B, obs_dim)`` (the
    ``inputs`` features kept; None: all) and actions ``(B, act_dim)`` -> Q ``(n, B)``.

    Each member is initialised as an ``nn.Linear`` stack (PyTorch's default init), member after member, so a seed
    gives the weights that ``n`` separate networks made in turn would have; on the CPU the batched forward and
    backward passes give those networks' values to the last bit."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, inputs: list[int] | None, n: int = 2):
        super().__init__()
        self.select = harness.select(inputs, obs_dim)
        n_in = (obs_dim if inputs is None else len(inputs)) + act_dim
        members = [[nn.Linear(n_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)] for _ in range(n)]
        # layer l's weights (n, out, in) and biases (n, 1, out), nn.Linear's layout per member
        self.weights = nn.ParameterList(
            nn.Parameter(torch.stack([m[layer].weight.detach() for m in members])) for layer in range(3)
        )
        self.biases = nn.ParameterList(
            nn.Parameter(torch.stack([m[layer].bias.detach() for m in members])[:, None, :]) for layer in range(3)
        )

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.select(obs), act.to(obs.dtype)], -1)
        h = x.expand(len(self.weights[0]), *x.shape)
        *hidden, (w_out, b_out) = zip(self.weights, self.biases)
        for w, b in hidden:
            h = F.relu(torch.baddbmm(b.to(h.dtype), h, w.to(h.dtype).transpose(1, 2)))
        # the head as (n, 1, hidden) @ (n, hidden, B): the product nn.Linear's one-output layer computes, same bits
        return torch.baddbmm(b_out.to(h.dtype), w_out.to(h.dtype), h.transpose(1, 2)).squeeze(1)


class Actor(nn.Module):
    """Gaussian policy over the pre-squash action: raw obs ``(B, obs_dim)`` -> ``(mean, log_std)``, each ``(B,
    act_dim)``, ``log_std`` state-dependent and squashed into ``[LOG_STD_MIN, LOG_STD_MAX]``. tanh puts the action
    into [-1, 1], which the env rescales to its Box bounds."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, inputs: list[int] | None):
        super().__init__()
        self.select = harness.select(inputs, obs_dim)
        n_in = obs_dim if inputs is None else len(inputs)
        self.trunk = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.fc_mean = nn.Linear(hidden, act_dim)
        self.fc_logstd = nn.Linear(hidden, act_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(self.select(obs))
        log_std = torch.tanh(self.fc_logstd(h))
        return self.fc_mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)

    def get_action(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sampled action (B, act_dim), its log-prob (B,), deterministic action tanh(mean))``, all float32."""
        mean, log_std = self(obs)
        mean, log_std = mean.float(), log_std.float()
        action, log_prob = squashed_gaussian_sample(mean, log_std, torch.randn_like(mean))
        return action, log_prob, torch.tanh(mean)


class DeterministicActor(nn.Module):
    """The deterministic policy (evaluation and export): raw obs float32 ``(B, obs_dim)`` -> ``tanh(mean)`` ``(B,
    act_dim)`` in [-1, 1]; it shares the actor's weights."""

    def __init__(self, actor: Actor):
        super().__init__()
        self.actor = actor

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.actor(obs)[0])


# ---------------------------------------------------------------------------------------------- hot functions
# in the order the loop calls them: sample_action (or act_step_store: action, env step and buffer write on a
# torch-batched env), then the gradient steps: update_critic, update_actor (every policy_frequency), soft_update
def sample_action(actor: Actor, obs: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """A stochastic action float32 ``(B, act_dim)`` in (-1, 1) of the current policy for each env; no host sync."""
    with torch.no_grad(), torch.autocast(obs.device.type, torch.bfloat16, enabled=amp):
        return actor.get_action(obs)[0]


def act_step_store(
    policy, env, rb: harness.ReplayBuffer, obs: torch.Tensor, *, reward_scale: float, bootstrap_truncation: bool
) -> torch.Tensor:
    """One iteration's env step on a torch-batched env: ``policy`` (:func:`sample_action`, bound) acts on ``obs``, the
    env steps, and the transitions go into ``rb`` (:func:`harness.store` without advancing; the caller then calls
    :meth:`~harness.ReplayBuffer.advance`). Returns the next observation. Tensors only, every state updated in place,
    no host sync: ``--compile`` traces it as one graph and ``--cudagraphs`` replays it as one CUDA graph."""
    actions = policy(obs)
    return harness.store(rb, obs, actions, env.step(actions), bootstrap_truncation, reward_scale, advance=False)


def update_critic(
    obs,
    actions,
    rewards,
    next_obs,
    dones,
    *,
    actor: Actor,
    qf: TwinQNetwork,
    qf_target: TwinQNetwork,
    log_alpha: torch.Tensor,
    q_optimizer: torch.optim.Optimizer,
    gamma: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """One gradient step of both Q networks on the soft Bellman target of the target networks; no host sync.

    A batch of ``B`` rows: ``obs``, ``next_obs`` ``(B, obs_dim)``, ``actions`` ``(B, act_dim)``, ``rewards`` and
    ``dones`` ``(B,)``, float32. Returns device scalars ``qf1_values``, ``qf2_values``, ``qf1_loss``, ``qf2_loss``,
    ``qf_loss`` (their mean) and ``bad`` (the loss is non-finite).
    """
    autocast = functools.partial(torch.autocast, obs.device.type, torch.bfloat16, enabled=amp)
    with torch.no_grad():
        with autocast():
            next_actions, next_log_pi, _ = actor.get_action(next_obs)
            q_next = qf_target(next_obs, next_actions).float()
        min_q_next = torch.minimum(q_next[0], q_next[1]) - log_alpha.exp() * next_log_pi
        target = rewards + (1.0 - dones) * gamma * min_q_next
    with autocast():
        q1, q2 = qf(obs, actions).float()
    qf1_loss = F.mse_loss(q1, target)
    qf2_loss = F.mse_loss(q2, target)
    qf_loss = qf1_loss + qf2_loss
    harness.zero_grad(q_optimizer)
    torch.autograd.backward(qf_loss, inputs=[p for group in q_optimizer.param_groups for p in group["params"]])
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
    obs,
    *,
    actor: Actor,
    qf: TwinQNetwork,
    log_alpha: torch.Tensor,
    actor_optimizer: torch.optim.Optimizer,
    a_optimizer: torch.optim.Optimizer | None,
    target_entropy: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """One gradient step of the actor (maximise ``min Q - alpha log pi``) on ``obs`` ``(B, obs_dim)`` and, with
    autotune (``a_optimizer``), of ``log_alpha``; no host sync. Returns device scalars ``actor_loss``, ``alpha``,
    ``alpha_loss`` and ``bad`` ``(2,)`` (which of the two losses is non-finite)."""
    with torch.autocast(obs.device.type, torch.bfloat16, enabled=amp):
        pi, log_pi, _ = actor.get_action(obs)
        q = qf(obs, pi)
        min_q = torch.minimum(q[0], q[1]).float()
    actor_loss = (log_alpha.exp().detach() * log_pi - min_q).mean()
    harness.zero_grad(actor_optimizer)
    # gradients only into the actor: the critics' grads belong to the critic step
    torch.autograd.backward(actor_loss, inputs=list(actor.parameters()))
    actor_optimizer.step()
    if a_optimizer is not None:
        alpha_loss = (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()
        harness.zero_grad(a_optimizer)
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


@torch.no_grad()
def soft_update(target: list[torch.Tensor], source: list[torch.Tensor], tau: float) -> None:
    """Polyak averaging in place: ``target <- (1 - tau) * target + tau * source`` for each pair of tensors."""
    torch._foreach_lerp_(target, source, tau)


def gradient_steps(
    sample: Callable[[], dict[str, torch.Tensor]],
    critic_step: Callable,
    actor_step: Callable,
    target_step: Callable,
    *,
    num_steps: int,
    first_update: int,
    policy_frequency: int,
    target_network_frequency: int,
) -> dict[str, torch.Tensor]:
    """One iteration's ``num_steps`` gradient steps, numbered ``first_update + 1, ...``: each a replay sample
    (``sample()``) and a critic step (:func:`update_critic`); every ``policy_frequency``-th also ``policy_frequency``
    actor steps (:func:`update_actor`, TD3's delayed policy updates), every ``target_network_frequency``-th the
    Polyak update (:func:`soft_update`). Tensors only, no host sync: ``--compile`` traces it as one graph and
    ``--cudagraphs`` replays it as one CUDA graph.

    Returns the last critic step's outputs, the last actor step's (absent where none ran) and ``bad``, bool
    ``(len(LOSS_NAMES),)``: True where that loss was non-finite in some step.
    """
    out: dict[str, torch.Tensor] = {}
    bad = None
    for update in range(first_update + 1, first_update + num_steps + 1):
        data = sample()
        out_q = critic_step(data["obs"], data["actions"], data["rewards"], data["next_obs"], data["dones"])
        no_actor_step = torch.zeros(len(LOSS_NAMES) - 1, dtype=torch.bool, device=out_q["bad"].device)
        flags = [out_q["bad"].reshape(1), no_actor_step]
        out.update(out_q)
        if update % policy_frequency == 0:
            for _ in range(policy_frequency):
                out_pi = actor_step(data["obs"])
                flags[1] = flags[1] | out_pi["bad"]
                out.update(out_pi)
        if update % target_network_frequency == 0:
            target_step()
        bad = torch.cat(flags) if bad is None else bad | torch.cat(flags)
    return {**out, "bad": bad}


# ---------------------------------------------------------------------------------------------- training
def check_action_space(env_id: str, space: gym.Space) -> None:
    """Raise SpaceError (naming ``env_id`` and ``space``) unless it is a ``Box`` with finite bounds."""
    if not isinstance(space, gym.spaces.Box):
        raise SpaceError(
            f"SAC needs a continuous (Box) action space, but {env_id} has {space}; use algos/dqn.py for "
            f"discrete actions"
        )
    if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise SpaceError(
            f"SAC squashes its actions into the action bounds, but {env_id} has an unbounded action space {space}"
        )


def check_observation_space(env_id: str, space: gym.Space) -> None:
    """Raise SpaceError (naming ``env_id`` and ``space``) unless it is a 1-D ``Box``: SAC's networks are MLPs."""
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
        kind = "image observations (3-D)" if isinstance(space, gym.spaces.Box) and len(space.shape) == 3 else "this"
        raise SpaceError(
            f"SAC's networks take flat observations (a 1-D Box), but {env_id} has {space}: {kind} is not "
            f"supported (algos/dqn.py has a CNN torso for image observations)"
        )


def deterministic_policy(args: Args, state: dict) -> tuple[nn.Module, object, str | None]:
    """The deterministic policy of a checkpoint's ``state``, with a one-env copy of its env and the action mode it
    acts in: ``(actor, env, action_mode)`` (``python -m algos.harness.export``)."""
    env = harness.make_env(args, 1, torch.device("cpu"), action_mode=args.action_mode)
    obs_dim, act_dim = env.obs_shape[0], int(np.prod(env.single_action_space.shape))
    nets = make_networks(args, obs_dim, act_dim, harness.network_inputs(env, args), torch.device("cpu"))[0]
    nets["actor"].load_state_dict(state["actor"])
    return DeterministicActor(nets["actor"]).eval(), env, args.action_mode


def make_networks(args: Args, obs_dim: int, act_dim: int, inputs: list[int] | None, device: torch.device) -> tuple:
    """The actor, the twin Q networks (one :class:`TwinQNetwork`) and its frozen target copy (``nets``, by checkpoint
    name), ``log_alpha``
    and the optimizers with their learning rates (device tensors under CUDA graphs, for capturable Adam; else floats).
    Returns ``(nets, log_alpha, optimizers, lrs)``; ``optimizers["a_optimizer"]`` is None without ``--autotune``."""
    actor = Actor(obs_dim, act_dim, args.hidden_size, inputs).to(device)
    qf = TwinQNetwork(obs_dim, act_dim, args.hidden_size, inputs).to(device)
    qf_target = copy.deepcopy(qf)
    for p in qf_target.parameters():
        p.requires_grad_(False)
    log_alpha = torch.full((), math.log(args.alpha), device=device, requires_grad=args.autotune)
    lrs = {"q_optimizer": args.q_lr, "actor_optimizer": args.policy_lr, "a_optimizer": args.q_lr}
    lrs = {name: harness.device_lr(lr, device) if args.cudagraphs else lr for name, lr in lrs.items()}
    adam = functools.partial(torch.optim.Adam, capturable=args.cudagraphs)
    optimizers = {
        "q_optimizer": adam(list(qf.parameters()), lr=lrs["q_optimizer"]),
        "actor_optimizer": adam(list(actor.parameters()), lr=lrs["actor_optimizer"]),
        "a_optimizer": adam([log_alpha], lr=lrs["a_optimizer"]) if args.autotune else None,
    }
    nets = {"actor": actor, "qf": qf, "qf_target": qf_target}
    return nets, log_alpha, optimizers, lrs


def start(
    run: harness.Run,
    state: dict | None,
    env,
    rb: harness.ReplayBuffer,
    log: harness.ReplayLog | None,
    nets: dict,
    log_alpha: torch.Tensor,
    optimizers: dict,
    lrs: dict,
) -> tuple[torch.Tensor, int, dict | None]:
    """Start the game: reset the envs, then load the live ``state`` handed over after an out-of-memory error or
    ``--resume``'s checkpoint (:meth:`harness.Run.restore`) and rebuild the replay buffer from it (its replay ``log``
    replayed, or its rows). Returns ``(obs, n_updates, loaded)``; ``loaded`` is None for a fresh start."""
    args, device = run.args, run.device
    obs, _ = env.reset(seed=args.seed)
    loaded = run.restore(state, nets, optimizers, env, lrs)
    if loaded is None:
        return obs, 0, None
    with torch.no_grad():
        log_alpha.copy_(loaded["log_alpha"])
    obs = loaded["obs"].to(device) if loaded["env_restored"] else env.reset(seed=args.seed + run.global_step)[0]

    def replay(obs, a):  # one env step and its transitions, to rebuild the buffer from its replay log
        return harness.store(rb, obs, a, env.step(a), args.bootstrap_truncation, args.reward_scale)

    message, kept = harness.restore_buffer(
        rb,
        log,
        loaded["replay_buffer"],
        env,
        replay,
        env.num_envs,
        loaded["env"] if loaded["env_restored"] else None,
        obs,
    )
    if state is None:
        run.resume_note(replay_buffer=message, exact=kept)
    return obs, int(loaded["n_updates"]), loaded


def bind_hot_functions(
    args: Args, env, rb: harness.ReplayBuffer, nets: dict, log_alpha: torch.Tensor, optimizers: dict, act_dim: int
) -> tuple:
    """The loop's hot functions bound once to the networks, optimizers, env and replay buffer, with the speed switches
    applied (``harness.bind``): ``(sample_action, act_step_store, learner)``.

    On a torch-batched env :func:`act_step_store` (action, env step and buffer write) is compiled as one graph and
    replayed as one CUDA graph; a host env steps between the device calls, so there ``act_step_store`` is None and
    :func:`sample_action` is compiled or graphed alone. ``learner(phase)`` is an iteration's :func:`gradient_steps`:
    its pieces (:func:`update_critic`, :func:`update_actor`, :func:`soft_update`) each compiled once, the whole loop
    of ``gradient_steps`` steps replayed as one CUDA graph, one per ``phase`` (the update count modulo the period of
    the delayed policy and target updates; each captured at its first use). Under CUDA graphs the replay sample is
    drawn on the device (:meth:`harness.ReplayBuffer.sample_on_device`), else by
    :meth:`harness.ReplayBuffer.sample`, whose draws an eager run of an earlier version made too.
    """
    actor, qf, qf_target = nets["actor"], nets["qf"], nets["qf_target"]
    policy = functools.partial(sample_action, actor, amp=args.amp)
    critic_step = functools.partial(
        update_critic,
        actor=actor,
        qf=qf,
        qf_target=qf_target,
        log_alpha=log_alpha,
        q_optimizer=optimizers["q_optimizer"],
        gamma=harness.per_step(args, args.gamma),
        amp=args.amp,
    )
    actor_step = functools.partial(
        update_actor,
        actor=actor,
        qf=qf,
        log_alpha=log_alpha,
        actor_optimizer=optimizers["actor_optimizer"],
        a_optimizer=optimizers["a_optimizer"],
        target_entropy=-float(act_dim),
        amp=args.amp,
    )
    target_step = functools.partial(soft_update, list(qf_target.parameters()), list(qf.parameters()), args.tau)
    # each piece compiled once (small graphs, a short compile), the iteration's loop over them captured as one graph
    critic_step, actor_step, target_step = harness.bind(
        args, graphs=False, update_critic=critic_step, update_actor=actor_step, soft_update=target_step
    )
    sampler = rb.sample_on_device if args.cudagraphs else rb.sample
    learners: dict[int, Callable] = {}

    def learner(phase: int) -> Callable:
        if phase not in learners:
            learners[phase] = harness.capture(
                args,
                functools.partial(
                    gradient_steps,
                    functools.partial(sampler, args.batch_size),
                    critic_step,
                    actor_step,
                    target_step,
                    num_steps=args.gradient_steps,
                    first_update=phase,
                    policy_frequency=args.policy_frequency,
                    target_network_frequency=args.target_network_frequency,
                ),
                "gradient_steps",
            )
        return learners[phase]

    step = None
    if env.torch_batched:  # act, env step and buffer write as one graph (from learning_starts on)
        (step,) = harness.bind(
            args,
            graphs=False,
            act_step_store=functools.partial(
                act_step_store,
                policy,
                env,
                rb,
                reward_scale=args.reward_scale,
                bootstrap_truncation=args.bootstrap_truncation,
            ),
        )
        step = harness.capture(args, step, "act_step_store")
    else:  # a host env steps between the device calls
        (policy,) = harness.bind(args, sample_action=policy)
    return policy, step, learner


def checkpoint_state(
    run: harness.Run, nets: dict, log_alpha, optimizers: dict, n_updates: int, env, obs, sizes, rb, log, rows: bool
) -> dict:
    """What a checkpoint holds besides ``run.counters()``: networks, ``log_alpha``, optimizers, counters, env state,
    the sizes, and the replay buffer's log, or its rows where ``rows`` (``--save-buffer``, and always in the live
    state handed over after an out-of-memory error)."""
    return {
        **{name: net.state_dict() for name, net in nets.items()},
        "log_alpha": log_alpha.detach(),
        **{name: None if o is None else o.state_dict() for name, o in optimizers.items()},
        "n_updates": n_updates,
        "env": env.state_dict(),
        "num_envs": sizes.num_envs,
        "obs": obs,
        "sizes": dataclasses.asdict(sizes),
        "replay_buffer": harness.checkpoint_buffer(rb, log, run.global_step, rows),
    }


def setup(run: harness.Run, sizes: harness.ReplaySizes) -> tuple:
    """The env setup of :func:`train`: the envs (their spaces checked), the networks and optimizers
    (:func:`make_networks`), and the replay buffer (halved until it fits, ``sizes.buffer_size`` set to what was
    allocated) with its replay log on a torch-batched env. Returns ``(env, act_dim, nets, log_alpha, optimizers, lrs,
    rb, log)``.

    Raises:
        ValueError: an action space that is not a bounded Box, or observations that are not flat (the envs closed).
        OutOfMemoryBackoffError: not even the smallest buffer fits.
    """
    args, device = run.args, run.device
    env = harness.make_env(args, sizes.num_envs, device, action_mode=args.action_mode)
    try:
        check_action_space(args.env_id, env.single_action_space)
        check_observation_space(args.env_id, env.single_observation_space)
    except ValueError:
        env.close()
        raise
    obs_dim, act_dim = env.obs_shape[0], int(np.prod(env.single_action_space.shape))
    if args.action_mode == "socket" and not args.socket_features and run.evhub:
        print("note: --action-mode socket without --socket-features: the networks do not see the sockets")
    nets, log_alpha, optimizers, lrs = make_networks(args, obs_dim, act_dim, harness.network_inputs(env, args), device)
    rb, sizes.buffer_size = harness.allocate_halving(
        run,
        lambda n: harness.ReplayBuffer(n, obs_dim, device, (act_dim,), torch.float32),
        sizes.buffer_size,
        max(sizes.num_envs, sizes.batch_size),
        "buffer_size",
    )
    log = harness.ReplayLog(rb, sizes.num_envs) if env.torch_batched else None
    return env, act_dim, nets, log_alpha, optimizers, lrs, rb, log


def announce(run: harness.Run, sizes: harness.ReplaySizes, env, num_iterations: int) -> None:
    """Say what the run will do (:meth:`harness.Run.announce`): envs, gradient steps per iteration and their
    update-to-data ratio, batch, buffer, iterations and steps."""
    args = run.args
    run.announce(
        f"{sizes.num_envs} envs, {args.gradient_steps} gradient steps per iteration (UTD "
        f"{args.gradient_steps / sizes.num_envs:.3g}), batch {sizes.batch_size}, buffer "
        f"{sizes.buffer_size:,}, {num_iterations} iterations, {run.steps_to_train(num_iterations, sizes.num_envs)}",
        env,
        dataclasses.asdict(sizes),
    )


def train(run: harness.Run, sizes: harness.ReplaySizes, state: dict | None = None) -> dict:
    """Train at ``sizes`` from ``state`` (the live state after an out-of-memory error), the checkpoint (``--resume``)
    or afresh; see :func:`main`."""
    args, device = run.args, run.device
    # TRY NOT TO MODIFY: env setup
    env, act_dim, nets, log_alpha, optimizers, lrs, rb, log = setup(run, sizes)

    # TRY NOT TO MODIFY: start the game, or resume it
    obs, n_updates, loaded = start(run, state, env, rb, log, nets, log_alpha, optimizers, lrs)
    # updates begin once the buffer holds learning_starts rows (a resumed run without its buffer refills it)
    updates_from = run.global_step + max(0, args.learning_starts - rb.size)
    steps_left = max(0, args.total_timesteps - run.global_step) // sizes.num_envs
    num_iterations = run.iteration + (steps_left if loaded is not None else max(1, steps_left))

    sample_action, act_step_store, learner = bind_hot_functions(args, env, rb, nets, log_alpha, optimizers, act_dim)
    period = math.lcm(args.policy_frequency, args.target_network_frequency)

    def live_state(rows: bool = True) -> dict:
        return checkpoint_state(run, nets, log_alpha, optimizers, n_updates, env, obs, sizes, rb, log, rows)

    nan = torch.full((), math.nan, device=device)
    # the logged losses: NaN until learning starts, then the last values of the last iteration's gradient steps
    losses = dict.fromkeys(("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss"), nan)
    losses |= dict.fromkeys(("actor_loss", "alpha", "alpha_loss"), nan)

    def update() -> None:
        """``gradient_steps`` updates on uniform samples of the replay buffer."""
        nonlocal n_updates
        out = learner(n_updates % period)()
        n_updates += args.gradient_steps
        run.flag(guard, out["bad"])
        losses.update({k: v for k, v in out.items() if k != "bad"})

    evaluator = DeterministicActor(nets["actor"])
    announce(run, sizes, env, num_iterations)
    guard = run.new_guard()
    for iteration in run.iterations(num_iterations):
        if log is not None:
            log.mark(env, obs, run.global_step)
        stepped = in_update = False
        try:
            # ALGO LOGIC: put action logic here
            if act_step_store is not None and run.global_step >= args.learning_starts:
                # a torch-batched env: act, step the envs and store the transitions in one (compiled, graphed) call
                obs = act_step_store(obs)
                rb.advance(sizes.num_envs)
            else:
                if run.global_step < args.learning_starts:
                    actions = torch.rand(sizes.num_envs, act_dim, device=device) * 2.0 - 1.0
                else:
                    actions = sample_action(obs)

                # TRY NOT TO MODIFY: execute the game (an async gymnasium env steps while the gradient steps run)
                if env.overlap:
                    env.step_async(actions)
                    if run.global_step >= max(updates_from, 1):  # before this step's transitions are stored
                        in_update = True
                        update()
                        in_update = False
                    result = env.step_wait()
                else:
                    result = env.step(actions)

                # TRY NOT TO MODIFY: save data to the replay buffer; `final_obs` is the real next obs of an ended
                # episode
                obs = harness.store(rb, obs, actions, result, args.bootstrap_truncation, args.reward_scale)
            run.global_step += sizes.num_envs
            stepped = True

            # ALGO LOGIC: training
            if not env.overlap and run.global_step >= updates_from:
                in_update = True
                update()
        except RuntimeError as exc:
            where = f"at global_step {run.global_step} (iteration {iteration}), "
            where += "in the gradient steps" if in_update else "stepping the envs"
            done = iteration if stepped else iteration - 1  # an overlapped step in flight is dropped with its iteration
            run.out_of_memory(exc, where, lambda done=done: {**live_state(), "iteration": done}, in_update)

        # TRY NOT TO MODIFY: record rewards and losses for plotting purposes
        if run.logging_now():
            run.log(
                env,
                guard,
                {f"losses/{k}": v for k, v in losses.items()},
                learning_rate=args.q_lr,
                policy_lr=args.policy_lr,
                gradient_steps=n_updates,
                num_envs=sizes.num_envs,
                batch_size=sizes.batch_size,
            )
        run.eval_during_training(evaluator, args.action_mode)
        if run.every(args.checkpoint_every):
            run.check_finite(guard)
            run.save(live_state(args.save_buffer))
    run.check_finite(guard)
    return run.finish(live_state(args.save_buffer), evaluator, env, args.action_mode, **dataclasses.asdict(sizes))


def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy", "vector_mode", "num_envs", "batch_size",
        "buffer_size"}`` (the sizes trained with at the end: smaller than asked for after out-of-memory back-offs)
        and, for EVHub-v0 unless ``eval_split`` is ``"none"``, ``"eval"``: the one-row KPI DataFrame.

    Raises:
        ValueError: an action space that is not a bounded Box, observations that are not flat, or a buffer smaller
            than num_envs. NonFiniteLossError: a loss became NaN or infinite. CheckpointError: ``--resume`` from an
            unusable checkpoint. OutOfMemoryBackoffError: CUDA ran out of memory once more after
            ``max_oom_retries`` halvings (or with nothing left to halve), or not even the smallest buffer fits.
    """
    if args.buffer_size < args.num_envs:
        raise ValueError(f"buffer_size={args.buffer_size} is smaller than num_envs={args.num_envs}")
    sizes = harness.ReplaySizes(args.num_envs, args.batch_size, args.buffer_size)
    run = harness.Run("sac", args, LOSS_NAMES, PRESETS, ENV_DEFAULTS)
    try:
        # in the gradient steps the batch halves (down to harness.OOM_MIN_BATCH_SIZE), else num_envs
        return harness.train_with_oom_restarts(
            train, run, sizes, functools.partial(harness.halve_batch_or_envs, gradient_steps=args.gradient_steps)
        )
    finally:
        run.close()


if __name__ == "__main__":
    harness.script(main, Args, PRESETS, ENV_DEFAULTS, description=__doc__)
