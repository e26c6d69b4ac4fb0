"""Backtests of the causal planner: windows of a split run through the env, what closed-loop tuning measures.

A window is a run of ``steps`` env steps of one split from step ``start``, begun like an evaluation run (the
battery at its initial SOC, no car plugged in, every session kept), with a planner built for the split and given
the parameters under test. Its CO2 and unserved energy are the env's. Windows are independent of each other, so a
tuner can run them in any order and in parallel (one Dask task each), and the outcome of window ``[s, s + n)``
is known once step ``s + n`` is realised: a causal tuner may use it from then on.

Weeks: the split's steps cut into consecutive windows of a week (:func:`week_steps`) from its first step (the last one
shorter when the split does not end on a week boundary).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from envs import timestep
from envs.evhub import EVHubVectorEnv
from envs.site import Site, SplitData, load_site
from pipeline import depends
from pipeline.control.mpc import MPCController, PlannerParams

UNSERVED_COST = 10.0
"""Cost of a kWh of EV energy unserved in a backtest, kg-CO2-equivalent: far above any MOER (below ~1 kg/kWh), so a
parameter that cuts CO2 by leaving cars short never wins a tuning."""


def week_steps(dt_h: float) -> int:
    """Env steps of a week at a step of ``dt_h`` hours (:func:`envs.timestep.steps_per_week`)."""
    return timestep.steps_per_week(dt_h)


def weeks(data: SplitData) -> list[tuple[int, int]]:
    """The split's weeks as ``(start, steps)``: consecutive windows of one week from its first step, the last one
    shorter when the split ends within a week."""
    w = week_steps(data.config.dt_h)
    T = data.num_steps
    return [(s, min(w, T - s)) for s in range(0, T, w)]


def evaluation_site(site: Site) -> Site:
    """``site`` as an evaluation runs it: every session kept (``episode.session_keep_min = 1``)."""
    if site.config.episode.session_keep_min >= 1.0:
        return site
    return Site(site.config.replace(episode={"session_keep_min": 1.0}), site.series, site.sessions, dict(site.source))


_SITES: OrderedDict[str, Site] = OrderedDict()
_SITES_KEPT = 2


def _site(site: Site | str | Path) -> Site:
    """The site as backtests run it (:func:`evaluation_site`). A path is loaded once per process for the content of
    its files (a Dask worker runs many windows of one site; a re-ingested site is loaded afresh): the
    :data:`_SITES_KEPT` sites used last are kept."""
    if isinstance(site, Site):
        return evaluation_site(site)
    key = depends.fingerprint(depends.site_files(site))
    if key not in _SITES:
        _SITES[key] = evaluation_site(load_site(site))
        while len(_SITES) > _SITES_KEPT:
            _SITES.popitem(last=False)
    _SITES.move_to_end(key)
    return _SITES[key]


@dataclass(frozen=True)
class WindowResult:
    """CO2 (kg) and unserved EV energy (kWh) of one backtested window, and its LP solves and their seconds."""

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


def run_window(
    site: Site | str | Path, split: str, start: int, steps: int, params: PlannerParams | dict
) -> WindowResult:
    """Run the causal planner with ``params`` over steps ``[start, start + steps)`` of ``split`` through the env.

    The planner reads what it would read in a whole-split run at those steps (its MOER forecast is refit on the
    split's past, its expected demand is the past days' sessions); the env starts the window at the battery's
    initial SOC with no car plugged in and keeps every session. HiGHS runs without presolve (these solves are what
    tuning spends its time on).

    Args:
        site: a loaded site or a path of a site TOML (loaded once per process for its files' content).
        split: ``"train"`` or ``"test"``. start, steps: the window, env steps.
        params: :class:`~pipeline.control.mpc.PlannerParams` or its dict.

    Raises:
        ValueError: a window outside the split. RuntimeError: an LP not solved, or the balance violated.
    """
    params = params if isinstance(params, PlannerParams) else PlannerParams.from_dict(params)
    return run_controller(site, split, start, steps, lambda data: MPCController(data, params, presolve=False))


def run_controller(
    site: Site | str | Path, split: str, start: int, steps: int, make: Callable[[SplitData], MPCController]
) -> WindowResult:
    """:func:`run_window`'s loop for any planner: ``make(split_data)`` builds it (a :class:`MPCController` or a
    subclass), run over steps ``[start, start + steps)`` of ``split`` as :func:`run_window` runs one.

    Raises:
        ValueError: a window outside the split. RuntimeError: an LP not solved, or the balance violated.
    """
    site = _site(site)
    data = site.split(split)
    if start < 0 or steps < 1 or start + steps > data.num_steps:
        raise ValueError(f"window [{start}, {start + steps}) lies outside split '{split}' of {data.num_steps} steps")
    env = EVHubVectorEnv(
        1,
        site=site,
        split=split,
        action_mode="socket",
        episode_steps=steps,
        dtype=torch.float64,
        bess_action="setpoint",
    )
    mpc = make(data)
    obs, _ = env.reset(seed=0, options={"start_steps": [start]})
    co2 = unserved = 0.0
    with torch.inference_mode():  # as envs.kpis.rollout_traces
        for _ in range(steps):
            obs, _, _, _, info = env.step(mpc(obs, env))
            co2 += float(info["co2_kg"][0])
            unserved += float(info["unserved_kwh"][0])
    if not math.isfinite(co2):
        raise RuntimeError(f"backtest of split '{split}' steps [{start}, {start + steps}) gave CO2 {co2}")
    return WindowResult(start, steps, co2, unserved, mpc.solves, mpc.solve_s)
