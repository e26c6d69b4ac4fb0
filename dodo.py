"""The study as doit tasks: ``doit run pipeline`` runs it end to end; ``doit list`` explains each task.

doit decides what is out of date (file dependencies, targets, the study's settings); each task then
computes its stage of the Dask graph of ``pipeline.study.graph``, which fans the work out over the cluster. The
stages that are ready run at once, in threads sharing one Dask client (``-n 1`` runs them one by one), and the
cluster places the work: on a CPU-only machine the agents train side by side, one per worker, with the simulated
controllers around them; on the embedded cluster of a CUDA machine the stages run one after another and the agents
train one after another on its GPU (``pipeline.study.cluster``). ``doit run pipeline`` ends with the wall time of
each task it ran.

doit's state (what is up to date) is kept per experiment, in ``<output_dir>/<experiment>/.doit.sqlite3``, and
a command that runs tasks holds ``<output_dir>/<experiment>/.doit.lock`` until it exits, so different
experiments run side by side and a second run of one experiment stops at once (see ``pipeline.study.runstate``).

Settings, as doit variables after the command or as environment variables::

    doit run pipeline site=path/to/site.toml      # EVHUB_SITE          (default: caltech)
    doit run pipeline experiment=trial            # EVHUB_EXPERIMENT    (default: the site's name)
    doit run pipeline total_timesteps=20000       # EVHUB_TOTAL_TIMESTEPS (default: each script's own)
    doit run pipeline seeds=1,2,3                 # EVHUB_SEEDS
    doit run pipeline dt_h=1                      # EVHUB_DT_H: the study's step in hours (default: the site TOML's,
                                                  # 0.25 for the shipped sites); experiment <site>_60min
    doit run pipeline scheduler=tcp://host:8786   # DASK_SCHEDULER_ADDRESS (default: a LocalCluster)
    doit run pipeline workers=1                   # EVHUB_WORKERS: the LocalCluster's processes (default: one per core)
    doit run pipeline algo_args="--compile --cudagraphs"   # EVHUB_ALGO_ARGS (extra flags of every agent script)
    doit run pipeline agent_budget=large                   # EVHUB_AGENT_BUDGET: the agents at their gpu presets
    doit run pipeline agent_inputs=context                 # EVHUB_AGENT_INPUTS: context features and the DC prior

``doit run ingest`` (the first task of ``pipeline``) builds the site's processed data from the raw sources its
TOML names in ``[sources]`` (``pipeline.data.ingest``); a shipped site whose raw files are not here uses its shipped
processed data as they are.

``doit run sizing`` (not part of ``pipeline``) runs the controllers over a grid of PV kWp x BESS kWh into
``outputs/<experiment>/sizing/`` (``pipeline.study.sizing``); its grid and unit costs are the site TOML's ``[sizing]``::

    doit run sizing kwp=0,20,40,80 bess_kwh=0,40,80,160   # EVHUB_SIZING_KWP, EVHUB_SIZING_BESS_KWH
    doit run sizing bess_kw_per_kwh=0.5                   # EVHUB_SIZING_BESS_KW_PER_KWH (BESS kW per kWh)
    doit run sizing controllers=rule_based,oracle         # EVHUB_SIZING_CONTROLLERS (uncontrolled always runs)
    doit run sizing workers=2                             # EVHUB_WORKERS, as for the pipeline

``doit run value_of_information`` (not part of ``pipeline``) runs the planner of ``mpc_rl_start`` given the true MOER,
the true arrivals or both, on both splits (``pipeline.study.information``), into
``outputs/<experiment>/report/value_of_information.{parquet,md}``; the report shows it once it is there.

``doit run online`` (not part of ``pipeline``) runs the online forms (``dqn_online``, ``ppo_online``,
``mpc_rl_online``: the trained agent or day-level policy fine-tuned at each week's start on the acting split's past
weeks, ``pipeline.study.online``) into ``outputs/<experiment>/online/``; the report shows their rows once they are
there.

``doit bench`` runs the speed benchmarks (``benchmarks/``) into ``outputs/bench``::

    doit bench                 # part=auto: the CPU part, and the GPU part too where CUDA is available
    doit bench part=cpu        # EVHUB_BENCH_PART: cpu, gpu or all

Errors the project raises on purpose (a bad site config, ``[sources]``, raw file or data, a bad doit variable, an
experiment already running; ``envs.errors.is_expected``) print one message, without a traceback, and doit exits
non-zero: while doit loads this file as its ``ERROR: ...`` (exit 3), in a task as ``TaskFailed`` (exit 1;
``pipeline.study.failures``). Any other error is a bug and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from doit.exceptions import InvalidDodoFile

from pipeline import depends
from pipeline.study.config import PROJECT_ROOT, from_environment
from pipeline.study.failures import ExpectedError, doit_action, one_message, quiet_worker_failures
from pipeline.study.runstate import STARTED_AT, current_doit_command, doit_config, stage_table, timed

# a bad doit variable (from_environment raises ValueError naming it) or site config stops doit here, with one line,
# before the study's graph and its controllers (torch, HiGHS, matplotlib) are imported: in about 1 s instead of 5
try:
    CFG = from_environment()
    SITE_TOML = CFG.site_toml
except (ExpectedError, ValueError, FileNotFoundError) as exc:
    raise InvalidDodoFile(one_message(exc)) from None

from pipeline.study.results import outputs  # noqa: E402  (after the settings are read, above)

OUT = outputs(CFG)  # the site config loaded above
COMMAND = current_doit_command()


def _state_folder() -> Path:
    """The experiment folder whose doit state and lock this command uses (``doit bench``: ``outputs/bench``)."""
    if COMMAND and COMMAND.tasks and all(t.split(":")[0] == "bench" for t in COMMAND.tasks):
        return PROJECT_ROOT / "outputs" / "bench"
    return CFG.root


# doit's state lives in each experiment folder (doit's sqlite3 backend), so experiments run side by side; a
# command that runs tasks holds the folder's lock until it exits, so a second run of one experiment stops here
try:
    _STATE = doit_config(_state_folder(), COMMAND)
except ExpectedError as exc:  # ExperimentBusy, DamagedState
    raise InvalidDodoFile(one_message(exc)) from None

DOIT_CONFIG = {"default_tasks": ["pipeline"], "verbosity": 2, "action_string_formatting": "new", **_STATE}
# the stages run at once, in threads of this process sharing one Dask client: the cluster places the work
# (pipeline.study.cluster); one thread per stage that can be ready at a time (``-n 1`` runs them one by one)
DOIT_CONFIG |= {"num_process": len(CFG.algos) + 3, "par_type": "thread"}


def _site_files() -> list[str]:
    return depends.as_strings(depends.site_files(SITE_TOML))


CONTROLLER_CODE = depends.as_strings(depends.controllers())
SETTINGS = CFG.as_dict()


def _stage(stage: str, cfg=CFG, task: str | None = None):
    """The doit action of a stage of the Dask graph, timed as ``task`` (default: the stage) on the stage clock; an
    expected error, re-raised by the Dask client, fails the task with its message alone (the validation tasks also
    raise a plain ValueError naming the file and key)."""

    def action():
        from pipeline.study.graph import run  # the controllers (torch, HiGHS): imported where a stage runs

        quiet_worker_failures(cfg.scheduler_address, cfg.workers)
        run(cfg, stages={stage})

    return timed(task or stage, doit_action(action, also=(ValueError,) if stage == "validate" else ()))


def _targets(stage: str) -> list[str]:
    return [str(p) for p in OUT[stage]]


def task_ingest():
    """Build the site's processed data from the raw sources its TOML names in [sources] (pipeline.data.ingest).

    Re-runs when a raw file (globs expanded), the ingestion code or what it reads of the TOML (name, timezone,
    splits, [pv], [sources]) changes, or a processed file is missing. Without the raw files of a shipped site
    (a fresh clone) there is nothing to do: its shipped processed data are the inputs, and the task's line
    says so; likewise for a site TOML without [sources]. A bad [sources] table fails this task, so nothing
    after it runs.
    """
    from doit.exceptions import TaskFailed
    from doit.tools import config_changed

    from pipeline.data.ingest import ingest, task_plan

    plan = task_plan(CFG.base_toml)  # the site TOML as given (a study at another step reads a copy of it)
    if plan["state"] in ("none", "shipped"):
        return {"actions": None, "uptodate": [True], "title": lambda task: plan["line"]}
    if plan["state"] == "error":
        return {"actions": [lambda: TaskFailed(plan["line"])], "uptodate": [False], "verbosity": 2}

    def action():
        ingest(CFG.base_toml)

    return {
        "actions": [timed("ingest", doit_action(action))],
        "file_dep": plan["file_dep"],
        "targets": plan["targets"],
        "uptodate": [config_changed(plan["settings"])],
        "verbosity": 2,
    }


def task_validate():
    """Check the site config and its data (pandera schemas, physical bounds), one Dask task per input."""
    return {
        "actions": [_stage("validate")],
        "task_dep": ["ingest"],
        "file_dep": _site_files() + depends.as_strings(depends.files(*depends.ENV, "pipeline/study/tasks.py")),
        "targets": _targets("validate"),
        "uptodate": [_config_changed()],
        "clean": True,
    }


def task_baselines():
    """Simulate the controllers that read no tuning (uncontrolled, rule_based, mpc, the learned planners' untrained
    starts, mpc_perfect) and solve the oracle LP, on each split."""
    return {
        "actions": [_stage("baselines")],
        "file_dep": _targets("validate") + _site_files() + CONTROLLER_CODE,
        "targets": _targets("baselines"),
        "uptodate": [_config_changed()],
        "clean": True,
    }


def _tune_budget() -> str:
    """The tuning budget of this command: the doit variable ``tune_budget`` if given, else ``full`` when the command
    names the ``tune`` task and ``small`` inside the pipeline (``pipeline.control.tuning.BUDGETS``)."""
    from pipeline.study.config import variable

    if variable("tune_budget") is not None:
        return CFG.tune_budget
    return "full" if COMMAND and any(t.split(":")[0] == "tune" for t in COMMAND.tasks) else "small"


TUNE_CFG = replace(CFG, tune_budget=_tune_budget())


def task_tune():
    """Tune the learned planners on the train split, once per seed: tune:mpc_tuned and tune:mpc_rl.

    ``tune:mpc_tuned``: the planner's parameters by CMA-ES in closed loop (pipeline.control.tuning); ``tune:mpc_rl``:
    mpc_rl's day-level PPO policy (pipeline.control.rl_planner).

    Inside ``doit run pipeline`` with the ``small`` budget; ``doit run tune`` runs the ``full`` one (``tune_budget=``
    chooses). Each result is kept in ``<experiment>/tuned/`` with the fingerprint of the site, its data and the code it
    was made with (every file of envs/ and pipeline/control/, and for mpc_rl the PPO script and harness); a result
    made for the same fingerprint with the budget asked for or a larger one is used as it is.
    """
    from pipeline.control import tuning

    tuned_dir = CFG.root / "tuned"
    budget = TUNE_CFG.tune_budget

    def tuned() -> bool:  # every seed's tuning made for this site, data and code with this budget or a larger one
        fp = tuning.fingerprint(SITE_TOML)
        return all(tuning.cached(tuned_dir, s, fp, budget) for s in CFG.seeds)

    def trained() -> bool:  # every seed's mpc_rl policy likewise
        from pipeline.study.tasks import rl_planner_trained

        return all(rl_planner_trained(str(SITE_TOML), s, tuned_dir, budget) for s in CFG.seeds)

    inputs = _targets("validate") + _site_files() + CONTROLLER_CODE
    for name, stage, done, code, doc in (
        ("mpc_tuned", "tune", tuned, [], f"tune the planner's parameters by CMA-ES for seeds {list(CFG.seeds)}"),
        (
            "mpc_rl",
            "tune_rl",
            trained,
            depends.as_strings(depends.training("ppo")),
            f"train mpc_rl's day-level PPO policy for seeds {list(CFG.seeds)}",
        ),
    ):
        if not _targets(stage):
            yield {
                "name": name,
                "actions": None,
                "uptodate": [True],
                "title": lambda task, name=name: f"tune:{name}: the site runs no {name}",
            }
            continue
        yield {
            "name": name,
            "doc": doc,
            "actions": [_stage(stage, TUNE_CFG, f"tune:{name}")],
            "file_dep": sorted(set(inputs + code)),
            "targets": _targets(stage),
            "uptodate": [done],
            "verbosity": 2,
        }


def task_planners():
    """Run the learned planners (mpc_tuned, mpc_adaptive, mpc_rl) on both splits, once per seed, from the tuning."""
    return {
        "actions": [_stage("planners")],
        "file_dep": _targets("tune") + _targets("tune_rl") + _targets("validate") + _site_files() + CONTROLLER_CODE,
        "targets": _targets("planners"),
        "uptodate": [_config_changed()],
        "clean": True,
    }


def _per_agent(stage: str, doc: str, file_dep, **extra):
    """One doit task of ``stage`` per agent (``<stage>:<algo>``), for every seed: ``doc`` and ``file_dep(algo, cfg)``
    of the agent and its one-agent config, the stage's outputs for that agent as targets, ``extra`` keys added."""
    for algo in CFG.algos:
        cfg = replace(CFG, algos=(algo,))
        yield {
            "name": algo,
            "doc": doc.format(algo=algo, seeds=list(CFG.seeds)),
            "actions": [_stage(stage, cfg, f"{stage}:{algo}")],
            "file_dep": file_dep(algo, cfg),
            "targets": [str(p) for p in outputs(cfg)[stage]],
            "clean": True,
            **extra,
        }


def task_train():
    """Train each agent (algos/<name>.py) on the train split: side by side on a CPU-only machine, one per GPU worker
    of a cluster, one after another on the GPU of a CUDA machine (pipeline.study.cluster.training_placement)."""
    yield from _per_agent(
        "train",
        "train {algo} (algos/{algo}.py) for seeds {seeds}",
        lambda algo, cfg: _targets("validate") + _site_files() + depends.as_strings(depends.training(algo)),
        uptodate=[_config_changed()],
    )


def task_evaluate():
    """Evaluate every trained policy deterministically over the train and the test split, one task per agent: each
    starts when its agent's training ends, on the CPU workers, while the next agent trains on the GPU."""
    yield from _per_agent(
        "evaluate",
        "evaluate {algo}'s policies (seeds {seeds}) on the train and the test split",
        lambda algo, cfg: (
            [str(p) for p in outputs(cfg)["train"]] + _site_files() + depends.as_strings(depends.files(*depends.ENV))
        ),
    )


def task_physics_baselines():
    """Score the simulated controllers that read no tuning also on the site simulated at 5 minutes (physics/)."""
    return {
        "actions": [_stage("physics_baselines")],
        "file_dep": _targets("validate") + _site_files() + CONTROLLER_CODE,
        "targets": _targets("physics_baselines"),
        "uptodate": [_config_changed()],
        "clean": True,
    }


def task_physics_planners():
    """Score the learned planners (each seed) also on the site simulated at 5 minutes (physics/)."""
    return {
        "actions": [_stage("physics_planners")],
        "file_dep": _targets("planners") + _site_files() + CONTROLLER_CODE,
        "targets": _targets("physics_planners"),
        "uptodate": [_config_changed()],
        "clean": True,
    }


def task_physics_agents():
    """Score each agent's policies also on the site simulated at 5 minutes (physics/), one task per agent."""
    yield from _per_agent(
        "physics_agents",
        "score {algo}'s policies (seeds {seeds}) on the 5-minute site, train and test split",
        lambda algo, cfg: (
            [str(p) for p in outputs(cfg)["train"]] + _site_files() + depends.as_strings(depends.files(*depends.ENV))
        ),
    )


def task_report():
    """Write the CO2 comparison report: report.md, co2_comparison.parquet and figures."""
    return {
        "actions": [_stage("report")],
        "file_dep": _targets("baselines")
        + _targets("planners")
        + _targets("evaluate")
        + _targets("physics_baselines")
        + _targets("physics_planners")
        + _targets("physics_agents")
        + depends.as_strings(depends.files(*depends.REPORT)),
        "targets": _targets("report"),
        "uptodate": [_shown_results_changed()],  # a sizing study, value-of-information table or online rows made since
        "clean": True,
    }


def _shown_results_changed():
    """``uptodate`` of the report on ``<experiment>/sizing/sizing.parquet``,
    ``<experiment>/report/value_of_information.parquet`` and ``<experiment>/online/*.parquet`` (their mtime and size;
    "" when absent). Not file_deps: that would make the report depend on the ``sizing``, ``value_of_information`` and
    ``online`` tasks, which are not part of the pipeline."""
    from doit.tools import config_changed

    def stamp(p: Path) -> str:
        return f"{p.stat().st_mtime_ns}:{p.stat().st_size}" if p.is_file() else ""

    shown = {"sizing_results": stamp(CFG.root / "sizing" / "sizing.parquet")}
    if information := stamp(CFG.root / "report" / "value_of_information.parquet"):
        shown["information_results"] = information  # only when there: a report made before it stays up to date
    if online := ",".join(stamp(p) for p in sorted((CFG.root / "online").glob("*.parquet"))):
        shown["online_results"] = online
    return config_changed(shown)


def task_pipeline():
    """The whole study (the default task): ingest, validate, baselines, tune, planners, train, evaluate, report.

    Ends with the report's path, the wall time of each task this command ran (the stage clock) and the work of its
    Dask tasks by kind (:func:`pipeline.study.cluster.work_table`)."""

    def action():
        from pipeline.study.cluster import work_table

        print(f"report: {Path(_targets('report')[0])}\nwall time of this command's tasks:\n{stage_table()}")
        if work := work_table(STARTED_AT):
            print(f"work of this command's Dask tasks (compute time on the workers, by kind):\n{work}")

    return {
        "actions": [action],
        "task_dep": ["report"],
        "uptodate": [False],
        "verbosity": 2,
    }


def task_sizing():
    """Size PV and battery (not in pipeline): controllers on a PV kWp x BESS kWh grid, cost per t CO2 avoided.

    ``doit run sizing`` runs ``uncontrolled``, ``rule_based``, ``mpc`` and the ``oracle`` on both splits at every
    point of the grid, one Dask task per point (``pipeline.study.sizing``), and writes ``<experiment>/sizing/``:
    ``sizing.parquet``, ``co2_saved.png``, ``pareto.png``, ``sizing.md`` and ``sizing.html`` (cost per tonne of CO2
    avoided, the cost-CO2 Pareto front). Grid and unit costs come from the site TOML's ``[sizing]`` table; the doit
    variables ``kwp=0,20,40,80 bess_kwh=0,40,80,160 bess_kw_per_kwh=0.5 controllers=...`` override the grid and
    ``workers=N`` sizes the LocalCluster. A bad ``[sizing]`` table or variable stops ``doit run sizing`` while doit
    loads this file (other tasks are not affected).
    """
    from doit.exceptions import TaskFailed
    from doit.tools import config_changed

    from pipeline.study.sizing import outputs as sizing_outputs
    from pipeline.study.sizing import sizing_spec
    from pipeline.study.sizing_page import run_sizing

    try:
        spec = sizing_spec(SITE_TOML)
    except (ValueError, FileNotFoundError) as exc:
        if COMMAND and any(t.split(":")[0] == "sizing" for t in COMMAND.tasks):
            raise InvalidDodoFile(str(exc)) from None
        error = str(exc)
        return {"actions": [lambda: TaskFailed(error)], "uptodate": [False], "verbosity": 2}
    targets = [str(p) for p in sizing_outputs(CFG.root)]

    def action():
        run_sizing(
            SITE_TOML, CFG.root / "sizing", spec=spec, workers=CFG.workers, scheduler_address=CFG.scheduler_address
        )

    return {
        "actions": [doit_action(action)],
        "file_dep": _site_files()
        + CONTROLLER_CODE
        + depends.as_strings(depends.files("pipeline/study/sizing.py", "pipeline/study/document.py")),
        "targets": targets,
        "uptodate": [config_changed(spec.as_dict())],
        "clean": True,
        "verbosity": 2,
    }


def task_value_of_information():
    """What forecasting what is worth at the site (not in pipeline): the planner given the true MOER, arrivals, both.

    ``doit run value_of_information`` runs the planner of ``mpc_rl_start`` with forecasts of both unknowns, the true
    MOER, the true arrivals and both true (``mpc_perfect``) over each whole split, one Dask task per run x split
    (``pipeline.study.information``), against ``rule_based`` and the ``oracle``; a row the study's ``baselines/``
    already holds, newer than the site and the controllers' code, is read instead of run. It writes
    ``<experiment>/report/value_of_information.parquet`` and ``value_of_information.md`` (a reading line per split);
    the report shows the table once it is there. Same settings as the pipeline (``site=``, ``experiment=``,
    ``scheduler=``).
    """
    from pipeline.study import information

    def action():
        quiet_worker_failures(CFG.scheduler_address, CFG.workers)
        information.run(SITE_TOML, CFG.root, scheduler_address=CFG.scheduler_address, workers=CFG.workers)

    return {
        "actions": [timed("value_of_information", doit_action(action))],
        "file_dep": _site_files()
        + CONTROLLER_CODE
        + depends.as_strings(depends.files("pipeline/study/information.py", "pipeline/study/document.py")),
        "targets": [str(p) for p in information.outputs(CFG.root)],
        "clean": True,
        "verbosity": 2,
    }


def task_online():
    """The online agents (not in pipeline): each trained agent with an online form fine-tuned week by week on the past.

    ``doit run online`` runs ``dqn_online``, ``ppo_online`` and ``mpc_rl_online`` (``pipeline.study.online``) for
    each seed on both splits, one Dask task each, from the study's trained runs (it trains them first where they are
    missing): at each week's start it fine-tunes on the acting split's weeks before it, then acts. It writes
    ``<experiment>/online/``; the report shows the rows once they are there. Same settings as the pipeline (``site=``,
    ``experiment=``, ``seeds=``, ``scheduler=``).
    """
    from pipeline.study import results

    cfg = replace(CFG, algos=results.online_algos(CFG.algos))

    def action():
        from pipeline.study import online  # torch: imported where the stage runs

        quiet_worker_failures(CFG.scheduler_address, CFG.workers)
        online.run(cfg)

    return {
        "actions": [timed("online", doit_action(action))],
        "file_dep": [str(p) for p in outputs(cfg)["train"]]
        + _targets("tune_rl")
        + _site_files()
        + depends.as_strings(depends.files(*depends.ENV, *depends.CONTROL, "pipeline/study/online.py")),
        "targets": [str(p) for p in results.online_outputs(cfg)],
        "clean": True,
        "verbosity": 2,
    }


def task_bench():
    """Speed benchmarks side by side: our envs and agents against gymnasium/SB3, sync vs async, speed switches.

    Envs (EVHub, Snake) vs gymnasium/SB3 vector envs, sync vs async on an I/O-bound env, PPO/SAC vs SB3, the speed
    switches (GPU)."""

    def action():
        import os

        import torch
        from doit import get_var
        from doit.exceptions import TaskFailed

        from benchmarks import env_throughput, profile, report, switches, training, vector_io

        part = get_var("part", None) or os.environ.get("EVHUB_BENCH_PART", "auto")
        if part not in ("auto", "cpu", "gpu", "all"):
            return TaskFailed(f"doit variable part={part!r}: must be auto, cpu, gpu or all (or EVHUB_BENCH_PART)")
        if part == "gpu" and not torch.cuda.is_available():
            return TaskFailed("doit variable part='gpu': needs CUDA, which is not available here; use part=cpu or auto")
        cpu = part in ("auto", "cpu", "all")
        gpu = part in ("gpu", "all") or (part == "auto" and torch.cuda.is_available())
        ours = ("ours", "ours_compile")  # the env step eager and compiled as one graph, side by side
        if cpu:
            env_throughput.run(device="cpu", impls=(*env_throughput.DEFAULT_IMPLS, "ours_compile"))
            env_throughput.run(device="cpu", env_id="Snake-v0")
            profile.run(("env_eager", "env_compile"), device="cpu", num_envs=4096)
            vector_io.run()
            training.run(device="cpu")
        if gpu:
            env_throughput.run(
                device="cuda",
                num_envs=(1, 256, 4096, 65536),
                impls=(*ours, "ours_cudagraph"),
                out_name="env_throughput_graphs_cuda",
            )
            env_throughput.run(device="cuda")
            env_throughput.run(device="cuda", env_id="Snake-v0")
            switches.run(device="cuda")
            training.run(device="cuda")
            for n in (4096, 65536):
                profile.run(
                    ("env_eager", "env_compile", "env_cudagraph"),
                    device="cuda",
                    num_envs=n,
                    name=f"profile_env_cuda_{n}",
                )
            profile.run(("ppo", "sac"), device="cuda", num_envs=16384)
        report.write()

    return {"actions": [action], "uptodate": [False], "verbosity": 2}


def _config_changed():
    from doit.tools import config_changed

    return config_changed({k: v for k, v in SETTINGS.items() if k not in ("scheduler_address", "workers")})


def task_wheelhouse():
    """Wheels of every dependency but torch, for an offline install on a machine whose torch is there already.

    ``doit wheelhouse python=3.12 platform=manylinux_2_28_x86_64 exclude="numpy pandas" dest=outputs/wheelhouse``
    (each optional: CPython 3.12, manylinux x86-64, nothing excluded, outputs/wheelhouse); then, on the target, from
    the project's root: ``pip install --no-index --find-links outputs/wheelhouse --no-build-isolation -e .``
    (:mod:`pipeline.wheelhouse`)."""

    def action():
        from pipeline import wheelhouse
        from pipeline.study.config import variable

        def given(name: str, default: str) -> str:
            return (variable(name) or (default,))[0]

        argv = ["--python", given("python", "3.12"), "--dest", given("dest", "outputs/wheelhouse")]
        for tag in given("platform", "").split():
            argv += ["--platform", tag]
        for name in given("exclude", "").split():
            argv += ["--exclude", name]
        return wheelhouse.main(argv) == 0

    return {"actions": [action], "uptodate": [False], "verbosity": 2}
