"""A week of a site through the central system (``evhub-csms``) against the study's run of the same controller.

What is run: the central system (site clock, its MOER feed the site's data files or, with ``--feed watttime``, a
client of the grid-carbon service's local stand-in serving the site's MOER record on a free port, its time the
site's: :mod:`pipeline.live.watttime_standin`; its store in a temporary folder) and the simulated site
(:mod:`pipeline.live.simsite`: the site's charge points as OCPP clients on localhost, 1.6J, 2.0.1 or a mix of both:
``--ocpp``) over the first ``days`` days of the split, in one event loop. The reference is the study's
own run of the controller (:meth:`pipeline.control.registry.Controller.simulate`) over a copy of the site whose split
ends two days after the week (the plans of the week never reach that end, so they are the full split's), the CO2 of
its steps in the first ``days * 24`` hours. Both run at the site's step (its TOML's ``dt_h``).

Run ``python -m benchmarks.csms_week --help``; the table goes to ``outputs/bench/csms_week.parquet``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd

from benchmarks.common import machine_info, save_table

COLUMNS = (
    "site", "controller", "ocpp", "feed", "hours", "csms_co2_kg", "study_co2_kg", "diff_kg", "csms_unserved_kwh",
    "study_unserved_kwh", "sessions", "transactions", "transactions_201", "plans", "plan_p50_s", "plan_p99_s", "wall_s",
    "outage_h", "feed_late_steps", "plans_failed",
)  # fmt: skip
"""Columns: the site, controller, what the charge points spoke (``1.6``, ``2.0.1``, ``mix``), the MOER feed (``files``,
``watttime``) and the hours run; the
week's CO2 (kg) and unserved energy (kWh) through the central system and in the study's run; the sessions of the
week (those the site took), the transactions the central system recorded (of them, 2.0.1's), its plans (new plans:
between them the last one holds), their latency (s) and the run's wall time (s); with ``--outage-h``, the hour the
service went down (NaN: none), the steps planned on the fall-back (the store's ``moer_feed_late`` events) and the plans
that failed."""


def study_week(site, controller: str, split: str, hours: float) -> tuple[float, float]:
    """The study's run of ``controller`` over the first ``hours`` of ``split`` (its steps of the site's ``dt_h``):
    ``(co2_kg, unserved_kwh)``."""
    from envs import timestep
    from envs.site import Site
    from pipeline.control import registry

    cfg = site.config
    start = cfg.split_bounds(split)[0].tz_convert(cfg.timezone)
    last = (start + pd.Timedelta(hours=hours) + pd.Timedelta(days=1)).date().isoformat()
    splits = {s: getattr(cfg.splits, s) for s in ("train", "test")}
    splits[split] = (start.date().isoformat(), last)
    short = Site(cfg.replace(splits=splits), site.series, site.sessions, dict(site.source))
    _, traces = registry.get(controller).simulate(short, split)
    week = traces.iloc[: timestep.steps(hours, cfg.dt_h)]
    return float(week.co2_kg.sum()), float(week.unserved_kwh.sum())


@contextlib.contextmanager
def moer_service(site, feed: str, split: str, hours: float, outage_h: float | None = None):
    """The run's MOER feed and the simulated site's hooks: ``(None, None)`` for the site's files; for ``watttime`` the
    feed of a client of the stand-in serving the site's record (fresh credentials, a free port) and the hooks that set
    the stand-in's time to each step's (:func:`pipeline.live.watttime_standin.following`). ``outage_h``: the service
    is down (503) for the hour from that many hours after the split's start, late by an hour over the next one, then
    back.

    Raises:
        LiveError: ``feed`` neither ``files`` nor ``watttime``.
    """
    from envs import timestep
    from pipeline.live.state import LiveError

    if feed == "files":
        yield None, None
        return
    if feed != "watttime":
        raise LiveError(f"--feed: {feed!r} is neither files nor watttime")
    from pipeline.live.watttime_standin import Outage, following, local_service

    outages = ()
    if outage_h is not None:
        t0 = site.config.split_bounds(split)[0] + pd.Timedelta(hours=outage_h)
        h = pd.Timedelta(hours=1)
        outages = (Outage(t0, t0 + h, "down"), Outage(t0 + h, t0 + 2 * h, "late", lag=h))
    with local_service(site, split, outages=outages) as (standin, moer):
        yield moer, following(standin, timestep.steps(hours, site.config.dt_h))


def run(
    site: str = "caltech", controller: str = "mpc", days: int = 7, split: str = "test", out_dir: str | None = None,
    ocpp: str = "1.6", feed: str = "files", outage_h: float | None = None,
) -> pd.DataFrame:  # fmt: skip
    """Run the week both ways; print one line and write the table.

    Raises:
        LiveError: ``ocpp`` not one of ``1.6``, ``2.0.1``, ``mix``; an outage without ``feed="watttime"``.
    """
    import numpy as np

    from envs import timestep
    from envs.site import load_site
    from pipeline.live.simsite import ocpp_versions, run_local

    s = load_site(site)
    ocpp_versions([], ocpp)  # a bad choice ends here, before the run
    if outage_h is not None and feed != "watttime":
        from pipeline.live.state import LiveError

        raise LiveError("--outage-h: give --feed watttime (the outage is the grid-carbon service's)")
    hours = 24 * days
    with tempfile.TemporaryDirectory() as tmp, moer_service(s, feed, split, hours, outage_h) as (moer, hooks):
        res, central = asyncio.run(run_local(s, Path(tmp) / "csms.sqlite", controller, split, hours, feed=moer,
                                             hooks=hooks, ocpp=ocpp))  # fmt: skip
        txs = central.store.transactions()
        late, failed = len(central.store.events("moer_feed_late")), len(central.store.events("plan_failed"))
        central.store.close()
    transactions, tx201 = len(txs), sum(t["charger_tx_id"] is not None for t in txs)
    ses = s.split(split).sessions
    sessions = int((~ses.rejected & (ses.arrival_step < timestep.steps(hours, s.config.dt_h))).sum())
    co2, unserved = study_week(s, controller, split, hours)
    lat = np.asarray(central.plan_latency_s)
    row = {
        "site": s.config.name,
        "controller": controller,
        "ocpp": ocpp,
        "feed": feed,
        "hours": res.hours,
        "csms_co2_kg": res.co2_kg,
        "study_co2_kg": co2,
        "diff_kg": res.co2_kg - co2,
        "csms_unserved_kwh": res.unserved_kwh,
        "study_unserved_kwh": unserved,
        "sessions": sessions,
        "transactions": transactions,
        "transactions_201": tx201,
        "plans": len(lat),
        "plan_p50_s": float(np.percentile(lat, 50)),
        "plan_p99_s": float(np.percentile(lat, 99)),
        "wall_s": res.wall_s,
        "outage_h": float("nan") if outage_h is None else float(outage_h),
        "feed_late_steps": late,
        "plans_failed": failed,
    }
    print(
        f"{controller} on {s.config.name}, first {res.hours:g} h of {split}, OCPP {ocpp}, MOER {feed}: CO2 "
        f"{res.co2_kg:.3f} kg through the central system, {co2:.3f} kg in the study's run (difference "
        f"{res.co2_kg - co2:+.4f} kg); "
        f"unserved {res.unserved_kwh:.4f} / {unserved:.4f} kWh; {sessions} sessions, {transactions} transactions "
        f"({tx201} of 2.0.1), {len(lat)} plans (p50 "
        f"{row['plan_p50_s']:.3f} s, p99 {row['plan_p99_s']:.3f} s), {res.wall_s:.1f} s"
        + (
            f"; the service down from hour {outage_h:g} for an hour, then late for one: {late} steps planned on the "
            f"fall-back, {failed} plans failed"
            if outage_h is not None
            else ""
        ),
        flush=True,
    )
    df = pd.DataFrame([row], columns=list(COLUMNS))
    df["machine"] = json.dumps(machine_info())
    save_table(df, "csms_week", out_dir)
    return df


@dataclass
class Args:
    """A week of a site through the central system and the simulated site, against the study's run."""

    site: str = "caltech"
    """site: a shipped site name or a path to a site TOML file"""
    controller: str = "mpc"
    """the causal controller (one that needs no tuning: mpc, mpc_scenario, mpc_tuned_start, mpc_rl_start)"""
    days: int = 7
    """days from the split's start"""
    split: str = "test"
    """the split replayed"""
    out_dir: str | None = None
    """folder of csms_week.parquet (None: outputs/bench/)"""
    ocpp: Literal["1.6", "2.0.1", "mix"] = "1.6"
    """what the site's charge points speak: OCPP 1.6J, 2.0.1, or a mix (alternating in the order of their ids)"""
    feed: Literal["files", "watttime"] = "files"
    """the MOER feed: the site's data files, or a client of the grid-carbon service's stand-in (WattTime's API v3)
    serving the site's MOER record on a free port"""
    outage_h: float | None = None
    """with --feed watttime: the service down (503) for the hour from this many hours after the split's start, an hour
    late over the next one, then back (None: no outage)"""


def main(args: Args | None = None) -> pd.DataFrame:
    """Command-line entry point (tyro)."""
    if args is None:
        import tyro

        args = tyro.cli(Args)
    return run(args.site, args.controller, args.days, args.split, args.out_dir, args.ocpp, args.feed, args.outage_h)


if __name__ == "__main__":
    main()
