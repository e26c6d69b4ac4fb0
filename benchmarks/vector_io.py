"""I/O-bound environments: gymnasium's ``SyncVectorEnv`` against ``AsyncVectorEnv`` (one worker process per
env) on ``IOBound-v0`` (:mod:`envs.io_bound`), whose ``step`` waits ``latency_s`` on simulated I/O, side by
side at the same numbers of envs N.

Stepped one after another, N waiting envs take N x ``latency_s`` per vector step; in N processes they wait
at the same time, so async should approach N times the steps/s of sync, bounded by the per-step cost of
moving actions and observations between processes. Waiting needs no CPU, so this holds on a 2-core machine
up to N = 16 and beyond. This is what ``--vector-mode async`` of the agent scripts buys for environments that
wait on a network or a device; for CPU-bound Python envs the speed-up is bounded by the cores instead.

What is timed: ``step`` calls with fixed actions (zeros), after the envs are built and reset and one warm-up
step. Each (mode, N) is timed ``repeats`` times with :func:`benchmarks.common.median_rate`; a rate is **env
steps per second** = vector steps x N / seconds. ``speedup`` is async's median over sync's at the same N.

Run ``python -m benchmarks.vector_io --help``; the table goes to ``outputs/bench/vector_io.parquet``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from benchmarks.common import fmt_num, machine_info, median_rate, save_table

MODES = ("sync", "async")
COLUMNS = ("mode", "num_envs", "latency_ms", "steps_per_s", "steps_per_s_min", "steps_per_s_max", "repeats", "speedup")
"""Columns: vector mode, N, the env's wait per step (ms), median/min/max env steps/s over the repeats, the
number of repeats, and (async rows) async's median rate over sync's at the same N (NaN on sync rows)."""


def make_vector_env(mode: str, num_envs: int, latency_s: float):
    """``gym.make_vec("IOBound-v0", num_envs, vectorization_mode=mode)`` with the given wait per step.

    Raises:
        ValueError: unknown mode.
    """
    import gymnasium as gym

    import envs  # noqa: F401  (registers IOBound-v0)

    if mode not in MODES:
        raise ValueError(f"unknown vector mode {mode!r}: expected one of {MODES}")
    return gym.make_vec("IOBound-v0", num_envs=num_envs, vectorization_mode=mode, latency_s=latency_s)


def run(
    num_envs: Sequence[int] = (1, 2, 4, 8, 16),
    latency_s: float = 0.005,
    repeats: int = 5,
    min_seconds: float = 0.5,
    out_dir: str | None = None,
) -> pd.DataFrame:
    """Measure env steps/s of sync and async vector envs of ``IOBound-v0`` at each N, side by side.

    Returns:
        one row per (mode, N), columns :data:`COLUMNS`; also written to ``<out_dir>/vector_io.parquet``.

    Raises:
        ValueError: empty or non-positive ``num_envs``, ``repeats < 1`` or ``min_seconds <= 0``.
    """
    num_envs = [int(n) for n in num_envs]
    if not num_envs or min(num_envs) < 1 or repeats < 1 or not min_seconds > 0:
        raise ValueError(
            f"need positive num_envs, repeats >= 1 and min_seconds > 0, got {num_envs}, {repeats}, {min_seconds}"
        )
    cpu = torch.device("cpu")
    rows = []
    t_start = time.perf_counter()
    for n in num_envs:
        for mode in MODES:
            env = make_vector_env(mode, n, latency_s)
            try:
                env.reset(seed=0)
                actions = np.zeros((n, 2), np.float32)
                env.step(actions)

                def step(k: int, env=env, actions=actions, n=n) -> int:
                    for _ in range(k):
                        env.step(actions)
                    return k * n

                median, rates = median_rate(step, repeats, min_seconds, cpu)
            finally:
                env.close()
            rows.append(
                {
                    "mode": mode,
                    "num_envs": n,
                    "latency_ms": latency_s * 1e3,
                    "steps_per_s": median,
                    "steps_per_s_min": min(rates),
                    "steps_per_s_max": max(rates),
                    "repeats": len(rates),
                }
            )
            print(
                f"  {mode:<5} N={n:<3} {median:>10,.0f} steps/s (min {min(rates):,.0f}, max {max(rates):,.0f})",
                flush=True,
            )
    df = pd.DataFrame(rows)
    sync = df[df["mode"] == "sync"].set_index("num_envs")["steps_per_s"]
    df["speedup"] = np.where(df["mode"] == "async", df["steps_per_s"] / df["num_envs"].map(sync), np.nan)
    df = df[list(COLUMNS)]
    info = machine_info(cpu)
    df.attrs = {
        "benchmark": "vector_io",
        "unit": "env steps per second",
        "latency_s": latency_s,
        **{f"machine_{k}": v for k, v in info.items()},
    }
    df["machine"] = json.dumps(info)
    path = save_table(df, "vector_io", out_dir)
    print(f"vector_io: {time.perf_counter() - t_start:.0f} s; wrote {path}\n{markdown(df)}", flush=True)
    return df


def markdown(df: pd.DataFrame) -> str:
    """The table as Markdown: one row per N with sync and async steps/s (median, min..max) and the speed-up."""
    lines = ["| N | sync steps/s | async steps/s | async ÷ sync |", "|---:|---:|---:|---:|"]
    for n, g in df.groupby("num_envs", sort=True):
        s, a = g[g["mode"] == "sync"].iloc[0], g[g["mode"] == "async"].iloc[0]
        lines.append(
            f"| {n} | {fmt_num(s.steps_per_s, ',.0f')} "
            f"({fmt_num(s.steps_per_s_min, ',.0f')}..{fmt_num(s.steps_per_s_max, ',.0f')}) | "
            f"{fmt_num(a.steps_per_s, ',.0f')} "
            f"({fmt_num(a.steps_per_s_min, ',.0f')}..{fmt_num(a.steps_per_s_max, ',.0f')}) | "
            f"{fmt_num(a.speedup, '.1f')} |"
        )
    return "\n".join(lines)


@dataclass
class Args:
    """Env steps/s of gymnasium's sync and async vector envs on an env whose step waits on simulated I/O."""

    num_envs: tuple[int, ...] = (1, 2, 4, 8, 16)
    """numbers of envs N (async starts one worker process per env)"""
    latency_ms: float = 5.0
    """wait of each env step and reset, milliseconds"""
    repeats: int = 5
    """timed repeats per (mode, N); the table reports their median, min and max"""
    min_seconds: float = 0.5
    """each repeat times at least this many seconds of stepping"""
    out_dir: str | None = None
    """folder of vector_io.parquet (None: outputs/bench/)"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro)."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    return run(args.num_envs, args.latency_ms / 1e3, args.repeats, args.min_seconds, args.out_dir)


if __name__ == "__main__":
    main()
