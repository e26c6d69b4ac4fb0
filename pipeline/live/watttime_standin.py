"""A local stand-in for a grid-carbon service speaking WattTime's data API v3 (:class:`WattTimeStandIn`): an HTTP
server (stdlib ``http.server``, in a thread) that answers ``/login``, ``/v3/historical``, ``/v3/forecast``,
``/v3/forecast/historical`` and ``/v3/signal-index`` as :mod:`pipeline.live.watttime` describes them, in lbs
CO2/MWh, from a site's own MOER record, to try the central system's ``--feed watttime`` and to test it.

Its record (:func:`service_record`): the site's raw 5-minute MOER files with the forecasts issued every 5 minutes
(``watttime-moer`` files with ``f1..f36``, read by ingestion's :func:`pipeline.data.readers.load_carbon`: for
caltech, WattTime's SGIP record of CAISO SCE, the files its processed series were made from); for a site without such
files whose series has no 5-minute column (a constant grid factor, the tests' synthetic sites), one made from its
series: each step's MOER over each of its 5-minute intervals, and at each step's start a forecast of three hours whose
intervals are ``moer_fc_h0``, ``h1`` and ``h2`` hour by hour (ingestion lays that record onto the site's step as its
series). ``f1`` is the interval that starts when the forecast is issued.

Its time (:meth:`WattTimeStandIn.now`): set by :meth:`WattTimeStandIn.set_time` (a simulated site's: :func:`following`
sets it at each step), else a clock given to it (the command's ``--start``: the record replayed from then on), else
the record's end (everything issued, as the real service is for a split of the past). At time ``T`` it serves the
intervals realised by ``T`` (those that ended by then) and the forecasts issued by ``T``; ``/v3/forecast`` is the last
of them. Its switches (:class:`Outage`, over times of its clock): ``down`` answers 503 to everything, ``refused``
closes its port (the connections are refused; it acts when the time is set), ``late`` answers as it stood ``lag``
before (its last forecast not yet updated); :meth:`WattTimeStandIn.fail_next` fails the next calls;
:meth:`WattTimeStandIn.expire_tokens` ends every token. It checks the user and password of ``/login`` and the token of
every other call (401), the region and the signal type (400), the ranges (400: at most 32 days of history, a day of
forecasts).

``python -m pipeline.live.watttime_standin --site caltech --port 8085`` serves a site's record by hand (its user and
password: ``WATTTIME_USERNAME`` / ``WATTTIME_PASSWORD`` of the environment, or ``--credentials``; docs/live.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pandas as pd

from envs import timestep
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site
from pipeline.data.readers import load_carbon
from pipeline.data.sources import MOER_FORECAST_COLUMNS, SourceError, files_of, load_sources
from pipeline.live.http_app import basic_credentials
from pipeline.live.state import FORECAST_COLUMNS, LiveError, as_timestamp
from pipeline.live.watttime import (
    FORECAST_POINTS,
    INTERVAL,
    KG_PER_KWH_PER_LBS_PER_MWH,
    SIGNAL_TYPE,
    ServiceCredentials,
    WattTimeClient,
    WattTimeFeed,
    iso,
    service_credentials,
    utc,
)

DEFAULT_REGION = "SGIP_CAISO_SCE"
"""The region served unless told (the shipped site's record: WattTime's SGIP signal of CAISO SCE)."""
MODEL_DATE = "stand-in"
"""The ``meta.model.date`` of its answers."""
HISTORY_DAYS = 32
"""The longest range of ``/v3/historical``, days."""
FORECAST_RANGE = pd.Timedelta(days=1)
"""The longest range of ``/v3/forecast/historical``."""
INDEX_WINDOW = pd.Timedelta(days=30)
"""``/v3/signal-index``: the percentile of the last realised interval among those of this window before it."""
OUTAGE_KINDS = ("down", "refused", "late")
"""What an :class:`Outage` does: answer 503, refuse connections, answer as it stood ``lag`` before."""
log = logging.getLogger("evhub.standin")


# ------------------------------------------------------------------------------------------------ the record
def service_record(site: Site, files: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The service's record of ``site`` (module docstring): 5-minute rows indexed by ``time`` (UTC, sorted), ``moer``
    (realised) and ``f1..f36`` (the forecast issued then, NaN where none was), float64 kg CO2/kWh.

    Args:
        files: the raw carbon files to read (patterns relative to the site's ``[sources]`` root; default the site's
            ``[sources.carbon]`` files).

    Raises:
        LiveError: ``files`` given for a site without ``watttime-moer`` sources or matching nothing; a site whose
            series has 5-minute columns without its raw files (only they give those columns back).
        SourceError: a raw file ingestion refuses.
    """
    raw = _raw_record(site, files)
    if raw is not None:
        return raw
    if files:
        raise LiveError(f"--files: the site {site.config.name} has no watttime-moer carbon source with forecasts")
    if any(c in site.series for c in MOER_5MIN_COLUMNS):
        raise LiveError(
            f"stand-in: the series of {site.config.name} has the 5-minute MOER columns, which only its raw MOER files "
            "give back, and they are not here (its TOML's [sources.carbon])"
        )
    s, minutes = site.series, timestep.step_minutes(site.config.dt_h)
    k = minutes // 5
    start = pd.DatetimeIndex(s.time).tz_convert("UTC")
    times = (start.repeat(k) + pd.to_timedelta(np.tile(np.arange(k) * 5, len(s)), unit="min")).rename("time")
    fc = np.full((len(times), FORECAST_POINTS), np.nan)
    for h, c in enumerate(FORECAST_COLUMNS):
        fc[::k, 12 * h : 12 * h + 12] = s[c].to_numpy(np.float64)[:, None]
    out = pd.DataFrame(fc, index=times, columns=list(MOER_FORECAST_COLUMNS))
    out.insert(0, "moer", np.repeat(s.moer_kg_per_kwh.to_numpy(np.float64), k))
    return out


def _raw_record(site: Site, files: tuple[str, ...] | None) -> pd.DataFrame | None:
    """The rows of the site's ``watttime-moer`` files with forecasts, or None where it has none (no TOML, no
    ``[sources]``, another format, no file here, no forecast columns)."""
    if "config" not in site.source:
        return None
    try:
        src = load_sources(site.source["config"], dt_h=site.config.dt_h)
    except SourceError:
        return None
    if src.carbon.format != "watttime-moer":
        return None
    if files:
        src = dataclasses.replace(src, carbon=dataclasses.replace(src.carbon, files=tuple(files)))
    try:
        files_of(src, "carbon")
    except SourceError as exc:
        if files:
            raise LiveError(f"--files: {exc}") from None
        return None
    raw = load_carbon(src)
    return raw.rows[["moer", *MOER_FORECAST_COLUMNS]] if raw is not None and raw.forecasts else None


# ------------------------------------------------------------------------------------------------ the switches
@dataclass(frozen=True)
class Outage:
    """A time the stand-in fails, ``[start, end)`` of its clock (tz-aware), as ``kind`` says: ``down`` (503 to every
    call), ``refused`` (its port closed: connections refused) or ``late`` (it answers as it stood ``lag`` before).

    Raises:
        LiveError: an unknown kind, times without a UTC offset, ``end`` not after ``start``, a lag not positive.
    """

    start: pd.Timestamp
    end: pd.Timestamp
    kind: str = "down"
    lag: pd.Timedelta = pd.Timedelta(hours=1)

    def __post_init__(self):
        if self.kind not in OUTAGE_KINDS:
            raise LiveError(f"outage: kind {self.kind!r} is not one of {', '.join(OUTAGE_KINDS)}")
        start, end = (as_timestamp(t, "outage").tz_convert("UTC") for t in (self.start, self.end))
        if end <= start or pd.Timedelta(self.lag) <= pd.Timedelta(0):
            raise LiveError(f"outage: {start}..{end} (lag {self.lag}): the end must follow the start, the lag be > 0")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "lag", pd.Timedelta(self.lag))


class RequestError(ValueError):
    """A bad request (answered 400 with its message)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: WattTimeStandIn


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self):  # noqa: N802 - http.server's name
        status, doc = self.server.standin.answer(self.path, self.headers.get("Authorization"))
        body = (json.dumps(doc) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        log.debug("stand-in: %s", format % args)


# ------------------------------------------------------------------------------------------------ the server
class WattTimeStandIn:
    """The stand-in (module docstring); :meth:`start` serves it (a context manager too), :attr:`url` is where.

    Args:
        site: the site whose record it serves. username, password: the credentials ``/login`` takes.
        region: the region it serves. files: as :func:`service_record`'s. outages: its :class:`Outage` times.
        clock: its time when :meth:`set_time` has not set one (None: the record's end).
        token_life_s: a token's life, s (30 minutes). host, port: where it listens (port 0: a free one).
        record: the record served (default :func:`service_record` of ``site``).

    Attributes:
        logins: the logins it granted. tokens: every token it gave (to check that none leaks). calls: ``(path,
        status)`` of each call answered.
    """

    def __init__(
        self, site: Site, username: str, password: str, region: str = DEFAULT_REGION,
        files: tuple[str, ...] | None = None, outages=(), clock: Callable[[], pd.Timestamp] | None = None,
        token_life_s: float = 1800.0, host: str = "127.0.0.1", port: int = 0, record: pd.DataFrame | None = None,
    ):  # fmt: skip
        record = service_record(site, files) if record is None else record
        self.username, self.password, self.region = username, password, region
        self.times = pd.DatetimeIndex(record.index).tz_convert("UTC")
        self.moer = record["moer"].to_numpy(np.float64)
        self.fc = record[list(MOER_FORECAST_COLUMNS)].to_numpy(np.float64)
        self.issued_rows = np.flatnonzero(np.isfinite(self.fc[:, 0]))
        self.outages, self.clock, self.token_life_s = list(outages), clock, token_life_s
        self.host, self.port = host, port
        self.time: pd.Timestamp | None = None
        self.lock = threading.Lock()
        self.live: dict[str, float] = {}
        self.tokens: list[str] = []
        self.logins, self.failing, self.failing_status = 0, 0, 503
        self.calls: list[tuple[str, int]] = []
        self.server: _Server | None = None
        self.serving = False

    # ------------------------------------------------------------------------------------------ serving
    @property
    def url(self) -> str:
        """Its address, ``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> WattTimeStandIn:
        """Serve (in a thread); returns itself."""
        self.serving = True
        self.apply_refusal()
        return self

    def close(self) -> None:
        """Stop serving."""
        self.serving = False
        self.stop_listening()

    def __enter__(self) -> WattTimeStandIn:
        return self if self.serving else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def listen(self) -> None:
        """Open its port (the same one again after a refusal) and answer in a thread."""
        self.server = _Server((self.host, self.port), _Handler)
        self.server.standin = self
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop_listening(self) -> None:
        """Close its port."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def apply_refusal(self) -> None:
        """Close the port in a ``refused`` outage, open it otherwise (while serving)."""
        out = self.outage(self.now())
        refuse = out is not None and out.kind == "refused"
        if self.serving and not refuse and self.server is None:
            self.listen()
        elif (refuse or not self.serving) and self.server is not None:
            self.stop_listening()

    # ------------------------------------------------------------------------------------------ its time and switches
    def now(self) -> pd.Timestamp:
        """Its time: the one set, else its clock's, else the record's end."""
        if self.time is not None:
            return self.time
        if self.clock is not None:
            return utc(self.clock())
        return self.times[-1] + INTERVAL

    def set_time(self, time) -> None:
        """Set its time (a tz-aware time or ISO 8601 string); a ``refused`` outage then closes or opens its port."""
        self.time = utc(as_timestamp(time, "stand-in time"))
        self.apply_refusal()

    def outage(self, now: pd.Timestamp) -> Outage | None:
        """The outage at ``now``, or None."""
        return next((o for o in self.outages if o.start <= now < o.end), None)

    def expire_tokens(self) -> None:
        """End every token given (the next call with one gets 401)."""
        with self.lock:
            self.live.clear()

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` calls with ``status`` (503: unavailable; 429: too many requests)."""
        with self.lock:
            self.failing, self.failing_status = n, status

    # ------------------------------------------------------------------------------------------ answering
    def answer(self, path: str, authorization: str | None) -> tuple[int, dict]:
        """The status and JSON body of ``GET path`` with that ``Authorization`` header."""
        url = urlsplit(path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        status, doc = self.route(url.path, query, authorization)
        with self.lock:
            self.calls.append((url.path, status))
        return status, doc

    def route(self, path: str, query: dict, authorization: str | None) -> tuple[int, dict]:
        """What a call gets: a failure asked for, the outage's 503, the login, 401 without a live token, 404, 400,
        or the endpoint's answer (at the time it stands at: ``lag`` back when late)."""
        with self.lock:
            if self.failing > 0:
                self.failing -= 1
                return self.failing_status, {"error": f"failing on purpose ({self.failing_status})"}
        now = self.now()
        out = self.outage(now)
        if out is not None and out.kind != "late":
            return 503, {"error": "service unavailable"}
        if path == "/login":
            return self.login(authorization)
        if not self.token_live(authorization):
            return 401, {"error": "no valid token: log in at /login (tokens last 30 minutes)"}
        endpoints = {
            "/v3/historical": self.historical,
            "/v3/forecast": self.forecast,
            "/v3/forecast/historical": self.forecasts,
            "/v3/signal-index": self.signal_index,
        }
        if path not in endpoints:
            return 404, {"error": f"no endpoint {path}"}
        if query.get("region") != self.region:
            return 400, {"error": f"region {query.get('region')!r}: this service has {self.region!r}"}
        if query.get("signal_type") != SIGNAL_TYPE:
            return 400, {"error": f"signal_type {query.get('signal_type')!r}: this service has {SIGNAL_TYPE!r}"}
        try:
            return endpoints[path](query, now - out.lag if out is not None else now)
        except RequestError as exc:
            return 400, {"error": str(exc)}

    def login(self, authorization: str | None) -> tuple[int, dict]:
        """``/login``: a token for the right Basic credentials, else 401."""
        user, password = basic_credentials(authorization) or ("", "")
        ok = hmac.compare_digest(user.encode(), self.username.encode())
        ok &= hmac.compare_digest(password.encode(), self.password.encode())
        if not ok:
            return 401, {"error": "wrong user or password"}
        token = secrets.token_urlsafe(32)
        with self.lock:
            self.live[token] = time.monotonic() + self.token_life_s
            self.tokens.append(token)
            self.logins += 1
        return 200, {"token": token}

    def token_live(self, authorization: str | None) -> bool:
        """Whether the header carries a token given and not expired."""
        if not authorization or not authorization.startswith("Bearer "):
            return False
        with self.lock:
            return self.live.get(authorization[7:], 0.0) > time.monotonic()

    def meta(self, **more) -> dict:
        """The ``meta`` of an answer."""
        units = more.pop("units", "lbs_co2_per_mwh")
        return {"region": self.region, "signal_type": SIGNAL_TYPE, "model": {"date": MODEL_DATE},
                "data_point_period_seconds": 300, "units": units, "warnings": [], **more}  # fmt: skip

    def span(self, query: dict, longest: pd.Timedelta) -> tuple[pd.Timestamp, pd.Timestamp]:
        """``start`` and ``end`` of a query (naive: UTC), at most ``longest`` apart.

        Raises:
            RequestError: missing, not times, in the wrong order or too far apart.
        """
        try:
            start, end = (utc(datetime.fromisoformat(query[k])) for k in ("start", "end"))
        except (KeyError, ValueError):
            raise RequestError("start and end: give both, ISO 8601 times") from None
        if end < start or end - start > longest:
            raise RequestError(f"start {start.isoformat()}, end {end.isoformat()}: end after start, at most {longest}")
        return start, end

    def points(self, row: int, n: int) -> list[dict]:
        """The first ``n`` points of the forecast issued at record row ``row``, lbs CO2/MWh."""
        g = self.times[row]
        return [
            {"point_time": iso(g + j * INTERVAL), "value": float(self.fc[row, j] / KG_PER_KWH_PER_LBS_PER_MWH)}
            for j in range(n)
            if np.isfinite(self.fc[row, j])
        ]

    def historical(self, query: dict, now: pd.Timestamp) -> tuple[int, dict]:
        """``/v3/historical``: the realised points from ``start`` to ``end`` (inclusive) that ended by ``now``."""
        start, end = self.span(query, pd.Timedelta(days=HISTORY_DAYS))
        sel = (self.times >= start) & (self.times <= end) & (self.times + INTERVAL <= now) & np.isfinite(self.moer)
        data = [
            {"point_time": iso(t), "value": float(v / KG_PER_KWH_PER_LBS_PER_MWH)}
            for t, v in zip(self.times[sel], self.moer[sel])
        ]
        return 200, {"data": data, "meta": self.meta()}

    def horizon(self, query: dict) -> int:
        """The points asked for by ``horizon_hours`` (0 to 72, default 24), at most the record's 36.

        Raises:
            RequestError: not a whole number of hours in 0..72.
        """
        try:
            hours = int(query.get("horizon_hours", 24))
        except ValueError:
            raise RequestError(f"horizon_hours {query['horizon_hours']!r}: a whole number of hours") from None
        if not 0 <= hours <= 72:
            raise RequestError(f"horizon_hours {hours}: 0 to 72")
        return min(FORECAST_POINTS, max(1, 12 * hours))

    def forecast(self, query: dict, now: pd.Timestamp) -> tuple[int, dict]:
        """``/v3/forecast``: the forecast issued last by ``now``."""
        n = self.horizon(query)
        k = int(np.searchsorted(self.times[self.issued_rows], now, side="right")) - 1
        if k < 0:
            return 404, {"error": f"no forecast issued by {now.isoformat()}"}
        row = int(self.issued_rows[k])
        g = self.times[row]
        meta = self.meta(generated_at=iso(g), generated_at_period_seconds=300)
        return 200, {"data": self.points(row, n), "meta": meta}

    def forecasts(self, query: dict, now: pd.Timestamp) -> tuple[int, dict]:
        """``/v3/forecast/historical``: the forecasts issued from ``start`` to ``end`` (inclusive) and by ``now``."""
        start, end = self.span(query, FORECAST_RANGE)
        n = self.horizon(query)
        issued = self.times[self.issued_rows]
        rows = self.issued_rows[(issued >= start) & (issued <= min(end, now))]
        data = [{"generated_at": iso(self.times[r]), "forecast": self.points(int(r), n)} for r in rows]
        return 200, {"data": data, "meta": self.meta(generated_at_period_seconds=300)}

    def signal_index(self, query: dict, now: pd.Timestamp) -> tuple[int, dict]:
        """``/v3/signal-index``: the percentile (0 to 100) of the last interval realised by ``now`` among those of the
        :data:`INDEX_WINDOW` before it."""
        done = np.flatnonzero((self.times + INTERVAL <= now) & np.isfinite(self.moer))
        if not len(done):
            return 404, {"error": f"nothing realised by {now.isoformat()}"}
        last = int(done[-1])
        window = self.moer[done[self.times[done] > self.times[last] - INDEX_WINDOW]]
        value = round(100.0 * float(np.mean(window <= self.moer[last])), 1)
        return 200, {"data": [{"point_time": iso(self.times[last]), "value": value}], "meta": self.meta(
            units="percentile")}  # fmt: skip


# ------------------------------------------------------------------------------------------------ for a simulated site
def following(standin: WattTimeStandIn, steps: int, hooks: dict | None = None) -> dict:
    """:class:`pipeline.live.simsite.SimSite` hooks that set the stand-in's time to the start of each of the first
    ``steps`` steps (before the step's messages and plan), then run ``hooks``' own hook of that step."""
    hooks = dict(hooks or {})

    def at(t: int):
        other = hooks.get(t)

        async def hook(sim) -> None:
            standin.set_time(sim.start + t * sim.dt)
            if other is not None:
                await other(sim)

        return hook

    return {t: at(t) for t in range(steps)}


@contextlib.contextmanager
def local_service(
    site: Site, split: str = "test", region: str = DEFAULT_REGION, files: tuple[str, ...] | None = None, outages=(),
    record: pd.DataFrame | None = None, **client_options,
):  # fmt: skip
    """A stand-in of ``site``'s record on a free port of localhost (fresh random credentials), and the feed of a
    client of it: yields ``(standin, feed)`` (:class:`pipeline.live.watttime.WattTimeFeed` of ``split``);
    ``client_options`` go to :class:`pipeline.live.watttime.WattTimeClient`."""
    password = secrets.token_urlsafe(16)
    with WattTimeStandIn(site, "evhub", password, region, files, outages, record=record) as standin:
        client = WattTimeClient(standin.url, ServiceCredentials("evhub", password), **client_options)
        yield standin, WattTimeFeed(site, client, region, split)


# ------------------------------------------------------------------------------------------------ the command
@dataclass
class Args:
    """A local stand-in for WattTime's data API v3, serving a site's own MOER record (docs/live.md): its user and
    password are WATTTIME_USERNAME / WATTTIME_PASSWORD of the environment, or --credentials."""

    site: str = "caltech"
    """the site whose record it serves: a shipped name or the path of a site TOML"""
    port: int = 8085
    """the port to listen on"""
    host: str = "127.0.0.1"
    """the address to listen on"""
    region: str = DEFAULT_REGION
    """the region it serves (the client's --moer-region)"""
    credentials: Path | None = None
    """a file of the lines WATTTIME_USERNAME=... and WATTTIME_PASSWORD=... (default: the environment)"""
    start: str | None = None
    """the record's time when it starts (ISO 8601 with its UTC offset), from which its clock runs; default: the
    record's end (every forecast issued: a central system replaying a split asks for the past)"""
    speed: float = 1.0
    """with --start: seconds of the record per second"""
    files: tuple[str, ...] = ()
    """raw carbon files to serve, patterns relative to the site's [sources] root (default: all of them)"""


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.live.watttime_standin`` (tyro): serve until interrupted; an expected error prints one line
    and returns 1."""
    import tyro

    from envs.errors import exit_code
    from envs.site import load_site

    args = tyro.cli(Args, args=argv)

    def run() -> None:
        creds = service_credentials(args.credentials, option="--credentials")
        clock = None
        if args.start is not None:
            t0, origin = time.monotonic(), utc(as_timestamp(args.start, "--start"))

            def clock() -> pd.Timestamp:
                return origin + pd.Timedelta(seconds=(time.monotonic() - t0) * args.speed)

        site = load_site(args.site)
        standin = WattTimeStandIn(site, creds.username, creds.password, args.region, args.files or None, (), clock,
                                  host=args.host, port=args.port)  # fmt: skip
        with standin:
            first, last = standin.times[0].isoformat(), standin.times[-1].isoformat()
            print(f"watttime stand-in: {site.config.name}'s MOER record ({len(standin.times):,} intervals, {first}.."
                  f"{last}) as region {args.region} at {standin.url} (user {creds.username}), its time "
                  f"{standin.now().isoformat()}", flush=True)  # fmt: skip
            with contextlib.suppress(KeyboardInterrupt):
                threading.Event().wait()

    return exit_code(run)


if __name__ == "__main__":
    raise SystemExit(main())
