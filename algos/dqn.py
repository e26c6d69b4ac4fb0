"""DQN for ``EVHub-v0``'s discrete actions and any gymnasium env with a ``Discrete`` action space, CleanRL style:
env, agent and replay buffer on one device; what is not the algorithm comes from ``algos/harness/``.

The agent picks one of the 15 rows of :func:`envs.evhub.discrete_action_table` (BESS levels x EV levels of the hub
mode) per env. Each iteration steps all ``num_envs`` envs ``num_steps`` times epsilon-greedily (epsilon on a linear
schedule computed on the device), writes the transitions into a replay buffer preallocated on the device, then takes
``gradient_steps`` gradient steps of Huber TD loss with gradient-norm clipping against a target network (hard copy
every ``target_network_frequency`` env steps, or a Polyak blend with ``tau < 1``), double-DQN target by default.

Speed switches (``harness.bind``): ``--compile`` compiles the hot functions, ``--cudagraphs`` replays them from CUDA
graphs. On a torch-batched env one env step is one function (:func:`act_step_store`: epsilon-greedy action, env step,
buffer write; ``epsilon`` a device tensor), compiled as one graph and replayed as one CUDA graph, and each gradient
step is another; a gymnasium env steps on the host, so there only the action choice is compiled or graphed.

Run (defaults: ``caltech`` site, a preset sized to the device)::

    python algos/dqn.py
    python algos/dqn.py --site path/to/site.toml --total-timesteps 200000 --seed 2 --preset cpu
    python algos/dqn.py --env-id Snake-v0
    python algos/dqn.py --env-id CartPole-v1 --vector-mode async --num-envs 8

Outputs (``harness.Run``): TensorBoard events, ``metrics.parquet``, ``checkpoint.pt`` (on a torch-batched env the
replay buffer's log, :class:`harness.ReplayLog`, from which ``--resume`` rebuilds the buffer exactly; with
``--save-buffer`` its rows), ``policy.pt2`` and, on EVHub-v0, the deterministic evaluation on ``eval_split``.

The exported policy and the evaluation of EVHub-v0 use the *hub* action mode: the greedy policy returns the table
row ``discrete_action_table()[argmax_a Q(obs, a)]`` ``(B, 2)`` in [-1, 1], which the hub mode steps exactly like the
discrete mode steps its index (``tests/test_dqn.py`` checks it). Elsewhere ``policy.pt2`` returns action indices.

Other envs: image observations ``(C, H, W)`` (Snake-v0's boards) go through a CNN torso, flat ones through the MLP;
a truncated episode bootstraps from its ``final_obs`` (the torch-batched envs give none: there it bootstraps through
the autoreset, an approximation). With ``--vector-mode async`` a gymnasium env's last step of each iteration runs in
the worker processes during the gradient steps, so those sample the buffer without its newest ``num_envs`` rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gymnasium as gym
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

try:
    from algos import harness
except ModuleNotFoundError:  # run as `python algos/dqn.py` from a checkout that is not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from algos import harness
from envs.evhub import discrete_action_table
from envs.vector import SpaceError, is_evhub

NonFiniteLossError, OutOfMemoryBackoffError, CheckpointError = (
    harness.NonFiniteLossError,
    harness.OutOfMemoryBackoffError,
    harness.CheckpointError,
)

PRESETS = {
    # 2 CPU cores: a few dozen envs, a small net, a replay ratio of 8 samples per env step
    "cpu": {"num_envs": 32, "total_timesteps": 1_000_000, "buffer_size": 200_000, "batch_size": 256, "num_steps": 2,
            "gradient_steps": 2, "learning_starts": 10_000, "hidden_size": 128, "num_threads": 1},
    # one GPU: thousands of envs, a wide net, big batches
    "gpu": {"num_envs": 1024, "total_timesteps": 20_000_000, "buffer_size": 2_000_000, "batch_size": 4096,
            "num_steps": 1, "gradient_steps": 2, "learning_starts": 100_000, "hidden_size": 256, "num_threads": 0},
}  # fmt: skip
"""Defaults per device preset (``harness.preset_args``); any of them can be set on the command line."""

ENV_DEFAULTS = {
    # EVHub-v0: the Args defaults (tuned for the site env)
    "EVHub-v0": {},
    # Snake: rewards of +1/-1, long episodes; a small CNN on 2 CPU cores
    "Snake-v0": {"gamma": 0.99, "reward_scale": 1.0, "exploration_fraction": 0.2, "end_e": 0.02,
                 "target_network_frequency": 20_000, "norm_obs": False, "cnn_channels": (16, 32)},
    # Snake on the cpu preset: sizes that learn in about 10 minutes on 2 CPU cores (800,000 steps)
    "Snake-v0/cpu": {"num_envs": 64, "total_timesteps": 800_000, "buffer_size": 100_000, "batch_size": 128,
                     "num_steps": 1, "gradient_steps": 1, "learning_starts": 5_000, "hidden_size": 128},
    # any other gymnasium env (CleanRL's classic-control settings)
    "*": {"gamma": 0.99, "reward_scale": 1.0, "exploration_fraction": 0.5, "target_network_frequency": 500,
          "learning_starts": 10_000},
}  # fmt: skip
"""Per-env defaults over the preset's (env id, ``"*"`` for an env without an entry); the command line wins."""

LOSS_NAMES = ("td_loss", "q_values", "grad_norm")
"""Quantities checked for finiteness after each update, in the order of the update's ``bad`` flags."""


@dataclass
class Args(harness.RunArgs):
    # RunArgs' exp_name, log_every and checkpoint_every (documented there) with this script's defaults
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    log_every: int = 100
    checkpoint_every: int = 2_000
    total_timesteps: int = 1_000_000
    """total env steps of the experiment (preset: 1,000,000 on cpu, 20,000,000 on gpu)"""
    learning_rate: float = 5e-4
    """the learning rate of the optimizer (Adam)"""
    num_envs: int = 32
    """the number of parallel env copies (preset: 32 on cpu, 1024 on gpu)"""
    num_steps: int = 2
    """env steps per env in each iteration, before the gradient steps (preset: 2 on cpu, 1 on gpu)"""
    gradient_steps: int = 2
    """gradient steps per iteration"""
    buffer_size: int = 200_000
    """the replay memory buffer size, transitions (preset: 200,000 on cpu, 2,000,000 on gpu)"""
    gamma: float = 0.95
    """the discount factor gamma, per hour of site time on EVHub-v0 (0.95, a horizon of about a day), per step on other
    envs (0.99)"""
    tau: float = 1.0
    """the target network update rate (1.0: hard copy; below 1: Polyak blend at each target update)"""
    target_network_frequency: int = 5_000
    """env steps between target network updates, checked once per iteration (5,000 on EVHub-v0, 20,000 on
    Snake-v0, 500 on other envs)"""
    batch_size: int = 256
    """the batch size of a gradient step, sampled from the replay memory (preset: 256 on cpu, 4096 on gpu)"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration (0.02 on Snake-v0)"""
    exploration_fraction: float = 0.5
    """the fraction of `total_timesteps` it takes from start_e to go end_e (0.2 on Snake-v0)"""
    learning_starts: int = 10_000
    """env steps before learning starts (preset: 10,000 on cpu, 100,000 on gpu; 10,000 on gymnasium envs)"""
    double_q: bool = True
    """use the double-DQN target (online network picks the next action, target network scores it)"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    hidden_size: int = 128
    """width of the hidden layers of the Q network (preset: 128 on cpu, 256 on gpu): the two of the MLP, or the one
    after the CNN torso"""
    cnn_channels: tuple[int, int] = (32, 64)
    """image observations (C, H, W): output channels of the CNN torso's two 3x3 convolutions (16 32 on Snake-v0)"""
    reward_scale: float = 10.0
    """multiplies the env reward before it is stored (the episodic_return curve stays unscaled): 10 on EVHub-v0,
    which brings the TD errors to about 1, where the Huber loss turns from quadratic to linear; 1 on other envs"""
    socket_features: bool = False
    """feed the per-socket observations to the Q network (off: only the site-level features, with the EV
    aggregates; on caltech the 165 per-socket inputs let DQN fit the 2019 sessions and transfer worse to the 2021
    test split: 1,368 vs 1,060 kg CO2 after 1M steps in tuning runs)"""
    norm_obs: bool = True
    """standardise flat observations with statistics gathered during the first learning_starts steps, then frozen
    (off on Snake-v0; image observations are never standardised)"""
    bootstrap_truncation: bool = True
    """treat the time-limit truncation as non-terminal (the site never terminates): bootstrap through the
    autoreset from the next window's first observation; False treats it as terminal like CleanRL"""
    save_buffer: bool = False
    """store the replay buffer's rows in the checkpoint (large) instead of its replay log; needed to resume a
    gymnasium env's run with its buffer (its state cannot be replayed; without it the run refills the buffer for
    learning_starts steps). On a torch-batched env the log alone rebuilds the same buffer (harness.ReplayLog)"""
    max_oom_retries: int = 3
    """halvings allowed after CUDA out-of-memory errors: in the gradient steps batch_size halves while it stays
    >= 64, then num_envs; stepping the envs (or at setup) num_envs halves (the replay buffer is kept). Each warns
    and trains on to total_timesteps; one more error stops the run with OutOfMemoryBackoffError, its last
    checkpoint kept (0: stop at the first). A replay buffer that does not fit at setup is halved apart from these,
    down to max(num_envs, batch_size) rows"""


# ---------------------------------------------------------------------------------------------- networks
class QNetwork(nn.Module):
    """Raw observations -> Q values float32 ``(B, n_actions)``.

    Flat observations ``(B, obs_dim)``: standardisation (:class:`harness.RunningObsNorm`, frozen by the loop when
    learning starts), feature choice (``inputs``, :func:`harness.network_inputs`), an MLP with two hidden layers of
    ``hidden`` units. Images ``(B, C, H, W)`` (``obs_shape`` of 3 dims): fed as they are to
    :func:`harness.cnn_torso` (torch's default init) and ``Linear(hidden, n_actions)``.
    """

    def __init__(
        self,
        obs_shape: tuple[int, ...],
        n_actions: int,
        hidden: int,
        norm_obs: bool = True,
        inputs: list[int] | None = None,
        cnn_channels: tuple[int, int] = (32, 64),
    ):
        super().__init__()
        if len(obs_shape) == 3:
            self.obs_norm, self.select = nn.Identity(), nn.Identity()
            torso = harness.cnn_torso(obs_shape, cnn_channels, hidden, init=lambda m: m)
            self.mlp = nn.Sequential(*torso, nn.Linear(hidden, n_actions))
            return
        obs_dim = int(obs_shape[0])
        self.obs_norm = harness.RunningObsNorm(obs_dim) if norm_obs else nn.Identity()
        self.select = harness.select(inputs, obs_dim)
        n_in = obs_dim if inputs is None else len(inputs)
        self.mlp = nn.Sequential(
            nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.select(self.obs_norm(obs)))


class GreedyHubPolicy(nn.Module):
    """EVHub-v0's deterministic policy: obs float32 ``(B, obs_dim)`` -> hub action ``(B, 2)`` in [-1, 1], the row
    ``table[argmax_a Q(obs, a)]`` of :func:`envs.evhub.discrete_action_table`."""

    def __init__(self, qnet: QNetwork, table: torch.Tensor):
        super().__init__()
        self.qnet = qnet
        self.register_buffer("table", table.to(torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table.index_select(0, self.qnet(obs).argmax(1))


class GreedyPolicy(nn.Module):
    """Other envs' deterministic policy: obs float32 ``(B, *obs_shape)`` -> action indices int64 ``(B,)``."""

    def __init__(self, qnet: QNetwork):
        super().__init__()
        self.qnet = qnet

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.qnet(obs).argmax(1)


def make_qnet(args: Args, env) -> QNetwork:
    """The :class:`QNetwork` for ``env`` (a :func:`harness.make_env` env with a Discrete action space), on the CPU."""
    obs_shape, n_actions = tuple(env.obs_shape), int(env.single_action_space.n)
    return QNetwork(
        obs_shape, n_actions, args.hidden_size, args.norm_obs, harness.network_inputs(env, args), args.cnn_channels
    )


def greedy_policy(qnet: QNetwork, evhub: bool) -> nn.Module:
    """The deterministic policy of ``qnet``: :class:`GreedyHubPolicy` on EVHub-v0 (hub actions), else
    :class:`GreedyPolicy`."""
    return GreedyHubPolicy(qnet, discrete_action_table()) if evhub else GreedyPolicy(qnet)


def deterministic_policy(args: Args, state: dict) -> tuple[nn.Module, object, str | None]:
    """The deterministic policy of a checkpoint's ``state``, with a one-env copy of its env and the action mode it
    acts in: ``(actor, env, action_mode)`` (``python -m algos.harness.export``)."""
    env = harness.make_env(args, 1, torch.device("cpu"), action_mode="discrete")
    qnet = make_qnet(args, env)
    qnet.load_state_dict(state["qnet"])
    evhub = is_evhub(args.env_id)
    return greedy_policy(qnet, evhub).eval(), env, "hub" if evhub else None


# ---------------------------------------------------------------------------------------------- hot functions
# in the order the loop calls them: linear_schedule (epsilon), rollout (choose_actions with act, or act_step_store:
# action, env step and buffer write on a torch-batched env), update (buffer_sample, td_target, one gradient step),
# target_update
def linear_schedule(start_e: float, end_e: float, duration: float, t: torch.Tensor) -> torch.Tensor:
    """Epsilon at env step ``t`` (a device tensor): linear from ``start_e`` to ``end_e`` over ``duration`` steps,
    then constant. No host sync."""
    slope = (end_e - start_e) / max(float(duration), 1.0)
    eps = start_e + slope * t.to(torch.float32)
    return eps.clamp(min(start_e, end_e), max(start_e, end_e))


def act(qnet: QNetwork, obs: torch.Tensor, epsilon: torch.Tensor, amp: bool = False) -> torch.Tensor:
    """Epsilon-greedy actions int64 ``(B,)`` for raw observations ``obs``; ``epsilon`` is a device scalar."""
    with torch.no_grad(), torch.autocast(obs.device.type, torch.bfloat16, enabled=amp):
        q = qnet(obs)
    greedy = q.argmax(1)
    random_actions = torch.randint(0, q.shape[1], greedy.shape, device=obs.device)
    explore = torch.rand(greedy.shape, device=obs.device) < epsilon
    return torch.where(explore, random_actions, greedy)


def choose_actions(act, qnet: QNetwork, obs: torch.Tensor, epsilon: torch.Tensor, update_norm: bool) -> torch.Tensor:
    """``act(obs, epsilon)`` (:func:`act`, bound and maybe compiled), first folding ``obs`` into the observation
    statistics while ``update_norm`` (a host flag: still before learning starts)."""
    if update_norm and isinstance(qnet.obs_norm, harness.RunningObsNorm):
        qnet.obs_norm.update(obs)
    return act(obs, epsilon)


def act_step_store(
    act,
    qnet: QNetwork,
    env,
    rb: harness.ReplayBuffer,
    obs: torch.Tensor,
    epsilon: torch.Tensor,
    *,
    update_norm: bool,
    bootstrap_truncation: bool,
    reward_scale: float,
) -> torch.Tensor:
    """One epsilon-greedy step of every env of a torch-batched ``env``: :func:`choose_actions` (``act``: :func:`act`,
    bound), the env step and the transitions written into ``rb`` (:func:`harness.store` without advancing; the caller
    then calls :meth:`~harness.ReplayBuffer.advance`); returns the next observation. ``epsilon`` a device scalar,
    ``update_norm`` a host flag fixed per compiled or captured copy. Tensors only, every state updated in place, no
    host sync: ``--compile`` traces it as one graph and ``--cudagraphs`` replays it as one CUDA graph."""
    action = choose_actions(act, qnet, obs, epsilon, update_norm)
    return harness.store(rb, obs, action, env.step(action), bootstrap_truncation, reward_scale, advance=False)


def rollout(
    act,
    act_step_store: dict | None,
    qnet: QNetwork,
    env,
    rb: harness.ReplayBuffer,
    next_obs: torch.Tensor,
    epsilon: torch.Tensor,
    *,
    num_steps: int,
    update_norm: bool,
    bootstrap_truncation: bool,
    reward_scale: float,
) -> tuple[torch.Tensor, tuple | None]:
    """Step every env ``num_steps`` times epsilon-greedily, storing the transitions; returns ``(last obs, pending)``.

    ``act_step_store`` (for a torch-batched env: :func:`act_step_store` bound, one copy per ``update_norm``; ``act`` is
    then unused) makes each step one call; otherwise (None) a step is :func:`choose_actions` with ``act`` (:func:`act`,
    bound), the env step and :func:`harness.store`. With ``env.overlap`` (an async gymnasium env) the last step is
    only sent (``env.step_async``): ``pending`` is its ``(obs, actions)``, for :func:`harness.store` of
    ``env.step_wait()`` after the gradient steps; else None. No host sync on the torch-batched envs.
    """
    if act_step_store is not None:
        step = act_step_store[update_norm]
        for _ in range(num_steps):
            next_obs = step(next_obs, epsilon)
            rb.advance(next_obs.shape[0])
        return next_obs, None
    for _ in range(num_steps - 1 if env.overlap else num_steps):
        action = choose_actions(act, qnet, next_obs, epsilon, update_norm)
        next_obs = harness.store(rb, next_obs, action, env.step(action), bootstrap_truncation, reward_scale)
    if not env.overlap:
        return next_obs, None
    action = choose_actions(act, qnet, next_obs, epsilon, update_norm)
    env.step_async(action)
    return next_obs, (next_obs, action)


def buffer_sample(rb: harness.ReplayBuffer, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Uniform sample of ``batch_size`` filled rows (with replacement, drawn on the device:
    :meth:`harness.ReplayBuffer.sample_on_device`, so a captured update sees the buffer grow): ``obs, actions,
    rewards, next_obs, dones``, observations as float32."""
    data = rb.sample_on_device(batch_size)
    return data["obs"].float(), data["actions"], data["rewards"], data["next_obs"].float(), data["dones"]


def td_target(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    next_q_target: torch.Tensor,
    next_q_online: torch.Tensor | None,
    gamma: float,
) -> torch.Tensor:
    """One-step TD target ``r + gamma * (1 - done) * Q_target(s', a*)``, float32 ``(B,)``.

    ``a* = argmax Q_online(s', .)`` (double DQN) when ``next_q_online`` is given, else ``argmax Q_target(s', .)``.
    Shapes: rewards, dones ``(B,)``; Q tables ``(B, n_actions)``.
    """
    if next_q_online is None:
        next_value = next_q_target.max(1).values
    else:
        next_value = next_q_target.gather(1, next_q_online.argmax(1, keepdim=True)).squeeze(1)
    return rewards + gamma * (1.0 - dones) * next_value


def update(
    qnet: QNetwork,
    target: QNetwork,
    optimizer: optim.Optimizer,
    rb: dict,
    batch_size: int,
    gamma: float,
    double_q: bool,
    max_grad_norm: float,
    amp: bool = False,
) -> dict[str, torch.Tensor]:
    """One gradient step of the Huber TD loss on a uniform replay sample.

    Returns device scalars ``td_loss``, ``q_values`` (mean Q of the taken actions), ``grad_norm`` (before clipping)
    and ``bad``: bool ``(len(LOSS_NAMES),)``, True where that quantity is non-finite.
    """
    obs, actions, rewards, next_obs, dones = buffer_sample(rb, batch_size)
    device_type = obs.device.type
    with torch.no_grad():
        with torch.autocast(device_type, torch.bfloat16, enabled=amp):
            next_q_target = target(next_obs)
            next_q_online = qnet(next_obs) if double_q else None
        next_q_online = None if next_q_online is None else next_q_online.float()
        y = td_target(rewards, dones, next_q_target.float(), next_q_online, gamma)
    with torch.autocast(device_type, torch.bfloat16, enabled=amp):
        q = qnet(obs)
    q_taken = q.float().gather(1, actions[:, None]).squeeze(1)
    loss = F.smooth_l1_loss(q_taken, y)
    harness.zero_grad(optimizer, set_to_none=False)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(qnet.parameters(), max_grad_norm)
    optimizer.step()
    stats = torch.stack([loss.detach(), q_taken.detach().mean(), grad_norm.detach()])
    return {"td_loss": stats[0], "q_values": stats[1], "grad_norm": stats[2], "bad": ~torch.isfinite(stats)}


@torch.no_grad()
def target_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """``target <- tau * online + (1 - tau) * target`` for parameters (in place; ``tau=1`` is a hard copy);
    buffers (the observation statistics) are copied."""
    for tp, p in zip(target.parameters(), online.parameters()):
        tp.lerp_(p, tau)
    for tb, b in zip(target.buffers(), online.buffers()):
        tb.copy_(b)


# ---------------------------------------------------------------------------------------------- training
def check_action_space(env_id: str, space: gym.Space) -> None:
    """Raise SpaceError (naming ``env_id`` and ``space``) unless it is ``Discrete``."""
    if not isinstance(space, gym.spaces.Discrete):
        raise SpaceError(
            f"DQN needs a Discrete action space; {env_id} has {space}. Use "
            "algos/ppo.py, algos/a2c.py or algos/sac.py for continuous (Box) actions."
        )


def start(
    run: harness.Run,
    handed: dict | None,
    env,
    rb: harness.ReplayBuffer,
    log: harness.ReplayLog | None,
    qnet: QNetwork,
    target: QNetwork,
    optimizer: optim.Optimizer,
    lr,
) -> tuple[torch.Tensor, int]:
    """Start the game, or continue it: reset the envs, then load the live state ``handed`` over after an out-of-memory
    error or ``--resume``'s checkpoint (:meth:`harness.Run.restore`) and rebuild the replay buffer from it (its replay
    ``log`` replayed, or its rows). Returns ``(next_obs, learn_from)``: the first observation and the env step at
    which the gradient steps begin."""
    args, device = run.args, run.device
    next_obs, _ = env.reset(seed=args.seed)
    loaded = run.restore(handed, {"qnet": qnet, "target": target}, {"optimizer": optimizer}, env, {"optimizer": lr})
    if loaded is None:
        return next_obs, args.learning_starts
    if loaded["env_restored"]:
        next_obs = loaded["next_obs"].to(device)
    else:  # new episodes (another num_envs, or a gymnasium env)
        next_obs, _ = env.reset(seed=args.seed + run.global_step)

    def replay(obs, a):  # one env step and its transitions, to rebuild the buffer from its replay log
        return harness.store(rb, obs, a, env.step(a), args.bootstrap_truncation, args.reward_scale)

    final_state = loaded["env"] if loaded["env_restored"] else None
    message, kept = harness.restore_buffer(
        rb, log, loaded.get("replay_buffer"), env, replay, env.num_envs, final_state, next_obs
    )
    # with its buffer back the run learns on from where it was; else it refills learning_starts steps first
    learn_from = int(loaded.get("learn_from", args.learning_starts)) if kept else None
    learn_from = run.global_step + args.learning_starts if learn_from is None else learn_from
    if handed is None:
        run.resume_note(replay_buffer=message, exact=kept)
    return next_obs, learn_from


def bind_hot_functions(
    args: Args,
    env,
    rb: harness.ReplayBuffer,
    qnet: QNetwork,
    target: QNetwork,
    optimizer: optim.Optimizer,
    batch_size: int,
) -> tuple:
    """The loop's hot functions bound once to the networks, optimizer, env and replay buffer, with the speed switches
    applied (``harness.bind``): ``(act, act_step_store, update)``.

    On a torch-batched env ``act_step_store`` holds :func:`act_step_store` (action, env step and buffer write) compiled
    as one graph and replayed as one CUDA graph, one copy per ``update_norm`` (each compiled and captured at its first
    call); a host env steps between the device calls, so there ``act_step_store`` is None and :func:`act` is compiled
    or graphed alone. Each gradient step (:func:`update`) is a graph of its own.
    """
    policy = partial(act, qnet, amp=args.amp)
    (learn,) = harness.bind(
        args,
        update=partial(
            update,
            qnet,
            target,
            optimizer,
            rb,
            batch_size,
            harness.per_step(args, args.gamma),
            args.double_q,
            args.max_grad_norm,
            args.amp,
        ),
    )
    steps = None
    if env.torch_batched:
        steps = {}
        for update_norm in (True, False):
            (step,) = harness.bind(
                args,
                graphs=False,
                act_step_store=partial(
                    act_step_store,
                    policy,
                    qnet,
                    env,
                    rb,
                    update_norm=update_norm,
                    bootstrap_truncation=args.bootstrap_truncation,
                    reward_scale=args.reward_scale,
                ),
            )
            steps[update_norm] = harness.capture(args, step, "act_step_store")
    else:  # a host env steps between the device calls
        (policy,) = harness.bind(args, act=policy)
    return policy, steps, learn


def checkpoint_state(
    run: harness.Run, qnet, target, optimizer, env, next_obs, learn_from: int, sizes, rb, log, rows: bool
) -> dict:
    """What a checkpoint holds besides ``run.counters()``: networks, optimizer, env state, the next observation, the
    step learning starts at, the sizes, and the replay buffer's log, or its rows where ``rows`` (``--save-buffer``,
    and always in the live state handed over after an out-of-memory error)."""
    return {
        "qnet": qnet.state_dict(),
        "target": target.state_dict(),
        "optimizer": optimizer.state_dict(),
        "env": env.state_dict(),
        "num_envs": sizes.num_envs,
        "next_obs": next_obs,
        "learn_from": learn_from,
        "sizes": dataclasses.asdict(sizes),
        "replay_buffer": harness.checkpoint_buffer(rb, log, run.global_step, rows),
    }


def setup(run: harness.Run, sizes: harness.ReplaySizes) -> tuple:
    """The env setup of :func:`train`: the envs (discrete actions, checked), the Q-network and its target copy, the
    optimizer and its learning rate (a device tensor with CUDA graphs), and the replay buffer (halved until it fits,
    ``sizes.buffer_size`` set to what was allocated). Returns ``(env, qnet, target, lr, optimizer, rb)``; on an error
    the envs are closed.

    Raises:
        ValueError: an action space that is not Discrete. OutOfMemoryBackoffError: not even the smallest buffer fits.
    """
    args, device = run.args, run.device
    env = harness.make_env(args, sizes.num_envs, device, action_mode="discrete")
    try:
        check_action_space(args.env_id, env.single_action_space)
        obs_shape = tuple(env.obs_shape)
        qnet = make_qnet(args, env).to(device)
        target = copy.deepcopy(qnet).requires_grad_(False)
        lr = harness.device_lr(args.learning_rate, device) if args.cudagraphs else args.learning_rate
        optimizer = optim.Adam(qnet.parameters(), lr=lr, capturable=args.cudagraphs)
        rb, sizes.buffer_size = harness.allocate_halving(
            run,
            lambda size: harness.ReplayBuffer(size, obs_shape, device),
            sizes.buffer_size,
            max(sizes.num_envs, sizes.batch_size),
            "buffer_size",
        )
    except BaseException:
        env.close()  # an async env's workers
        raise
    return env, qnet, target, lr, optimizer, rb


def announce(run: harness.Run, sizes: harness.ReplaySizes, env, num_iterations: int) -> None:
    """Say what the run will do (:meth:`harness.Run.announce`): actions, observation and torso, envs, steps and
    gradient steps per iteration, iterations and steps."""
    args = run.args
    obs_shape, n_actions = tuple(env.obs_shape), int(env.single_action_space.n)
    cnn = "CNN" if len(obs_shape) == 3 else "MLP"
    overlap = ", env steps overlapped with the gradient steps" if env.overlap else ""
    run.announce(
        f"{n_actions} discrete actions, obs {obs_shape} ({cnn}), {sizes.num_envs} envs x "
        f"{args.num_steps} steps + {args.gradient_steps} gradient steps per iteration{overlap}, "
        f"{num_iterations} iterations, {run.steps_to_train(num_iterations, sizes.num_envs * args.num_steps)}",
        env,
        dataclasses.asdict(sizes),
    )


def train(run: harness.Run, sizes: harness.ReplaySizes, handed: dict | None) -> dict:
    """Train from scratch, from ``--resume``'s checkpoint or from the live state ``handed`` over after a CUDA
    out-of-memory error, until ``total_timesteps``; then :meth:`harness.Run.finish` (its result, with the sizes)."""
    args, device = run.args, run.device

    # TRY NOT TO MODIFY: env setup
    env, qnet, target, lr, optimizer, rb = setup(run, sizes)
    try:
        # TRY NOT TO MODIFY: start the game, or continue it
        iteration_steps = sizes.num_envs * args.num_steps
        log = harness.ReplayLog(rb, iteration_steps) if env.torch_batched else None
        next_obs, learn_from = start(run, handed, env, rb, log, qnet, target, optimizer, lr)
        # the statistics freeze when learning starts; a fine-tuning (--init-from) keeps those its networks came with
        norm_frozen = run.global_step >= args.learning_starts or bool(args.init_from)
        num_iterations = run.iteration + max(0, args.total_timesteps - run.global_step) // iteration_steps
        num_iterations = max(num_iterations, 1)

        act, act_step_store, update = bind_hot_functions(args, env, rb, qnet, target, optimizer, sizes.batch_size)
        actor = greedy_policy(qnet, run.evhub).to(device)
        step_t = torch.full((), float(run.global_step), device=device)
        duration = args.exploration_fraction * args.total_timesteps
        epsilon = linear_schedule(args.start_e, args.end_e, duration, step_t)
        out = {k: torch.full((), math.nan, device=device) for k in LOSS_NAMES}
        guard = run.new_guard()

        def live_state(rows: bool = True) -> dict:
            return checkpoint_state(run, qnet, target, optimizer, env, next_obs, learn_from, sizes, rb, log, rows)

        announce(run, sizes, env, num_iterations)

        for iteration in run.iterations(num_iterations):
            if log is not None:
                log.mark(env, next_obs, run.global_step)
            epsilon.copy_(linear_schedule(args.start_e, args.end_e, duration, step_t))
            try:
                next_obs, pending = rollout(
                    act,
                    act_step_store,
                    qnet,
                    env,
                    rb,
                    next_obs,
                    epsilon,
                    num_steps=args.num_steps,
                    update_norm=not norm_frozen,
                    bootstrap_truncation=args.bootstrap_truncation,
                    reward_scale=args.reward_scale,
                )
            except RuntimeError as exc:  # TRY NOT TO MODIFY: out of memory: the iteration is repeated with fewer envs
                run.iteration -= 1
                where = f"at global_step {run.global_step} (iteration {iteration}), stepping the envs"
                run.out_of_memory(exc, where, live_state)
            prev_step = run.global_step
            run.global_step += iteration_steps
            step_t += iteration_steps

            # ALGO LOGIC: training
            oom = None
            if run.global_step >= learn_from:
                if not norm_frozen:  # the statistics freeze when learning starts; the target copies them
                    norm_frozen = True
                    target_update(target, qnet, 1.0)
                try:
                    for _ in range(args.gradient_steps):
                        out = update()
                        run.flag(guard, out["bad"])
                except RuntimeError as exc:  # out of memory: the iteration's other gradient steps are skipped
                    oom = exc
                if run.global_step // args.target_network_frequency > prev_step // args.target_network_frequency:
                    target_update(target, qnet, args.tau)
            if pending is not None:  # the overlapped env step: collect it, then store its transition
                next_obs = harness.store(rb, *pending, env.step_wait(), args.bootstrap_truncation, args.reward_scale)

            # TRY NOT TO MODIFY: record rewards and losses for plotting purposes, evaluate, checkpoint
            if run.logging_now():
                scalars = {f"losses/{k}": out[k] for k in LOSS_NAMES}
                scalars |= {"charts/epsilon": epsilon, "charts/learning_rate": args.learning_rate}
                run.log(env, guard, scalars, num_envs=sizes.num_envs, batch_size=sizes.batch_size)
            run.eval_during_training(actor, "hub")
            if run.every(args.checkpoint_every):
                run.check_finite(guard)
                run.save(live_state(args.save_buffer))
            if oom is not None:  # TRY NOT TO MODIFY: a smaller batch from the next iteration on
                where = f"at global_step {run.global_step} (iteration {iteration}), in the gradient steps"
                run.out_of_memory(oom, where, live_state, in_update=True)

        run.check_finite(guard)
        return run.finish(
            live_state(args.save_buffer),
            actor,
            env,
            action_mode="hub" if run.evhub else None,
            **dataclasses.asdict(sizes),
        )
    finally:
        env.close()  # an async env's workers (after finish, or on an error)


def main(args: Args) -> dict:
    """Train, checkpoint, export and evaluate as ``args`` say.

    Returns:
        :meth:`harness.Run.finish`'s result (``global_step``, ``train_wall_s``, ``sps``, ``sps_steady``, ``policy``,
        ``vector_mode``, on EVHub-v0 ``eval``) with ``num_envs``, ``batch_size`` and ``buffer_size``: the sizes at the
        end (smaller than asked for after halvings for lack of CUDA memory).

    Raises:
        NonFiniteLossError: a loss became NaN or infinite.
        OutOfMemoryBackoffError: CUDA ran out of memory once more after ``max_oom_retries`` halvings (or with nothing
            left to halve); the last checkpoint is kept.
        CheckpointError: ``--resume`` from a checkpoint that cannot be used.
    """
    if args.buffer_size < args.num_envs:
        raise ValueError(f"buffer_size={args.buffer_size} must hold at least one step of the {args.num_envs} envs")
    run = harness.Run("dqn", args, LOSS_NAMES, PRESETS, ENV_DEFAULTS)
    try:
        sizes = harness.ReplaySizes(args.num_envs, args.batch_size, args.buffer_size)
        # in the gradient steps the batch halves (down to harness.OOM_MIN_BATCH_SIZE), else num_envs
        return harness.train_with_oom_restarts(train, run, sizes, harness.halve_batch_or_envs)
    except Exception:
        run.close()
        raise


if __name__ == "__main__":
    harness.script(main, Args, PRESETS, ENV_DEFAULTS, description=__doc__.split("\n\n")[0])
