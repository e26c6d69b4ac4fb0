"""What bounds a workload: torch.profiler summaries of the batched env step and of a short training run.

For each target it writes ``outputs/bench/profile_<target>_<device>.txt`` (torch.profiler's table of the
operators by self time) and one row of ``profile[_cuda].parquet``:

- ``wall_s``: wall time of the profiled region (s);
- ``cuda_kernel_s``: summed time of the CUDA kernels (s); ``gpu_busy_pct = 100 * cuda_kernel_s / wall_s``
  (kernels can overlap, so this is an upper bound of the GPU's busy share). A low value on a GPU means the
  host is the bound: kernel launches, Python or host syncs, not the GPU's arithmetic or memory;
- ``kernel_launches`` (CUDA launch calls) and ``launches_per_step`` (per vector step of the env, or per
  training iteration);
- ``top_ops``: the five operators with the most self time (CUDA time on a GPU, CPU time otherwise).

Targets: ``env`` or ``env_eager``, ``env_compile``, ``env_cudagraph`` (``steps`` vector steps of ``EVHubVectorEnv`` at
``num_envs``, its step eager, compiled as one graph, or that graph replayed by CUDA; see :func:`profile_env`) and
``ppo``, ``a2c``,
``sac``, ``dqn`` (the script, eager, with its device preset and a budget of a few iterations; set-up,
compilation and export are included in the wall time, so read the per-op table rather than the total).
Run: ``python -m benchmarks.profile --help``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from algos import harness
from benchmarks.common import BENCH_DIR, machine_info, resolve_device, save_table
from envs.files import write_text


def _summarise(prof, wall: float, steps: int, device: torch.device) -> dict:
    """Kernel time, launches and top operators of a finished profile."""
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    cuda_us = (
        sum(
            getattr(e, "self_device_time_total", 0.0) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
        )
        if device.type == "cuda"
        else 0.0
    )
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cuLaunchKernelEx")
    )
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:5]
    return {
        "wall_s": wall,
        "cuda_kernel_s": cuda_us / 1e6,
        "gpu_busy_pct": 100.0 * cuda_us / 1e6 / max(wall, 1e-9) if device.type == "cuda" else float("nan"),
        "kernel_launches": float(launches),
        "launches_per_step": launches / max(steps, 1),
        "top_ops": "; ".join(f"{e.key} {getattr(e, key, 0.0) / 1e3:.1f} ms" for e in top),
        "table": events.table(sort_by=sort, row_limit=25),
    }


def profile_env(num_envs: int, device: torch.device, steps: int = 50, mode: str = "eager") -> dict:
    """Profile ``steps`` vector steps of the batched env at ``num_envs`` (random actions pre-generated), its step
    run ``mode``: ``"eager"``, ``"compile"`` (``torch.compile(fullgraph=True)``) or ``"cudagraph"`` (that compiled
    step replayed from a CUDA graph; CUDA only). ``ops_per_step``: the torch operators (eager) or compiled regions the
    profiler records per step on the host."""
    from envs.evhub import EVHubVectorEnv

    env = EVHubVectorEnv(num_envs, device=device, bess_action="surplus")
    env.reset(seed=0)
    step = env.step
    if mode in ("compile", "cudagraph"):
        torch._dynamo.reset()
        step = torch.compile(env.step, fullgraph=True)
    if mode == "cudagraph":
        if device.type != "cuda":
            raise ValueError("mode 'cudagraph' needs a CUDA device")
        step = harness.CudaGraphed(step)
    actions = torch.rand(16, num_envs, 2, device=device) * 2 - 1
    for i in range(10):  # warm-up: compilation and graph capture happen here
        step(actions[i % 16])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(actions[i % 16])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::") or "Compiled" in e.key)
    return {
        "target": f"env_{mode}",
        "num_envs": num_envs,
        "steps": steps,
        "ops_per_step": ops / steps,
        **_summarise(prof, wall, steps, device),
    }


def profile_algo(algo: str, device: torch.device, iterations: int = 2, out_dir: Path = BENCH_DIR) -> dict:
    """Profile a short eager run of ``algos/<algo>.py`` with its device preset (``iterations`` iterations)."""
    module = importlib.import_module(f"algos.{algo}")
    argv = [
        "--eval-split",
        "none",
        "--checkpoint-every",
        "0",
        "--output-dir",
        str(out_dir / "runs" / f"profile_{algo}"),
        "--cuda" if device.type == "cuda" else "--no-cuda",
    ]
    args = harness.cli(module.Args, module.PRESETS, module.ENV_DEFAULTS, argv)
    sized = args  # the preset's values are the parsed defaults
    per_iteration = sized.num_envs * getattr(sized, "num_steps", 1)  # env steps per iteration
    learning_starts = getattr(sized, "learning_starts", 0)
    steps = learning_starts + iterations * per_iteration  # off-policy: profile iterations that learn
    args = dataclasses.replace(args, total_timesteps=steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        module.main(args)
        wall = time.perf_counter() - t0
    n_iter = steps // max(per_iteration, 1)
    return {"target": algo, "num_envs": sized.num_envs, "steps": n_iter, **_summarise(prof, wall, n_iter, device)}


def run(
    targets: Sequence[str] = ("env",),
    device: str = "cpu",
    num_envs: int = 4096,
    out_dir: str | Path | None = None,
    name: str | None = None,
) -> pd.DataFrame:
    """Profile each target and write its table and the summary ``profile[_cuda].parquet`` (or ``<name>.parquet``).

    Raises:
        ValueError: unknown target, or CUDA requested without it.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    dev = torch.device(device)
    out = Path(out_dir or BENCH_DIR)
    rows = []
    for t in targets:
        if t in ("env", "env_eager", "env_compile", "env_cudagraph"):
            r = profile_env(num_envs, dev, mode=t.removeprefix("env").removeprefix("_") or "eager")
        elif t in ("ppo", "a2c", "sac", "dqn"):
            r = profile_algo(t, dev, out_dir=out)
        else:
            raise ValueError(
                f"unknown profile target {t!r}: env (env_eager), env_compile, env_cudagraph, ppo, a2c, sac or dqn"
            )
        write_text(out / f"profile_{t}_{device}.txt", r.pop("table") + "\n")
        rows.append({"device": device, **r})
        print(
            f"[profile {t} {device}] wall {r['wall_s']:.2f} s, kernels {r['cuda_kernel_s']:.2f} s, "
            f"launches per step {r['launches_per_step']:.0f}"
            + (f", host ops per step {r['ops_per_step']:.0f}" if "ops_per_step" in r else "")
            + f"; top: {r['top_ops']}",
            flush=True,
        )
    df = pd.DataFrame(rows)
    df["machine"] = json.dumps(machine_info(dev))
    save_table(df, name or ("profile" if device == "cpu" else f"profile_{device}"), out)
    return df


@dataclass
class Args:
    """torch.profiler summaries: what bounds the env step and each training loop."""

    targets: tuple[str, ...] = ("env",)
    """what to profile: env (= env_eager), env_compile, env_cudagraph (CUDA only), ppo, a2c, sac, dqn"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """device ('auto': cuda when available)"""
    num_envs: int = 4096
    """number of env copies of the 'env' target"""
    out_dir: str | None = None
    """folder of the tables (None: outputs/bench)"""


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    device = resolve_device(args.device)
    run(args.targets, device, args.num_envs, args.out_dir)


if __name__ == "__main__":
    main()
