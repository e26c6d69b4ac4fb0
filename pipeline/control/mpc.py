"""Model predictive control: the battery's and the EVs' power for the least CO2, planned by a linear program over the
next hours and applied a step at a time.

At each clock hour and on each arrival, :class:`MPCController` solves the window LP over the next ``horizon_h`` hours
(the window ends at ``min(t + horizon_h, T)``, the split's end, where the env ends too) at the site's step, the hours
after the first in one-hour blocks below the hour (:meth:`MPCController.periods`), and applies its first step through
the env, holding the plan between plans. Two controllers share the code and differ in what they know
(:data:`PERFECT`):

* ``mpc`` (causal) knows at step ``t`` the BESS energy and every plugged EV's remaining energy and steps to
  departure (the env's ``energy_kwh``, ``ev_need_kwh``, ``ev_steps_left``; the sessions arriving at ``t`` are
  plugged in by then); a causal MOER forecast for each step of the window (:mod:`pipeline.control.forecast`: the
  per-lead :class:`~pipeline.control.forecast.MOERRegression` refit each day on what was realised before it,
  :func:`~pipeline.control.forecast.profile_outlook` while it warms up); the modelled PV series over the window (a
  typical year, the series the agents' look-ahead reads) and the config's constant base load; and an expected EV
  demand (:meth:`MPCController.sessions`): every session that arrived at the same hour of one of the last
  ``expected_demand_days`` days before ``t``, moved into the window with its stay, its energy and power scaled by
  ``expected_demand_weight / expected_demand_days`` (a fraction of a car).
* ``mpc_perfect`` knows the true MOER over the window and the sessions arriving within it (arrival step,
  departure, energy), besides the same state and PV. ``MPCController(perfect_moer=True)`` or
  ``perfect_arrivals=True`` gives one of the two truths only (:mod:`pipeline.study.information`).

The window LP is :func:`pipeline.control.oracle.assemble_lp` over the window (balance, storage, EV energy with an
unserved slack at the oracle's penalty) with:

* Step-0 bounds, so that the first step is what the env does with the mapped action: each plugged EV's power in
  ``[floor_i, cap_i]``, the env's least-laxity floor and ``min(socket_kw_i, need_i / dt)`` (:class:`EVBounds`);
  the floors scaled down together, as the env's import-limit cut, where the import limit cannot meet them all.
* Deferral: a session leaving after the window may leave the energy it could still get after it (``socket_kw_i *
  dt`` per step beyond the window) to later (column ``defer``), at the window's mean MOER outlook per kWh.
* Terminal value: when the window ends before the split, each kWh left in the BESS at its end is worth
  ``terminal_value * eta_discharge * mean(MOER outlook)`` kg (a negative cost on the last ``E``); the battery then
  charges from the grid only in hours below about ``eta_c * eta_d`` times the window's mean MOER.
* Tie-breaks far below any MOER difference, choosing among plans of equal CO2: :data:`EPS_CYCLE` per kWh charged and
  discharged; :data:`EPS_CURTAIL` per kWh curtailed or exported, falling linearly to half of it at the window's end
  (PV used rather than curtailed, and now rather than later); the import cost discounted by :data:`IMPORT_DISCOUNT`
  linearly over the window (equal-MOER import as late as possible).
* With ``grid.export_credit = "moer"``, export earns its step's MOER outlook (the oracle's objective), and step 0
  keeps the env's two dispatch rules the credit would tempt the LP to break
  (:meth:`MPCController.apply_env_rules_at_step0`).

HiGHS solves it (:mod:`pipeline.control.highs`), warm-started from the last hour's basis with ``warm_start``.

Parameters:
    horizon_h (int, hours): the window's length.
    expected_demand_days (int, days): the past days the expected demand is drawn from.
    expected_demand_weight (float, [0, 1]): the share of their mean demand the plan counts on.
    terminal_value (float, multiple of ``eta_discharge`` times the window's mean MOER outlook, kg/kWh): the value of a
        kWh left in the battery at the window's end.
    moer_contrast, moer_bias, moer_near_contrast_1_2h, moer_near_contrast_3_5h (float, dimensionless): how the MOER
        outlook is planned on (1, 0, 1, 1: as forecast).
    demand_day_type (bool): the expected demand of each hour from past days of its own day type.
    moer_half_life_days (float, days), moer_five_minute (bool): the MOER regression's fit.
    These are :class:`PlannerParams`' fields (``mpc`` reads the first three from the site's ``[mpc]`` table); the
    tie-breaks are the module's constants :data:`EPS_CYCLE`, :data:`EPS_CURTAIL` (kg/kWh) and :data:`IMPORT_DISCOUNT`
    (relative).

Returns:
    Each plan, a :class:`Plan`: the first step's flows (kW) and the env's socket action (``action_mode="socket"``,
    ``bess_action="setpoint"``) that applies them, ``a_bess = (ch - dis) / power_kw`` and ``a_i = (P_i - floor_i) /
    (cap_i - floor_i)`` for socket ``i`` (0 where ``cap_i = floor_i``; the env's ``P_i = floor_i + a_i * (cap_i -
    floor_i)`` inverted); and the battery's and plugged EVs' power over the window. :func:`run_mpc`: a whole split's
    KPI row and traces (:func:`envs.kpis.evaluate_policy`).

References:
    docs/pipeline.md, "Model predictive control" and "The planner's step"; docs/agents.md, what each piece of
    information is worth and "How much of the expected demand to count on" (why the plan counts on 0.75 of it);
    :mod:`pipeline.control.oracle`, the LP it builds on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

import numpy as np
import pandas as pd
import torch

from envs import timestep
from envs.config import SiteConfig
from envs.evhub import EVHubVectorEnv
from envs.kpis import evaluate_policy
from envs.site import Site, SplitData, load_site
from pipeline.control.forecast import LEARNED_HALF_LIFE_DAYS, MOERRegression, hourly_view, profile_outlook
from pipeline.control.highs import LPSolver
from pipeline.control.oracle import LP, Offsets, assemble_lp

PERFECT = {"mpc": False, "mpc_perfect": True}
"""MPC controllers by name -> whether they get perfect information within the horizon."""

EPS_CYCLE = 1e-4
"""Tie-break cost per kWh charged and per kWh discharged, kg (MOER is ~0.1-0.7 kg/kWh): no charge and discharge in one
step, no battery energy burnt into curtailment, no cycling without a CO2 gain."""
EPS_CURTAIL = 3e-4
"""Tie-break cost per kWh of PV curtailed or exported in the window's first step, kg; half of it at the window's end.
Above ``2 * EPS_CYCLE``, so PV goes into the battery or the EVs, now, rather than being curtailed or exported."""
IMPORT_DISCOUNT = 1e-4
"""Relative discount of the import cost at the window's end (linear from 0 at its first step): equal-MOER import as
late as possible, keeping room for PV and new cars."""
TERMINAL_VALUE = 1.0
"""Value of the BESS energy left at the end of a window that ends before the split does, per kWh, as a multiple of
``eta_discharge * mean(MOER outlook of the window)`` (kg): the CO2 a kWh stored displaces when discharged at an
average hour later. Without it the battery's energy would be worthless beyond the window (the controller knows no
future arrivals), so it would curtail PV rather than store it."""


@dataclass(frozen=True)
class PlannerParams:
    """The causal planner's parameters: what ``mpc`` runs with by hand, what the learned planners tune or set.

    Attributes:
        horizon_h: look-ahead, hours (steps of ``dt_h``).
        expected_demand_days: days of past sessions the expected demand is drawn from.
        expected_demand_weight: share of that mean demand the plan counts on, [0, 1].
        terminal_value: value of a kWh left in the battery at the window's end, as a multiple of ``eta_discharge``
            times the window's mean MOER outlook (1: :data:`TERMINAL_VALUE`'s rule).
        moer_contrast, moer_bias: the MOER outlook ``f`` is planned on as ``m + moer_contrast * (f - m) + moer_bias *
            m``, ``m`` its mean over the window (1 and 0: as forecast). A regression forecast is shrunk towards its
            mean where it is unsure; a contrast above 1 plans as if the forecast's hour-to-hour shape were surer.
        moer_near_contrast_1_2h, moer_near_contrast_3_5h: then the outlook's leads 1-2 h and 3-5 h are planned on as
            ``f_0 + a * (f_k - f_0)`` (clipped at 0), ``f_0`` its value for the current step (1: as forecast; below 1
            the next hours look more like this one, above 1 less): where the plan's value lies (docs/agents.md).
        demand_day_type: draw the expected demand of each hour from the last ``expected_demand_days`` days of its own
            day type (weekday or weekend, local time) rather than from the last days whatever their type.
        moer_half_life_days: the half-life of the MOER regression's past pairs, days (0: none, ``mpc``'s forecast;
            :data:`~pipeline.control.forecast.LEARNED_HALF_LIFE_DAYS` in the learned planners).
        moer_five_minute: the MOER regression also reads the data's 5-minute values at the hour start (the learned
            planners; ``mpc``: no).

    The causal parameters are not used by ``mpc_perfect`` (it knows the MOER and the arrivals), nor the forecast's
    when the controller is given a ``forecaster``.
    """

    horizon_h: int = 24
    expected_demand_days: int = 7
    expected_demand_weight: float = 0.75
    terminal_value: float = TERMINAL_VALUE
    moer_contrast: float = 1.0
    moer_bias: float = 0.0
    moer_near_contrast_1_2h: float = 1.0
    moer_near_contrast_3_5h: float = 1.0
    demand_day_type: bool = False
    moer_half_life_days: float = 0.0
    moer_five_minute: bool = False

    FIXED = ("horizon_h", "moer_half_life_days", "moer_five_minute")
    """The parameters a controller is built with and keeps (its LP's window, its forecast's fit)."""

    @classmethod
    def of_site(cls, config: SiteConfig) -> PlannerParams:
        """The site's ``[mpc]`` table (what ``mpc`` runs with), the other parameters at their defaults."""
        m = config.mpc
        return cls(
            horizon_h=int(m.horizon_h),
            expected_demand_days=int(m.expected_demand_days),
            expected_demand_weight=float(m.expected_demand_weight),
        )

    @classmethod
    def learned_start(cls, config: SiteConfig) -> PlannerParams:
        """Where the learned planners start: :meth:`of_site` with the learned MOER forecast (the regression with
        forgetting, half-life :data:`~pipeline.control.forecast.LEARNED_HALF_LIFE_DAYS`, on the data's 5-minute
        values where the site has them)."""
        return replace(cls.of_site(config), moer_half_life_days=LEARNED_HALF_LIFE_DAYS, moer_five_minute=True)

    def as_dict(self) -> dict:
        """Plain dict (JSON, Parquet columns)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> PlannerParams:
        """From :meth:`as_dict`'s dict (its values Python's or NumPy's: a table row's); integer and yes/no fields
        rounded.

        Raises:
            KeyError: a key that is not a parameter (the message names it).
        """
        known = {f.name: f for f in fields(cls)}
        unknown = set(d) - set(known)
        if unknown:
            raise KeyError(f"unknown planner parameter(s) {sorted(unknown)}: known are {sorted(known)}")
        kinds = {"int": int, "bool": bool, "float": float}
        return cls(
            **{k: kinds[known[k].type](round(float(v)) if known[k].type != "float" else v) for k, v in d.items()}
        )


@dataclass
class Plan:
    """The first step of one MPC solve: LP flows (kW) and the env action that applies them."""

    t: int
    action: np.ndarray
    """``[a_bess, a_1..a_N]`` in [-1, 1], the env's socket action."""
    grid_import_kw: float
    grid_export_kw: float
    pv_curtailed_kw: float
    bess_charge_kw: float
    bess_discharge_kw: float
    ev_kw: np.ndarray
    """Per-socket EV power, ``(N,)``."""
    co2_planned_kg: float
    """LP objective's CO2 part over the window (forecast MOER; net of the export credit where there is one)."""
    bess_kw_steps: np.ndarray | None = None
    """Battery power over the whole window, kW, ``(H,)`` steps, + = charge: ``ch - dis`` of each step (step 0 as
    applied, ``bess_charge_kw - bess_discharge_kw``; a period of several steps gives each of its steps its power)."""
    ev_kw_steps: np.ndarray | None = None
    """Per-socket power of the plugged EVs over the whole window, kW, ``(N, H)``: each one's LP columns until its
    departure, 0 after it and for a free socket (expected arrivals have no socket yet); step 0 is :attr:`ev_kw`."""


class KeyKind(IntEnum):
    """What a column or row of a window LP stands for, the first field of its warm-start key (:func:`lp_key`).

    The key's other fields: the block (scenario; 0 for a non-anticipativity row), ``a`` (a session's socket code: a
    plugged EV's socket ``i``, an expected arrival's ``KEY_SOCKETS + i``; 0 for a per-step column or row) and ``b`` (the
    absolute step; for an expected arrival's EV power ``arrival_step << 10 | step_within_its_stay``; for a session's
    slack, deferral and EV-energy row its absolute arrival step, 0 when plugged; for a non-anticipativity row its
    index among them).
    """

    PLUGGED_EV = 0
    """A plugged EV's power in one step."""
    ARRIVING_EV = 1
    """An expected arrival's power in one step of its stay."""
    CHARGE = 2
    DISCHARGE = 3
    ENERGY = 4
    """The BESS energy at the end of a step."""
    IMPORT = 5
    CURTAIL = 6
    EXPORT = 7
    SLACK = 8
    """A session's unserved energy."""
    DEFER = 9
    """A session's energy deferred past the window."""
    BALANCE = 10
    """A step's power balance row."""
    STORAGE = 11
    """A step's BESS storage row."""
    EV_ENERGY = 12
    """A session's EV energy row."""
    NONANTICIPATIVITY = 13
    """A row tying a step-0 column of a scenario to the first scenario's (:mod:`pipeline.control.scenario`)."""


KEY_SOCKETS = 1 << 19
"""The socket code of an expected arrival at socket ``i`` is ``KEY_SOCKETS + i`` (a plugged EV's: ``i``), so that the
two never share a key."""
STEP_KINDS = (KeyKind.CHARGE, KeyKind.DISCHARGE, KeyKind.ENERGY, KeyKind.IMPORT, KeyKind.CURTAIL, KeyKind.EXPORT)
"""The kinds of the per-step columns, in :meth:`pipeline.control.oracle.Offsets.per_step`'s order."""


def lp_key(kind: KeyKind, block, a, b) -> np.ndarray:
    """The warm-start key of LP columns or rows: ``kind`` (4 bits) | ``block`` (9 bits, its scenario, modulo 512) |
    ``a`` (20 bits) | ``b`` (30 bits), from the highest bits to the lowest (:class:`KeyKind` names the fields).

    Args:
        kind: what the columns or rows stand for.
        block, a, b: non-negative ints or int64 arrays, broadcast together; ``a`` and ``b`` are not masked (a
            wider value runs into the field above it).

    Returns:
        int64 key(s), the broadcast shape of ``block``, ``a`` and ``b``.
    """
    return ((np.int64(kind) << 9 | block & 511) << 20 | a) << 30 | b


def step_bounds(
    need_kwh: np.ndarray, steps_left: np.ndarray, socket_kw: np.ndarray, dt_h: float, deadline_floor: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The env's per-socket power bounds of a step (``EVHubVectorEnv._ev_bounds``): ``(cap, floor)``, kW, ``(N,)``
    each, from each socket's remaining energy (kWh), steps to departure and power (kW), for steps of ``dt_h`` hours:
    ``cap = min(Pmax, need / dt)`` for a plugged car, the least-laxity floor below it (0 without ``deadline_floor``)."""
    occupied = steps_left > 0
    cap = np.where(occupied, np.minimum(need_kwh / dt_h, socket_kw), 0.0)
    if not deadline_floor:
        return cap, np.zeros(len(cap))
    later = socket_kw * dt_h * np.maximum(steps_left - 1, 0)
    return cap, np.minimum(np.maximum((need_kwh - later) / dt_h, 0.0), cap)


def held_step(
    t: int, steps_left: np.ndarray, planned_at: int, steps_left_then: np.ndarray, window: int, hour_steps: int,
    replan: str = "hour", replan_on_arrival: bool = True,
) -> int | None:  # fmt: skip
    """The step of a plan's window that step ``t`` holds, or None when a new plan is due (:meth:`MPCController.act`'s
    rule): a plan at every step with ``replan = "step"``, at each hour's start (``hour_steps`` steps an hour: every
    step at hourly steps), at or past the end of the last plan's ``window`` (steps), and, with ``replan_on_arrival``,
    when a socket's car is not one the plan saw (its steps to departure ``steps_left``, ``(N,)``, are not those of
    when it was made at step ``planned_at``, ``steps_left_then``, counted down: a car came, left before its time, or
    changed its departure)."""
    j = t - planned_at
    if replan == "step" or t % hour_steps == 0 or not 0 < j < window:
        return None
    if replan_on_arrival and bool((steps_left != np.maximum(steps_left_then - j, 0)).any()):
        return None
    return j


def held_action(
    bess_kw: float, ev_kw: np.ndarray, cap: np.ndarray, floor: np.ndarray, bess_power_kw: float
) -> np.ndarray:
    """The env's socket action ``[a_bess, a_1..a_N]`` that carries out a held plan's step: the battery's set-point
    ``bess_kw`` (kW, + = charge) over its power limit, each car's planned power ``ev_kw`` (kW, ``(N,)``) between this
    step's ``floor`` and ``cap`` (:func:`step_bounds`; 0 where they meet)."""
    action = np.zeros(1 + len(ev_kw))
    action[0] = min(max(bess_kw / bess_power_kw, -1.0), 1.0) if bess_power_kw > 0 else 0.0
    span = cap - floor
    ok = span > 1e-12
    action[1:][ok] = np.clip((ev_kw[ok] - floor[ok]) / span[ok], 0.0, 1.0)
    return action


def plugged_evs(need_kwh: np.ndarray, steps_left: np.ndarray) -> np.ndarray:
    """The sockets whose car is plugged in and still needs energy (``steps_left > 0`` and ``need_kwh > 1e-9``),
    ascending, ``(P,)`` int64, from each socket's remaining energy (kWh) and steps to departure, ``(N,)`` each."""
    return np.flatnonzero((steps_left > 0) & (need_kwh > 1e-9))


@dataclass(frozen=True)
class EVBounds:
    """The env's bounds on each socket's EV power in one step (:func:`step_bounds`), kW, ``(N,)`` float64 each: ``cap``
    (``min(socket_kw, need / dt)`` for a plugged car, 0 at a free socket) and the least-laxity ``floor`` below it."""

    cap: np.ndarray
    floor: np.ndarray


@dataclass(frozen=True)
class WindowSessions:
    """The sessions a window LP plans for (:meth:`MPCController.sessions`): the plugged EVs (first) and the arrivals
    expected in the window; with several blocks (scenarios), each block's in turn. ``S`` sessions, each field ``(S,)``.

    Attributes:
        arrival: int64, the session's first step in the window, steps from ``t`` (0 for a plugged EV).
        departure: int64, its departure step, steps from ``t``, exclusive (may lie past the window).
        energy_kwh: float64, the energy it is to get, kWh (an expected arrival's scaled by its weight).
        socket: int64, its socket (a plugged EV's; the one an expected arrival comes to).
        expected: bool, an expected arrival (True) or a plugged EV (False).
        weight: float64, the share of its socket's power it may draw, in (0, 1] (1 for a real session).
        block: int64, its block (scenario) of the window LP (:meth:`MPCController.window_lp`), non-decreasing; 0 with
            one block.
    """

    arrival: np.ndarray
    departure: np.ndarray
    energy_kwh: np.ndarray
    socket: np.ndarray
    expected: np.ndarray
    weight: np.ndarray
    block: np.ndarray

    def __len__(self) -> int:
        """``S``, the number of sessions."""
        return len(self.arrival)

    @classmethod
    def plugged(cls, need_kwh: np.ndarray, steps_left: np.ndarray) -> WindowSessions:
        """The plugged EVs that still need energy (:func:`plugged_evs`), from each socket's remaining energy (kWh) and
        steps to departure, ``(N,)`` each; in socket order, weight 1, block 0."""
        i = plugged_evs(need_kwh, steps_left)
        n = len(i)
        return cls(
            np.zeros(n, np.int64),
            steps_left[i].astype(np.int64),
            need_kwh[i].astype(np.float64),
            i,
            np.zeros(n, bool),
            np.ones(n),
            np.zeros(n, np.int64),
        )

    @classmethod
    def arrivals(
        cls, arrival: np.ndarray, departure: np.ndarray, energy_kwh: np.ndarray, socket: np.ndarray, weight=None
    ) -> WindowSessions:
        """Expected arrivals at steps ``arrival`` (from ``t``) until ``departure``, with ``energy_kwh`` (kWh) at
        ``socket``, each ``(S,)``; ``weight`` ``(S,)`` (default 1); block 0."""
        n = len(arrival)
        return cls(
            np.asarray(arrival, np.int64),
            np.asarray(departure, np.int64),
            np.asarray(energy_kwh, np.float64),
            np.asarray(socket, np.int64),
            np.ones(n, bool),
            np.ones(n) if weight is None else np.asarray(weight, np.float64),
            np.zeros(n, np.int64),
        )

    @classmethod
    def concat(cls, parts: list[WindowSessions], blocks: bool = False) -> WindowSessions:
        """``parts``' sessions one after another; with ``blocks``, part ``k``'s in block ``k`` (the scenarios of
        :mod:`pipeline.control.scenario`), else in the blocks they hold."""
        cat = np.concatenate
        block = [np.full(len(x), k, np.int64) for k, x in enumerate(parts)] if blocks else [x.block for x in parts]
        return cls(
            cat([x.arrival for x in parts]),
            cat([x.departure for x in parts]),
            cat([x.energy_kwh for x in parts]).astype(np.float64),
            cat([x.socket for x in parts]),
            cat([x.expected for x in parts]),
            cat([x.weight for x in parts]),
            cat(block),
        )


@dataclass(frozen=True)
class WindowBlock:
    """One block (scenario) of a window LP (:meth:`MPCController.window_lp`): where its step-0 decisions lie.

    Attributes:
        off: the block's first column of each variable, in the LP's numbering (ints).
        col0: the step-0 column of each plugged EV, ``(P,)`` int64.
        s0: its socket, ``(P,)`` int64.
        dep0: its last period + 1 in the window, ``(P,)`` int64.
        H: the window's periods (its steps where each period is one step).
        period_steps: each period's steps, ``(H,)`` int64 (:meth:`MPCController.periods`); None: one step each.
    """

    off: Offsets
    col0: np.ndarray
    s0: np.ndarray
    dep0: np.ndarray
    H: int
    period_steps: np.ndarray | None = None


@dataclass(frozen=True)
class WindowLP:
    """A window LP (:meth:`MPCController.window_lp`): the LP (its ``c`` and ``bounds`` amended from
    :func:`~pipeline.control.oracle.assemble_lp`'s) and its ``K`` blocks (:class:`WindowBlock`; one for ``mpc``)."""

    lp: LP
    blocks: list[WindowBlock]


@dataclass
class MPCController:
    """A receding-horizon LP controller for one split; call it as a policy ``(obs, env) -> action``.

    Args:
        data: the split it controls.
        params: its :class:`PlannerParams` (default: the site's ``[mpc]`` table, :meth:`PlannerParams.of_site`);
            :meth:`set_params` changes them between steps.
        perfect: give it the true MOER and the arrivals within the horizon (``mpc_perfect``); sets both of the
            next two.
        perfect_moer: give it the true MOER within the horizon (:meth:`moer_outlook`); the arrivals as ``params``
            say unless ``perfect_arrivals``.
        perfect_arrivals: give it the true arrivals within the horizon (:meth:`sessions`); the MOER forecast unless
            ``perfect_moer``. With both, ``perfect`` is set: the controller is ``mpc_perfect``'s.
        forecaster: the causal MOER forecast, a callable ``(t, H) -> (H,) kg/kWh or None`` while it warms up
            (default :class:`~pipeline.control.forecast.MOERRegression` over the horizon with the parameters'
            half-life and 5-minute regressors); when None is returned
            :func:`~pipeline.control.forecast.profile_outlook` is used. Not built, nor called, when the MOER is true.
        presolve: HiGHS presolve (off halves the solve time on these small LPs; the optimum is the same, the
            vertex chosen among equal-cost plans may differ).
        keep_plans: keep the :class:`Plan` of every solve in ``plans``.
        warm_start: start HiGHS's dual simplex from the last solve's basis, carried over to this hour's LP by what
            each column and row stands for (:meth:`lp_keys`); HiGHS completes it to a basis of the new LP. Fewer
            iterations (about a quarter on ``mpc_scenario``'s LPs); the optimum is the same, the vertex chosen among
            equal-cost plans may differ.
        replan: when a new plan is made at steps below the hour (:meth:`act`): ``"hour"`` at each hour's start (and
            on arrivals, below), holding the last plan in between; ``"step"`` at every step. At hourly steps both plan
            every step.
        replan_on_arrival: with ``replan = "hour"``, also plan when a car has come since the last plan (as the
            central system plans on each transaction's start).
        fine_h: move blocking (:meth:`periods`): the window's first ``fine_h`` hours, up to the next whole hour, at
            the site's step, the rest in one-hour periods; None: every step at the site's step.

    Attributes:
        H: the horizon in steps.
        day_steps: steps per day.
        weekend: whether each step of the split lies on a weekend (local time), ``(T,)`` bool.
        solves, solve_s: number of LP solves and their total seconds (build + HiGHS).
        solver: the :class:`~pipeline.control.highs.LPSolver` of its solves (its HiGHS and the basis kept).
        plans: the :class:`Plan` of every solve when ``keep_plans`` is set.

    Extension interface: :meth:`plan` is a template. A planner over other futures (the scenarios of
    :class:`~pipeline.control.scenario.ScenarioMPC`) overrides its three steps :meth:`window_futures` (the MOER,
    sessions and blocks the window LP is built for), :meth:`decision_lp` (the LP solved) and :meth:`window_plan`
    (the :class:`Plan` of the solution), and builds on :meth:`past_days`, :meth:`step0_bounds`, :meth:`window_lp`,
    :meth:`lp_keys`, :meth:`solve`, :meth:`apply_env_rules_at_step0` and :meth:`plan_of`.
    """

    data: SplitData
    params: PlannerParams | None = None
    perfect: bool = False
    perfect_moer: bool = False
    perfect_arrivals: bool = False
    forecaster: object | None = None
    presolve: bool = True
    keep_plans: bool = False
    warm_start: bool = False
    replan: str = "hour"
    replan_on_arrival: bool = True
    fine_h: float | None = 1.0
    solves: int = 0
    solve_s: float = 0.0
    plans: list = field(default_factory=list)

    def __post_init__(self):
        if self.perfect or (self.perfect_moer and self.perfect_arrivals):
            self.perfect = self.perfect_moer = self.perfect_arrivals = True
        self.solver = LPSolver(self.presolve)
        cfg = self.data.config
        if self.params is None:
            self.params = PlannerParams.of_site(cfg)
        p = self.params
        self.H = timestep.steps(p.horizon_h, cfg.dt_h)
        self.day_steps = timestep.steps_per_day(cfg.dt_h)
        self.hour_steps = timestep.steps_per_hour(cfg.dt_h)
        self.weekend = self.data.weekend()  # (T,) bool
        if self.replan not in ("hour", "step"):
            raise ValueError(f"MPCController: replan must be 'hour' or 'step', got {self.replan!r}")
        self._hourly = hourly_view(self.data)  # what the MOER forecast reads: leads in hours at every step
        self._hourly_forecast = self.forecaster is None and self.hour_steps > 1
        if self.forecaster is None and not self.perfect_moer:
            self.forecaster = MOERRegression(
                self._hourly,
                -(-self.H // self.hour_steps) + (self.hour_steps > 1),  # hours from the last hour start
                half_life_days=p.moer_half_life_days,
                five_minute=p.moer_five_minute,
            )
        self._held: tuple | None = None  # (t, plan, sockets plugged then) of the last solve, held between solves

    def set_params(self, params: PlannerParams) -> None:
        """Plan with ``params`` from the next step on (the learned planners change the weight, the terminal value,
        ... from day to day or week to week); the forecast keeps its state.

        Raises:
            ValueError: ``params`` differ in one of :attr:`PlannerParams.FIXED` (the horizon, the forecast's
                settings), which the controller was built with.
        """
        changed = [k for k in PlannerParams.FIXED if getattr(params, k) != getattr(self.params, k)]
        if changed:
            raise ValueError(
                f"MPCController.set_params: {', '.join(changed)} cannot change after the controller is built "
                f"({', '.join(f'{k} {getattr(self.params, k)} -> {getattr(params, k)}' for k in changed)})"
            )
        self.params = params

    # ---------------------------------------------------------------- what is known at step t
    def moer_outlook(self, t: int, H: int) -> np.ndarray:
        """MOER over steps ``t .. t+H-1``, kg/kWh, ``(H,)``: the truth (``perfect_moer``) or the causal forecast (module
        docstring)."""
        d, p = self.data, self.params
        if self.perfect_moer:
            return d.moer[t : t + H].copy()
        if self._hourly_forecast:
            fc = self._hourly_outlook(t, H)
        else:
            fc = self.forecaster(t, H)
            fc = profile_outlook(d, t, H) if fc is None else fc
        if p.moer_contrast != 1.0 or p.moer_bias != 0.0:
            m = float(fc.mean())
            fc = np.maximum(m + p.moer_contrast * (fc - m) + p.moer_bias * m, 0.0)
        near = ((1, 3, p.moer_near_contrast_1_2h), (3, 6, p.moer_near_contrast_3_5h))  # hours [from, to)
        if any(a != 1.0 for *_, a in near):
            fc = fc.copy()
            dt = d.config.dt_h
            for lo_h, hi_h, a in near:  # contiguous bands at any step length: steps 1-2 and 3-5 at hourly steps
                k = slice(max(1, round(lo_h / dt)), round(hi_h / dt))
                fc[k] = np.maximum(fc[0] + a * (fc[k] - fc[0]), 0.0)
        return fc

    def _hourly_outlook(self, t: int, H: int) -> np.ndarray:
        """The MOER outlook over steps ``t .. t+H-1`` at steps below the hour, kg/kWh, ``(H,)``: the hourly forecast
        issued at the start of ``t``'s hour (:meth:`forecaster` on the split's hourly view, or
        :func:`~pipeline.control.forecast.profile_outlook` while it warms up), each step taking its hour's value; over
        the hour from ``t``, the shape of the data's 5-minute forecasts issued at ``t`` (their mean over each step less
        their mean over the hour, where the data have them) added to it, clipped at 0."""
        n = self.hour_steps
        h0, into = divmod(t, n)
        hours = (into + H - 1) // n + 1
        fc = self.forecaster(h0, hours)
        fc = profile_outlook(self._hourly, h0, hours) if fc is None else fc
        out = fc[(into + np.arange(H)) // n].astype(np.float64)
        five = self.data.moer_5min
        if five is not None:
            f = five[t, 2:]  # the twelve 5-minute forecasts for the hour from t
            per = len(f) // n
            shape = f[: per * n].reshape(n, per).mean(1) - f.mean()
            k = min(n, H)
            out[:k] = np.maximum(out[:k] + shape[:k], 0.0)
        return out

    def sessions(self, t: int, H: int, need: np.ndarray, steps_left: np.ndarray) -> WindowSessions:
        """The window's sessions: the plugged EVs (one per socket, from each socket's remaining energy, kWh, and steps
        to departure, ``(N,)`` each) and those expected to arrive in ``(t, t+H)``.

        Expected arrivals: with ``perfect_arrivals``, the true ones; otherwise every session that arrived at step
        ``s <= t`` with ``s + j * day`` in ``(t, t+H)`` for some ``j`` in ``1..expected_demand_days``, moved to that
        step with its stay, weighted ``expected_demand_weight / expected_demand_days`` (module docstring).

        Returns:
            the :class:`WindowSessions`, one block.
        """
        d = self.data
        plugged = WindowSessions.plugged(need, steps_left)
        p = self.params
        if self.perfect_arrivals:
            sources = [(t, 1.0)]
        else:  # no days (or no weight): the plugged EVs only
            days, total = p.expected_demand_days, p.expected_demand_weight
            sources = [(t - j * self.day_steps, total / days) for j in range(1, days + 1) if total > 0]
        if p.demand_day_type and not self.perfect_arrivals and p.expected_demand_weight > 0:
            sources = self._same_day_type_sources(t, H)
        steps, shifts, shares = [], [], []  # every source's steps of arrivals known at t, one array for all
        for shift, share in sources:  # arrivals at steps shift + k, k in 1..H-1, that are known at t
            s = np.arange(max(shift + 1, 0), min(shift + H, t + 1 if shift < t else d.num_steps))
            if isinstance(share, tuple):  # (share, the steps k of the window this past day stands for)
                share, ks = share
                stands = np.zeros(H, bool)
                stands[ks] = True
                s = s[stands[s - shift]]  # s - shift lies in 1..H-1
            steps.append(s)
            shifts.append(np.full(len(s), shift))
            shares.append(np.full(len(s), float(share)))
        if not steps:
            return plugged
        s, shift, share = np.concatenate(steps), np.concatenate(shifts), np.concatenate(shares)
        r, i = np.nonzero(d.arrival_stay_steps[s] > 0)  # source by source, step by step, socket by socket
        k = s[r] - shift[r]
        expected = WindowSessions.arrivals(
            k, k + d.arrival_stay_steps[s[r], i], d.arrival_need_kwh[s[r], i] * share[r], i, share[r]
        )
        return WindowSessions.concat([plugged, expected])

    def past_days(self, t: int, H: int, n: int, same_type: bool = True) -> list[np.ndarray]:
        """The past days the window's steps may be drawn from: for each step ``t + k`` of the window, the ``n`` most
        recent days ``j >= 1`` before it whose step ``t + k - j * day`` is realised by ``t`` (at or before it, and in
        the split) and, with ``same_type``, of the day type (weekday or weekend, local time) of ``t + k``.

        Returns:
            ``H`` int64 arrays of day offsets ``j``, most recent first, each at most ``n`` long (fewer in a split's
            first days); the one of ``k = 0`` (whose arrivals are the plugged EVs) is empty.
        """
        day, weekend = self.day_steps, self.weekend
        out = [np.zeros(0, np.int64)]
        for k in range(1, H):
            u = t + k
            js = np.arange(max(1, -(-k // day)), u // day + 1)  # u - j * day <= t and >= 0
            if same_type:
                js = js[weekend[u - js * day] == weekend[min(u, len(weekend) - 1)]]
            out.append(js[:n])
        return out

    def _same_day_type_sources(self, t: int, H: int) -> list:
        """The expected demand's past days by day type: for each step ``t + k`` of the window (``k`` in ``1..H-1``), the
        last ``expected_demand_days`` days before it of its own type (:meth:`past_days`); returns ``[(shift, (share,
        ks))]``, ``shift = t - j * day`` for past day ``j`` and ``ks`` the window steps it stands for."""
        days = self.params.expected_demand_days
        chosen: dict[int, list[int]] = {}
        for k, js in enumerate(self.past_days(t, H, days)):
            for j in js.tolist():
                chosen.setdefault(j, []).append(k)
        share = self.params.expected_demand_weight / days
        return [(t - j * self.day_steps, (share, np.array(ks))) for j, ks in sorted(chosen.items())]

    # ---------------------------------------------------------------- one solve
    def periods(self, H: int, t: int = 0) -> np.ndarray:
        """The periods of the window from step ``t``, the LP's time steps, as each one's number of steps, ``(P,)`` int64
        summing to ``H``: one step each over the first :attr:`fine_h` hours and up to the next whole hour of the
        split (all of them where :attr:`fine_h` is None, and at hourly steps), then blocks of one hour, on the split's
        hours (move blocking: the plan's later hours are decided again before they come; a plan made within an hour
        has the same blocks as the one made at its start, so the warm start finds them)."""
        n = self.hour_steps
        if self.fine_h is None or n == 1:
            fine = H
        else:
            fine = min(H, timestep.steps(self.fine_h, self.data.config.dt_h) + (-t) % n)
        rest = H - fine
        tail = np.full(int(rest % n > 0), rest % n, np.int64)
        return np.concatenate([np.ones(fine, np.int64), np.full(rest // n, n, np.int64), tail])

    def plan(self, t: int, energy_kwh: float, ev_need_kwh: np.ndarray, ev_steps_left: np.ndarray) -> Plan:
        """Solve the window LP at step ``t`` from the given state; returns its first step and the env action.

        The steps: the MOER outlook (:meth:`moer_outlook`) and the env's step-0 bounds (:meth:`step0_bounds`); the
        futures planned for (:meth:`window_futures`) and their window LP (:meth:`window_lp`); the LP solved
        (:meth:`decision_lp`, keyed by :meth:`lp_keys` for the warm start) by :meth:`solve`; with
        ``grid.export_credit = "moer"`` the env's dispatch rules at step 0 (:meth:`apply_env_rules_at_step0`); the
        plan of the solution (:meth:`window_plan`).

        Args:
            t: the step. energy_kwh: the BESS energy, kWh.
            ev_need_kwh, ev_steps_left: each socket's remaining energy (kWh) and steps to departure, ``(N,)`` each.

        Raises:
            RuntimeError: HiGHS finds no optimum.
        """
        t0 = time.perf_counter()
        H = min(self.H, self.data.num_steps - t)
        need_all = np.asarray(ev_need_kwh, dtype=np.float64)
        left_all = np.asarray(ev_steps_left, dtype=np.int64)
        moer = self.moer_outlook(t, H)
        ev_bounds = self.step0_bounds(need_all, left_all)
        moers, sessions = self.window_futures(t, H, moer, need_all, left_all)
        w = self.window_lp(t, H, moers, energy_kwh, sessions, ev_bounds)
        lp = self.decision_lp(w)
        keys = self.lp_keys(t, lp, sessions, w.blocks[0].period_steps) if self.warm_start else None
        z = self.solve(lp.c, lp.A_eq, lp.b_eq, lp.bounds, t, keys=keys)
        if self.data.config.grid.export_credit == "moer":
            z = self.apply_env_rules_at_step0(lp, w.blocks[0], z, t, ev_bounds.cap[w.blocks[0].s0])
        plan = self.window_plan(t, z, lp, w, moers, ev_bounds)
        self.solves += 1
        self.solve_s += time.perf_counter() - t0
        if self.keep_plans:
            self.plans.append(plan)
        return plan

    def window_futures(
        self, t: int, H: int, moer: np.ndarray, need_all: np.ndarray, left_all: np.ndarray
    ) -> tuple[np.ndarray, WindowSessions]:
        """What the window LP plans for (a step of :meth:`plan`): ``(moer, sessions)`` for :meth:`window_lp`. Here one
        future: the outlook ``moer`` (``(H,)`` kg/kWh) and :meth:`sessions` (from each socket's remaining energy and
        steps, ``(N,)`` each), one block."""
        return moer, self.sessions(t, H, need_all, left_all)

    def decision_lp(self, w: WindowLP) -> LP:
        """The LP solved for the window LP ``w`` (a step of :meth:`plan`): here ``w.lp`` itself."""
        return w.lp

    def window_plan(self, t: int, z: np.ndarray, lp: LP, w: WindowLP, moer: np.ndarray, ev_bounds: EVBounds) -> Plan:
        """The :class:`Plan` of the solution ``z`` of :meth:`decision_lp`'s ``lp`` (a step of :meth:`plan`): here
        :meth:`plan_of` its one block, for the outlook ``moer`` (``(H,)``) and the env's bounds of this step."""
        return self.plan_of(t, z, lp, w.blocks[0], moer, ev_bounds)

    def step0_bounds(self, need_all: np.ndarray, left_all: np.ndarray) -> EVBounds:
        """The env's per-socket power bounds of this step (``EVHubVectorEnv._ev_bounds``), from each socket's
        remaining energy (kWh) and steps to departure, ``(N,)`` each."""
        cfg = self.data.config
        return EVBounds(*step_bounds(need_all, left_all, self.data.socket_kw, cfg.dt_h, cfg.ev.deadline_floor))

    def window_lp(
        self, t: int, H: int, moer: np.ndarray, energy_kwh: float, sessions: WindowSessions, ev_bounds: EVBounds
    ) -> WindowLP:
        """The window LP of the module docstring at step ``t`` over ``H`` steps.

        Args:
            t, H: the window's first step and its steps.
            moer: the MOER outlook, kg/kWh, ``(H,)``; or ``(K, H)``, one per block (the scenarios of
                :mod:`pipeline.control.scenario`): ``K`` window LPs at once, as
                :func:`~pipeline.control.oracle.assemble_lp`'s blocks, the same LP as the ``K`` built one by one and
                stacked block-diagonally.
            energy_kwh: the BESS energy at the window's start, kWh.
            sessions: the window's sessions (:meth:`sessions`; with ``K`` blocks, each block's plugged EVs first).
            ev_bounds: the env's bounds on each socket's EV power at step 0 (:meth:`step0_bounds`).

        Returns:
            the :class:`WindowLP`: the oracle's LP with the deferral, terminal value, tie-breaks and the env's step-0
            bounds, and one :class:`WindowBlock` per block.
        """
        d = self.data
        cfg = d.config
        b, dt = cfg.bess, cfg.dt_h
        arr, end = sessions.arrival, sessions.departure
        moer_k = np.atleast_2d(moer)  # (K, H)
        K = moer_k.shape[0]
        dep = np.minimum(end, H)
        p_max = d.socket_kw[sessions.socket] * sessions.weight  # (S,) kW, its socket's own power (its share of it)
        defer = np.minimum(sessions.energy_kwh, p_max * dt * np.maximum(end - H, 0))
        lens = self.periods(H, t)  # (P,) steps of each period
        P = len(lens)
        pv, load = d.pv_kw[t : t + H], d.load_kw[t : t + H]
        step_h, arr_p, dep_p = None, arr, dep
        if P < H:  # move blocking: each period's mean power and MOER, each session in the periods it touches
            starts = np.cumsum(lens) - lens
            period_of = np.repeat(np.arange(P), lens)  # (H,) the period of each step

            def mean(x: np.ndarray) -> np.ndarray:
                return np.add.reduceat(x, starts, axis=-1) / lens

            pv, load, moer_k, step_h = mean(pv), mean(load), mean(moer_k), lens * dt
            arr_p, dep_p = period_of[arr], period_of[dep - 1] + 1
        lp = assemble_lp(
            cfg,
            pv,
            load,
            moer_k,
            energy_kwh,
            arr_p,
            dep_p,
            sessions.energy_kwh,
            p_max=p_max,
            defer_kwh=defer,
            block=sessions.block,
            n_blocks=K,
            step_h=step_h,
        )
        if P < H:  # a session present for part of a period draws at most that part of its power over the period
            ps, pp = lp.p_sess, lp.p_step
            present = np.minimum(dep[ps], starts[pp] + lens[pp]) - np.maximum(arr[ps], starts[pp])
            lp.bounds[lp.p_col, 1] *= present / lens[pp]
        self._add_window_costs(lp, t, H, moer, sessions.block, dt if step_h is None else step_h)
        room = (
            cfg.grid.import_limit_kw
            + pv[0]
            - load[0]
            + min(b.power_kw, max(energy_kwh - b.soc_min * b.capacity_kwh, 0.0) * b.eta_discharge / dt)
        )
        col0, s0, b0, dep0 = self._bound_step0(lp, sessions, arr_p, dep_p, ev_bounds, room)
        lens_or_none = None if P == H else lens
        blocks = [
            WindowBlock(lp.off.block(m), col0[b0 == m], s0[b0 == m], dep0[b0 == m], P, lens_or_none) for m in range(K)
        ]
        return WindowLP(lp, blocks)

    def _add_window_costs(self, lp: LP, t: int, H: int, moer: np.ndarray, blk: np.ndarray, dt_p) -> None:
        """Add the tie-breaks, the deferral's cost and the terminal value (module docstring) to the costs ``lp.c`` of
        :meth:`window_lp`'s LP at step ``t`` over ``H`` steps, in place: ``moer`` its outlook per step (``(H,)`` or
        ``(K, H)``, kg/kWh), ``blk`` each session's block (``(S,)``), ``dt_p`` each period's hours (a float where
        every period is one step, else ``(P,)``)."""
        off, c, P = lp.off, lp.c, lp.T
        steps = np.arange(P)
        ramp = steps / P

        def at(first: np.ndarray) -> np.ndarray:  # (K, P) columns of a per-period variable
            return first[:, None] + steps

        c[at(off.g)] *= 1.0 - IMPORT_DISCOUNT * ramp
        c[at(off.ch)] += EPS_CYCLE * dt_p
        c[at(off.dis)] += EPS_CYCLE * dt_p
        c[at(off.u)] += EPS_CURTAIL * dt_p * (1.0 - 0.5 * ramp)
        c[at(off.x)] += EPS_CURTAIL * dt_p * (1.0 - 0.5 * ramp)  # export: a surplus, like curtailment
        # (the export credit, -MOER per kWh with grid.export_credit = "moer", is already in assemble_lp's cost)
        mean_moer = np.array([float(m.mean()) for m in np.atleast_2d(moer)])  # (K,) each block's mean over the window
        c[off.defer[blk] + lp.s_local] = mean_moer[blk]
        if t + H < self.data.num_steps:  # energy left in the battery when the window ends is worth what it displaces
            c[off.E + P - 1] -= self.params.terminal_value * self.data.config.bess.eta_discharge * mean_moer

    @staticmethod
    def _bound_step0(
        lp: LP, sessions: WindowSessions, arr_p: np.ndarray, dep_p: np.ndarray, ev_bounds: EVBounds, room: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Bound each plugged EV's step-0 column of :meth:`window_lp`'s LP ``lp`` (in place) by the env's floor and
        cap, the floors of each block scaled down together where they exceed ``room`` (kW: the import limit, PV less
        load and what the battery can give in step 0), as the env cuts them. ``arr_p``, ``dep_p``: each session's
        first and last + 1 period, ``(S,)``.

        Returns:
            ``(col0, s0, b0, dep0)``: each plugged EV's step-0 column, socket, block and last period + 1, ``(P,)``
            int64 each.
        """
        stay = dep_p - arr_p
        first = lp.p_col[np.cumsum(stay) - stay] if len(stay) else np.zeros(0, np.int64)
        is_plugged = ~sessions.expected
        col0, s0 = first[is_plugged], sessions.socket[is_plugged]
        b0, dep0 = sessions.block[is_plugged], dep_p[is_plugged]
        floor = ev_bounds.floor[s0]
        for m in range(lp.K) if len(floor) else ():  # the env cuts the floors too when the import limit binds
            sel = b0 == m
            f = floor[sel]
            if f.sum() > max(room, 0.0):
                floor[sel] = f * max(room, 0.0) / f.sum()
        lp.bounds[col0, 0] = floor
        lp.bounds[col0, 1] = ev_bounds.cap[s0]
        return col0, s0, b0, dep0

    def plan_of(self, t: int, z: np.ndarray, lp: LP, block: WindowBlock, moer: np.ndarray, ev_bounds: EVBounds) -> Plan:
        """The :class:`Plan` of ``block`` (one of :meth:`window_lp`'s) in the solution ``z`` of the LP ``lp``, for its
        MOER outlook ``moer`` (``(H,)`` kg/kWh) and the env's bounds of this step (:meth:`step0_bounds`)."""
        cfg = self.data.config
        b, dt, pmax, N = cfg.bess, cfg.dt_h, self.data.socket_kw, cfg.ev.n_sockets
        col0, s0, H = block.col0, block.s0, block.H
        off, bounds = block.off, lp.bounds
        step0 = lambda col: float(min(max(z[col], bounds[col, 0]), bounds[col, 1]))  # noqa: E731  (np.clip's value)
        ch, dis = step0(off.ch), step0(off.dis)
        ev = np.zeros(N)
        ev[s0] = np.clip(z[col0], bounds[col0, 0], bounds[col0, 1])
        action = np.zeros(1 + N)
        action[0] = min(max((ch - dis) / b.power_kw, -1.0), 1.0) if b.power_kw > 0 else 0.0
        cap_all, floor_all = ev_bounds.cap, ev_bounds.floor
        span = cap_all - floor_all
        ok = span > 1e-12
        action[1:][ok] = np.clip((ev[ok] - floor_all[ok]) / span[ok], 0.0, 1.0)
        g = z[off.g : off.g + H] - z[off.x : off.x + H] * (cfg.grid.export_credit == "moer")
        bess_steps = np.maximum(z[off.ch : off.ch + H], 0.0) - np.maximum(z[off.dis : off.dis + H], 0.0)
        bess_steps[0] = ch - dis
        ev_steps = np.zeros((N, H))
        for i, c0, n in zip(s0, col0, block.dep0):  # a plugged EV's columns: periods 0 .. its departure
            ev_steps[i, :n] = np.clip(z[c0 : c0 + n], 0.0, pmax[i])
        ev_steps[:, 0] = ev
        lens = block.period_steps
        if lens is None:
            co2 = float((g * moer).sum() * dt)
        else:  # periods of several steps: their CO2 at their mean MOER; the schedules per step
            co2 = float((g * np.add.reduceat(moer, np.cumsum(lens) - lens)).sum() * dt)
            bess_steps, ev_steps = np.repeat(bess_steps, lens), np.repeat(ev_steps, lens, axis=1)
        return Plan(
            t=t,
            action=action,
            grid_import_kw=step0(off.g),
            grid_export_kw=step0(off.x),
            pv_curtailed_kw=step0(off.u),
            bess_charge_kw=ch,
            bess_discharge_kw=dis,
            ev_kw=ev,
            co2_planned_kg=co2,
            bess_kw_steps=bess_steps,
            ev_kw_steps=ev_steps,
        )

    def apply_env_rules_at_step0(self, lp: LP, block: WindowBlock, z: np.ndarray, t: int, cap0) -> np.ndarray:
        """Make step 0 of a plan what the env does with it when exported energy is credited.

        Two dispatch rules of the env are not in the LP: the battery discharges only into the site's deficit (in a
        step where it discharges nothing is exported or curtailed), and with ``ev.surplus_to_ev`` PV left over goes
        to the plugged EVs, up to their caps, before any is exported or curtailed. Without a credit the LP keeps
        both of its own accord (export earns nothing, and the tie-breaks prefer using PV now); with one it may plan
        to export while discharging or while holding EVs below their caps (and charge them later), which the env
        would not carry out. Where step 0 of the plan breaks a rule, it is solved both ways: (a) no discharge and,
        with ``surplus_to_ev``, every plugged EV at its cap; (b) no export and no curtailment; the cheaper plan is
        kept. Later steps of the window keep the LP's relaxation.

        Args:
            lp, block: the LP solved (:meth:`decision_lp`) and the block whose step 0 is carried out
                (:meth:`window_lp`'s; with several blocks, the non-anticipativity rows tie the others' step 0 to it).
            z: the LP's solution, ``(n,)``.
            cap0: env cap (kW) of each plugged EV's step-0 power (column ``block.col0``), ``(P,)``.

        Returns:
            ``z`` where step 0 keeps both rules, else the cheaper of the two solutions, ``(n,)``.

        Raises:
            RuntimeError: neither way has an optimum.
        """
        off, col0, tol = block.off, block.col0, 1e-7
        c, bounds = lp.c, lp.bounds
        surplus = z[off.x] + z[off.u]
        below_cap = len(col0) > 0 and float((cap0 - z[col0]).max()) > tol
        to_ev = self.data.config.ev.surplus_to_ev
        if not ((z[off.dis] > tol and surplus + z[off.ch] > tol) or (to_ev and surplus > tol and below_cap)):
            return z
        a, b = bounds.copy(), bounds.copy()
        a[off.dis, 1] = 0.0
        if to_ev:
            a[col0, 0] = cap0
        b[off.x, 1] = b[off.u, 1] = 0.0
        best = None
        for bnd in (a, b):
            zz = self.solve(c, lp.A_eq, lp.b_eq, bnd, t, strict=False)
            if zz is not None and (best is None or c @ zz < c @ best):
                best = zz
        if best is None:
            raise RuntimeError(
                f"MPC LP at step {t} of split '{self.data.split}' not solved under the env's dispatch rules"
            )
        return best

    def lp_keys(
        self, t: int, lp: LP, sessions: WindowSessions, period_steps: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """What each column and row of the LP ``lp`` (:meth:`window_lp`'s, or :meth:`decision_lp`'s with
        non-anticipativity rows after the blocks') at step ``t`` stands for, as :func:`lp_key` keys that are the same in
        the next hour's LP where the variable or row is the same (the basis :attr:`warm_start` carries over): its
        :class:`KeyKind`, its block (scenario), and the absolute step, or the session (socket and absolute arrival
        step; a plugged EV: its socket) and the step within it; a non-anticipativity row, its index. Equal keys
        within one LP are harmless (a worse start).

        Args:
            sessions: the LP's sessions, as given to :meth:`window_lp`.
            period_steps: the steps of each of the LP's periods (:attr:`WindowBlock.period_steps`; None: one each):
                a period is keyed by its first step.

        Returns:
            ``(column keys, row keys)``, ``(n,)`` and ``(rows,)`` int64.
        """
        H, off, row_off = lp.T, lp.off, lp.row_off
        arr, blk, expected = sessions.arrival, sessions.block, sessions.expected
        code = np.where(expected, KEY_SOCKETS + sessions.socket, sessions.socket)  # (S,) plugged and expected apart
        when = np.where(expected, t + arr, 0)  # an expected arrival's absolute step (0: plugged)
        steps = np.arange(H, dtype=np.int64)
        at = t + steps  # the absolute step of each period (its first step)
        if period_steps is not None:
            at = t + np.cumsum(period_steps) - period_steps
        ps, step, p_col = lp.p_sess, at[lp.p_step], lp.p_col
        m = np.arange(lp.K, dtype=np.int64)[:, None]
        cols = np.empty(len(lp.c), np.int64)
        pb = blk[ps]
        arriving = when[ps] << 10 | np.maximum(step - t - arr[ps], 0)
        cols[p_col] = np.where(
            expected[ps],
            lp_key(KeyKind.ARRIVING_EV, pb, code[ps], arriving),
            lp_key(KeyKind.PLUGGED_EV, pb, code[ps], step),
        )
        for kind, first in zip(STEP_KINDS, off.per_step()):
            cols[first[:, None] + steps] = lp_key(kind, m, 0, at)
        s_col = lp.s_local
        cols[off.slack[blk] + s_col] = lp_key(KeyKind.SLACK, blk, code, when)
        if off.defer is not None:
            cols[off.defer[blk] + s_col] = lp_key(KeyKind.DEFER, blk, code, when)
        rows = np.empty(len(lp.b_eq), np.int64)
        rows[row_off[:, None] + steps] = lp_key(KeyKind.BALANCE, m, 0, at)
        rows[row_off[:, None] + H + steps] = lp_key(KeyKind.STORAGE, m, 0, at)
        rows[row_off[blk] + 2 * H + s_col] = lp_key(KeyKind.EV_ENERGY, blk, code, when)
        n = lp.nonanticipativity_rows
        rows[len(rows) - n :] = lp_key(KeyKind.NONANTICIPATIVITY, 0, 0, np.arange(n, dtype=np.int64))
        return cols, rows

    def solve(self, c, A_eq, b_eq, bounds, t: int, strict: bool = True, keys: tuple | None = None) -> np.ndarray | None:
        """Solve the LP with HiGHS (:class:`~pipeline.control.highs.LPSolver`); the solution, or None when it has no
        optimum and ``strict`` is False.

        Args:
            c, A_eq, b_eq, bounds: the LP (:class:`~pipeline.control.oracle.LP`'s fields), ``(n,)``, ``(rows, n)``
                sparse, ``(rows,)`` and ``(n, 2)``.
            t: the step (named in errors).
            keys: ``(column keys, row keys)`` of the LP (:meth:`lp_keys`): with :attr:`warm_start`, HiGHS starts from
                the last keyed solve's basis (columns and rows it does not know start at their lower bound and basic)
                and this solve's basis is kept for the next; None: a cold start, nothing kept.

        Returns:
            the solution, ``(n,)`` float64, or None.

        Raises:
            RuntimeError: no optimum and ``strict``.
        """
        z = self.solver.solve(c, A_eq, b_eq, bounds, keys if self.warm_start else None)
        if z is None and strict:
            raise RuntimeError(
                f"MPC LP at step {t} of split '{self.data.split}' not solved: HiGHS {self.solver.status_text()}"
            )
        return z

    # ---------------------------------------------------------------- as a policy
    def __call__(self, obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
        """Socket action ``(1, 1 + n_sockets)`` for env 0's current step, from its state (:meth:`act`)."""
        action = self.act(
            int(env.t[0]),
            float(env.energy_kwh[0]),
            env.ev_need_kwh[0].detach().cpu().numpy().astype(np.float64),
            env.steps_left()[0].detach().cpu().numpy(),
        )
        return torch.as_tensor(action, dtype=obs.dtype, device=obs.device)[None]

    def act(self, t: int, energy_kwh: float, ev_need_kwh: np.ndarray, ev_steps_left: np.ndarray) -> np.ndarray:
        """The socket action ``[a_bess, a_1..a_N]`` at step ``t`` from the state (as :meth:`plan` takes it).

        A new plan's first step (:meth:`plan`) when one is due: at every step with ``replan = "step"`` or at hourly
        steps; else at each hour's start and whenever a car has come since the last plan (a socket whose car is not the
        one the plan saw). Between plans the last plan is held: its battery set-point and each plugged car's power for
        this step of its window, mapped to the env's action at this step's floors and caps (:meth:`step0_bounds`).
        """
        left = np.asarray(ev_steps_left, dtype=np.int64)
        held = self._held
        j = None
        if held is not None:
            rule = (self.hour_steps, self.replan, self.replan_on_arrival)
            j = held_step(t, left, held[0], held[2], len(held[1].bess_kw_steps), *rule)
        if j is None:
            plan = self.plan(t, energy_kwh, ev_need_kwh, left)
            self._held = (t, plan, left.copy())
            return plan.action
        plan = held[1]
        now = self.step0_bounds(np.asarray(ev_need_kwh, dtype=np.float64), left)
        bess_power = self.data.config.bess.power_kw
        return held_action(plan.bess_kw_steps[j], plan.ev_kw_steps[:, j], now.cap, now.floor, bess_power)


def run_mpc(
    site: Site | str,
    split: str,
    controller: str = "mpc",
    horizon_h: int | None = None,
    physics_dt_h: float | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, MPCController]:
    """Run an MPC controller over a whole split through the env (socket actions, set-point BESS).

    Args:
        site: a loaded site or anything :func:`envs.site.load_site` accepts.
        split: ``"train"`` or ``"test"``.
        controller: ``"mpc"`` or ``"mpc_perfect"``.
        horizon_h: look-ahead (default: the site's ``mpc.horizon_h``).
        physics_dt_h: simulate the site at that finer step (:func:`envs.kpis.evaluate_policy`).

    Returns:
        ``(kpi_row, traces, controller)`` like :func:`envs.kpis.evaluate_policy` (``train_wall_s = 0``, no
        wall-clock figure in the row), and the controller with its ``solves`` and ``solve_s``.

    Raises:
        KeyError: unknown controller or split.
        RuntimeError: an LP not solved to optimality, or an energy-balance violation in some step.
    """
    if controller not in PERFECT:
        raise KeyError(f"unknown MPC controller {controller!r}: known are {sorted(PERFECT)}")
    site = load_site(site)
    params = PlannerParams.of_site(site.config)
    if horizon_h is not None:
        params = replace(params, horizon_h=int(horizon_h))
    horizon = params.horizon_h
    mpc = MPCController(site.split(split), params, perfect=PERFECT[controller])
    t0 = time.perf_counter()
    kpis, traces = evaluate_policy(
        mpc,
        site,
        split,
        controller,
        action_mode="socket",
        bess_action="setpoint",
        physics_dt_h=physics_dt_h,
        train_wall_s=0.0,
    )
    wall = time.perf_counter() - t0
    print(
        f"{controller} {split}: horizon {horizon} h, {mpc.solves} solves, {mpc.solve_s:.1f} s solving "
        f"({1e3 * mpc.solve_s / max(mpc.solves, 1):.1f} ms per solve), {wall:.1f} s in all; "
        f"CO2 {traces.co2_kg.sum():.1f} kg, unserved {traces.unserved_kwh.sum():.3f} kWh",
        flush=True,
    )
    return kpis, traces, mpc


def simulate(
    site: Site, split: str, controller: str = "mpc", physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`run_mpc` at the site's horizon: ``(kpi_row, traces)`` (the registry's runner)."""
    return run_mpc(site, split, controller, physics_dt_h=physics_dt_h)[:2]
