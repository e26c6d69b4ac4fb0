"""PPO (Schulman et al. 2017) for ``EVHub-v0`` or any gymnasium env, CleanRL style: one file, the algorithm only.

Box actions get a Gaussian policy with a state-independent log-std, Discrete ones a Categorical policy; flat
observations go to separate actor and critic MLPs (two tanh layers, inputs standardised by running statistics),
images ``(C, H, W)`` to one CNN torso shared by both heads (CleanRL's ``ppo_atari.py``). The whole rollout stays on
the device: the torch-batched env steps ``num_envs`` copies, storage is preallocated, and the host reads numbers only
once per ``log_every`` iterations.

The hot functions are plain module-level functions bound to the agent once: :func:`policy_step` (normalise and act),
:func:`estimate_advantages` (bootstrap value + GAE) and :func:`update_minibatch` (clipped surrogate loss and one
gradient step); ``--compile`` and ``--cudagraphs`` rebind them (``harness.bind``), ``--amp`` runs the forward passes
under bf16 autocast. No host sync inside the loop, except ``--target-kl``'s early stop (one read per epoch).

Run::

    python algos/ppo.py                                  # caltech site, hub actions, a preset sized to the device
    python algos/ppo.py --site path/to/site.toml --total-timesteps 200000 --seed 2
    python algos/ppo.py --preset gpu --compile --cudagraphs
    python algos/ppo.py --env-id CartPole-v1 --num-envs 8 --num-steps 128 --total-timesteps 100000
    python algos/ppo.py --env-id Snake-v0
    tensorboard --logdir outputs/

Writes into the run folder: TensorBoard events, ``metrics.parquet``, ``checkpoint.pt`` (``--resume`` continues from
it), ``policy.pt2`` (the deterministic policy, actions in the env's units; ``policy.json`` beside it for EVHub-v0) and,
for EVHub-v0, the deterministic evaluation on ``eval_split``. What is not PPO (vector envs, logging, checkpoints,
export, speed switches, out-of-memory back-off) is ``algos/harness/`` and ``envs/vector.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

try:
    from algos import harness
except ModuleNotFoundError:  # run as `python algos/ppo.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from algos import harness
from envs.vector import NormalizeReward, SpaceError

PRESETS = {
    # 2 CPU cores: ~100 envs, a small net, one torch thread; about 2 minutes on the caltech site, evaluation included
    "cpu": {"num_envs": 128, "num_steps": 168, "total_timesteps": 4_000_000, "hidden_size": 64, "num_threads": 1},
    # one GPU: thousands of envs, a wider net; a log (one host read, a metrics.parquet write) every 10 iterations, not
    # every one: each log stalls the GPU for the host's work
    "gpu": {"num_envs": 2048, "num_steps": 168, "total_timesteps": 50_000_000, "hidden_size": 256, "num_threads": 0,
            "log_every": 10},
}  # fmt: skip
"""Args values per size preset, applied before the command line is read (which overrides any of them)."""

ENV_DEFAULTS = {
    # Snake: rewards of +1 (food) / -1 (death), boards (3, 10, 10) in [0, 1]. The return normaliser hurt here (greedy
    # score 0.76 vs 1.41 foods per episode after 500k steps at a learning rate of 2.5e-4); the learning rate stays at
    # 1e-3 (17.8 foods after 500k steps; 2.5e-4, CleanRL's Atari value, learned far slower)
    "Snake-v0": {"gamma": 0.99, "ent_coef": 0.01, "norm_obs": False, "norm_reward": False, "cnn_channels": (16, 32),
                 "num_minibatches": 4, "update_epochs": 4},
    # about 3 minutes on a free CPU core (2,700 steps/s), a greedy score of ~18 foods
    "Snake-v0/cpu": {"num_envs": 16, "num_steps": 128, "total_timesteps": 500_000, "hidden_size": 128},
    "Snake-v0/gpu": {"num_envs": 256, "num_steps": 128, "total_timesteps": 10_000_000, "hidden_size": 512,
                     "cnn_channels": (32, 64)},
}  # fmt: skip
"""Args values of an env (a ``module:`` prefix dropped), and of an env on one preset (``"<env_id>/<preset>"``), applied
after :data:`PRESETS`; the command line wins over both."""

LOSS_NAMES = ("value_loss", "policy_loss", "entropy", "grad_norm")
"""Quantities checked for finiteness after each update, in the order of the update's ``bad`` flags."""


@dataclass
class Args(harness.RunArgs):
    # RunArgs' exp_name, log_every and checkpoint_every (documented there) with this script's defaults
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    log_every: int = 1
    checkpoint_every: int = 25
    action_mode: str = "hub"
    """'hub' (BESS setpoint + total EV level) or 'socket' (BESS + one level per socket); EVHub-v0 only"""
    total_timesteps: int = 4_000_000
    """total env steps of the experiment"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    num_envs: int = 128
    """the number of parallel env copies"""
    num_steps: int = 168
    """the number of steps per env in each rollout (168 = one week of hourly steps, one EVHub-v0 episode)"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear to zero over the run)"""
    gamma: float = 0.98
    """the discount factor gamma, per hour of site time on EVHub-v0 (0.98: a horizon of about two days), per step on
    other envs"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation, per hour of site time on EVHub-v0 as gamma"""
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
    """the target KL divergence threshold (early stop of the epochs; one host sync per epoch, not with --cudagraphs)"""
    hidden_size: int = 64
    """width of the two hidden layers of actor and critic, or of the CNN torso's linear layer for images"""
    cnn_channels: tuple[int, int] = (32, 64)
    """output channels (C1 C2) of the two 3x3 convolutions of the CNN torso (image observations only)"""
    init_logstd: float = -0.5
    """initial log standard deviation of the Gaussian policy (state-independent, learned); Box actions only"""
    norm_obs: bool = True
    """standardise observations with running statistics kept in the agent (CleanRL's NormalizeObservation; per pixel
    for images)"""
    norm_reward: bool = True
    """scale rewards by a running std of the discounted return (CleanRL's NormalizeReward, on the device)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal: EVHub-v0 (the site never terminates) bootstraps through the
    autoreset into the next window, a gymnasium env adds gamma * V(final_obs) to the truncated step's reward; False
    treats it as terminal like CleanRL"""


# ---------------------------------------------------------------------------------------------- agent
class Agent(nn.Module):
    """Actor and critic: the torso of the observations and the policy head of the action space.

    Flat observations ``(B, obs_dim)``: separate actor and critic MLPs, each two tanh layers of ``hidden`` units over
    the ``inputs`` features (``network`` is the identity). Images ``(B, C, H, W)``: one :func:`harness.cnn_torso`
    ``network`` shared by a linear policy head and a linear value head. Box actions: a Gaussian with mean
    ``actor_mean`` and a state-independent ``actor_logstd``; Discrete: a Categorical over the logits of ``actor``.
    Heads end in orthogonal init of gain 0.01 (policy) and 1 (value), other layers sqrt(2). ``obs_norm`` (running
    standardisation or identity) maps raw observations to the network inputs; the rollout stores normalised ones.
    """

    def __init__(self, obs_shape: tuple[int, ...], act_dim: int, discrete: bool, args: Args, inputs: list[int] | None):
        super().__init__()
        self.act_dim = act_dim
        self.discrete, self.image = bool(discrete), len(obs_shape) == 3
        hidden, init = args.hidden_size, harness.layer_init
        self.obs_norm = harness.RunningObsNorm(obs_shape) if args.norm_obs else nn.Identity()
        if self.image:
            self.network = harness.cnn_torso(obs_shape, args.cnn_channels, hidden)
            actor = init(nn.Linear(hidden, act_dim), std=0.01)
            self.critic = init(nn.Linear(hidden, 1), std=1.0)
        else:
            n_in = obs_shape[0] if inputs is None else len(inputs)

            def mlp(n_out: int, std: float) -> nn.Sequential:
                return nn.Sequential(
                    harness.select(inputs, obs_shape[0]),
                    init(nn.Linear(n_in, hidden)),
                    nn.Tanh(),
                    init(nn.Linear(hidden, hidden)),
                    nn.Tanh(),
                    init(nn.Linear(hidden, n_out), std=std),
                )

            self.network = nn.Identity()
            self.critic = mlp(1, 1.0)
            actor = mlp(act_dim, 0.01)
        if self.discrete:
            self.actor = actor  # logits of the Categorical
        else:
            self.actor_mean = actor
            self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(args.init_logstd)))

    @property
    def policy_head(self) -> nn.Module:
        """Normalised observations -> logits (Discrete) or Gaussian mean (Box), through the shared torso for images."""
        head = self.actor if self.discrete else self.actor_mean
        return nn.Sequential(self.network, head) if self.image else head

    def get_value(self, x: torch.Tensor, amp: bool = False) -> torch.Tensor:
        """Value float32 ``(B,)`` at normalised observations ``x``; ``amp``: bf16 forward."""
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            value = self.critic(self.network(x))
        return value.float().squeeze(-1)

    def dist_and_value(self, x: torch.Tensor, amp: bool = False) -> tuple[Normal | Categorical, torch.Tensor]:
        """Policy distribution (a ``Normal`` of batch shape ``(B, act_dim)`` or a ``Categorical`` of ``(B,)``, neither
        validating its arguments: that would sync) and value float32 ``(B,)`` at normalised observations ``x``."""
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=amp):
            hidden = self.network(x)
            head = (self.actor if self.discrete else self.actor_mean)(hidden)
            value = self.critic(hidden)
        if self.discrete:
            return Categorical(logits=head.float(), validate_args=False), value.float().squeeze(-1)
        mean = head.float()
        return Normal(mean, torch.exp(self.actor_logstd.expand_as(mean)), validate_args=False), value.float().squeeze(
            -1
        )


class DeterministicActor(nn.Module):
    """The deterministic policy: raw observations -> the mean action clipped to [-1, 1] float32 ``(B, act_dim)`` (Box)
    or the argmax action int64 ``(B,)`` (Discrete); the observation normaliser's statistics are frozen in it."""

    def __init__(self, agent: Agent):
        super().__init__()
        self.discrete, self.obs_norm, self.head = agent.discrete, agent.obs_norm, agent.policy_head

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.head(self.obs_norm(obs))
        return out.argmax(-1) if self.discrete else out.clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------- hot functions
# in the order the loop calls them: rollout (policy_step and the env step, num_steps times), estimate_advantages
# (the bootstrap value and compute_gae), update (update_minibatch on each minibatch of each epoch)
def policy_step(agent: Agent, obs: torch.Tensor, amp: bool = False):
    """Fold raw ``obs`` float32 ``(B, *obs_shape)`` into the running normaliser, normalise and sample; no host sync.

    Returns ``(obs_normalised, action, logprob (B,), value (B,))``: the action float32 ``(B, act_dim)`` unclipped (the
    env clips it) for a Box, int64 ``(B,)`` for a Discrete.
    """
    with torch.no_grad():
        if isinstance(agent.obs_norm, harness.RunningObsNorm):
            agent.obs_norm.update(obs)
        obs_n = agent.obs_norm(obs)
        dist, value = agent.dist_and_value(obs_n, amp)
        if agent.discrete:
            # Categorical.sample()'s Gumbel-max draw without its host-side check of the probabilities (a sync)
            probs = dist.probs
            action = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
            return obs_n, action, dist.log_prob(action), value
        # mean + std * noise: dist.sample() checks std >= 0 on the host (a sync); both draw the same numbers
        action = dist.loc + dist.scale * torch.randn_like(dist.loc)
        return obs_n, action, dist.log_prob(action).sum(1), value


def act_and_step(policy, env, obs: torch.Tensor):
    """One step of the rollout: ``policy`` (:func:`policy_step`, bound) on the raw ``obs``, then the env's answer.
    Returns ``(obs_normalised, action, logprob, value, next_obs, reward, terminated, truncated, final_obs)``. For a
    torch-batched env this is one function of tensors, so ``--compile`` traces policy and env as one graph."""
    obs_n, action, logprob, value = policy(obs)
    next_obs, reward, terminated, truncated, info = env.step(action)
    return obs_n, action, logprob, value, next_obs, reward, terminated, truncated, info["final_obs"]


def bootstrap_value(agent: Agent, obs: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Value float32 ``(B,)`` of raw observations (the ``final_obs`` of truncated episodes); no host sync."""
    with torch.no_grad():
        return agent.get_value(agent.obs_norm(obs), amp)


def rollout(
    policy,
    env,
    next_obs,
    next_done,
    *,
    storage: dict,
    gamma: float,
    bootstrap_truncation: bool,
    final_value=None,
    step=act_and_step,
):
    """Collect ``num_steps`` steps of every env into ``storage`` (in place), each ``step(policy, env, obs)``:
    :func:`act_and_step` (for a torch-batched env compiled as one graph with ``--compile``) with ``policy``
    (:func:`policy_step`, bound). No host sync beyond what a host env's step needs, so for a torch-batched env
    ``--cudagraphs`` replays the whole rollout as one CUDA graph.

    ``final_value`` (:func:`bootstrap_value`, bound; for an env with ``has_final_obs`` and ``bootstrap_truncation``):
    every episode end is a done, and a step that truncates without terminating gets ``gamma * V(final_obs)`` added to
    its (normalised) reward. Without it, ``bootstrap_truncation`` makes only ``terminated`` a done (EVHub-v0
    bootstraps through the autoreset into the next window). Returns ``(next_obs, next_done)`` after the last step.
    """
    cut_is_done = final_value is not None or not bootstrap_truncation
    for t in range(storage["obs"].shape[0]):
        storage["dones"][t] = next_done
        obs_n, action, logprob, value, next_obs, reward, terminated, truncated, final_obs = step(policy, env, next_obs)
        storage["obs"][t] = obs_n
        storage["values"][t] = value
        storage["actions"][t] = action
        storage["logprobs"][t] = logprob
        next_done = (terminated | truncated if cut_is_done else terminated).to(torch.float32)
        if final_value is not None:  # a time limit is not terminal: bootstrap from the episode's last observation
            cut = (truncated & ~terminated).to(torch.float32)
            reward = reward + gamma * cut * final_value(final_obs)
        storage["rewards"][t] = reward
    return next_obs, next_done


def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, gae_lambda: float):
    """Generalised advantage estimation (Schulman et al. 2016) over a rollout, CleanRL's recursion; no host sync.

    Args:
        rewards, values, dones: float32 ``(num_steps, num_envs)``; ``dones[t]`` is 1 where the observation of step
            ``t`` began a new episode after a terminal step (so step ``t-1`` does not bootstrap from it).
        next_value, next_done: float32 ``(num_envs,)`` of the observation after the last step.

    Returns:
        ``(advantages, returns)``, float32 ``(num_steps, num_envs)``; ``returns = advantages + values``.
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def estimate_advantages(
    agent: Agent, next_obs, next_done, rewards, values, dones, *, gamma: float, gae_lambda: float, amp: bool = False
):
    """Bootstrap value of the raw ``next_obs``, then :func:`compute_gae`: ``(advantages, returns)``, float32
    ``(num_steps, num_envs)``; no host sync."""
    with torch.no_grad():
        next_value = agent.get_value(agent.obs_norm(next_obs), amp)
        return compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda)


def update_minibatch(
    agent: Agent,
    optimizer,
    obs,
    actions,
    logprobs,
    advantages,
    returns,
    values,
    *,
    clip_coef: float,
    norm_adv: bool,
    clip_vloss: bool,
    ent_coef: float,
    vf_coef: float,
    max_grad_norm: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """PPO's clipped-surrogate loss and one gradient step on one minibatch of ``M`` rows; no host sync.

    ``obs`` normalised float32 ``(M, *obs_shape)``; ``actions`` float32 ``(M, act_dim)`` or int64 ``(M,)``; the rest
    float32 ``(M,)``. Returns device scalars ``value_loss, policy_loss, entropy, old_approx_kl, approx_kl, clipfrac``
    and ``bad``, bool ``(len(LOSS_NAMES),)``: True where that quantity is non-finite.
    """
    dist, newvalue = agent.dist_and_value(obs, amp)
    if agent.discrete:
        newlogprob, entropy = dist.log_prob(actions), dist.entropy()
    else:
        newlogprob, entropy = dist.log_prob(actions).sum(1), dist.entropy().sum(1)
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

    harness.zero_grad(optimizer)
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
    update_minibatch,
    b_obs,
    b_actions,
    b_logprobs,
    b_advantages,
    b_returns,
    b_values,
    *,
    update_epochs: int,
    minibatch_size: int,
    target_kl: float | None = None,
) -> dict[str, torch.Tensor]:
    """``update_epochs`` epochs over the flattened batch of ``B`` rows, one ``update_minibatch`` step
    (:func:`update_minibatch`, bound, compiled or graphed) per minibatch of a device-side permutation (the last one
    shorter when the size does not divide ``B``). No host sync unless ``target_kl`` is set (one read per epoch).

    Returns device tensors: the last minibatch's losses and KL estimates, ``clipfrac`` (mean over the minibatches),
    the batch's ``explained_variance`` and ``bad`` (True where a quantity was non-finite in some minibatch).
    """
    device, batch_size = b_obs.device, b_obs.shape[0]
    clipfrac_sum = torch.zeros((), device=device)
    bad = torch.zeros(len(LOSS_NAMES), dtype=torch.bool, device=device)
    n_mb = 0
    for _epoch in range(update_epochs):
        perm = torch.randperm(batch_size, device=device)
        for start in range(0, batch_size, minibatch_size):
            mb = perm[start : start + minibatch_size]
            out = update_minibatch(
                b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb], b_values[mb]
            )
            clipfrac_sum += out["clipfrac"]
            bad |= out["bad"]
            n_mb += 1
        if target_kl is not None and out["approx_kl"] > target_kl:  # host sync, only when asked for
            break
    # copies: under --cudagraphs the outputs are the graph's static buffers, overwritten by the next replay
    last = {k: out[k].clone() for k in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl")}
    with torch.no_grad():
        explained_var = harness.explained_variance(b_values, b_returns)
    return {**last, "clipfrac": clipfrac_sum / max(n_mb, 1), "explained_variance": explained_var, "bad": bad}


# ---------------------------------------------------------------------------------------------- training
def check_spaces(env_id: str, obs_space: gym.Space, act_space: gym.Space) -> None:
    """Raise SpaceError unless PPO can drive these single-env spaces: a Box or Discrete action space, a Box
    observation space of at most 3 dimensions (flat ones go to the MLP, images ``(C, H, W)`` to the CNN torso)."""
    if not isinstance(act_space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise SpaceError(
            f"PPO supports a Box (Gaussian policy) or a Discrete (Categorical policy) action space, but "
            f"{env_id} has {act_space}; algos/sac.py (Box) and algos/dqn.py (Discrete) take no other kind "
            f"either: wrap the env to expose a single Box or Discrete action space"
        )
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) > 3:
        raise SpaceError(
            f"PPO takes flat Box observations (an MLP) or images (C, H, W) (a CNN torso), but {env_id} "
            f"has {obs_space}; wrap the env to give (C, H, W) images or flat vectors"
        )


def make_agent(args: Args, env) -> Agent:
    """The :class:`Agent` for ``env`` (a :func:`harness.make_env` env), on the CPU; its ``act_dim`` is the number of
    actions (Discrete) or the action's size (Box)."""
    space = env.single_action_space
    act_dim = int(space.n) if env.discrete else int(np.prod(space.shape))
    return Agent(tuple(env.obs_shape), act_dim, env.discrete, args, harness.network_inputs(env, args))


def deterministic_policy(args: Args, state: dict) -> tuple[nn.Module, object, str | None]:
    """The deterministic policy of a checkpoint's ``state``, with a one-env copy of its env and the action mode it
    acts in: ``(actor, env, action_mode)`` (``python -m algos.harness.export``)."""
    env = harness.make_env(args, 1, torch.device("cpu"), action_mode=args.action_mode)
    agent = make_agent(args, env)
    agent.load_state_dict(state["agent"])
    return DeterministicActor(agent).eval(), env, args.action_mode


def make_storage(sizes: Sizes, obs_shape: tuple[int, ...], act_dim: int, discrete: bool, device: torch.device) -> dict:
    """Preallocated rollout storage, ``(num_steps, num_envs, ...)`` float32 tensors (int64 actions for a Discrete)."""
    z = lambda *s: torch.zeros(sizes.num_steps, sizes.num_envs, *s, device=device)  # noqa: E731
    actions = torch.zeros(sizes.num_steps, sizes.num_envs, dtype=torch.int64, device=device) if discrete else z(act_dim)
    return {"obs": z(*obs_shape), "actions": actions, "logprobs": z(), "rewards": z(), "dones": z(), "values": z()}


def bind_hot_functions(args: Args, env, agent: Agent, optimizer: torch.optim.Optimizer, storage: dict) -> tuple:
    """The loop's hot functions bound once to the agent, optimizer, env and storage, with the speed switches applied
    (``harness.bind``): ``(rollout, estimate_advantages, update_minibatch)``.

    On a torch-batched env the policy and the env step are compiled as one graph and the whole rollout is replayed as
    one CUDA graph; a host env steps between the device calls, so there the policy (and the value of the final
    observations) is compiled or graphed alone.
    """
    policy = functools.partial(policy_step, agent, amp=args.amp)
    final_value = None
    if env.has_final_obs and args.bootstrap_truncation:
        final_value = functools.partial(bootstrap_value, agent, amp=args.amp)
    step = act_and_step
    if env.torch_batched:  # policy and env step compiled as one graph
        (step,) = harness.bind(args, graphs=False, act_and_step=step)
    else:  # a host env steps between the device calls
        policy, final_value = harness.bind(args, policy_step=policy, bootstrap_value=final_value)
    bound_rollout = functools.partial(
        rollout,
        policy,
        env,
        storage=storage,
        gamma=harness.per_step(args, args.gamma),
        bootstrap_truncation=args.bootstrap_truncation,
        final_value=final_value,
        step=step,
    )
    if env.torch_batched:  # the whole rollout replayed as one CUDA graph
        bound_rollout = harness.capture(args, bound_rollout, "rollout")
    # GAE's loop over num_steps (a week) unrolled: compiling it took 48 s of PPO's 107 s of compilation at the CPU
    # preset and saves little (docs/benchmarks.md); it stays eager, replayed inside a CUDA graph with --cudagraphs
    (advantages,) = harness.bind(
        args,
        compile=False,
        estimate_advantages=functools.partial(
            estimate_advantages,
            agent,
            gamma=harness.per_step(args, args.gamma),
            gae_lambda=harness.per_step(args, args.gae_lambda),
            amp=args.amp,
        ),
    )
    (minibatch_step,) = harness.bind(
        args,
        update_minibatch=functools.partial(
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
        ),
    )
    return bound_rollout, advantages, minibatch_step


def train(run: harness.Run, sizes: Sizes, state: dict | None = None) -> dict:
    """Train at ``sizes`` from ``state`` (the live state after an out-of-memory error) or the checkpoint
    (``--resume``) or afresh; see :func:`main`."""
    args, device = run.args, run.device
    # TRY NOT TO MODIFY: env setup
    env = harness.make_env(args, sizes.num_envs, device, action_mode=args.action_mode)
    check_spaces(args.env_id, env.single_observation_space, env.single_action_space)
    if args.norm_reward:
        env = NormalizeReward(
            env,
            harness.per_step(args, args.gamma),
            reset_on_truncation=env.has_final_obs or not args.bootstrap_truncation,
        )
    obs_shape, discrete = tuple(env.obs_shape), env.discrete
    agent = make_agent(args, env).to(device)
    act_dim = agent.act_dim
    storage = make_storage(sizes, obs_shape, act_dim, discrete, device)
    lr = harness.device_lr(args.learning_rate, device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, capturable=device.type == "cuda")

    # TRY NOT TO MODIFY: start the game, or resume it
    next_obs, _ = env.reset(seed=args.seed)
    next_done = torch.zeros(sizes.num_envs, device=device)
    loaded = run.restore(state, {"agent": agent}, {"optimizer": optimizer}, env, lrs={"optimizer": lr})
    if loaded is not None and loaded["env_restored"]:
        next_obs, next_done = loaded["next_obs"].to(device), loaded["next_done"].to(device)
    elif loaded is not None:
        next_obs, _ = env.reset(seed=args.seed + run.global_step)
    steps_left = max(0, args.total_timesteps - run.global_step) // sizes.batch_size
    num_iterations = run.iteration + (steps_left if loaded is not None else max(1, steps_left))
    end_step = run.global_step + (num_iterations - run.iteration) * sizes.batch_size  # the LR anneals to 0 there

    rollout, estimate_advantages, update_minibatch = bind_hot_functions(args, env, agent, optimizer, storage)

    def live_state() -> dict:
        return {
            "agent": agent.state_dict(),
            "optimizer": optimizer.state_dict(),
            "env": env.state_dict(),
            "num_envs": sizes.num_envs,
            "sizes": dataclasses.asdict(sizes),
            "next_obs": next_obs,
            "next_done": next_done,
        }

    policy = DeterministicActor(agent)  # shares the agent's weights
    torso = f"CNN {args.cnn_channels[0]}-{args.cnn_channels[1]} channels" if agent.image else "MLP"
    run.announce(
        f"obs {obs_shape} ({torso}) {'Categorical' if discrete else 'Gaussian'} policy, {sizes.num_envs} envs "
        f"x {sizes.num_steps} steps, {num_iterations} iterations, "
        f"{run.steps_to_train(num_iterations, sizes.batch_size)}",
        env,
        dataclasses.asdict(sizes),
    )
    guard = run.new_guard()
    for iteration in run.iterations(num_iterations):
        if args.anneal_lr:
            lr.fill_((1.0 - run.global_step / end_step) * args.learning_rate)
        try:
            next_obs, next_done = rollout(next_obs, next_done)
            advantages, returns = estimate_advantages(
                next_obs, next_done, storage["rewards"], storage["values"], storage["dones"]
            )
            out = update(
                update_minibatch,
                storage["obs"].reshape(-1, *obs_shape),
                storage["actions"].reshape(-1) if discrete else storage["actions"].reshape(-1, act_dim),
                storage["logprobs"].reshape(-1),
                advantages.reshape(-1),
                returns.reshape(-1),
                storage["values"].reshape(-1),
                update_epochs=args.update_epochs,
                minibatch_size=sizes.minibatch_size,
                target_kl=args.target_kl,
            )
        except RuntimeError as exc:
            run.out_of_memory(exc, f"at global_step {run.global_step} (iteration {iteration})", live_state)
        run.global_step += sizes.batch_size
        run.flag(guard, out.pop("bad"))

        # TRY NOT TO MODIFY: record losses and episode statistics for plotting
        if run.logging_now():
            run.log(
                env,
                guard,
                {**{f"losses/{k}": v for k, v in out.items()}, "charts/learning_rate": lr},
                num_envs=sizes.num_envs,
            )
        run.eval_during_training(policy, args.action_mode)
        if run.every(args.checkpoint_every):
            run.check_finite(guard)
            run.save(live_state())
    run.check_finite(guard)
    return run.finish(live_state(), policy, env, num_envs=sizes.num_envs, batch_size=sizes.batch_size)


def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        ``{"global_step", "train_wall_s", "sps", "sps_steady", "policy", "vector_mode", "num_envs", "batch_size"}``
        (the sizes trained with at the end: smaller than asked for after out-of-memory back-offs) and, for EVHub-v0
        unless ``eval_split`` is ``"none"``, ``"eval"``: the one-row KPI DataFrame.

    Raises:
        ValueError: spaces PPO cannot drive, or bad sizes (:func:`check_args`).
        NonFiniteLossError: a loss became NaN or infinite. CheckpointError: ``--resume`` from an unusable checkpoint.
        OutOfMemoryBackoffError: CUDA ran out of memory once more after ``max_oom_retries`` halvings of num_envs.
    """
    sizes = check_args(args)
    run = harness.Run("ppo", args, LOSS_NAMES, PRESETS, ENV_DEFAULTS)
    try:
        return harness.train_with_oom_restarts(
            train,
            run,
            sizes,
            lambda sizes, in_update: halve_num_envs(sizes, args.cudagraphs),  # wherever it struck
        )
    finally:
        run.close()


# ---------------------------------------------------------------------------------------------- out-of-memory back-off
@dataclass(frozen=True)
class Sizes:
    """The sizes of the run, which an out-of-memory back-off changes (``Args`` never does)."""

    num_envs: int
    num_steps: int
    num_minibatches: int

    @property
    def batch_size(self) -> int:
        """Env steps per iteration: ``num_envs * num_steps``."""
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        """Rows per minibatch: ``batch_size // num_minibatches``."""
        return self.batch_size // self.num_minibatches

    def __str__(self) -> str:
        return f"num_envs {self.num_envs} (batch {self.batch_size}, minibatch {self.minibatch_size})"


def check_args(args: Args) -> Sizes:
    """The run's :class:`Sizes`, after checking the arguments.

    Raises:
        ValueError: a size below 1 or bad ``--cnn-channels``; more minibatches than rows; ``--cudagraphs`` with
            ``--target-kl`` (its early stop reads the device) or with unequal minibatches.
    """
    sizes = Sizes(args.num_envs, args.num_steps, args.num_minibatches)
    if len(args.cnn_channels) != 2 or min(args.cnn_channels) < 1:
        raise ValueError(f"--cnn-channels takes two positive channel counts (C1 C2), got {args.cnn_channels}")
    if min(args.num_envs, args.num_steps, args.log_every) < 1:
        raise ValueError("num_envs, num_steps and log_every must be >= 1")
    if sizes.minibatch_size < 1:
        raise ValueError(f"num_minibatches={args.num_minibatches} exceeds the batch size {sizes.batch_size}")
    if args.cudagraphs and args.target_kl is not None:
        raise ValueError(
            "--cudagraphs cannot be combined with --target-kl: its early stop reads approx_kl on the host "
            "after every epoch; drop one of the two"
        )
    if args.cudagraphs and sizes.batch_size % args.num_minibatches:
        raise ValueError(
            f"--cudagraphs needs equal minibatches: the batch size {sizes.batch_size} (num_envs * "
            f"num_steps) must be a multiple of num_minibatches={args.num_minibatches}"
        )
    return sizes


def halve_num_envs(sizes: Sizes, cudagraphs: bool = False) -> tuple[Sizes, str]:
    """PPO's out-of-memory rule, wherever the error struck: half the envs, so the batch and each of the
    ``num_minibatches`` minibatches halve.

    Raises:
        ValueError: nothing left to halve (one env, or fewer rows than minibatches), or, under ``--cudagraphs``, a
            batch that would not split into equal minibatches.
    """
    new = dataclasses.replace(sizes, num_envs=sizes.num_envs // 2)
    if new.num_envs < 1 or new.batch_size < sizes.num_minibatches:
        raise ValueError(f"num_envs {sizes.num_envs} cannot be halved (num_minibatches={sizes.num_minibatches})")
    if cudagraphs and new.batch_size % sizes.num_minibatches:
        raise ValueError(
            f"--cudagraphs needs equal minibatches and {new.num_envs} envs x {sizes.num_steps} steps do "
            f"not split into num_minibatches={sizes.num_minibatches}"
        )
    return (
        new,
        f"num_envs {sizes.num_envs} -> {new.num_envs} (batch {sizes.batch_size} -> {new.batch_size}, "
        f"minibatch {sizes.minibatch_size} -> {new.minibatch_size})",
    )


if __name__ == "__main__":
    harness.script(main, Args, PRESETS, ENV_DEFAULTS, description=__doc__)
