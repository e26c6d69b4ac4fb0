"""Faults caused for real: a training run killed with SIGKILL resumes from its last checkpoint (every algorithm),
DQN's replay buffer survives the checkpoint round trip exactly, a pipeline killed mid-training resumes the run
when started again, and a process killed while writing a Parquet file never leaves a truncated one.

A Dask worker killed mid-training is in ``tests/test_cluster.py``; a non-finite loss in each ``tests/test_<algo>.py``.
"""

from __future__ import annotations

import math
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
    load_algo,
    make_site,
    run_algo,
    tiny_ppo_pipeline_env,
    training_process,
    wait_for_checkpoint,
    write_site,
)

from envs.files import atomic_write, write_parquet


@dataclass(frozen=True)
class KillCase:
    """One algorithm's tiny SIGKILL-then-resume run.

    ``args`` are the tiny settings (site, output folder and budget are added by the test); ``total`` env steps is
    long enough for the run to be killed once its checkpoint reaches ``kill_after`` iterations with seconds of
    training still ahead. For the replay-buffer algorithms, ``buffer_rows`` names the key of the checkpoint's
    ``replay_buffer`` that counts its filled rows, ``resume_buffer`` is the resume message's report of them
    (formatted with the row count) and ``loss`` is a loss column of ``metrics.parquet`` that is finite in a row only
    if this session made updates before it.
    """

    args: list[str]
    total: int
    kill_after: int
    buffer_rows: str | None = None
    resume_buffer: str = ""
    loss: str = ""


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
        total=4 * 48 * 120,  # 120 iterations: long enough to be killed in the middle
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
            "--save-buffer",
        ],
        total=4 * 750,
        kill_after=64,
        buffer_rows="size",
        resume_buffer="buffer {:,} rows",
        loss="qf_loss",
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
            "--save-buffer",
        ],
        total=8 * 750,
        kill_after=48,
        buffer_rows="count",
        resume_buffer="buffer {:,} rows restored",
        loss="td_loss",
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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sigkilled_run_resumes_to_the_full_step_count(name, site_toml, tmp_path):
    case = CASES[name]
    out = tmp_path / name
    args = [
        "--site",
        str(site_toml),
        "--output-dir",
        str(out),
        "--no-cuda",
        "--eval-split",
        "none",
        *case.args,
        "--total-timesteps",
        str(case.total),
    ]
    ckpt = out / "checkpoint.pt"
    killed = start_and_sigkill(name, args, ckpt, case.kill_after)
    killed_at = killed["global_step"]
    assert 0 < killed_at < case.total
    assert killed["iteration"] >= case.kill_after
    assert not (out / "policy.pt2").exists()
    if case.buffer_rows:
        rows = killed["replay_buffer"][case.buffer_rows]
        assert rows == 200 and killed["replay_buffer"]["obs"].shape[0] == rows  # full, wrapped around, stored

    resumed = run_algo(name, *args, "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at global_step {killed_at}" in resumed.stdout
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == case.total
    assert metrics.global_step.is_monotonic_increasing and metrics.global_step.is_unique
    final = torch.load(ckpt, weights_only=False)
    assert final["global_step"] == case.total
    assert (out / "policy.pt2").is_file()
    if case.buffer_rows:
        assert case.resume_buffer.format(rows) in resumed.stdout, resumed.stdout[-3000:]
        # with its buffer back the resumed run updates at once: the first log row after the resume has a loss,
        # which a run refilling learning_starts (64) steps first would not have by then (32 steps on)
        first = metrics[metrics.global_step > killed_at].iloc[0]
        assert first.global_step - killed_at < 64 and math.isfinite(first[case.loss]), metrics.head(20)
        assert final["replay_buffer"][case.buffer_rows] == 200


# ---------------------------------------------------------------------------------------------- DQN replay buffer
def filled_dqn_buffer(dqn, size: int, batches: int, obs_dim: int = 3, n: int = 4, seed: int = 0) -> dict:
    """A DQN replay buffer of ``size`` rows after ``batches`` writes of ``n`` random transitions."""
    g = torch.Generator().manual_seed(seed)
    rb = dqn.make_replay_buffer(size, obs_dim, torch.device("cpu"))
    for _ in range(batches):
        dqn.buffer_add(
            rb,
            torch.randn(n, obs_dim, generator=g),
            torch.randint(0, 15, (n,), generator=g),
            torch.randn(n, generator=g),
            torch.randn(n, obs_dim, generator=g),
            (torch.rand(n, generator=g) < 0.2).float(),
        )
    return rb


@pytest.mark.parametrize("batches", [2, 4, 5])  # 8 of 10 rows filled; full at pos 6; full at pos 0
def test_dqn_checkpointed_replay_buffer_restores_identically(batches, tmp_path):
    dqn = load_algo("dqn")
    assert dqn.Args().save_buffer is False  # opt-in: the buffer makes checkpoints large
    saved = filled_dqn_buffer(dqn, 10, batches)
    path = tmp_path / "checkpoint.pt"
    atomic_write(path, lambda tmp: torch.save({"replay_buffer": dqn.buffer_state(saved)}, tmp))
    state = torch.load(path, weights_only=False)["replay_buffer"]
    count = min(4 * batches, 10)
    assert (state["pos"], state["count"], state["size"]) == (4 * batches % 10, count, 10)
    for key in dqn.BUFFER_FIELDS:  # only the filled rows are written, not the whole preallocated tensor
        assert state[key].shape[0] == count
        assert state[key].untyped_storage().nbytes() == state[key].numel() * state[key].element_size()

    restored = dqn.make_replay_buffer(10, 3, torch.device("cpu"))
    dqn.load_buffer_state(restored, state)
    assert (restored["pos"], restored["count"], restored["size"]) == (saved["pos"], saved["count"], saved["size"])
    assert restored["count_t"].item() == saved["count_t"].item() == count
    for key in dqn.BUFFER_FIELDS:
        assert restored[key].dtype == saved[key].dtype
        assert torch.equal(restored[key], saved[key]), key  # every row, the unfilled zeros included
    # the same writes and the same random numbers then give the same samples
    more = filled_dqn_buffer(dqn, 10, 1, seed=1)
    for rb in (saved, restored):
        dqn.buffer_add(
            rb, more["obs"][:4], more["actions"][:4], more["rewards"][:4], more["next_obs"][:4], more["dones"][:4]
        )
    torch.manual_seed(3)
    a = dqn.buffer_sample(saved, 16)
    torch.manual_seed(3)
    b = dqn.buffer_sample(restored, 16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_dqn_stored_buffer_into_another_size_keeps_the_newest_transitions():
    dqn = load_algo("dqn")
    saved = filled_dqn_buffer(dqn, 10, 4)  # 16 writes into 10 rows: the newest 10 start at pos 6
    state = dqn.buffer_state(saved)
    oldest_first = torch.cat([saved["rewards"][6:], saved["rewards"][:6]])

    small = dqn.make_replay_buffer(6, 3, torch.device("cpu"))
    dqn.load_buffer_state(small, state)
    assert (small["pos"], small["count"], small["count_t"].item()) == (0, 6, 6)
    assert torch.equal(small["rewards"], oldest_first[-6:])

    big = dqn.make_replay_buffer(16, 3, torch.device("cpu"))
    dqn.load_buffer_state(big, state)
    assert (big["pos"], big["count"]) == (10, 10)
    assert torch.equal(big["rewards"][:10], oldest_first) and not big["rewards"][10:].any()

    with pytest.raises(ValueError, match="obs"):
        dqn.load_buffer_state(dqn.make_replay_buffer(10, 5, torch.device("cpu")), state)


@pytest.mark.slow
def test_a_pipeline_killed_mid_training_resumes_the_run_when_started_again(tmp_path):
    total = 4 * 48 * 100  # PPO: 100 iterations, a checkpoint every 2
    out = tmp_path / "outputs"
    env = tiny_ppo_pipeline_env(write_site(make_site(days=7), tmp_path / "site"), out, total)
    cmd = [sys.executable, "-m", "doit", "run", "--db-file", str(tmp_path / "doit.db"), "pipeline"]
    run_dir = out / "synthetic" / "runs" / "ppo_seed1"
    ckpt = run_dir / "checkpoint.pt"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / "first.log", "w"), stderr=subprocess.STDOUT)
    wait_for_checkpoint(ckpt, first, 4, tmp_path / "first.log")
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
    assert (out / "synthetic" / "report" / "co2_comparison.parquet").is_file()


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
