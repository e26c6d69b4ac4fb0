"""Scenario MPC (``mpc_scenario``): a two-stage stochastic plan over futures drawn from the site's realised past.

At each clock hour :class:`ScenarioMPC` solves one linear program over ``K`` futures of the next ``horizon_h``
hours, future ``k`` with probability ``p_k``: a first step shared by all of them (the one carried out: the battery's
charge and discharge, each plugged EV's power, the grid and curtailment of step 0) and each scenario's own recourse
after it (EV charging of its own arrivals, battery, grid). It hedges against cars that may not come without
``mpc``'s hand-set expected-demand weight, whose right value moves with the regime. Between clock hours (at
sub-hourly steps) it plans again on each arrival, as ``mpc`` does, by ``mpc``'s deterministic window LP of its own
planner parameters (the expected demand at their weight, one MOER outlook) until the next hour's two-stage plan
(``deterministic_within_hour``; :data:`DETERMINISTIC_WITHIN_HOUR`).

What the controller knows at step ``t``:

- the env's state, PV and base load as ``mpc`` knows them (:mod:`pipeline.control.mpc`);
- the MOER outlook of its planner (:meth:`~pipeline.control.mpc.MPCController.moer_outlook`, the learned planners'
  forecast by default). With ``moer_scenarios``, scenario ``k`` adds to it the errors the same forecast made at the
  same leads when issued ``k + 1`` days before (realised MOER minus that forecast; known by ``t`` for leads within a
  day, 0 beyond), clipped at 0; only outlooks the controller issued itself are read, so a run begun mid-split plans on
  the forecast alone for its first days. With ``moer_revisions = s > 0``, scenario ``k`` instead adds, at leads 1 and
  beyond, ``s`` times how the outlook issued ``k + 1`` days before at the same hour was revised one hour later, less
  the mean of those revisions over the scenarios that have one (the scenarios' mean outlook stays the outlook),
  clipped at 0;
- arrivals: scenario ``k`` is the ``k``-th most recent past day of the same day type (weekday or weekend, local time;
  any day without ``demand_day_type``) whose arrivals are realised by ``t``
  (:meth:`~pipeline.control.mpc.MPCController.past_days`): every session that arrived at that hour of that day, moved
  into the window with its stay and its real, unscaled energy. While fewer than ``K`` such days exist the available
  days repeat in turn. With ``scenario_source = "session_model"`` scenario ``k`` is the ``k``-th seeded draw of a
  session model fit on the split's realised past (:mod:`pipeline.control.sessions`).

Each scenario's block is ``mpc``'s window LP (:meth:`~pipeline.control.mpc.MPCController.window_lp`: the oracle's
constraints, deferral past the window, terminal value, tie-breaks, the env's step-0 floors and caps and import-limit
cut), its objective times ``p_k``; the ``K`` blocks are stacked block-diagonally in one build, and
non-anticipativity rows tie the step-0 columns (``ch``, ``dis``, ``g``, ``u``, ``x`` and every plugged EV's first
column) of every scenario to the first one's. HiGHS starts each plan from the last one's basis
(:mod:`pipeline.control.highs`). With ``grid.export_credit = "moer"`` step 0 keeps the env's dispatch rules as
``mpc``'s does. With one scenario equal to ``mpc``'s expected demand and MOER outlook the LP is ``mpc``'s, column for
column.

Parameters:
    n_scenarios (int, past days): ``K`` (:data:`N_SCENARIOS`, 21).
    recency_half_life (float, same-type days): ``p_k`` proportional to ``0.5 ** (k / half_life)``, ``k = 0`` the most
        recent day; 0 (:data:`RECENCY_HALF_LIFE`): every ``p_k = 1 / K``.
    today_bandwidth (float, arrivals per socket group): ``h``; with ``h > 0`` each ``p_k`` is also multiplied by
        ``exp(-d_k / (2 h^2))``, ``d_k`` how far scenario ``k``'s day so far lies from today's
        (:meth:`ScenarioMPC.today_distance`); 0 (:data:`TODAY_BANDWIDTH`): not weighted by today.
    moer_scenarios (bool), moer_revisions (float, dimensionless): the MOER scenarios above (:data:`MOER_SCENARIOS`,
        :data:`MOER_REVISIONS`: off).
    scenario_source (str): ``"past_days"`` or ``"session_model"`` (:data:`SCENARIO_SOURCE`, :data:`SESSION_MODEL`).
    deterministic_within_hour (bool): the plans within the hour by the deterministic LP
        (:data:`DETERMINISTIC_WITHIN_HOUR`).
    params (:class:`~pipeline.control.mpc.PlannerParams`): the planner's (:func:`base_params`); its expected-demand
        weight and days count only in the plans within the hour.

Returns:
    Each plan, a :class:`~pipeline.control.mpc.Plan`: step 0 (shared) and, over the window, the probability-weighted
    mean of the scenarios' battery and plugged-EV power; ``co2_planned_kg`` is the expected CO2. :func:`simulate`: a
    whole split's KPI row and traces.

References:
    J. R. Birge and F. Louveaux, *Introduction to Stochastic Programming*, 2nd ed., Springer, 2011 (two-stage
    programs with recourse, non-anticipativity). How ``K``, the half-life and the MOER scenarios were chosen (on the
    train split only) and what each is worth: ``docs/lab/scenario-mpc.md``; results: ``docs/findings.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import scipy.sparse as sp

from envs.config import SiteConfig
from envs.site import Site, SplitData, load_site
from pipeline.control import tuning
from pipeline.control.backtest import WindowResult, run_controller
from pipeline.control.highs import LPSolver
from pipeline.control.mpc import EVBounds, MPCController, Plan, PlannerParams, WindowLP, WindowSessions
from pipeline.control.oracle import LP
from pipeline.control.sessions import SessionModel

N_SCENARIOS = 21
"""``K``, past days (scenarios) per plan, chosen on the train split (``docs/lab/scenario-mpc.md``)."""
SHARED_BESS_STEPS = 1
"""The window's first steps whose battery schedule every scenario shares (1: the two-stage plan, only step 0
shared), chosen on the train split (``docs/agents.md``)."""
RECENCY_HALF_LIFE = 0.0
"""Half-life of the scenarios' probabilities in same-type days (0: every scenario ``1 / K``), chosen on the train
split."""
MOER_SCENARIOS = False
"""Whether each scenario adds the forecast's past errors to the MOER outlook, chosen on the train split."""
MOER_REVISIONS = 0.0
"""The scale of the outlook's past one-hour revisions each scenario adds to it (0: none), chosen on the train split
(``docs/agents.md``)."""
TODAY_BANDWIDTH = 0.0
"""``h``, the bandwidth of the scenarios' weights by today's arrivals (:meth:`ScenarioMPC.today_distance`; 0: not
weighted by today), chosen on the train split (``docs/agents.md``)."""
SCENARIO_SOURCE = "past_days"
"""Where each scenario's arrivals come from: ``"past_days"`` (the ``k``-th most recent past day of the same type) or
``"session_model"`` (a draw of :class:`~pipeline.control.sessions.SessionModel` with :data:`SESSION_MODEL`), chosen on
the train split (``docs/agents.md``)."""
SESSION_MODEL = {"half_life_days": 112.0, "band_h": 3.0, "dispersion": True}
"""The session model's settings, chosen by its log-likelihood on held-out train-split weeks (``docs/agents.md``)."""
DETERMINISTIC_WITHIN_HOUR = True
"""Whether the plans made within an hour (on an arrival, at sub-hourly steps) solve ``mpc``'s deterministic window LP
instead of the two-stage one, chosen on the train split at 15-minute steps (6,834.24 against 6,838.17 kg over the
whole split for 28% less CPU time: ``docs/lab/scenario-mpc.md``)."""


TUNED_SPACE = tuple(p for p in tuning.SPACE if p.name in ("terminal_value", "moer_contrast", "moer_bias"))
"""The planner's parameters :func:`tune` searches for ``mpc_scenario`` (the ranges of
:data:`pipeline.control.tuning.SPACE`): the ones it reads and no grid chose (``K``, the horizon and the day type were
chosen on the train split by grids; the demand weight and days count only in its plans within the hour)."""
NEAR_SPACE = (tuning.Param("moer_near_contrast_1_2h", 0.5, 2.0), tuning.Param("moer_near_contrast_3_5h", 0.5, 2.0))
"""The MOER outlook's contrast at leads 1-2 h and 3-5 h (:class:`~pipeline.control.mpc.PlannerParams`), chosen by the
plan's CO2 (``tune(space=NEAR_SPACE)``): from half to twice the forecast's own deviation from the current hour, 1 (the
forecast as it is) the start and the centre on a log scale. Tuned on caltech and not adopted (docs/lab/scenario-mpc.md):
:class:`~pipeline.control.mpc.PlannerParams`' defaults keep 1."""


def base_params(site_config: SiteConfig) -> PlannerParams:
    """The planner ``mpc_scenario`` stands on: ``mpc``'s ``[mpc]`` values on the learned MOER forecast
    (:meth:`~pipeline.control.mpc.PlannerParams.learned_start`), past days drawn by day type, terminal value 1 (as
    ``mpc_rl_start``'s planner; the demand weight counts only in the plans within the hour)."""
    return replace(PlannerParams.learned_start(site_config), demand_day_type=True, terminal_value=1.0)


@dataclass
class ScenarioMPC(MPCController):
    """A two-stage stochastic receding-horizon controller (module docstring); a policy ``(obs, env) -> action``.

    Its :meth:`~pipeline.control.mpc.MPCController.plan` is ``mpc``'s with three steps of its own: the scenarios'
    futures (:meth:`window_futures`), the two-stage LP (:meth:`decision_lp`) and the plan over the scenarios
    (:meth:`window_plan`).

    Args (besides :class:`~pipeline.control.mpc.MPCController`'s; ``perfect``, ``perfect_moer`` and
    ``perfect_arrivals`` must stay False: its scenarios are its forecast):
        n_scenarios: ``K``, at least 1.
        recency_half_life: half-life of the scenarios' probabilities, in same-type days (0: uniform).
        today_bandwidth: ``h`` of the weights by today's arrivals (module docstring; 0: none).
        moer_scenarios: add the forecast's past errors at each lead to each scenario's MOER outlook.
        moer_revisions: the scale of the outlook's past one-hour revisions, centred, added to each scenario's MOER
            outlook at leads from 1 (module docstring; 0: none).
        scenario_source: ``"past_days"`` or ``"session_model"`` (:data:`SCENARIO_SOURCE`).
        seed: the session model's draws' generator (``"session_model"`` only).
        warm_start: start each hour's HiGHS from the last hour's basis (:class:`~pipeline.control.mpc.MPCController`).
        shared_bess_steps: the window's first steps whose battery charge and discharge every scenario shares (1: the
            first step alone, the two-stage plan; more: the battery's next hours are one schedule for every scenario,
            while the EVs, grid and curtailment after step 0 remain each scenario's own).
        deterministic_within_hour: plan at steps within the hour (on arrivals, at sub-hourly steps) by ``mpc``'s
            deterministic window LP, on a HiGHS of its own warm-started from the last such plan
            (:data:`DETERMINISTIC_WITHIN_HOUR`); False: by the two-stage LP, as at each hour's start.

    Attributes:
        lp_shape: ``(rows, columns, nonzeros)`` of the last LP solved.
        lp_total: those of every LP solved, summed (``lp_total / solves``: the mean LP).
        prob: the scenarios' probabilities of the last plan, ``(K,)`` (:meth:`probabilities` at its step).

    Raises:
        ValueError: ``n_scenarios < 1``, ``shared_bess_steps < 1``, a negative half-life or bandwidth, a ``perfect``
            flag, an unknown scenario source, weights by today with the session model's scenarios (they have no past
            day), or a negative ``moer_revisions`` or one with ``moer_scenarios``.
    """

    n_scenarios: int = N_SCENARIOS
    recency_half_life: float = RECENCY_HALF_LIFE
    today_bandwidth: float = TODAY_BANDWIDTH
    moer_scenarios: bool = MOER_SCENARIOS
    moer_revisions: float = MOER_REVISIONS
    scenario_source: str = SCENARIO_SOURCE
    seed: int = 1
    warm_start: bool = True
    shared_bess_steps: int = SHARED_BESS_STEPS
    deterministic_within_hour: bool = DETERMINISTIC_WITHIN_HOUR

    def __post_init__(self):
        perfect = self.perfect or self.perfect_moer or self.perfect_arrivals
        if self.n_scenarios < 1 or not self.recency_half_life >= 0 or perfect:
            raise ValueError(
                f"ScenarioMPC: n_scenarios >= 1, recency_half_life >= 0 and no perfect, perfect_moer or "
                f"perfect_arrivals required, got {self.n_scenarios}, {self.recency_half_life}, {perfect}"
            )
        if self.shared_bess_steps < 1:
            raise ValueError(f"ScenarioMPC: shared_bess_steps >= 1 required, got {self.shared_bess_steps}")
        if self.scenario_source not in ("past_days", "session_model"):
            raise ValueError(
                f"ScenarioMPC: scenario_source 'past_days' or 'session_model', got {self.scenario_source!r}"
            )
        if not self.today_bandwidth >= 0 or (self.today_bandwidth > 0 and self.scenario_source != "past_days"):
            raise ValueError(
                f"ScenarioMPC: today_bandwidth >= 0, and 0 unless scenario_source is 'past_days', got "
                f"{self.today_bandwidth} with {self.scenario_source!r}"
            )
        if not self.moer_revisions >= 0 or (self.moer_revisions > 0 and self.moer_scenarios):
            raise ValueError(
                f"ScenarioMPC: moer_revisions >= 0, and 0 with moer_scenarios, got {self.moer_revisions} with "
                f"moer_scenarios={self.moer_scenarios}"
            )
        super().__post_init__()
        self._model = SessionModel(self.data, **SESSION_MODEL) if self.scenario_source == "session_model" else None
        self._rng = np.random.default_rng(self.seed)
        self._issued: dict[int, np.ndarray] = {}  # step -> the MOER outlook issued then (kg/kWh)
        self.lp_shape = (0, 0, 0)
        self.lp_total = np.zeros(3, np.int64)
        self.prob = self.probabilities()
        self._group_of_socket = self.data.config.ev.group_of_socket()  # (N,)
        self._within_hour = False  # whether the plan being made is one within the hour by the deterministic LP
        self._within_hour_solver = LPSolver(self.presolve)

    # ---------------------------------------------------------------- what is known at step t
    def probabilities(self, t: int | None = None, days: np.ndarray | None = None) -> np.ndarray:
        """The scenarios' probabilities, ``(K,)`` float64 summing to 1 (module docstring): by recency, times, with
        ``today_bandwidth > 0`` and a step ``t``, the kernel of :meth:`today_distance` for the scenarios' past days
        ``days`` (:meth:`scenario_days`' ``(K, H)``; computed when not given)."""
        k = np.arange(self.n_scenarios, dtype=np.float64)
        w = 0.5 ** (k / self.recency_half_life) if self.recency_half_life > 0 else np.ones_like(k)
        if self.today_bandwidth > 0 and t is not None:
            if days is None:
                days = self.scenario_days(t, min(self.H, self.data.num_steps - t))
            w = w * np.exp(-self.today_distance(t, days) / (2.0 * self.today_bandwidth**2))
        return w / w.sum()

    def today_distance(self, t: int, days: np.ndarray) -> np.ndarray:
        """How far each scenario's day is from today so far, ``(K,)`` float64, >= 0: with ``x_g`` the sessions that
        arrived at socket group ``g`` from the last local midnight up to step ``t`` (inclusive: realised by ``t``) and
        ``y_g`` those over the same steps ``j`` days before, ``j`` the scenario's past day for the window's next step
        (``days[:, 1]``, :meth:`scenario_days`), ``sum_g (x_g - y_g)^2 / (x_g + y_g + 1)`` (a chi-square distance of
        counts: a difference of one arrival weighs more on a quiet day than on a busy one). 0 for a scenario without
        a past day and for a one-step window."""
        out = np.zeros(self.n_scenarios)
        if days.shape[1] < 2:
            return out
        m0, G = self.data.last_midnight(t), len(self.data.config.ev.groups)
        x = self._group_arrivals(m0, t, G)
        for m, j in enumerate(days[:, 1].tolist()):
            if j > 0:
                y = self._group_arrivals(m0 - j * self.day_steps, t - j * self.day_steps, G)
                out[m] = float(np.sum((x - y) ** 2 / (x + y + 1.0)))
        return out

    def _group_arrivals(self, a: int, b: int, n_groups: int) -> np.ndarray:
        """Sessions arriving per socket group over steps ``[max(a, 0), b]``, ``(G,)`` float64."""
        arrived = (self.data.arrival_stay_steps[max(a, 0) : b + 1] > 0).sum(axis=0)  # (N,)
        return np.bincount(self._group_of_socket, weights=arrived, minlength=n_groups).astype(np.float64)

    def scenario_days(self, t: int, H: int) -> np.ndarray:
        """The past day of each scenario for each step of the window: ``(K, H)`` int64 day offsets ``j`` (the source of
        step ``t + k`` is step ``t + k - j * day``, realised by ``t``), 0 where no past day exists (and at ``k = 0``,
        whose arrivals are the plugged EVs)."""
        K = self.n_scenarios
        out = np.zeros((K, H), np.int64)
        for k, js in enumerate(self.past_days(t, H, K, same_type=self.params.demand_day_type)):
            if len(js):
                out[:, k] = js[np.arange(K) % len(js)]
        return out

    def scenario_sessions(self, t: int, H: int, need: np.ndarray, steps_left: np.ndarray) -> list[WindowSessions]:
        """Each scenario's sessions in the window, ``K`` :class:`~pipeline.control.mpc.WindowSessions` of one block
        each: the plugged EVs (from each socket's remaining energy, kWh, and steps to departure, ``(N,)`` each), then
        the scenario's arrivals (weight 1): its past day's (``"past_days"``) or the session model's draw
        (``"session_model"``, fit on what was realised before ``t``'s day and the day's arrivals up to ``t``)."""
        d = self.data
        plugged = WindowSessions.plugged(need, steps_left)
        if self._model is not None:
            arrivals = self._model.draw(t, H, self.n_scenarios, self._rng, steps_left=steps_left)
        else:
            days = self.scenario_days(t, H)
            k = np.arange(H)
            arrivals = []
            for m in range(self.n_scenarios):
                ks = k[days[m] > 0]
                src = t + ks - days[m, ks] * self.day_steps  # (n,) source steps, each <= t
                r, i = np.nonzero(d.arrival_stay_steps[src] > 0)
                a = ks[r]
                stay, energy = d.arrival_stay_steps[src[r], i], d.arrival_need_kwh[src[r], i]
                arrivals.append(WindowSessions.arrivals(a, a + stay, energy, i))
        return [WindowSessions.concat([plugged, x]) for x in arrivals]

    def scenario_moer(self, t: int, H: int, moer: np.ndarray) -> np.ndarray:
        """Each scenario's MOER over the window, ``(K, H)`` kg/kWh: the outlook ``moer`` (``(H,)``), plus, with
        ``moer_scenarios``, scenario ``k``'s past error at each lead, or with ``moer_revisions``, its past one-hour
        revision (module docstring). Only outlooks this controller issued itself and MOER realised before ``t`` are
        read."""
        out = np.repeat(moer[None], self.n_scenarios, 0)
        if self.moer_revisions > 0:
            rev = np.zeros((self.n_scenarios, H - 1))
            have = np.zeros(self.n_scenarios, bool)
            for m in range(self.n_scenarios):
                u = t - (m + 1) * self.day_steps
                a, b = self._issued.get(u), self._issued.get(u + 1)
                if a is not None and b is not None:  # issued with this H: leads 1..H-1, step u + j for j = 1..H-1
                    rev[m], have[m] = b[: H - 1] - a[1:H], True
            if have.any():
                rev[have] -= rev[have].mean(0)
                out[:, 1:] = np.maximum(out[:, 1:] + self.moer_revisions * rev, 0.0)
            return out
        if not self.moer_scenarios:
            return out
        for m in range(self.n_scenarios):
            u = t - (m + 1) * self.day_steps
            past = self._issued.get(u)
            if past is None:
                continue
            n = min(H, len(past), t - u)  # leads whose target u + k lies before t
            out[m, :n] = np.maximum(moer[:n] + self.data.moer[u : u + n] - past[:n], 0.0)
        return out

    # ---------------------------------------------------------------- one solve: the steps of MPCController.plan
    def plan(self, t: int, energy_kwh: float, ev_need_kwh: np.ndarray, ev_steps_left: np.ndarray) -> Plan:
        """:meth:`~pipeline.control.mpc.MPCController.plan` by the two-stage LP at an hour's start; at a step within
        the hour with ``deterministic_within_hour``, by the deterministic window LP on its own HiGHS (the steps below
        take their one-future branch)."""
        self._within_hour = self.deterministic_within_hour and t % self.hour_steps != 0
        hour_solver = self.solver
        if self._within_hour:
            self.solver = self._within_hour_solver
        try:
            return super().plan(t, energy_kwh, ev_need_kwh, ev_steps_left)
        finally:
            self.solver = hour_solver
            self._within_hour = False

    def window_futures(
        self, t: int, H: int, moer: np.ndarray, need_all: np.ndarray, left_all: np.ndarray
    ) -> tuple[np.ndarray, WindowSessions]:
        """The scenarios the window LP plans for (a step of :meth:`~pipeline.control.mpc.MPCController.plan`): each
        one's MOER (:meth:`scenario_moer` of the outlook ``moer``, ``(H,)``) and sessions (:meth:`scenario_sessions`,
        from each socket's remaining energy and steps, ``(N,)`` each), as ``(moers, sessions)``: ``(K, H)`` kg/kWh and
        the scenarios' sessions one after another, scenario ``k``'s in block ``k``. Sets :attr:`prob`
        (:meth:`probabilities` at ``t``). With ``moer_scenarios`` or ``moer_revisions`` the outlook is kept for later
        hours' scenarios. Within the hour (:meth:`plan`): ``mpc``'s one future."""
        if self.moer_scenarios or self.moer_revisions > 0:
            self._issued[t] = moer
            self._issued.pop(t - (self.n_scenarios + 1) * self.day_steps - 1, None)
        if self._within_hour:
            return super().window_futures(t, H, moer, need_all, left_all)
        self.prob = self.probabilities(t)
        moers = self.scenario_moer(t, H, moer)
        return moers, WindowSessions.concat(self.scenario_sessions(t, H, need_all, left_all), blocks=True)

    def decision_lp(self, w: WindowLP) -> LP:
        """The two-stage LP of the scenarios' window LP ``w`` (:meth:`two_stage` with :attr:`prob`); within the hour
        (:meth:`plan`), ``w``'s one LP."""
        return w.lp if self._within_hour else self.two_stage(w, self.prob, self.shared_bess_steps)

    def window_plan(self, t: int, z: np.ndarray, lp: LP, w: WindowLP, moer: np.ndarray, ev_bounds: EVBounds) -> Plan:
        """The plan of the two-stage solution ``z``: step 0 (shared) and, over the window, the probability-weighted
        mean of the scenarios' battery and plugged-EV power and of their planned CO2 (each scenario's
        :meth:`~pipeline.control.mpc.MPCController.plan_of` for its MOER ``moer[k]``, ``moer`` ``(K, H)``); counts the
        LP in :attr:`lp_shape` and :attr:`lp_total`. Within the hour (:meth:`plan`): the plan of ``w``'s one block for
        the outlook ``moer`` (``(H,)``)."""
        self.lp_shape = (*lp.A_eq.shape, lp.A_eq.nnz)
        self.lp_total += self.lp_shape
        if self._within_hour:
            return self.plan_of(t, z, lp, w.blocks[0], moer, ev_bounds)
        prob = self.prob
        plans = [self.plan_of(t, z, lp, b, moer[m], ev_bounds) for m, b in enumerate(w.blocks)]
        plan = plans[0]
        plan.co2_planned_kg = float(sum(p * q.co2_planned_kg for p, q in zip(prob, plans)))
        plan.bess_kw_steps = sum(p * q.bess_kw_steps for p, q in zip(prob, plans))
        plan.ev_kw_steps = sum(p * q.ev_kw_steps for p, q in zip(prob, plans))
        return plan

    @staticmethod
    def two_stage(w: WindowLP, prob: np.ndarray, shared_bess_steps: int = 1) -> LP:
        """The two-stage LP of the scenarios' window LPs (:meth:`~pipeline.control.mpc.MPCController.window_lp`'s
        ``w`` with ``K`` blocks) with probabilities ``prob`` (``(K,)``): each block's costs times its ``p_k``, and
        non-anticipativity rows ``z0[j] - zk[j] = 0`` after the blocks' rows for each step-0 column ``j`` of scenario
        0 (``ch, dis, g, u, x`` and the plugged EVs' first columns; the plugged EVs come first in every block, in the
        same order), and with ``shared_bess_steps`` > 1 for the battery's ``ch`` and ``dis`` columns of the window's
        steps 1 to ``shared_bess_steps - 1`` too. Returns ``w.lp`` with that ``c``, ``A_eq`` (canonical CSC, as
        assembled), ``b_eq`` and ``nonanticipativity_rows`` (its ``bounds`` shared)."""
        lp, blocks = w.lp, w.blocks
        later = np.arange(1, min(shared_bess_steps, blocks[0].H), dtype=np.int64)  # the battery's later shared steps
        shared = [
            np.concatenate(
                [[b.off.ch, b.off.dis, b.off.g, b.off.u, b.off.x], b.col0, b.off.ch + later, b.off.dis + later]
            )
            for b in blocks
        ]
        A = lp.A_eq
        n_rows = len(shared[0]) * (len(blocks) - 1)
        if n_rows:
            r = np.arange(n_rows)
            cols = np.concatenate([np.tile(shared[0], len(blocks) - 1), np.concatenate(shared[1:])])
            vals = np.concatenate([np.ones(n_rows), -np.ones(n_rows)])
            A = _append_rows(A.tocsc(), np.concatenate([r, r]), cols, vals, n_rows)
        return replace(
            lp,
            c=prob[lp.col_block] * lp.c,
            A_eq=A,
            b_eq=np.concatenate([lp.b_eq, np.zeros(n_rows)]),
            nonanticipativity_rows=n_rows,
        )


def _append_rows(A: sp.csc_matrix, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n_rows: int) -> sp.csc_matrix:
    """``A`` (canonical CSC, ``(m, n)``) with ``n_rows`` rows appended whose entries are the COO triplets ``rows``
    (``0..n_rows-1``), ``cols``, ``vals`` (no duplicates): canonical CSC ``(m + n_rows, n)``, the arrays
    ``sp.vstack([A, B]).tocsc()`` gives, without the round trip through CSR (this runs once per MPC step)."""
    m, n = A.shape
    order = np.lexsort((rows, cols))
    new_rows, new_vals = rows[order] + m, vals[order]
    per_col = np.bincount(cols, minlength=n)  # (n,) appended entries per column
    below = np.zeros(n + 1, np.int64)
    np.cumsum(per_col, out=below[1:])
    indptr = A.indptr + below  # each column: A's entries, then its appended ones (larger row indices)
    old_cols = np.repeat(np.arange(n), np.diff(A.indptr))
    at_a = np.arange(A.nnz) + below[old_cols]
    at_new = np.arange(len(order)) + A.indptr[1:][cols[order]]
    indices = np.empty(A.nnz + len(order), np.int32)
    data = np.empty(A.nnz + len(order), np.float64)
    indices[at_a], data[at_a] = A.indices, A.data
    indices[at_new], data[at_new] = new_rows, new_vals
    return sp.csc_matrix((data, indices, indptr.astype(np.int32)), shape=(m + n_rows, n))


def controller(data: SplitData, params: PlannerParams | None = None, **settings) -> ScenarioMPC:
    """``mpc_scenario``'s controller for a split: the planner ``params`` (default :func:`base_params`'), HiGHS without
    presolve and warm-started, and the chosen ``n_scenarios``, ``recency_half_life``, ``moer_scenarios`` unless
    ``settings`` give others."""
    return ScenarioMPC(data, params or base_params(data.config), presolve=False, **settings)


def run_window(
    site: Site | str, split: str, start: int, steps: int, params: PlannerParams | dict | None = None, **settings
) -> WindowResult:
    """Backtest ``mpc_scenario`` (:func:`controller` with ``params`` and ``settings``) over steps ``[start, start +
    steps)`` of ``split``, begun as :func:`pipeline.control.backtest.run_window` begins a window; the same signature,
    so that :func:`pipeline.control.tuning.tune` can tune its planner (:data:`TUNED_SPACE`).

    Raises:
        ValueError: a window outside the split. RuntimeError: an LP not solved, or the balance violated.
    """
    params = PlannerParams.from_dict(params) if isinstance(params, dict) else params
    return run_controller(site, split, start, steps, lambda data: controller(data, params, **settings))


def tune(site: Site | str, seeds=(1,), budget: str = "small", evaluate=None, space=TUNED_SPACE, **kwargs) -> list:
    """CMA-ES over ``space`` (:data:`TUNED_SPACE`, or :data:`NEAR_SPACE`) for ``mpc_scenario``'s planner on the train
    split's weeks, from :func:`base_params` (:func:`pipeline.control.tuning.tune` with this planner's backtests,
    :func:`run_window`); ``evaluate`` as there (default: one window after another here). Returns one
    :class:`~pipeline.control.tuning.TuningResult` per seed. What it found:
    ``docs/lab/scenario-mpc.md``.

    Raises:
        KeyError: an unknown budget.
    """
    site = load_site(site)
    evaluate = evaluate or tuning.local_evaluator(site, "train", run_window)
    return tuning.tune(site, seeds, budget, evaluate, space=space, start=base_params(site.config), **kwargs)


def simulate(
    site: Site | str, split: str, physics_dt_h: float | None = None, **settings
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_scenario`` over a whole split (socket actions, set-point BESS): ``(kpi_row, traces)``; prints its solves,
    their seconds and the LP's size. ``physics_dt_h``: the site simulated at that finer step
    (:func:`envs.kpis.evaluate_policy`).

    Raises:
        KeyError: unknown split. RuntimeError: an LP not solved, or the balance violated.
    """
    from pipeline.control.learned import run_planner

    site = load_site(site)
    mpc = controller(site.split(split), **settings)
    out = run_planner(site, split, "mpc_scenario", mpc, physics_dt_h=physics_dt_h)
    rows, cols, nnz = mpc.lp_total / max(mpc.solves, 1)
    print(
        f"mpc_scenario {split}: K {mpc.n_scenarios}, recency half-life {mpc.recency_half_life:g}, MOER scenarios "
        f"{'on' if mpc.moer_scenarios else 'off'}, MOER revisions x{mpc.moer_revisions:g}; "
        f"{1e3 * mpc.solve_s / max(mpc.solves, 1):.1f} ms per solve (build and HiGHS); the mean LP {rows:.0f} rows x "
        f"{cols:.0f} columns, {nnz:.0f} nonzeros",
        flush=True,
    )
    return out
