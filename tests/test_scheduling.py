"""Where the study's work runs: training placement on each kind of cluster, and the stage clock of a doit command."""

from __future__ import annotations

import time

import pytest

from pipeline.study import cluster, runstate


class FakeClient:
    """What :func:`pipeline.study.cluster.gpu_workers` reads of a ``distributed.Client``: the workers' resources."""

    def __init__(self, *resources: dict):
        self.resources = resources

    def scheduler_info(self, n_workers=-1):
        return {"workers": {f"tcp://w{i}": {"resources": r} for i, r in enumerate(self.resources)}}


def test_a_cluster_with_gpu_workers_gives_each_training_a_gpu():
    assert cluster.training_placement(FakeClient({"GPU": 1}, {})) == cluster.TrainingPlacement({"GPU": 1})


def test_a_cluster_without_gpu_workers_trains_side_by_side():
    assert cluster.training_placement(FakeClient({}, {})) == cluster.TrainingPlacement(None)


@pytest.mark.slow
def test_the_embedded_cluster_of_a_cuda_machine_holds_one_gpu_worker_beside_the_cpu_workers():
    """Its GPU worker takes the training tasks, one at a time, while the others run the rest."""
    from distributed import Client, Lock, get_worker

    with cluster.local_cluster(3, gpu_slots=1) as local, Client(local) as client:
        assert cluster.gpu_workers(client) == 1
        place = cluster.training_placement(client)
        assert place == cluster.TrainingPlacement({"GPU": 1})

        def busy(tag):
            lock = Lock("probe")  # held by at most one task at a time: two at once would have to wait
            got = lock.acquire(blocking=False)
            time.sleep(0.5)
            if got:
                lock.release()
            return tag, get_worker().name, got

        trained = client.gather([client.submit(busy, f"train{i}", pure=False, **place.options) for i in range(3)])
        others = client.gather([client.submit(busy, f"sim{i}", pure=False) for i in range(4)])  # after: no overlap
    assert {name for _, name, _ in trained} == {"gpu"}  # every training on the GPU worker
    assert all(got for *_, got in trained)  # never two at once there (each found the lock free)
    assert {name for _, name, _ in others} - {"gpu"}  # the rest also reach the CPU workers


@pytest.mark.slow
def test_gpu_slots_let_trainings_share_the_gpu_worker():
    from distributed import Client, get_worker

    def busy():
        t0 = time.monotonic()
        time.sleep(1.0)
        return get_worker().name, t0, time.monotonic()

    with cluster.local_cluster(2, gpu_slots=2) as local, Client(local) as client:
        options = cluster.training_placement(client).options
        runs = client.gather([client.submit(busy, pure=False, **options) for _ in range(2)])
    assert {name for name, *_ in runs} == {"gpu"}
    (_, a0, a1), (_, b0, b1) = runs
    assert a0 < b1 and b0 < a1  # the two trainings overlapped in time


def test_the_embedded_cluster_needs_a_worker_beside_the_gpu_one(monkeypatch):
    with pytest.raises(ValueError, match="at least 2 workers with a GPU"):
        cluster.local_cluster(1, gpu_slots=1)
    monkeypatch.setenv("EVHUB_GPU_SLOTS", "0")
    with pytest.raises(ValueError, match="EVHUB_GPU_SLOTS='0': gpu_slots must be a positive integer"):
        cluster.gpu_slots()
    monkeypatch.setenv("EVHUB_GPU_SLOTS", "4")
    assert cluster.gpu_slots() == 4
    monkeypatch.delenv("EVHUB_GPU_SLOTS")
    assert cluster.gpu_slots() == 1


def test_the_stage_clock_lists_the_tasks_in_the_order_they_started(monkeypatch):
    monkeypatch.setattr(runstate, "_CLOCK", [])
    slow = runstate.timed("train:ppo", lambda: time.sleep(0.05))
    quick = runstate.timed("baselines", lambda: "done")
    slow()
    assert quick() == "done"  # the action's result passes through
    with pytest.raises(ZeroDivisionError):
        runstate.timed("report", lambda: 1 / 0)()  # a failing task is on the clock too
    lines = runstate.stage_table().splitlines()
    assert [line.split()[0] for line in lines] == ["task", "train:ppo", "baselines", "report", "whole"]
    start, end, wall = map(float, lines[1].split()[1:])
    assert end >= start and wall == pytest.approx(end - start, abs=0.11)
    assert float(lines[-1].split()[-1]) >= end


def test_a_training_run_does_not_inherit_the_dask_workers_environment(tmp_path, monkeypatch):
    from conftest import make_site, write_site

    from pipeline.study import tasks

    script = tmp_path / "envcheck.py"
    script.write_text(
        "import os\nfor k in ('MALLOC_TRIM_THRESHOLD_', 'OMP_NUM_THREADS', 'EVHUB_MARK'):\n"
        "    print(k, os.environ.get(k))\n"
    )
    monkeypatch.setattr(tasks, "algo_script", lambda algo: script)
    for k, v in {"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "EVHUB_MARK": "kept"}.items():
        monkeypatch.setenv(k, v)  # what a Dask nanny sets for its worker, and a variable of the user's
    site_toml = write_site(make_site(days=14), tmp_path / "site")
    run = tasks.train_agent("envcheck", 1, str(site_toml), str(tmp_path / "run"))
    log = (tmp_path / "run" / "train.log").read_text()
    assert run == str(tmp_path / "run")
    assert "MALLOC_TRIM_THRESHOLD_ None" in log and "OMP_NUM_THREADS None" in log and "EVHUB_MARK kept" in log, log
