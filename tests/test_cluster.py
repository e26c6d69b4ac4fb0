"""The pipeline against a real, separately started Dask cluster: one scheduler and two workers on 127.0.0.1.

The workers only *declare* ``--resources GPU=1`` (they are CPU processes); training tasks ask for
``GPU=1``, so the tests also show that the resource annotation matches what a GPU worker offers. One test
trains two agents x two seeds; the other kills the worker process that is training, mid-run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import (
    assert_resumed_once_to_the_end,
    machinery_site,
    tiny_pipeline_env,
    training_process,
    wait_for_checkpoint,
)

ROOT = Path(__file__).resolve().parent.parent


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )


def _scheduler_address(scheduler_file: Path, log: Path, timeout_s: float = 60) -> str:
    """The address in the scheduler's file, once it is whole: the scheduler writes it in place, so an early read can
    find it empty or half written."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            return json.loads(scheduler_file.read_text())["address"]
        time.sleep(0.2)
    raise AssertionError(f"no address in {scheduler_file} after {timeout_s} s:\n{log.read_text()}")


@contextlib.contextmanager
def cluster(tmp_path: Path):
    """Start ``dask scheduler`` and two ``dask worker --resources GPU=1`` on 127.0.0.1; yield the address."""
    scheduler_file = tmp_path / "scheduler.json"
    procs = [
        _start(
            [
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(scheduler_file),
            ],
            tmp_path / "scheduler.log",
        )
    ]
    try:
        address = _scheduler_address(scheduler_file, tmp_path / "scheduler.log")
        for i in range(2):
            procs.append(
                _start(
                    [
                        "distributed.cli.dask_worker",
                        address,
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--resources",
                        "GPU=1",
                        "--name",
                        f"gpu-worker-{i}",
                    ],
                    tmp_path / f"worker{i}.log",
                )
            )
        from distributed import Client

        with Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=60)
            resources = {w["name"]: w["resources"] for w in client.scheduler_info()["workers"].values()}
        assert resources == {"gpu-worker-0": {"GPU": 1.0}, "gpu-worker-1": {"GPU": 1.0}}
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.slow
def test_pipeline_on_an_existing_cluster_with_gpu_resources(tmp_path):
    with cluster(tmp_path) as address:
        site_toml = machinery_site(tmp_path / "site")
        out = tmp_path / "outputs"
        env = {
            **os.environ,
            "EVHUB_SITE": str(site_toml),
            "EVHUB_OUTPUT_DIR": str(out),
            "EVHUB_ALGOS": "ppo,a2c",
            "EVHUB_SEEDS": "1,2",
            "EVHUB_TOTAL_TIMESTEPS": "4096",
            "DASK_SCHEDULER_ADDRESS": address,
        }
        # doit runs two tasks at once (train:ppo and train:a2c, two seeds each); the four training runs share
        # the two GPU workers
        cmd = [
            sys.executable,
            "-m",
            "doit",
            "run",
            "-n",
            "2",
            "-P",
            "thread",
            "--db-file",
            str(tmp_path / "doit.db"),
            "pipeline",
        ]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        table = pd.read_parquet(out / "synthetic" / "report" / "co2_comparison.parquet")
        assert {"uncontrolled", "rule_based", "oracle", "ppo", "a2c"} <= set(table.controller)
        agents = table[table.controller.isin(["ppo", "a2c"])]
        assert (agents.n_seeds == 2).all() and agents.co2_kg_std.notna().all()  # mean and spread over 2 seeds
        assert "± " in (out / "synthetic" / "report" / "report.md").read_text()
        for algo in ("ppo", "a2c"):
            for seed in (1, 2):
                assert (out / "synthetic" / "runs" / f"{algo}_seed{seed}" / "policy.pt2").is_file()
        # the training ran in the cluster's worker processes (their output is in the workers' logs), every
        # agent x seed exactly once, and both GPU workers trained
        logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(2)]
        runs = [(a, sd) for a in ("ppo", "a2c") for sd in (1, 2)]
        where = {r: [i for i, log in enumerate(logs) if f"[{r[0]} seed {r[1]}] training:" in log] for r in runs}
        assert all(len(w) == 1 for w in where.values()), where
        assert {w[0] for w in where.values()} == {0, 1}, where


@pytest.mark.slow
def test_a_worker_killed_mid_training_is_rescheduled_and_the_run_resumes(tmp_path):
    total = 4 * 48 * 50  # PPO: 50 iterations of 4 envs x 48 steps, a checkpoint every 2
    with cluster(tmp_path) as address:
        out = tmp_path / "outputs"
        env = tiny_pipeline_env(machinery_site(tmp_path / "site"), out, total, scheduler=address)
        cmd = [sys.executable, "-m", "doit", "run", "--db-file", str(tmp_path / "doit.db"), "pipeline"]
        doit_log = tmp_path / "doit.log"
        pipeline = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(doit_log, "w"), stderr=subprocess.STDOUT)
        run_dir = out / "synthetic" / "runs" / "ppo_seed1"
        ckpt = run_dir / "checkpoint.pt"
        try:
            wait_for_checkpoint(ckpt, pipeline, 4, doit_log)
            trainer = training_process(run_dir)
            worker = trainer.parent()  # the Dask worker process running the training task
            assert "python" in worker.name(), worker.cmdline()
            worker.send_signal(signal.SIGKILL)
            trainer.wait(timeout=30)  # the training run dies with its worker: no orphan keeps writing the run folder
            killed_at = torch.load(ckpt, weights_only=False)["global_step"]
            assert 0 < killed_at < total
            assert pipeline.wait(timeout=400) == 0, doit_log.read_text()[-3000:]
        finally:
            if pipeline.poll() is None:
                pipeline.kill()

        # the scheduler rescheduled the training task; the second attempt resumed from the last checkpoint
        assert_resumed_once_to_the_end(run_dir, killed_at, total)
        table = pd.read_parquet(out / "synthetic" / "report" / "co2_comparison.parquet")
        assert {"uncontrolled", "rule_based", "oracle", "ppo"} <= set(table.controller)
        ppo = table[table.controller == "ppo"]
        assert len(ppo) == 2 and ppo.co2_kg.notna().all()  # evaluated on both splits
