"""Faults caused for real: a training run killed with SIGKILL resumes from its last checkpoint to the uninterrupted
run's networks, training curve and exported policy, bit for bit (every algorithm; the replay buffers rebuilt from
their logs; the uninterrupted run, another process with PyTorch's deterministic algorithms on, is also the test that
the same seed gives the same run), a pipeline killed
mid-training resumes the run when started again, and a process killed while writing a Parquet file never leaves a
truncated one. The replay buffer and its log alone are in ``tests/test_harness.py``.

A Dask worker killed mid-training is in ``tests/test_cluster.py``; a non-finite loss in each ``tests/test_<algo>.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import (
    ROOT,
    assert_resumed_once_to_the_end,
    machinery_site,
    run_algo,
    tiny_pipeline_env,
    training_process,
    wait_for_checkpoint,
)

from envs.files import atomic_write, write_parquet


@dataclass(frozen=True)
class KillCase:
    """One algorithm's tiny SIGKILL-then-resume run.

    ``args`` are the tiny settings (site, output folder and budget are added by the test); ``total`` env steps is
    long enough for the run to be killed once its checkpoint reaches ``kill_after`` iterations with seconds of
    training still ahead. ``replay`` marks the replay-buffer algorithms, whose buffer (200 rows) has wrapped around
    and whose learning has started by the kill.
    """

    args: list[str]
    total: int
    kill_after: int
    replay: bool = False


CASES = {
    "ppo": KillCase(
        [
            "--num-envs",
            "4",
            "--num-steps",
            "48",
            "--num-minibatches",
            "2",
            "--update-epochs",
            "2",
            "--hidden-size",
            "16",
            "--checkpoint-every",
            "2",
        ],
        total=4 * 48 * 40,  # 40 iterations (about 10 s): killed after 6, with most of the run still ahead
        kill_after=6,
    ),
    "a2c": KillCase(
        ["--num-envs", "4", "--num-steps", "8", "--hidden-size", "16", "--log-every", "2", "--checkpoint-every", "2"],
        total=4 * 8 * 300,
        kill_after=6,
    ),
    "sac": KillCase(
        # the buffer (200 rows) has wrapped around and learning has started (step 64) by the kill (iteration 64+)
        [
            "--num-envs",
            "4",
            "--hidden-size",
            "16",
            "--batch-size",
            "32",
            "--buffer-size",
            "200",
            "--learning-starts",
            "64",
            "--gradient-steps",
            "2",
            "--log-every",
            "8",
            "--checkpoint-every",
            "16",
        ],
        total=4 * 750,
        kill_after=64,
        replay=True,
    ),
    "dqn": KillCase(
        # 8 env steps per iteration: the buffer (200 rows) has wrapped around and learning has started by the kill
        [
            "--num-envs",
            "4",
            "--num-steps",
            "2",
            "--gradient-steps",
            "2",
            "--batch-size",
            "32",
            "--buffer-size",
            "200",
            "--learning-starts",
            "64",
            "--target-network-frequency",
            "40",
            "--hidden-size",
            "16",
            "--log-every",
            "4",
            "--checkpoint-every",
            "16",
        ],
        total=8 * 750,
        kill_after=48,
        replay=True,
    ),
}


def start_and_sigkill(name: str, args: list[str], ckpt, kill_after: int, timeout: float = 120) -> dict:
    """Start ``algos/<name>.py *args`` in a subprocess, SIGKILL it once ``ckpt`` holds iteration ``kill_after`` or
    later, and return the checkpoint left behind (loaded after the kill, so it is the last one written)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "algos" / f"{name}.py"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if ckpt.is_file() and torch.load(ckpt, weights_only=False)["iteration"] >= kill_after:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # a failed assertion above: do not leave the run behind
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return torch.load(ckpt, weights_only=False)  # the checkpoint file is whole (atomic write)


def final_state(out) -> dict:
    """The last checkpoint's networks: ``{name: state_dict}`` of every ``nn.Module`` entry."""
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    return {k: v for k, v in ckpt.items() if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values())}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sigkilled_run_resumes_to_the_uninterrupted_run(name, site_toml, tmp_path):
    case = CASES[name]
    runs = {}
    for kind in ("killed", "uninterrupted"):
        runs[kind] = [
            "--site",
            str(site_toml),
            "--output-dir",
            str(tmp_path / kind),
            "--no-cuda",
            "--eval-split",
            "none",
            *case.args,
            "--total-timesteps",
            str(case.total),
        ]
    # the uninterrupted run also switches PyTorch to its deterministic algorithms: on the CPU that changes nothing
    runs["uninterrupted"].append("--deterministic-algorithms")
    out = tmp_path / "killed"
    ckpt = out / "checkpoint.pt"
    killed = start_and_sigkill(name, runs["killed"], ckpt, case.kill_after)
    killed_at = killed["global_step"]
    assert 0 < killed_at < case.total
    assert killed["iteration"] >= case.kill_after
    assert not (out / "policy.pt2").exists()
    if case.replay:  # the buffer is not stored, its replay log is: the actions since a snapshot of the env
        log = killed["replay_buffer"]["log"]
        assert "rows" not in killed["replay_buffer"] and log["size"] == 200
        assert (
            log["snapshots"][0].step <= killed_at - 200
            and log["actions"].shape[0] == killed_at - log["snapshots"][0].step
        )

    resumed = run_algo(name, *runs["killed"], "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at global_step {killed_at}" in resumed.stdout
    if case.replay:
        assert "replay buffer 200 rows rebuilt by replaying" in resumed.stdout, resumed.stdout[-3000:]
        assert "(the same as the interrupted run's)" in resumed.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == case.total
    assert metrics.global_step.is_monotonic_increasing and metrics.global_step.is_unique
    assert torch.load(ckpt, weights_only=False)["global_step"] == case.total
    assert (out / "policy.pt2").is_file()
    resumes = json.loads((out / "resumes.json").read_text())
    assert [(r["from_global_step"], r["exact"]) for r in resumes] == [(killed_at, True)]

    # the same run uninterrupted, in another process, ends with the same networks and exported policy, bit for bit,
    # and logs the same losses and episodes
    whole = run_algo(name, *runs["uninterrupted"], timeout=300)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert not (tmp_path / "uninterrupted" / "resumes.json").exists()
    a, b = final_state(out), final_state(tmp_path / "uninterrupted")
    assert a.keys() == b.keys() and a
    for net in a:
        for key in a[net]:
            assert torch.equal(a[net][key], b[net][key]), (net, key)
    policies = [torch.export.load(str(d / "policy.pt2")).state_dict for d in (out, tmp_path / "uninterrupted")]
    assert policies[0].keys() == policies[1].keys() and policies[0]
    for key, weights in policies[0].items():
        assert torch.equal(weights, policies[1][key]), key
    clocks = [c for c in metrics.columns if c in ("wall_s", "sps") or c.startswith("gpu_")]
    reference = pd.read_parquet(tmp_path / "uninterrupted" / "metrics.parquet")
    pd.testing.assert_frame_equal(metrics.drop(columns=clocks), reference.drop(columns=clocks))


@pytest.mark.slow
def test_a_pipeline_killed_mid_training_resumes_to_the_rows_of_an_uninterrupted_one(tmp_path):
    """DQN (a replay buffer, 200 rows, wrapped by the kill), killed with doit and its cluster after a checkpoint,
    then the same command again: every row of the report equals an uninterrupted pipeline's."""
    total = 8 * 750  # DQN: 750 iterations of 8 env steps, a checkpoint every 16
    dqn_args = " ".join(CASES["dqn"].args) + " --no-cuda"
    site = machinery_site(tmp_path / "site")
    out, whole = tmp_path / "outputs", tmp_path / "uninterrupted"
    env = tiny_pipeline_env(site, out, total, algo="dqn", algo_args=dqn_args)
    cmd = [sys.executable, "-m", "doit", "run", "--db-file", str(tmp_path / "doit.db"), "pipeline"]
    run_dir = out / "synthetic" / "runs" / "dqn_seed1"
    ckpt = run_dir / "checkpoint.pt"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / "first.log", "w"), stderr=subprocess.STDOUT)
    wait_for_checkpoint(ckpt, first, 48, tmp_path / "first.log")
    trainer = training_process(run_dir)
    first.send_signal(signal.SIGKILL)  # doit, its embedded Dask cluster and the training run all die
    first.wait(timeout=60)
    trainer.wait(timeout=60)
    killed_at = torch.load(ckpt, weights_only=False)["global_step"]
    assert 0 < killed_at < total
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    # the same run (same fingerprint) with a checkpoint: the second attempt passed --resume and went on from it
    assert_resumed_once_to_the_end(run_dir, killed_at, total)
    assert "replay buffer 200 rows rebuilt" in (run_dir / "train.log").read_text()
    spec = json.loads((run_dir / "run.json").read_text())
    assert [(r["from_global_step"], r["exact"]) for r in spec["resumed"]] == [(killed_at, True)]
    report = (out / "synthetic" / "report" / "report.md").read_text()
    assert f"dqn seed 1 from global step {killed_at:,} (every state restored)" in report

    uninterrupted = subprocess.run(
        [*cmd[:4], "--db-file", str(tmp_path / "whole.db"), "pipeline"],
        cwd=ROOT,
        env={**env, "EVHUB_OUTPUT_DIR": str(whole)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-3000:] + uninterrupted.stderr[-3000:]
    rows = {}
    for name, root in (("resumed", out), ("uninterrupted", whole)):
        table = pd.read_parquet(root / "synthetic" / "report" / "co2_comparison.parquet")
        rows[name] = table.drop(columns=[c for c in table.columns if c.startswith(("train_wall_s", "steps_per_s"))])
    assert "dqn" in set(rows["resumed"].controller)
    pd.testing.assert_frame_equal(rows["resumed"], rows["uninterrupted"])


ROWS = 300_000

WRITER = f"""
import sys
import numpy as np, pandas as pd
from envs.files import write_parquet

version = 0
while True:
    version += 1
    x = np.random.default_rng(version).random({ROWS})
    write_parquet(pd.DataFrame({{"version": np.full({ROWS}, version), "x": x}}), sys.argv[1])
    print(version, flush=True)
"""


def _check_whole(path) -> int:
    """Read the file back completely and check it is exactly one version the writer wrote; returns it."""
    df = pd.read_parquet(path)
    assert len(df) == ROWS
    version = int(df.version.iloc[0])
    assert (df.version == version).all()
    np.testing.assert_array_equal(df.x.to_numpy(), np.random.default_rng(version).random(ROWS))
    return version


@pytest.mark.slow
def test_a_kill_while_writing_parquet_leaves_the_previous_file_or_none(tmp_path):
    path = tmp_path / "kpis.parquet"
    rng = np.random.default_rng(0)
    leftovers = 0
    for trial in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if trial == 0:
            time.sleep(0.3)  # killed before its first write finished (interpreter still importing or writing)
        else:
            proc.stdout.readline()  # one version written; kill during a later one, at a random point
            time.sleep(float(rng.uniform(0.0, 0.2)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if path.exists():
            _check_whole(path)
        else:
            assert trial == 0, "a previous version existed and must still be there"
        temporary = [p for p in tmp_path.iterdir() if p != path]
        # a kill can leave a hidden temporary file beside the target, never a file under the target's name;
        # the next writer's first completed write deletes the ones left by earlier kills
        assert all(p.name.startswith(".kpis.parquet.") and p.suffix == ".tmp" for p in temporary), temporary
        assert len(temporary) <= 1, temporary  # at most the one of this kill
        leftovers += len(temporary)
    assert path.exists()
    assert leftovers > 0, "no kill landed in the middle of a write: the test did not exercise the window"
    write_parquet(pd.read_parquet(path), path)  # a completed write sweeps what the dead writers left
    assert [p.name for p in tmp_path.iterdir()] == ["kpis.parquet"]


def test_only_temporaries_of_dead_writers_on_this_machine_are_swept(tmp_path):
    from envs import files

    path = tmp_path / "kpis.parquet"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    other_host = "0" * 8 if files._HOST != "0" * 8 else "1" * 8
    names = {
        "dead": f".kpis.parquet.p{dead_pid}h{files._HOST}.abc.tmp",
        "alive": f".kpis.parquet.p{os.getppid()}h{files._HOST}.abc.tmp",  # the test runner's parent: running
        "elsewhere": f".kpis.parquet.p{dead_pid}h{other_host}.abc.tmp",  # another machine's writer
        "other_file": f".metrics.parquet.p{dead_pid}h{files._HOST}.abc.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"PAR1")
    write_parquet(pd.DataFrame({"co2_kg": [1.0]}), path)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"kpis.parquet", names["alive"], names["elsewhere"], names["other_file"]}


def test_a_failing_writer_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "kpis.parquet"
    previous = pd.DataFrame({"co2_kg": [1.0, 2.0]})
    write_parquet(previous, path)

    def half_then_fail(tmp):
        tmp.write_bytes(b"PAR1 only the first bytes")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    pd.testing.assert_frame_equal(pd.read_parquet(path), previous)
    assert [p.name for p in tmp_path.iterdir()] == ["kpis.parquet"]


def test_the_reports_note_names_every_resumed_run_and_what_was_not_restored(tmp_path):
    from pipeline.study.tasks import resumed_note

    runs = {name: tmp_path / name for name in ("dqn seed 1", "sac seed 2", "mpc_rl's policy, seed 1", "ppo seed 1")}
    for run in runs.values():
        run.mkdir()
    resumed = {
        "dqn seed 1": [{"from_global_step": 256000, "exact": True, "replay_buffer": "rebuilt"}],
        "sac seed 2": [{"from_global_step": 64000, "exact": False, "replay_buffer": "replay buffer not stored"}],
        "mpc_rl's policy, seed 1": [{"from_global_step": 1200, "exact": True}],
    }
    for name, entries in resumed.items():
        (runs[name] / "run.json").write_text(json.dumps({"fingerprint": "x", "resumed": entries}))
    (runs["ppo seed 1"] / "run.json").write_text(json.dumps({"fingerprint": "x"}))  # never interrupted
    note = resumed_note(runs)
    assert "dqn seed 1 from global step 256,000 (every state restored)" in note
    assert "sac seed 2 from global step 64,000 (not exactly: replay buffer not stored)" in note
    assert "mpc_rl's policy, seed 1 from global step 1,200 (every state restored)" in note
    assert "ppo" not in note
    assert resumed_note({"ppo seed 1": runs["ppo seed 1"], "a2c seed 1": tmp_path / "missing"}) is None
