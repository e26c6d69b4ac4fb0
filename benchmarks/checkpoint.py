"""What a checkpoint of DQN and SAC costs, their replay buffers stored as rows (``--save-buffer``) against their
replay log (the default, :class:`algos.harness.ReplayLog`), side by side at each script's CPU and GPU presets.

For each (algorithm, preset) the buffer of the preset's ``buffer_size`` is filled to its worst case for the log (two
laps: the log then holds its most actions and snapshots) with the preset's ``num_envs`` EVHub-v0 envs of the site,
on the CPU. Rows and log are each written with ``torch.save`` to a temporary file ``repeats`` times: the size (MB)
and the median write time (s). With ``--replay`` (CPU presets only, it steps the envs for real) the buffer is
filled by stepping the envs with random actions, and the rebuild a resume runs (:func:`algos.harness.restore_buffer`)
is timed too, and checked to give the same rows.

Run ``python -m benchmarks.checkpoint --help``; the table goes to ``outputs/bench/checkpoint.parquet``.
"""

from __future__ import annotations

import importlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import tyro

from algos import harness
from benchmarks.common import machine_info, save_table
from envs.site import load_site
from envs.vector import RecordEpisodeStatistics, make_vec

COLUMNS = (
    "algo",
    "preset",
    "num_envs",
    "buffer_size",
    "rows_mb",
    "rows_write_s",
    "log_mb",
    "log_write_s",
    "size_ratio",
    "rebuild_s",
    "rebuild_env_steps",
)
"""Columns: the script and its preset, the preset's num_envs and buffer_size, the checkpoint's replay-buffer entry
as rows and as log (size in MB, median write time in s), rows over log size, and (``--replay``) the rebuild's wall
time and env steps (NaN otherwise)."""


def _fill(algo: str, site, num_envs: int, capacity: int, step_envs: bool, seed: int = 0):
    """A buffer of ``capacity`` rows with its log, after two laps of ``num_envs`` transitions a step: stepped for
    real with random actions where ``step_envs``, else random rows (the log's snapshots still the env's state).
    Returns ``(env, rb, log, obs, global_step)``."""
    mode = "discrete" if algo == "dqn" else "hub"
    env = RecordEpisodeStatistics(make_vec("EVHub-v0", num_envs, "cpu", site=site, split="train", action_mode=mode))
    obs, _ = env.reset(seed=seed)
    act_shape = () if algo == "dqn" else tuple(env.single_action_space.shape)
    dtype = torch.int64 if algo == "dqn" else torch.float32
    rb = harness.ReplayBuffer(capacity, obs.shape[1], torch.device("cpu"), act_shape, dtype)
    log = harness.ReplayLog(rb, num_envs)
    g = torch.Generator().manual_seed(seed)
    steps = -(-2 * capacity // num_envs)
    for k in range(steps):
        log.mark(env, obs, k * num_envs)
        if algo == "dqn":
            a = torch.randint(0, 15, (num_envs,), generator=g)
        else:
            a = torch.rand(num_envs, *act_shape, generator=g) * 2 - 1
        if step_envs:
            obs = harness.store(rb, obs, a, env.step(a), True, 1.0)
        else:
            rand = torch.rand(num_envs, obs.shape[1], generator=g)
            rb.add(rand, a, rand[:, 0], rand, torch.zeros(num_envs))
    return env, rb, log, obs, steps * num_envs


def _write(entry: dict, repeats: int) -> tuple[float, float]:
    """``(MB, median seconds)`` of ``torch.save(entry)`` to a temporary file."""
    times, size = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.save(entry, path)
            times.append(time.perf_counter() - t0)
            size = path.stat().st_size
    return size / 1e6, statistics.median(times)


@dataclass
class Args:
    """Checkpoint size and write time of DQN's and SAC's replay buffers: rows against replay log."""

    site: str = "caltech"
    """the site (a shipped name or a TOML) whose envs fill the buffers"""
    presets: tuple[str, ...] = ("cpu", "gpu")
    """the scripts' presets to size the buffers by"""
    repeats: int = 3
    """writes per entry; the median is reported"""
    replay: bool = False
    """fill the CPU presets' buffers by stepping the envs, and time the rebuild a resume runs (minutes)"""
    num_envs: int | None = None
    """envs in place of each preset's (a quick try)"""
    buffer_size: int | None = None
    """buffer rows in place of each preset's (a quick try)"""
    out_dir: str | None = None
    """folder of checkpoint.parquet (default outputs/bench)"""


def run(args: Args) -> pd.DataFrame:
    """Measure every (algorithm, preset), print the table and write it; returns it."""
    rows = []
    site = load_site(args.site)
    for algo in ("dqn", "sac"):
        module = importlib.import_module(f"algos.{algo}")
        for preset in args.presets:
            sizes = module.PRESETS[preset]
            n, cap = int(args.num_envs or sizes["num_envs"]), int(args.buffer_size or sizes["buffer_size"])
            real = args.replay and preset == "cpu"
            env, rb, log, obs, step = _fill(algo, site, n, cap, real)
            rows_mb, rows_s = _write(harness.checkpoint_buffer(rb, log, step, rows=True), args.repeats)
            log_mb, log_s = _write(harness.checkpoint_buffer(rb, log, step, rows=False), args.repeats)
            rebuild_s = rebuild_steps = float("nan")
            if real:
                saved = harness.checkpoint_buffer(rb, log, step, rows=False)
                final = env.state_dict()
                again = harness.ReplayBuffer(cap, obs.shape[1], torch.device("cpu"), rb.data["actions"].shape[1:],
                                             rb.data["actions"].dtype)  # fmt: skip

                def replay(o, a, again=again, env=env):
                    return harness.store(again, o, a, env.step(a), True, 1.0)

                t0 = time.perf_counter()
                _, exact = harness.restore_buffer(again, harness.ReplayLog(again, n), saved, env, replay, n, final, obs)
                rebuild_s = time.perf_counter() - t0
                rebuild_steps = saved["log"]["actions"].shape[0] // n
                if not (exact and all(torch.equal(again.data[k], rb.data[k]) for k in rb.FIELDS)):
                    raise RuntimeError(f"{algo} {preset}: the rebuilt buffer differs from the one written")
            rows.append(
                {
                    "algo": algo,
                    "preset": preset,
                    "num_envs": n,
                    "buffer_size": cap,
                    "rows_mb": rows_mb,
                    "rows_write_s": rows_s,
                    "log_mb": log_mb,
                    "log_write_s": log_s,
                    "size_ratio": rows_mb / log_mb,
                    "rebuild_s": rebuild_s,
                    "rebuild_env_steps": rebuild_steps,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table.attrs["machine"] = json.dumps(machine_info("cpu"))
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    save_table(table, "checkpoint", args.out_dir)
    return table


if __name__ == "__main__":
    run(tyro.cli(Args))
