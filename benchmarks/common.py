"""Pieces every benchmark shares: where results go, the machine they ran on, timing and memory.

Results are Parquet tables under ``outputs/bench/`` (written atomically, see :mod:`envs.files`), one per
benchmark, plus ``outputs/bench/benchmarks.md`` (see :mod:`benchmarks.report`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from envs.files import write_parquet

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = PROJECT_ROOT / "outputs" / "bench"
"""Default folder of the benchmark tables."""


def machine_info(device: torch.device | str = "cpu") -> dict[str, str | int | float]:
    """What the numbers were measured on: CPU model and core count, RAM (GiB), GPU name, torch/CUDA version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import psutil

        ram_gib = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover - psutil comes with dask.distributed
        ram_gib = float("nan")
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count() or 0,
        "ram_gib": ram_gib,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "python": platform.python_version(),
    }


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when CUDA is available, else ``"cpu"``; any other name is returned as is."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def fmt_num(x: float | None, spec: str) -> str:
    """``format(x, spec)`` for a Markdown cell; blank for None, NaN or infinity."""
    if x is None:
        return ""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return format(v, spec) if math.isfinite(v) else ""


def synced(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (a host sync on CUDA), seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median_rate(
    run: Callable[[int], int], repeats: int, min_seconds: float, device: torch.device, first_chunk: int = 1
) -> tuple[float, list[float]]:
    """Median of ``repeats`` timed rates of ``run``, each timed over at least ``min_seconds``.

    ``run(k)`` does ``k`` units of work (for example ``k`` vector steps) and returns how many items it
    produced (for example ``k * num_envs`` env steps). Each repeat doubles ``k`` from ``first_chunk`` until
    one call lasts ``min_seconds``, and its rate is items per second of that call.

    Returns:
        ``(median items/s, [items/s of each repeat])``.
    """
    rates: list[float] = []
    k = max(1, first_chunk)
    for _ in range(repeats):
        while True:
            t0 = synced(device)
            items = run(k)
            dt = synced(device) - t0
            if dt >= min_seconds:
                break
            k *= 2 if dt <= 0 else max(2, min(16, int(min_seconds / dt) + 1))
        rates.append(items / dt)
    return statistics.median(rates), rates


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux ``/proc/self/clear_refs``); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident set size of this process since start or :func:`reset_peak_rss`, in MiB (NaN if unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except ImportError:  # pragma: no cover - not on POSIX
        return float("nan")


def cuda_peak_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by torch on ``device`` since the last reset, MiB (NaN off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    return torch.cuda.max_memory_allocated(device) / 2**20


def save_table(df: pd.DataFrame, name: str, out_dir: str | Path | None = None) -> Path:
    """Write ``df`` to ``<out_dir>/<name>.parquet`` atomically (default :data:`BENCH_DIR`); returns the path."""
    return write_parquet(df, Path(out_dir or BENCH_DIR) / f"{name}.parquet")


RESULT_PREFIX = "BENCH_RESULT "
"""Marks the line on which a benchmark worker prints its JSON result."""


def run_worker(module: str, args: list[str], timeout_s: float) -> dict:
    """Run ``python -m <module> <args>`` in a fresh process (so its peak memory is its own) and return
    the JSON object it printed after :data:`RESULT_PREFIX`.

    Raises:
        RuntimeError: the worker failed or printed no result (the message has its last line; the last
            lines of its output are printed).
        subprocess.TimeoutExpired: it ran longer than ``timeout_s`` seconds.
    """
    path = os.pathsep.join(filter(None, (str(PROJECT_ROOT), os.environ.get("PYTHONPATH"))))
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=os.environ | {"PYTHONPATH": path},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines() or [""]
        print("\n".join(tail[-15:]), flush=True)
        raise RuntimeError(f"exit code {proc.returncode}: {tail[-1]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])
