"""The central system under load: the site's simulated charge points replaying its first hours (each hour planned
and sent, as in :mod:`benchmarks.csms_week`) while more charge points, up to ``charge_points`` in all, each send one
``Heartbeat`` a second, all on localhost in one process.

What is measured: the plan's latency (:func:`pipeline.live.make_plan`'s wall time inside the central system) and the
hour's round trip (the site's ``Clock`` message to its answer: the state read from the store, the plan, every profile
sent and acknowledged), their p50 and p99; the heartbeats' round trip p50/p99; the process's peak memory (MiB: the
central system and the clients together).

Run ``python -m benchmarks.csms_load --help``; the table goes to ``outputs/bench/csms_load.parquet``.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks.common import machine_info, peak_rss_mb, save_table

COLUMNS = (
    "site", "charge_points", "hours", "plan_p50_s", "plan_p99_s", "hour_p50_s", "hour_p99_s", "heartbeat_p50_s",
    "heartbeat_p99_s", "heartbeats", "peak_rss_mb", "wall_s",
)  # fmt: skip
"""Columns: the site, the charge points connected, the hours planned; latency p50/p99 (s) of the plan, of the hour's
round trip and of a heartbeat; the heartbeats answered; the peak memory (MiB) and the wall time (s)."""


async def _load(site, charge_points: int, hours: int, db: Path) -> dict:
    from ocpp.v16 import call

    from pipeline.live.csms import CentralSystem, CsmsOptions
    from pipeline.live.simsite import SimSite, register, site_passwords
    from pipeline.live.sources import SiteClock, SiteDataFeed, default_mapping
    from pipeline.live.store import Store

    store = Store(db)
    passwords = site_passwords(site)
    extra = {f"load-{k}": f"pw-{k}" for k in range(max(charge_points - len(passwords) + 1, 0))}
    register(store, passwords | extra)
    central = CentralSystem(site, store, SiteClock(), SiteDataFeed(site), default_mapping(site), CsmsOptions())
    server = await central.start("127.0.0.1", 0)
    url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    sim = SimSite(site, url, passwords | extra, hours=hours)
    for cp_id in extra:
        await sim.connect(cp_id)
    beats: list[float] = []
    hour_s: list[float] = []
    done = asyncio.Event()

    async def beat(cp_id: str, phase: float) -> None:
        await asyncio.sleep(phase)
        while not done.is_set():
            t0 = time.perf_counter()
            await sim.cps[cp_id].call(call.Heartbeat())
            beats.append(time.perf_counter() - t0)
            await asyncio.sleep(max(1.0 - (time.perf_counter() - t0), 0.0))

    original = sim.hour

    async def timed_hour(t: int) -> None:
        t0 = time.perf_counter()
        await original(t)
        hour_s.append(time.perf_counter() - t0)

    sim.hour = timed_hour
    tasks = [asyncio.create_task(beat(c, k / max(len(extra), 1))) for k, c in enumerate(extra)]
    t0 = time.perf_counter()
    try:
        await sim.run()
    finally:
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await central.stop()
    p = lambda x, q: float(np.percentile(x, q)) if len(x) else float("nan")  # noqa: E731
    lat = central.plan_latency_s
    return {
        "site": site.config.name,
        "charge_points": len(sim.cps) - 1,
        "hours": hours,
        "plan_p50_s": p(lat, 50),
        "plan_p99_s": p(lat, 99),
        "hour_p50_s": p(hour_s, 50),
        "hour_p99_s": p(hour_s, 99),
        "heartbeat_p50_s": p(beats, 50),
        "heartbeat_p99_s": p(beats, 99),
        "heartbeats": len(beats),
        "peak_rss_mb": peak_rss_mb(),
        "wall_s": time.perf_counter() - t0,
    }


def run(site: str = "caltech", charge_points: int = 500, hours: int = 48, out_dir: str | None = None) -> pd.DataFrame:
    """Run the load; print one line and write the table."""
    from envs.site import load_site

    s = load_site(site)
    with tempfile.TemporaryDirectory() as tmp:
        row = asyncio.run(_load(s, charge_points, hours, Path(tmp) / "csms.sqlite"))
    print(
        f"{row['charge_points']} charge points on {row['site']}, {hours} h planned: "
        f"plan p50 {row['plan_p50_s']:.3f} s, p99 {row['plan_p99_s']:.3f} s; "
        f"hour round trip p50 {row['hour_p50_s']:.3f} s, p99 {row['hour_p99_s']:.3f} s; "
        f"heartbeat p50 {1e3 * row['heartbeat_p50_s']:.1f} ms, p99 {1e3 * row['heartbeat_p99_s']:.1f} ms "
        f"({row['heartbeats']}); peak memory {row['peak_rss_mb']:.0f} MiB; {row['wall_s']:.1f} s",
        flush=True,
    )
    df = pd.DataFrame([row], columns=list(COLUMNS))
    df["machine"] = json.dumps(machine_info())
    save_table(df, "csms_load", out_dir)
    return df


@dataclass
class Args:
    """The central system under load: the site's charge points replaying its hours, more sending a heartbeat a
    second."""

    site: str = "caltech"
    """site: a shipped site name or a path to a site TOML file"""
    charge_points: int = 500
    """charge points connected in all (the site's own, then heartbeat-only ones)"""
    hours: int = 48
    """hours of the test split replayed (each planned and sent)"""
    out_dir: str | None = None
    """folder of csms_load.parquet (None: outputs/bench/)"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro)."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    return run(args.site, args.charge_points, args.hours, args.out_dir)


if __name__ == "__main__":
    main()
