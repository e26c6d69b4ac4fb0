"""The controllers of the registry rebuilt from a history, hour by hour as the study's runs build them: the MOER
regression caught up (:func:`_catch_up`), ``mpc_adaptive``'s weekly weight from backtests of the history's weeks
(:class:`WeekCosts`), ``mpc_rl``'s parameters at the day's start; which controllers run at a site
(:func:`supported`, :data:`REFUSED`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from envs.files import write_parquet, write_text
from envs.site import Site
from pipeline.control import registry, scenario
from pipeline.control.mpc import MPCController, PlannerParams
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
    step whose day it is already fitted to (0: a new controller)."""
    fc = mpc.forecaster
    day = getattr(fc, "day", None)
    if day is None:
        return
    for start in range(since - since % day + day, t - t % day + 1, day):
        fc(start, 1)


@dataclass
class StepPlan:
    """A controller's plan from the state: ``action`` the env's socket action of its first step (``[a_bess,
    a_1..a_N]``, set-point battery), ``bess_kw`` ``(H,)`` kW (+ = charge) and ``ev_kw`` ``(N, H)`` kW."""

    action: np.ndarray
    bess_kw: np.ndarray
    ev_kw: np.ndarray
    params: PlannerParams | None = None


def _plan_step(hist: History, m: MPCController, since: int = 0) -> StepPlan:
    """``m``'s plan from the state (its forecast refit up to the state's day first, from ``since``'s day on)."""
    _catch_up(m, hist.t, since)
    p = m.plan(hist.t, hist.energy_kwh, hist.ev_need_kwh, hist.ev_steps_left)
    return StepPlan(p.action, p.bess_kw_steps, p.ev_kw_steps, m.params)


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
        horizon = max(1, int(round(horizon_h / d.config.dt_h)))
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
        from pipeline.control.backtest import run_window

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
    from pipeline.control import learned, tuning
    from pipeline.control.backtest import week_steps, weeks

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
    from pipeline.control import learned, tuning

    f = learned.table_file(tuned_dir, "train", seed)
    stamp = tuning.result_files(tuned_dir, seed)[0].stat().st_mtime_ns
    if f.is_file() and f.stat().st_mtime_ns >= stamp:
        t = pd.read_parquet(f)
        if t.candidate.nunique() == len(cands):
            return t
    return pd.read_parquet(write_parquet(learned.week_table(site, "train", cands), f))


def _rl_params(hist: History, tuned_dir: Path, seed: int) -> tuple[PlannerParams, MPCController, int]:
    """``mpc_rl``'s parameters of the state's day: its policy's action on the day-level observation at the last local
    midnight (or the history's first step), from the site then (:attr:`LiveState.day_start`); returns them, the
    planner (its forecast refit up to that midnight's day) and that midnight's step."""
    import torch

    from envs.kpis import load_policy
    from pipeline.control import rl_planner

    path = rl_planner.policy_file(rl_planner.run_dir(tuned_dir, seed))
    if not path.is_file():
        raise LiveError(
            f"controller: no trained mpc_rl policy for seed {seed} ({shown_path(path)}): run `doit run pipeline` first"
        )
    d, t = hist.data, hist.t
    local = d.time.tz_convert(d.config.timezone)
    mids = np.flatnonzero((local.hour == 0) & (local.minute == 0))
    m = int(max([0, *mids[mids <= t]]))
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
    env = SimpleNamespace(
        t=torch.tensor([m]),
        energy_kwh=torch.tensor([energy], dtype=torch.float64),
        ev_need_kwh=torch.tensor([[need]], dtype=torch.float64),
    )
    view = SimpleNamespace(config=d.config, split=lambda s: d if s == "test" else hist.source.split(s))
    day = rl_planner._Day(view, "test", base, env)
    _catch_up(day.mpc, m)
    policy = load_policy(path)
    x = torch.as_tensor(day.observe(None))[None]
    with torch.no_grad():
        a = policy(x, env)[0].numpy()
    params = rl_planner.day_params(base, a)
    day.mpc.set_params(params)
    return params, day.mpc, m


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
    (:func:`pipeline.study.report.best_controllers`).

    Raises:
        LiveError: no results yet (run the pipeline, or name a controller), or none that names a causal row.
    """
    f = results_root(site, output_dir, experiment) / "report" / "co2_comparison.parquet"
    if not f.is_file():
        raise LiveError(
            f"controller: not given, and no study results for site {site.config.name!r} to read the report's answer "
            f"from ({shown_path(f)} is missing): run `doit run pipeline` first, or pass --controller (e.g. mpc)"
        )
    from pipeline.study.report import best_controllers

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


def _check_controller(name: str) -> None:
    if name in REFUSED:
        raise LiveError(f"controller: {name!r} cannot run at a site: {REFUSED[name]}")
    if name not in registry.CONTROLLERS:
        try:
            registry.get(name)
        except KeyError as exc:
            raise LiveError(f"controller: {exc.args[0]}") from None
    if registry.is_agent(name):
        raise LiveError(f"controller: {name!r} is not supported by evhub-plan: {AGENT_REASON}")


def _seed(name: str, tuned_dir: Path, seed: int | None) -> int:
    if seed is not None:
        return int(seed)
    stems = (p.stem.removeprefix("mpc_tuned_seed") for p in tuned_dir.glob("mpc_tuned_seed*.json"))
    found = sorted(int(s) for s in stems if s.isdigit())
    found = [s for s in found if name != "mpc_rl" or (tuned_dir / f"mpc_rl_seed{s}" / "policy.pt2").is_file()]
    if not found:
        raise LiveError(
            f"controller: {name!r} reads what the study tuned on the train split, and {shown_path(tuned_dir)} holds "
            "none: run `doit run pipeline` first"
        )
    return found[0]


def horizon_of(site: Site, name: str, tuned_dir: Path, seed: int | None) -> tuple[PlannerParams, int]:
    """The planner parameters a controller starts from and its window, steps."""
    from pipeline.control import rl_planner, tuning

    cfg = site.config
    if name == "mpc":
        params = PlannerParams.of_site(cfg)
    elif name == "mpc_tuned_start":
        params = PlannerParams.learned_start(cfg)
    elif name == "mpc_rl_start":
        params = rl_planner.start_params(site)
    elif name == "mpc_rl":
        params = rl_planner.base_params(site)
    elif name in ("mpc_tuned", "mpc_adaptive"):
        params = tuning.load_params(tuned_dir, seed)
    elif name == "mpc_scenario":
        params = scenario.base_params(cfg)
    else:  # supported() grew without a branch here
        raise NotImplementedError(f"evhub-plan has no planner parameters for {name!r} yet")
    return params, max(1, int(round(params.horizon_h / cfg.dt_h)))


# ------------------------------------------------------------------------------------------------ the plan
