"""Replaying a planner over windows of a split through the env: what closed-loop tuning measures.

A window is a run of ``steps`` env steps of one split from step ``start``, begun like an evaluation run (the
battery at its initial SOC, no car plugged in, every session kept), with a planner built for the split and given
the parameters under test. Its CO2 and unserved energy are the env's. Windows are independent of each other, so a
tuner can run them in any order and in parallel (one Dask task each), and the outcome of window ``[s, s + n)``
is known once step ``s + n`` is realised: a causal tuner may use it from then on.

Weeks: the split's steps cut into consecutive windows of :data:`WEEK_STEPS` from its first step (the last one
shorter when the split does not end on a week boundary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from envs.evhub import EVHubVectorEnv
from envs.site import Site, SplitData, load_site
from pipeline.control.forecast import LEARNED_HALF_LIFE_DAYS
from pipeline.control.mpc import MPCController

WEEK_STEPS = 168
"""Steps of a week at the hourly step the shipped sites use (``dt_h = 1``); :func:`weeks` scales it by ``dt_h``."""

UNSERVED_COST = 10.0
"""Cost of a kWh of EV energy unserved in a replay, kg-CO2-equivalent: far above any MOER (below ~1 kg/kWh), so a
parameter that cuts CO2 by leaving cars short never wins a tuning."""


@dataclass(frozen=True)
class PlannerParams:
    """The causal planner's parameters (:class:`pipeline.control.mpc.MPCController`'s fields of the same names).

    Attributes:
        horizon_h: look-ahead, hours.
        expected_demand_days: days of past sessions the expected demand is drawn from.
        expected_demand_weight: share of that mean demand the plan counts on, [0, 1].
        terminal_value: value of a kWh left in the battery at the window's end, as a multiple of
            ``eta_discharge`` times the window's mean MOER outlook.
        moer_contrast: the MOER outlook's deviation from its window mean is scaled by this.
        moer_bias: the MOER outlook is shifted by this share of its window mean.
        demand_day_type: the expected demand of an hour from past days of its own type (weekday or weekend).
        moer_half_life_days: the half-life of the MOER regression's past pairs, days (0: none, ``mpc``'s forecast;
            :data:`~pipeline.control.forecast.LEARNED_HALF_LIFE_DAYS` in the learned planners).
        moer_five_minute: the MOER regression also reads the data's 5-minute values at the hour start (the learned
            planners; ``mpc``: no).
    """

    horizon_h: int = 24
    expected_demand_days: int = 7
    expected_demand_weight: float = 0.75
    terminal_value: float = 1.0
    moer_contrast: float = 1.0
    moer_bias: float = 0.0
    demand_day_type: bool = False
    moer_half_life_days: float = 0.0
    moer_five_minute: bool = False

    @classmethod
    def of_site(cls, site: Site) -> PlannerParams:
        """The site's ``[mpc]`` table (what ``mpc`` runs with), the other parameters at their defaults."""
        m = site.config.mpc
        return cls(
            horizon_h=int(m.horizon_h),
            expected_demand_days=int(m.expected_demand_days),
            expected_demand_weight=float(m.expected_demand_weight),
        )

    @classmethod
    def learned_start(cls, site: Site) -> PlannerParams:
        """Where the learned planners start: :meth:`of_site` with the learned MOER forecast (the regression with
        forgetting, half-life :data:`~pipeline.control.forecast.LEARNED_HALF_LIFE_DAYS`, on the data's 5-minute
        values where the site has them)."""
        return replace(cls.of_site(site), moer_half_life_days=LEARNED_HALF_LIFE_DAYS, moer_five_minute=True)

    def as_dict(self) -> dict:
        """Plain dict (JSON, Parquet columns)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> PlannerParams:
        """From :meth:`as_dict`'s dict; integer fields rounded.

        Raises:
            KeyError: a key that is not a parameter (the message names it).
        """
        known = {f.name: f for f in fields(cls)}
        unknown = set(d) - set(known)
        if unknown:
            raise KeyError(f"unknown planner parameter(s) {sorted(unknown)}: known are {sorted(known)}")
        kinds = {"int": int, "bool": bool, "float": float}
        return cls(**{k: kinds[known[k].type](round(v) if known[k].type != "float" else v) for k, v in d.items()})


def planner(data: SplitData, params: PlannerParams, **kwargs) -> MPCController:
    """The causal MPC of ``data`` with ``params`` (HiGHS presolve off: these replays are what tuning spends its
    time on); ``kwargs`` go to :class:`~pipeline.control.mpc.MPCController`."""
    kw = dict(presolve=False) | kwargs
    return MPCController(
        data,
        horizon_h=params.horizon_h,
        expected_demand_days=params.expected_demand_days,
        expected_demand_weight=params.expected_demand_weight,
        terminal_value=params.terminal_value,
        moer_contrast=params.moer_contrast,
        moer_bias=params.moer_bias,
        demand_day_type=params.demand_day_type,
        moer_half_life_days=params.moer_half_life_days,
        moer_five_minute=params.moer_five_minute,
        **kw,
    )


def weeks(data: SplitData) -> list[tuple[int, int]]:
    """The split's weeks as ``(start, steps)``: consecutive windows of one week from its first step, the last one
    shorter when the split ends within a week."""
    w = max(1, int(round(WEEK_STEPS / data.config.dt_h)))
    T = data.num_steps
    return [(s, min(w, T - s)) for s in range(0, T, w)]


_SITES: dict[str, Site] = {}


def _site(site: Site | str) -> Site:
    """A loaded site; a path is loaded once per process (Dask workers replay many windows of one site)."""
    if isinstance(site, Site):
        return site
    key = str(site)
    if key not in _SITES:
        _SITES[key] = load_site(key)
    return _SITES[key]


@dataclass(frozen=True)
class WindowResult:
    """CO2 (kg) and unserved EV energy (kWh) of one replayed window, and its LP solves and their seconds."""

    start: int
    steps: int
    co2_kg: float
    unserved_kwh: float
    solves: int
    solve_s: float

    @property
    def cost(self) -> float:
        """``co2_kg + UNSERVED_COST * unserved_kwh``: what tuning minimises."""
        return self.co2_kg + UNSERVED_COST * self.unserved_kwh


def replay(site: Site | str, split: str, start: int, steps: int, params: PlannerParams | dict) -> WindowResult:
    """Run the causal planner with ``params`` over steps ``[start, start + steps)`` of ``split`` through the env.

    The planner reads what it would read in a whole-split run at those steps (its MOER forecast is refit on the
    split's past, its expected demand is the past week's sessions); the env starts the window at the battery's
    initial SOC with no car plugged in and keeps every session.

    Args:
        site: a loaded site or a path of a site TOML (loaded once per process).
        split: ``"train"`` or ``"test"``. start, steps: the window, env steps.
        params: :class:`PlannerParams` or its dict.

    Raises:
        ValueError: a window outside the split. RuntimeError: an LP not solved, or the balance violated.
    """
    site = _site(site)
    params = params if isinstance(params, PlannerParams) else PlannerParams.from_dict(params)
    data = site.split(split)
    if start < 0 or steps < 1 or start + steps > data.num_steps:
        raise ValueError(f"window [{start}, {start + steps}) lies outside split '{split}' of {data.num_steps} steps")
    if site.config.episode.session_keep_min < 1.0:  # windows keep every session, like an evaluation
        site = Site(
            site.config.replace(episode={"session_keep_min": 1.0}), site.hourly, site.sessions, dict(site.source)
        )
        data = site.split(split)
    env = EVHubVectorEnv(
        1,
        site=site,
        split=split,
        action_mode="socket",
        episode_steps=steps,
        dtype=torch.float64,
        bess_action="setpoint",
    )
    mpc = planner(data, params)
    obs, _ = env.reset(seed=0, options={"start_steps": [start]})
    co2 = unserved = 0.0
    with torch.no_grad():
        for _ in range(steps):
            obs, _, _, _, info = env.step(mpc(obs, env))
            co2 += float(info["co2_kg"][0])
            unserved += float(info["unserved_kwh"][0])
    if not math.isfinite(co2):
        raise RuntimeError(f"replay of split '{split}' steps [{start}, {start + steps}) gave CO2 {co2}")
    return WindowResult(start, steps, co2, unserved, mpc.solves, mpc.solve_s)


def window_costs(results: list[WindowResult]) -> np.ndarray:
    """``(n,)`` costs (:attr:`WindowResult.cost`) of some replayed windows, kg."""
    return np.array([r.cost for r in results], np.float64)
