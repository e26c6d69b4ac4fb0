"""What one run of the study is: which site, which agents, where outputs go, which Dask cluster.

Values come from, in order: keyword arguments, doit command-line variables (``doit run pipeline
site=path/to/site.toml``), environment variables (``EVHUB_SITE``, ``EVHUB_EXPERIMENT``,
``EVHUB_OUTPUT_DIR``, ``EVHUB_ALGOS``, ``EVHUB_SEEDS``, ``EVHUB_TOTAL_TIMESTEPS``,
``EVHUB_ALGO_ARGS``, ``DASK_SCHEDULER_ADDRESS``), then defaults.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from envs.site import load_config

PROJECT_ROOT = Path(__file__).resolve().parent.parent
ALGOS = ("ppo", "sac", "a2c", "dqn")
"""Agents the pipeline knows how to train (one ``algos/<name>.py`` script each)."""
SPLITS = ("train", "test")


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
        extra_algo_args: extra command-line flags of every agent script (for example ``("--compile",
            "--cudagraphs")`` on a GPU); doit variable ``algo_args`` / ``EVHUB_ALGO_ARGS``, split like a shell.
    """

    site: str = "caltech"
    experiment: str = ""
    output_dir: str = "outputs"
    algos: tuple[str, ...] = ALGOS
    seeds: tuple[int, ...] = (1,)
    total_timesteps: int | None = None
    scheduler_address: str | None = None
    extra_algo_args: tuple[str, ...] = field(default=())

    def __post_init__(self):
        unknown = [a for a in self.algos if a not in ALGOS]
        if unknown:
            raise ValueError(f"unknown algorithm(s) {unknown}: known are {list(ALGOS)}")
        if not self.experiment:
            object.__setattr__(self, "experiment", load_config(self.site)[0].name)

    @property
    def site_toml(self) -> Path:
        """Resolved path of the site config."""
        return load_config(self.site)[1]

    @property
    def root(self) -> Path:
        """``<output_dir>/<experiment>``, absolute."""
        out = Path(self.output_dir)
        if not out.is_absolute():
            out = PROJECT_ROOT / out
        return out / self.experiment

    def as_dict(self) -> dict:
        """Plain dict (for doit's ``config_changed``)."""
        d = asdict(self)
        d["site_toml"] = str(self.site_toml)
        return d


def from_environment(**overrides) -> PipelineConfig:
    """Build a :class:`PipelineConfig` from doit variables, environment variables and ``overrides``.

    Raises:
        ValueError: malformed values (e.g. non-integer seeds) or an unknown algorithm.
        FileNotFoundError / envs.site.ConfigError: the site cannot be loaded.
    """
    try:
        from doit import get_var
    except ImportError:  # pragma: no cover - doit is a dependency
        get_var = lambda name, default=None: default  # noqa: E731

    def var(name: str, env: str, default=None):
        value = get_var(name, None)
        return value if value is not None else os.environ.get(env, default)

    kw: dict = {}
    for name, env in (("site", "EVHUB_SITE"), ("experiment", "EVHUB_EXPERIMENT"), ("output_dir", "EVHUB_OUTPUT_DIR")):
        if (v := var(name, env)) is not None:
            kw[name] = v
    if (v := var("algos", "EVHUB_ALGOS")) is not None:
        kw["algos"] = tuple(a.strip() for a in v.split(",") if a.strip())
    if (v := var("seeds", "EVHUB_SEEDS")) is not None:
        try:
            kw["seeds"] = tuple(int(s) for s in v.split(",") if s.strip())
        except ValueError as exc:
            raise ValueError(f"seeds must be comma-separated integers, got {v!r}") from exc
    if (v := var("total_timesteps", "EVHUB_TOTAL_TIMESTEPS")) is not None:
        try:
            kw["total_timesteps"] = int(v)
        except ValueError as exc:
            raise ValueError(f"total_timesteps must be an integer, got {v!r}") from exc
    if (v := var("algo_args", "EVHUB_ALGO_ARGS")) is not None:
        kw["extra_algo_args"] = tuple(shlex.split(v))
    if (v := var("scheduler", "DASK_SCHEDULER_ADDRESS")) is not None:
        kw["scheduler_address"] = v or None
    kw.update(overrides)
    return PipelineConfig(**kw)
