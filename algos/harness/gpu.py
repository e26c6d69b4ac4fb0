"""GPU statistics logged beside the training curves: memory from the caching allocator, utilisation from NVML."""

from __future__ import annotations

import importlib.util
import math

import torch

GPU_STAT_KEYS = ("perf/gpu_mem_allocated_gb", "perf/gpu_mem_reserved_gb", "perf/gpu_mem_peak_gb", "perf/gpu_util_pct")
"""The TensorBoard tags of :func:`gpu_stats`; ``metrics.parquet`` has them as columns without ``perf/``."""

_HAVE_PYNVML = importlib.util.find_spec("pynvml") is not None


def gpu_stats(device: torch.device) -> dict[str, float]:
    """GPU memory (GB = 1e9 bytes; the caching allocator's host-side counters, no sync) and utilisation (percent of
    the last sample period with a kernel running, via NVML: NaN unless ``pynvml`` imports) of ``device``, keyed by
    :data:`GPU_STAT_KEYS`. NaN on a non-CUDA device; never raises (a failed reading is NaN)."""
    stats = {key: math.nan for key in GPU_STAT_KEYS}
    if device.type != "cuda":
        return stats
    try:
        stats["perf/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        stats["perf/gpu_mem_reserved_gb"] = torch.cuda.memory_reserved(device) / 1e9
        stats["perf/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    except Exception:  # noqa: BLE001 - monitoring must not stop training
        pass
    if _HAVE_PYNVML:
        try:
            stats["perf/gpu_util_pct"] = float(torch.cuda.utilization(device))
        except Exception:  # noqa: BLE001
            pass
    return stats
