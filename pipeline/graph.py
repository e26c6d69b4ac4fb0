"""The study as one Dask graph, and the one place where the Dask cluster is chosen.

``run(cfg)`` submits the whole study (validation fanned out per input, baselines per controller x split,
the MPC controllers and the oracle per split, training per agent x seed, evaluation per agent x seed x split, the report) and
waits for the report. ``run(cfg, stages={"baselines"})`` computes only some stages; the outputs of the
stages left out are taken from disk (this is how ``dodo.py`` runs one stage per doit task, so doit decides
what is out of date and Dask fans out the work inside a stage).

Cluster: ``cfg.scheduler_address`` (or ``DASK_SCHEDULER_ADDRESS``) connects to an existing cluster;
otherwise an embedded ``LocalCluster`` is started once per process. Training tasks ask for the worker
resource ``GPU=1`` whenever some worker declares it (``dask worker ... --resources GPU=1``); otherwise
they run on any worker. Workers must see the same file system paths as the client (outputs and site data
are passed as paths).

Tasks that are safe to repeat carry Dask retries: baselines, the MPC controllers, the oracle, evaluation, and training (a repeated
training task resumes from its run's checkpoint, see :func:`pipeline.tasks.train_agent`). Tasks of a worker
that dies are rescheduled by the scheduler.
"""

from __future__ import annotations

import atexit
from pathlib import Path

from envs.site import load_config
from pipeline.baselines import CONTROLLERS
from pipeline.config import SPLITS, PipelineConfig
from pipeline.mpc import CONTROLLERS as MPC_CONTROLLERS
from pipeline import tasks

STAGES = ("validate", "baselines", "train", "evaluate", "report")

_CLIENTS: dict[str | None, object] = {}


def get_client(scheduler_address: str | None = None, n_workers: int | None = None):
    """A ``distributed.Client`` for the study: the given scheduler, else an embedded LocalCluster (cached).

    Args:
        scheduler_address: an existing Dask scheduler; None starts a LocalCluster.
        n_workers: worker processes of the LocalCluster (one thread each; default ``min(4, cores)``); ignored
            with a scheduler address. A LocalCluster is cached per size.

    Raises:
        OSError / TimeoutError: the scheduler cannot be reached (message names the address).
    """
    from distributed import Client, LocalCluster

    key = scheduler_address if scheduler_address or not n_workers else f"local:{n_workers}"
    if key in _CLIENTS:
        return _CLIENTS[key]
    if scheduler_address:
        try:
            client = Client(scheduler_address, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise OSError(f"cannot reach the Dask scheduler at {scheduler_address}: {exc}") from exc
    else:
        import os

        n = n_workers or max(1, min(4, os.cpu_count() or 1))
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
        atexit.register(lambda: (client.close(), cluster.close()))
    _CLIENTS[key] = client
    return client


def gpu_workers(client) -> int:
    """Number of workers that declare the resource ``GPU``."""
    try:
        info = client.scheduler_info(n_workers=-1)  # newer distributed lists only a few workers by default
    except TypeError:
        info = client.scheduler_info()
    return sum(1 for w in info["workers"].values() if w.get("resources", {}).get("GPU", 0) >= 1)


def mpc_controllers(cfg: PipelineConfig) -> list[str]:
    """The MPC controllers the study runs: ``mpc`` and ``mpc_perfect`` unless the site sets ``[mpc] enabled = false``."""
    return list(MPC_CONTROLLERS) if load_config(cfg.site_toml)[0].mpc.enabled else []


def outputs(cfg: PipelineConfig) -> dict[str, list[Path]]:
    """Every file each stage writes, by stage (doit's targets and the stand-ins for skipped stages)."""
    root = cfg.root
    runs = [f"{a}_seed{s}" for a in cfg.algos for s in cfg.seeds]
    controllers = [*CONTROLLERS, *mpc_controllers(cfg), "oracle"]
    return {
        "validate": [root / "validate" / f"{i}.json" for i in tasks.INPUTS],
        "baselines": [root / "baselines" / f"{c}_{s}{x}.parquet" for c in controllers for s in SPLITS for x in ("", "_traces")],
        "train": [root / "runs" / r / f for r in runs for f in ("metrics.parquet", "policy.pt2")],
        "evaluate": [root / "eval" / f"{r}_{s}{x}.parquet" for r in runs for s in SPLITS for x in ("", "_traces")],
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

    # validation: one task per input; the stamps are written only when all of them passed
    if "validate" in stages:
        checks = [submit(tasks.validate_input, site, kind, key=f"validate-{kind}-{cfg.experiment}", pure=False) for kind in tasks.INPUTS]
        validated = submit(tasks.write_validation, checks, str(root / "validate"), pure=False)
        futures["validate"] = validated
    else:
        validated = on_disk("validate") if stages & {"baselines", "train"} else None

    # baselines: one task per controller x split, the oracle per split
    if "baselines" in stages:
        out = str(root / "baselines")
        jobs = [submit(tasks.run_baseline, site, c, s, out, validated, retries=2, pure=False) for c in CONTROLLERS for s in SPLITS]
        jobs += [submit(tasks.run_mpc, site, c, s, out, validated, retries=1, pure=False) for c in mpc_controllers(cfg) for s in SPLITS]
        jobs += [submit(tasks.run_oracle, site, s, out, validated, retries=1, pure=False) for s in SPLITS]
        futures["baselines"] = client.submit(_flatten, jobs, pure=False)
        baseline_files = futures["baselines"]
    else:
        baseline_files = on_disk("baselines") if "report" in stages else None

    # training: one task per agent x seed, needing a GPU when the cluster has GPU workers; on an
    # embedded LocalCluster the agents train one after another (each task waits for the previous one)
    runs: dict[tuple[str, int], object] = {}
    if "train" in stages:
        resources = {"GPU": 1} if gpu_workers(client) else None
        previous = None
        for algo in cfg.algos:
            for seed in cfg.seeds:
                run_dir = str(root / "runs" / f"{algo}_seed{seed}")
                deps = (validated,) if previous is None or cfg.scheduler_address else (validated, previous)
                fut = submit(
                    tasks.train_agent, algo, seed, site, run_dir, cfg.total_timesteps, cfg.extra_algo_args, *deps,
                    resources=resources, retries=1, pure=False, key=f"train-{algo}-seed{seed}-{cfg.experiment}",
                )
                runs[(algo, seed)] = previous = fut
        futures["train"] = client.submit(list, list(runs.values()), pure=False)
    elif stages & {"evaluate", "report"}:
        if "evaluate" in stages:
            on_disk("train")
        runs = {(a, s): str(root / "runs" / f"{a}_seed{s}") for a in cfg.algos for s in cfg.seeds}

    if "evaluate" in stages:
        out = str(root / "eval")
        jobs = [
            submit(tasks.evaluate_agent, a, s, run_dir, site, split, out, retries=1, pure=False)
            for (a, s), run_dir in runs.items()
            for split in SPLITS
        ]
        futures["evaluate"] = client.submit(_flatten, jobs, pure=False)
        eval_files = futures["evaluate"]
    else:
        eval_files = on_disk("evaluate") if "report" in stages else None

    if "report" in stages:
        futures["report"] = submit(_report, cfg.as_dict(), baseline_files, eval_files, str(root), pure=False)

    results = client.gather(futures)
    return results


def _flatten(lists: list[list[str]]) -> list[str]:
    return [p for sub in lists for p in sub]


def _report(cfg_dict: dict, baseline_files: list[str], eval_files: list[str], root: str) -> str:
    files = [*baseline_files, *eval_files]
    kpis = [p for p in files if not p.endswith("_traces.parquet")]
    traces = {}
    for p in files:
        if p.endswith("_traces.parquet"):
            name = Path(p).name.removesuffix("_traces.parquet")
            stem, split = name.rsplit("_", 1)
            controller = stem.split("_seed")[0] if "_seed" in stem else stem
            traces[f"{controller}|{split}"] = p
    metrics = {}
    for algo in cfg_dict["algos"]:
        for seed in cfg_dict["seeds"]:
            m = Path(root) / "runs" / f"{algo}_seed{seed}" / "metrics.parquet"
            if m.is_file():
                metrics.setdefault(algo, str(m))
    return tasks.make_report(cfg_dict, kpis, traces, metrics, str(Path(root) / "report"))
