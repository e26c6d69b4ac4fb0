"""RL-MPC (``mpc_rl``): an agent that sets the planner's parameters for the next day.

The planner (:class:`pipeline.control.mpc.MPCController`) is kept; a policy chooses, at each local midnight, two of
its parameters for the next 24 hours from what has been realised: the expected-demand weight (how much of the past
days' demand to count on) and the terminal value of stored energy. The planner then acts through EVHub-v0 as ``mpc``
does until the next midnight: an RL signal that adapts an optimiser rather than replacing it, one decision a day.

``EVHubPlanner-v0`` (:class:`PlannerEnv`) is the gymnasium env the project's agent scripts train it on::

    python algos/ppo.py --env-id pipeline.control.rl_planner:EVHubPlanner-v0 --vector-mode async --num-envs 2

- episode: one week of the train split from a random local midnight (after the split's first week, in which the
  planner's forecasts warm up), begun like a backtest window (:func:`pipeline.control.backtest.run_window`);
- action: ``(2,)`` in ``[-1, 1]``: the weight ``w_c + width * a0`` clipped to ``[0, 1]`` and the terminal value
  ``v_c + width * a1`` clipped to ``[0.5, 1.5]`` (:func:`day_params`); the centre's other parameters as they are;
- reward: ``-(CO2 kg + UNSERVED_COST * unserved kWh) / REWARD_SCALE_KG`` of the day;
- observation (:data:`OBS_NAMES`, about ``[-1, 1]``): the day of week (sin, cos), the battery's SOC, the energy the
  plugged cars still need, the past week's mean daily arrivals, yesterday's arrivals against that mean, the
  planner's mean MOER outlook for the day against the last week's mean MOER, and yesterday's CO2 per kWh charged
  (energies in units of the train split's mean daily arrivals, whichever split it acts on).

Parameters:
    centre (:class:`~pipeline.control.mpc.PlannerParams`): the zero action's planner, :func:`base_params` (weight 0.5,
        terminal value 1: the middle of both ranges) unless ``EVHUB_PLANNER_CENTRE`` (a JSON of its fields, e.g. a
        tuning's) gives another.
    width (float, dimensionless): how far ``|a| = 1`` moves both from the centre, :data:`WIDTH` (0.5: the whole
        ranges) unless ``EVHUB_PLANNER_WIDTH`` gives another.
    site (str): ``site`` or ``EVHUB_SITE`` (as the study sets it), default ``caltech``.
    split (str), window (``"first:end"``, env steps): where episodes are drawn from (``EVHUB_PLANNER_SPLIT``, default
        ``train``; ``EVHUB_PLANNER_WINDOW``, default the whole split), as ``mpc_rl_online``'s weekly fine-tunings on
        the acting split's past set them (:mod:`pipeline.study.online`).

Returns:
    :func:`simulate_rl`: a trained policy (its exported ``policy.pt2``) over a whole split, reading the observation and
    setting the day's parameters at every local midnight: ``mpc_rl``'s KPI row and traces; :func:`simulate_start`:
    the zero action's (``mpc_rl_start``).

References:
    J. Arroyo, C. Manna, F. Spiessens and L. Helsen, "Reinforced model predictive control (RL-MPC) for building
    energy management", Applied Energy 309 (2022). What it learned and against which start:
    ``docs/lab/learned-planners.md``; results: ``docs/findings.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import torch

from envs import timestep
from envs.evhub import EVHubVectorEnv
from envs.kpis import evaluate_policy
from envs.site import Site, SplitData, load_site
from pipeline.control.backtest import UNSERVED_COST, evaluation_site
from pipeline.control.learned import run_planner
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.tuned import ENV_ID, EPISODE_DAYS, rl_policy_file, rl_run_dir

REWARD_SCALE_KG = 50.0
"""A day's CO2 on the shipped caltech site is of this order (kg); rewards are divided by it."""
OBS_NAMES = (
    "dow_sin",
    "dow_cos",
    "soc",
    "plugged_need",
    "week_arrivals",
    "yesterday_vs_week",
    "moer_outlook_vs_week",
    "yesterday_co2_per_kwh",
)
"""The observation's features, in order (module docstring)."""


WIDTH = 0.5
"""How far the action moves the weight and the terminal value from the centre (at ``|a| = 1``): 0.5 spans both
parameters' whole ranges from :func:`base_params`."""


def base_params(site: Site) -> PlannerParams:
    """The planner the policy acts around (its zero action): the site's ``[mpc]`` values on the learned MOER forecast
    (:meth:`pipeline.control.mpc.PlannerParams.learned_start`), the expected demand drawn by day type (weekday or
    weekend; chosen on the train split, ``docs/agents.md``), weight 0.5 and terminal value 1 (the middle of their
    ranges)."""
    return replace(
        PlannerParams.learned_start(site.config), demand_day_type=True, expected_demand_weight=0.5, terminal_value=1.0
    )


def centre(site: Site) -> tuple[PlannerParams, float]:
    """``(centre, width)`` of the policy's action range: ``EVHUB_PLANNER_CENTRE`` (a JSON object of
    :class:`~pipeline.control.mpc.PlannerParams`) and ``EVHUB_PLANNER_WIDTH`` when set and not empty, else
    :func:`base_params` and :data:`WIDTH` (what the study trains ``mpc_rl`` with).

    Raises:
        ValueError: a width outside ``(0, 1]`` or a centre that is not such a JSON object (the message names it).
    """
    raw = os.environ.get("EVHUB_PLANNER_CENTRE")
    try:
        c = PlannerParams.from_dict(json.loads(raw)) if raw else base_params(site)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"EVHUB_PLANNER_CENTRE={raw!r}: not a JSON object of planner parameters ({e})") from e
    width = float(os.environ.get("EVHUB_PLANNER_WIDTH") or WIDTH)
    if not 0.0 < width <= 1.0:
        raise ValueError(f"EVHUB_PLANNER_WIDTH={width}: must lie in (0, 1]")
    return c, width


def day_params(base: PlannerParams, action, width: float = WIDTH) -> PlannerParams:
    """The day's parameters from an action in ``[-1, 1]^2`` (clipped) around the centre ``base``: weight
    ``base.expected_demand_weight + width * a0`` in ``[0, 1]``, terminal value ``base.terminal_value + width * a1`` in
    ``[0.5, 1.5]`` (clipped); the others as in ``base``. At :func:`base_params` and :data:`WIDTH`: weight
    ``(a0 + 1) / 2``, terminal value ``1 + a1 / 2``."""
    a = np.clip(np.asarray(action, np.float64).reshape(-1), -1.0, 1.0)
    w = float(np.clip(base.expected_demand_weight + width * a[0], 0.0, 1.0))
    v = float(np.clip(base.terminal_value + width * a[1], 0.5, 1.5))
    return replace(base, expected_demand_weight=w, terminal_value=v)


def day_observation(
    data: SplitData, train: SplitData, mpc: MPCController, t: int, energy_kwh: float, ev_need_kwh: float,
    last_co2_kg: float = 0.0, last_charged_kwh: float = 0.0,
) -> np.ndarray:  # fmt: skip
    """The day-level observation at step ``t`` of ``data`` (:data:`OBS_NAMES`; causal: realised data before ``t``,
    the planner's forecast).

    Args:
        data: the split acted on. train: the site's train split (its mean daily arrivals scale the energies).
        mpc: the planner acting on ``data`` (its MOER outlook from ``t``).
        t: the step. energy_kwh: the battery's energy then, kWh. ev_need_kwh: the plugged cars' total need, kWh.
        last_co2_kg, last_charged_kwh: the CO2 (kg) and the EV energy (kWh) of the day before, as the planner ran
            it (0: not tracked; the feature is then the last week's mean MOER).

    Returns:
        ``(len(OBS_NAMES),)`` float32, about ``[-1, 1]``.
    """
    cfg = data.config
    day = timestep.steps_per_day(cfg.dt_h)
    arrivals = data.arrival_need_kwh.sum(1).astype(np.float64)  # (T,) kWh arriving per step
    # the normaliser: a typical day's arrivals, kWh, of the train split (known before any split is acted on)
    scale = max(float(train.arrival_need_kwh.sum(1).mean()) * day, 1.0)
    local = data.time[min(t, data.num_steps - 1)].tz_convert(cfg.timezone)
    dow = 2 * np.pi * local.day_of_week / 7.0
    soc = float(energy_kwh) / max(cfg.bess.capacity_kwh, 1e-9)
    need = float(ev_need_kwh) / scale
    past = arrivals[max(0, t - 7 * day) : t]
    week = past.sum() / max(len(past) / day, 1.0) if len(past) else 0.0
    yesterday = arrivals[max(0, t - day) : t].sum()
    moer_week = float(np.mean(data.moer[max(0, t - 7 * day) : t])) if t > 0 else float(data.moer_fc[0, 0])
    outlook = float(np.mean(mpc.moer_outlook(t, min(day, mpc.H, data.num_steps - t))))
    co2_per_kwh = last_co2_kg / last_charged_kwh if last_charged_kwh > 1e-9 else moer_week
    return np.array(
        [
            np.sin(dow),
            np.cos(dow),
            2.0 * soc - 1.0,
            np.tanh(need),
            np.tanh(week / scale),
            np.tanh((yesterday - week) / scale),
            np.tanh(outlook / max(moer_week, 1e-3) - 1.0),
            np.tanh(co2_per_kwh / max(moer_week, 1e-3) - 1.0),
        ],
        np.float32,
    )


def policy_day_params(
    policy, data: SplitData, train: SplitData, mpc: MPCController, t: int, energy_kwh: float, ev_need_kwh: float,
    base: PlannerParams, width: float = WIDTH, env=None,
) -> PlannerParams:  # fmt: skip
    """The planner's parameters ``mpc_rl``'s day-level policy sets for the day starting at step ``t`` (a local
    midnight): its action on :func:`day_observation` (no previous day's CO2 tracked), through :func:`day_params`
    around ``base`` with ``width``.

    Args:
        policy: ``(obs, env) -> action``, obs ``(1, len(OBS_NAMES))``, action ``(1, 2)`` in ``[-1, 1]``
            (:func:`envs.kpis.load_policy`'s).
        data, train, mpc, t, energy_kwh, ev_need_kwh: as :func:`day_observation`'s.
        env: what the policy is given as its env (its own policies ignore it).
    """
    x = torch.as_tensor(day_observation(data, train, mpc, t, energy_kwh, ev_need_kwh))[None]
    with torch.no_grad():
        a = policy(x, env)[0].numpy()
    return day_params(base, a, width)


class _Day:
    """The day-level state of one run through a split: the env (one copy), the planner, and what has been realised."""

    def __init__(self, site: Site, split: str, base: PlannerParams, env: EVHubVectorEnv):
        self.site, self.data, self.base, self.env = site, site.split(split), base, env
        self.mpc = MPCController(self.data, base, presolve=False)
        self.day = timestep.steps_per_day(site.config.dt_h)
        self.last_co2 = self.last_kwh = 0.0

    def observe(self, obs: torch.Tensor) -> np.ndarray:
        """The day-level observation at the env's current step (:func:`day_observation`)."""
        env = self.env
        return day_observation(
            self.data, self.site.split("train"), self.mpc, int(env.t[0]), float(env.energy_kwh[0]),
            float(env.ev_need_kwh[0].sum()), self.last_co2, self.last_kwh,
        )  # fmt: skip

    def run_day(self, params: PlannerParams, obs: torch.Tensor, steps: int):
        """Set the planner's parameters and act ``steps`` steps; returns ``(obs, co2_kg, unserved_kwh)``."""
        m = self.mpc
        m.set_params(params)
        co2 = unserved = kwh = 0.0
        with torch.no_grad():
            for _ in range(steps):
                obs, _, _, _, info = self.env.step(m(obs, self.env))
                co2 += float(info["co2_kg"][0])
                unserved += float(info["unserved_kwh"][0])
                kwh += float(info["ev_charge_kw"][0]) * self.site.config.dt_h
        self.last_co2, self.last_kwh = co2, kwh
        return obs, co2, unserved


def episode_starts(site: Site, split: str, first: int = 0, end: int | None = None) -> np.ndarray:
    """The steps of ``split`` an episode may start at: local midnights from the split's second week on (the planner's
    forecasts warm up in its first) and from step ``first`` on, whose week (and the one step the env reads after it)
    ends by step ``end`` (default: the split's end). Empty when none fits."""
    day = timestep.steps_per_day(site.config.dt_h)
    end = site.split(split).num_steps if end is None else int(end)
    s = site.split(split).local_midnights()
    return s[(s >= max(7 * day, int(first))) & (s + EPISODE_DAYS * day + 1 <= end)]


def _window_from_env() -> tuple[int, int | None]:
    """``EVHUB_PLANNER_WINDOW`` (``"first:end"`` steps; unset or empty: the whole split).

    Raises:
        ValueError: not two integers with ``first < end`` (the message names the variable).
    """
    raw = os.environ.get("EVHUB_PLANNER_WINDOW")
    if not raw:
        return 0, None
    try:
        first, end = (int(x) for x in raw.split(":"))
    except ValueError:
        first = end = -1
    if not 0 <= first < end:
        raise ValueError(f"EVHUB_PLANNER_WINDOW={raw!r}: must be 'first:end', steps with 0 <= first < end")
    return first, end


class PlannerEnv(gym.Env):
    """``EVHubPlanner-v0``: one step is a day of the planner acting through EVHub-v0 (module docstring).

    Args:
        site: a shipped site name or a site TOML (None: ``EVHUB_SITE``, else ``caltech``).
        split: the split episodes are drawn from (None: ``EVHUB_PLANNER_SPLIT``, else ``train``).
        window: ``(first, end)``: the steps of the split episodes lie in (:func:`episode_starts`; None:
            ``EVHUB_PLANNER_WINDOW``, else the whole split).

    Raises:
        ValueError: no episode fits (the message names the split and window), or a bad environment variable.
    """

    metadata = {"render_modes": []}

    def __init__(self, site: str | None = None, split: str | None = None, window: tuple[int, int] | None = None):
        # episodes keep every session, like an evaluation
        self.site = evaluation_site(load_site(site or os.environ.get("EVHUB_SITE", "caltech")))
        self.split = split or os.environ.get("EVHUB_PLANNER_SPLIT") or "train"
        self.base, self.width = centre(self.site)
        self.steps = EPISODE_DAYS * timestep.steps_per_day(self.site.config.dt_h)
        first, end = window if window is not None else _window_from_env()
        # the env's window is one step longer than the episode, so it does not start a new window at the episode's end
        self.starts = episode_starts(self.site, self.split, first, end)
        if len(self.starts) == 0:
            raise ValueError(
                f"split '{self.split}' has no whole week after its first within steps [{first}, {end}) to draw "
                "episodes from"
            )
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (len(OBS_NAMES),), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._state: _Day | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start a week at a random local midnight of the split (``options={"start_step": s}`` pins it)."""
        super().reset(seed=seed)
        start = (
            int(options["start_step"])
            if options and "start_step" in options
            else int(self.np_random.choice(self.starts))
        )
        env = EVHubVectorEnv(
            1,
            site=self.site,
            split=self.split,
            action_mode="socket",
            episode_steps=self.steps + 1,
            dtype=torch.float64,
            bess_action="setpoint",
        )
        self._obs, _ = env.reset(seed=0, options={"start_steps": [start]})
        self._state = _Day(self.site, self.split, self.base, env)
        self._days = 0
        return self._state.observe(self._obs), {}

    def step(self, action):
        s = self._state
        self._obs, co2, unserved = s.run_day(day_params(self.base, action, self.width), self._obs, s.day)
        self._days += 1
        reward = -(co2 + UNSERVED_COST * unserved) / REWARD_SCALE_KG
        truncated = self._days >= EPISODE_DAYS
        return s.observe(self._obs), float(reward), False, truncated, {"co2_kg": co2, "unserved_kwh": unserved}


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="pipeline.control.rl_planner:PlannerEnv")


class DailyPolicyPlanner:
    """A policy ``(obs, env) -> socket action`` over a whole split: at each local midnight (and at the split's first
    step) the trained day-level policy sets the planner's parameters (:func:`policy_day_params`)."""

    def __init__(self, site: Site, split: str, policy, base: PlannerParams, width: float = WIDTH):
        self.site, self.split, self.policy, self.base, self.width = site, split, policy, base, width
        self.midnights = set(site.split(split).local_midnights().tolist()) | {0}
        self.mpc: MPCController | None = None
        self.params: list[tuple[int, PlannerParams]] = []

    def __call__(self, obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
        data = self.site.split(self.split)
        if self.mpc is None:
            self.mpc = MPCController(data, self.base, presolve=False)
        t = int(env.t[0])
        if t in self.midnights:
            energy, need = float(env.energy_kwh[0]), float(env.ev_need_kwh[0].sum())
            p = policy_day_params(
                self.policy, data, self.site.split("train"), self.mpc, t, energy, need, self.base, self.width, env
            )
            self.mpc.set_params(p)
            self.params.append((t, p))
        return self.mpc(obs, env)


def training_environ(site_toml: str | Path, split: str = "train", window: tuple[int, int] | None = None) -> dict:
    """The environment variables a training of ``mpc_rl``'s policy runs with: the site, the shipped action range
    (:func:`base_params`, :data:`WIDTH`; whatever the caller's environment holds), and the split and window of steps
    its episodes are drawn from (:class:`PlannerEnv`; default the whole train split)."""
    return {
        "EVHUB_SITE": str(site_toml),
        "EVHUB_PLANNER_CENTRE": "",
        "EVHUB_PLANNER_WIDTH": str(WIDTH),
        "EVHUB_PLANNER_SPLIT": split,
        "EVHUB_PLANNER_WINDOW": "" if window is None else f"{int(window[0])}:{int(window[1])}",
    }


def start_params(site: Site) -> PlannerParams:
    """The planner's parameters under the untrained policy's action: the zero action every day (the mean of PPO's
    Gaussian policy at its start, whose mean layer starts near zero): weight 0.5, terminal value 1.0, the others
    :func:`base_params`'s."""
    return day_params(base_params(site), np.zeros(2))


def simulate_start(
    site: Site, split: str, controller: str = "mpc_rl_start", physics_dt_h: float | None = None, **truth: bool
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_rl_start``, ``mpc_rl``'s untrained start, over a whole split: its planner with the zero action every day
    (:func:`start_params`); ``(kpi_row, traces)``. ``truth``: :class:`~pipeline.control.mpc.MPCController`'s
    ``perfect_moer`` / ``perfect_arrivals``, for the value-of-information table's runs (named ``controller``);
    ``physics_dt_h``: as :func:`~pipeline.control.learned.run_planner`."""
    site = evaluation_site(site)
    mpc = MPCController(site.split(split), start_params(site), presolve=False, **truth)
    return run_planner(site, split, controller, mpc, physics_dt_h=physics_dt_h)


def simulate_rl(
    site: Site, split: str, seed: int, tuned_dir: str | Path, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_rl`` of ``seed`` over a whole split: ``(kpi_row, traces)``, from the policy trained into
    :func:`run_dir` (its day-level CO2 tracked per day in the planner; ``physics_dt_h``: the site simulated at that
    finer step).

    Raises:
        FileNotFoundError: no trained policy there (the message says how to train one).
    """
    from envs.kpis import load_policy

    path = rl_policy_file(rl_run_dir(tuned_dir, seed))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no trained mpc_rl policy for seed {seed} (run `doit run tune` or the pipeline)"
        )
    policy = load_policy(path)
    site = evaluation_site(site)
    p = DailyPolicyPlanner(site, split, policy, base_params(site))
    kpis, traces = evaluate_policy(
        p,
        site,
        split,
        "mpc_rl",
        action_mode="socket",
        bess_action="setpoint",
        physics_dt_h=physics_dt_h,
        train_wall_s=0.0,
        seed=float(seed),
    )
    weights = np.array([q.expected_demand_weight for _, q in p.params])
    print(
        f"mpc_rl seed {seed} {split}: daily weight mean {weights.mean():.2f} (min {weights.min():.2f}, max "
        f"{weights.max():.2f}); CO2 {traces.co2_kg.sum():.1f} kg, unserved {traces.unserved_kwh.sum():.3f} kWh",
        flush=True,
    )
    return kpis, traces
