"""Latency of one live plan (:func:`pipeline.live.make_plan`, the function behind ``evhub-plan``): state in, plan out.

What is timed: ``make_plan(site, state, controller)`` with the site loaded and the state rebuilt once (``--at``'s
:func:`pipeline.live.state_at`): the history turned into a split, the controller rebuilt from it (its MOER regression
refit day after day from the split's start), the LP solved, the OCPP profiles built and validated. One untimed warm-up
call, then ``repeats`` timed calls; the table keeps their median, min and max. What a process adds around it (Python,
torch and the site's data loaded) is timed once, from a subprocess running the command itself (``cli_s``).

The default hour is the example of ``docs/live.md`` on caltech (2021-08-23 08:00, 2,744 h into the test split); the
train split's last hours (up to 5,880 h of history) are the slowest the shipped sites have.

Run ``python -m benchmarks.plan_latency --help``; the table goes to ``outputs/bench/plan_latency.parquet``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from benchmarks.common import PROJECT_ROOT, fmt_num, machine_info, save_table

COLUMNS = ("site", "at", "controller", "repeats", "median_s", "min_s", "max_s", "profiles", "horizon_h", "cli_s")
"""Columns: the site and hour, the controller, the number of timed plans and their median/min/max seconds, the plan's
charging profiles and window (hours), and one end-to-end run of the command from a fresh process (seconds; NaN when
not measured)."""

WITHOUT_TUNING = ("mpc", "mpc_tuned_start", "mpc_rl_start")
"""The controllers measured by default: those that run without the study's tuning (a fresh clone has none)."""


def run(
    site: str = "caltech",
    at: str = "2021-08-23T08:00:00-07:00",
    controllers: tuple[str, ...] = WITHOUT_TUNING,
    repeats: int = 20,
    cli: bool = True,
    out_dir: str | None = None,
    output_dir: str = "outputs",
) -> pd.DataFrame:
    """Time ``repeats`` plans of each controller at hour ``at``; print one line each and write the table
    (``output_dir``: the study folder whose tuning the tuned controllers read).

    Raises:
        pipeline.live.LiveError: a bad hour or controller (as the command says it).
    """
    from envs.site import load_site
    from pipeline import live

    s = load_site(site)
    state = live.state_at(s, at)
    rows = []
    for name in controllers:
        with live.quiet_stdout():
            plan = live.make_plan(s, state, name, output_dir=output_dir)  # warm-up: solver, OCPP schema, caches
            walls = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = live.make_plan(s, state, name, output_dir=output_dir)
                walls.append(time.perf_counter() - t0)
        cli_s = _cli_seconds(site, at, name, output_dir) if cli else float("nan")
        rows.append(
            {
                "site": s.config.name,
                "at": at,
                "controller": name,
                "repeats": repeats,
                "median_s": statistics.median(walls),
                "min_s": min(walls),
                "max_s": max(walls),
                "profiles": len(plan.charging_profiles),
                "horizon_h": plan.horizon_h,
                "cli_s": cli_s,
            }
        )
        r = rows[-1]
        print(
            f"{name}: median {r['median_s']:.3f} s of {repeats} plans (min {r['min_s']:.3f}, max {r['max_s']:.3f}) at "
            f"{s.config.name} {at}, {r['profiles']} profile(s) over {r['horizon_h']:g} h"
            + (f"; the command end to end {cli_s:.1f} s" if cli else ""),
            flush=True,
        )
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    info = machine_info()
    df["machine"] = json.dumps(info)
    path = save_table(df, "plan_latency", out_dir)
    print(f"on {info['cpu']} ({info['cpu_cores']} cores); wrote {path}", flush=True)
    return df


def _cli_seconds(site: str, at: str, controller: str, output_dir: str) -> float:
    """Seconds of one ``python -m pipeline.live`` run writing a plan (process start, imports, the site's data)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pipeline.live", "--site", site, "--at", at, "--controller", controller]
        cmd += ["--output-dir", str(output_dir)]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*cmd, "--out", str(Path(tmp) / "plan.json")], cwd=PROJECT_ROOT, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"evhub-plan failed: {proc.stderr.strip().splitlines()[-1:]}")
    return wall


def markdown(df: pd.DataFrame) -> str:
    """The table as Markdown: one row per controller."""
    lines = ["| controller | median s (min..max) | plans | command end to end s |", "|---|---:|---:|---:|"]
    for r in df.itertuples():
        lines.append(
            f"| {r.controller} | {fmt_num(r.median_s, '.3f')} ({fmt_num(r.min_s, '.3f')}..{fmt_num(r.max_s, '.3f')}) "
            f"| {r.repeats} | {fmt_num(r.cli_s, '.1f')} |"
        )
    return "\n".join(lines)


@dataclass
class Args:
    """Latency of one live plan (evhub-plan's function: state in, plan out), median of N calls per controller."""

    site: str = "caltech"
    """site: a shipped site name or a path to a site TOML file"""
    at: str = "2021-08-23T08:00:00-07:00"
    """the hour whose state (rebuilt from the site's data, as --at does) every plan starts from"""
    controllers: tuple[str, ...] = WITHOUT_TUNING
    """controllers to time (the tuned ones need the study's tuning in outputs/<site>/tuned/)"""
    repeats: int = 20
    """timed plans per controller (after one untimed warm-up)"""
    cli: bool = True
    """also time one run of the command from a fresh process per controller"""
    out_dir: str | None = None
    """folder of plan_latency.parquet (None: outputs/bench/)"""
    output_dir: str = "outputs"
    """the study's output folder, whose tuning the tuned controllers read (outputs/<site>/tuned/)"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro)."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    return run(args.site, args.at, args.controllers, args.repeats, args.cli, args.out_dir, args.output_dir)


if __name__ == "__main__":
    main()
