"""What one run of the study is: which site, which agents, where outputs go, which Dask cluster.

Values come from, in order: keyword arguments, doit command-line variables (``doit run pipeline
site=path/to/site.toml``), environment variables (``EVHUB_SITE``, ``EVHUB_EXPERIMENT``,
``EVHUB_OUTPUT_DIR``, ``EVHUB_ALGOS``, ``EVHUB_SEEDS``, ``EVHUB_TOTAL_TIMESTEPS``,
``EVHUB_ALGO_ARGS``, ``EVHUB_AGENT_BUDGET``, ``EVHUB_AGENT_INPUTS``, ``DASK_SCHEDULER_ADDRESS``), then
defaults. A doit variable that is not one of :data:`VARIABLES` (a typo such as ``algo=ppo``) and an unknown algorithm
name are errors naming the variable and its value.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from envs import timestep
from envs.config import load_config
from envs.toml_table import did_you_mean
from pipeline.control import registry
from pipeline.control.tuning import BUDGETS
from pipeline.paths import PROJECT_ROOT, shown_path  # noqa: F401  (re-exported: the study's modules read them here)

ALGOS = registry.agents()
"""Agents the pipeline knows how to train (one ``algos/<name>.py`` script each; :mod:`pipeline.control.registry`)."""
SPLITS = ("train", "test")


def check_algos(algos: tuple[str, ...], where: str = "algos") -> None:
    """Check that every name in ``algos`` is a known agent (:data:`ALGOS`).

    Raises:
        ValueError: naming ``where`` (e.g. ``doit variable algos='ppo,foo'``), each unknown name with the
            closest known one, and the known names.
    """
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        hints = "".join(f"; '{a}'{hint}" for a in unknown if (hint := did_you_mean(a, ALGOS)))
        raise ValueError(
            f"{where}: unknown algorithm(s) {', '.join(map(repr, unknown))}{hints} (known: {', '.join(ALGOS)})"
        )


@dataclass(frozen=True)
class AgentFlags:
    """A named set of agent-script flags (a training budget, the inputs): ``flags`` put before ``extra_algo_args`` of
    every agent script, and what the report ``says`` of it."""

    flags: tuple[str, ...]
    says: str


AGENT_BUDGETS = {
    "preset": AgentFlags((), "each script's preset for the device it runs on: its cpu preset on a CPU, gpu on CUDA"),
    "large": AgentFlags(
        ("--preset", "gpu"), "each script's gpu preset (its networks, envs and env steps) wherever it runs"
    ),
}
"""The agents' training budgets by name. ``preset`` is the default; ``large`` trains at the GPU presets on any device
(on a 2-core CPU, PPO's 50 M steps take about 79 minutes a seed). A flag in ``extra_algo_args`` still wins (the last of
a repeated flag does), and ``total_timesteps`` overrides the steps of both."""

AGENT_INPUTS = {
    "plain": AgentFlags((), "the observation without its context features; trained on the train split's sessions"),
    "context": AgentFlags(
        ("--context-features", "--dc-prior"),
        "the observation with its context features (expected arrivals per socket group, MOER at 3-5 h); trained on "
        "the train split's sessions plus the DC prior's (envs/context.py)",
    ),
}
"""What the agents read and train on, by name: ``plain`` (the default) or ``context`` (``--context-features
--dc-prior``; docs/agents.md, "Context per socket group and a prior of DC sessions")."""


@dataclass(frozen=True)
class PipelineConfig:
    """One study: a site, the agents to train, where outputs go and which Dask cluster runs it.

    Attributes:
        site: shipped site name (``"caltech"``) or path to a site TOML.
        experiment: name of the output folder (default: the site's name).
        output_dir: root of all outputs (default ``outputs/``); remote Dask workers must see the same
            path (shared file system).
        algos: agents to train, each an ``algos/<name>.py`` script.
        seeds: training seeds; each agent trains once per seed.
        total_timesteps: override of each script's default training budget (None: script default).
        scheduler_address: address of an existing Dask scheduler; None starts a LocalCluster.
        workers: worker processes of that LocalCluster (None: one per core,
            :func:`pipeline.study.cluster.local_workers`); ignored with a scheduler address; doit variable ``workers`` /
            ``EVHUB_WORKERS``. Not part of what a task's results depend on: changing it makes nothing stale.
        tune_budget: budget of the learned planners' tuning and ``mpc_rl``'s training on the train split
            (:data:`pipeline.control.tuning.BUDGETS`): ``small`` inside ``doit run pipeline``, ``full`` for ``doit run
            tune``, ``tiny`` for tests; doit variable ``tune_budget`` / ``EVHUB_TUNE_BUDGET``. A result cached with a
            larger budget is used as it is.
        extra_algo_args: extra command-line flags of every agent script (for example ``("--compile",
            "--cudagraphs")`` on a GPU); doit variable ``algo_args`` / ``EVHUB_ALGO_ARGS``, split like a shell.
        agent_budget: the agents' training budget, a name of :data:`AGENT_BUDGETS` (``preset`` or ``large``); doit
            variable ``agent_budget`` / ``EVHUB_AGENT_BUDGET``.
        agent_inputs: what the agents read and train on, a name of :data:`AGENT_INPUTS` (``plain`` or ``context``);
            doit variable ``agent_inputs`` / ``EVHUB_AGENT_INPUTS``.
        dt_h: the study's step, hours, in place of the site TOML's ``dt_h`` (None: the TOML's; ``1`` runs the hourly
            study): the study then reads a copy of the site TOML with that step (:attr:`site_toml`), and the
            experiment defaults to ``<site>_<minutes>min``; doit variable ``dt_h`` / ``EVHUB_DT_H``.
    """

    site: str = "caltech"
    experiment: str = ""
    output_dir: str = "outputs"
    algos: tuple[str, ...] = ALGOS
    seeds: tuple[int, ...] = (1,)
    total_timesteps: int | None = None
    scheduler_address: str | None = None
    workers: int | None = None
    extra_algo_args: tuple[str, ...] = field(default=())
    tune_budget: str = "small"
    agent_budget: str = "preset"
    agent_inputs: str = "plain"
    dt_h: float | None = None

    def __post_init__(self):
        """Check the agents and default ``experiment`` to the site's name.

        Raises:
            ValueError: an unknown algorithm name (message names ``algos``, the bad name and the known ones), or an
                unknown tuning or agent budget or agent inputs.
            FileNotFoundError / envs.config.ConfigError: the site config cannot be loaded.
        """
        check_algos(self.algos)
        if self.tune_budget not in BUDGETS:
            raise ValueError(f"tune_budget={self.tune_budget!r}: unknown budget (known: {', '.join(BUDGETS)})")
        if self.agent_budget not in AGENT_BUDGETS:
            known = ", ".join(AGENT_BUDGETS)
            raise ValueError(f"agent_budget={self.agent_budget!r}: unknown budget (known: {known})")
        if self.agent_inputs not in AGENT_INPUTS:
            known = ", ".join(AGENT_INPUTS)
            raise ValueError(f"agent_inputs={self.agent_inputs!r}: unknown inputs (known: {known})")
        base = load_config(self.site)[0]
        if self.dt_h is not None:
            try:
                dt_h = timestep.exact_dt_h(float(self.dt_h))
            except (timestep.StepError, ValueError) as exc:
                raise ValueError(f"dt_h={self.dt_h!r}: {exc}") from None
            object.__setattr__(self, "dt_h", None if dt_h == base.dt_h else dt_h)
        if not self.experiment:
            suffix = "" if self.dt_h is None else f"_{timestep.step_minutes(self.dt_h)}min"
            object.__setattr__(self, "experiment", base.name + suffix)

    @property
    def base_toml(self) -> Path:
        """Resolved path of the site config as given (what ingestion reads)."""
        return load_config(self.site)[1]

    @property
    def site_toml(self) -> Path:
        """The site config the study reads: :attr:`base_toml`, or with :attr:`dt_h` given, its copy at that step in
        the experiment folder (:func:`site_at_step`, written when it is not there or differs)."""
        if self.dt_h is None:
            return self.base_toml
        return site_at_step(self.base_toml, self.dt_h, self.root / "site")

    @property
    def root(self) -> Path:
        """``<output_dir>/<experiment>``, absolute."""
        out = Path(self.output_dir)
        if not out.is_absolute():
            out = PROJECT_ROOT / out
        return out / self.experiment

    @property
    def algo_args(self) -> tuple[str, ...]:
        """The flags every agent script gets: the budget's (:data:`AGENT_BUDGETS`), the inputs' (:data:`AGENT_INPUTS`),
        then ``extra_algo_args``."""
        return (*AGENT_BUDGETS[self.agent_budget].flags, *AGENT_INPUTS[self.agent_inputs].flags, *self.extra_algo_args)

    def as_dict(self) -> dict:
        """Plain dict (for doit's ``config_changed``)."""
        d = asdict(self)
        d["site_toml"] = str(self.site_toml)
        return d


def site_at_step(toml: Path, dt_h: float, folder: Path) -> Path:
    """A copy of the site TOML ``toml`` at the step ``dt_h`` (hours) in ``folder``, its data read from the original's
    data folder (``data_dir`` made absolute); the rest of the file as it is. Written atomically when absent or
    different; returns its path (``folder/<toml's name>``)."""
    from envs.files import write_text

    text = Path(toml).read_text()
    cfg = load_config(toml)[0]
    data_dir = (Path(toml).parent / cfg.data_dir).resolve()
    head, sep, tables = text.partition("\n[")  # the top-level keys come before the first table
    lines = [ln for ln in head.splitlines() if not re.match(r"\s*(dt_h|data_dir)\s*=", ln)]
    lines += [f"data_dir = {json.dumps(str(data_dir))}", f"dt_h = {dt_h!r}"]
    out = Path(folder) / Path(toml).name
    new = "\n".join(lines) + ("\n" + sep + tables if sep else "\n")
    if not out.is_file() or out.read_text() != new:
        write_text(out, new)
    return out


VARIABLES = {
    "site": "EVHUB_SITE",
    "experiment": "EVHUB_EXPERIMENT",
    "output_dir": "EVHUB_OUTPUT_DIR",
    "algos": "EVHUB_ALGOS",
    "seeds": "EVHUB_SEEDS",
    "total_timesteps": "EVHUB_TOTAL_TIMESTEPS",
    "algo_args": "EVHUB_ALGO_ARGS",
    "scheduler": "DASK_SCHEDULER_ADDRESS",
    "part": "EVHUB_BENCH_PART",
    "kwp": "EVHUB_SIZING_KWP",
    "bess_kwh": "EVHUB_SIZING_BESS_KWH",
    "bess_kw_per_kwh": "EVHUB_SIZING_BESS_KW_PER_KWH",
    "controllers": "EVHUB_SIZING_CONTROLLERS",
    "workers": "EVHUB_WORKERS",
    "gpu_slots": "EVHUB_GPU_SLOTS",
    "tune_budget": "EVHUB_TUNE_BUDGET",
    "agent_budget": "EVHUB_AGENT_BUDGET",
    "agent_inputs": "EVHUB_AGENT_INPUTS",
    "dt_h": "EVHUB_DT_H",
    "python": "EVHUB_WHEEL_PYTHON",
    "platform": "EVHUB_WHEEL_PLATFORM",
    "exclude": "EVHUB_WHEEL_EXCLUDE",
    "dest": "EVHUB_WHEEL_DEST",
}
"""Every doit variable of ``dodo.py`` and the environment variable standing in for it (``part`` belongs
to ``doit bench``; ``kwp``, ``bess_kwh``, ``bess_kw_per_kwh`` and ``controllers`` to ``doit run
sizing``, see :mod:`pipeline.study.sizing`; ``gpu_slots`` to the embedded cluster of a CUDA machine,
:func:`pipeline.study.cluster.gpu_slots`; ``python``, ``platform``, ``exclude`` and ``dest`` to ``doit wheelhouse``,
:mod:`pipeline.wheelhouse`; the others to the study)."""


def _doit_variables() -> dict[str, str]:
    """The ``name=value`` variables given on doit's command line ({} outside doit).

    Values are read with doit's public ``get_var``; listing the names (to catch typos) needs doit's
    module-level table, so where a doit version lacks it only the typo check is skipped.
    """
    try:
        from doit import doit_cmd, get_var
    except ImportError:  # pragma: no cover - doit is a dependency
        return {}
    names = set(getattr(doit_cmd, "_CMDLINE_VARS", None) or ()) | set(VARIABLES)
    return {n: v for n in sorted(names) if (v := get_var(n, None)) is not None}


def variable(name: str) -> tuple[str, str] | None:
    """A setting of :data:`VARIABLES` as given: ``(value, origin)`` from doit's command line, else from its
    environment variable, else ``None``. ``origin`` names where the value came from for error messages
    (``"doit variable kwp='0,20'"`` or ``"environment variable EVHUB_SIZING_KWP='0,20'"``).

    Raises:
        KeyError: ``name`` is not in :data:`VARIABLES`.
    """
    env = VARIABLES[name]
    cmdline = _doit_variables()
    if name in cmdline:
        return cmdline[name], f"doit variable {name}={cmdline[name]!r}"
    if env in os.environ:
        return os.environ[env], f"environment variable {env}={os.environ[env]!r}"
    return None


def from_environment(**overrides) -> PipelineConfig:
    """Build a :class:`PipelineConfig` from doit variables, environment variables and ``overrides``.

    Raises:
        ValueError: an unknown doit variable (a typo such as ``algo=ppo``: the message names it and the
            closest known one), malformed values (e.g. non-integer seeds) or an unknown algorithm; the
            message names the doit variable (``algos=...``) or the environment variable
            (``EVHUB_ALGOS=...``) the bad value came from, and the value.
        FileNotFoundError / envs.config.ConfigError: the site cannot be loaded.
    """
    cmdline = _doit_variables()
    for name, value in cmdline.items():
        if name not in VARIABLES:
            hint = did_you_mean(name, VARIABLES)
            raise ValueError(f"doit variable {name}={value!r}: unknown variable{hint} (known: {', '.join(VARIABLES)})")
    origin: dict[str, str] = {}

    def var(name: str):
        env = VARIABLES[name]
        if name in cmdline:
            origin[name] = f"doit variable {name}={cmdline[name]!r}"
            return cmdline[name]
        if env in os.environ:
            origin[name] = f"environment variable {env}={os.environ[env]!r}"
            return os.environ[env]
        return None

    kw: dict = {}
    for name in ("site", "experiment", "output_dir"):
        if (v := var(name)) is not None:
            kw[name] = v
    if (v := var("algos")) is not None:
        kw["algos"] = tuple(a.strip() for a in v.split(",") if a.strip())
        if "algos" not in overrides:
            check_algos(kw["algos"], origin["algos"])
    if (v := var("seeds")) is not None:
        try:
            kw["seeds"] = tuple(int(s) for s in v.split(",") if s.strip())
        except ValueError as exc:
            raise ValueError(f"{origin['seeds']}: seeds must be comma-separated integers") from exc
    if (v := var("total_timesteps")) is not None:
        try:
            kw["total_timesteps"] = int(v)
        except ValueError as exc:
            raise ValueError(f"{origin['total_timesteps']}: total_timesteps must be an integer") from exc
    if (v := var("algo_args")) is not None:
        kw["extra_algo_args"] = tuple(shlex.split(v))
    if (v := var("scheduler")) is not None:
        kw["scheduler_address"] = v or None
    if (v := var("workers")) is not None and v.strip():
        try:
            kw["workers"] = int(v)
        except ValueError:
            kw["workers"] = 0
        if kw["workers"] < 1:
            raise ValueError(f"{origin['workers']}: workers must be a positive integer (Dask worker processes)")
    if (v := var("tune_budget")) is not None:
        kw["tune_budget"] = v
    if (v := var("agent_budget")) is not None:
        kw["agent_budget"] = v
    if (v := var("agent_inputs")) is not None:
        kw["agent_inputs"] = v
    if (v := var("dt_h")) is not None:
        try:
            kw["dt_h"] = timestep.exact_dt_h(float(v))
        except timestep.StepError as exc:
            raise ValueError(f"{origin['dt_h']}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{origin['dt_h']}: dt_h must be a number of hours (1, 0.5, 0.25, ...)") from exc
    kw.update(overrides)
    return PipelineConfig(**kw)
