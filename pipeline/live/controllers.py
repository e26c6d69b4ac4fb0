"""The controllers of the registry rebuilt from a history, step by step as the study's runs build them, one entry of
:data:`LIVE_CONTROLLERS` each (how it finds its parameters and makes its plan step): the MOER regression caught up
(:func:`_catch_up`), ``mpc_adaptive``'s weekly weight from backtests of the history's weeks (:class:`WeekCosts`),
``mpc_rl``'s parameters at the day's start; which controllers run at a site (:func:`supported`, :data:`REFUSED`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from envs import timestep
from envs.config import SiteConfig
from envs.files import write_parquet, write_text
from envs.kpis import load_policy
from envs.site import Site
from pipeline.control import learned, registry, rl_planner, scenario, tuning
from pipeline.control.backtest import run_window, week_steps, weeks
from pipeline.control.mpc import MPCController, PlannerParams
from pipeline.control.tuned import rl_policy_file, rl_run_dir, tuning_files
from pipeline.live.history import History
from pipeline.live.state import LiveError
from pipeline.paths import PROJECT_ROOT, shown_path

REFUSED = {
    "uncontrolled": "it is no control: every car at full power from arrival, the battery idle; there is no plan to "
    "send (leave the chargers and the battery as they are)",
    "rule_based": "it is the battery's own self-consumption rule, decided hour by hour on site with the chargers at "
    "full power; there is no plan over a window to send",
    "mpc_perfect": "it is not causal: it plans on the true MOER and arrivals of the next hours, which no site knows",
    "oracle": "it is not causal: it plans the whole split with perfect foresight (the study's lower bound)",
    "mpc_rl_online": "it trains its day-level policy by PPO each week on the site's past, a study's run (doit run "
    "online); send mpc_rl, the policy it starts from, or mpc_adaptive",
}
"""The registry's controllers :func:`make_plan` refuses, and why."""
AGENT_REASON = (
    "it is a model-free agent: it acts one hour at a time from the env's observation and has no plan over a horizon "
    "to send as a charging profile (and on the study's sites it lands behind mpc)"
)
"""Why the agents are refused."""


def _catch_up(mpc: MPCController, t: int, since: int = 0) -> None:
    """Refit ``mpc``'s MOER regression day after day up to step ``t``'s day, as a run over the split does (one
    refit at each day start): the same sums in the same order, so the same forecast as the run's. ``since``: the
    step whose day it is already fitted to (0: a new controller). At steps below the hour the regression counts the
    split's hours (:func:`pipeline.control.forecast.hourly_view`): ``t`` and ``since`` are taken to their hours."""
    fc = mpc.forecaster
    day = getattr(fc, "day", None)
    if day is None:
        return
    per = max(1, mpc.day_steps // day)  # the controller's steps per step of the forecast (1, or the steps an hour)
    t, since = t // per, since // per
    for start in range(since - since % day + day, t - t % day + 1, day):
        fc(start, 1)


@dataclass
class StepPlan:
    """A controller's plan from the state: ``action`` the env's socket action of its first step (``[a_bess,
    a_1..a_N]``, set-point battery), ``bess_kw`` ``(H,)`` kW (+ = charge) and ``ev_kw`` ``(N, H)`` kW, per step of the
    site; ``replan``: when the controller plans again (:attr:`pipeline.control.mpc.MPCController.replan`)."""

    action: np.ndarray
    bess_kw: np.ndarray
    ev_kw: np.ndarray
    params: PlannerParams | None = None
    replan: str = "hour"


def _plan_step(hist: History, m: MPCController, since: int = 0) -> StepPlan:
    """``m``'s plan from the state (its forecast refit up to the state's day first, from ``since``'s day on)."""
    _catch_up(m, hist.t, since)
    p = m.plan(hist.t, hist.energy_kwh, hist.ev_need_kwh, hist.ev_steps_left)
    return StepPlan(p.action, p.bess_kw_steps, p.ev_kw_steps, m.params, m.replan)


class WeekCosts:
    """Backtested costs of ``mpc_adaptive``'s weeks (:func:`pipeline.control.backtest.run_window` on the history),
    kept by a key of what each backtest reads (the config, the parameters, the window, the history up to the week's
    end and the PV over the horizon beyond it): in memory, and in ``folder/week_costs.json`` when a folder is given."""

    def __init__(self, folder: str | Path | None = None):
        self.file = Path(folder) / "week_costs.json" if folder else None
        self.costs: dict[str, float] = {}
        if self.file and self.file.is_file():
            try:
                self.costs = {k: float(v) for k, v in json.loads(self.file.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.costs = {}
        self.computed = 0

    @staticmethod
    def data_digest(hist: History, start: int, steps: int, horizon_h: float) -> str:
        """Digest of what a backtest of steps ``[start, start + steps)`` reads of the history: the MOER, forecasts and
        5-minute values up to its end, the PV and load over the window beyond it, the arrivals up to its end, the
        sockets' power, the history's start."""
        d = hist.data
        end = start + steps
        horizon = timestep.steps(horizon_h, d.config.dt_h)
        h = hashlib.sha256(str(d.time[0]).encode())
        arrays = [d.moer[:end], d.moer_fc[:end], d.pv_kw[: end + horizon], d.load_kw[: end + horizon]]
        arrays += [d.arrival_need_kwh[: end + 1], d.arrival_stay_steps[: end + 1], d.socket_kw]
        if d.moer_5min is not None:
            arrays.append(d.moer_5min[:end])
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def cost(self, hist: History, params: PlannerParams, start: int, steps: int, digest: str | None = None) -> float:
        """The backtested cost (kg, :attr:`pipeline.control.backtest.WindowResult.cost`) of ``params`` over steps
        ``[start, start + steps)`` of the history, from the cache or run now (``digest``: :meth:`data_digest`'s)."""
        digest = digest or self.data_digest(hist, start, steps, params.horizon_h)
        what = json.dumps([dataclasses.asdict(hist.data.config), params.as_dict(), start, steps, digest], default=str)
        k = hashlib.sha256(what.encode()).hexdigest()
        if k not in self.costs:
            self.costs[k] = run_window(hist.site, "test", start, steps, params).cost
            self.computed += 1
        return self.costs[k]

    def save(self) -> None:
        if self.file and self.computed:
            write_text(self.file, json.dumps(self.costs, indent=0, sort_keys=True))
            self.computed = 0


def _adaptive_params(hist: History, tuned_dir: Path, seed: int, weeks_cache: WeekCosts) -> PlannerParams:
    """``mpc_adaptive``'s parameters at the state's step: ``mpc_tuned``'s in the history's first week, then the
    candidate of least mean backtested cost over the last ``lookback`` weeks (the lookback chosen on the train
    split's week table, as :func:`pipeline.control.learned.simulate_adaptive` does)."""
    tuned = tuning.load_params(tuned_dir, seed)
    cands = learned.candidates(tuned)
    lookback = learned.choose_lookback(_train_week_table(hist.source, tuned_dir, seed, cands))
    w = hist.t // week_steps(hist.data.config.dt_h)
    if w == 0:
        return cands[0]
    past = weeks(hist.data)[max(0, w - lookback) : w]
    digests = [weeks_cache.data_digest(hist, s, n, tuned.horizon_h) for s, n in past]
    cost = np.array([[weeks_cache.cost(hist, c, s, n, g) for c in cands] for (s, n), g in zip(past, digests)])
    return cands[learned.week_choice(cost)]


def _train_week_table(site: Site, tuned_dir: Path, seed: int, cands: list) -> pd.DataFrame:
    """The train split's week table kept beside the tuning (computed and kept there when missing or older than the
    tuning, as :func:`pipeline.control.learned.simulate_adaptive` does)."""
    f = learned.table_file(tuned_dir, "train", seed)
    stamp = tuning_files(tuned_dir, seed)[0].stat().st_mtime_ns
    if f.is_file() and f.stat().st_mtime_ns >= stamp:
        t = pd.read_parquet(f)
        if t.candidate.nunique() == len(cands):
            return t
    return pd.read_parquet(write_parquet(learned.week_table(site, "train", cands), f))


def _rl_planner(hist: History, tuned_dir: Path, seed: int) -> tuple[MPCController, int]:
    """``mpc_rl``'s planner of the state's day, on the parameters its policy sets from the day-level observation at
    the last local midnight (or the history's first step), from the site then (:attr:`LiveState.day_start`,
    :func:`pipeline.control.rl_planner.policy_day_params`); returns it (its forecast refit up to that midnight's day)
    and that midnight's step."""
    path = rl_policy_file(rl_run_dir(tuned_dir, seed))
    if not path.is_file():
        raise LiveError(
            f"controller: no trained mpc_rl policy for seed {seed} ({shown_path(path)}): run `doit run pipeline` first"
        )
    d, t = hist.data, hist.t
    m = d.last_midnight(t)
    if m == t:
        soc, need = hist.energy_kwh / max(d.config.bess.capacity_kwh, 1e-9), float(hist.ev_need_kwh.sum())
    elif hist.day_start is None:
        raise LiveError(
            f"day_start: missing: mpc_rl sets its parameters at each local midnight from the battery's SOC and the "
            f"plugged cars' need then ({d.time[m].tz_convert(d.config.timezone).isoformat()}); give them"
        )
    else:
        soc, need = float(hist.day_start.soc), float(hist.day_start.ev_need_kwh)
    base = rl_planner.base_params(hist.source)
    b = d.config.bess
    energy = min(max(soc, b.soc_min), b.soc_max) * b.capacity_kwh
    mpc = MPCController(d, base, presolve=False)
    _catch_up(mpc, m)
    train = hist.source.split("train")
    params = rl_planner.policy_day_params(load_policy(path), d, train, mpc, m, energy, need, base)
    mpc.set_params(params)
    return mpc, m


# ------------------------------------------------------------------------------------------------ the dispatch
@dataclass
class PlanInputs:
    """What a controller's plan step reads (:attr:`LiveController.plan`).

    Attributes:
        hist: the history. params: the parameters the controller starts from (:attr:`LiveController.params`).
        tuned_dir: the study's tuning folder. seed: the study's seed (None for an unseeded controller).
        live_dir: the study's folder of what the live path keeps (``<experiment>/live``).
        week_costs: ``mpc_adaptive``'s cache of week backtests (None: the one kept in ``live_dir``).
    """

    hist: History
    params: PlannerParams
    tuned_dir: Path
    seed: int | None
    live_dir: Path
    week_costs: WeekCosts | None = None


def _plan_fixed(run: PlanInputs, presolve: bool = False) -> StepPlan:
    """A planner on its starting parameters throughout."""
    return _plan_step(run.hist, MPCController(run.hist.data, run.params, presolve=presolve))


def _plan_adaptive(run: PlanInputs) -> StepPlan:
    """``mpc_adaptive``: the week's parameters from backtests of the weeks before it (kept in the cache)."""
    cache = run.week_costs if run.week_costs is not None else WeekCosts(run.live_dir)
    params = _adaptive_params(run.hist, run.tuned_dir, run.seed, cache)
    step = _plan_step(run.hist, MPCController(run.hist.data, params, presolve=False))
    cache.save()
    return step


def _plan_rl(run: PlanInputs) -> StepPlan:
    """``mpc_rl``: the day's parameters set by its policy at the last local midnight."""
    mpc, midnight = _rl_planner(run.hist, run.tuned_dir, run.seed)
    return _plan_step(run.hist, mpc, since=midnight)


def _plan_scenario(run: PlanInputs) -> StepPlan:
    """``mpc_scenario``: its scenarios drawn from the history's realised days."""
    return _plan_step(run.hist, scenario.controller(run.hist.data))


def _has_policy(tuned_dir: Path, seed: int) -> bool:
    return rl_policy_file(rl_run_dir(tuned_dir, seed)).is_file()


@dataclass(frozen=True)
class LiveController:
    """How the live path runs one controller of the registry (an entry of :data:`LIVE_CONTROLLERS`).

    Attributes:
        params: ``(site, tuned_dir, seed) -> PlannerParams``: the parameters it starts from; their horizon is its
            window (seed None for an unseeded controller).
        plan: ``(PlanInputs) -> StepPlan``: its plan from the state.
        has_seed: ``(tuned_dir, seed) -> bool``: whether the study left what it runs from for a tuned seed (its
            choice of a default seed); None: every tuned seed.
    """

    params: Callable[[Site, Path, int | None], PlannerParams]
    plan: Callable[[PlanInputs], StepPlan]
    has_seed: Callable[[Path, int], bool] | None = None


def _of_config(f: Callable[[SiteConfig], PlannerParams]) -> Callable[[Site, Path, int | None], PlannerParams]:
    return lambda site, tuned_dir, seed: f(site.config)


def _of_site(f: Callable[[Site], PlannerParams]) -> Callable[[Site, Path, int | None], PlannerParams]:
    return lambda site, tuned_dir, seed: f(site)


def _tuned(site: Site, tuned_dir: Path, seed: int | None) -> PlannerParams:
    return tuning.load_params(tuned_dir, seed)


LIVE_CONTROLLERS: dict[str, LiveController] = {
    "mpc": LiveController(_of_config(PlannerParams.of_site), partial(_plan_fixed, presolve=True)),
    "mpc_tuned_start": LiveController(_of_config(PlannerParams.learned_start), _plan_fixed),
    "mpc_tuned": LiveController(_tuned, _plan_fixed),
    "mpc_adaptive": LiveController(_tuned, _plan_adaptive),
    "mpc_rl_start": LiveController(_of_site(rl_planner.start_params), _plan_fixed),
    "mpc_rl": LiveController(_of_site(rl_planner.base_params), _plan_rl, has_seed=_has_policy),
    "mpc_scenario": LiveController(_of_config(scenario.base_params), _plan_scenario),
}
"""The controllers the live path runs (:func:`supported`), by name: how each finds its parameters and makes its plan
step. Adding a controller is adding its entry."""


def live_controller(name: str) -> LiveController:
    """The entry of :data:`LIVE_CONTROLLERS` of a supported controller.

    Raises:
        NotImplementedError: :func:`supported` names a controller without an entry.
    """
    if name not in LIVE_CONTROLLERS:
        raise NotImplementedError(f"evhub-plan has no way to run {name!r} yet: give it an entry of LIVE_CONTROLLERS")
    return LIVE_CONTROLLERS[name]


# ------------------------------------------------------------------------------------------------ the answer
def results_root(site: Site, output_dir: str | Path = "outputs", experiment: str = "") -> Path:
    """``<output_dir>/<experiment>`` of the study of ``site`` (``output_dir`` relative to the project root,
    ``experiment`` by default the site's name), as the pipeline lays it out."""
    out = Path(output_dir)
    if not out.is_absolute():
        out = PROJECT_ROOT / out
    return out / (experiment or site.config.name)


def answer(site: Site, output_dir: str | Path = "outputs", experiment: str = "") -> str:
    """The controller the report answers with for ``site``: the lowest-CO2 causal row of its results
    (``report/co2_comparison.parquet``) on the held-out split, as the report's first section names it
    (:func:`pipeline.study.comparison.best_controllers`).

    Raises:
        LiveError: no results yet (run the pipeline, or name a controller), or none that names a causal row.
    """
    f = results_root(site, output_dir, experiment) / "report" / "co2_comparison.parquet"
    if not f.is_file():
        raise LiveError(
            f"controller: not given, and no study results for site {site.config.name!r} to read the report's answer "
            f"from ({shown_path(f)} is missing): run `doit run pipeline` first, or pass --controller (e.g. mpc)"
        )
    from pipeline.study.comparison import best_controllers

    table = pd.read_parquet(f)
    split = "test" if (table.split == "test").any() else str(table.split.iloc[0])
    best = best_controllers(table, split).get("causal")
    if best is None:
        raise LiveError(f"controller: {shown_path(f)} names no causal controller: pass --controller")
    return best


def supported() -> tuple[str, ...]:
    """The registry's controllers :func:`make_plan` runs: the causal planners (not the agents or online agents, nor the
    baselines of :data:`REFUSED`)."""
    return tuple(n for n in registry.CONTROLLERS if registry.CONTROLLERS[n].causal and not registry.is_agent(n)
                 and n not in REFUSED)  # fmt: skip


def check_controller(name: str) -> None:
    """Check that the live path runs ``name``.

    Raises:
        LiveError: a controller of :data:`REFUSED`, an agent, or a name the registry does not know (with its closest
            names).
    """
    if name in REFUSED:
        raise LiveError(f"controller: {name!r} cannot run at a site: {REFUSED[name]}")
    if name not in registry.CONTROLLERS:
        try:
            registry.get(name)
        except KeyError as exc:
            raise LiveError(f"controller: {exc.args[0]}") from None
    if registry.is_agent(name):
        raise LiveError(f"controller: {name!r} is not supported by evhub-plan: {AGENT_REASON}")


def tuned_seed(name: str, tuned_dir: Path, seed: int | None) -> int:
    """The study's seed a tuned controller runs with: ``seed`` when given, else the lowest seed tuned in
    ``tuned_dir`` for which the study left what the controller runs from (:attr:`LiveController.has_seed`).

    Raises:
        LiveError: no such seed (the study has not run).
    """
    if seed is not None:
        return int(seed)
    stems = (p.stem.removeprefix("mpc_tuned_seed") for p in tuned_dir.glob("mpc_tuned_seed*.json"))
    found = sorted(int(s) for s in stems if s.isdigit())
    has_seed = live_controller(name).has_seed
    found = [s for s in found if has_seed is None or has_seed(tuned_dir, s)]
    if not found:
        raise LiveError(
            f"controller: {name!r} reads what the study tuned on the train split, and {shown_path(tuned_dir)} holds "
            "none: run `doit run pipeline` first"
        )
    return found[0]


def horizon_of(site: Site, name: str, tuned_dir: Path, seed: int | None) -> tuple[PlannerParams, int]:
    """The planner parameters a controller starts from (:attr:`LiveController.params`) and its window, steps.

    Raises:
        NotImplementedError: a controller without an entry of :data:`LIVE_CONTROLLERS`.
    """
    params = live_controller(name).params(site, tuned_dir, seed)
    return params, timestep.steps(params.horizon_h, site.config.dt_h)
