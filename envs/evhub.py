"""``EVHub-v0``: a solar + battery + EV-charging site as a torch-batched gymnasium environment.

:class:`EVHubVectorEnv` steps ``num_envs`` copies of the site at once with pure tensor code on one device
(no Python loop over envs or sockets, no host sync in ``step``). :class:`EVHubEnv` wraps one copy as a
plain ``gymnasium.Env`` with NumPy spaces for tools that expect one (``check_env``, Stable-Baselines3).

Physics per step of ``dt`` hours (units: kW, kWh, kg CO2/kWh; see the project's design notes):

* EV sockets: an EV plugged into socket i still needs ``e_i`` kWh and leaves after ``n_i`` steps. Its
  power lies between the least-laxity floor ``f_i = clip((e_i - Pmax_i*dt*(n_i-1))/dt, 0, c_i)`` (only when
  ``ev.deadline_floor``, else 0) and the cap ``c_i = min(Pmax_i, e_i/dt)``; the action picks a point between.
  ``Pmax_i`` is socket i's own power (``SplitData.socket_kw``: the ``[[ev.sockets]]`` groups of the config,
  e.g. 6.6 kW Level-2 and 50 kW DC sockets side by side).
  At departure what is still needed is *unserved energy*. With ``ev.surplus_to_ev``, PV that the load and
  the BESS leave over is given to the plugged EVs (each up to its cap, in proportion to its headroom)
  before any is curtailed or exported: the agent chooses the EV power when the grid would supply it.
* BESS: ``a_bess`` in [-1, 1] times the power limit, positive charges; clipped so SOC stays in
  [SOC_min, SOC_max]; discharge is also limited to the site's deficit (the battery never exports).
  ``E' = E + eta_c * P_ch * dt - P_dis * dt / eta_d``.
* Grid: ``G_imp - G_exp - P_curt = L + sum_i P_i + P_ch - P_pv - P_dis``; a surplus is exported if allowed, else
  curtailed. Import above the limit cuts battery charging first, then EV power above the deadline floors, then the
  floors (a battery never takes energy that a waiting car needs).
* Emissions ``CO2 = G_imp * MOER * dt``, or ``(G_imp - G_exp) * MOER * dt`` with ``grid.export_credit = "moer"``
  (exported energy credited at its hour's MOER; CO2 may then be negative); reward
  ``-scale * (w_co2 * CO2 + w_unserved * unserved + w_peak * max(0, G_imp - peak_threshold))``.

Action modes: ``"socket"``: ``1 + n_sockets`` numbers ``[a_bess, a_1..a_N]``; ``"hub"``: two numbers
``[a_bess, a_ev]`` where ``a_ev`` sets the total EV power between the sum of floors and the sum of caps,
shared earliest-deadline-first. EV actions are clipped to [0, 1] (negative means floor only).
``"discrete"``: one integer per env choosing a hub action from a grid of BESS levels x EV levels
(:func:`discrete_action_table`), for value-based agents such as DQN.

Observation (float, about [-1, 1]), read per hour of site time so that it means the same at every step: local hour and
weekday (sin/cos, 4), PV per kWp now and 1, 2 and 3 hours ahead (4), the MOER realised over the last hour
(:func:`last_hour_moer`; before the split's first step: the data's forecast for it) and its forecasts for the hour from
the step, the next and the one after (4), SOC (1), aggregates (occupied fraction, energy needed, floor and cap power;
4), outlook (PV energy of the next 24 h per kWp, and the EV energy requested per day over the past 7 days; 2), then per
socket (occupied, energy needed, hours to departure / 24; 3 * n_sockets), then the context (:mod:`envs.context`: the EV
energy expected per socket group over the next 1-6 and 7-24 hours from the split's last same-type days, and the MOER at
3-5 h from the last week's same hours; ``2 * n_groups + 3``). Energy needed is scaled per socket by its own power, ``e_i
/ (8 h * Pmax_i)`` (hours of full-power charging left / 8: the same range for a 3.3 kW and a 50 kW socket); the floor
and cap aggregates by the site's total socket power ``sum_i Pmax_i``, the demand outlook by ``24 h * sum_i Pmax_i / 8``
(with one kind of socket, ``sum_i Pmax_i = n_sockets * socket_kw`` exactly). The PV look-ahead reads the modelled PV
series itself (a perfect forecast, as the PV comes from a typical year); the demand feature is causal (sessions that
already arrived; since the split start when that is less than 7 days back).

Physics at a finer step (``physics_dt_h``, evaluation runs): the controller acts every ``dt_h`` on the observation of
its step (each car's steps to departure rounded up to whole steps, :meth:`EVHubVectorEnv.steps_left`), and the step is
simulated as sub-steps of ``physics_dt_h`` with the decision held, as a charging profile and a battery set-point hold
for their period: the EV power the action gives each socket (kW, from the step's floor and cap) stays asked for, within
each sub-step's own floor and cap, and a car given its cap (all it can take in the step) charges at full power; a car
that arrives within the step charges at full power until the next decision (a charger without a profile for its session
does so); the battery keeps its kW set-point (clipped to its SOC limits and, for discharge, the sub-step's deficit).
Cars arrive and leave at their own sub-steps (:meth:`envs.site.Site.physics_split`); PV and MOER are the sub-steps' own.
At ``physics_dt_h = dt_h`` the env is exactly the plain one.

Episodes: training draws a random window of ``episode.train_h`` hours of the split per env;
``full_split=True`` runs the whole split once from its first step (evaluation). With
``episode.session_keep_min < 1`` each training window keeps each arriving session with a probability
drawn per window from ``[session_keep_min, 1]`` (demand augmentation: a later year may see far fewer
drivers than the training year); the demand feature is scaled by the same probability. With ``dc_prior=True``
training windows also draw DC fast-charger sessions from :mod:`envs.context`'s prior (a rate per window; its expected
energy is added to the DC group's context); with ``exo_prior=True`` they scale the MOER (level, contrast) and the PV by
per-window factors within the training steps' month-to-month spread (:func:`envs.context.exo_spread`). Episodes end
by time limit only (``truncated``). :class:`EVHubVectorEnv` autoresets in the same step (``autoreset_mode`` SAME_STEP,
without ``info["final_obs"]``): the observation returned on an episode's last step is already the first of the next
one. :class:`EVHubEnv` (``gym.make("EVHub-v0")``) returns its episode's own last observation there (the step after
the last, as if the episode went on) and starts the next episode at ``reset()``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv

from envs import context, rng, timestep
from envs.rng import seeds_tensor, stream_keys
from envs.site import Site, SplitData, load_site

INFO_KEYS = (
    "pv_kw",
    "pv_curtailed_kw",
    "grid_import_kw",
    "grid_export_kw",
    "bess_charge_kw",
    "bess_discharge_kw",
    "ev_charge_kw",
    "load_kw",
    "co2_kg",
    "unserved_kwh",
)
"""Keys of the per-step ``info`` dict; each value has shape ``(num_envs,)`` (kW, kg or kWh). ``co2_kg`` is the step's
CO2 under the site's ``grid.export_credit`` accounting (net of credited export with ``"moer"``)."""

MOER_CENTER = 0.25  # kg/kWh; typical CAISO marginal rate, used only to centre the observation
MOER_SCALE = 0.25
OBS_BOUND = 10.0  # observations are clipped to [-OBS_BOUND, OBS_BOUND]


DISCRETE_BESS_LEVELS = (-1.0, -0.5, 0.0, 0.5, 1.0)
"""BESS set-points of the ``"discrete"`` action mode, fractions of the power limit (positive charges)."""
DISCRETE_EV_LEVELS = (0.0, 0.5, 1.0)
"""EV levels of the ``"discrete"`` action mode (0: deadline floor only, 1: full power)."""


BESS_ACTIONS = ("setpoint", "surplus")
"""Meanings of the BESS action ``a_bess`` in [-1, 1] (``P_max``: BESS power limit, kW; ``s``: PV minus base
load minus the EV power chosen this step, clipped to [-P_max, P_max], kW):

* ``"setpoint"``: ``P = a_bess * P_max`` (positive charges).
* ``"surplus"``: relative to the PV surplus ``s+ = max(s, 0)`` and deficit ``s- = max(-s, 0)``:
  ``P = s+ + a_bess * (P_max - s+)`` for ``a_bess >= 0`` (store the surplus, plus grid charging up to full
  power) and ``P = s+ + a_bess * s-`` below (store the surplus; at a deficit, discharge up to covering it
  all at -1). The battery always takes the PV surplus it has room for; 0 holds it at a deficit, -1 is the
  self-consumption rule and +1 charges at full power, so each level means something in every hour: the
  discrete levels of DQN become "cover the deficit / half of it / hold / charge half / full" instead of
  fixed kW. Set-points below the surplus (leaving PV to the EVs or to curtailment while the battery has
  room) are not reachable.

Either way the set-point is then clipped to the SOC limits and, for discharge, to the site's deficit."""

DEFAULT_BESS_ACTION = "surplus"
"""The BESS action meaning of the envs (:class:`EVHubVectorEnv`, :class:`EVHubEnv`, ``gym.make("EVHub-v0")``) and of
the training scripts unless told otherwise, and the one a policy without a recorded ``bess_action`` (no
``policy.json``, nothing embedded in ``policy.pt2``) is evaluated under. The baselines and planners, written in plain
kW, pass ``"setpoint"`` explicitly."""


def discrete_action_table() -> torch.Tensor:
    """Hub actions of the ``"discrete"`` mode, shape ``(n_actions, 2)`` float64: row ``k`` is
    ``[bess_level, ev_level]`` with ``k = i_bess * len(DISCRETE_EV_LEVELS) + i_ev``."""
    return torch.tensor([[b, e] for b in DISCRETE_BESS_LEVELS for e in DISCRETE_EV_LEVELS], dtype=torch.float64)


def action_dim(action_mode: str, n_sockets: int) -> int:
    """Size of the action vector: 2 for ``"hub"``, ``1 + n_sockets`` for ``"socket"``; for ``"discrete"``
    the number of discrete actions (``len(DISCRETE_BESS_LEVELS) * len(DISCRETE_EV_LEVELS)``).

    Raises:
        ValueError: unknown action mode.
    """
    if action_mode == "hub":
        return 2
    if action_mode == "socket":
        return 1 + n_sockets
    if action_mode == "discrete":
        return len(DISCRETE_BESS_LEVELS) * len(DISCRETE_EV_LEVELS)
    raise ValueError(f"unknown action_mode {action_mode!r}: expected 'hub', 'socket' or 'discrete'")


def obs_dim(n_sockets: int, n_groups: int = 1) -> int:
    """Size of the observation vector for a site with ``n_sockets`` sockets in ``n_groups`` socket groups."""
    return N_SITE_FEATURES + 3 * n_sockets + context.n_context(n_groups)


def last_hour_moer(data: SplitData) -> np.ndarray:
    """The MOER realised over the hour before each step's start, kg/kWh, ``(T,)``: the mean of the last hour's steps
    (at hourly steps the last step); a step of that hour before the split's first stands for the data's forecast
    issued at the split's first step (its own realised MOER is not known yet)."""
    n = timestep.steps_per_hour(data.dt_h)
    past = np.concatenate([np.full(n, data.moer_fc[0, 0]), data.moer[:-1]])
    if n == 1:
        return past
    c = np.concatenate([[0.0], np.cumsum(past)])
    return (c[n:] - c[:-n]) / n


def observation_tables(d: SplitData) -> dict[str, np.ndarray]:
    """The per-step tables the observation reads (module docstring), float64, each ``(T, ...)`` for the split's ``T``
    steps: ``pv_kw`` and ``load_kw`` (kW, padded at the end by 3 hours and a step so that look-ahead indices never run
    out), ``exo`` (``(T, 12)``: time features, PV per kWp now and 1-3 hours ahead, the last hour's MOER and the
    forecasts for the next three hours, centred and scaled), ``pv_day`` (PV energy of the next 24 hours per kWp / 8,
    the series continuing periodically past the split's end) and ``demand`` (EV energy requested per day over the
    past 7 days, causal, scaled by the sockets' power over a day / 8)."""
    cfg, T = d.config, d.num_steps
    kwp = max(cfg.pv.kwp, 1e-9)
    hour = timestep.steps_per_hour(cfg.dt_h)  # the observation reads the site per hour at every step
    pad = 3 * hour + 1
    pv = np.concatenate([d.pv_kw, np.repeat(d.pv_kw[-1:], pad)])
    exo = np.concatenate(
        [
            d.time_features,
            np.stack([pv[i * hour : i * hour + T] / kwp for i in range(4)], axis=1),
            (np.concatenate([last_hour_moer(d)[:, None], d.moer_fc], axis=1) - MOER_CENTER) / MOER_SCALE,
        ],
        axis=1,
    )
    H = timestep.steps_per_day(cfg.dt_h)
    pv_day = np.concatenate([d.pv_kw, np.resize(d.pv_kw[-H:], H)])
    c = np.concatenate([[0.0], np.cumsum(pv_day)])
    pv_next_day_kwh = (c[H : H + T] - c[:T]) * cfg.dt_h  # kWh over steps t .. t+H-1
    c = np.concatenate([[0.0], np.cumsum(d.arrival_need_kwh.sum(1))])
    steps = np.arange(T)
    first = np.maximum(steps - 7 * H, 0)
    demand_per_day = (c[steps] - c[first]) / np.maximum(steps - first, H) * H  # kWh/day, causal
    total_kw = math.fsum(d.socket_kw)  # kW, all sockets at full power (one kind: exactly n_sockets * socket_kw)
    return {
        "pv_kw": pv,
        "load_kw": np.concatenate([d.load_kw, np.repeat(d.load_kw[-1:], pad)]),
        "exo": exo,
        "pv_day": pv_next_day_kwh / kwp / 8.0,  # ~8 kWh/kWp on a clear summer day
        "demand": demand_per_day / (total_kw * 24.0) * 8.0,
    }


N_SITE_FEATURES = 19
"""Number of site-level observation features before the ``3 * n_sockets`` per-socket ones."""


def observation_layout(n_sockets: int, n_groups: int = 1) -> dict[str, list[int]]:
    """Feature indices of the observation by name: ``"hour_of_day"`` (sin, cos), ``"day_of_week"`` (sin, cos),
    ``"site"`` (every site-level feature, those two groups included), ``"sockets"`` (the ``3 * n_sockets``
    per-socket features: occupied, energy needed, hours to departure) and ``"context"`` (the last
    :func:`envs.context.n_context` features: expected arrivals per socket group, MOER at 3-5 h)."""
    sockets_end = N_SITE_FEATURES + 3 * n_sockets
    return {
        "hour_of_day": [0, 1],
        "day_of_week": [2, 3],
        "site": list(range(N_SITE_FEATURES)),
        "sockets": list(range(N_SITE_FEATURES, sockets_end)),
        "context": list(range(sockets_end, obs_dim(n_sockets, n_groups))),
    }


class EVHubVectorEnv(VectorEnv):
    """``num_envs`` copies of one site's split, stepped together on ``device``.

    Args:
        num_envs: number of parallel copies.
        site: site name, TOML path or loaded :class:`~envs.site.Site` (default ``"caltech"``).
        split: ``"train"`` or ``"test"``.
        action_mode: ``"hub"`` (2 actions), ``"socket"`` (1 + n_sockets actions) or ``"discrete"`` (one
            integer per env indexing :func:`discrete_action_table`: BESS levels x EV levels of the hub mode).
        device: torch device of all state and returned tensors.
        full_split: run the whole split once from step 0 (evaluation) instead of random windows.
        episode_steps: training window length in steps (default: the site's ``episode.train_h`` hours in steps).
        window_end: training windows lie within the split's steps ``[0, window_end)`` (default: the whole split);
            the online learners train on an acting split's realised past this way.
        dc_prior: training windows (not ``full_split``) add sessions at the DC sockets drawn from
            :mod:`envs.context`'s prior (a site without a socket above :data:`envs.context.LEVEL2_MAX_KW` is unchanged).
        exo_prior: training windows (not ``full_split``) see the MOER and PV changed by per-window factors drawn within
            the month-to-month spread of the steps before ``window_end`` (:mod:`envs.context`, exogenous prior).
        physics_dt_h: simulate the site at this finer step, hours, a divisor of the site's ``dt_h`` (only with
            ``full_split``; None: at ``dt_h``). The controller still acts every ``dt_h`` on the observation of its
            step (module docstring, "Physics at a finer step"); :data:`envs.timestep.PHYSICS_DT_H` is the 5-minute
            simulation every controller is also scored on.
        dtype: floating dtype of state and outputs (float32 default; float64 for exact accounting).
        bess_action: meaning of ``a_bess`` (see :data:`BESS_ACTIONS`; default :data:`DEFAULT_BESS_ACTION`):
            ``"setpoint"`` ``P = a_bess * P_max``; ``"surplus"``: the PV surplus left after load and EVs is always
            stored; 0 holds the battery at a deficit, -1 covers the deficit, +1 charges at full power (linear
            between).
        edf: how the hub mode's earliest-deadline-first split is computed, both exact: ``"sort"`` (a sort of the
            sockets by deadline; fastest eager on the CPU) or ``"pairwise"`` (each socket sums the flexible power of
            the sockets due before it, ``(num_envs, n_sockets, n_sockets)`` comparisons: no sort kernel, and one fused
            reduction under ``torch.compile``). Default: ``"pairwise"`` on CUDA, ``"sort"`` elsewhere.

    Randomness (window starts, the session thinning of training windows, the priors' draws) comes from one
    counter-based stream per env (:mod:`envs.rng`): ``reset(seed=s)`` seeds env ``i`` with ``s + i``, a sequence
    seeds each env, and ``reset()`` continues the streams; env ``i`` of a batch thus follows a single env seeded
    like it. The step is pure tensor code with the state updated in place, so ``torch.compile(env.step,
    fullgraph=True)`` traces it as one graph and a CUDA graph can replay it.

    ``step(actions)`` takes a tensor ``(num_envs, action_dim)`` (anything ``torch.as_tensor`` accepts)
    and returns ``obs (num_envs, obs_dim)``, ``reward``, ``terminated``, ``truncated`` (each
    ``(num_envs,)``) and ``info`` with exactly the keys of :data:`INFO_KEYS`, each ``(num_envs,)``.
    ``reset(seed=..., options={"start_steps": [...]})`` can pin each env's first step.

    Autoreset (``metadata["autoreset_mode"]``: ``AutoresetMode.SAME_STEP``): an env whose window ends in a step
    (``truncated``) starts its next window within that step, and the observation returned is that window's first.
    ``info`` carries no ``"final_obs"`` (the window's own last observation would cost a second observation per step
    in the training loop): a learner bootstrapping a truncation from the returned observation values the next
    window's first state (``envs.vector``'s ``has_final_obs``). :class:`EVHubEnv` does not autoreset.

    Raises:
        ValueError: bad ``action_mode`` or ``bess_action``, ``num_envs < 1``, or a window longer than the split
            (or than ``window_end``).
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int = 1,
        site: str | Path | Site = "caltech",
        split: str = "train",
        action_mode: str = "hub",
        device: str | torch.device = "cpu",
        full_split: bool = False,
        episode_steps: int | None = None,
        dtype: torch.dtype = torch.float32,
        bess_action: str = DEFAULT_BESS_ACTION,
        edf: str | None = None,
        window_end: int | None = None,
        dc_prior: bool = False,
        exo_prior: bool = False,
        physics_dt_h: float | None = None,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if bess_action not in BESS_ACTIONS:
            raise ValueError(f"unknown bess_action {bess_action!r}: expected one of {', '.join(BESS_ACTIONS)}")
        self.bess_action = bess_action
        self.site = load_site(site)
        self.data: SplitData = self.site.split(split)
        cfg = self.site.config
        self.cfg = cfg
        self.num_envs = num_envs
        self.split = split
        self.action_mode = action_mode
        self.device = torch.device(device)
        self.dtype = dtype
        self.full_split = full_split
        self._set_window(episode_steps, window_end)
        self.n_sockets = cfg.ev.n_sockets
        self.n_groups = len(cfg.ev.groups)
        self._set_spaces()
        self._load_split()
        self._load_priors(dc_prior, exo_prior)
        b = cfg.bess
        self._e_min = b.soc_min * b.capacity_kwh
        self._e_max = b.soc_max * b.capacity_kwh
        self._e_init = b.soc_initial * b.capacity_kwh
        self._need_scale = self._socket_kw * 8.0  # (n_sockets,) kWh; an 8-hour full-power charge
        self._num_steps_total = self.data.num_steps
        self._load_physics(physics_dt_h)
        self._export_credit = 1.0 if cfg.grid.export_credit == "moer" else 0.0  # exported kWh credited at MOER
        self._init_state(edf)

    # ------------------------------------------------------------------ set-up (__init__'s parts, in its order)
    def _tensor(self, x, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x`` (array-like) as a tensor on the env's device, of ``dtype`` (default: the env's float dtype)."""
        return torch.as_tensor(np.asarray(x), dtype=self.dtype if dtype is None else dtype, device=self.device)

    def _set_window(self, episode_steps: int | None, window_end: int | None) -> None:
        """The episode length and the end of the training windows, steps (``__init__``'s arguments).

        Raises:
            ValueError: a window longer than the split, or ``window_end`` outside ``[episode_steps, T]``.
        """
        T, split = self.data.num_steps, self.split
        self.episode_steps = T if self.full_split else int(episode_steps or self.cfg.episode_steps)
        if self.episode_steps > T:
            raise ValueError(f"episode_steps={self.episode_steps} exceeds the {T} steps of split '{split}'")
        self.window_end = T if window_end is None or self.full_split else int(window_end)
        if not self.episode_steps <= self.window_end <= T:
            raise ValueError(
                f"window_end={self.window_end} must lie in [episode_steps={self.episode_steps}, {T}] (the steps of "
                f"split '{split}'): a training window of {self.episode_steps} steps must fit before it"
            )

    def _set_spaces(self) -> None:
        """The action and observation spaces, single and batched, and the discrete mode's action table
        (``(n_actions, 2)`` of the env's dtype).

        Raises:
            ValueError: an unknown action mode (:func:`action_dim`).
        """
        adim = action_dim(self.action_mode, self.n_sockets)
        odim = obs_dim(self.n_sockets, self.n_groups)
        if self.action_mode == "discrete":
            self.single_action_space = gym.spaces.Discrete(adim)
            self._discrete_actions = discrete_action_table().to(device=self.device, dtype=self.dtype)
        else:
            self.single_action_space = gym.spaces.Box(-1.0, 1.0, (adim,), np.float32)
        self.single_observation_space = gym.spaces.Box(-OBS_BOUND, OBS_BOUND, (odim,), np.float32)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)

    def _load_split(self) -> None:
        """The split's series and tables on the device, each ``(T, ...)`` of the env's dtype unless said: PV and load
        (kW), MOER (kg/kWh), the observation's tables (:func:`observation_tables`), each socket's power ``(N,)`` kW,
        the arrivals' need (kWh) and stay (steps, int64), the context (:mod:`envs.context`), and the session
        thinning of training windows."""
        d, t = self.data, self._tensor
        tables = observation_tables(d)
        self._pv_kw = t(tables["pv_kw"])
        self._load_kw = t(tables["load_kw"])
        self._moer = t(d.moer)
        self._exo_obs = t(tables["exo"])
        self._pv_day_obs = t(tables["pv_day"])
        self._demand_obs = t(tables["demand"])
        self._socket_kw = t(d.socket_kw)  # (n_sockets,) kW, each socket's own power
        self._total_socket_kw = math.fsum(d.socket_kw)  # kW, all sockets at full power (one kind: n_sockets * kW)
        self._keep_min = 1.0 if self.full_split else float(self.cfg.episode.session_keep_min)
        self._thinning = self._keep_min < 1.0
        self._arrival_need = t(d.arrival_need_kwh)
        self._arrival_stay = t(d.arrival_stay_steps, torch.int64)
        ctx = context.context_table(d)
        n_moer = len(context.CONTEXT_MOER_LEADS_H)
        ctx[:, -n_moer:] = (ctx[:, -n_moer:] - MOER_CENTER) / MOER_SCALE
        self._context_obs = t(ctx)

    def _load_priors(self, dc_prior: bool, exo_prior: bool) -> None:
        """The priors of training windows (not ``full_split``; :mod:`envs.context`): the DC prior's sockets, arrival
        share and context, and the exogenous prior's MOER mean and ``(3, 2)`` ranges of level, contrast and PV
        scale."""
        d, t = self.data, self._tensor
        # the DC prior (training windows only): which sockets, when cars come, and the context a unit rate adds
        self._dc_prior = bool(dc_prior) and not self.full_split
        dc = context.dc_sockets(d) if self._dc_prior else np.zeros(0, np.int64)
        self._dc_prior = self._dc_prior and len(dc) > 0
        self._dc_index = t(dc, torch.int64)
        self._dc_share = t(context.arrival_share(d)) if self._dc_prior else None
        self._dc_context = t(context.dc_prior_context(d)) if self._dc_prior else None
        # the exogenous prior (training windows only): the ranges of the per-window MOER level and contrast and PV scale
        self._exo_prior = bool(exo_prior) and not self.full_split
        if self._exo_prior:
            spread = context.exo_spread(d, self.window_end)
            self._exo_mean = spread["moer_mean"]
            self._exo_ranges = t([spread["level"], spread["contrast"], spread["pv_scale"]])  # (3, 2): lo, hi

    def _load_physics(self, physics_dt_h: float | None) -> None:
        """The physics: at the site's step, or ``substeps`` sub-steps of a finer one per step (evaluation runs only):
        the physics split's PV, load (kW), MOER (kg/kWh) and arrivals on the device.

        Raises:
            ValueError: ``physics_dt_h`` not 5 minutes or not a divisor of the site's step, without ``full_split``,
                or a physics split of another length.
        """
        T, t = self.data.num_steps, self._tensor
        self.substeps = 1 if physics_dt_h is None else timestep.substeps(self.cfg.dt_h, physics_dt_h)
        if self.substeps > 1 and timestep.step_minutes(physics_dt_h) != timestep.step_minutes(timestep.PHYSICS_DT_H):
            raise ValueError(
                f"physics_dt_h={physics_dt_h:.6g}: a finer physics runs at {timestep.PHYSICS_DT_H:.6g} h (5 "
                "minutes), the step of the site's physics series"
            )
        self.physics = self.data
        if self.substeps > 1:
            if not self.full_split:
                raise ValueError("physics_dt_h: a finer physics runs whole splits only (full_split=True)")
            self.physics = self.site.physics_split(self.split)
            if self.physics.num_steps != T * self.substeps:
                raise ValueError(
                    f"physics_dt_h: the physics split has {self.physics.num_steps} steps, not {T} x {self.substeps}"
                )
            ph = self.physics
            self._pv_sub = t(ph.pv_kw)
            self._load_sub = t(ph.load_kw)
            self._moer_sub = t(ph.moer)
            self._arrival_need = t(ph.arrival_need_kwh)
            self._arrival_stay = t(ph.arrival_stay_steps, torch.int64)
        self._left_h = self.physics.dt_h  # hours per unit of ev_steps_left

    def _init_state(self, edf: str | None) -> None:
        """The state, ``(num_envs, ...)`` tensors on the device (zeros until ``reset``), the random streams (seeded
        from 0 until ``reset(seed=...)``) and the earliest-deadline-first method.

        Raises:
            ValueError: an unknown ``edf``.
        """
        B, N, dtype = self.num_envs, self.n_sockets, self.dtype
        z = lambda *s, dt=dtype: torch.zeros(*s, dtype=dt, device=self.device)  # noqa: E731
        self.t = z(B, dt=torch.int64)  # absolute step index in the split
        self.elapsed = z(B, dt=torch.int64)  # steps since episode start
        self.energy_kwh = z(B)  # BESS energy content, kWh
        self.ev_need_kwh = z(B, N)  # energy each plugged EV still needs, kWh
        self.ev_steps_left = z(B, N, dt=torch.int64)  # steps until departure; 0 = socket free
        self.session_keep = torch.ones(B, dtype=dtype, device=self.device)  # per-window session keep probability
        self.dc_rate = z(B)  # per-window DC prior sessions per day per DC socket (0 without the prior)
        self.exo_factors = torch.ones(B, 3, dtype=dtype, device=self.device)  # per window: MOER level, contrast; PV
        self.rng = z(B, dt=torch.int64)  # per-env counter-based random streams (envs.rng), seeded from 0 ...
        self.rng.copy_(stream_keys(seeds_tensor(0, B, self.device)))  # ... until reset(seed=...)
        if edf not in (None, "sort", "pairwise"):
            raise ValueError(f"unknown edf {edf!r}: expected 'sort' or 'pairwise'")
        self.edf = edf or ("pairwise" if self.device.type == "cuda" else "sort")
        self._socket_index = torch.arange(N, dtype=torch.int64, device=self.device)
        self._autoreset = True  # EVHubEnv sets False: an ended window goes on until reset() (_go_on)

    # ------------------------------------------------------------------ state helpers
    @property
    def observation_layout(self) -> dict[str, list[int]]:
        """Feature indices of this env's observation by name (:func:`observation_layout`)."""
        return observation_layout(self.n_sockets, self.n_groups)

    @property
    def soc(self) -> torch.Tensor:
        """State of charge of the BESS, fraction of capacity, shape ``(num_envs,)``."""
        return self.energy_kwh / max(self.cfg.bess.capacity_kwh, 1e-9)

    def steps_left(self) -> torch.Tensor:
        """Steps of ``dt_h`` until each plugged car leaves (0: the socket is free), ``(num_envs, n_sockets)`` int64:
        what a controller acting every step plans with. With a finer physics, the physics' sub-steps rounded up to whole
        steps (a car leaving within the step counts the step); else :attr:`ev_steps_left` itself."""
        if self.substeps == 1:
            return self.ev_steps_left
        return (self.ev_steps_left + (self.substeps - 1)) // self.substeps

    def _ev_bounds(self, sub: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-socket (floor, cap) charging power, kW, shape ``(num_envs, n_sockets)`` each: over a step of the site
        (the controller's view, :meth:`steps_left`), or with ``sub`` over a sub-step of the finer physics."""
        dt, left = (self.physics.dt_h, self.ev_steps_left) if sub else (self.cfg.dt_h, self.steps_left())
        pmax = self._socket_kw  # (n_sockets,) kW
        occupied = left > 0
        cap = torch.where(occupied, torch.minimum(self.ev_need_kwh / dt, pmax), 0.0)
        if self.cfg.ev.deadline_floor:
            later = pmax * dt * (left - 1).clamp(min=0).to(self.dtype)
            floor = torch.minimum(((self.ev_need_kwh - later) / dt).clamp(min=0.0), cap)
        else:
            floor = torch.zeros_like(cap)
        return floor, cap

    def power_outlook(self) -> dict[str, torch.Tensor]:
        """What the site faces in the current step, shape ``(num_envs,)`` each (for rule-based controllers).

        Returns:
            ``pv_kw`` available PV, ``load_kw`` base load, ``ev_floor_kw`` and ``ev_max_kw`` (sum over
            sockets of the least and the most EV power this step), ``bess_charge_max_kw`` and
            ``bess_discharge_max_kw`` (SOC and power limits).
        """
        floor, cap = self._ev_bounds()
        b, dt = self.cfg.bess, self.cfg.dt_h
        pv = self._pv_kw.index_select(0, self.t)
        return {
            "pv_kw": pv * self.exo_factors[:, 2] if self._exo_prior else pv,
            "load_kw": self._load_kw.index_select(0, self.t),
            "ev_floor_kw": floor.sum(1),
            "ev_max_kw": cap.sum(1),
            "bess_charge_max_kw": ((self._e_max - self.energy_kwh) / (b.eta_charge * dt)).clamp(0, b.power_kw),
            "bess_discharge_max_kw": ((self.energy_kwh - self._e_min) * b.eta_discharge / dt).clamp(0, b.power_kw),
        }

    def _plug_in(self, u: torch.Tensor | None = None) -> torch.Tensor:
        """Connect the sessions arriving at each env's current step (or at physics sub-step ``u``, ``(num_envs,)``) into
        their sockets; returns which sockets took a car, ``(num_envs, n_sockets)`` bool."""
        if u is None:
            u = self.t * self.substeps if self.substeps > 1 else self.t
        need = self._arrival_need.index_select(0, u)
        stay = self._arrival_stay.index_select(0, u)
        arrive = stay > 0
        if self._thinning:  # fixed at construction: no branching on tensor values
            keep = rng.unit(rng.draw(self.rng, self.n_sockets), self.dtype)
            arrive = arrive & (keep < self.session_keep[:, None])
        self.ev_need_kwh.copy_(torch.where(arrive, need, self.ev_need_kwh))
        self.ev_steps_left.copy_(torch.where(arrive, stay, self.ev_steps_left))
        if self._dc_prior:  # fixed at construction
            self._plug_in_dc_prior()
        return arrive

    def _plug_in_dc_prior(self) -> None:
        """The DC prior's sessions (:mod:`envs.context`): each free DC socket gets a car at the current step with
        probability ``rate * share`` (its window's rate per day times the step's share of a day's arrivals), asking
        for an energy uniform in :data:`envs.context.DC_SESSION_KWH` (at most what the socket delivers in its stay)."""
        n = len(self._dc_index)
        u = rng.unit(rng.draw(self.rng, 2 * n), self.dtype)
        p = (self.dc_rate * self._dc_share.index_select(0, self.t))[:, None]
        steps_left = self.ev_steps_left.index_select(1, self._dc_index)
        arrive = (u[:, :n] < p) & (steps_left == 0)
        kw = self._socket_kw.index_select(0, self._dc_index)
        lo, hi = context.DC_SESSION_KWH
        need = lo + (hi - lo) * u[:, n:]
        stay = torch.ceil(need / (kw * self.cfg.dt_h) - 1e-9).clamp(min=1).to(torch.int64)
        need_all = self.ev_need_kwh.index_select(1, self._dc_index)
        self.ev_need_kwh.index_copy_(1, self._dc_index, torch.where(arrive, need, need_all))
        self.ev_steps_left.index_copy_(1, self._dc_index, torch.where(arrive, stay, steps_left))

    def _observe(self) -> torch.Tensor:
        N = self.n_sockets
        total_kw = self._total_socket_kw
        occupied = (self.ev_steps_left > 0).to(self.dtype)
        floor, cap = self._ev_bounds()
        need = self.ev_need_kwh / self._need_scale
        steps = self.ev_steps_left.to(self.dtype) * self._left_h / 24.0  # hours to departure / 24
        agg = torch.stack(
            [occupied.mean(1), need.sum(1) / N * 4.0, floor.sum(1) / total_kw * 4.0, cap.sum(1) / total_kw],
            dim=1,
        )
        soc = (2.0 * self.soc - 1.0)[:, None]
        outlook = torch.stack(
            [self._pv_day_obs.index_select(0, self.t), self._demand_obs.index_select(0, self.t) * self.session_keep],
            dim=1,
        )
        ctx = self._context_obs.index_select(0, self.t)
        if self._dc_prior:  # fixed at construction
            ctx = ctx + self.dc_rate[:, None] * self._dc_context.index_select(0, self.t)
        exo = self._exo_obs.index_select(0, self.t)
        if self._exo_prior:  # fixed at construction
            n = len(context.CONTEXT_MOER_LEADS_H)
            pv_scale = self.exo_factors[:, 2:]
            exo = torch.cat([exo[:, :4], exo[:, 4:8] * pv_scale, self._exo_moer_obs(exo[:, 8:12])], dim=1)
            ctx = torch.cat([ctx[:, :-n], self._exo_moer_obs(ctx[:, -n:])], dim=1)
            outlook = torch.cat([outlook[:, :1] * pv_scale, outlook[:, 1:]], dim=1)
        obs = torch.cat([exo, soc, agg, outlook, occupied, need, steps, ctx], dim=1)
        return obs.clamp(-OBS_BOUND, OBS_BOUND)

    def _exo_moer(self, moer: torch.Tensor) -> torch.Tensor:
        """The exogenous prior's MOER, kg/kWh: ``max(0, level * mu + contrast * (moer - mu))`` per env, ``moer``
        ``(num_envs, k)``."""
        level, contrast, mu = self.exo_factors[:, :1], self.exo_factors[:, 1:2], self._exo_mean
        return (level * mu + contrast * (moer - mu)).clamp(min=0.0)

    def _exo_moer_obs(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`_exo_moer` of MOER observation features ``x`` (centred and scaled), ``(num_envs, k)``."""
        return (self._exo_moer(x * MOER_SCALE + MOER_CENTER) - MOER_CENTER) / MOER_SCALE

    STATE_KEYS = (
        "t",
        "elapsed",
        "energy_kwh",
        "ev_need_kwh",
        "ev_steps_left",
        "session_keep",
        "dc_rate",
        "exo_factors",
        "rng",
    )
    """Tensors that make up the dynamic state of all envs, the per-env random streams among them
    (:meth:`state_dict`)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the dynamic state tensors (:data:`STATE_KEYS`, each ``(num_envs, ...)``): what a checkpoint needs
        to resume mid-episode."""
        return rng.state_tensors(self, self.STATE_KEYS)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a :meth:`state_dict` in place (moved to this env's device and dtype).

        Raises:
            ValueError: a missing key, or tensors shaped for another ``num_envs`` / ``n_sockets``.
        """
        rng.load_state_tensors(self, state, self.STATE_KEYS)

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start new episodes in every env.

        Args:
            seed: int ``s`` seeds env ``i``'s random stream with ``s + i``; a sequence of ``num_envs`` ints seeds
                each env; None continues the streams.
            options: ``{"start_steps": sequence of num_envs ints}`` pins each env's first step.

        Returns:
            ``(obs, info)``: obs ``(num_envs, obs_dim)``; info is empty.

        Raises:
            ValueError: a pinned start that leaves less than one episode before the split ends.
        """
        if seed is not None:
            self.rng.copy_(stream_keys(seeds_tensor(seed, self.num_envs, self.device)))
        starts = None if options is None else options.get("start_steps")
        if starts is not None:
            starts = torch.as_tensor(starts, dtype=torch.int64, device=self.device).reshape(self.num_envs)
            last = self._num_steps_total - self.episode_steps
            if bool(((starts < 0) | (starts > last)).any()):
                raise ValueError(f"start_steps must lie in [0, {last}] for episodes of {self.episode_steps} steps")
        all_envs = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self._reset_envs(all_envs, starts)
        self._plug_in()
        return self._observe(), {}

    def _reset_envs(self, mask: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        """Start new windows in the envs of ``mask`` (bool ``(num_envs,)``), in place. Every env draws the same count
        from its stream, masked or not, so its stream never depends on the others': the window start and the session
        keep probability, then the DC prior's rate and the exogenous prior's three factors where they are on."""
        x = rng.draw(self.rng, 2 + self._dc_prior + 3 * self._exo_prior)
        if starts is None:
            high = 1 if self.full_split else self.window_end - self.episode_steps + 1
            starts = rng.below(x[:, 0], high)
        self.t.copy_(torch.where(mask, starts, self.t))
        self.elapsed.masked_fill_(mask, 0)
        self.energy_kwh.masked_fill_(mask, self._e_init)
        self.ev_need_kwh.masked_fill_(mask[:, None], 0.0)
        self.ev_steps_left.masked_fill_(mask[:, None], 0)
        if self._thinning:
            keep = self._keep_min + (1.0 - self._keep_min) * rng.unit(x[:, 1], self.dtype)
            self.session_keep.copy_(torch.where(mask, keep, self.session_keep))
        if self._dc_prior:
            rate = context.DC_SESSIONS_PER_DAY_MAX * rng.unit(x[:, 2], self.dtype)
            self.dc_rate.copy_(torch.where(mask, rate, self.dc_rate))
        if self._exo_prior:
            lo, hi = self._exo_ranges[:, 0], self._exo_ranges[:, 1]
            u = rng.unit(x[:, -3:], self.dtype)  # (num_envs, 3)
            self.exo_factors.copy_(torch.where(mask[:, None], lo + (hi - lo) * u, self.exo_factors))

    def _ev_power(self, a_ev: torch.Tensor, floor: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        """Per-socket EV power, kW, ``(num_envs, n_sockets)``, from the EV part of the action."""
        if self.action_mode == "socket":
            return floor + a_ev.clamp(0.0, 1.0) * (cap - floor)
        # hub: total flexible power shared earliest-deadline-first
        flex = cap - floor
        level = a_ev[:, 0].clamp(0.0, 1.0)
        budget = level * flex.sum(1)
        if self.edf == "pairwise":  # a constructor setting, not a tensor value
            # key: the deadline, then the socket index (the sort's stable order); sockets without flexible power add
            # nothing to the sums, wherever they stand
            key = self.ev_steps_left * self.n_sockets + self._socket_index
            earlier = key[:, None, :] < key[:, :, None]  # [b, i, j]: socket j is served before socket i
            before = (earlier.to(flex.dtype) * flex[:, None, :]).sum(-1)
            return floor + torch.minimum((budget[:, None] - before).clamp(min=0.0), flex)
        deadline = torch.where(flex > 0, self.ev_steps_left, torch.iinfo(torch.int64).max)
        order = torch.sort(deadline, dim=1, stable=True).indices
        flex_sorted = torch.gather(flex, 1, order)
        before = torch.cumsum(flex_sorted, 1) - flex_sorted
        alloc_sorted = torch.minimum((budget[:, None] - before).clamp(min=0.0), flex_sorted)
        alloc = torch.zeros_like(flex).scatter(1, order, alloc_sorted)
        return floor + alloc

    def step(self, actions):
        """Advance every env by one step; see the class docstring for shapes and the module's for physics."""
        cfg = self.cfg
        b = cfg.bess
        if self.action_mode == "discrete":
            index = torch.as_tensor(actions, device=self.device).reshape(self.num_envs).long()
            a = self._discrete_actions.index_select(0, index)
        else:
            a = torch.as_tensor(actions, device=self.device).to(self.dtype).reshape(self.num_envs, -1)
        pv = self._pv_kw.index_select(0, self.t)
        load = self._load_kw.index_select(0, self.t)
        moer = self._moer.index_select(0, self.t)
        if self._exo_prior:  # fixed at construction
            pv = pv * self.exo_factors[:, 2]
            moer = self._exo_moer(moer[:, None])[:, 0]

        floor, cap = self._ev_bounds()
        ev = self._ev_power(a[:, 1:], floor, cap)
        ev_total = ev.sum(1)

        a_bess = a[:, 0].clamp(-1.0, 1.0)
        if self.bess_action == "surplus":  # a config string, not a tensor value
            s = (pv - load - ev_total).clamp(-b.power_kw, b.power_kw)
            s_pos, s_neg = s.clamp(min=0.0), (-s).clamp(min=0.0)
            p_bess = torch.where(a_bess >= 0, s_pos + a_bess * (b.power_kw - s_pos), s_pos + a_bess * s_neg)
        else:
            p_bess = a_bess * b.power_kw

        if self.substeps > 1:  # a constructor setting, not a tensor value
            flows, unserved = self._substeps(ev, p_bess, (ev >= cap * (1.0 - 1e-9)) & (cap > 0))
        else:
            flows = self._dispatch(ev, p_bess, floor, cap, pv, load, moer, cfg.dt_h)
            # time passes: departures, then the end of episodes, then arrivals
            self.ev_steps_left.sub_(1).clamp_(min=0)
            departed = self.ev_steps_left == 0
            unserved = torch.where(departed, self.ev_need_kwh, 0.0).sum(1)
            self.ev_need_kwh.masked_fill_(departed, 0.0)
        self.t.add_(1)
        self.elapsed.add_(1)
        truncated = self.elapsed >= self.episode_steps
        # EVs still plugged in when a training window ends are not counted as unserved (their
        # departure lies beyond the window); in full-split runs every departure lies within the split.
        if self._autoreset:  # fixed at construction (EVHubEnv: False)
            # The final step of the split has no successor: clamp before reading, then reset those envs.
            self.t.clamp_(max=self._num_steps_total - 1)
            self._reset_envs(truncated)
            self._plug_in()
        else:
            self._go_on()

        r = cfg.reward
        peak = flows.pop("peak_excess_kw")
        cost = r.w_co2 * flows["co2_kg"] + r.w_unserved * unserved + r.w_peak * peak
        reward = -r.scale * cost
        terminated = torch.zeros_like(truncated)
        info = {**flows, "unserved_kwh": unserved}
        return self._observe(), reward, terminated, truncated, info

    def _go_on(self) -> None:
        """The end of :meth:`step` without autoreset (:class:`EVHubEnv`): every env goes on into the step after, its
        window ended or not, so that the observation at truncation is its own episode's last (the next episode starts
        at :meth:`reset`). An env past the split's last step stays at that step, where no car arrives again: its
        exogenous features (time, PV, MOER, context) are the last step's, as the data have no later step. The random
        streams draw as with autoreset, so the env follows the autoresetting one up to its truncation."""
        within = (self.t < self._num_steps_total)[:, None]
        self.t.clamp_(max=self._num_steps_total - 1)
        self._reset_envs(torch.zeros_like(within[:, 0]))  # resets nothing; draws what the autoreset draws
        need, left = self.ev_need_kwh.clone(), self.ev_steps_left.clone()
        self._plug_in()
        self.ev_need_kwh.copy_(torch.where(within, self.ev_need_kwh, need))
        self.ev_steps_left.copy_(torch.where(within, self.ev_steps_left, left))

    def _dispatch(self, ev, p_bess, floor, cap, pv, load, moer, dt: float) -> dict[str, torch.Tensor]:
        """One step (or sub-step) of ``dt`` hours of the site's physics (module docstring) from the EV power and the
        battery set-point asked for, ``(num_envs, n_sockets)`` and ``(num_envs,)`` kW, within the EVs' ``floor`` and
        ``cap`` of this step and its ``pv``, ``load`` (kW) and ``moer`` (kg/kWh), ``(num_envs,)`` each. Updates the
        battery's energy and each car's need in place; returns the step's flows (:data:`INFO_KEYS` but
        ``unserved_kwh``, each ``(num_envs,)``) and ``peak_excess_kw``, the import above the reward's threshold."""
        cfg, b = self.cfg, self.cfg.bess
        ev_total = ev.sum(1)
        charge_max = ((self._e_max - self.energy_kwh) / (b.eta_charge * dt)).clamp(min=0.0)
        discharge_max = ((self.energy_kwh - self._e_min) * b.eta_discharge / dt).clamp(min=0.0)
        deficit = (load + ev_total - pv).clamp(min=0.0)
        charge = torch.minimum(p_bess.clamp(min=0.0), charge_max)
        discharge = torch.minimum(torch.minimum((-p_bess).clamp(min=0.0), discharge_max), deficit)

        # grid import limit: a battery never takes energy that a waiting car needs. Cut BESS charging first, then
        # EV power above the deadline floors, then the floors (each EV in proportion to its share)
        excess = (load + ev_total + charge - pv - discharge - cfg.grid.import_limit_kw).clamp(min=0.0)
        charge_cut = torch.minimum(excess, charge)
        charge = charge - charge_cut
        excess = excess - charge_cut
        above = ev - floor  # >= 0: the allocation starts at the floors
        above_total = above.sum(1)
        above_cut = torch.minimum(excess, above_total)
        above = above * (1.0 - above_cut / above_total.clamp(min=1e-12))[:, None]
        floor_total = floor.sum(1)
        floor_cut = torch.minimum(excess - above_cut, floor_total)
        ev = floor * (1.0 - floor_cut / floor_total.clamp(min=1e-12))[:, None] + above
        ev_total = ev.sum(1)

        net = load + ev_total + charge - pv - discharge
        if cfg.ev.surplus_to_ev:  # a config flag, not a tensor value
            room = (cap - ev).clamp(min=0.0)
            room_total = room.sum(1)
            extra = torch.minimum((-net).clamp(min=0.0), room_total)
            ev = ev + room * (extra / room_total.clamp(min=1e-12))[:, None]
            ev_total = ev.sum(1)
            net = net + extra
        grid_import = net.clamp(min=0.0)
        surplus = (-net).clamp(min=0.0)
        zero = torch.zeros_like(surplus)
        grid_export = surplus if cfg.grid.export_allowed else zero
        curtailed = zero if cfg.grid.export_allowed else surplus

        self.energy_kwh.copy_(
            (self.energy_kwh + b.eta_charge * charge * dt - discharge * dt / b.eta_discharge).clamp(
                self._e_min, self._e_max
            )
        )
        co2 = (grid_import - grid_export * self._export_credit) * moer * dt  # credit: 0 or 1, a config value
        self.ev_need_kwh.copy_((self.ev_need_kwh - ev * dt).clamp(min=0.0))
        return {
            "pv_kw": pv,
            "pv_curtailed_kw": curtailed,
            "grid_import_kw": grid_import,
            "grid_export_kw": grid_export,
            "bess_charge_kw": charge,
            "bess_discharge_kw": discharge,
            "ev_charge_kw": ev_total,
            "load_kw": load,
            "co2_kg": co2,
            "peak_excess_kw": (grid_import - cfg.reward.peak_threshold_kw).clamp(min=0.0),
        }

    def _substeps(
        self, ev_set: torch.Tensor, bess_set: torch.Tensor, full: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The step as :attr:`substeps` sub-steps of the finer physics, the controller's decision held (module
        docstring, "Physics at a finer step"): each car keeps the power set for its socket, ``ev_set`` (kW, ``(num_envs,
        n_sockets)``), within its floor and cap of the sub-step, or charges at full power where the decision gave it
        its cap (``full``, bool, the same shape) and where it arrived since the decision; the battery keeps its
        set-point ``bess_set`` (kW, + = charge, ``(num_envs,)``). Returns the step's flows (kW means over the
        sub-steps; ``co2_kg`` summed) and the unserved energy of the cars that left in it, kWh."""
        k, dt = self.substeps, self.physics.dt_h
        fresh = torch.zeros_like(self.ev_need_kwh, dtype=torch.bool)  # arrived since the decision
        total: dict[str, torch.Tensor] = {}
        unserved = torch.zeros_like(self.energy_kwh)
        for j in range(k):
            u = self.t * k + j
            floor, cap = self._ev_bounds(sub=True)
            ev = torch.where(fresh | full, cap, torch.minimum(torch.maximum(ev_set, floor), cap))
            pv, load = self._pv_sub.index_select(0, u), self._load_sub.index_select(0, u)
            flows = self._dispatch(ev, bess_set, floor, cap, pv, load, self._moer_sub.index_select(0, u), dt)
            for key, v in flows.items():
                total[key] = total[key] + v if key in total else v
            self.ev_steps_left.sub_(1).clamp_(min=0)
            departed = self.ev_steps_left == 0
            unserved = unserved + torch.where(departed, self.ev_need_kwh, 0.0).sum(1)
            self.ev_need_kwh.masked_fill_(departed, 0.0)
            if j < k - 1:  # the cars of the step's later sub-steps (the next step's first: after the episode's end)
                fresh = fresh | self._plug_in(u + 1)
        mean = {key: v if key == "co2_kg" else v / k for key, v in total.items()}
        return mean, unserved


class EVHubEnv(gym.Env):
    """One copy of :class:`EVHubVectorEnv` as a plain ``gymnasium.Env`` with NumPy float32 spaces.

    Takes the same keyword arguments as :class:`EVHubVectorEnv` (except ``num_envs``; ``bess_action`` defaults to
    :data:`DEFAULT_BESS_ACTION` likewise); runs on the CPU in float64 so its accounting is exact. ``info`` holds the
    :data:`INFO_KEYS` flows as Python floats.

    No autoreset: the step that ends an episode (``truncated=True``) returns that episode's own last observation, the
    step after its last as if it went on (at the split's end: the state after the step, with the last step's
    exogenous features), so a learner bootstrapping the truncation values the right state; the next episode starts
    at :meth:`reset`.

    Raises:
        ValueError: as :class:`EVHubVectorEnv`.
    """

    metadata = {"render_modes": []}

    def __init__(self, render_mode: str | None = None, **kwargs: Any):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", torch.float64)
        self.vec = EVHubVectorEnv(num_envs=1, **kwargs)
        self.vec._autoreset = False
        self.observation_space = self.vec.single_observation_space
        self.action_space = self.vec.single_action_space
        self.render_mode = render_mode

    @property
    def bess_action(self) -> str:
        """Meaning of the BESS action, one of :data:`BESS_ACTIONS`."""
        return self.vec.bess_action

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode; ``options={"start_step": int}`` pins its first step."""
        super().reset(seed=seed)
        torch_seed = int(self.np_random.integers(0, 2**62))
        vec_options = None
        if options and "start_step" in options:
            vec_options = {"start_steps": [int(options["start_step"])]}
        obs, _ = self.vec.reset(seed=torch_seed, options=vec_options)
        return obs[0].cpu().numpy().astype(np.float32), {}

    def step(self, action):
        """One step; returns NumPy obs, float reward, bools and a dict of floats."""
        obs, reward, terminated, truncated, info = self.vec.step(torch.as_tensor(np.asarray(action))[None])
        return (
            obs[0].cpu().numpy().astype(np.float32),
            float(reward[0]),
            bool(terminated[0]),
            bool(truncated[0]),
            {k: float(v[0]) for k, v in info.items()},
        )
