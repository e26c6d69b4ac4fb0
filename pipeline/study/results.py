"""The names of the study's result files, written and read here only.

Under ``<output_dir>/<experiment>/``::

    baselines/<controller>_<split>.parquet                 one KPI row of a simulated controller
    baselines/<controller>_<split>_traces.parquet          its hourly traces
    runs/<agent>_seed<seed>/                               a training run (TensorBoard events, metrics, policy)
    eval/<agent>_seed<seed>_<split>[_traces].parquet       a trained agent evaluated on a split
    physics/<controller>[_seed<seed>]_<split>[_traces].parquet   any of them scored on the 5-minute site

    validate/<input>.json                                  one input of the site checked (:data:`INPUTS`)
    tuned/                                                 the learned planners' tuning (:mod:`pipeline.control.tuned`)
    planners/<controller>_seed<seed>_<split>[_traces].parquet   a learned planner tuned with a seed, on a split
    report/                                                the report (:mod:`pipeline.study.report`)
    online/<controller>_online_seed<seed>_<split>[_traces].parquet   an online form (``doit run online``)

Controller names may hold underscores (``rule_based``, ``mpc_perfect``); a split name is the last part and
never holds one. :func:`outputs` names every file each stage writes, importing no controller (doit names its targets
with it before anything heavy is imported).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from envs.config import load_config
from pipeline.control import registry
from pipeline.control.tuned import rl_policy_file, rl_run_dir, tuning_files
from pipeline.study.config import SPLITS, PipelineConfig

INPUTS = ("config", "series", "sessions")
"""The site's inputs, each validated by one task into ``validate/<input>.json``."""

ONLINE_FORMS = ("dqn", "ppo", "mpc_rl")
"""The controllers with an online form (``doit run online``, :mod:`pipeline.study.online`; its
``FINE_TUNE_STEPS`` has one entry each)."""

TRACES_SUFFIX = "_traces"
_SEED = re.compile(r"^(?P<controller>.+)_seed(?P<seed>\d+)$")


def run_name(agent: str, seed: int) -> str:
    """A training run's folder name, ``<agent>_seed<seed>``."""
    return f"{agent}_seed{seed}"


def stem(controller: str, split: str, seed: int | None = None) -> str:
    """``<controller>_<split>`` or, for a seeded agent, ``<agent>_seed<seed>_<split>``.

    Raises:
        ValueError: a split name with an underscore (it could not be read back).
    """
    if "_" in split:
        raise ValueError(f"split name {split!r} must not contain '_'")
    return f"{controller if seed is None else run_name(controller, seed)}_{split}"


def files(folder: str | Path, controller: str, split: str, seed: int | None = None) -> tuple[Path, Path]:
    """``(kpi_file, traces_file)`` of one controller (or seeded agent) on one split inside ``folder``."""
    s = stem(controller, split, seed)
    return Path(folder) / f"{s}.parquet", Path(folder) / f"{s}{TRACES_SUFFIX}.parquet"


@dataclass(frozen=True)
class ResultFile:
    """What a result file's name says: its controller, seed (None for a simulated controller), split and whether
    it holds traces."""

    controller: str
    seed: int | None
    split: str
    traces: bool


def parse(path: str | Path) -> ResultFile:
    """Read a result file's name back (the inverse of :func:`files`).

    Raises:
        ValueError: a name that :func:`files` does not write.
    """
    name = Path(path).name
    if not name.endswith(".parquet"):
        raise ValueError(f"{path}: not a result file (expected <controller>_<split>[_traces].parquet)")
    base = name.removesuffix(".parquet")
    traces = base.endswith(TRACES_SUFFIX)
    base = base.removesuffix(TRACES_SUFFIX) if traces else base
    head, sep, split = base.rpartition("_")
    if not sep or not head or not split:
        raise ValueError(f"{path}: not a result file (expected <controller>_<split>[_traces].parquet)")
    m = _SEED.match(head)
    return ResultFile(m["controller"], int(m["seed"]), split, traces) if m else ResultFile(head, None, split, traces)


def simulated(cfg: PipelineConfig) -> tuple[str, ...]:
    """The controllers of the ``baselines`` stage for this site: simulated, reading no tuning
    (:func:`pipeline.control.registry.simulated`)."""
    return registry.simulated(load_config(cfg.site_toml)[0], tuned=False)


def planners(cfg: PipelineConfig) -> tuple[str, ...]:
    """The controllers of the ``planners`` stage for this site: simulated once per seed from the tuning."""
    return registry.simulated(load_config(cfg.site_toml)[0], tuned=True)


def physics_scored(cfg: PipelineConfig) -> bool:
    """Whether the study also scores its controllers on the site simulated at 5 minutes (the ``physics`` stage): when
    the site steps above 5 minutes and its data hold a series at 5 minutes (:func:`envs.site.physics_file`)."""
    from envs import timestep
    from envs.site import physics_file

    step = load_config(cfg.site_toml)[0].dt_h
    return (
        timestep.step_minutes(step) > timestep.step_minutes(timestep.PHYSICS_DT_H)
        and physics_file(cfg.site_toml).is_file()
    )


def outputs(cfg: PipelineConfig) -> dict[str, list[Path]]:
    """Every file each stage writes, by stage (doit's targets and the stand-ins for skipped stages)."""
    root = cfg.root
    runs = [(a, s) for a in cfg.algos for s in cfg.seeds]
    tuned = planners(cfg)  # the site config read once
    scored = physics_scored(cfg)
    physics = root / "physics"
    return {
        "validate": [root / "validate" / f"{i}.json" for i in INPUTS],
        "baselines": [f for c in simulated(cfg) for s in SPLITS for f in files(root / "baselines", c, s)],
        "tune": [f for seed in cfg.seeds for f in tuning_files(root / "tuned", seed)] if tuned else [],
        "tune_rl": [rl_policy_file(rl_run_dir(root / "tuned", sd)) for sd in cfg.seeds] if "mpc_rl" in tuned else [],
        "planners": [f for c in tuned for sd in cfg.seeds for s in SPLITS for f in files(root / "planners", c, s, sd)],
        "train": [root / "runs" / run_name(a, s) / f for a, s in runs for f in ("metrics.parquet", "policy.pt2")],
        "evaluate": [f for a, seed in runs for s in SPLITS for f in files(root / "eval", a, s, seed)],
        "physics_baselines": [f for c in simulated(cfg) for s in SPLITS for f in files(physics, c, s)]
        if scored
        else [],
        "physics_planners": [f for c in tuned for sd in cfg.seeds for s in SPLITS for f in files(physics, c, s, sd)]
        if scored
        else [],
        "physics_agents": [f for a, seed in runs for s in SPLITS for f in files(physics, a, s, seed)] if scored else [],
        "report": [root / "report" / f for f in ("report.md", "report.html", "co2_comparison.parquet")],
    }


def online_algos(algos) -> tuple[str, ...]:
    """The agents of ``algos`` that have an online form (:data:`ONLINE_FORMS`, ``mpc_rl`` apart: a planner)."""
    return tuple(a for a in algos if a in ONLINE_FORMS and a != "mpc_rl")


def online_forms(cfg: PipelineConfig) -> tuple[str, ...]:
    """What ``doit run online`` runs an online form of: :func:`online_algos` of ``cfg.algos``, and ``mpc_rl`` where
    the site runs it (:func:`planners`)."""
    return online_algos(cfg.algos) + (("mpc_rl",) if "mpc_rl" in planners(cfg) else ())


def online_outputs(cfg: PipelineConfig) -> list[Path]:
    """The KPI and traces files ``doit run online`` writes into ``<root>/online/``."""
    out = Path(cfg.root) / "online"
    return [p for a in online_forms(cfg) for s in cfg.seeds for sp in SPLITS for p in files(out, f"{a}_online", sp, s)]
