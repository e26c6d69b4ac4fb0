"""Shared fixtures: a small synthetic site (fast, independent of the shipped data) and the real one."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pandas as pd
import pytest

from envs.config import config_from_dict
from envs.site import Site


def pytest_configure(config):
    """Under pytest-xdist each worker computes on one thread (torch's intra-op pool and the BLAS pools): the workers
    already fill the cores, and two threads each on two cores made them take turns.

    Inductor compiles in the process that asks (``TORCHINDUCTOR_COMPILE_THREADS=1``, inherited by the scripts the
    tests start; a value already set is kept): its pool of compile workers, one per core, would start a Python with
    torch in every compiling process of a suite that already fills the cores (the PPO compile test: 94 s of CPU with
    the pool, 79 s without, alone on two cores)."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(1)
        threadpool_limits(1)


def make_site(days: int = 14, n_sockets: int = 6, seed: int = 0, dt_h: float = 1.0, **overrides) -> Site:
    """A synthetic site: ``days`` of train and of test data, sunny days, a daily MOER cycle, random sessions.

    The train split is the first ``days`` local days from 2019-05-01, the test split the next ``days``.
    ``overrides`` are config tables, e.g. ``bess={"capacity_kwh": 0.0}``. With ``dt_h`` below 1 the site steps at
    that step and carries its 5-minute physics series (:func:`_finer_series`): the same hourly means, the same sessions.
    """
    rng = np.random.default_rng(seed)
    tz = "America/Los_Angeles"
    start = pd.Timestamp("2019-05-01").tz_localize(tz).tz_convert("UTC")
    end = (pd.Timestamp("2019-05-01") + pd.Timedelta(days=2 * days)).tz_localize(tz).tz_convert("UTC")
    time = pd.date_range(start, end, freq="h", inclusive="left")
    hour = time.tz_convert(tz).hour.to_numpy()
    pv = np.clip(np.sin((hour - 6) / 12 * np.pi), 0, None) * 0.8 * rng.uniform(0.6, 1.0, len(time))
    moer = 0.25 + 0.12 * np.cos((hour - 13) / 24 * 2 * np.pi) + rng.normal(0, 0.02, len(time))
    hourly = pd.DataFrame(
        {
            "time": time,
            "pv_kw_per_kwp": pv.astype(np.float32),
            "moer_kg_per_kwh": moer.astype(np.float32),
            "moer_fc_h0": moer.astype(np.float32),
            "moer_fc_h1": np.roll(moer, -1).astype(np.float32),
            "moer_fc_h2": np.roll(moer, -2).astype(np.float32),
        }
    )
    rows = []
    for d in range(2 * days):
        day = pd.Timestamp("2019-05-01").tz_localize(tz) + pd.Timedelta(days=d)
        for k in range(rng.integers(n_sockets // 2, 2 * n_sockets)):
            arr = day + pd.Timedelta(hours=float(rng.uniform(6, 12)))
            dep = arr + pd.Timedelta(hours=float(rng.uniform(0.3, 10)))
            rows.append(
                {
                    "session_id": f"s{d}_{k}",
                    "station_id": f"CA-{rng.integers(0, n_sockets + 2)}",
                    "arrival": arr.tz_convert("UTC"),
                    "departure": dep.tz_convert("UTC"),
                    "energy_kwh": np.float32(rng.uniform(1, 30)),
                    "requested_energy_kwh": np.float32(rng.uniform(1, 40)),
                }
            )
    sessions = pd.DataFrame(rows).sort_values("arrival").reset_index(drop=True)
    sessions["arrival"] = pd.to_datetime(sessions.arrival, utc=True).astype("datetime64[ns, UTC]")
    sessions["departure"] = pd.to_datetime(sessions.departure, utc=True).astype("datetime64[ns, UTC]")
    last = (pd.Timestamp("2019-05-01") + pd.Timedelta(days=days - 1)).date().isoformat()
    first_test = (pd.Timestamp("2019-05-01") + pd.Timedelta(days=days)).date().isoformat()
    last_test = (pd.Timestamp("2019-05-01") + pd.Timedelta(days=2 * days - 1)).date().isoformat()
    raw = {
        "name": "synthetic",
        "timezone": tz,
        "pv": {"kwp": 10.0},
        "bess": {"capacity_kwh": 20.0, "power_kw": 10.0},
        "ev": {"n_sockets": n_sockets, "socket_kw": 6.6},
        "grid": {"import_limit_kw": 100.0},
        "splits": {"train": ["2019-05-01", last], "test": [first_test, last_test]},
        "episode": {"train_h": 48},
    }
    for key, value in overrides.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = config_from_dict({**raw, "dt_h": dt_h}, "synthetic")
    five = _finer_series(hourly, seed)
    minutes = round(cfg.dt_h * 60)
    series = hourly if minutes == 60 else _coarser(five, minutes)
    source = {"series": f"synthetic/series_{minutes}min.parquet", "physics": "synthetic/series_5min.parquet"}
    return Site(cfg, series, sessions, source, physics_series=five[["time", "pv_kw_per_kwp", "moer_kg_per_kwh"]])


def _finer_series(hourly: pd.DataFrame, seed: int) -> pd.DataFrame:
    """The 5-minute series of a synthetic hourly one: each hour's PV and MOER spread over its twelve 5-minute steps
    around the hour's value (a ramp of PV within the hour, MOER noise), with the hour's mean kept; the forecasts as
    :func:`_coarser` issues them."""
    rng = np.random.default_rng(seed + 1000)
    n = len(hourly)
    start = pd.DatetimeIndex(hourly.time)[0]
    time = pd.date_range(start, periods=12 * n, freq="5min")
    shape = 1.0 + 0.3 * np.linspace(-1, 1, 12)[None, :] * np.sign(rng.normal(size=(n, 1)))
    pv = hourly.pv_kw_per_kwp.to_numpy(np.float64)[:, None] * shape
    noise = rng.normal(0, 0.03, (n, 12))
    moer = hourly.moer_kg_per_kwh.to_numpy(np.float64)[:, None] + noise - noise.mean(1, keepdims=True)
    five = pd.DataFrame(
        {
            "time": pd.DatetimeIndex(time).astype("datetime64[ns, UTC]"),
            "pv_kw_per_kwp": np.clip(pv, 0, None).ravel().astype(np.float32),
            "moer_kg_per_kwh": np.clip(moer, 0.01, None).ravel().astype(np.float32),
        }
    )
    return _with_forecasts(five, 5)


def _with_forecasts(series: pd.DataFrame, minutes: int) -> pd.DataFrame:
    """``series`` with ``moer_fc_h0..h2``: the true mean MOER of the hour from each step's start, the next hour and the
    one after (the series wraps at its end, as the hourly site's forecasts do)."""
    per_hour = 60 // minutes
    m = series.moer_kg_per_kwh.to_numpy(np.float64)
    c = np.concatenate([[0.0], np.cumsum(np.concatenate([m, m[: 3 * per_hour]]))])
    t = np.arange(len(m))
    out = series.copy()
    for h in range(3):
        lo = t + h * per_hour
        out[f"moer_fc_h{h}"] = ((c[lo + per_hour] - c[lo]) / per_hour).astype(np.float32)
    return out


def _coarser(five: pd.DataFrame, minutes: int) -> pd.DataFrame:
    """The series at a step of ``minutes`` from the 5-minute one: PV and MOER the steps' means, forecasts re-issued."""
    k = minutes // 5
    n = len(five) // k
    coarse = pd.DataFrame(
        {
            "time": pd.DatetimeIndex(five.time)[::k][:n],
            "pv_kw_per_kwp": five.pv_kw_per_kwp.to_numpy(np.float64)[: n * k].reshape(n, k).mean(1).astype(np.float32),
            "moer_kg_per_kwh": five.moer_kg_per_kwh.to_numpy(np.float64)[: n * k]
            .reshape(n, k)
            .mean(1)
            .astype(np.float32),
        }
    )
    return _with_forecasts(coarse, minutes)


DC_SOCKETS = {
    "ev": {
        "n_sockets": 6,
        "socket_kw": 50.0,
        "sockets": [{"count": 1, "kw": 50.0, "stations": "DC-*"}, {"count": 5, "kw": 6.6, "stations": "CA-*"}],
    }
}
"""A :func:`make_site` override: one 50 kW DC socket (no session: no station id matches it) and five Level-2 ones."""


@pytest.fixture
def site() -> Site:
    return make_site()


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table, e.g. one of the [[ev.sockets]] groups
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def write_site(site: Site, folder, physics: bool = True):
    """Write a site to ``folder/<name>.toml`` + ``folder/<name>/{series_<m>min,sessions}.parquet`` (and its 5-minute
    physics series where it has one, unless ``physics`` is False: a site whose study skips the 5-minute scoring, for
    the pipeline tests that check something else); returns the TOML path."""
    import dataclasses
    from pathlib import Path

    folder = Path(folder)
    raw = dataclasses.asdict(site.config)
    raw["data_dir"] = raw["name"]
    lines = [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if vv is not None]
    data = folder / raw["name"]
    data.mkdir(parents=True, exist_ok=True)
    site.series.to_parquet(data / f"series_{round(site.config.dt_h * 60)}min.parquet", index=False)
    if physics and site.physics_series is not None and site.config.dt_h != 5 / 60:
        site.physics_series.to_parquet(data / "series_5min.parquet", index=False)
    site.sessions.to_parquet(data / "sessions.parquet", index=False)
    toml = folder / f"{raw['name']}.toml"
    toml.write_text("\n".join(lines) + "\n")
    return toml


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def machinery_site(folder, days: int = 7, seed: int = 0):
    """A ``days``-day synthetic site written to ``folder`` (its TOML's path) whose study is the uncontrolled site, the
    rule, the oracle and the agents: the MPC family off (``[mpc] enabled = false``) and no 5-minute physics. For the
    tests of the pipeline's machinery (locks, clusters, kills and resumes); the MPC rows and the physics stages run in
    the end-to-end test (``test_pipeline.py``)."""
    return write_site(make_site(days=days, seed=seed, mpc={"enabled": False}), folder, physics=False)


def load_algo(name: str):
    """Import ``algos/<name>.py`` as a module (the algos are scripts, not a package)."""
    import importlib.util
    import sys

    module_name = f"algos_{name}_under_test"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "algos" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def run_algo(name: str, *args: str, timeout: float = 120):
    """Run ``python algos/<name>.py *args`` in a subprocess (one BLAS thread); returns the CompletedProcess."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "algos" / f"{name}.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_compile_reproduces_eager(name: str, site_toml, tmp_path, total_timesteps: int, tiny: list[str]) -> None:
    """Train ``algos/<name>.py`` eagerly and with ``--compile`` (same seed and budget) and check that every
    logged metric agrees up to float rounding: under ``--compile`` the random numbers come from eager's kernels,
    so a seed means the same run on both paths. The compiled run compiles nothing after its hot functions' first
    calls."""
    metrics = {}
    # torch's own cache folder (--compile-cache ""), as before the project's cache: it outlives a test run
    for label, flags in (("eager", []), ("compile", ["--compile", "--compile-cache", ""])):
        out = tmp_path / label
        proc = run_algo(
            name,
            "--site",
            str(site_toml),
            "--output-dir",
            str(out),
            "--total-timesteps",
            str(total_timesteps),
            "--eval-split",
            "none",
            *flags,
            *tiny,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (out / "policy.pt2").is_file()
        if label == "compile":  # each hot function compiled in its first calls, never again (harness.COMPILE_CLOCK)
            assert "compile and capture:" in proc.stdout and "RECOMPILED" not in proc.stdout, proc.stdout[-3000:]
        metrics[label] = pd.read_parquet(out / "metrics.parquet").drop(columns=["wall_s", "sps"])
    eager, compiled = (metrics[k].to_numpy(dtype=float) for k in ("eager", "compile"))
    assert len(eager) >= 2 and np.isfinite(eager[-1]).sum() > 3
    np.testing.assert_allclose(compiled, eager, rtol=1e-3, atol=1e-5)


def doit(args: list[str], site_toml, out, cwd=None, **env):
    """Run ``python -m doit <args>`` for the site ``site_toml`` with outputs under ``out`` (its doit database
    beside ``out``), a training budget of 4096 steps and an embedded Dask cluster of one worker process (the suite's
    workers already fill the cores: a second process would only add its start-up); returns the CompletedProcess.

    ``args`` is the doit command and its arguments, e.g. ``["run", "pipeline", "algos=ppo"]``; ``env`` adds
    environment variables; ``cwd`` runs it in another copy of the project (its code first on ``PYTHONPATH``, so every
    process of the run imports that copy).
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    environ = {
        **os.environ,
        "EVHUB_SITE": str(site_toml),
        "EVHUB_OUTPUT_DIR": str(out),
        "EVHUB_TOTAL_TIMESTEPS": "4096",
        "EVHUB_WORKERS": "1",
        **env,
    }
    environ.pop("DASK_SCHEDULER_ADDRESS", None)
    if cwd is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(cwd), *filter(None, [environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "doit", args[0], "--db-file", str(Path(out).parent / "doit.db"), *args[1:]]
    return subprocess.run(cmd, cwd=cwd or ROOT, env=environ, capture_output=True, text=True, timeout=600)


def files_under(folder) -> list:
    """Every file below ``folder`` (sorted paths; [] when the folder does not exist)."""
    from pathlib import Path

    folder = Path(folder)
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture(scope="module")
def site_toml(tmp_path_factory):
    """A one-week synthetic site with 6 sockets written to disk, shared by the tests of one module."""
    return write_site(make_site(days=7, n_sockets=6), tmp_path_factory.mktemp("site"))


def tiny_run(name: str, site_toml, tmp_path_factory, *args: str):
    """Train ``algos/<name>.py`` on ``site_toml`` with ``args`` into a fresh folder; returns ``(folder, process)``."""
    out = tmp_path_factory.mktemp("run") / name
    return out, run_algo(name, "--site", str(site_toml), "--output-dir", str(out), *args)


TINY_PPO_ARGS = (
    "--num-envs 4 --num-steps 48 --num-minibatches 2 --update-epochs 2 --hidden-size 16 --checkpoint-every 2 --no-cuda"
)
"""PPO flags (``algo_args``) of the pipeline fault tests: 192 env steps per iteration, a checkpoint every 2."""


def tiny_pipeline_env(
    site_toml,
    out,
    total_timesteps: int,
    scheduler: str | None = None,
    algo: str = "ppo",
    algo_args: str = TINY_PPO_ARGS,
) -> dict:
    """Environment of a ``doit run pipeline`` that trains only ``algo`` (seed 1; PPO with :data:`TINY_PPO_ARGS`
    unless told otherwise), on ``scheduler``'s cluster or an embedded one of one worker process (as :func:`doit`)."""
    import os

    env = {
        **os.environ,
        "EVHUB_SITE": str(site_toml),
        "EVHUB_OUTPUT_DIR": str(out),
        "EVHUB_ALGOS": algo,
        "EVHUB_SEEDS": "1",
        "EVHUB_TOTAL_TIMESTEPS": str(total_timesteps),
        "EVHUB_ALGO_ARGS": algo_args,
        "EVHUB_WORKERS": "1",
    }
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    if scheduler:
        env["DASK_SCHEDULER_ADDRESS"] = scheduler
    return env


def wait_for_checkpoint(ckpt, proc, iteration: int, log=None, timeout: float = 240) -> None:
    """Wait until ``ckpt`` records at least ``iteration`` while ``proc`` still runs (else fail, with ``log``'s end)."""
    import time

    import torch

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if ckpt.is_file() and torch.load(ckpt, weights_only=False)["iteration"] >= iteration:
            return
        time.sleep(0.2)
    raise AssertionError(
        f"no checkpoint at iteration {iteration} while running: {log.read_text()[-3000:] if log else ''}"
    )


def training_process(run_dir):
    """The running ``algos/*.py`` process writing into ``run_dir`` (a ``psutil.Process``)."""
    import psutil

    return next(
        p
        for p in psutil.process_iter(["cmdline"])
        if str(run_dir) in " ".join(p.info["cmdline"] or []) and "algos" in " ".join(p.info["cmdline"])
    )


def assert_resumed_once_to_the_end(run_dir, killed_at: int, total_timesteps: int) -> None:
    """A pipeline run's ``train.log`` holds two attempts, the second with ``--resume`` from at least global step
    ``killed_at``, and its ``metrics.parquet`` ends at ``total_timesteps`` with unique, increasing steps."""
    log = (run_dir / "train.log").read_text()
    assert log.count("==== ") == 2, log[-3000:]
    assert "--resume" in log.split("==== ")[2].splitlines()[0]
    resumed = [line for line in log.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1 and int(resumed[0].split("global_step ")[1].split(",")[0]) >= killed_at, resumed
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    assert metrics.global_step.iloc[-1] == total_timesteps
    assert metrics.global_step.is_monotonic_increasing and metrics.global_step.is_unique


# ---------------------------------------------------------------------------------------------- the agents' tiny runs
PPO_TINY = [
    "--num-envs", "4",
    "--num-steps", "48",
    "--num-minibatches", "2",
    "--update-epochs", "2",
    "--hidden-size", "16",
    "--checkpoint-every", "1",
    "--no-cuda",
]  # fmt: skip
"""PPO's tiny budget: 4 envs x 48 steps (one synthetic episode) per iteration."""

A2C_TINY = [
    "--num-envs", "4",
    "--num-steps", "8",
    "--hidden-size", "16",
    "--log-every", "6",
    "--checkpoint-every", "6",
    "--no-cuda",
]  # fmt: skip
"""A2C's tiny budget: 4 envs x 8 steps per update; a log row every 6 updates = 48 steps, one synthetic episode."""

SAC_TINY = [
    "--preset", "cpu",
    "--num-envs", "4",
    "--hidden-size", "16",
    "--batch-size", "32",
    "--buffer-size", "500",
    "--learning-starts", "64",
    "--gradient-steps", "2",
    "--log-every", "48",
    "--checkpoint-every", "48",
    "--no-cuda",
]  # fmt: skip
"""SAC's tiny budget: 4 envs; a log every 48 iterations (one synthetic episode); learning from step 64."""

DQN_TINY = [
    "--num-envs", "4",
    "--num-steps", "2",
    "--gradient-steps", "2",
    "--batch-size", "32",
    "--buffer-size", "100",  # smaller than the run: the buffer wraps around
    "--learning-starts", "64",
    "--target-network-frequency", "40",
    "--hidden-size", "16",
    "--log-every", "8",
    "--checkpoint-every", "16",
    "--no-cuda",
]  # fmt: skip
"""DQN's tiny budget: 4 envs x 2 steps (8 env steps) and 2 gradient steps per iteration."""

ALGO_TINY = {"ppo": PPO_TINY, "a2c": A2C_TINY, "sac": SAC_TINY, "dqn": DQN_TINY}
"""Each agent's tiny settings, by script name."""

TINY_RUN_STEPS = {"ppo": 384, "a2c": 384, "sac": 384, "dqn": 256}
"""The env steps of each agent's tiny run (:func:`tiny_runs`)."""


@pytest.fixture(scope="session")
def tiny_site_toml(tmp_path_factory):
    """The one-week synthetic site of :func:`site_toml` (6 sockets), written once for the session's tiny runs."""
    return write_site(make_site(days=7, n_sockets=6), tmp_path_factory.mktemp("tiny_site"))


@pytest.fixture(scope="session")
def tiny_runs(tiny_site_toml, tmp_path_factory):
    """``tiny_runs(name)``: ``(folder, process)`` of ``algos/<name>.py`` trained on :func:`tiny_site_toml` with
    :data:`ALGO_TINY` for :data:`TINY_RUN_STEPS` steps, evaluated on the test split. Trained at the first call, then
    shared by every test of the session: a test that writes into the run works on a copy of its folder."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = tiny_run(
                name, tiny_site_toml, tmp_path_factory, "--total-timesteps", str(TINY_RUN_STEPS[name]), *ALGO_TINY[name]
            )
        return done[name]

    return get


def changed_future(site, split: str, cut: int):
    """A copy of ``site`` whose MOER (and MOER forecasts) from step ``cut`` of ``split`` on are scrambled and whose
    sessions arriving from that step on are replaced by others."""
    import numpy as np
    import pandas as pd

    from envs.schemas import MOER_5MIN_COLUMNS
    from envs.site import Site

    start, _ = site.config.split_bounds(split)
    t_cut = start + cut * pd.Timedelta(minutes=round(site.config.dt_h * 60))
    hourly = site.series.copy()
    later = hourly.time >= t_cut
    rng = np.random.default_rng(7)
    for c in ("moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2", *MOER_5MIN_COLUMNS):
        if c in hourly.columns:
            hourly.loc[later, c] = rng.uniform(0.0, 0.7, later.sum()).astype(np.float32)
    s = site.sessions
    keep = s[s.arrival < t_cut]
    moved = s[s.arrival >= t_cut].copy()
    moved["arrival"] += pd.Timedelta(hours=2)
    moved["departure"] += pd.Timedelta(hours=5)
    moved["energy_kwh"] = (moved.energy_kwh * 0.5).astype(np.float32)
    sessions = pd.concat([keep, moved], ignore_index=True)
    physics = None if site.physics_series is None else site.physics_series.copy()
    if physics is not None:
        late = physics.time >= t_cut
        physics.loc[late, "moer_kg_per_kwh"] = rng.uniform(0.0, 0.7, late.sum()).astype(np.float32)
    return Site(site.config, hourly, sessions, dict(site.source), physics_series=physics)


def perturbed_future(site: Site, split: str, cut: int, seed: int = 1) -> Site:
    """``site`` with its future changed from step ``cut`` of ``split`` on: the realised MOER of hours >= cut and
    the forecast rows issued after it (the row issued at ``cut`` is known at ``cut``), sessions arriving after
    ``cut`` dropped, and new sessions arriving after it."""
    rng = np.random.default_rng(seed)
    start, _ = site.config.split_bounds(split)
    t_cut = start + cut * pd.Timedelta(minutes=round(site.config.dt_h * 60))
    hourly = site.series.copy()
    realised = hourly.time >= t_cut
    issued_later = hourly.time > t_cut
    hourly.loc[realised, "moer_kg_per_kwh"] = rng.uniform(0.0, 1.0, realised.sum()).astype(np.float32)
    for c in ("moer_fc_h0", "moer_fc_h1", "moer_fc_h2"):
        hourly.loc[issued_later, c] = rng.uniform(0.0, 1.0, issued_later.sum()).astype(np.float32)
    physics = None if site.physics_series is None else site.physics_series.copy()
    if physics is not None:
        later = physics.time >= t_cut
        physics.loc[later, "moer_kg_per_kwh"] = rng.uniform(0.0, 1.0, later.sum()).astype(np.float32)
    sessions = site.sessions[site.sessions.arrival <= t_cut]
    stations = sorted(site.sessions.station_id.unique())
    new = pd.DataFrame(
        {
            "session_id": [f"new{i}" for i in range(20)],
            "station_id": [stations[i % len(stations)] for i in range(20)],
            "arrival": [t_cut + pd.Timedelta(hours=1.5 + 3 * i) for i in range(20)],
            "departure": [t_cut + pd.Timedelta(hours=6.5 + 3 * i) for i in range(20)],
            "energy_kwh": np.full(20, 25.0, np.float32),
            "requested_energy_kwh": np.full(20, 30.0, np.float32),
        }
    )
    for c in ("arrival", "departure"):
        new[c] = new[c].astype(sessions[c].dtype)
    sessions = (
        pd.concat([sessions, new], ignore_index=True).sort_values("arrival", kind="mergesort").reset_index(drop=True)
    )
    return Site(site.config, hourly, sessions, dict(site.source), physics_series=physics)


def observations(site: Site, split: str, steps: int, **env_kwargs):
    """Observations of ``steps`` steps under a fixed, seeded action sequence, shape ``(steps + 1, B, obs_dim)``."""
    import torch

    from envs.evhub import EVHubVectorEnv

    env = EVHubVectorEnv(site=site, split=split, dtype=torch.float64, **env_kwargs)
    g = torch.Generator().manual_seed(0)
    obs, _ = env.reset(seed=3, options={"start_steps": [0] * env.num_envs} if not env.full_split else None)
    out = [obs]
    for _ in range(steps):
        if env.action_mode == "discrete":
            a = torch.randint(0, env.single_action_space.n, (env.num_envs,), generator=g)
        else:
            a = torch.rand((env.num_envs, env.single_action_space.shape[0]), generator=g, dtype=torch.float64) * 2 - 1
        obs, *_ = env.step(a)
        out.append(obs)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------- the central system
CSMS_FAST_HASH = 2**4
"""scrypt's cost in the central system tests' stores (the production default is 2**14: 50 ms a hash)."""
CSMS_HOURS = 24
"""The central system's shorter runs: the first day of :func:`csms_site`'s test split (every car has left by its
end)."""


def csms_site(days: int = 2, dt_h: float = 1.0) -> Site:
    """The central system tests' small synthetic site: 6 sockets, a 6 h window, a test split of ``days`` days."""
    return make_site(days=days, n_sockets=6, mpc={"horizon_h": 6}, dt_h=dt_h)


def csms_store(path):
    """A central system's store at ``path`` writing cheap password hashes (:data:`CSMS_FAST_HASH`)."""
    from pipeline.live.store import Store

    return Store(path, scrypt_n=CSMS_FAST_HASH)


def study_co2(site: Site, hours: float | None = None) -> tuple[float, float]:
    """The study's mpc run over the test split: its CO2 (kg) and unserved energy (kWh), over its steps in the first
    ``hours``."""
    from envs import timestep
    from pipeline.control import registry

    _, traces = registry.get("mpc").simulate(site, "test")
    traces = traces.iloc[: None if hours is None else timestep.steps(hours, site.config.dt_h)]
    return float(traces.co2_kg.sum()), float(traces.unserved_kwh.sum())


def assert_served(site: Site, res, central, hours: float | None = None) -> None:
    """A simulated run served every car: nothing unserved, no step without a profile, every session one transaction,
    every transaction stopped with its driver's needs."""
    from envs import timestep

    ses = site.split("test").sessions
    steps = len(site.split("test").time) if hours is None else timestep.steps(hours, site.config.dt_h)
    ses = ses[~ses.rejected & (ses.arrival_step < steps)]
    assert res.unserved_kwh < 1e-3
    assert res.fallbacks == 0
    txs = central.store.transactions()
    assert res.started == res.stopped == len(txs) == len(ses) > 0
    assert all(t["stop_time"] is not None and t["needs_source"] == "driver" for t in txs)


@contextlib.asynccontextmanager
async def csms_serving(tmp_path, tls=None):
    """A central system on a free port of localhost (with its HTTP endpoint) over :func:`csms_site`, one charge point
    and the site controller registered; yields ``(central, port, charge point id, {id: password})``."""
    from pipeline.live import csms
    from pipeline.live.simsite import register
    from pipeline.live.sources import SiteClock, SiteDataFeed, default_mapping

    site = csms_site()
    store = csms_store(tmp_path / "csms.sqlite")
    cp = next(iter(default_mapping(site)))[0]
    passwords = {cp: "good-password", "site": "site-password"}
    register(store, passwords)
    central = csms.CentralSystem(site, store, SiteClock(), SiteDataFeed(site), default_mapping(site))
    server = await central.start("127.0.0.1", 0, tls, http_port=0)
    try:
        yield central, server.sockets[0].getsockname()[1], cp, passwords
    finally:
        await central.stop()


async def csms_boots(url: str, cp: str, password: str, tls=None, ocpp: str = "1.6") -> str:
    """A good client of OCPP ``ocpp`` (``"1.6"`` or ``"2.0.1"``): connects and boots; returns the registration
    status."""
    import asyncio

    from websockets.asyncio.client import connect

    from pipeline.live.simsite import SimChargePoint, SimChargePoint201, basic_auth

    kind = SimChargePoint201 if ocpp == "2.0.1" else SimChargePoint
    headers = {"Authorization": basic_auth(cp, password)}
    async with connect(f"{url}/{cp}", subprotocols=[kind.SUBPROTOCOL], additional_headers=headers, ssl=tls) as ws:
        client = kind(cp, ws)
        task = asyncio.create_task(client.start())
        status = await client.boot()
        task.cancel()
        return status


async def csms_refused(url: str, headers: dict, subprotocol: str = "ocpp1.6") -> int:
    """The HTTP status of a handshake that must be refused."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as err:
        async with connect(url, subprotocols=[subprotocol], additional_headers=headers):
            pass
    return err.value.response.status_code


async def csms_callerror(ws, frame: str, want: str) -> None:
    """Send ``frame`` over the open connection ``ws`` and check the answer is a CALLERROR (message type 4) for the
    frame's id ``"7"`` (``"-1"`` where the frame could not be read) whose error code starts with ``want``."""
    import json

    await ws.send(frame)
    answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert answer[0] == 4 and answer[1] in ("7", "-1"), answer
    assert answer[2].startswith(want), answer


def self_signed_cert(folder) -> tuple:
    """A self-signed certificate for 127.0.0.1 and its key, made by the ``openssl`` command in ``folder``:
    ``(cert.pem, key.pem)``; the test is skipped where ``openssl`` is not installed."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificate to test TLS with")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days",
         "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
         str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
