"""The learned planners (``mpc_tuned``, ``mpc_adaptive``): the causal MPC kept, its parameters learned from the site's
realised data.

- ``mpc_tuned``: the planner (:class:`pipeline.control.mpc.MPCController`) with the parameters CMA-ES chose in closed
  loop on the train split (:mod:`pipeline.control.tuning`), the same on every split.
- ``mpc_adaptive``: the planner re-tuned online. At the start of each week of the split it acts on, it takes, among
  :func:`candidates` (``mpc_tuned``'s parameters, then the same at each expected-demand weight of
  :data:`ADAPTIVE_WEIGHTS`), the one whose backtests (:func:`pipeline.control.backtest.run_window`) over the last
  ``lookback`` weeks of that split cost least (CO2 plus unserved energy at
  :data:`pipeline.control.backtest.UNSERVED_COST`), and runs with it for the week; in the split's first week it runs
  with ``mpc_tuned``'s. A week's backtest is known once the week is realised, so the choice at week ``w`` reads only
  weeks before ``w``. Backtesting every candidate over every week once gives a table from which each week's choice is
  read (:func:`week_table`, :func:`schedule`): the same as re-tuning each week, without running a week twice.

Parameters:
    tuned (:class:`~pipeline.control.mpc.PlannerParams`): the tuning's parameters of the run's seed, read from the
        tuning folder (``<experiment>/tuned/``, :mod:`pipeline.control.tuned`).
    weights (float, [0, 1], share of the past days' mean demand): :data:`ADAPTIVE_WEIGHTS`.
    lookback (int, weeks): chosen on the train split among :data:`LOOKBACKS` (:func:`choose_lookback`), used as such
        on every split.

Returns:
    :func:`simulate_tuned`, :func:`simulate_tuned_start`, :func:`simulate_adaptive`: a whole split's KPI row and
    traces (:func:`envs.kpis.evaluate_policy`); :func:`week_table`: each candidate's cost per week.

References:
    N. Hansen, "The CMA Evolution Strategy: A Tutorial", arXiv:1604.00772 (2016) (the tuner, through ``cma``). How
    the budget, the weights and the lookback were chosen: ``docs/lab/learned-planners.md``; results:
    ``docs/findings.md``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from envs.evhub import EVHubVectorEnv
from envs.kpis import evaluate_policy
from envs.site import Site, SplitData, load_site
from pipeline.control import tuning
from pipeline.control.backtest import WindowResult, week_steps, weeks
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.tuned import tuning_files

ADAPTIVE_WEIGHTS = (0.25, 0.5, 0.75, 1.0)
"""Expected-demand weights ``mpc_adaptive`` chooses among each week (besides ``mpc_tuned``'s own). Weight 0 (the
plugged cars only) is left out: on the train split it is the worst weight (``docs/agents.md``)."""

LOOKBACKS = (1, 2, 4, 8)
"""Lookbacks (weeks) :func:`choose_lookback` chooses among on the train split."""


def candidates(tuned: PlannerParams) -> list[PlannerParams]:
    """``mpc_adaptive``'s candidates: ``tuned`` first, then ``tuned`` at each weight of :data:`ADAPTIVE_WEIGHTS`
    that differs from its own."""
    out = [tuned]
    out += [
        replace(tuned, expected_demand_weight=w)
        for w in ADAPTIVE_WEIGHTS
        if abs(w - tuned.expected_demand_weight) > 1e-9
    ]
    return out


def week_table(site: Site | str, split: str, cands: list[PlannerParams], evaluate=None) -> pd.DataFrame:
    """Backtest every candidate over every week of ``split``.

    Args:
        evaluate: a :data:`pipeline.control.tuning.Evaluate` (default: one window after another here).

    Returns:
        one row per (candidate, week): ``candidate`` (index into ``cands``), ``week``, ``start``, ``steps``,
        ``co2_kg``, ``unserved_kwh``, ``cost_kg``.
    """
    site = load_site(site)
    evaluate = evaluate or tuning.local_evaluator(site, split)
    wk = weeks(site.split(split))
    jobs = [(c, s, n) for c in cands for s, n in wk]
    return pd.DataFrame([_week_row(*divmod(i, len(wk)), r) for i, r in enumerate(evaluate(jobs))])


def _week_row(candidate: int, week: int, r: WindowResult) -> dict:
    """One row of a week table (:func:`week_table`'s columns)."""
    return {
        "candidate": candidate,
        "week": week,
        "start": r.start,
        "steps": r.steps,
        "co2_kg": r.co2_kg,
        "unserved_kwh": r.unserved_kwh,
        "cost_kg": r.cost,
    }


def schedule(table: pd.DataFrame, lookback: int) -> np.ndarray:
    """The candidate each week runs with: week 0 the first candidate (``mpc_tuned``'s), week ``w`` the candidate of
    least mean cost over weeks ``max(0, w - lookback) .. w - 1`` (ties: the lower index).

    Returns:
        ``(n_weeks,)`` int64 candidate indices.
    """
    cost = table.pivot(index="week", columns="candidate", values="cost_kg").sort_index().to_numpy()
    out = np.zeros(len(cost), np.int64)
    for w in range(1, len(cost)):
        out[w] = week_choice(cost[max(0, w - lookback) : w])
    return out


def week_choice(past_costs: np.ndarray) -> int:
    """The candidate a week runs with, from the backtested costs of the weeks before it (``(weeks, candidates)`` kg,
    at least one week): the least mean cost (ties: the lower index)."""
    return int(np.argmin(np.asarray(past_costs).mean(0)))


def schedule_cost(table: pd.DataFrame, chosen: np.ndarray) -> float:
    """Sum over weeks of the chosen candidate's backtested cost, kg (the week table's estimate of a schedule)."""
    cost = table.pivot(index="week", columns="candidate", values="cost_kg").sort_index().to_numpy()
    return float(cost[np.arange(len(chosen)), chosen].sum())


def choose_lookback(train_table: pd.DataFrame) -> int:
    """The lookback of :data:`LOOKBACKS` whose schedule costs least on the train split's week table (ties: the
    shorter)."""
    costs = [schedule_cost(train_table, schedule(train_table, k)) for k in LOOKBACKS]
    return LOOKBACKS[int(np.argmin(costs))]


class AdaptivePlanner:
    """A policy ``(obs, env) -> socket action`` that runs the planner with the parameters of each week's candidate.

    One :class:`~pipeline.control.mpc.MPCController` holds the forecast's state over the whole split; at each step it
    plans with the parameters of its week's candidate (:meth:`~pipeline.control.mpc.MPCController.set_params`).

    Raises:
        ValueError: candidates that differ in a parameter the controller keeps
            (:attr:`~pipeline.control.mpc.PlannerParams.FIXED`: the horizon, the forecast's settings).
    """

    def __init__(self, data: SplitData, cands: list[PlannerParams], chosen: np.ndarray):
        if len({tuple(getattr(c, k) for k in PlannerParams.FIXED) for c in cands}) != 1:
            raise ValueError(f"adaptive candidates must share {', '.join(PlannerParams.FIXED)}")
        self.mpc = MPCController(data, cands[0], presolve=False)
        self.cands, self.chosen = cands, chosen
        self.week = week_steps(data.config.dt_h)

    def __call__(self, obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
        t = int(env.t[0])
        self.mpc.set_params(self.cands[int(self.chosen[min(t // self.week, len(self.chosen) - 1)])])
        return self.mpc(obs, env)


def run_planner(
    site: Site, split: str, name: str, policy, seed: int | None = None, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A learned planner's run over a whole split (socket actions, set-point BESS): ``(kpi_row, traces)`` as
    :func:`envs.kpis.evaluate_policy` returns them, the seed in the row when it has one; prints its solves and CO2.

    Args:
        policy: an :class:`~pipeline.control.mpc.MPCController` or a policy holding one as ``mpc``.
        physics_dt_h: simulate the site at that finer step (:func:`envs.kpis.evaluate_policy`).
    """
    t0 = time.perf_counter()
    kpis, traces = evaluate_policy(
        policy,
        site,
        split,
        name,
        action_mode="socket",
        bess_action="setpoint",
        physics_dt_h=physics_dt_h,
        train_wall_s=0.0,
        **({} if seed is None else {"seed": float(seed)}),
    )
    mpc = getattr(policy, "mpc", policy)
    tag = name if seed is None else f"{name} seed {seed}"
    print(
        f"{tag} {split}: {mpc.solves} solves, {mpc.solve_s:.1f} s solving, "
        f"{time.perf_counter() - t0:.1f} s in all; CO2 {traces.co2_kg.sum():.1f} kg, "
        f"unserved {traces.unserved_kwh.sum():.3f} kWh",
        flush=True,
    )
    return kpis, traces


def simulate_tuned(
    site: Site, split: str, seed: int, tuned_dir: str | Path, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_tuned`` of ``seed`` over a whole split: ``(kpi_row, traces)`` (``physics_dt_h``: as :func:`run_planner`).

    Raises:
        FileNotFoundError: no tuning of that seed in ``tuned_dir``.
    """
    params = tuning.load_params(tuned_dir, seed)
    mpc = MPCController(site.split(split), params, presolve=False)
    return run_planner(site, split, "mpc_tuned", mpc, seed, physics_dt_h)


def simulate_tuned_start(
    site: Site, split: str, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_tuned_start``, ``mpc_tuned``'s untrained start, over a whole split: the planner with the parameters the
    tuning starts from (:meth:`~pipeline.control.mpc.PlannerParams.learned_start`); ``(kpi_row, traces)``
    (``physics_dt_h``: as :func:`run_planner`)."""
    start = PlannerParams.learned_start(site.config)
    mpc = MPCController(site.split(split), start, presolve=False)
    return run_planner(site, split, "mpc_tuned_start", mpc, physics_dt_h=physics_dt_h)


def table_file(tuned_dir: str | Path, split: str, seed: int) -> Path:
    """Where ``mpc_adaptive``'s week table of ``split`` and ``seed`` is kept (beside the tuning)."""
    return Path(tuned_dir) / f"mpc_adaptive_seed{seed}_{split}_weeks.parquet"


def table_windows(
    site: Site | str, tuned: PlannerParams, splits=("train", "test")
) -> list[tuple[str, int, PlannerParams, int, int]]:
    """Every backtest the week tables of ``splits`` need: ``(split, candidate index, params, start, steps)``."""
    site = load_site(site)
    cands = candidates(tuned)
    return [(sp, i, c, s, n) for sp in splits for i, c in enumerate(cands) for s, n in weeks(site.split(sp))]


def write_week_tables(results: list, windows: list, tuned_dir: str | Path, seed: int) -> list[str]:
    """Write the week tables (:func:`week_table`'s columns) of the backtested ``windows`` (:func:`table_windows`, in
    order with ``results``) beside the tuning of ``seed``; returns the files."""
    from envs.files import write_parquet

    rows: dict[str, list] = {}
    count: dict[tuple[str, int], int] = {}
    for (sp, c, *_), r in zip(windows, results):
        w = count[sp, c] = count.get((sp, c), -1) + 1  # the windows of a candidate come week after week
        rows.setdefault(sp, []).append(_week_row(c, w, r))
    return [str(write_parquet(pd.DataFrame(v), table_file(tuned_dir, sp, seed))) for sp, v in rows.items()]


def simulate_adaptive(
    site: Site, split: str, seed: int, tuned_dir: str | Path, physics_dt_h: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``mpc_adaptive`` of ``seed`` over a whole split: ``(kpi_row, traces)`` (module docstring; ``physics_dt_h``: as
    :func:`run_planner`).

    It reads the week tables of the train split (for the lookback) and of ``split`` kept beside the tuning
    (:func:`table_file`, written by the study's ``planners`` stage from backtests fanned out over the cluster); a
    table that is missing or older than the tuning is computed here, one window after another.

    Raises:
        FileNotFoundError: no tuning of that seed in ``tuned_dir``.
    """
    from envs.files import write_parquet

    tuned = tuning.load_params(tuned_dir, seed)
    cands = candidates(tuned)
    stamp = tuning_files(tuned_dir, seed)[0].stat().st_mtime_ns

    def table(s: str) -> pd.DataFrame:
        f = table_file(tuned_dir, s, seed)
        if f.is_file() and f.stat().st_mtime_ns >= stamp:
            t = pd.read_parquet(f)
            if t.candidate.nunique() == len(cands):
                return t
        return pd.read_parquet(write_parquet(week_table(site, s, cands), f))

    lookback = choose_lookback(table("train"))
    chosen = schedule(table(split), lookback)
    weights = ", ".join(f"{cands[c].expected_demand_weight:g}" for c in chosen)
    print(
        f"mpc_adaptive seed {seed} {split}: lookback {lookback} weeks (chosen on the train split); weekly weights "
        f"{weights}",
        flush=True,
    )
    policy = AdaptivePlanner(site.split(split), cands, chosen)
    return run_planner(site, split, "mpc_adaptive", policy, seed, physics_dt_h)
