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


@pytest.mark.parametrize("cuda", [False, True])
def test_a_cluster_with_gpu_workers_gives_each_training_a_gpu(monkeypatch, cuda):
    monkeypatch.setattr(cluster, "local_cuda", lambda: cuda)
    place = cluster.training_placement(FakeClient({"GPU": 1}, {}), "tcp://scheduler:8786")
    assert place == cluster.TrainingPlacement({"GPU": 1}, one_at_a_time=False)


def test_a_cpu_only_machine_trains_side_by_side_and_runs_the_stages_at_once(monkeypatch):
    monkeypatch.setattr(cluster, "local_cuda", lambda: False)
    assert cluster.training_placement(FakeClient({}, {}), None) == cluster.TrainingPlacement(None, False)
    assert cluster.stages_side_by_side(None)


def test_the_embedded_cluster_of_a_cuda_machine_trains_one_after_another(monkeypatch):
    monkeypatch.setattr(cluster, "local_cuda", lambda: True)
    assert cluster.training_placement(FakeClient({}, {}), None) == cluster.TrainingPlacement(None, True)
    assert not cluster.stages_side_by_side(None)
    # a user's cluster places the work itself, whatever this machine has
    assert cluster.training_placement(FakeClient({}), "tcp://scheduler:8786").one_at_a_time is False
    assert cluster.stages_side_by_side("tcp://scheduler:8786")


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
