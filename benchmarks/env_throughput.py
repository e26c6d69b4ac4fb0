"""Environment throughput: a torch-batched env (``EVHub-v0``, or ``Snake-v0`` with ``--env-id``) against the
usual vector-env wrappers of its single env, side by side in one run, at the same numbers of envs.

Implementations (``impl``):

* ``ours``: :class:`envs.evhub.EVHubVectorEnv` with ``num_envs`` copies on ``device`` (float32, train split,
  hub actions, ``bess_action="surplus"``), stepped as one batch of tensor code.
* ``ours_compile`` (opt-in, not in the default ``impls``): the same env with its ``step`` wrapped in
  ``torch.compile(fullgraph=True)``: both envs' steps trace as one graph (counter-based random streams, no host
  sync). Compilation happens in the untimed warm-up.
* ``ours_cudagraph`` (opt-in, CUDA only): that compiled step captured once and replayed from a CUDA graph
  (``algos.harness.CudaGraphed``), one graph launch per vector step.
* ``gym_sync``: ``gymnasium.vector.SyncVectorEnv`` of ``num_envs`` :class:`envs.evhub.EVHubEnv` (one copy
  each, CPU, float64), stepped in a Python loop in this process.
* ``gym_async``: ``gymnasium.vector.AsyncVectorEnv`` of the same, one worker subprocess per env.
* ``sb3_dummy``: Stable-Baselines3's ``DummyVecEnv`` (in process, a Python loop).
* ``sb3_subproc``: Stable-Baselines3's ``SubprocVecEnv`` (one worker subprocess per env).

Every env runs the same site data (loaded once) and the same physics; the baselines are always on the CPU.
With ``env_id="Snake-v0"`` the same five implementations run :class:`envs.snake.SnakeVectorEnv` (10 x 10 boards)
and its single env :class:`envs.snake.SnakeEnv`, with random discrete actions in 0..3.

What is timed: only ``step`` calls of the vector env, with random actions in [-1, 1] drawn beforehand (a pool
of :data:`ACTION_POOL` batches, on ``device`` for ``ours`` and as NumPy arrays for the baselines, cycled).
Episode ends (every ``episode.train_h`` hours) and the automatic resets they trigger fall inside the timed
steps, as they would in training. Not timed: loading the site, building the envs (including starting the
worker subprocesses), the first ``reset``, drawing the actions, a short warm-up and a calibration run that sizes
the timed calls. Each (impl, N) is timed ``repeats`` times with :func:`benchmarks.common.median_rate` (which
synchronises CUDA), each over at least ``min_seconds``; a rate is **env steps per second** = vector steps x
``num_envs`` / seconds of that call.

Memory: ``peak_rss_mb`` is the peak resident set size (MiB) of the benchmark process while a configuration
was built and measured. Garbage is collected and freed heap returned to the OS before each configuration, so it
starts from what is in use: the interpreter, torch and the site data, about 0.4 GiB. The worker subprocesses of
``gym_async`` and ``sb3_subproc`` are **not** included (each imports torch, roughly 0.3 GiB). ``cuda_peak_mb``
is torch's peak CUDA allocation (MiB) of rows run on CUDA, NaN otherwise.

Run ``python -m benchmarks.env_throughput --help``; the table goes to ``outputs/bench/env_throughput.parquet``
(``env_throughput_cuda.parquet`` when run on CUDA; ``env_throughput_snake[_cuda].parquet`` for ``Snake-v0``).
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from benchmarks.common import (
    cuda_peak_mb,
    fmt_num,
    machine_info,
    median_rate,
    peak_rss_mb,
    reset_peak_rss,
    resolve_device,
    save_table,
    synced,
)

ALL_IMPLS: tuple[str, ...] = (
    "ours",
    "ours_compile",
    "ours_cudagraph",
    "gym_sync",
    "gym_async",
    "sb3_dummy",
    "sb3_subproc",
)
"""Every implementation this benchmark knows (see the module docstring)."""
DEFAULT_IMPLS: tuple[str, ...] = ("ours", "gym_sync", "gym_async", "sb3_dummy", "sb3_subproc")
"""Implementations measured unless ``impls`` says otherwise (``ours_compile`` is opt-in: it compiles per N)."""
OURS_IMPLS = ("ours", "ours_compile", "ours_cudagraph")
"""Implementations that run the torch-batched env on ``device``."""
INPROCESS_IMPLS = ("gym_sync", "sb3_dummy")
"""Baselines that hold one Python env object per copy in this process (limited by ``max_inprocess_envs``)."""
SUBPROCESS_IMPLS = ("gym_async", "sb3_subproc")
"""Baselines with one worker subprocess per copy (limited by ``max_subprocess_envs``)."""
SB3_IMPLS = ("sb3_dummy", "sb3_subproc")

CPU_NUM_ENVS = (1, 16, 256, 4096)
"""Default numbers of envs on the CPU."""
CUDA_NUM_ENVS = (1, 16, 256, 4096, 16384)
"""Default numbers of envs on CUDA."""
ACTION_POOL = 64
"""Number of pre-drawn action batches, cycled through while stepping."""
WARMUP_STEPS = 3
"""Vector steps before timing (CPU and baselines)."""
CUDA_WARMUP_STEPS = 20
"""Vector steps before timing ``ours`` on CUDA (kernel caches, allocator)."""
START_METHOD = "forkserver"
"""multiprocessing start method of the worker subprocesses. ``fork`` from a process that has already run torch
can hang in the child; ``forkserver`` forks from a clean server process (which preloads torch and the env once,
so start-up is far cheaper than ``spawn``)."""
FORKSERVER_PRELOAD = ("torch", "envs.evhub")
CALIBRATE_FRACTION = 0.1
"""The chunk size is estimated from stepping for at least this fraction of ``min_seconds`` (after the warm-up)."""
CHUNK_SLACK = 1.3
"""Each timed call is sized to last about ``CHUNK_SLACK * min_seconds``, so that noise rarely pushes it under
``min_seconds`` (``median_rate`` then doubles the chunk and times again)."""

COLUMNS = (
    "impl",
    "device",
    "num_envs",
    "steps_per_s",
    "steps_per_s_min",
    "steps_per_s_max",
    "repeats",
    "speedup_vs",
    "peak_rss_mb",
    "cuda_peak_mb",
    "status",
)
"""Columns of the result table:

* ``impl``, ``device`` (where the env's tensors live; the baselines are always ``cpu``), ``num_envs`` (N);
* ``steps_per_s``: median over the repeats of env steps per second; ``steps_per_s_min``/``_max``: the slowest
  and fastest repeat; ``repeats``: how many repeats were timed (0 when skipped);
* ``speedup_vs``: ``ours``'s median rate at the same N divided by this row's (1.0 for ``ours``; NaN when either
  is missing);
* ``peak_rss_mb``: peak RSS of the benchmark process, MiB (worker subprocesses not included);
* ``cuda_peak_mb``: peak CUDA memory allocated by torch, MiB (NaN for rows on the CPU);
* ``status``: ``"ok"``, ``"skipped: <reason>"`` or ``"error: <exception>"`` (rates NaN unless ``"ok"``).
"""


def _sb3_available() -> bool:
    try:
        import stable_baselines3.common.vec_env  # noqa: F401
    except ImportError:
        return False
    return True


ENV_IDS = ("EVHub-v0", "Snake-v0")
"""Environments the benchmark knows how to build, batched and single."""


class SingleEnvFactory:
    """Picklable factory of one single env (for the vector-env wrappers).

    Args:
        site: the loaded :class:`envs.site.Site` (pickled into each worker with its cached split); None for
            ``Snake-v0``.
        one_thread: call ``torch.set_num_threads(1)`` first (in worker subprocesses: N workers on few cores).
        env_id: one of :data:`ENV_IDS`: :class:`envs.evhub.EVHubEnv` or :class:`envs.snake.SnakeEnv`.
        env_kwargs: further keyword arguments of that class.
    """

    def __init__(self, site: Any, one_thread: bool, env_id: str = "EVHub-v0", **env_kwargs: Any):
        self.site = site
        self.one_thread = one_thread
        self.env_id = env_id
        self.env_kwargs = env_kwargs

    def __call__(self):
        if self.one_thread:
            torch.set_num_threads(1)
        if self.env_id == "Snake-v0":
            from envs.snake import SnakeEnv

            return SnakeEnv(**self.env_kwargs)
        from envs.evhub import EVHubEnv

        return EVHubEnv(site=self.site, **self.env_kwargs)


def _mp_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once the server runs
    return ctx


def _build(impl: str, n: int, site: Any, device: torch.device, rng: np.random.Generator, env_id: str = "EVHub-v0"):
    """Build one configuration; returns ``(env, step(k) -> env steps, close)`` (the env is already reset)."""
    snake = env_id == "Snake-v0"
    if impl in OURS_IMPLS:
        gen = torch.Generator(device=device).manual_seed(0)
        if snake:
            from envs.snake import SnakeVectorEnv

            env = SnakeVectorEnv(num_envs=n, device=device)
            pool = list(torch.randint(0, 4, (ACTION_POOL, n), generator=gen, device=device).unbind(0))
        else:
            from envs.evhub import EVHubVectorEnv

            env = EVHubVectorEnv(num_envs=n, site=site, split="train", device=device, bess_action="surplus")
            pool = list((torch.rand((ACTION_POOL, n, 2), generator=gen, device=device) * 2.0 - 1.0).unbind(0))
        env.reset(seed=0)
        env_step = env.step
        if impl in ("ours_compile", "ours_cudagraph"):
            torch._dynamo.reset()  # a fresh cache per configuration: no recompile limit across N
            env_step = torch.compile(env.step, fullgraph=True)  # one graph: a break would fail here
        if impl == "ours_cudagraph":  # the compiled step replayed from a CUDA graph: one launch per step
            from algos.harness import CudaGraphed

            env_step = CudaGraphed(env_step)

        def step(k: int) -> int:
            for i in range(k):
                env_step(pool[i % ACTION_POOL])
            return k * n

        return env, step, env.close

    one_thread = impl in SUBPROCESS_IMPLS
    factory = (
        SingleEnvFactory(None, one_thread, env_id)
        if snake
        else SingleEnvFactory(site, one_thread, env_id, split="train", bess_action="surplus")
    )
    fns = [factory] * n
    if impl == "gym_sync":
        import gymnasium as gym

        env = gym.vector.SyncVectorEnv(fns)
    elif impl == "gym_async":
        import gymnasium as gym

        _mp_context()
        env = gym.vector.AsyncVectorEnv(fns, context=START_METHOD)
    elif impl == "sb3_dummy":
        from stable_baselines3.common.vec_env import DummyVecEnv

        env = DummyVecEnv(fns)
    elif impl == "sb3_subproc":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        _mp_context()
        env = SubprocVecEnv(fns, start_method=START_METHOD)
    else:  # pragma: no cover - checked by run()
        raise ValueError(impl)
    try:
        if impl.startswith("gym"):
            env.reset(seed=0)
        else:
            env.seed(0)
            env.reset()
        pool = list(
            rng.integers(0, 4, (ACTION_POOL, n))
            if snake
            else rng.uniform(-1.0, 1.0, (ACTION_POOL, n, 2)).astype(np.float32)
        )
    except BaseException:
        env.close()
        raise

    def step(k: int) -> int:
        for i in range(k):
            env.step(pool[i % ACTION_POOL])
        return k * n

    return env, step, env.close


def _calibrated_chunk(step, min_seconds: float, device: torch.device) -> int:
    """Vector steps per timed call: doubles a chunk until it lasts ``CALIBRATE_FRACTION * min_seconds``, then
    scales it to about ``CHUNK_SLACK * min_seconds`` (passed to ``median_rate`` as ``first_chunk``; not timed)."""
    k = 1
    while True:
        t0 = synced(device)
        step(k)
        dt = synced(device) - t0
        if dt >= CALIBRATE_FRACTION * min_seconds:
            return max(1, math.ceil(k * CHUNK_SLACK * min_seconds / dt))
        k *= 2


def _free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``), so that the next
    configuration's peak RSS starts from what is really in use."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _skip_reason(
    impl: str, n: int, max_inprocess_envs: int, max_subprocess_envs: int, sb3: bool, device: torch.device | None = None
) -> str | None:
    if impl == "ours_cudagraph" and (device is None or device.type != "cuda"):
        return "a CUDA graph needs a CUDA device"
    if impl in SB3_IMPLS and not sb3:
        return "stable-baselines3 not installed"
    if impl in INPROCESS_IMPLS and n > max_inprocess_envs:
        return f"N > max_inprocess_envs={max_inprocess_envs} (a Python loop over one env object per copy)"
    if impl in SUBPROCESS_IMPLS and n > max_subprocess_envs:
        return f"N > max_subprocess_envs={max_subprocess_envs} (one worker process per copy, ~0.3 GiB each)"
    return None


def markdown(df: pd.DataFrame) -> str:
    """A Markdown table of a result of :func:`run`: impl, N, median env steps/s, min..max of the repeats,
    ours ÷ this (speed-up of the batched env), peak RSS of the benchmark process (MiB), CUDA peak (MiB), status.
    Missing numbers are left blank."""

    lines = [
        "| impl | N | steps/s median | min..max | ours ÷ this | peak RSS MiB | CUDA peak MiB | status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in df.itertuples(index=False):
        span = "" if not np.isfinite(r.steps_per_s_min) else f"{r.steps_per_s_min:,.0f}..{r.steps_per_s_max:,.0f}"
        lines.append(
            f"| {r.impl} | {int(r.num_envs):,} | {fmt_num(r.steps_per_s, ',.0f')} | {span} | "
            f"{fmt_num(r.speedup_vs, ',.1f')} | {fmt_num(r.peak_rss_mb, ',.0f')} | {fmt_num(r.cuda_peak_mb, ',.0f')} | "
            f"{r.status} |"
        )
    return "\n".join(lines)


def _device_of(impl: str, dev: torch.device) -> torch.device:
    """The device an implementation runs on: ``dev`` for ours, the CPU for the baselines."""
    return dev if impl in OURS_IMPLS else torch.device("cpu")


def _measure(impl, n, dev, site_obj, rng, env_id, repeats, min_seconds, reason) -> dict[str, Any]:
    """One row of :func:`run`'s table: ``impl`` at ``n`` envs timed (median of ``repeats`` rates over at least
    ``min_seconds`` each), or recorded as skipped (``reason``) or failed (its error; one broken baseline must not lose
    the rest of the run)."""
    row_dev = _device_of(impl, dev)
    row: dict[str, Any] = {
        "impl": impl,
        "device": str(row_dev),
        "num_envs": n,
        "steps_per_s": math.nan,
        "steps_per_s_min": math.nan,
        "steps_per_s_max": math.nan,
        "repeats": 0,
        "speedup_vs": math.nan,
        "peak_rss_mb": math.nan,
        "cuda_peak_mb": math.nan,
        "status": "ok",
    }
    if reason is not None:
        print(f"  {impl:<12} N={n:<6,} skipped: {reason}", flush=True)
        return row | {"status": f"skipped: {reason}"}
    _free_memory()
    reset_peak_rss()
    if row_dev.type == "cuda":
        torch.cuda.synchronize(row_dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(row_dev)
    t0 = time.perf_counter()
    try:
        env, step, close = _build(impl, n, site_obj, row_dev, rng, env_id)
        t_build = time.perf_counter() - t0
        try:
            step(CUDA_WARMUP_STEPS if row_dev.type == "cuda" else WARMUP_STEPS)
            chunk = _calibrated_chunk(step, min_seconds, row_dev)
            median, rates = median_rate(step, repeats, min_seconds, row_dev, first_chunk=chunk)
            row["peak_rss_mb"] = peak_rss_mb()
            row["cuda_peak_mb"] = cuda_peak_mb(row_dev)
        finally:
            close()
            del env, step, close
    except Exception as e:  # noqa: BLE001 - one broken baseline must not lose the rest of the run
        print(f"  {impl:<12} N={n:<6,} ERROR {type(e).__name__}: {e}", flush=True)
        return row | {"status": f"error: {type(e).__name__}: {e}"[:300]}
    row.update(steps_per_s=median, steps_per_s_min=min(rates), steps_per_s_max=max(rates), repeats=len(rates))
    print(
        f"  {impl:<12} N={n:<6,} {median:>14,.0f} steps/s (min {min(rates):,.0f}, max {max(rates):,.0f}; build "
        f"{t_build:.1f} s, total {time.perf_counter() - t0:.1f} s, peak RSS {row['peak_rss_mb']:,.0f} MiB)",
        flush=True,
    )
    return row


def _checked(num_envs, device: str, impls, repeats: int, min_seconds: float, env_id: str) -> tuple:
    """:func:`run`'s arguments checked: ``(device, numbers of envs)``, the default numbers for the device where
    ``num_envs`` is None. Raises ValueError as :func:`run` says."""
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        raise ValueError(f"unknown impl(s) {unknown}: expected some of {', '.join(ALL_IMPLS)}")
    if not impls:
        raise ValueError("impls is empty")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if num_envs is None:
        num_envs = CUDA_NUM_ENVS if dev.type == "cuda" else CPU_NUM_ENVS
    num_envs = [int(n) for n in num_envs]
    if not num_envs or min(num_envs) < 1:
        raise ValueError(f"num_envs must be positive integers, got {num_envs}")
    if repeats < 1 or not min_seconds > 0:
        raise ValueError(f"need repeats >= 1 and min_seconds > 0, got {repeats} and {min_seconds}")
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env id {env_id!r}: expected one of {', '.join(ENV_IDS)}")
    return dev, num_envs


def run(
    num_envs: Sequence[int] | None = None,
    device: str = "cpu",
    impls: Sequence[str] = DEFAULT_IMPLS,
    repeats: int = 5,
    min_seconds: float = 1.0,
    max_inprocess_envs: int = 256,
    max_subprocess_envs: int = 16,
    out_dir: str | None = None,
    site: str = "caltech",
    env_id: str = "EVHub-v0",
    out_name: str | None = None,
) -> pd.DataFrame:
    """Measure env steps per second of each implementation at each number of envs, side by side.

    Args:
        num_envs: numbers of parallel envs N (default :data:`CPU_NUM_ENVS`, or :data:`CUDA_NUM_ENVS` on CUDA).
        device: torch device of ``ours`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``); baselines always run on the CPU.
        impls: implementations to run, a subset of :data:`ALL_IMPLS` (default :data:`DEFAULT_IMPLS`;
            ``speedup_vs`` needs ``"ours"``).
        repeats: timed repeats per configuration; the table reports their median, min and max.
        min_seconds: each repeat times at least this many seconds of stepping.
        max_inprocess_envs: largest N for ``gym_sync`` and ``sb3_dummy``; larger N are recorded as skipped.
        max_subprocess_envs: largest N for ``gym_async`` and ``sb3_subproc`` (one process per env); larger
            N are recorded as skipped.
        out_dir: folder of ``env_throughput.parquet`` (default ``outputs/bench/``).
        site: shipped site name or site TOML path; loaded once and shared by every env (EVHub-v0 only).
        env_id: one of :data:`ENV_IDS`.
        out_name: the table's name (default ``env_throughput[_snake][_<device>]``).

    Returns:
        One row per (impl, N), columns :data:`COLUMNS` (rates in env steps/s, memory in MiB); skipped
        configurations are rows with NaN rates and ``status="skipped: <reason>"``. ``df.attrs`` holds the
        machine description and settings. The table is also written to ``<out_dir>/env_throughput.parquet``.

    Raises:
        ValueError: unknown impl or env id, CUDA requested without CUDA, or bad sizes/repeats/min_seconds.
    """
    from envs.site import load_site

    dev, num_envs = _checked(num_envs, device, impls, repeats, min_seconds, env_id)
    site_obj = None
    if env_id == "EVHub-v0":
        site_obj = load_site(site)
        site_obj.split("train")  # cut once; the cached split is shared (and pickled into the workers)
    sb3 = _sb3_available()
    info = machine_info(dev)
    print(
        f"env_throughput {env_id}: {info['cpu']} ({info['cpu_cores']} cores), torch {info['torch']} "
        f"({torch.get_num_threads()} intra-op threads), device {dev}{' ' + str(info['gpu']) if info['gpu'] else ''}; "
        f"{repeats} repeats x >= {min_seconds} s; rates are env steps/s",
        flush=True,
    )

    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for n in num_envs:
        for impl in impls:
            reason = _skip_reason(impl, n, max_inprocess_envs, max_subprocess_envs, sb3, _device_of(impl, dev))
            rows.append(_measure(impl, n, dev, site_obj, rng, env_id, repeats, min_seconds, reason))

    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df["num_envs"] = df["num_envs"].astype("int64")
    df["repeats"] = df["repeats"].astype("int64")
    ours = df[(df.impl == "ours") & (df.status == "ok")].set_index("num_envs")["steps_per_s"]
    df["speedup_vs"] = df["num_envs"].map(ours).astype(float) / df["steps_per_s"]
    df.attrs = {
        "benchmark": "env_throughput",
        "unit": "env steps per second",
        "repeats": repeats,
        "min_seconds": min_seconds,
        "torch_threads": torch.get_num_threads(),
        "start_method": START_METHOD,
        "site": str(site),
        "env_id": env_id,
        **{f"machine_{k}": v for k, v in info.items()},
    }
    df["machine"] = json.dumps(info)
    name = "env_throughput" + ("_snake" if env_id == "Snake-v0" else "")
    name = out_name or (name if torch.device(device).type == "cpu" else f"{name}_{torch.device(device).type}")
    path = save_table(df, name, out_dir)
    print(f"env_throughput: {time.perf_counter() - t_start:.0f} s; wrote {path}\n{markdown(df)}", flush=True)
    return df


@dataclass
class Args:
    """Environment steps per second: a batched env (EVHub-v0 or Snake-v0) against gymnasium's and
    Stable-Baselines3's vector envs of its single env, at the same numbers of envs."""

    env_id: Literal["EVHub-v0", "Snake-v0"] = "EVHub-v0"
    """environment: the site env, or the Snake grid world (10 x 10 boards, random actions 0..3)"""

    num_envs: tuple[int, ...] | None = None
    """numbers of parallel envs N (None: 1 16 256 4096 on cpu, plus 16384 on cuda)"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """device of the batched env ('auto': cuda when available); the baselines always run on the cpu"""
    impls: tuple[
        Literal["ours", "ours_compile", "ours_cudagraph", "gym_sync", "gym_async", "sb3_dummy", "sb3_subproc"], ...
    ] = DEFAULT_IMPLS  # type: ignore[assignment]
    """implementations to measure ('ours' is needed for the speed-up column; 'ours_compile', the batched env's step
    under torch.compile, and 'ours_cudagraph', that step replayed from a CUDA graph (CUDA only), are opt-in)"""
    repeats: int = 5
    """timed repeats per configuration (the table reports median, min and max)"""
    min_seconds: float = 1.0
    """each repeat times at least this many seconds of stepping"""
    max_inprocess_envs: int = 256
    """largest N for gym_sync and sb3_dummy (a Python loop over N env objects); larger N are recorded as skipped"""
    max_subprocess_envs: int = 16
    """largest N for gym_async and sb3_subproc (one worker process per env, each importing torch, ~0.3 GiB);
    larger N are recorded as skipped"""
    out_dir: str | None = None
    """folder of env_throughput.parquet (None: outputs/bench/)"""
    site: str = "caltech"
    """site: a shipped site name or a path to a site TOML file"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro): parse :class:`Args` unless given, then :func:`run`."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    device = resolve_device(args.device)
    return run(
        num_envs=args.num_envs,
        device=device,
        impls=args.impls,
        repeats=args.repeats,
        min_seconds=args.min_seconds,
        max_inprocess_envs=args.max_inprocess_envs,
        max_subprocess_envs=args.max_subprocess_envs,
        out_dir=args.out_dir,
        site=args.site,
        env_id=args.env_id,
    )


if __name__ == "__main__":
    main()
