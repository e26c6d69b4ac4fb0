"""The one table of the study's controllers: every name the pipeline, the report and sizing know, in report order.

Each :class:`Controller` says what it is (``family``), what it may know when it acts (``causal``, ``knows``),
whether it learns from data (``learned``) and, for the controllers the pipeline simulates itself, how to run it
over one split (:meth:`Controller.simulate`). The agents are trained by their ``algos/<name>.py`` scripts and
evaluated from their exported policies (``pipeline.study.tasks``); they are here so that names, order and what
each row of the report knows come from one place.

Families, in report order:

- ``reference``: ``uncontrolled``, what the site does without control (the CO2 reference);
- ``rule``: ``rule_based``, the self-consumption battery rule;
- ``planner``: ``mpc``, the receding-horizon LP with hand-set parameters (:mod:`pipeline.control.mpc`);
- ``learned planner``: the planners that learn from the site's realised data (their own section of the docs);
- ``agent``: the model-free agents, one script each;
- ``online agent``: an agent (or ``mpc_rl``'s day-level policy) that keeps learning, week by week, from the realised
  past of the split it acts in (``pipeline.study.online``; ``doit run online``, not part of the pipeline);
- ``bound``: ``mpc_perfect`` (the planner given the true future within its horizon) and the ``oracle`` (the
  perfect-foresight LP over the whole split): not causal, they bracket what information is worth.

The protocol every causal row obeys: it uses only what was realised before the hour it acts on, in the train
split and in the split it acts on; nothing is chosen on the test split's outcome.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from envs.config import SiteConfig
from envs.toml_table import did_you_mean

if TYPE_CHECKING:
    from envs.site import Site

FAMILIES = ("reference", "rule", "planner", "learned planner", "agent", "online agent", "bound")
"""Controller families in report order."""


def _always(cfg: SiteConfig) -> bool:
    return True


def _mpc_enabled(cfg: SiteConfig) -> bool:
    return cfg.mpc.enabled


LEARNED_MIN_TRAIN_DAYS = 15
"""The learned planners need this many days in the train split: a week that warms the forecasts up, then a whole
week to tune on and to draw ``mpc_rl``'s week-long episodes from (and the hour that ends the last). A site with a
shorter train split runs without them."""


def _learned_enabled(cfg: SiteConfig) -> bool:
    start, end = cfg.split_bounds("train")
    return cfg.mpc.enabled and (end - start) >= pd.Timedelta(days=LEARNED_MIN_TRAIN_DAYS)


@dataclass(frozen=True)
class Controller:
    """One row of :data:`CONTROLLERS`.

    Attributes:
        name: the controller's name in file names, tables and doit variables.
        family: one of :data:`FAMILIES`.
        causal: acts only on what was realised before the hour it acts on (``False``: ``mpc_perfect``, ``oracle``).
        learned: fits something to the site's data (a forecast, its parameters or a network).
        knows: what it reads when it acts, in a few words (the report's "knows" column).
        runner: the function that simulates it over a split, ``(site, split, *runner_args, [seed=, tuned_dir=]) ->
            (kpi_row, traces)``, named ``"module:function"`` and imported when it runs (so that reading this table
            imports no controller); ``None`` for the agents (trained and evaluated by the study).
        runner_args: extra positional arguments of the runner after ``(site, split)``.
        enabled: whether a site runs it (the MPC family can be switched off with ``[mpc] enabled = false``; the learned
            planners also need :data:`LEARNED_MIN_TRAIN_DAYS` in the train split).
        retries: Dask retries of its task (every simulation is deterministic and safe to repeat).
        seeded: runs once per seed of the study (its result files carry the seed, the report averages them).
        tuned: reads the planner parameters tuned on the train split (``<experiment>/tuned/``,
            :mod:`pipeline.control.tuning`), so it runs after the study's ``tune`` stage.
        start: the row of its untrained start, which its learning is credited against (``mpc_tuned``: the tuning's
            start, ``mpc_tuned_start``; ``mpc_adaptive``: ``mpc_tuned``, whose parameters its weekly re-choice starts
            from; ``mpc_rl``: its policy's zero action, ``mpc_rl_start``); None where the table has none.
    """

    name: str
    family: str
    causal: bool
    learned: bool
    knows: str
    runner: str | None = None
    runner_args: tuple = ()
    enabled: Callable[[SiteConfig], bool] = _always
    retries: int = 1
    seeded: bool = False
    tuned: bool = False
    start: str | None = None

    @property
    def simulated(self) -> bool:
        """Whether the study simulates it over a split itself (everything but the agents)."""
        return self.runner is not None

    def simulate(
        self, site: Site, split: str, seed: int | None = None, tuned_dir=None, physics_dt_h: float | None = None
    ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Run it over one whole split; returns ``(kpi_row, traces)`` (:func:`envs.kpis.evaluate_policy`'s).

        Args:
            seed: the study's seed (a ``seeded`` controller needs one). tuned_dir: the tuning folder (a ``tuned``
                controller needs it).
            physics_dt_h: score it on the site simulated at that finer step (its decisions every step of the site,
                held over the physics' sub-steps; the oracle solved at that step).

        Raises:
            TypeError: an agent (it is trained, not simulated here), or a missing seed or tuning folder.
            KeyError: unknown split. RuntimeError: an LP not solved, or an energy-balance violation.
            FileNotFoundError: a ``tuned`` controller whose tuning is not in ``tuned_dir``.
        """
        if self.family == "online agent":
            raise TypeError(f"controller {self.name!r} is an online agent: run it with doit run online")
        if self.runner is None:
            raise TypeError(f"controller {self.name!r} is an agent: train it with algos/{self.name}.py")
        kwargs = {}
        if self.seeded:
            if seed is None:
                raise TypeError(f"controller {self.name!r} runs once per seed: give a seed")
            kwargs["seed"] = int(seed)
        if self.tuned:
            if tuned_dir is None:
                raise TypeError(f"controller {self.name!r} reads tuned parameters: give the tuning folder")
            kwargs["tuned_dir"] = tuned_dir
        if physics_dt_h is not None:
            kwargs["physics_dt_h"] = physics_dt_h
        return self.run_function(site, split, *self.runner_args, **kwargs)

    @property
    def run_function(self) -> Callable[..., tuple[pd.DataFrame, pd.DataFrame]]:
        """The runner itself, imported from its module.

        Raises:
            TypeError: an agent (no runner).
        """
        if self.runner is None:
            raise TypeError(f"controller {self.name!r} has no runner: it is trained, not simulated")
        module, _, function = self.runner.partition(":")
        return getattr(importlib.import_module(module), function)


_AGENT_KNOWS = (
    "the observation (PV, MOER and its forecasts, SOC, sockets, time; with agent_inputs=context also the arrivals "
    "expected per socket group from the acting split's past days); trained on the train split"
)

CONTROLLERS: dict[str, Controller] = {
    c.name: c
    for c in (
        Controller("uncontrolled", "reference", True, False, "nothing: EVs at full power, battery idle",
                   "pipeline.control.baselines:simulate", ("uncontrolled",), retries=2),
        Controller("rule_based", "rule", True, False, "the hour's PV surplus or deficit",
                   "pipeline.control.baselines:simulate", ("rule_based",), retries=2),
        Controller("mpc", "planner", True, False,
                   "24 h LP on a MOER regression refit daily and the past week's sessions (hand-set weights)",
                   "pipeline.control.mpc:simulate", ("mpc",), _mpc_enabled),
        Controller("mpc_tuned_start", "learned planner", True, False,
                   "mpc_tuned's untrained start: mpc on the learned MOER forecast at the site's [mpc] values, where"
                   " CMA-ES starts",
                   "pipeline.control.learned:simulate_tuned_start", (), _learned_enabled),
        Controller("mpc_tuned", "learned planner", True, True,
                   "mpc on a learned MOER forecast (5-minute data, forgets old days), its parameters tuned by"
                   " CMA-ES in closed loop on the train split's weeks",
                   "pipeline.control.learned:simulate_tuned", (), _learned_enabled, seeded=True, tuned=True,
                   start="mpc_tuned_start"),
        Controller("mpc_adaptive", "learned planner", True, True,
                   "mpc_tuned, its demand weight re-chosen each week by backtesting the split's last weeks",
                   "pipeline.control.learned:simulate_adaptive", (), _learned_enabled, seeded=True, tuned=True,
                   start="mpc_tuned"),
        Controller("mpc_rl_start", "learned planner", True, False,
                   "mpc_rl's untrained start: its planner (learned MOER forecast, demand by day type) with the"
                   " policy's zero action every day: demand weight 0.5, terminal value 1.0",
                   "pipeline.control.rl_planner:simulate_start", (), _learned_enabled),
        Controller("mpc_rl", "learned planner", True, True,
                   "mpc on a learned MOER forecast and demand by day type, its demand weight and terminal value"
                   " set each day by a PPO policy trained on the train split",
                   "pipeline.control.rl_planner:simulate_rl", (), _learned_enabled, seeded=True, tuned=True,
                   start="mpc_rl_start"),
        Controller("mpc_scenario", "learned planner", True, False,
                   "a 24 h two-stage LP over scenarios: the real sessions of each of the last 21 past days of the"
                   " same day type, one shared first step; the learned MOER forecast",
                   "pipeline.control.scenario:simulate", (), _learned_enabled),
        *(Controller(a, "agent", True, True, _AGENT_KNOWS, seeded=True) for a in ("ppo", "sac", "a2c", "dqn")),
        *(Controller(f"{a}_online", "online agent", True, True,
                     f"{a}'s observation; from the second week on, fine-tuned at each week's start on the acting "
                     "split's past weeks", seeded=True, start=a) for a in ("ppo", "dqn")),
        Controller("mpc_rl_online", "online agent", True, True,
                   "mpc_rl, its day-level policy fine-tuned at each week's start by PPO on backtests of the acting"
                   " split's last 4 weeks", seeded=True, start="mpc_rl"),
        Controller("mpc_perfect", "bound", False, False, "the true MOER and arrivals of the next 24 h",
                   "pipeline.control.mpc:simulate", ("mpc_perfect",), _mpc_enabled),
        Controller("oracle", "bound", False, False, "the whole split (perfect-foresight LP)",
                   "pipeline.control.oracle:simulate"),
    )
}  # fmt: skip
"""Every controller by name, in report order (agents among themselves are shown by name)."""


def get(name: str) -> Controller:
    """The controller called ``name``.

    Raises:
        KeyError: an unknown name; the message gives the closest known one and every known name.
    """
    if name not in CONTROLLERS:
        raise KeyError(
            f"unknown controller {name!r}{did_you_mean(name, CONTROLLERS)} (known: {', '.join(CONTROLLERS)})"
        )
    return CONTROLLERS[name]


def agents() -> tuple[str, ...]:
    """The model-free agents (one ``algos/<name>.py`` script each), in the pipeline's training order."""
    return tuple(n for n, c in CONTROLLERS.items() if c.family == "agent")


def simulated(cfg: SiteConfig | None = None, tuned: bool | None = None) -> tuple[str, ...]:
    """The controllers the study simulates itself, in report order; with ``cfg``, those that site runs; with
    ``tuned``, only those that do (True) or do not (False) read tuned parameters."""
    return tuple(
        n
        for n, c in CONTROLLERS.items()
        if c.simulated and (cfg is None or c.enabled(cfg)) and (tuned is None or c.tuned == tuned)
    )


def is_agent(name: str) -> bool:
    """Whether ``name`` is a trained agent's row: a registered agent or online agent, or any name the table does not
    know (an agent script outside it)."""
    return name not in CONTROLLERS or CONTROLLERS[name].family in ("agent", "online agent")


def describe(name: str) -> Controller:
    """The registry's row of ``name``; a name it does not know is an agent script outside it (causal, learned)."""
    return CONTROLLERS.get(name) or Controller(name, "agent", True, True, _AGENT_KNOWS)


def sort_key(name: str) -> tuple[int, str]:
    """Report order: the table's order, the agents and online agents (and unknown names) by name where the first
    agent stands."""
    names = list(CONTROLLERS)
    first_agent = next(i for i, n in enumerate(names) if CONTROLLERS[n].family == "agent")
    if is_agent(name):
        return (first_agent, name)
    return (names.index(name), "")
