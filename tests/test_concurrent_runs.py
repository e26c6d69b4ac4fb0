"""Runs side by side: each experiment keeps its own doit state and lock (``pipeline.study.runstate``).

Two experiments run at once to completion, a second run of one of them is refused at once (naming the folder and
the holder's pid), a SIGKILLed run leaves no stale lock, and a damaged state database stops doit with a message
naming the file and the way out, never a traceback. The pipeline runs here pass no ``--db-file``: they use the
state database ``dodo.py`` puts in each experiment folder.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import ROOT, machinery_site, tiny_pipeline_env

from pipeline.study.runstate import LOCK_FILE, STATE_FILE, DamagedState, ExperimentBusy, ExperimentLock, check_state

DOIT = [sys.executable, "-m", "doit"]
TOTAL = 4 * 48 * 4  # 4 PPO iterations of TINY_PPO_ARGS


def _env(site_toml, out, experiment: str) -> dict:
    return {**tiny_pipeline_env(site_toml, out, TOTAL), "EVHUB_EXPERIMENT": experiment, "OMP_NUM_THREADS": "1"}


def _wait_for_holder(folder, proc, timeout: float = 120) -> dict:
    """The lock file of ``folder`` once it names ``proc`` (which must still run)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            holder = json.loads((folder / LOCK_FILE).read_text())
            if holder.get("pid") == proc.pid:
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{folder / LOCK_FILE} never named pid {proc.pid} (exit code {proc.poll()})")


@pytest.mark.slow
def test_two_experiments_run_side_by_side_and_a_second_run_of_one_is_refused(tmp_path):
    out = tmp_path / "outputs"
    sites = {n: machinery_site(tmp_path / f"site_{n}", seed=seed) for n, seed in (("a", 0), ("b", 1))}
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in sites}
    runs = {
        name: subprocess.Popen(
            [*DOIT, "run", "pipeline"],
            cwd=ROOT,
            env=_env(site, out, name),
            stdout=logs[name],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for name, site in sites.items()
    }
    try:
        _wait_for_holder(out / "a", runs["a"])
        started = time.time()
        second = subprocess.run(
            [*DOIT, "run", "pipeline"],
            cwd=ROOT,
            env=_env(sites["a"], out, "a"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        refused_in = time.time() - started
        for run in runs.values():
            run.wait(timeout=480)
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
        for log in logs.values():
            log.close()

    # the second run of experiment a stopped at once, before any task, naming the folder and the first run's pid
    message = second.stdout + second.stderr
    assert second.returncode == 3, message[-3000:]
    assert f"experiment folder {out / 'a'} is in use by process {runs['a'].pid}" in message, message[-3000:]
    assert f"kill {runs['a'].pid}" in message and "Traceback" not in message, message[-3000:]
    assert ".  validate" not in second.stdout and refused_in < 60, (refused_in, message[-3000:])

    # both experiments ran to completion, each with its own state; no lock is left behind
    for name, run in runs.items():
        log = (tmp_path / f"{name}.log").read_text()
        assert run.returncode == 0, log[-4000:]
        assert (out / name / "report" / "co2_comparison.parquet").is_file()
        assert (out / name / STATE_FILE).is_file() and not (out / name / LOCK_FILE).exists()
        check_state(out / name / STATE_FILE)
    with sqlite3.connect(out / "a" / STATE_FILE) as db:
        assert "train:ppo" in {row[0] for row in db.execute("select task_id from doit")}

    # the state of experiment a is its own: a new run of it finds every task up to date
    again = subprocess.run(
        [*DOIT, "run", "pipeline"],
        cwd=ROOT,
        env=_env(sites["a"], out, "a"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for task in ("validate", "baselines", "train:ppo", "evaluate:ppo", "report"):
        assert f"-- {task}" in again.stdout, again.stdout


@pytest.mark.slow
def test_a_sigkilled_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "outputs"
    env = _env(machinery_site(tmp_path / "site"), out, "k")
    first = subprocess.Popen(
        [*DOIT, "run", "pipeline"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for_holder(out / "k", first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # doit and whatever it started
        first.wait(timeout=60)
    assert json.loads((out / "k" / LOCK_FILE).read_text())["pid"] == first.pid  # the crashed holder's file is left

    # the next command that needs the lock takes it (doit forget: writes the state, runs no task)
    after = subprocess.run([*DOIT, "forget", "--all"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
    assert not (out / "k" / LOCK_FILE).exists()


def _garbage(path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(3000))


def _bad_record(path) -> None:
    """A valid sqlite database whose task record is two JSON documents (what a torn write leaves)."""
    with sqlite3.connect(path) as db:
        db.execute("create table doit (task_id text not null primary key, task_data json)")
        db.execute("insert into doit values (?, ?)", ("validate", '{"_values_:": {}}{"_values_:"'))


def _truncated(path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("create table doit (task_id text not null primary key, task_data json)")
        db.executemany("insert into doit values (?, ?)", [(f"t{i}", json.dumps({"x": "y" * 2000})) for i in range(40)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [_garbage, _bad_record, _truncated], ids=["garbage", "bad-record", "truncated"])
def test_a_damaged_state_database_stops_doit_with_the_way_out(tmp_path, damage):
    out = tmp_path / "outputs"
    env = _env(machinery_site(tmp_path / "site"), out, "d")
    state = out / "d" / STATE_FILE
    state.parent.mkdir(parents=True)
    damage(state)
    with pytest.raises(DamagedState, match="delete it"):
        check_state(state)

    for args in (["run", "pipeline"], ["list", "--status"])[: 2 if damage is _garbage else 1]:
        result = subprocess.run([*DOIT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        message = result.stdout + result.stderr
        assert result.returncode == 3, message[-3000:]
        assert f"doit's state database {state} is damaged" in message and f"rm {state}" in message, message[-3000:]
        assert "Traceback" not in message and ".  validate" not in result.stdout, message[-3000:]
    assert not (out / "d" / LOCK_FILE).exists()


def test_the_lock_is_exclusive_and_names_its_holder(tmp_path):
    first = ExperimentLock(tmp_path / "exp", describe="doit run pipeline site=x")
    try:
        with pytest.raises(ExperimentBusy) as busy:
            ExperimentLock(tmp_path / "exp")
        holder = f"process {os.getpid()} (doit run pipeline site=x)"
        assert f"experiment folder {tmp_path / 'exp'} is in use by {holder}" in str(busy.value)
    finally:
        first.release()
    assert not (tmp_path / "exp" / LOCK_FILE).exists()
    ExperimentLock(tmp_path / "exp").release()  # free again


def test_a_damaged_dbm_state_is_reported_too(tmp_path):
    import dbm

    path = tmp_path / "doit.db"
    with dbm.open(str(path), "c") as db:
        db[b"validate"] = b'{"a": 1}{"b"'
    with pytest.raises(DamagedState, match=r"Extra data.*rm .*doit\.db\*"):
        check_state(path, "dbm")
    check_state(tmp_path / "missing.db", "dbm")
    check_state(tmp_path / "missing.sqlite3")
