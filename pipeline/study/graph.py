"""The study as one Dask graph.

``run(cfg)`` submits the whole study (validation fanned out per input, baselines per controller x split, the MPC
controllers and the oracle per split, the learned planners' tuning (a task per week backtest) and ``mpc_rl``'s
training per seed, the learned planners per planner x seed x split, training per agent x seed, evaluation per agent x
seed x split, the report) and waits for the report. ``run(cfg, stages={"baselines"})`` computes only some stages; the
outputs of the stages left out are taken from disk (this is how ``dodo.py`` runs one stage per doit task, so doit
decides what is out of date and Dask fans out the work inside a stage).

The cluster is :func:`pipeline.study.cluster.get_client`'s: ``cfg.scheduler_address`` (or
``DASK_SCHEDULER_ADDRESS``) if given, else an embedded ``LocalCluster`` of ``cfg.workers`` processes; where training
tasks run is :func:`pipeline.study.cluster.training_placement`'s (a GPU each on a cluster with GPU workers, side by
side on a CPU-only machine); every task's Dask priority is :data:`pipeline.study.cluster.PRIORITY`'s. The simulated
controllers are the registry's (:mod:`pipeline.control.registry`), their files named by
:mod:`pipeline.study.results`.

Tasks that are safe to repeat carry Dask retries: baselines, the MPC controllers, the oracle, evaluation, and training
(a repeated training task resumes from its run's checkpoint, see :func:`pipeline.study.tasks.train_agent`). Tasks of a
worker that dies are rescheduled by the scheduler.
"""

from __future__ import annotations

import functools
from pathlib import Path

from envs.config import load_config
from pipeline.control import registry, tuning
from pipeline.study import results, tasks
from pipeline.study.cluster import PRIORITY, get_client, training_placement
from pipeline.study.config import SPLITS, PipelineConfig

PHYSICS_STAGES = ("physics_baselines", "physics_planners", "physics_agents")
"""The ``physics`` part of the study in three stages, so that each starts as soon as what it scores is there."""
STAGES = ("validate", "baselines", "tune", "tune_rl", "planners", "train", "evaluate", *PHYSICS_STAGES, "report")


def run(cfg: PipelineConfig, stages=STAGES, client=None) -> dict[str, object]:
    """Build the study's graph and compute the requested stages once.

    Args:
        cfg: the study.
        stages: stages to compute; the outputs of the others must already be on disk.
        client: a Dask client (default: :func:`get_client` for ``cfg.scheduler_address``).

    Returns:
        the result of each computed stage (paths).

    Raises:
        FileNotFoundError: a stage's input from a skipped stage is missing.
        Whatever a task raises (validation errors name file, column and row).
    """
    stages = set(stages)
    unknown = stages - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}: stages are {STAGES}")
    g = _Graph(cfg, stages, client or get_client(cfg.scheduler_address, cfg.workers))
    validated = g.validate()
    baseline_files = g.baselines(validated)
    g.tune()
    planner_files = g.planners()
    runs = g.train(validated)
    eval_files = g.evaluate(runs)
    physics_files = g.physics(runs, validated)
    if "report" in stages:
        g.futures["report"] = g.submit(
            _report, cfg.as_dict(), baseline_files, planner_files, eval_files, str(g.root), physics_files, pure=False
        )
    return g.client.gather(g.futures)


class _Graph:
    """The study's graph while :func:`run` builds it: the stages asked for, the Dask client, the site and the output
    folders, and ``futures``, the result of each stage computed (a future, or a list of them). Each stage method
    submits the tasks of its stage when it is asked for; when it is not, it returns what the later stages read of it
    (its files on disk, checked by :meth:`on_disk`, or None when no later stage asked for needs them)."""

    def __init__(self, cfg: PipelineConfig, stages: set[str], client):
        self.cfg, self.stages, self.client = cfg, stages, client
        self.site = str(cfg.site_toml)
        self.root = cfg.root
        self.tuned_dir = str(cfg.root / "tuned")
        self.expected = results.outputs(cfg)
        self.submit = client.submit
        self.futures: dict[str, object] = {}

    def on_disk(self, stage: str) -> list[str]:
        """The files of a stage that does not run here.

        Raises:
            FileNotFoundError: one of them is missing (the stage has not run).
        """
        missing = [p for p in self.expected[stage] if not p.exists()]
        if missing:
            raise FileNotFoundError(f"stage '{stage}' has not run: {missing[0]} is missing")
        return [str(p) for p in self.expected[stage]]

    def collect(self, fn, *args):
        """A task that gathers others' results: runs as soon as they are done."""
        return self.submit(fn, *args, priority=PRIORITY["collect"], pure=False)

    @functools.cached_property
    def inputs(self) -> str:
        """A fingerprint of the site, its data and the controllers' code, read once per graph."""
        return tuning.fingerprint(self.site)[:16]

    def baseline_key(self, c: str, s: str) -> str:
        """What a baseline's run computes and where it goes: the controller, split, output folder and a fingerprint
        of the site, its data and the controllers' code (a changed input, a changed key)."""
        return f"simulate-{c}-{s}-{self.root}-{self.inputs}"

    def simulate(self, c: str, s: str, *after):
        """A baseline's run as a task keyed by :meth:`baseline_key` (the key also kept in its KPI file), so that the
        planners stage can share it: the finished file, or the task while the baselines stage still holds it."""
        key = self.baseline_key(c, s)
        return self.submit(tasks.run_controller, self.site, c, s, str(self.root / "baselines"), *after, inputs=key,
                           retries=registry.get(c).retries, priority=PRIORITY["simulate"], key=key)  # fmt: skip

    def baseline_run(self, c: str, s: str):
        """A baseline's run for the planners stage: its files when they hold this key's run, else :meth:`simulate`."""
        files = [str(f) for f in results.files(self.root / "baselines", c, s)]
        return files if tasks.run_inputs(files) == self.baseline_key(c, s) else self.simulate(c, s)

    def validate(self):
        """Validation: one task per input; the stamps are written only when all of them passed."""
        if "validate" not in self.stages:
            return self.on_disk("validate") if self.stages & {"baselines", "train"} else None
        checks = [
            self.submit(tasks.validate_input, self.site, kind, key=f"validate-{kind}-{self.cfg.experiment}", pure=False)
            for kind in results.INPUTS
        ]
        self.futures["validate"] = self.collect(tasks.write_validation, checks, str(self.root / "validate"))
        return self.futures["validate"]

    def baselines(self, validated):
        """The simulated controllers (baselines, planners, bounds): one task per controller x split."""
        if "baselines" not in self.stages:
            return self.on_disk("baselines") if "report" in self.stages else None
        jobs = [self.simulate(c, s, validated) for c in results.simulated(self.cfg) for s in SPLITS]
        self.futures["baselines"] = self.collect(_flatten, jobs)
        return self.futures["baselines"]

    def tune(self) -> None:
        """The planner's parameters tuned on the train split, once per seed (CMA-ES; its backtests fanned out as
        tasks), and ``mpc_rl``'s day-level policy trained on it, once per seed (one training task each)."""
        cfg = self.cfg
        if "tune" in self.stages:
            self.futures["tune"] = (
                tasks.tune_planner(self.site, cfg.seeds, self.tuned_dir, cfg.tune_budget, self.client)
                if results.planners(cfg)
                else []
            )
        if "tune_rl" in self.stages:
            self.futures["tune_rl"] = (
                tasks.train_rl_planners(self.site, cfg.seeds, self.tuned_dir, cfg.tune_budget, self.client)
                if "mpc_rl" in results.planners(cfg)
                else []
            )

    def planners(self):
        """The learned planners: one task per planner x seed x split, after the tuning."""
        if "planners" not in self.stages:
            return self.on_disk("planners") if "report" in self.stages else None
        for stage in {"tune", "tune_rl"} - self.stages:
            self.on_disk(stage)
        cfg, out = self.cfg, str(self.root / "planners")
        tables = self.week_tables()
        config = load_config(cfg.site_toml)[0]
        jobs = []
        for c in results.planners(cfg):
            for seed in cfg.seeds:
                for s in SPLITS:
                    if c == "mpc_tuned" and tuning.kept_start(self.tuned_dir, seed, config):
                        # the same planner as mpc_tuned_start: its run under mpc_tuned's name
                        start = self.baseline_run("mpc_tuned_start", s)
                        jobs.append(self.submit(tasks.run_as, start, c, s, out, seed, pure=False))
                        continue
                    jobs.append(
                        self.submit(
                            tasks.run_controller,
                            self.site,
                            c,
                            s,
                            out,
                            tables.get(seed) if c == "mpc_adaptive" else None,  # the others need no week table
                            seed=seed,
                            tuned_dir=self.tuned_dir,
                            retries=1,
                            priority=PRIORITY["simulate"],
                            pure=False,
                        )
                    )
        self.futures["planners"] = self.collect(_flatten, jobs)
        return self.futures["planners"]

    def week_tables(self) -> dict[int, object]:
        """``mpc_adaptive``'s week tables by seed (none when the site runs no ``mpc_adaptive``): every (candidate,
        week) backtest one task, then a task that writes the seed's table."""
        from pipeline.control import learned
        from pipeline.control.backtest import run_window

        tables = {}
        if "mpc_adaptive" in results.planners(self.cfg):
            for seed in self.cfg.seeds:
                windows = learned.table_windows(self.site, tuning.load_params(self.tuned_dir, seed), SPLITS)
                backtests = [
                    self.submit(run_window, self.site, sp, s, n, c.as_dict(), priority=PRIORITY["backtest"], pure=False)
                    for sp, _, c, s, n in windows
                ]
                tables[seed] = self.collect(learned.write_week_tables, backtests, windows, self.tuned_dir, seed)
        return tables

    def train(self, validated) -> dict[tuple[str, int], object]:
        """Training: one task per agent x seed, placed by :func:`training_placement` (one at a time per GPU worker,
        the GPU of a CUDA machine's embedded cluster included; side by side on the workers of a CPU-only machine).

        Returns:
            each run's task, or its folder when training does not run here but a later stage reads it (else empty).
        """
        cfg = self.cfg
        runs: dict[tuple[str, int], object] = {}
        if "train" in self.stages:
            place = training_placement(self.client)
            algo_args = cfg.algo_args
            if "--compile" in algo_args:  # one compile cache for every agent, kept with the outputs
                algo_args = ("--compile-cache", str(Path(cfg.output_dir).resolve() / "compile_cache"), *algo_args)
            for algo in cfg.algos:
                for seed in cfg.seeds:
                    run_dir = str(self.root / "runs" / results.run_name(algo, seed))
                    runs[(algo, seed)] = self.submit(
                        tasks.train_agent,
                        algo,
                        seed,
                        self.site,
                        run_dir,
                        cfg.total_timesteps,
                        algo_args,
                        validated,
                        **place.options,
                        retries=1,
                        pure=False,
                        key=f"train-{algo}-seed{seed}-{cfg.experiment}",
                    )
            self.futures["train"] = self.collect(list, list(runs.values()))
        elif self.stages & {"evaluate", "report", "physics_agents"}:
            if "evaluate" in self.stages:
                self.on_disk("train")
            runs = {(a, s): str(self.root / "runs" / results.run_name(a, s)) for a in cfg.algos for s in cfg.seeds}
        return runs

    def evaluate(self, runs: dict[tuple[str, int], object]):
        """Evaluation: one task per agent x seed x split, of the trained ``runs``."""
        if "evaluate" not in self.stages:
            return self.on_disk("evaluate") if "report" in self.stages else None
        out = str(self.root / "eval")
        jobs = [
            self.submit(tasks.evaluate_agent, a, s, run_dir, self.site, split, out, retries=1, pure=False)
            for (a, s), run_dir in runs.items()
            for split in SPLITS
        ]
        self.futures["evaluate"] = self.collect(_flatten, jobs)
        return self.futures["evaluate"]

    def physics(self, runs: dict[tuple[str, int], object], validated) -> list:
        """Every controller of the study also scored on the site simulated at 5 minutes
        (:data:`envs.timestep.PHYSICS_DT_H`; its decisions every step of the site, held over the sub-steps; the oracle
        solved at that step), into ``physics/``, one task per controller (x seed) x split, in three stages
        (:data:`PHYSICS_STAGES`): the baselines' after validation, the learned planners' after the tuning and the
        week tables, the agents' after their training (read from disk). Nothing where the site steps at 5 minutes
        itself or has no series at 5 minutes (:func:`pipeline.study.results.physics_scored`).

        Returns:
            the three stages' results for the report (their files on disk for a stage that does not run here).
        """
        cfg, out = self.cfg, str(self.root / "physics")
        scored = results.physics_scored(cfg)
        options = {"priority": PRIORITY["simulate"], "pure": False}
        parts = []
        for stage in PHYSICS_STAGES:
            if stage not in self.stages:
                parts.append(self.on_disk(stage) if "report" in self.stages else [])
                continue
            jobs = []
            if scored and stage == "physics_baselines":
                for c in results.simulated(cfg):
                    for s in SPLITS:
                        jobs.append(self.submit(tasks.run_controller, self.site, c, s, out, validated, physics=True,
                                                retries=registry.get(c).retries, **options))  # fmt: skip
            if scored and stage == "physics_planners":
                for dep in {"tune", "tune_rl", "planners"} - self.stages:
                    self.on_disk(dep)
                tables = self.week_tables_on_disk()
                for c in results.planners(cfg):
                    for seed in cfg.seeds:
                        for s in SPLITS:
                            jobs.append(self.submit(tasks.run_controller, self.site, c, s, out, tables.get(seed),
                                                    seed=seed, tuned_dir=self.tuned_dir, physics=True, retries=1,
                                                    **options))  # fmt: skip
            if scored and stage == "physics_agents":
                if "train" not in self.stages:
                    self.on_disk("train")
                for (a, seed), run_dir in runs.items():
                    for s in SPLITS:
                        jobs.append(self.submit(tasks.evaluate_agent, a, seed, run_dir, self.site, s, out,
                                                physics=True, retries=1, pure=False))  # fmt: skip
            self.futures[stage] = self.collect(_flatten, jobs)
            parts.append(self.futures[stage])
        return self.collect(_flatten, parts) if any(not isinstance(p, list) for p in parts) else _flatten(parts)

    def week_tables_on_disk(self) -> dict[int, str]:
        """``mpc_adaptive``'s week tables by seed as the planners stage wrote them (its runs read them from disk)."""
        from pipeline.control import learned

        if "mpc_adaptive" not in results.planners(self.cfg):
            return {}
        return {sd: str(learned.table_file(self.tuned_dir, "train", sd)) for sd in self.cfg.seeds}


def _flatten(lists: list[list[str]]) -> list[str]:
    return [p for sub in lists for p in sub]


def _report(
    cfg_dict: dict,
    baseline_files: list[str],
    planner_files: list[str],
    eval_files: list[str],
    root: str,
    physics_files: list[str] | None = None,
) -> str:
    files = [*baseline_files, *planner_files, *eval_files]
    physics = [p for p in physics_files or () if not results.parse(p).traces]
    files += sorted(str(p) for p in (Path(root) / "online").glob("*.parquet"))  # doit run online's rows, when made
    kpis, traces = [], {}
    for p in files:
        r = results.parse(p)
        if r.traces:
            traces[f"{r.controller}|{r.split}"] = p
        else:
            kpis.append(p)
    metrics = {}
    for algo in cfg_dict["algos"]:
        for seed in cfg_dict["seeds"]:
            m = Path(root) / "runs" / results.run_name(algo, seed) / "metrics.parquet"
            if m.is_file():
                metrics.setdefault(algo, str(m))
    return tasks.make_report(cfg_dict, kpis, traces, metrics, str(Path(root) / "report"), physics)
