"""What the central system reads besides its charge points: the clock it plans by (:class:`WallClock`, or
:class:`SiteClock`, set by the site), the MOER feed (:class:`MoerFeed`; :class:`SiteDataFeed` reads a site's data
files, :class:`LateFeed` withholds its new values at some steps), the connectors' sockets (:func:`default_mapping`,
:func:`read_mapping`) and the session model's expectation for a driver who gave no departure or need
(:func:`expected_session`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd

from envs import timestep
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site, station_sockets
from pipeline.live.state import FORECAST_COLUMNS, MAX_FORECAST_AGE_H, LiveError, realised_history


# ------------------------------------------------------------------------------------------------ the clock
class Clock(Protocol):
    """The time the central system plans by (it plans at each of its steps, as its controller decides)."""

    def now(self) -> pd.Timestamp:
        """The time now, tz-aware."""
        ...


class WallClock:
    """The real time (a site's own central system)."""

    def now(self) -> pd.Timestamp:
        """The time now, UTC."""
        return pd.Timestamp.now(tz="UTC")


class SiteClock:
    """The time as the site sets it (a simulated site in accelerated time): the site controller sends it with a
    ``DataTransfer`` (vendor ``evhub``, message ``Clock``); it never goes back.

    Args:
        start: the time before the site sets one (None: unknown; planning waits for the site).
    """

    def __init__(self, start: pd.Timestamp | None = None):
        self.time = start

    def now(self) -> pd.Timestamp:
        """The site's time.

        Raises:
            LiveError: the site has not set it yet.
        """
        if self.time is None:
            raise LiveError("clock: the site has not set the time yet (DataTransfer evhub/Clock)")
        return self.time

    def advance(self, time: pd.Timestamp) -> None:
        """Set the time to ``time`` (tz-aware).

        Raises:
            LiveError: a time before the clock's (the message names both).
        """
        time = pd.Timestamp(time).tz_convert("UTC")
        if self.time is not None and time < self.time:
            raise LiveError(f"clock: {time.isoformat()} is before the clock's time {self.time.isoformat()}")
        self.time = time


# ------------------------------------------------------------------------------------------------ the MOER feed
@dataclass
class FeedHistory:
    """What a feed knows at a time: ``series`` and ``sessions`` as :class:`pipeline.live.LiveState`'s (at the site's
    step: the realised MOER before it, the forecasts up to it, the PV outlook; the sessions realised by then), and
    ``window_end`` (where a plan's window ends at the latest; None: a whole horizon)."""

    series: pd.DataFrame
    sessions: pd.DataFrame
    window_end: pd.Timestamp | None = None


class MoerFeed(Protocol):
    """The realised MOER, its forecasts and the PV outlook up to a time (a grid-carbon service at a real site)."""

    def history(self, now: pd.Timestamp) -> FeedHistory:
        """What is known at ``now`` (on a step of the site)."""
        ...


class SiteDataFeed:
    """A feed read from the site's own data files: :func:`pipeline.live.realised_history` of one split (what the
    study's replay reads); a plan's window ends at the split's end, as in the study.

    Args:
        site: the site. split: ``train`` or ``test``.
    """

    def __init__(self, site: Site, split: str = "test"):
        self.site, self.split = site, split
        self.start, self.end = site.config.split_bounds(split)

    def step(self, now: pd.Timestamp) -> int:
        """The step of ``now`` in the split.

        Raises:
            LiveError: a time outside the split or between its steps.
        """
        now = pd.Timestamp(now).tz_convert("UTC")
        pos = (now - self.start) / pd.Timedelta(timestep.step_timedelta(self.site.config.dt_h))
        if not self.start <= now < self.end or pos != int(pos):
            raise LiveError(
                f"MOER feed: {now.isoformat()} is not a step of the site's {self.split} split "
                f"({self.start.isoformat()}..{self.end.isoformat()})"
            )
        return int(pos)

    def history(self, now: pd.Timestamp) -> FeedHistory:
        """The split's history realised at ``now`` (:func:`pipeline.live.realised_history`)."""
        series, sessions = realised_history(self.site, self.split, self.step(now))
        return FeedHistory(series, sessions, self.end)


class LateFeed:
    """A feed that brings nothing new at some steps (a late MOER service): at those steps its MOER and forecasts are
    what ``feed`` knew a step before; the sessions are the site's own and stay current.

    Args:
        feed: the feed. late: the steps (tz-aware times) it is late at. dt_h: the site's step, hours.
    """

    def __init__(self, feed: MoerFeed, late, dt_h: float = 1.0):
        self.feed, self.dt = feed, pd.Timedelta(timestep.step_timedelta(dt_h))
        self.late = {pd.Timestamp(t).tz_convert("UTC") for t in late}

    def history(self, now: pd.Timestamp) -> FeedHistory:
        """``feed``'s history, its series a step old at a late step."""
        got = self.feed.history(now)
        if pd.Timestamp(now).tz_convert("UTC") in self.late:
            got = FeedHistory(self.feed.history(now - self.dt).series, got.sessions, got.window_end)
        return got


def late_steps(dt_h: float) -> int:
    """How many steps a feed may be late and still be planned through (:func:`fill_late`): the steps of
    :data:`pipeline.live.state.MAX_FORECAST_AGE_H` at a step of ``dt_h`` hours, at least one."""
    return max(1, timestep.steps(MAX_FORECAST_AGE_H, dt_h))


def fill_late(series: pd.DataFrame, now: pd.Timestamp, dt_h: float) -> tuple[pd.DataFrame, pd.Timestamp, bool]:
    """Plan on the last forecast when the feed brought none for the step ``now``: the forecast issued ``k`` steps
    before (the latest one there is, at most :data:`pipeline.live.state.MAX_FORECAST_AGE_H` old), moved on to each
    step since: at ``j`` steps on, each hour's value becomes the hourly forecast read ``j * dt_h`` hours later, linear
    between its hours, the last one held (a step on at 15 minutes: ``0.75`` of it and ``0.25`` of the next hour's; at
    hourly steps its next hour's); its 5-minute values; and for the steps since it, the forecast in place of the
    realised MOER that did not come.

    Args:
        series: the feed's history at the site's step. now: the step planned. dt_h: the site's step, hours.

    Returns:
        ``(series, issued_at, late)``: the history to plan on, when its current forecast was issued, and whether
        the feed was late. A feed late by more than that is left as it is (the plan then refuses it as stale).
    """
    dt = pd.Timedelta(timestep.step_timedelta(dt_h))
    f = timestep.exact_dt_h(dt_h)  # the step's share of an hour
    per_hour = timestep.steps(1.0, dt_h)
    now = pd.Timestamp(now).tz_convert("UTC")
    h = series.copy()
    h["time"] = pd.to_datetime(h.time, utc=True)
    row = np.flatnonzero((h.time == now).to_numpy())
    if len(row) and np.isfinite(float(h.loc[row[0], FORECAST_COLUMNS[0]])):
        return series, now, False
    k = next(
        (k for k in range(1, late_steps(dt_h) + 1)
         if np.isfinite(h.loc[(h.time == now - k * dt).to_numpy(), FORECAST_COLUMNS[0]].astype(float)).any()),
        None,
    )  # fmt: skip
    if k is None:
        return series, now, True
    missing = [now - j * dt for j in range(k - 1, -1, -1) if not (h.time == now - j * dt).any()]
    if missing:
        h = pd.concat([h, pd.DataFrame({"time": missing})], ignore_index=True).sort_values("time", ignore_index=True)
    at = {t: i for i, t in enumerate(h.time)}
    p = at[now - k * dt]
    last = [float(h.loc[p, c]) for c in FORECAST_COLUMNS]
    n = len(last)

    def later(lead_steps: int) -> float:  # the forecast read lead_steps steps on, linear between its hours
        i, rem = divmod(lead_steps, per_hour)
        return (1.0 - rem * f) * last[min(i, n - 1)] + rem * f * last[min(i + 1, n - 1)]

    for j in range(k + 1):
        r = at[now - (k - j) * dt]
        if j < k and not np.isfinite(float(h.loc[r, "moer_kg_per_kwh"])):
            h.loc[r, "moer_kg_per_kwh"] = later(j)
        if j == 0:
            continue
        for m, c in enumerate(FORECAST_COLUMNS):
            h.loc[r, c] = later(m * per_hour + j)
        for c in MOER_5MIN_COLUMNS:
            if c in h:
                h.loc[r, c] = h.loc[p, c]
    return h, now - k * dt, True


# ------------------------------------------------------------------------------------------------ the connectors
def default_mapping(site: Site) -> dict[tuple[str, int], int]:
    """``{(charge point id, connector): socket}``: one charge point per socket, connector 1, named after the socket's
    first station in the site's data (:func:`envs.site.station_sockets`), else ``socket-<i>``."""
    first: dict[int, str] = {}
    for st, i in sorted(station_sockets(site.config, site.sessions.station_id.unique()).items()):
        first.setdefault(i, st)
    return {(first.get(i, f"socket-{i}"), 1): i for i in range(site.config.ev.n_sockets)}


def read_mapping(path: str | Path, n_sockets: int) -> dict[tuple[str, int], int]:
    """A mapping file: a JSON list of ``{"charge_point": id, "connector": n, "socket": i}``.

    Raises:
        LiveError: no such file, not JSON, a bad row or a socket given twice (the message names the row).
    """
    path = Path(path)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LiveError(f"--mapping: {path}: no such file") from None
    except ValueError as exc:
        raise LiveError(f"--mapping: {path}: not valid JSON ({exc})") from None
    if not isinstance(rows, list):
        raise LiveError(f"--mapping: {path}: give a JSON list of {{charge_point, connector, socket}}")
    out: dict[tuple[str, int], int] = {}
    for k, r in enumerate(rows):
        try:
            cp, conn, sock = str(r["charge_point"]), int(r["connector"]), int(r["socket"])
        except (KeyError, TypeError, ValueError):
            raise LiveError(f"--mapping: row {k}: {r!r} needs charge_point, connector (>= 1) and socket") from None
        if not 0 <= sock < n_sockets or conn < 1:
            raise LiveError(f"--mapping: row {k}: socket {sock} / connector {conn} out of range (0..{n_sockets - 1})")
        if sock in out.values():
            raise LiveError(f"--mapping: row {k}: socket {sock} is mapped twice")
        out[(cp, conn)] = sock
    return out


# ------------------------------------------------------------------------------------------------ expected needs
def expected_session(
    sessions: pd.DataFrame, now: pd.Timestamp, socket_kw: float, days: int = 28
) -> tuple[pd.Timedelta, float]:
    """The stay and energy expected of a car that plugged in at ``now`` without telling: the means over the sessions
    that arrived within an hour of the same local hour in the last ``days`` days (all past sessions if none; 4 h and
    half of what the socket gives in that time if there are none at all), the energy capped at what the socket gives
    over the stay.

    Returns:
        ``(stay, energy_kwh)``.
    """
    s = sessions
    if len(s):
        arr = pd.to_datetime(s.arrival, utc=True)
        dep = pd.to_datetime(s.departure, utc=True)
        now_utc = pd.Timestamp(now).tz_convert("UTC")
        gap = ((arr.dt.hour * 60 + arr.dt.minute) - (now_utc.hour * 60 + now_utc.minute)) % (24 * 60)
        near = (np.minimum(gap, 24 * 60 - gap) <= 60) & (arr > now_utc - pd.Timedelta(days=days)) & (arr <= now_utc)
        pick = near if near.any() else arr <= now_utc
        if pick.any():
            stay_h = float(((dep - arr)[pick] / pd.Timedelta(hours=1)).mean())
            energy = float(s.energy_kwh[pick].astype(np.float64).mean())
            stay_h = max(stay_h, 1.0)
            return pd.Timedelta(hours=stay_h), min(energy, socket_kw * stay_h)
    return pd.Timedelta(hours=4), socket_kw * 2.0


# ------------------------------------------------------------------------------------------------ the start-up check
def feed_span(feed: MoerFeed) -> tuple[pd.Timestamp, pd.Timestamp, str] | None:
    """The times a MOER feed has data for: ``(start, end, what)``, UTC, ``end`` excluded, ``what`` naming the data;
    None for a feed without a fixed span (a live service). :class:`SiteDataFeed`: its split; :class:`LateFeed`: its
    feed's; any other feed: what its own ``span()`` method gives (the same triple, or None), if it has one."""
    if isinstance(feed, SiteDataFeed):
        return feed.start, feed.end, f"the {feed.split} split of the site {feed.site.config.name!r}"
    if isinstance(feed, LateFeed):
        return feed_span(feed.feed)
    span = getattr(feed, "span", None)
    return span() if callable(span) else None


def check_clock_meets_feed(clock: Clock, feed: MoerFeed, dt_h: float) -> None:
    """The central system's start-up check: a wall clock must read a time the MOER feed has data for
    (:func:`feed_span`), or no step would ever plan. A site clock passes (the site sets its time, and each step's plan
    says when the feed has nothing for it), as does a feed without a fixed span.

    Args:
        clock: the central system's clock. feed: its MOER feed. dt_h: the site's step, hours.

    Raises:
        LiveError: the wall clock's step lies outside the feed's span; the one-line message names both and what to do.
    """
    span = feed_span(feed) if isinstance(clock, WallClock) else None
    if span is None:
        return
    start, end, what = span
    now = clock.now().tz_convert("UTC").floor(pd.Timedelta(timestep.step_timedelta(dt_h)))
    if start <= now < end:
        return

    def utc(t: pd.Timestamp) -> str:
        return t.tz_convert("UTC").strftime("%Y-%m-%d %H:%M UTC")

    never = "and the wall clock never goes back" if now >= end else "and the first of them is still to come"
    raise LiveError(
        f"clock: the wall clock reads {utc(now)}, outside what the MOER feed has ({what}: {utc(start)} .. "
        f"{utc(end)}), {never}: no step could be planned; run with --clock site (a simulated site sets the time), or "
        "give a MOER feed that covers the time now"
    )
