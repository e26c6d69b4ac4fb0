"""Gathers the benchmark tables of ``outputs/bench`` into one Markdown page, ``benchmarks.md``.

Each section comes from one Parquet table written by a benchmark module (CPU and, where it ran, CUDA);
tables that are missing are listed as not run. Targets are checked against the same tables
(:func:`targets`), so the page says which were met.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from benchmarks import env_throughput, ppo_vs_sb3, switches, training, vector_io
from benchmarks.common import BENCH_DIR
from envs.files import write_text


def _read(out: Path, name: str) -> pd.DataFrame | None:
    path = out / f"{name}.parquet"
    return pd.read_parquet(path) if path.is_file() else None


def targets(out: Path) -> pd.DataFrame:
    """The issue's speed targets against the measured tables: ``target, measured, met`` (met: True/False/None)."""
    rows = []

    def add(target: str, value: float | None, ok: bool | None, unit: str = "") -> None:
        shown = "not measured" if value is None or not math.isfinite(value) else f"{value:,.1f}{unit}"
        rows.append({"target": target, "measured": shown, "met": ok if shown != "not measured" else None})

    env = _read(out, "env_throughput")
    if env is not None:
        r = env[(env.impl == "sb3_dummy") & (env.num_envs == 256) & (env.status == "ok")]
        v = float(r.speedup_vs.iloc[0]) if len(r) else None
        add("CPU: batched env at 256 envs >= 50x SB3 DummyVecEnv", v, v is not None and v >= 50, "x")
    tr = _read(out, "training")
    if tr is not None:
        r = tr[(tr.config == "ours_ppo_preset") & (tr.status == "ok")]
        v = float(r.sps_vs_sb3.iloc[0]) if len(r) else None
        add("CPU: our PPO >= 10x SB3 PPO's SPS", v, v is not None and v >= 10, "x")
    if env is not None:  # the env step as one graph: compiled vs eager, side by side in one run
        rate = env[env.status == "ok"].set_index(["impl", "num_envs"])["steps_per_s"]
        v = rate.get(("ours_compile", 4096), math.nan) / rate.get(("ours", 4096), math.nan)
        add("CPU: compiled env step at 4,096 envs >= 2x the eager step", v, bool(v >= 2), "x")
    graphs = _read(out, "env_throughput_graphs_cuda")
    if graphs is not None:
        best = graphs[graphs.status == "ok"].groupby("num_envs")["steps_per_s"].max()
        for n, goal in ((65536, 1e8), (4096, 2e7)):
            v = float(best.get(n, math.nan))
            add(
                f"GPU: env >= {goal:.0e} steps/s at {n:,} envs (best of eager, compiled, CUDA-graphed)",
                v,
                bool(v >= goal),
                " steps/s",
            )
    prof_gpu = [_read(out, f"profile_env_cuda_{n}") for n in (4096, 65536)]
    for n, p in zip((4096, 65536), prof_gpu):
        if p is None:
            continue
        r = p[p.target == "env_cudagraph"]
        v = float(r.launches_per_step.iloc[0]) if len(r) else None
        add(f"GPU: <= 10 kernel launches per env step once graphed ({n:,} envs)", v, v is not None and v <= 10)
    tr_gpu = _read(out, "training_cuda")
    if tr_gpu is not None:
        for algo, goal in (("ppo", 5e6), ("sac", 5e5)):
            r = tr_gpu[(tr_gpu.library == "ours") & (tr_gpu.algo == algo) & (tr_gpu.status == "ok")]
            v = float(r.sps.max()) if len(r) else None
            add(f"GPU: {algo.upper()} >= {goal:.0e} env steps/s end to end", v, v is not None and v >= goal, " SPS")
    sw = _read(out, "switches_cuda")
    if sw is not None:
        for algo in ("sac", "dqn"):
            r = sw[(sw.algo == algo) & (sw.switches == "compile+cudagraphs") & (sw.status == "ok")]
            v = float(r.speedup_vs_eager.iloc[0]) if len(r) else None
            add(
                f"GPU: {algo.upper()} --compile --cudagraphs >= 3x eager (steady SPS)", v, v is not None and v >= 3, "x"
            )
    return pd.DataFrame(rows, columns=["target", "measured", "met"])


def write(out_dir: str | Path | None = None) -> Path:
    """Write ``<out_dir>/benchmarks.md`` (default ``outputs/bench``) from the tables there; returns its path."""
    out = Path(out_dir or BENCH_DIR)
    parts = ["# Benchmarks", ""]
    t = targets(out)
    if len(t):
        parts += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        parts += [
            f"| {r.target} | {r.measured} | {'' if r.met is None else ('yes' if r.met else 'no')} |"
            for r in t.itertuples()
        ]
        parts.append("")
    sections = (
        ("Environment throughput", "env_throughput", env_throughput.markdown),
        ("Environment throughput, Snake-v0", "env_throughput_snake", env_throughput.markdown),
        ("The env step eager, compiled and CUDA-graphed", "env_throughput_graphs", env_throughput.markdown),
        ("I/O-bound env (IOBound-v0): sync vs async vector envs", "vector_io", vector_io.markdown),
        ("Training throughput and time to quality", "training", training.markdown),
        ("Our PPO against Stable-Baselines3's, configured alike", "ppo_vs_sb3", ppo_vs_sb3.markdown),
        ("Speed switches", "switches", switches.markdown),
    )
    for title, name, fmt in sections:
        for suffix in ("", "_cuda"):
            df = _read(out, name + suffix)
            if df is None:
                continue
            machine = df["machine"].iloc[0] if "machine" in df and len(df) else df.attrs.get("machine")
            parts += [f"## {title} ({'GPU' if suffix else 'CPU'})", ""]
            if machine:
                m = json.loads(machine) if isinstance(machine, str) else machine
                parts += ["Machine: " + ", ".join(f"{k} {v}" for k, v in m.items() if v != ""), ""]
            parts += [fmt(df), ""]
    names = ("profile", "profile_cuda", "profile_env_cuda_4096", "profile_env_cuda_65536")
    prof = [p for p in (_read(out, n) for n in names) if p is not None]
    if prof:
        parts += [
            "## Profiles",
            "",
            "| target | device | envs | wall s | CUDA kernels s | GPU busy % | launches per step | "
            "host ops per step | top ops |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in prof:
            for r in p.itertuples():
                busy = "" if not math.isfinite(r.gpu_busy_pct) else f"{r.gpu_busy_pct:.0f}"
                ops = getattr(r, "ops_per_step", math.nan)
                parts.append(
                    f"| {r.target} | {r.device} | {r.num_envs} | {r.wall_s:.2f} | {r.cuda_kernel_s:.2f} | {busy} | "
                    f"{r.launches_per_step:.0f} | {'' if not math.isfinite(ops) else f'{ops:.0f}'} | {r.top_ops} |"
                )
        parts.append("")
    path = write_text(out / "benchmarks.md", "\n".join(parts) + "\n")
    print(f"benchmark report: {path}")
    return path


if __name__ == "__main__":
    write()
