"""Closed-loop tuning of the planner's parameters by CMA-ES: what ``mpc_tuned`` runs with.

The causal planner (:class:`pipeline.control.mpc.MPCController`) has parameters a person set by hand
(:class:`pipeline.control.mpc.PlannerParams`: the expected-demand weight and days, the terminal value of stored
energy, the MOER outlook's contrast and bias, the horizon; and one it does not use, the expected demand by day type).
Here they are tuned where they act: in closed loop, through the env, on sampled weeks of the **train split**
(:func:`pipeline.control.backtest.run_window`), by CMA-ES (Hansen's ``cma`` package) in the box :data:`SPACE`, each
parameter in its own units with an initial step of ``sigma0`` times its range (``CMA_stds``), the integer and yes/no
parameters handled as integers by ``cma`` itself (``integer_variables``: rounded where sampled, their steps kept from
vanishing), starting at the site's ``[mpc]`` values with the learned MOER forecast
(:meth:`~pipeline.control.mpc.PlannerParams.learned_start`; a yes/no parameter undecided, at 0.5). Each generation
samples :attr:`Budget.weeks` weeks of the split (after its first, in which the planner's forecasts warm up) and
evaluates every candidate on the same weeks (common random numbers: CMA-ES only ranks the candidates of a
generation), each (candidate, week) one Dask task. The result is the distribution's mean after the last generation
(its integers rounded by ``cma``), not the best candidate seen (which would favour an easy sample of weeks): of the
means after the last :data:`VALIDATED_MEANS` generations and the starting point, the one that costs least over a fixed
set of validation weeks of the train split (the parameters' effects are small beside the weeks' noise, so a tuning can
drift; it never ends worse on those weeks than it began). Nothing here reads the test split.

Each seed's CMA-ES samples from its own generator (``cma``'s ``randn`` option; its integer handling's few draws from
its own stream too, :func:`_repair_draws`), so the seeds tuned in lockstep are independent of each other and of
NumPy's global generator.

Budgets (:data:`BUDGETS`): ``small`` runs inside ``doit run pipeline``, ``full`` is ``doit run tune``, ``tiny`` is for
tests; the pipeline uses the largest budget whose result is cached for the same site, data and code (:func:`cached`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from envs.files import write_parquet, write_text
from envs.site import Site, load_site
from pipeline import depends
from pipeline.control.tuned import tuning_files
from pipeline.paths import PROJECT_ROOT

if TYPE_CHECKING:  # the planner (torch, HiGHS) is imported where a tuning runs, so that reading BUDGETS stays light
    from pipeline.control.backtest import WindowResult
    from pipeline.control.mpc import PlannerParams


@dataclass(frozen=True)
class Param:
    """One tuned parameter: its :class:`PlannerParams` field, its range (inclusive), and whether CMA-ES samples it as an
    integer (a yes/no parameter is one, 0 or 1)."""

    name: str
    low: float
    high: float
    integer: bool = False


SPACE = (
    Param("expected_demand_weight", 0.0, 1.0),
    Param("expected_demand_days", 1, 14, integer=True),
    Param("terminal_value", 0.5, 1.5),
    Param("moer_contrast", 0.5, 2.5),
    Param("moer_bias", -0.2, 0.2),
    Param("horizon_h", 12, 36, integer=True),
    Param("demand_day_type", 0, 1, integer=True),
)
"""The tuned parameters and their ranges: the weight as a share; days and hours as integers; the terminal value as
a multiple of the shipped rule's (1: a stored kWh is worth the window's mean MOER times ``eta_discharge``); the
contrast as a factor on the outlook's deviation from its mean; the bias as a share of that mean; whether the expected
demand is drawn from past days of the hour's own day type (weekday or weekend) as a yes/no (above 0.5: yes)."""


VALIDATED_MEANS = 3
"""CMA-ES's means after the last this many generations are validated beside the starting point."""


@dataclass(frozen=True)
class Budget:
    """How much closed-loop evaluation one tuning spends: ``generations`` x ``popsize`` candidates, each backtested on
    ``weeks`` weeks; ``sigma0`` is CMA-ES's initial step as a share of each parameter's range; ``validation_weeks``: the
    weeks, spread evenly over the split, on which CMA-ES's means after the last :data:`VALIDATED_MEANS` generations are
    compared with the starting point (the cheapest one is the result); ``rl_days``: the days (env steps) ``mpc_rl``'s
    PPO trains for (:mod:`pipeline.control.rl_planner`)."""

    generations: int
    popsize: int
    weeks: int
    sigma0: float = 0.2
    rl_days: int = 0
    validation_weeks: int = 6

    @property
    def windows(self) -> int:
        """Week backtests the tuning runs (at most: the validation backtests each distinct mean once)."""
        return (
            self.generations * self.popsize * self.weeks
            + (1 + min(VALIDATED_MEANS, self.generations)) * self.validation_weeks
        )


BUDGETS = {
    "tiny": Budget(generations=2, popsize=4, weeks=1, rl_days=14, validation_weeks=1),
    "small": Budget(generations=4, popsize=6, weeks=3, rl_days=140, validation_weeks=6),
    "full": Budget(generations=10, popsize=8, weeks=4, rl_days=700, validation_weeks=16),
}
"""From the least to the most: ``tiny`` for tests of the whole pipeline (at most 11 week backtests and 14 days of PPO
a seed); ``small``: inside ``doit run pipeline`` (at most 96 week backtests and 140 days); ``full``: ``doit run tune``
(at most 384 week backtests and 700 days, about three times the train split's)."""


def encode(params: PlannerParams, space: Sequence[Param] = SPACE, undecided: bool = False) -> np.ndarray:
    """``(len(space),)`` float64: each tuned parameter's value in its units, clipped to its range; with ``undecided`` a
    yes/no parameter sits at 0.5, where either answer is as likely (CMA-ES's start)."""
    d = params.as_dict()
    return np.array(
        [
            0.5 if undecided and isinstance(d[p.name], bool) else float(np.clip(float(d[p.name]), p.low, p.high))
            for p in space
        ]
    )


def decode(x: Sequence[float], base: PlannerParams, space: Sequence[Param] = SPACE) -> PlannerParams:
    """The parameters at ``x`` (a point of CMA-ES in the units of ``space``: integer coordinates already rounded by
    ``cma``), the others as in ``base``; the continuous ones rounded to 4 decimals for the record.

    Raises:
        ValueError: a coordinate outside its range, or an integer parameter at a non-integer value.
    """
    values = {}
    for p, v in zip(space, np.asarray(x, np.float64)):
        slack = 1e-9 * (p.high - p.low)  # cma's bound handling is exact up to float rounding
        if not p.low - slack <= v <= p.high + slack or (p.integer and not float(v).is_integer()):
            raise ValueError(f"{p.name} = {v} is not a point of [{p.low}, {p.high}]{' (integer)' if p.integer else ''}")
        v = float(np.clip(v, p.low, p.high))
        if isinstance(getattr(base, p.name), bool):
            values[p.name] = bool(v)
        else:
            values[p.name] = int(v) if p.integer else round(v, 4)
    return replace(base, **values)


def fingerprint(site_toml: str | Path, split: str = "train", root: Path = PROJECT_ROOT) -> str:
    """SHA-256 (hex) of what a tuning depends on: the split, the site's files (:func:`pipeline.depends.site_files`)
    and the controllers' code under ``root`` (:func:`pipeline.depends.controllers`: every file of ``envs`` and
    ``pipeline/control``, the files doit's ``tune`` tasks depend on).

    Raises:
        FileNotFoundError: a site file that is not there. envs.config.ConfigError: a bad site TOML.
    """
    files = [*depends.site_files(site_toml), *depends.controllers(root)]
    return depends.fingerprint(files, root=root, salt=split)


@dataclass
class TuningResult:
    """One tuning: the chosen parameters, the seed and budget, and every candidate evaluated.

    Attributes:
        params: the chosen :class:`PlannerParams`: of CMA-ES's means after the last generations and the starting
            point, the one that costs least on the validation weeks.
        start: the parameters it started from (:meth:`PlannerParams.learned_start`).
        seed: CMA-ES's seed. budget: the :data:`BUDGETS` name (``"custom"`` for another :class:`Budget`).
        budget_spec: the :class:`Budget` itself.
        history: one row per (generation, candidate): ``generation``, ``candidate`` (its index in the generation, str;
            ``start`` and ``mean after generation g`` in the validation rows after the last one), the parameters,
            ``cost_kg`` (CO2 plus the unserved penalty summed over the weeks), ``weeks`` (their indices in the split,
            str).
        wall_s: seconds of the whole tuning; solves, solve_s: LP solves of its backtests and their seconds.
    """

    params: PlannerParams
    start: PlannerParams
    seed: int
    budget: str
    budget_spec: Budget
    history: pd.DataFrame
    wall_s: float
    solves: int
    solve_s: float

    def summary(self) -> dict:
        """JSON-able summary (no history)."""
        return {
            "params": self.params.as_dict(),
            "start": self.start.as_dict(),
            "seed": self.seed,
            "budget": self.budget,
            "budget_spec": asdict(self.budget_spec),
            "wall_s": self.wall_s,
            "solves": self.solves,
            "solve_s": self.solve_s,
        }


Evaluate = Callable[[list[tuple["PlannerParams", int, int]]], list["WindowResult"]]
"""Backtests a batch of ``(params, start, steps)`` windows of the tuned split, in order (locally or on Dask)."""


Window = Callable[..., "WindowResult"]
"""A backtest of one window, ``(site, split, start, steps, params) -> WindowResult``: the planner's
(:func:`pipeline.control.backtest.run_window`, the default) or another planner on the same parameters
(:func:`pipeline.control.scenario.run_window`)."""


def _planner_window(window: Window | None) -> Window:
    """``window``, or the planner's backtest (:func:`pipeline.control.backtest.run_window`) when None."""
    if window is not None:
        return window
    from pipeline.control.backtest import run_window

    return run_window


def local_evaluator(site: Site | str, split: str, window: Window | None = None) -> Evaluate:
    """Backtests one window after another in this process, each by ``window`` (default: the planner's,
    :func:`pipeline.control.backtest.run_window`)."""
    window = _planner_window(window)
    return lambda jobs: [window(site, split, s, n, p) for p, s, n in jobs]


def dask_evaluator(client, site_toml: str, split: str, priority: int = 0, window: Window | None = None) -> Evaluate:
    """Backtests as Dask tasks of ``client`` at Dask ``priority``, one task per window, each by ``window`` (default:
    the planner's, :func:`pipeline.control.backtest.run_window`; a worker loads a site once)."""
    window = _planner_window(window)

    def evaluate(jobs):
        futures = [
            client.submit(window, site_toml, split, s, n, p.as_dict(), priority=priority, pure=False)
            for p, s, n in jobs
        ]
        return client.gather(futures)

    return evaluate


@contextmanager
def _repair_draws(run: dict):
    """Run a block of ``cma`` calls with NumPy's global generator in the state ``run["repair_state"]``, kept where the
    block leaves it; the caller's state is restored after.

    CMA-ES samples from each seed's own generator (the ``randn`` option), but cma's integer handling (its
    ``IntegerCentering.repair``, cma 4.5) draws from NumPy's global generator when it moves an integer coordinate
    back into its bounds. Without this, the seeds tuned in lockstep would share one stream for those draws, and a seed's
    tuning would depend on which other seeds were tuned beside it.
    """
    outer = np.random.get_state()
    np.random.set_state(run["repair_state"])
    try:
        yield
    finally:
        run["repair_state"] = np.random.get_state()
        np.random.set_state(outer)


def tune(
    site: Site | str,
    seeds: Sequence[int] = (1,),
    budget: str | Budget = "small",
    evaluate: Evaluate | None = None,
    split: str = "train",
    space: Sequence[Param] = SPACE,
    progress: Callable[[str], None] = print,
    start: PlannerParams | None = None,
) -> list[TuningResult]:
    """Tune the planner's parameters by CMA-ES on sampled weeks of ``split``, once per seed (module docstring).

    The seeds' CMA-ES runs go in lockstep: each generation's candidates of every seed are backtested in one batch, so
    a Dask evaluator keeps every worker busy.

    Args:
        site: a loaded site or a site TOML path.
        seeds: one tuning per seed (it seeds CMA-ES's generator and the weeks sampled, each its own stream).
        budget: a key of :data:`BUDGETS`, or a :class:`Budget`.
        evaluate: how windows are backtested (default :func:`local_evaluator`).
        split: the split tuned on (the train split; tuning never reads another).
        space: the parameters tuned (default :data:`SPACE`; the others stay at ``start``'s).
        progress: called with one line per generation.
        start: where CMA-ES starts (default :meth:`PlannerParams.learned_start`; its yes/no parameters in ``space``
            undecided).

    Returns:
        one :class:`TuningResult` per seed, in ``seeds``' order.

    Raises:
        KeyError: an unknown budget. ValueError: a split with fewer than two weeks.
    """
    from cma import CMAEvolutionStrategy

    site = load_site(site)
    b, name = (budget, "custom") if isinstance(budget, Budget) else (BUDGETS[budget], budget)
    evaluate = evaluate or local_evaluator(site, split)
    pool = _week_pool(site, split)
    from pipeline.control.mpc import PlannerParams

    start = start or PlannerParams.learned_start(site.config)
    x0 = encode(start, space, undecided=True)
    box = list(space)
    if len(box) == 1:  # cma needs two dimensions at least: a second one that decode() ignores
        box.append(Param("unused", 0.0, 1.0))
        x0 = np.r_[x0, 0.5]
    t0 = time.perf_counter()
    runs = [_start_run(CMAEvolutionStrategy, seed, x0, box, b) for seed in seeds]
    for g in range(b.generations):
        _generation(runs, g, pool, b, start, space, evaluate, progress)
    chosen = _validate(runs, pool, b, start, evaluate, progress)
    return [
        TuningResult(
            params,
            start,
            int(r["seed"]),
            name,
            b,
            pd.DataFrame(r["rows"]),
            time.perf_counter() - t0,
            r["solves"],
            r["solve_s"],
        )
        for r, params in zip(runs, chosen)
    ]


def _week_pool(site: Site, split: str) -> list[tuple[int, int]]:
    """The ``(start, steps)`` windows a tuning samples: the whole weeks of ``split`` after its first (in which the
    planner's forecasts warm up).

    Raises:
        ValueError: a split with fewer than two whole weeks.
    """
    data = site.split(split)
    from pipeline.control.backtest import weeks

    pool = weeks(data)[1:]  # the first week warms the planner's forecasts up
    pool = [w for w in pool if w[1] == pool[0][1]]  # whole weeks only
    if len(pool) < 1:
        raise ValueError(f"split '{split}' has {data.num_steps} steps: fewer than two whole weeks to tune on")
    return pool


def _start_run(strategy: Callable, seed: int, x0: np.ndarray, box: Sequence[Param], b: Budget) -> dict:
    """One seed's tuning before its first generation: its CMA-ES (an instance of ``strategy``, cma's
    ``CMAEvolutionStrategy``) at ``x0`` in ``box``, its generators (:func:`_repair_draws`) and its empty records."""
    weeks_rng = np.random.default_rng(int(seed))
    streams = np.random.SeedSequence(int(seed)).spawn(2)  # cma's, independent of the weeks'
    cma_rng = np.random.default_rng(streams[0])
    es = strategy(
        x0,
        b.sigma0,
        {
            "popsize": b.popsize,
            "maxiter": b.generations,
            "bounds": [[p.low for p in box], [p.high for p in box]],
            "CMA_stds": [p.high - p.low for p in box],  # sigma0 is a share of each parameter's range
            "integer_variables": [i for i, p in enumerate(box) if p.integer],
            "randn": lambda lam, n, rng=cma_rng: rng.standard_normal((lam, n)),
            "seed": np.nan,  # cma leaves NumPy's global generator alone
            "verbose": -9,
        },
    )
    return {
        "seed": seed,
        "es": es,
        "rng": weeks_rng,
        "repair_state": np.random.RandomState(np.random.MT19937(streams[1])).get_state(),
        "rows": [],
        "solves": 0,
        "solve_s": 0.0,
        "means": [],
    }


def _generation(
    runs: list[dict],
    g: int,
    pool: list[tuple[int, int]],
    b: Budget,
    start: PlannerParams,
    space: Sequence[Param],
    evaluate: Evaluate,
    progress: Callable[[str], None],
) -> None:
    """Generation ``g`` of every seed's CMA-ES: each samples its candidates and weeks of ``pool``, all candidates are
    backtested in one batch, each CMA-ES is told its costs; its rows, solves and mean are recorded in its run."""
    batch, layout = [], []
    for r in runs:
        with _repair_draws(r):
            X = r["es"].ask()
        picked = sorted(r["rng"].choice(len(pool), size=min(b.weeks, len(pool)), replace=False).tolist())
        cands = [decode(x, start, space) for x in X]
        layout.append((r, X, cands, picked, len(batch)))
        batch += [(c, pool[i][0], pool[i][1]) for c in cands for i in picked]
    results = evaluate(batch)
    for r, X, cands, picked, at in layout:
        n = len(picked)
        costs = []
        for k, c in enumerate(cands):
            res = results[at + k * n : at + (k + 1) * n]
            costs.append(float(sum(x.cost for x in res)))
            r["solves"] += sum(x.solves for x in res)
            r["solve_s"] += sum(x.solve_s for x in res)
            r["rows"].append(
                {
                    "generation": g,
                    "candidate": str(k),
                    **c.as_dict(),
                    "cost_kg": costs[-1],
                    "weeks": ",".join(str(i + 1) for i in picked),
                }
            )
        with _repair_draws(r):
            r["es"].tell(X, costs)
        best = decode(r["es"].to_phenotype(r["es"].mean), start, space)  # the mean, its integers rounded
        r["means"].append(best)
        progress(
            f"tune seed {r['seed']} generation {g + 1}/{b.generations}: best {min(costs):.1f} kg, "
            f"median {float(np.median(costs)):.1f} kg over {n} weeks; mean now {_short(best)}"
        )


def _validate(
    runs: list[dict],
    pool: list[tuple[int, int]],
    b: Budget,
    start: PlannerParams,
    evaluate: Evaluate,
    progress: Callable[[str], None],
) -> list[PlannerParams]:
    """Backtest each seed's starting point and its distinct means after the last :data:`VALIDATED_MEANS`
    generations on the same validation weeks of ``pool``, every seed's in one batch, and keep the cheapest (the tuning
    never ends worse than it began, and a last generation that drifted does not decide alone); the rows and solves
    are added to each run, one progress line per seed.

    Returns:
        the parameters each run keeps, in ``runs``' order.
    """
    step = max(1, len(pool) // max(1, b.validation_weeks))
    valid = pool[::step][: b.validation_weeks]
    for r in runs:
        r["cands"] = [("start", start)]
        last = r["means"][-VALIDATED_MEANS:]
        for g, m in enumerate(last, start=b.generations - len(last) + 1):
            if all(m != c for _, c in r["cands"]):
                r["cands"].append((f"mean after generation {g}", m))
    batch = [(c, s, n) for r in runs for _, c in r["cands"] for s, n in valid]
    results = iter(evaluate(batch) if batch else [])
    kept = []
    for r in runs:
        cands = r["cands"]
        res = [next(results) for _ in range(len(cands) * len(valid))]
        costs = [sum(x.cost for x in res[k * len(valid) : (k + 1) * len(valid)]) for k in range(len(cands))]
        r["solves"] += sum(x.solves for x in res)
        r["solve_s"] += sum(x.solve_s for x in res)
        best = int(np.argmin(costs))  # ties: the start
        for (label, params), cost in zip(cands, costs):
            r["rows"].append(
                {
                    "generation": b.generations,
                    "candidate": label,
                    **params.as_dict(),
                    "cost_kg": cost,
                    "weeks": ",".join(str(pool.index(w) + 1) for w in valid),
                }
            )
        progress(
            f"tune seed {r['seed']} validation over {len(valid)} weeks: "
            + ", ".join(f"{label} {c:.1f} kg" for (label, _), c in zip(cands, costs))
            + f"; keeps the {cands[best][0]}"
        )
        kept.append(cands[best][1])
    return kept


def _short(p: PlannerParams) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in p.as_dict().items())


# ------------------------------------------------------------------------------------------------ the cache
def write(result: TuningResult, folder: str | Path, fingerprint_hex: str) -> list[Path]:
    """Write a tuning's summary (JSON, with the fingerprint it was made for) and history atomically."""
    js, hist = tuning_files(folder, result.seed)
    return [
        write_parquet(result.history, hist),
        write_text(js, json.dumps(result.summary() | {"fingerprint": fingerprint_hex}, indent=2)),
    ]


def cached(folder: str | Path, seed: int, fingerprint_hex: str, budget: str = "small") -> dict | None:
    """The cached tuning summary of ``seed`` in ``folder`` when it was made for ``fingerprint_hex`` with ``budget``
    or a larger one (:data:`BUDGETS` order); else None."""
    js, hist = tuning_files(folder, seed)
    if not (js.is_file() and hist.is_file()):
        return None
    try:
        s = json.loads(js.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    order = list(BUDGETS)
    if s.get("fingerprint") != fingerprint_hex or s.get("budget") not in order:
        return None
    return s if order.index(s["budget"]) >= order.index(budget) else None


def kept_start(folder: str | Path, seed: int, config) -> bool:
    """Whether the tuning of ``seed`` in ``folder`` ended where ``mpc_tuned_start`` plans: its parameters are
    :meth:`~pipeline.control.mpc.PlannerParams.learned_start`'s for the site ``config`` (then ``mpc_tuned`` runs the
    same planner as ``mpc_tuned_start``)."""
    from pipeline.control.mpc import PlannerParams

    return load_params(folder, seed) == PlannerParams.learned_start(config)


def load_params(folder: str | Path, seed: int) -> PlannerParams:
    """The tuned parameters of ``seed`` from ``folder``.

    Raises:
        FileNotFoundError: no tuning of that seed there (the message says how to make one).
    """
    js, _ = tuning_files(folder, seed)
    if not js.is_file():
        raise FileNotFoundError(
            f"{js}: no tuned planner parameters for seed {seed} (run `doit run tune` or the pipeline)"
        )
    from pipeline.control.mpc import PlannerParams

    return PlannerParams.from_dict(json.loads(js.read_text())["params"])
