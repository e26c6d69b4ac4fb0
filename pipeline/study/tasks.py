"""The study's tasks: plain functions from file paths to file paths, run as Dask tasks by ``pipeline.study.graph``.
Each imports the heavy libraries it needs (torch, the planners, matplotlib) where it runs, so the process that only
orchestrates (doit's, submitting them) imports none.

Every task writes its outputs atomically (temporary name, then rename), so a killed task leaves the
previous file or none. Under ``<output_dir>/<experiment>/``: ``validate/<input>.json`` (what was checked, written
only when every input passed), the result files of :mod:`pipeline.study.results` (``baselines/``, ``runs/``,
``eval/``) and ``report/`` (report.md, report.html, co2_comparison.parquet, figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from envs import timestep
from envs.config import load_config
from envs.files import write_parquet, write_text
from envs.site import load_site, site_files
from pipeline import depends
from pipeline.control import registry, tuning
from pipeline.control.tuned import ppo_args, rl_policy_file, rl_run_dir, tuning_files
from pipeline.study import results
from pipeline.study.cluster import PRIORITY
from pipeline.study.config import AGENT_BUDGETS, AGENT_INPUTS, PROJECT_ROOT, SPLITS, shown_path


def validate_input(site_toml: str, kind: str) -> dict:
    """Validate one input of a site and return a summary (nothing is written).

    Args:
        site_toml: path of the site config.
        kind: ``"config"`` (the TOML, and that both splits hold data and sessions), ``"series"`` (the series at the
            site's step) or ``"sessions"`` (the processed tables against their pandera schemas).

    Returns:
        dict with ``input``, ``file``, ``rows`` and, for the config, per-split step and session counts.

    Raises:
        envs.config.ConfigError, envs.schemas.DataValidationError, ValueError: the message names the file,
            the column or key, and the row or time.
    """
    from envs.schemas import read_table, validate_table

    cfg, path = load_config(site_toml)
    if kind == "config":
        site = load_site(path, validate=False)
        summary = {"input": kind, "file": str(path)}
        for split in SPLITS:
            data = site.split(split)
            if len(data.sessions) == 0:
                raise ValueError(f"{path}: key 'splits.{split}' selects no EV sessions in {site.source['sessions']}")
            summary[split] = {"steps": data.num_steps, "sessions": len(data.sessions)}
        return summary
    if kind not in ("series", "sessions"):
        raise ValueError(f"unknown input kind {kind!r}: expected one of {results.INPUTS}")
    file = site_files(path)[kind]
    df = read_table(file)
    validate_table(kind, df, str(file), timestep.step_minutes(cfg.dt_h))
    return {"input": kind, "file": str(file), "rows": len(df)}


def write_validation(summaries: list[dict], out_dir: str) -> list[str]:
    """Write one ``<input>.json`` per validated input into ``out_dir`` (called only when all passed)."""
    return [str(write_text(Path(out_dir) / f"{s['input']}.json", json.dumps(s, indent=2))) for s in summaries]


def run_controller(
    site_toml: str,
    controller: str,
    split: str,
    out_dir: str,
    *after,
    seed: int | None = None,
    tuned_dir: str | None = None,
    inputs: str | None = None,
    physics: bool = False,
) -> list[str]:
    """Simulate a controller of the registry over a whole split (:meth:`pipeline.control.registry.Controller.simulate`);
    returns ``[kpi_path, traces_path]`` (named by :func:`pipeline.study.results.files`, with the seed of a seeded
    controller).

    Args:
        after: outputs of the tasks it must follow (validation, the week tables), not read.
        seed, tuned_dir: what a seeded controller that reads tuned parameters needs.
        inputs: a name of what the run was computed from, kept in the KPI file's metadata (``attrs["inputs"]``, read
            back by :func:`run_inputs`).
        physics: score it on the site simulated at :data:`envs.timestep.PHYSICS_DT_H` (5 minutes) instead.

    Raises:
        KeyError: unknown controller (the message names the closest known one) or split.
        TypeError: an agent (trained by its script, not simulated), or a missing seed or tuning folder.
        RuntimeError: an LP not solved, or the energy balance violated in some step.
    """
    c = registry.get(controller)
    physics_dt_h = timestep.PHYSICS_DT_H if physics else None
    kpis, traces = c.simulate(load_site(site_toml), split, seed=seed, tuned_dir=tuned_dir, physics_dt_h=physics_dt_h)
    if inputs is not None:
        kpis.attrs["inputs"] = inputs
    return write_run(kpis, traces, out_dir, controller, split, seed if c.seeded else None)


def run_inputs(files: list[str | Path]) -> str | None:
    """The ``inputs`` a finished run (``[kpi_path, traces_path]``) was written with by :func:`run_controller`; None
    when either file is missing or unreadable, or the run has none."""
    try:
        if not Path(files[1]).is_file():
            return None
        return pd.read_parquet(files[0]).attrs.get("inputs")
    except (OSError, ValueError):
        return None


def tune_planner(site_toml: str, seeds, tuned_dir: str, budget: str, client=None) -> list[str]:
    """Tune the planner's parameters on the train split once per seed (:func:`pipeline.control.tuning.tune`), its
    backtests as tasks of ``client``; a seed whose tuning is cached in ``tuned_dir`` for the same site, data and code
    with ``budget`` or a larger one is not tuned again. Returns every tuning file (summary and history per seed).

    Raises:
        KeyError: an unknown budget.
    """
    fp = tuning.fingerprint(site_toml)
    todo = [s for s in seeds if tuning.cached(tuned_dir, s, fp, budget) is None]
    b = tuning.BUDGETS[budget]
    if todo:
        evaluate = tuning.dask_evaluator(client, site_toml, "train", PRIORITY["tune"]) if client is not None else None
        line = f"tune: seeds {todo}, budget '{budget}' ({b.windows} week backtests a seed) on the train split"
        print(line, flush=True)
        for result in tuning.tune(site_toml, todo, budget, evaluate=evaluate):
            tuning.write(result, tuned_dir, fp)
            print(
                f"tune seed {result.seed}: {result.wall_s:.0f} s, {result.solves} LP solves "
                f"({result.solves / max(result.solve_s, 1e-9):.0f} solves/s); {result.params}",
                flush=True,
            )
    return [str(f) for s in seeds for f in tuning_files(tuned_dir, s)]


def train_rl_planners(site_toml: str, seeds, tuned_dir: str, budget: str, client=None) -> list[str]:
    """Train ``mpc_rl``'s day-level policy once per seed (:func:`train_rl_planner`, one training task of ``client``
    each); a seed whose finished run in ``tuned_dir`` was made for the same site, data and code with ``budget`` or a
    larger one (:func:`rl_planner_trained`) is kept. Returns the exported policies.

    Raises:
        KeyError: an unknown budget. RuntimeError: a training that failed.
    """
    todo = [s for s in seeds if rl_planner_trained(site_toml, s, tuned_dir, budget) is None]
    days = tuning.BUDGETS[budget].rl_days
    if client is None:
        for seed in todo:
            train_rl_planner(site_toml, seed, str(rl_run_dir(tuned_dir, seed)), days)
    else:
        options = {"priority": PRIORITY["train"]}  # CPU work (each day is 24 LP solves): no GPU asked for
        client.gather(
            [
                client.submit(
                    train_rl_planner, site_toml, seed, str(rl_run_dir(tuned_dir, seed)), days, **options,
                    pure=False,
                )
                for seed in todo
            ]
        )  # fmt: skip
    return [str(rl_policy_file(rl_run_dir(tuned_dir, s))) for s in seeds]


def rl_planner_trained(site_toml: str, seed: int, tuned_dir: str | Path, budget: str) -> str | None:
    """The budget (a :data:`pipeline.control.tuning.BUDGETS` key) of the finished ``mpc_rl`` run of ``seed`` in
    ``tuned_dir`` when it was trained for this site, data and code with ``budget`` or a larger one; else None."""
    run = rl_run_dir(tuned_dir, seed)
    spec = run / "run.json"
    if not (spec.is_file() and rl_policy_file(run).is_file()):
        return None
    try:
        made = json.loads(spec.read_text()).get("fingerprint")
    except (OSError, json.JSONDecodeError):
        return None
    order = list(tuning.BUDGETS)
    for larger in order[order.index(budget) :]:
        cmd = training_command("ppo", seed, site_toml, str(run), *_rl_args(tuning.BUDGETS[larger].rl_days))
        if made == run_fingerprint(cmd[1:], site_toml, "ppo", code=depends.CONTROL):
            return larger
    return None


def _rl_args(days: int) -> tuple[int, tuple[str, ...]]:
    """``(total_timesteps, extra_args)`` of ``mpc_rl``'s training for ``days`` days."""
    return days, ppo_args(days)


def train_rl_planner(site_toml: str, seed: int, run_dir: str, days: int) -> str:
    """Train ``mpc_rl``'s policy (``algos/ppo.py`` on :data:`pipeline.control.tuned.ENV_ID`) for ``days`` days
    into ``run_dir`` (:func:`train_agent`, which keeps a finished run of the same fingerprint); returns the folder."""
    from pipeline.control import rl_planner

    t0 = time.perf_counter()
    run = train_agent(
        "ppo",
        seed,
        site_toml,
        run_dir,
        *_rl_args(days),
        env_vars=rl_planner.training_environ(site_toml),
        code=depends.CONTROL,
        tag=f"mpc_rl seed {seed}",
    )
    print(f"mpc_rl seed {seed}: {days} days of PPO in {time.perf_counter() - t0:.0f} s", flush=True)
    return run


def run_as(files: list[str], controller: str, split: str, out_dir: str, seed: int | None = None) -> list[str]:
    """Write another controller's run (``files``: :func:`run_controller`'s ``[kpi_path, traces_path]``) under the name
    ``controller`` (and ``seed``): the study's ``mpc_tuned`` of a seed whose tuning kept its start is
    ``mpc_tuned_start``'s run, the same planner step for step (:func:`pipeline.study.graph.run`). Returns
    ``[kpi_path, traces_path]``."""
    kpis = pd.read_parquet(files[0])
    kpis.attrs.clear()
    source = str(kpis.controller.iloc[0])
    kpis["controller"] = controller
    if seed is not None:
        kpis["seed"] = float(seed)
    tag = controller if seed is None else f"{controller} seed {seed}"
    print(f"{tag} {split}: {source}'s run, the same planner; CO2 {kpis.co2_kg.iloc[0]:.1f} kg", flush=True)
    return write_run(kpis, pd.read_parquet(files[1]), out_dir, controller, split, seed)


def write_run(
    kpis: pd.DataFrame, traces: pd.DataFrame, out_dir: str | Path, controller: str, split: str, seed: int | None = None
) -> list[str]:
    """Write one run's KPI row and traces (:func:`pipeline.study.results.files`' names, atomically); returns
    ``[kpi_path, traces_path]``."""
    kpi_file, traces_file = results.files(out_dir, controller, split, seed)
    traces_path = write_parquet(traces, traces_file)
    kpi_path = write_parquet(kpis, kpi_file)
    return [str(kpi_path), str(traces_path)]


def algo_script(algo: str) -> Path:
    """Path of an algorithm's script, ``algos/<algo>.py``."""
    return PROJECT_ROOT / "algos" / f"{algo}.py"


def run_fingerprint(
    cmd: list[str], site_toml: str, algo: str, root: Path = PROJECT_ROOT, code: tuple[str, ...] = ()
) -> str:
    """SHA-256 (hex) of what a training run is: its command line, the site config and data, and the code.

    Two attempts with the same fingerprint are the same run, so the second may resume the first's checkpoint.
    The data files are the site's (:func:`pipeline.depends.site_files`); the code is
    :func:`pipeline.depends.training` (the agent's script, the harness, every file of ``envs``) under ``root``,
    the same files doit's ``train`` tasks depend on, so a change that re-runs training also starts it afresh; and the
    files of the globs ``code``.
    """
    code_files = depends.training(algo, root)
    code_files += [f for f in depends.files(*code, root=root) if f not in code_files]
    site = [f for f in depends.site_files(site_toml) if f.is_file()]
    return depends.fingerprint([*site, *code_files], root=root, salt=json.dumps(cmd))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGKILL this process when the thread that started it dies (``prctl(PR_SET_PDEATHSIG)``).

    A Dask worker killed mid-task then takes its training run with it, so the rescheduled task never races
    an orphaned run writing the same folder. A no-op where ``prctl`` is unavailable.
    """
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def training_command(
    algo: str,
    seed: int,
    site_toml: str,
    run_dir: str | Path,
    total_timesteps: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The command line :func:`train_agent` runs: ``algos/<algo>.py`` with the site, seed, output folder, budget,
    ``--eval-split none`` (the study evaluates every policy on both splits itself, :func:`evaluate_agent`) and
    ``extra_args`` (the last of a repeated flag wins: a user's ``--eval-split`` still applies)."""
    cmd = [sys.executable, str(algo_script(algo)), "--site", site_toml, "--seed", str(seed)]
    cmd += ["--output-dir", str(run_dir)]
    if total_timesteps is not None:
        cmd += ["--total-timesteps", str(total_timesteps)]
    return cmd + ["--eval-split", "none", *extra_args]


def train_agent(
    algo: str,
    seed: int,
    site_toml: str,
    run_dir: str,
    total_timesteps: int | None = None,
    extra_args: tuple[str, ...] = (),
    *deps,
    env_vars: dict[str, str] | None = None,
    code: tuple[str, ...] = (),
    tag: str | None = None,
    echo: bool = True,
) -> str:
    """Train one agent by running its script in a subprocess (``--eval-split none``: the study's ``evaluate`` stage
    evaluates the policy on both splits, so the script's own final evaluation is left out); returns the run folder.

    ``env_vars`` are set in the script's environment; ``code`` are globs (relative to the project root) of code the
    run depends on besides :func:`pipeline.study.depends.training` (the env of another id, say), in its fingerprint
    too; ``tag`` prefixes its echoed lines (default ``<algo> seed <seed>``; ``echo=False`` only logs them).

    The script's output is appended to ``<run_dir>/train.log`` (one header line per attempt) and echoed
    line by line. The task is safe to repeat: ``<run_dir>/run.json`` records the run's fingerprint
    (:func:`run_fingerprint`), and an attempt with the same fingerprint whose folder holds a checkpoint
    passes ``--resume``, so a re-run (a rescheduled Dask task after a lost worker, or ``doit run`` after an
    interruption) continues from the last checkpoint instead of starting over; a finished run has nothing
    left to train. A changed command, site, data or code starts a fresh run. On Linux the script is killed
    with the worker that started it.

    Raises:
        RuntimeError: the script failed; the message holds the end of its log.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cmd = training_command(algo, seed, site_toml, run_dir, total_timesteps, extra_args)
    fingerprint = run_fingerprint(cmd[1:], site_toml, algo, code=code)
    spec_path = run / "run.json"
    same_run = spec_path.is_file() and json.loads(spec_path.read_text()).get("fingerprint") == fingerprint
    if same_run and (run / "checkpoint.pt").is_file():
        cmd.append("--resume")
    else:
        (run / "checkpoint.pt").unlink(missing_ok=True)  # another run's checkpoint must not be resumed
        write_text(spec_path, json.dumps({"fingerprint": fingerprint, "command": cmd[1:]}, indent=2))
    dropped = worker_environ()
    env = {k: v for k, v in os.environ.items() if k not in dropped} | {"PYTHONUNBUFFERED": "1"} | (env_vars or {})
    log_path = run / "train.log"
    tail: list[str] = []
    with (
        open(log_path, "a", buffering=1) as log,
        subprocess.Popen(  # line-buffered: a killed worker loses no line
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=PROJECT_ROOT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        ) as proc,
    ):
        assert proc.stdout is not None
        log.write(f"==== {pd.Timestamp.now(tz='UTC'):%Y-%m-%dT%H:%M:%SZ} pid {proc.pid}: {' '.join(cmd[1:])}\n")
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line])[-40:]
            if echo and "\r" not in line:
                print(f"[{tag or f'{algo} seed {seed}'}] {line}", end="", flush=True)
        code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{algo} (seed {seed}) failed with exit code {code}; end of {log_path}:\n{''.join(tail)}")
    resumes = run / "resumes.json"  # written by a run that was resumed: from which steps, and whether exactly
    if resumes.is_file():
        spec = json.loads(spec_path.read_text())
        write_text(spec_path, json.dumps({**spec, "resumed": json.loads(resumes.read_text())}, indent=2))
    return str(run)


def resumed_note(run_dirs: dict[str, Path]) -> str | None:
    """The report's note on the training runs (``{label: run folder}``) that were interrupted and resumed, from their
    ``run.json`` (:func:`train_agent`): from which global step, and whether every state came back (the replay
    buffer rebuilt the same: the row equals an uninterrupted run's on the same machine and torch build) or not
    (the row may differ from one). None where no run was resumed."""
    parts = []
    for label, run in run_dirs.items():
        try:
            resumed = json.loads((Path(run) / "run.json").read_text()).get("resumed") or []
        except (OSError, json.JSONDecodeError):
            continue
        for r in resumed:
            lost = r.get("replay_buffer", "its envs started new episodes")
            how = "every state restored" if r.get("exact") else f"not exactly: {lost}"
            parts.append(f"{label} from global step {r['from_global_step']:,} ({how})")
    if not parts:
        return None
    return (
        "**Resumed training runs.** "
        + "; ".join(parts)
        + ". A run resumed with every state restored ends where an uninterrupted run ends on the same machine and "
        "torch build; one that was not may differ from it."
    )


def worker_environ() -> set[str]:
    """The environment variables a Dask nanny sets for its worker process (``distributed.nanny.pre-spawn-environ``:
    OMP/MKL/OpenBLAS at one thread, ``MALLOC_TRIM_THRESHOLD_=65536``), which a training run started by a task must not
    inherit: the run owns its worker's cores (and GPU), its script sets its own torch threads, and glibc trimming its
    heap at every free above 64 KiB made SAC's cpu preset 1.5x slower (2,017 against 1,320 steps/s over 30,000 steps,
    28x the page faults)."""
    import dask
    import distributed  # noqa: F401  (defines the nanny's configuration)

    return set(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}) | {
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }


def find_policy(run_dir: str | Path) -> Path:
    """The exported policy of a run (``policy.pt2`` or ``policy.pt``).

    Raises:
        FileNotFoundError: the run has no exported policy.
    """
    for name in ("policy.pt2", "policy.pt"):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    raise FileNotFoundError(f"{run_dir}: no policy.pt2 or policy.pt (did training finish?)")


def evaluate_agent(
    algo: str, seed: int, run_dir: str, site_toml: str, split: str, out_dir: str, physics: bool = False
) -> list[str]:
    """Evaluate a trained agent's exported policy over a whole split, deterministically (``physics``: on the site
    simulated at :data:`envs.timestep.PHYSICS_DT_H`, its decisions every step of the site held over the sub-steps).

    Training figures (``train_wall_s``, ``env_steps``, ``steps_per_s``) come from the run's
    ``metrics.parquet``. Returns ``[kpi_path, traces_path]``.
    """
    from envs.kpis import evaluate_policy, load_policy, read_policy_spec

    site = load_site(site_toml)
    extra = {"seed": float(seed)}
    metrics_path = Path(run_dir) / "metrics.parquet"
    if metrics_path.is_file():
        m = pd.read_parquet(metrics_path)
        if len(m):
            last = m.iloc[-1]
            extra |= {
                "train_wall_s": float(last.wall_s),
                "env_steps": float(last.global_step),
                "steps_per_s": float(last.global_step / max(last.wall_s, 1e-9)),
            }
    spec = read_policy_spec(run_dir)  # the env settings the policy was trained in
    kpis, traces = evaluate_policy(
        load_policy(find_policy(run_dir)),
        site,
        split,
        algo,
        spec["action_mode"],
        bess_action=spec["bess_action"],
        physics_dt_h=timestep.PHYSICS_DT_H if physics else None,
    )
    for k, v in extra.items():
        kpis[k] = v
    return write_run(kpis, traces, out_dir, algo, split, seed)


def make_report(
    cfg_dict: dict, kpi_paths: list[str], trace_paths: dict, metrics: dict, out_dir: str, physics_paths=()
) -> str:
    """Write the CO2 comparison report from the KPI and trace files (and the KPI files of the controllers scored on the
    5-minute site, ``physics_paths``); returns the report.md path.

    A site whose config sets ``synthetic_sessions`` gets "(synthetic EV sessions)" in the title and a note
    under it; a ``data_note`` is shown in the site section; a site whose hourly MOER is one constant gets a
    note that its CO2 follows grid import, to be read beside unserved energy. When a sizing study of the experiment
    has run (``<experiment>/sizing/sizing.parquet``, ``doit run sizing``), its headline is shown too
    (:func:`pipeline.study.sizing.report_summary`); likewise the value-of-information table
    (``report/value_of_information.parquet``, ``doit run value_of_information``).
    """
    from pipeline.study.hparams import write_hparams
    from pipeline.study.report import site_data_sources, write_report
    from pipeline.study.sizing import report_summary

    c, toml = load_config(cfg_dict["site_toml"])
    budget, inputs = cfg_dict.get("agent_budget", "preset"), cfg_dict.get("agent_inputs", "plain")
    summary = {
        "site": f"{c.name} ({shown_path(cfg_dict['site_toml'])})",
        "timezone": c.timezone,
        "PV": f"{c.pv.kwp:g} kWp",
        "BESS": f"{c.bess.capacity_kwh:g} kWh / {c.bess.power_kw:g} kW, SOC {c.bess.soc_min:g}..{c.bess.soc_max:g}",
        "EV sockets": " + ".join(
            f"{g.count} x {g.kw:g} kW" + (f" ({', '.join(g.stations)})" if c.ev.sockets else "") for g in c.ev.groups
        )
        + f" (deadline floor: {c.ev.deadline_floor})",
        "grid": f"import limit {c.grid.import_limit_kw:g} kW, "
        f"export {'allowed' if c.grid.export_allowed else 'not allowed'}",
        "CO2 accounting": "grid import x MOER of its hour, minus exported energy x MOER of its hour (avoided emissions)"
        if c.grid.export_credit == "moer"
        else "grid import x MOER of its hour; exported energy is not credited",
        "splits": f"train {c.splits.train[0]}..{c.splits.train[1]}, test {c.splits.test[0]}..{c.splits.test[1]}",
        "agents": ", ".join(cfg_dict["algos"]),
        "agents' training budget": f"`{budget}`: {AGENT_BUDGETS[budget].says}"
        + (f", {cfg_dict['total_timesteps']:,} env steps each" if cfg_dict.get("total_timesteps") else ""),
        "agents' inputs": f"`{inputs}`: {AGENT_INPUTS[inputs].says}",
    }
    notes = []
    if c.synthetic_sessions:
        summary["EV sessions"] = "**synthetic**, generated from stated fleet parameters (not measured)"
        notes.append(
            f"**Synthetic EV sessions.** The EV sessions of site `{c.name}` are generated from assumed fleet "
            "parameters, not measured; read the results as what the controllers do with this sizing."
        )
    if c.data_note:
        summary["data"] = c.data_note
    moer = pd.read_parquet(site_files(toml)["series"], columns=["moer_kg_per_kwh"])["moer_kg_per_kwh"]
    if len(moer) and float(moer.max()) == float(moer.min()):
        notes.append(
            f"**Constant grid factor** ({float(moer.iloc[0]):.4g} kg CO2/kWh): CO2 is proportional to grid import, "
            "so a controller can only cut it by importing less; read it beside the unserved energy."
        )
    root, seeds = Path(out_dir).parent, cfg_dict.get("seeds", ())
    runs = {f"{a} seed {sd}": root / "runs" / results.run_name(a, sd) for a in cfg_dict["algos"] for sd in seeds}
    runs |= {f"mpc_rl's policy, seed {sd}": rl_run_dir(root / "tuned", sd) for sd in seeds}
    if note := resumed_note(runs):
        notes.append(note)
    sizing_file = Path(out_dir).parent / "sizing" / "sizing.parquet"  # a sizing study of this experiment, if run
    sizing = None
    if sizing_file.is_file():
        sizing = report_summary(pd.read_parquet(sizing_file))
    information_file = Path(out_dir) / "value_of_information.parquet"  # from `doit run value_of_information`, if run
    information = pd.read_parquet(information_file) if information_file.is_file() else None
    path = write_report(
        [Path(p) for p in kpi_paths],
        {tuple(k.split("|")): Path(v) for k, v in trace_paths.items()},
        {k: Path(v) for k, v in metrics.items()},
        Path(out_dir),
        title=f"CO2 comparison: {c.name}" + (" (synthetic EV sessions)" if c.synthetic_sessions else ""),
        site_summary=summary,
        notes=notes,
        data_sources=site_data_sources(toml.parent / c.data_dir / "README.md"),
        sizing=sizing,
        information=information,
        physics_files=[Path(p) for p in physics_paths],
        step_minutes=timestep.step_minutes(c.dt_h),
    )
    write_hparams([Path(p) for p in kpi_paths], root)  # each learned run's settings and evaluation, for TensorBoard
    return str(path)
