"""The central system under load, measured on its own process: ``evhub-csms`` runs as its own process (``python -m
pipeline.live.csms --clock site``) and its clients in others, all on localhost: the simulated site (the site's charge
points and its site controller, :mod:`pipeline.live.simsite`) replays the split's first ``hours`` in this process,
each step of the site planned and sent (or the last plan held) as in :mod:`benchmarks.csms_week`, while
``charge_points`` more charge points each send one ``Heartbeat`` a second from ``workers`` worker processes. With
``--ocpp 2.0.1`` the heartbeat charge points and the site's own speak OCPP 2.0.1 (the site controller 1.6J); ``mix``
alternates them.

What is measured, over the replay (the connections made before it): the plan's latency (its wall time inside the
central system, from the store's ``plans`` table) and the step's round trip (the site's ``Clock`` message to its
answer: the state read from the store, the plan or the last plan held, every profile sent and acknowledged), their
p50 and p99; the
heartbeats' round trip p50/p99 and the heartbeats answered a second; the central system's CPU time over the replay
(as a share of one core) and its peak memory (``VmHWM`` of its process, MiB). The passwords are stored at the
production scrypt cost; connecting the charge points (a hash check each) is timed apart (``connect_s``).

Run ``python -m benchmarks.csms_load --help`` (Linux: it reads ``/proc``); the table goes to
``outputs/bench/csms_load.parquet``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from benchmarks.common import machine_info, save_table

COLUMNS = (
    "site", "ocpp", "charge_points", "hours", "workers", "connect_s", "replay_s", "plan_p50_s", "plan_p99_s",
    "step_p50_s", "step_p99_s", "heartbeat_p50_s", "heartbeat_p99_s", "heartbeats", "heartbeats_per_s",
    "csms_cpu_share", "csms_peak_rss_mb",
)  # fmt: skip
"""Columns: the site, what the charge points spoke (``1.6``, ``2.0.1``, ``mix``), the heartbeat charge points, the
hours replayed, the heartbeat worker processes; the time to connect them all and the replay's wall time (s); latency
p50/p99 (s) of the plan, of the step's round trip and of a heartbeat; the heartbeats answered during the replay, a
second; the central system's CPU time over the replay / its wall time (1.0: one core busy) and its peak memory
(MiB)."""


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU time of a process, s (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_peak_rss_mb(pid: int) -> float:
    """Peak resident memory of a process (``VmHWM``), MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


async def _connect(url: str, cp_id: str, password: str, version: str):
    """Connect and boot a heartbeat-only charge point of OCPP ``version`` (``1.6``, ``2.0.1``); returns it (its session
    running)."""
    from websockets.asyncio.client import connect

    from pipeline.live.simsite import SimChargePoint, SimChargePoint201, basic_auth

    kind = SimChargePoint201 if version == "2.0.1" else SimChargePoint
    ws = await connect(
        f"{url}/{cp_id}", subprotocols=[kind.SUBPROTOCOL], compression=None, open_timeout=120,
        additional_headers={"Authorization": basic_auth(cp_id, password)},
    )  # fmt: skip
    cp = kind(cp_id, ws)
    cp.session = asyncio.create_task(cp.start())
    await cp.boot()
    return cp


async def _beats(url: str, ids: dict[str, str], ready, go, stop, out: str, versions: dict[str, str]) -> None:
    cps = {}
    for k in range(0, len(ids), 25):
        got = await asyncio.gather(*(_connect(url, i, ids[i], versions[i]) for i in list(ids)[k : k + 25]))
        cps.update({cp.id: cp for cp in got})
    ready.set()
    while not go.is_set():
        await asyncio.sleep(0.05)
    rtt: list[float] = []

    async def beat(cp_id: str, phase: float) -> None:
        await asyncio.sleep(phase)
        while not stop.is_set():
            t0 = time.perf_counter()
            await cps[cp_id].heartbeat()
            rtt.append(time.perf_counter() - t0)
            await asyncio.sleep(max(1.0 - (time.perf_counter() - t0), 0.0))

    tasks = [asyncio.create_task(beat(c, k / len(ids))) for k, c in enumerate(ids)]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks, return_exceptions=True)
    for cp in cps.values():
        await cp.connection.close()
        cp.session.cancel()
    np.save(out, np.asarray(rtt))


def heartbeat_worker(url: str, ids: dict[str, str], ready, go, stop, out: str, versions: dict[str, str]) -> None:
    """A worker process: connect ``ids`` (``{id: password}``, each in its OCPP version of ``versions``: ``1.6`` or
    ``2.0.1``), set ``ready``; from ``go`` until ``stop``, a heartbeat a second from each; the round trips (s) to
    ``out`` (``.npy``)."""
    asyncio.run(_beats(url, ids, ready, go, stop, out, versions))


def _start_csms(toml: str, db: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    """Start ``python -m pipeline.live.csms`` (``mpc``, site clock, any free port); returns it and its address.

    Raises:
        RuntimeError: it ended before it listened (its stderr's tail in the message).
    """
    cmd = [sys.executable, "-m", "pipeline.live.csms", "--site", toml, "--controller", "mpc", "--clock", "site"]
    cmd += ["--port", "0", "--db", str(db), "--battery-file", str(tmp / "battery.json")]
    err = open(tmp / "csms.err", "w")  # noqa: SIM115 - the process writes to it until it ends
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"evhub-csms did not start: {(tmp / 'csms.err').read_text()[-2000:]}")
    return proc, line.split("listening on ", 1)[1].split("/<", 1)[0]


def _load(site, toml: str, charge_points: int, hours: float, workers: int, tmp: Path, ocpp: str = "1.6") -> dict:
    """One run (module docstring) in folder ``tmp``: its row of :data:`COLUMNS`."""
    from pipeline.live.simsite import SimSite, ocpp_versions, register, site_passwords
    from pipeline.live.store import Store

    passwords = site_passwords(site)
    extra = {f"load-{k}": f"pw-{k}" for k in range(charge_points)}
    versions = ocpp_versions(extra, ocpp)
    store = Store(tmp / "csms.sqlite")
    register(store, passwords | extra)  # the production scrypt cost
    proc, url = _start_csms(toml, tmp / "csms.sqlite", tmp)
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    shares = [dict(list(extra.items())[k::workers]) for k in range(workers)]
    procs, readies = [], []
    t0 = time.perf_counter()
    for k, ids in enumerate(shares):
        ready = ctx.Event()
        out = str(tmp / f"beats-{k}.npy")
        p = ctx.Process(target=heartbeat_worker, args=(url, ids, ready, go, stop, out, versions))
        p.start()
        procs.append(p)
        readies.append(ready)
    sim = SimSite(site, url, passwords, hours=hours, ocpp=ocpp)
    step_s: list[float] = []
    original = sim.tick
    window: dict[str, float] = {}

    async def timed_step(t: int) -> None:
        if t == 0:  # the site's charge points connected: the heartbeats start, the window opens
            go.set()
            window.update(cpu=_proc_cpu_s(proc.pid), wall=time.perf_counter())
        h0 = time.perf_counter()
        await original(t)
        step_s.append(time.perf_counter() - h0)

    sim.tick = timed_step
    try:
        for ready in readies:
            if not ready.wait(900):
                raise RuntimeError("the heartbeat workers did not connect in 15 minutes")
        connect_s = time.perf_counter() - t0
        asyncio.run(sim.run())
        replay_s, cpu = time.perf_counter() - window["wall"], _proc_cpu_s(proc.pid) - window["cpu"]
        rss = _proc_peak_rss_mb(proc.pid)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
        proc.terminate()
        proc.wait()
    beats = np.concatenate([np.load(tmp / f"beats-{k}.npy") for k in range(workers)])
    lat = [p["wall_s"] for p in store.plans()]
    store.close()
    q = lambda x, p: float(np.percentile(x, p)) if len(x) else float("nan")  # noqa: E731
    return {
        "site": site.config.name,
        "ocpp": ocpp,
        "charge_points": len(extra),
        "hours": hours,
        "workers": workers,
        "connect_s": connect_s,
        "replay_s": replay_s,
        "plan_p50_s": q(lat, 50),
        "plan_p99_s": q(lat, 99),
        "step_p50_s": q(step_s, 50),
        "step_p99_s": q(step_s, 99),
        "heartbeat_p50_s": q(beats, 50),
        "heartbeat_p99_s": q(beats, 99),
        "heartbeats": len(beats),
        "heartbeats_per_s": len(beats) / replay_s,
        "csms_cpu_share": cpu / replay_s,
        "csms_peak_rss_mb": rss,
    }


def run(
    site: str = "caltech", charge_points: int = 500, hours: float = 168, workers: int = 2, out_dir: str | None = None,
    ocpp: str = "1.6",
) -> pd.DataFrame:  # fmt: skip
    """Run the load; print one line and write the table.

    Raises:
        RuntimeError: the central system did not start, or the workers did not connect.
        LiveError: ``ocpp`` not one of ``1.6``, ``2.0.1``, ``mix``.
    """
    from envs.site import load_site
    from pipeline.live.simsite import ocpp_versions

    ocpp_versions([], ocpp)  # a bad choice ends here, before the run
    s = load_site(site)
    toml = str(Path(site).resolve()) if site.endswith(".toml") else site
    with tempfile.TemporaryDirectory() as tmp:
        row = _load(s, toml, charge_points, hours, workers, Path(tmp), ocpp)
    print(
        f"OCPP {ocpp}: {row['charge_points']} heartbeat charge points ({workers} processes), {row['site']}'s replaying "
        f"{hours:g} h "
        f"in {row['replay_s']:.1f} s (connecting {row['connect_s']:.1f} s): plan p50 {row['plan_p50_s']:.3f} s, p99 "
        f"{row['plan_p99_s']:.3f} s; step round trip p50 {row['step_p50_s']:.3f} s, p99 {row['step_p99_s']:.3f} s; "
        f"heartbeat p50 {1e3 * row['heartbeat_p50_s']:.1f} ms, p99 {1e3 * row['heartbeat_p99_s']:.1f} ms "
        f"({row['heartbeats_per_s']:.0f} a second); the central system: {100 * row['csms_cpu_share']:.0f} % of a "
        f"core, peak memory {row['csms_peak_rss_mb']:.0f} MiB",
        flush=True,
    )
    df = pd.DataFrame([row], columns=list(COLUMNS))
    df["machine"] = json.dumps(machine_info())
    save_table(df, "csms_load", out_dir)
    return df


@dataclass
class Args:
    """The central system under load, in its own process: the site's charge points replaying its hours, more sending
    a heartbeat a second from worker processes."""

    site: str = "caltech"
    """site: a shipped site name or a path to a site TOML file"""
    charge_points: int = 500
    """heartbeat charge points (one a second each), besides the site's own replaying its hours"""
    hours: float = 168
    """hours of the test split replayed, whole steps of the site (each step planned and sent, or the last plan held)"""
    workers: int = 2
    """processes sending the heartbeats"""
    out_dir: str | None = None
    """folder of csms_load.parquet (None: outputs/bench/)"""
    ocpp: Literal["1.6", "2.0.1", "mix"] = "1.6"
    """what the heartbeat charge points and the site's own speak: OCPP 1.6J, 2.0.1, or a mix (alternating in the
    order of their ids); the site controller speaks 1.6J"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro)."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    return run(args.site, args.charge_points, args.hours, args.workers, args.out_dir, args.ocpp)


if __name__ == "__main__":
    main()
