"""The speed switches, per algorithm: eager vs ``--compile`` vs ``--compile --cudagraphs`` vs with ``--amp``.

Each (algorithm, switches) pair trains in its own subprocess with the script's device preset, the same
seed and the same budget, without evaluation, and reports:

- ``sps``: env steps per second over the whole run (compilation and graph capture included);
- ``sps_steady``: env steps per second over the second half of the iterations (past compilation and
  capture), which is what the switches change;
- ``speedup_vs_eager``: ``sps_steady`` divided by the eager run's;
- ``peak_rss_mb`` (MiB, the training process) and ``cuda_peak_mb`` (MiB allocated by torch, CUDA only).

``--cudagraphs`` needs CUDA, so on the CPU only eager and ``--compile`` run (the rest are recorded as
skipped). Run: ``python -m benchmarks.switches --help``.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import torch

from algos import harness
from benchmarks.common import (
    BENCH_DIR,
    RESULT_PREFIX,
    cuda_peak_mb,
    fmt_num,
    machine_info,
    peak_rss_mb,
    resolve_device,
    run_worker,
    save_table,
)

ALGOS = ("ppo", "a2c", "dqn", "sac")
SWITCHES: dict[str, tuple[str, ...]] = {
    "eager": (),
    "compile": ("--compile",),
    "compile+cudagraphs": ("--compile", "--cudagraphs"),
    "compile+cudagraphs+amp": ("--compile", "--cudagraphs", "--amp"),
}
"""Switch sets by name, as command-line flags of the ``algos/`` scripts."""

BUDGET_STEPS = {
    "cuda": {"ppo": 2_064_384, "a2c": 3_276_800, "dqn": 700_000, "sac": 100_000},
    "cpu": {"ppo": 200_000, "a2c": 200_000, "dqn": 30_000, "sac": 10_000},
}
"""Env steps per run by device and algorithm (each a few seconds of steady state past compilation)."""


def run_one(algo: str, switches: str, device: str, steps: int, seed: int, out_dir: Path) -> dict:
    """Train ``algos/<algo>.py`` with ``switches`` in this process; returns its speed and memory (JSON-able)."""
    module = importlib.import_module(f"algos.{algo}")
    argv = [
        *SWITCHES[switches],
        "--seed",
        str(seed),
        "--total-timesteps",
        str(steps),
        "--eval-split",
        "none",
        "--checkpoint-every",
        "0",
        "--output-dir",
        str(out_dir / "runs" / f"switches_{algo}_{switches}_{device}"),
        "--cuda" if device == "cuda" else "--no-cuda",
    ]
    args = harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, argv)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sized = args  # the preset's values are the parsed defaults
    result = module.main(args)
    return {
        "num_envs": sized.num_envs,
        "env_steps": result["global_step"],
        "train_wall_s": result["train_wall_s"],
        "sps": result["sps"],
        "sps_steady": result["sps_steady"],
        "peak_rss_mb": peak_rss_mb(),
        "cuda_peak_mb": cuda_peak_mb(dev),
    }


def run(
    algos: Sequence[str] = ALGOS,
    switches: Sequence[str] | None = None,
    device: str = "cpu",
    seed: int = 1,
    scale: float = 1.0,
    out_dir: str | Path | None = None,
    timeout_s: float = 600.0,
) -> pd.DataFrame:
    """Measure every (algorithm, switch set), one subprocess each, and write ``switches[_cuda].parquet``.

    Args:
        algos: names of ``algos/`` scripts.
        switches: names from :data:`SWITCHES` (default: all; on the CPU the CUDA-graph ones are skipped).
        device: ``"cpu"`` or ``"cuda"``.
        seed: training seed of every run.
        scale: multiplies the env-step budgets of :data:`BUDGET_STEPS`.
        out_dir: folder of the table (default ``outputs/bench``).
        timeout_s: wall limit of one run's subprocess.

    Returns:
        one row per (algo, switches): ``algo, switches, device, num_envs, env_steps, train_wall_s, sps,
        sps_steady, speedup_vs_eager, peak_rss_mb, cuda_peak_mb, status``.

    Raises:
        ValueError: unknown algorithm or switch set, or CUDA requested without it.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    names = list(switches or SWITCHES)
    for a in algos:
        if a not in ALGOS:
            raise ValueError(f"unknown algorithm {a!r}: known are {list(ALGOS)}")
    for s in names:
        if s not in SWITCHES:
            raise ValueError(f"unknown switch set {s!r}: known are {list(SWITCHES)}")
    out = Path(out_dir or BENCH_DIR)
    rows = []
    for a in algos:
        steps = max(int(BUDGET_STEPS[device][a] * scale), 1)
        for s in names:
            base = {"algo": a, "switches": s, "device": device}
            if "--cudagraphs" in SWITCHES[s] and device != "cuda":
                rows.append(base | {"status": "skipped: CUDA graphs need CUDA"})
                continue
            cmd = [
                "--one",
                a,
                "--switches",
                s,
                "--device",
                device,
                "--seed",
                str(seed),
                "--budget-steps",
                str(steps),
                "--out-dir",
                str(out),
            ]
            t0 = time.perf_counter()
            try:
                rows.append(base | run_worker("benchmarks.switches", cmd, timeout_s) | {"status": "ok"})
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append(base | {"status": f"failed: {str(exc).splitlines()[0][:200]}"})
            _save(rows, device, out)
            r = rows[-1]
            if r["status"] == "ok":
                print(
                    f"[{a} {s} {device}] {r['env_steps']:,} steps, {r['sps']:,.0f} SPS, {r['sps_steady']:,.0f} steady "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            else:
                print(f"[{a} {s} {device}] {r['status']}", flush=True)
    return _save(rows, device, out)


def _save(rows: list[dict], device: str, out: Path) -> pd.DataFrame:
    """The table of the runs so far, written to ``out`` (after every run, so a killed benchmark keeps what it
    measured)."""
    df = pd.DataFrame(rows)
    for col in ("num_envs", "env_steps", "train_wall_s", "sps", "sps_steady", "peak_rss_mb", "cuda_peak_mb"):
        if col not in df:
            df[col] = math.nan
    eager = {r.algo: r.sps_steady for r in df.itertuples() if r.switches == "eager" and r.status == "ok"}
    df["speedup_vs_eager"] = [r.sps_steady / eager[r.algo] if r.algo in eager else math.nan for r in df.itertuples()]
    df["machine"] = json.dumps(machine_info(device))
    save_table(df, "switches" if device == "cpu" else f"switches_{device}", out)
    return df


def markdown(df: pd.DataFrame) -> str:
    """Markdown table of a :func:`run` result (env steps per second, MiB)."""

    lines = [
        "| algo | switches | device | envs | SPS (whole run) | SPS (steady) | × eager | peak RSS MiB "
        "| CUDA peak MiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in df.itertuples():
        lines.append(
            f"| {r.algo} | {r.switches} | {r.device} | {fmt_num(r.num_envs, '.0f')} | {fmt_num(r.sps, ',.0f')} | "
            f"{fmt_num(r.sps_steady, ',.0f')} | {fmt_num(r.speedup_vs_eager, '.2f')} | {fmt_num(r.peak_rss_mb, '.0f')} "
            f"| {fmt_num(r.cuda_peak_mb, '.0f')} | {r.status} |"
        )
    return "\n".join(lines)


@dataclass
class Args:
    """Speed switches per algorithm: eager vs --compile vs --compile --cudagraphs vs with --amp."""

    algos: tuple[str, ...] = ALGOS
    """algorithms to measure (algos/<name>.py)"""
    switch_sets: tuple[str, ...] = ()
    """switch sets to measure (default: all): eager, compile, compile+cudagraphs, compile+cudagraphs+amp"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """device ('auto': cuda when available)"""
    seed: int = 1
    """training seed of every run"""
    scale: float = 1.0
    """multiplies the env-step budgets (0.01 for a quick check)"""
    out_dir: str | None = None
    """folder of the Parquet table (None: outputs/bench)"""
    timeout_s: float = 600.0
    """wall limit of one run, seconds"""
    one: str | None = None
    """(internal) run only this algorithm in this process and print its result as JSON"""
    switches: str = "eager"
    """(internal, with --one) the switch set"""
    budget_steps: int = 0
    """(internal, with --one) env steps of the run"""


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    device = resolve_device(args.device)
    if args.one:
        res = run_one(args.one, args.switches, device, args.budget_steps, args.seed, Path(args.out_dir or BENCH_DIR))
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return
    df = run(args.algos, args.switch_sets or None, device, args.seed, args.scale, args.out_dir, args.timeout_s)
    print(markdown(df))


if __name__ == "__main__":
    main()
