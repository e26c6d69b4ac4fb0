"""The study as one Dask graph.

``run(cfg)`` submits the whole study (validation fanned out per input, baselines per controller x split, the MPC
controllers and the oracle per split, the learned planners' tuning (a task per week backtest) and ``mpc_rl``'s
training per seed, the learned planners per planner x seed x split, training per agent x seed, evaluation per agent x
seed x split, the report) and waits for the report. ``run(cfg, stages={"baselines"})`` computes only some stages; the
outputs of the stages left out are taken from disk (this is how ``dodo.py`` runs one stage per doit task, so doit
decides what is out of date and Dask fans out the work inside a stage).

The cluster is :func:`pipeline.study.cluster.get_client`'s: ``cfg.scheduler_address`` (or
``DASK_SCHEDULER_ADDRESS``) if given, else an embedded ``LocalCluster``; where training tasks run is
:func:`pipeline.study.cluster.training_placement`'s (a GPU each on a cluster with GPU workers, side by side on a
CPU-only machine); every task's Dask priority is :data:`pipeline.study.cluster.PRIORITY`'s. The simulated
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
from pipeline.control import learned, registry, rl_planner, tuning
from pipeline.control.backtest import run_window
from pipeline.study import results, tasks
from pipeline.study.cluster import PRIORITY, get_client, training_placement
from pipeline.study.config import SPLITS, PipelineConfig

STAGES = ("validate", "baselines", "tune", "tune_rl", "planners", "train", "evaluate", "report")


def simulated(cfg: PipelineConfig) -> tuple[str, ...]:
    """The controllers of the ``baselines`` stage for this site: simulated, reading no tuning
    (:func:`pipeline.control.registry.simulated`)."""
    return registry.simulated(load_config(cfg.site_toml)[0], tuned=False)


def planners(cfg: PipelineConfig) -> tuple[str, ...]:
    """The controllers of the ``planners`` stage for this site: simulated once per seed from the tuning."""
    return registry.simulated(load_config(cfg.site_toml)[0], tuned=True)


def outputs(cfg: PipelineConfig) -> dict[str, list[Path]]:
    """Every file each stage writes, by stage (doit's targets and the stand-ins for skipped stages)."""
    root = cfg.root
    runs = [(a, s) for a in cfg.algos for s in cfg.seeds]
    return {
        "validate": [root / "validate" / f"{i}.json" for i in tasks.INPUTS],
        "baselines": [f for c in simulated(cfg) for s in SPLITS for f in results.files(root / "baselines", c, s)],
        "tune": [f for seed in cfg.seeds for f in tuning.result_files(root / "tuned", seed)] if planners(cfg) else [],
        "tune_rl": [rl_planner.policy_file(rl_planner.run_dir(root / "tuned", seed)) for seed in cfg.seeds]
        if "mpc_rl" in planners(cfg)
        else [],
        "planners": [
            f
            for c in planners(cfg)
            for seed in cfg.seeds
            for s in SPLITS
            for f in results.files(root / "planners", c, s, seed)
        ],
        "train": [
            root / "runs" / results.run_name(a, s) / f for a, s in runs for f in ("metrics.parquet", "policy.pt2")
        ],
        "evaluate": [f for a, seed in runs for s in SPLITS for f in results.files(root / "eval", a, s, seed)],
        "report": [root / "report" / f for f in ("report.md", "report.html", "co2_comparison.parquet")],
    }


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
    client = client or get_client(cfg.scheduler_address)
    site = str(cfg.site_toml)
    root = cfg.root
    expected = outputs(cfg)

    def on_disk(stage: str) -> list[str]:
        missing = [p for p in expected[stage] if not p.exists()]
        if missing:
            raise FileNotFoundError(f"stage '{stage}' has not run: {missing[0]} is missing")
        return [str(p) for p in expected[stage]]

    submit = client.submit
    futures: dict[str, object] = {}

    def collect(fn, *args):  # a task that gathers others' results: runs as soon as they are done
        return submit(fn, *args, priority=PRIORITY["collect"], pure=False)

    # validation: one task per input; the stamps are written only when all of them passed
    if "validate" in stages:
        checks = [
            submit(tasks.validate_input, site, kind, key=f"validate-{kind}-{cfg.experiment}", pure=False)
            for kind in tasks.INPUTS
        ]
        validated = collect(tasks.write_validation, checks, str(root / "validate"))
        futures["validate"] = validated
    else:
        validated = on_disk("validate") if stages & {"baselines", "train"} else None

    @functools.cache
    def inputs() -> str:  # the site, its data and the controllers' code, read once per graph
        return tuning.fingerprint(site)[:16]

    def baseline_key(c: str, s: str) -> str:
        """What a baseline's run computes and where it goes: the controller, split, output folder and a fingerprint
        of the site, its data and the controllers' code (a changed input, a changed key)."""
        return f"simulate-{c}-{s}-{root}-{inputs()}"

    def simulate(c: str, s: str, *after):
        """A baseline's run as a task keyed by :func:`baseline_key` (the key also kept in its KPI file), so that the
        planners stage can share it: the finished file, or the task while the baselines stage still holds it."""
        key = baseline_key(c, s)
        return submit(tasks.run_controller, site, c, s, str(root / "baselines"), *after, inputs=key,
                      retries=registry.get(c).retries, priority=PRIORITY["simulate"], key=key)  # fmt: skip

    def baseline_run(c: str, s: str):
        """A baseline's run for the planners stage: its files when they hold this key's run, else :func:`simulate`."""
        files = [str(f) for f in results.files(root / "baselines", c, s)]
        return files if tasks.run_inputs(files) == baseline_key(c, s) else simulate(c, s)

    # the simulated controllers (baselines, planners, bounds): one task per controller x split
    if "baselines" in stages:
        jobs = [simulate(c, s, validated) for c in simulated(cfg) for s in SPLITS]
        futures["baselines"] = collect(_flatten, jobs)
        baseline_files = futures["baselines"]
    else:
        baseline_files = on_disk("baselines") if "report" in stages else None

    # the planner's parameters tuned on the train split, once per seed (CMA-ES; its backtests fanned out as tasks)
    tuned_dir = str(root / "tuned")
    if "tune" in stages:
        futures["tune"] = (
            tasks.tune_planner(site, cfg.seeds, tuned_dir, cfg.tune_budget, client) if planners(cfg) else []
        )
    # mpc_rl's day-level policy trained on the train split, once per seed (one training task each)
    if "tune_rl" in stages:
        futures["tune_rl"] = (
            tasks.train_rl_planners(site, cfg.seeds, tuned_dir, cfg.tune_budget, client)
            if "mpc_rl" in planners(cfg)
            else []
        )
    # the learned planners: one task per planner x seed x split, after the tuning
    if "planners" in stages:
        for stage in {"tune", "tune_rl"} - stages:
            on_disk(stage)
        out = str(root / "planners")
        tables = {}  # mpc_adaptive's week tables: every (candidate, week) backtest one task, then written per seed
        if "mpc_adaptive" in planners(cfg):
            for seed in cfg.seeds:
                windows = learned.table_windows(site, tuning.load_params(tuned_dir, seed), SPLITS)
                backtests = [
                    submit(run_window, site, sp, s, n, c.as_dict(), priority=PRIORITY["backtest"], pure=False)
                    for sp, _, c, s, n in windows
                ]
                tables[seed] = collect(learned.write_week_tables, backtests, windows, tuned_dir, seed)
        config = load_config(cfg.site_toml)[0]
        jobs = []
        for c in planners(cfg):
            for seed in cfg.seeds:
                for s in SPLITS:
                    if c == "mpc_tuned" and tuning.kept_start(tuned_dir, seed, config):
                        # the same planner as mpc_tuned_start: its run under mpc_tuned's name
                        start = baseline_run("mpc_tuned_start", s)
                        jobs.append(submit(tasks.run_as, start, c, s, out, seed, pure=False))
                        continue
                    jobs.append(
                        submit(
                            tasks.run_controller,
                            site,
                            c,
                            s,
                            out,
                            tables.get(seed) if c == "mpc_adaptive" else None,  # the others need no week table
                            seed=seed,
                            tuned_dir=tuned_dir,
                            retries=1,
                            priority=PRIORITY["simulate"],
                            pure=False,
                        )
                    )
        futures["planners"] = collect(_flatten, jobs)
        planner_files = futures["planners"]
    else:
        planner_files = on_disk("planners") if "report" in stages else None

    # training: one task per agent x seed, placed by training_placement (one at a time per GPU worker, the GPU of a
    # CUDA machine's embedded cluster included; side by side on the workers of a CPU-only machine)
    runs: dict[tuple[str, int], object] = {}
    if "train" in stages:
        place = training_placement(client)
        for algo in cfg.algos:
            for seed in cfg.seeds:
                run_dir = str(root / "runs" / results.run_name(algo, seed))
                runs[(algo, seed)] = submit(
                    tasks.train_agent,
                    algo,
                    seed,
                    site,
                    run_dir,
                    cfg.total_timesteps,
                    cfg.extra_algo_args,
                    validated,
                    **place.options,
                    retries=1,
                    pure=False,
                    key=f"train-{algo}-seed{seed}-{cfg.experiment}",
                )
        futures["train"] = collect(list, list(runs.values()))
    elif stages & {"evaluate", "report"}:
        if "evaluate" in stages:
            on_disk("train")
        runs = {(a, s): str(root / "runs" / results.run_name(a, s)) for a in cfg.algos for s in cfg.seeds}

    if "evaluate" in stages:
        out = str(root / "eval")
        jobs = [
            submit(tasks.evaluate_agent, a, s, run_dir, site, split, out, retries=1, pure=False)
            for (a, s), run_dir in runs.items()
            for split in SPLITS
        ]
        futures["evaluate"] = collect(_flatten, jobs)
        eval_files = futures["evaluate"]
    else:
        eval_files = on_disk("evaluate") if "report" in stages else None

    if "report" in stages:
        futures["report"] = submit(
            _report, cfg.as_dict(), baseline_files, planner_files, eval_files, str(root), pure=False
        )

    return client.gather(futures)


def _flatten(lists: list[list[str]]) -> list[str]:
    return [p for sub in lists for p in sub]


def _report(
    cfg_dict: dict, baseline_files: list[str], planner_files: list[str], eval_files: list[str], root: str
) -> str:
    files = [*baseline_files, *planner_files, *eval_files]
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
    return tasks.make_report(cfg_dict, kpis, traces, metrics, str(Path(root) / "report"))
