"""Synchronous advantage actor-critic (A2C), CleanRL style: ``EVHub-v0`` or any gymnasium env with a Box action space
(Gaussian policy) or a Discrete one (Categorical policy), flat observations (MLPs) or images (a CNN torso).

Each iteration steps ``num_envs`` copies of the env for a short rollout of ``num_steps`` steps, computes returns and
advantages by GAE (``gae_lambda=1``: the classic n-step returns, bootstrapped from the value of the observation after
the rollout) and takes ONE gradient step on ``policy_loss + vf_coef * value_loss - ent_coef * entropy`` with RMSprop
(``alpha=0.99, eps=1e-5``, as Stable-Baselines3 / CleanRL) or Adam, clipped to ``max_grad_norm``.

* Box actions: an unsquashed Gaussian mean (``actor_mean``) and a state-independent learned log-std; the rollout stores
  the raw sample float32 ``(num_steps, num_envs, act_dim)`` (the env clips it to [-1, 1] and rescales to its bounds).
* Discrete actions: a Categorical over ``actor_logits`` (sampled by the Gumbel-max trick, no host sync); the rollout
  stores the indices int64 ``(num_steps, num_envs)`` in ``0..n-1``.
* Flat observations ``(obs_dim,)``: separate actor and critic MLPs (two tanh layers of ``hidden_size``) over the
  features :func:`harness.network_inputs` keeps, standardised by running statistics (``--norm-obs``).
* Images ``(C, H, W)`` (e.g. ``Snake-v0``): one :func:`harness.cnn_torso` shared by a policy head (orthogonal std 0.01)
  and a value head (std 1), CleanRL's ``ppo_atari.py`` layout.

Episode ends: A2C's returns stop at every episode end (``dones``). A truncation is bootstrapped
(``--bootstrap-truncation``): from ``gamma * V(final_obs)`` added to the reward where the env gives the final
observation (gymnasium envs), else from the next stored value (the torch-batched envs' autoreset observation). The
reward normaliser's discounted return restarts at every episode end as well.

The hot functions are plain module-level functions bound to the agent once: :func:`policy_step` (normalise and act)
and :func:`update` (bootstrap value, returns, one gradient step); ``--compile`` / ``--cudagraphs`` rebind them
(:func:`harness.bind`), ``--amp`` runs the forward passes under bf16 autocast. On a torch-batched env the policy and
the env step are one function (:func:`act_and_step`) that ``--compile`` traces as one graph, and ``--cudagraphs``
replays the whole rollout of ``num_steps`` steps as one CUDA graph and the update as another (a gymnasium env steps
on the host: there only the policy is compiled or graphed). No host sync in the loop on the torch-batched envs: the
host reads numbers once per ``log_every`` iterations.

Run::

    python algos/a2c.py                                  # caltech site, hub actions, a preset sized to the device
    python algos/a2c.py --site path/to/site.toml --total-timesteps 200000 --optimizer adam --gae-lambda 0.95
    python algos/a2c.py --env-id Pendulum-v1 --num-envs 8 --num-steps 8 --total-timesteps 200000
    python algos/a2c.py --env-id CartPole-v1 --num-envs 8 --num-steps 5 --gamma 0.99 --total-timesteps 100000
    python algos/a2c.py --env-id Snake-v0
    tensorboard --logdir outputs/

Writes into the run folder: TensorBoard events, ``metrics.parquet``, ``checkpoint.pt`` (``--resume`` continues from
it), ``policy.pt2`` (the deterministic policy: the clipped mean or the argmax action, in the env's units; for EVHub-v0
``policy.json`` beside it) and, for EVHub-v0, the deterministic evaluation on ``eval_split``. What is not A2C (vector
envs, logging, checkpoints, export, speed switches, out-of-memory back-off) is ``algos/harness/`` and
``envs/vector.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

try:
    from algos import harness
except ModuleNotFoundError:  # run as `python algos/a2c.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from algos import harness
from algos.harness import CheckpointError, NonFiniteLossError, OutOfMemoryBackoffError  # noqa: F401 (main's errors)
from envs.vector import NormalizeReward, SpaceError

PRESETS = {
    # 2 CPU cores: ~100 envs, short rollouts, a small net; a few minutes on the caltech site with evaluation
    "cpu": {"num_envs": 128, "num_steps": 16, "total_timesteps": 4_000_000, "hidden_size": 64, "log_every": 50,
            "num_threads": 1},
    # one GPU: thousands of envs, a wider net
    "gpu": {"num_envs": 2048, "num_steps": 16, "total_timesteps": 64_000_000, "hidden_size": 256, "log_every": 50,
            "num_threads": 0},
}  # fmt: skip
"""Size presets: Args values chosen by ``--preset`` before the command line is parsed (any flag overrides them)."""

ENV_DEFAULTS = {
    # Snake: rewards of +1 (food) / -1 (death), long episodes, image observations in [0, 1]
    "Snake-v0": {"gamma": 0.99, "ent_coef": 0.01, "norm_obs": False, "norm_reward": False, "cnn_channels": (16, 32)},
    # Snake on the cpu preset: about 5 minutes on 2 CPU cores (10,000 steps/s); seed 1 scored 39 foods per episode
    # with the greedy policy (1,000 episodes; uniform-random actions: 0.155)
    "Snake-v0/cpu": {"num_envs": 64, "num_steps": 8, "total_timesteps": 3_000_000, "hidden_size": 128},
    # Snake on one GPU (sizes not tuned): batches of 4,096 steps, a wider torso, about as many updates as on the cpu
    "Snake-v0/gpu": {"num_envs": 512, "num_steps": 8, "total_timesteps": 20_000_000, "hidden_size": 256,
                     "cnn_channels": (32, 64)},
}  # fmt: skip
"""An env's own Args values (keyed by its id without a ``module:`` prefix; ``"<env_id>/<preset>"``: for one preset),
on top of :data:`PRESETS`; any flag given on the command line overrides them."""

LOSS_NAMES = ("value_loss", "policy_loss", "entropy", "grad_norm")
"""What the finite-loss guard watches: the update's ``bad`` flags come in this order."""


@dataclass
class Args(harness.RunArgs):
    # RunArgs' exp_name, log_every and checkpoint_every (documented there) with this script's defaults
    exp_name: str = Path(__file__).stem
    log_every: int = 50
    checkpoint_every: int = 1000
    action_mode: str = "hub"
    """EVHub-v0 only: 'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket)"""
    total_timesteps: int = 4_000_000
    """total env steps of the experiment"""
    learning_rate: float = 7e-4
    """the learning rate of the optimizer"""
    num_envs: int = 128
    """the number of parallel env copies"""
    num_steps: int = 16
    """the number of steps per env in each rollout, one gradient step per rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear to zero over the run)"""
    optimizer: Literal["rmsprop", "adam"] = "rmsprop"
    """the optimizer: 'rmsprop' (alpha=rmsprop_alpha, eps=optimizer_eps, as SB3/CleanRL A2C) or 'adam'"""
    rmsprop_alpha: float = 0.99
    """the smoothing constant alpha of RMSprop"""
    optimizer_eps: float = 1e-5
    """the epsilon of the optimizer (RMSprop and Adam)"""
    gamma: float = 0.98
    """the discount factor gamma, per hour of site time on EVHub-v0 (0.98: a horizon of about two days), per step on
    other envs"""
    gae_lambda: float = 1.0
    """the lambda of the generalised advantage estimation (1.0: plain n-step returns, as SB3's A2C), per hour of site
    time on EVHub-v0 as gamma"""
    norm_adv: bool = False
    """toggles advantage normalisation over the batch (off in SB3's A2C)"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value loss (mean squared error of value and return)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    hidden_size: int = 64
    """width of the two hidden layers of actor and critic, or of the layer after the CNN torso for images"""
    cnn_channels: tuple[int, int] = (32, 64)
    """image observations (C, H, W): output channels of the CNN torso's two 3x3 convolutions (not used for flat
    observations)"""
    init_logstd: float = -0.5
    """initial log standard deviation of the Gaussian policy (state-independent, learned; Box actions only)"""
    norm_obs: bool = True
    """standardise observations with running statistics kept in the agent (CleanRL's NormalizeObservation; per pixel
    for images; Snake-v0: off, its images are in [0, 1] already)"""
    norm_reward: bool = True
    """scale rewards by a running std of the discounted return (CleanRL's NormalizeReward, on device; Snake-v0: off,
    its rewards are +-1 already)"""
    bootstrap_truncation: bool = True
    """bootstrap through time-limit truncations (torch-batched envs: the value of the next episode's first observation
    stands in for the lost final one, exact where, as for EVHub-v0, the windows are alike; gymnasium envs: the value
    of info['final_obs']); False: truncation is terminal"""


# ---------------------------------------------------------------------------------------------- agent
def mlp(obs_dim: int, inputs: list[int] | None, hidden: int, n_out: int, out_std: float) -> nn.Sequential:
    """``(B, obs_dim)`` -> ``(B, n_out)``: the ``inputs`` features, two tanh layers of ``hidden``, a linear output
    (orthogonal init, std ``out_std``)."""
    n_in = obs_dim if inputs is None else len(inputs)
    return nn.Sequential(
        harness.select(inputs, obs_dim),
        harness.layer_init(nn.Linear(n_in, hidden)),
        nn.Tanh(),
        harness.layer_init(nn.Linear(hidden, hidden)),
        nn.Tanh(),
        harness.layer_init(nn.Linear(hidden, n_out), std=out_std),
    )


class Agent(nn.Module):
    """Actor and critic over flat observations (separate MLPs, :func:`mlp`) or images (one shared CNN torso).

    ``discrete``: a Categorical actor over ``actor_logits`` (``act_dim`` = the number of actions); else a Gaussian
    actor with mean ``actor_mean`` (``act_dim`` outputs) and a state-independent ``actor_logstd``. Flat observations
    (``obs_shape`` None or ``(obs_dim,)``): MLPs over the ``inputs`` features (all by default). Images (``obs_shape``
    ``(C, H, W)``): ``network`` is :func:`harness.cnn_torso` with ``cnn_channels``, the actor and ``critic`` are
    single ``Linear`` heads on its ``hidden`` features; ``inputs`` is not used.

    ``obs_norm`` (running standardisation, or identity) maps raw observations to network inputs; the rollout stores
    normalised observations. ``discrete`` and ``image`` are Python bools: the hot functions branch on them only.

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
        self.image, self.discrete = obs_shape is not None and len(obs_shape) == 3, discrete
        shape = tuple(int(x) for x in obs_shape) if self.image else obs_dim
        self.obs_norm = harness.RunningObsNorm(shape) if norm_obs else nn.Identity()
        if self.image:  # the order of construction is the order of the random initial weights
            self.network = harness.cnn_torso(shape, cnn_channels, hidden)
            self._set_actor(harness.layer_init(nn.Linear(hidden, act_dim), std=0.01), act_dim, init_logstd)
            self.critic = harness.layer_init(nn.Linear(hidden, 1), std=1.0)
        else:
            self.critic = mlp(obs_dim, inputs, hidden, 1, 1.0)
            self._set_actor(mlp(obs_dim, inputs, hidden, act_dim, 0.01), act_dim, init_logstd)

    def _set_actor(self, head: nn.Module, act_dim: int, init_logstd: float) -> None:
        if self.discrete:
            self.actor_logits = head
        else:
            self.actor_mean = head
            self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_logstd)))

    def actor_net(self) -> nn.Module:
        """Normalised observations -> the policy's logits ``(B, n)`` or mean ``(B, act_dim)`` (shared parameters)."""
        head = self.actor_logits if self.discrete else self.actor_mean
        return nn.Sequential(self.network, head) if self.image else head

    def dist_and_value(self, x: torch.Tensor, amp: bool = False) -> tuple[Normal | Categorical, torch.Tensor]:
        """Policy distribution and value float32 ``(B,)`` at normalised observations ``x`` ``(B, n_in)`` or ``(B, C,
        H, W)``: a ``Normal`` over ``(B, act_dim)`` or a ``Categorical`` with batch ``(B,)``; ``amp``: bf16 forward
        passes (the distribution's parameters are float32)."""
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            if self.image:
                x = self.network(x)  # the features shared by both heads
            out = (self.actor_logits if self.discrete else self.actor_mean)(x)
            value = self.critic(x)
        value = value.float().squeeze(-1)
        if self.discrete:
            return Categorical(logits=out.float(), validate_args=False), value
        mean = out.float()  # validation would sync with the host
        return Normal(mean, torch.exp(self.actor_logstd.expand_as(mean)), validate_args=False), value


def make_agent(args: Args, env) -> Agent:
    """The :class:`Agent` for ``env`` (a :func:`harness.make_env` env), on the CPU."""
    obs_shape, space = tuple(env.obs_shape), env.single_action_space
    act_dim = int(space.n) if env.discrete else int(np.prod(space.shape))
    image = len(obs_shape) == 3
    return Agent(
        int(np.prod(obs_shape)),
        act_dim,
        args.hidden_size,
        args.init_logstd,
        args.norm_obs,
        harness.network_inputs(env, args),
        env.discrete,
        obs_shape if image else None,
        args.cnn_channels,
    )


def deterministic_policy(args: Args, state: dict) -> tuple[nn.Module, object, str | None]:
    """The deterministic policy of a checkpoint's ``state``, with a one-env copy of its env and the action mode it
    acts in: ``(actor, env, action_mode)`` (``python -m algos.harness.export``)."""
    env = harness.make_env(args, 1, torch.device("cpu"), args.action_mode)
    agent = make_agent(args, env)
    agent.load_state_dict(state["agent"])
    return GreedyActor(agent).eval(), env, args.action_mode


class GreedyActor(nn.Module):
    """The deterministic policy of an :class:`Agent` (sharing its modules): raw observations float32 ``(B, *obs_shape)``
    -> the mean action clipped to [-1, 1], float32 ``(B, act_dim)``, or the argmax index, int64 ``(B,)`` in ``0..n-1``.
    The running observation statistics are part of it, frozen."""

    def __init__(self, agent: Agent):
        super().__init__()
        self.discrete, self.obs_norm, self.net = agent.discrete, agent.obs_norm, agent.actor_net()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.net(self.obs_norm(obs))
        return out.argmax(-1) if self.discrete else out.clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------- hot functions
# in the order the loop calls them: rollout (policy_step and the env step, num_steps times), then update (the
# bootstrap value, compute_gae and one gradient step)
def policy_step(agent: Agent, obs: torch.Tensor, amp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold raw ``obs`` float32 ``(B, *obs_shape)`` into the running normaliser, normalise, sample; no host sync.

    Returns:
        ``(obs_normalised, action, value (B,))``; the action float32 ``(B, act_dim)`` unclipped (Box) or the index
        int64 ``(B,)`` in ``0..n-1`` (Discrete).
    """
    with torch.no_grad():
        if isinstance(agent.obs_norm, harness.RunningObsNorm):
            agent.obs_norm.update(obs)
        obs_n = agent.obs_norm(obs)
        dist, value = agent.dist_and_value(obs_n, amp)
        if agent.discrete:
            # Gumbel-max: argmax(logits + Gumbel noise) samples the Categorical without torch.multinomial (whose
            # CUDA kernel checks the probabilities); the uniform draws are kept away from 0
            u = torch.rand_like(dist.logits).clamp_(min=torch.finfo(dist.logits.dtype).tiny)
            return obs_n, (dist.logits - torch.log(-torch.log(u))).argmax(-1), value
        # mean + std * noise, not dist.sample(): torch.normal checks std >= 0 on the host (a sync on CUDA)
        return obs_n, dist.loc + dist.scale * torch.randn_like(dist.loc), value


def act_and_step(policy, env, obs: torch.Tensor):
    """One step of the rollout: ``policy`` (:func:`policy_step`, bound) on the raw ``obs``, then the env's answer.
    Returns ``(obs_normalised, action, value, next_obs, reward, terminated, truncated, final_obs)``. For a
    torch-batched env this is one function of tensors, so ``--compile`` traces policy and env step as one graph."""
    obs_n, action, value = policy(obs)
    next_obs, reward, terminated, truncated, info = env.step(action)
    return obs_n, action, value, next_obs, reward, terminated, truncated, info["final_obs"]


def state_value(agent: Agent, obs: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Values ``(B,)`` of raw observations ``(B, *obs_shape)`` (current statistics, not updated); no gradient."""
    with torch.no_grad():
        return agent.dist_and_value(agent.obs_norm(obs), amp)[1]


def rollout(
    policy,
    env,
    next_obs: torch.Tensor,
    *,
    storage: dict,
    gamma: float,
    bootstrap_truncation: bool,
    value_fn=None,
    step=act_and_step,
) -> torch.Tensor:
    """Collect ``num_steps`` steps of every env into ``storage`` (in place), each ``step(policy, env, obs)``:
    :func:`act_and_step` (for a torch-batched env compiled as one graph with ``--compile``) with ``policy``
    (:func:`policy_step`, bound); returns the raw observation after the last step. No host sync on torch-batched
    envs, so there ``--cudagraphs`` replays the whole rollout as one CUDA graph (:func:`harness.capture`).

    The env gets the raw actions (it clips and rescales Box ones) and returns the rewards to learn from (normalised by
    :class:`envs.vector.NormalizeReward` where wrapped). ``value_fn`` (:func:`state_value` bound to the agent; only
    for an env that gives real final observations, ``has_final_obs``): with ``bootstrap_truncation`` a truncated step
    gets ``gamma * V(final_obs)`` added to its reward and is stored as terminal, as Stable-Baselines3 does; otherwise
    truncations bootstrap from the next stored value (``bootstrap_truncation``) or are terminal.
    """
    from_final = value_fn is not None and bootstrap_truncation
    for t in range(storage["obs"].shape[0]):
        obs_n, action, value, next_obs, reward, terminated, truncated, final_obs = step(policy, env, next_obs)
        storage["obs"][t], storage["actions"][t], storage["values"][t] = obs_n, action, value
        episode_end = terminated | truncated
        cut = truncated & ~terminated
        if from_final and bool(cut.any()):  # gymnasium envs only: their steps sync with the host anyway
            reward = reward + gamma * cut.to(reward.dtype) * value_fn(final_obs).to(reward.dtype)
        storage["terminals"][t] = episode_end if from_final or not bootstrap_truncation else terminated
        storage["rewards"][t] = reward
        storage["dones"][t] = episode_end
    return next_obs


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_value: torch.Tensor,
    terminals: torch.Tensor,
    dones: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A2C's generalised advantage estimation over a rollout, flags per transition; ``gae_lambda=1``: n-step returns.

    Args:
        rewards, values: float32 ``(num_steps, num_envs)``; ``values[t]`` is the value of step ``t``'s observation.
        next_value: float32 ``(num_envs,)``, the value of the observation after the last step.
        terminals: 1 where step ``t``'s transition is terminal (no bootstrap from the next observation).
        dones: 1 where the episode ended at step ``t`` (the trace stops there). Where ``dones`` but not ``terminals``
            (a truncation bootstrapped through), step ``t`` bootstraps from ``gamma * V(s_{t+1})`` and nothing of
            the following episode enters its return (unlike PPO's ``compute_gae``, which runs on).

    Returns:
        ``(advantages, returns)``, float32 ``(num_steps, num_envs)``; ``returns = advantages + values``.
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
    """One A2C update: the bootstrap value of raw ``next_obs`` ``(num_envs, *obs_shape)``, :func:`compute_gae` and one
    gradient step on the whole rollout (the tensors of :func:`make_storage`, observations normalised).

    Returns:
        device scalars ``value_loss``, ``policy_loss``, ``entropy``, ``grad_norm``, ``explained_variance`` and ``bad``,
        bool ``(len(LOSS_NAMES),)``: True where that quantity is non-finite.
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
    logprob, entropy = dist.log_prob(b_actions), dist.entropy()
    if not agent.discrete:  # a Gaussian per action dimension
        logprob, entropy = logprob.sum(1), entropy.sum(1)
    entropy = entropy.mean()
    pg_loss = -(b_adv * logprob).mean()
    v_loss = F.mse_loss(new_value, b_returns)
    loss = pg_loss + vf_coef * v_loss - ent_coef * entropy

    harness.zero_grad(optimizer)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        out = torch.stack([v_loss, pg_loss, entropy, grad_norm]).detach()
        named = dict(zip(LOSS_NAMES, out))
        return {
            **named,
            "explained_variance": harness.explained_variance(values.reshape(-1), b_returns),
            "bad": ~torch.isfinite(out),
        }


# ---------------------------------------------------------------------------------------------- training
def check_spaces(env_id: str, observation_space: gym.Space, action_space: gym.Space) -> None:
    """Check that A2C can drive an env with these spaces: Box or Discrete actions, and a Box observation of 1 or 2
    dims (flattened, MLPs) or 3 dims (an image ``(C, H, W)``, the CNN torso).

    Raises:
        SpaceError: naming ``env_id``, the offending space and the way out.
    """
    if not isinstance(action_space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise SpaceError(
            f"A2C supports Box actions (Gaussian policy) and Discrete actions (Categorical policy), but {env_id} has "
            f"action space {action_space}; wrap the env to expose a Box or a Discrete action space (e.g. flatten a "
            f"MultiDiscrete space into one Discrete space)"
        )
    if not isinstance(observation_space, gym.spaces.Box):
        raise SpaceError(
            f"A2C supports flat Box observations and images (C, H, W) only, but {env_id} has observation space "
            f"{observation_space}; flatten it with a wrapper (e.g. gymnasium.wrappers.FlattenObservation)"
        )
    if len(observation_space.shape) > 3:
        raise SpaceError(
            f"A2C takes flat observations (MLPs) or images (C, H, W) (CNN torso), but {env_id} has observations of "
            f"{len(observation_space.shape)} dims {observation_space}; stack extra axes into the channels, e.g. "
            f"(T, C, H, W) frames as (T * C, H, W) (gymnasium.wrappers.ReshapeObservation), or flatten them "
            f"(gymnasium.wrappers.FlattenObservation)"
        )


def make_optimizer(
    params, name: str, lr: torch.Tensor | float, alpha: float = 0.99, eps: float = 1e-5, capturable: bool = False
) -> torch.optim.Optimizer:
    """``"rmsprop"`` (PyTorch RMSprop with ``alpha``, ``eps``, as SB3/CleanRL A2C) or ``"adam"``; ``lr`` may be a device
    tensor annealed in place (:func:`harness.device_lr`), ``capturable`` keeps the state on the device (CUDA graphs).

    Raises:
        ValueError: unknown ``name``.
    """
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps, capturable=capturable)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps, capturable=capturable)
    raise ValueError(f"unknown optimizer {name!r}: expected 'rmsprop' or 'adam'")


def make_storage(
    num_steps: int,
    num_envs: int,
    obs_dim: int | tuple[int, ...],
    act_dim: int,
    device: torch.device,
    discrete: bool = False,
) -> dict[str, torch.Tensor]:
    """Preallocated rollout storage on ``device``, ``(num_steps, num_envs, ...)``: ``obs`` float32 ``(.., *obs_dim)``
    (``obs_dim`` an int or a shape such as ``(C, H, W)``), ``actions`` float32 ``(.., act_dim)`` or, with ``discrete``,
    int64 ``(num_steps, num_envs)``, and float32 ``rewards``, ``values``, ``terminals`` (step ``t`` does not bootstrap
    from its next observation) and ``dones`` (the episode ended at step ``t``: the return stops there)."""
    shape = (obs_dim,) if isinstance(obs_dim, int) else tuple(obs_dim)
    zeros = functools.partial(torch.zeros, num_steps, num_envs, device=device)
    actions = zeros(dtype=torch.int64) if discrete else zeros(act_dim)
    return {
        "obs": zeros(*shape),
        "actions": actions,
        "rewards": zeros(),
        "values": zeros(),
        "terminals": zeros(),
        "dones": zeros(),
    }


def bind_hot_functions(args: Args, env, agent: Agent, optimizer: torch.optim.Optimizer, storage: dict) -> tuple:
    """The loop's hot functions bound once to the agent, optimizer, env and storage, with the speed switches applied
    (``harness.bind``): ``(rollout, update)``.

    On a torch-batched env the policy and the env step are compiled as one graph and the whole rollout is replayed as
    one CUDA graph; a host env steps between the device calls, so there the policy is compiled or graphed alone, and
    the value of its final observations (at truncations only) stays eager.
    """
    policy = functools.partial(policy_step, agent, amp=args.amp)
    step = act_and_step
    if env.torch_batched:  # policy and env step compiled as one graph
        (step,) = harness.bind(args, graphs=False, act_and_step=step)
    else:  # a host env steps between the device calls
        (policy,) = harness.bind(args, policy_step=policy)
    bound_rollout = functools.partial(
        rollout,
        policy,
        env,
        storage=storage,
        gamma=harness.per_step(args, args.gamma),
        bootstrap_truncation=args.bootstrap_truncation,
        value_fn=functools.partial(state_value, agent, amp=args.amp) if env.has_final_obs else None,
        step=step,
    )
    if env.torch_batched:  # the whole rollout replayed as one CUDA graph
        bound_rollout = harness.capture(args, bound_rollout, "rollout")
    bound_update = functools.partial(
        update,
        agent,
        optimizer,
        gamma=harness.per_step(args, args.gamma),
        gae_lambda=harness.per_step(args, args.gae_lambda),
        vf_coef=args.vf_coef,
        ent_coef=args.ent_coef,
        max_grad_norm=args.max_grad_norm,
        norm_adv=args.norm_adv,
        amp=args.amp,
    )
    return (bound_rollout, *harness.bind(args, update=bound_update))


def train(run: harness.Run, sizes: Sizes, state: dict | None = None) -> dict:
    """Train to ``args.total_timesteps`` at ``sizes``, from the live ``state`` an out-of-memory restart hands over, else
    from ``--resume``'s checkpoint or afresh; then :meth:`harness.Run.finish`. Returns its result with the sizes."""
    args, device = run.args, run.device
    # TRY NOT TO MODIFY: env setup
    env = harness.make_env(args, sizes.num_envs, device, args.action_mode)
    try:
        check_spaces(args.env_id, env.single_observation_space, env.single_action_space)
        if args.norm_reward:  # the discounted return restarts at every episode end, as A2C's returns do
            env = NormalizeReward(env, harness.per_step(args, args.gamma), reset_on_truncation=True)
        obs_shape, discrete, space = tuple(env.obs_shape), env.discrete, env.single_action_space
        act_dim = int(space.n) if discrete else int(np.prod(space.shape))
        storage = make_storage(args.num_steps, sizes.num_envs, obs_shape, act_dim, device, discrete)

        agent = make_agent(args, env).to(device)
        lr = harness.device_lr(args.learning_rate, device)
        optimizer = make_optimizer(
            agent.parameters(),
            args.optimizer,
            lr,
            args.rmsprop_alpha,
            args.optimizer_eps,
            capturable=device.type == "cuda",
        )
        # TRY NOT TO MODIFY: start the game (or take it up where the checkpoint or the out-of-memory restart left it)
        loaded = run.restore(state, {"agent": agent}, {"optimizer": optimizer}, env, {"optimizer": lr})
        if loaded is not None and loaded["env_restored"]:
            next_obs = loaded["next_obs"].to(device)
        else:  # new episodes, seeded apart from the first session's
            next_obs, _ = env.reset(seed=args.seed + run.global_step)

        # the steps left, in batches of this session's size; the learning rate anneals to 0 at the last of them
        left = (args.total_timesteps - run.global_step) // sizes.batch_size
        num_iterations = run.iteration + max(int(run.global_step == 0), left)
        end_step = run.global_step + (num_iterations - run.iteration) * sizes.batch_size

        rollout, update = bind_hot_functions(args, env, agent, optimizer, storage)
        actor, guard = GreedyActor(agent), run.new_guard()
        net = f"CNN {args.cnn_channels[0]}-{args.cnn_channels[1]}" if len(obs_shape) == 3 else "MLP"
        run.announce(
            f"obs {obs_shape} ({net}), {sizes.num_envs} envs x {args.num_steps} steps, {num_iterations} "
            f"updates, {run.steps_to_train(num_iterations, sizes.batch_size)}",
            env,
            dataclasses.asdict(sizes),
        )

        def checkpoint_state() -> dict:
            return {
                "agent": agent.state_dict(),
                "optimizer": optimizer.state_dict(),
                "env": env.state_dict(),
                "next_obs": next_obs,
                **dataclasses.asdict(sizes),
                "sizes": dataclasses.asdict(sizes),
            }

        for iteration in run.iterations(num_iterations):
            if args.anneal_lr:
                lr.fill_((1.0 - run.global_step / end_step) * args.learning_rate)
            try:
                next_obs = rollout(next_obs)
                out = update(
                    storage["obs"],
                    storage["actions"],
                    storage["rewards"],
                    storage["values"],
                    storage["terminals"],
                    storage["dones"],
                    next_obs,
                )
            except RuntimeError as exc:  # TRY NOT TO MODIFY: CUDA out of memory: restart smaller from the live state
                run.out_of_memory(exc, f"at global_step {run.global_step} (iteration {iteration})", checkpoint_state)
            run.global_step += sizes.batch_size
            run.flag(guard, out["bad"])

            # TRY NOT TO MODIFY: record rewards and losses for plotting purposes (one host read)
            if run.logging_now():
                scalars = {f"losses/{k}": out[k] for k in (*LOSS_NAMES, "explained_variance")}
                run.log(env, guard, {**scalars, "charts/learning_rate": lr}, num_envs=sizes.num_envs)
            run.eval_during_training(actor, args.action_mode)
            if run.every(args.checkpoint_every):
                run.check_finite(guard)
                run.save(checkpoint_state())
        return run.finish(checkpoint_state(), actor, env, args.action_mode, **dataclasses.asdict(sizes))
    finally:
        env.close()  # an async env's workers; the envs are not stepped after training


def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        :meth:`harness.Run.finish`'s result (``global_step``, ``train_wall_s``, ``sps``, ``sps_steady``, ``policy``,
        ``vector_mode``, for EVHub-v0 ``eval``) with ``num_envs`` and ``batch_size``, the sizes at the end.

    Raises:
        ValueError: a size below 1, or ``--cudagraphs`` without CUDA.
        NonFiniteLossError: a loss became NaN or infinite; the last good checkpoint is kept.
        OutOfMemoryBackoffError: CUDA ran out of memory once more after ``max_oom_retries`` halvings of num_envs.
        CheckpointError: ``--resume`` from a checkpoint that cannot be used.
    """
    if min(args.num_envs, args.num_steps, args.log_every) < 1:
        raise ValueError("num_envs, num_steps and log_every must be >= 1")
    # TRY NOT TO MODIFY: seeding, device, run folder and writer
    run = harness.Run("a2c", args, LOSS_NAMES, PRESETS, ENV_DEFAULTS)
    try:
        return harness.train_with_oom_restarts(
            train,
            run,
            Sizes(args.num_envs, args.num_envs * args.num_steps),
            lambda sizes, in_update: halve_num_envs(sizes),  # wherever it struck
        )
    finally:
        run.close()


# ---------------------------------------------------------------------------------------------- out-of-memory back-off
@dataclass(frozen=True)
class Sizes:
    """What an out-of-memory back-off shrinks (``Args`` never changes): the envs and the batch of one update."""

    num_envs: int
    batch_size: int
    """``num_envs * num_steps`` env steps per iteration and update"""

    def __str__(self) -> str:
        return f"num_envs {self.num_envs} (batch {self.batch_size})"


def halve_num_envs(sizes: Sizes) -> tuple[Sizes, str]:
    """A2C's out-of-memory rule, wherever the error struck: half the envs, so half the batch.

    Raises:
        ValueError: one env left.
    """
    if sizes.num_envs < 2:
        raise ValueError(f"num_envs {sizes.num_envs} cannot be halved")
    new = Sizes(sizes.num_envs // 2, sizes.batch_size // sizes.num_envs * (sizes.num_envs // 2))
    return new, f"num_envs {sizes.num_envs} -> {new.num_envs} (batch {sizes.batch_size} -> {new.batch_size})"


if __name__ == "__main__":
    harness.script(main, Args, PRESETS, ENV_DEFAULTS, description=__doc__.split("\n\n")[0])
