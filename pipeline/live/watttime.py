"""A grid-carbon service behind the central system's MOER feed: a client of WattTime's data API v3
(:class:`WattTimeClient`) and the feed made of it (:class:`WattTimeFeed`, a :class:`pipeline.live.sources.MoerFeed`).

The API (https://docs.watttime.org, version 3). ``GET /login`` with HTTP Basic auth answers ``{"token": ...}``, a
bearer token valid 30 minutes; every other call carries ``Authorization: Bearer <token>``:

- ``GET /v3/historical?region&start&end&signal_type=co2_moer``: the realised MOER, a point every 5 minutes (``data``:
  ``{point_time, value}``, ``point_time`` the interval's start); ``start`` and ``end`` inclusive (the client asks 30
  days at a time);
- ``GET /v3/forecast?region&signal_type&horizon_hours``: the forecast issued last (``meta.generated_at``), ``data``
  every 5 minutes from ``generated_at``;
- ``GET /v3/forecast/historical?region&start&end&signal_type&horizon_hours``: the forecasts issued from ``start`` to
  ``end`` (``data``: ``{generated_at, forecast: [{point_time, value}]}``; a day at a time);
- ``GET /v3/signal-index?region&signal_type``: where the MOER stands now (a percentile, 0 to 100).

Values are lbs CO2/MWh; the project's unit is kg CO2/kWh: 1 lb = 0.45359237 kg and 1 MWh = 1000 kWh, so kg/kWh =
lbs/MWh x 0.45359237 / 1000 (:data:`KG_PER_KWH_PER_LBS_PER_MWH`, ingestion's factor of the unit ``lb/MWh``).

The feed gives what :class:`pipeline.live.sources.SiteDataFeed` gives (the same columns, dtypes and rows: the split's
steps; the window ends at the split's end) with only the MOER part from the service: at step ``now``, the realised
5-minute MOER before ``now`` and the forecast issued at each step's start up to ``now`` (the forecast's ``f1..f36``:
its first three hours) become the step's columns through ingestion's own function
(:func:`pipeline.data.readers.carbon_at`: the step's mean, ``moer_fc_h0..h2`` the means of each hour of the forecast
issued at the step's start, the 5-minute columns where the site has them), as float32, then what was not realised yet
is blanked (:func:`pipeline.live.state.blank_unrealised`); the PV outlook and the sessions are the site's files', as
now (:func:`pipeline.live.realised_history`). The client asks only for what it lacks: the points since the last it
got and the forecast of each new step (``/v3/forecast``; ``/v3/forecast/historical`` for steps it missed, and where
the service's newest forecast is later than the step, as when a split of the past is replayed).

Fall-backs. Each call times out (:attr:`WattTimeClient.timeout_s`); a call that gets no answer, a 429 or a 5xx is
tried again after an exponential back-off (:attr:`WattTimeClient.retries`, :attr:`WattTimeClient.backoff_s`); a 401
logs in again once (the token expired), as does a token near its 30 minutes. When the step's forecast is not there
(the service is late: its newest forecast was issued a step before or earlier, or it is down), the feed gives the
history as it stood at the last step it holds, at most :data:`pipeline.live.state.MAX_FORECAST_AGE_H` (an hour)
before, as :class:`pipeline.live.sources.LateFeed` does a step before: the planning loop then plans on that forecast
moved on (:func:`pipeline.live.sources.fill_late`) and logs ``moer_feed_late``. Down or late by more than that: a
:class:`pipeline.live.state.LiveError` saying since when (the planning loop records the step as failed and the
chargers keep the profiles they have). Wrong credentials, an unknown region or any other refusal: a
:class:`~pipeline.live.state.LiveError` at once, in one line.

Credentials come from the environment (``WATTTIME_USERNAME``, ``WATTTIME_PASSWORD``) or a file of those two
``KEY=VALUE`` lines (:func:`service_credentials`); neither the password nor a token is ever put in a message or a log
line. What the feed does is said on the logger ``evhub.csms.moer``.
"""

from __future__ import annotations

import base64
import bisect
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pandas as pd

from envs import timestep
from envs.schemas import MOER_5MIN_COLUMNS
from envs.site import Site
from pipeline.data.readers import CarbonRows, carbon_at
from pipeline.data.sources import (
    CARBON_UNITS,
    MOER_FORECAST_COLUMNS,
    CarbonSource,
    PVParams,
    SessionsSource,
    SourceError,
    Sources,
    WeatherSource,
    step_bins,
)
from pipeline.live.sources import FeedHistory, SiteDataFeed, late_steps
from pipeline.live.state import (
    FORECAST_COLUMNS,
    MAX_FORECAST_AGE_H,
    LiveError,
    blank_unrealised,
    realised_history,
)

KG_PER_KWH_PER_LBS_PER_MWH = CARBON_UNITS["lb/MWh"]
"""kg CO2/kWh per lbs CO2/MWh: 0.45359237 kg per lb over 1000 kWh per MWh."""
DEFAULT_URL = "https://api.watttime.org"
"""WattTime's API."""
SIGNAL_TYPE = "co2_moer"
"""The signal asked for: the marginal operating emissions rate of CO2."""
INTERVAL = pd.Timedelta(minutes=5)
"""The service's interval: a realised point, and a forecast issued, every 5 minutes."""
FORECAST_POINTS = len(MOER_FORECAST_COLUMNS)
"""The points of a forecast the feed keeps: 36, its first 3 hours (ingestion's ``f1..f36``)."""
FORECAST_HOURS = FORECAST_POINTS * INTERVAL // pd.Timedelta(hours=1)
"""``horizon_hours`` asked of the service (3)."""
HISTORY_BEFORE = pd.Timedelta(hours=1)
"""How far before the split's start the realised MOER is asked for (the first step's last 5 and 15 minutes)."""
TOKEN_LIFE_S = 30 * 60.0
"""A token's life (30 minutes), s."""
RETRY_STATUS = (429, 500, 502, 503, 504)
"""HTTP statuses tried again (too many requests, the service failing or unavailable)."""
MOER_COLUMNS = ("moer_kg_per_kwh", *FORECAST_COLUMNS, *MOER_5MIN_COLUMNS)
"""The series columns the service gives (those the site's series has): the rest stays the site's files'."""
USER_VARIABLE, PASSWORD_VARIABLE = "WATTTIME_USERNAME", "WATTTIME_PASSWORD"
"""The environment variables (and keys of a credentials file) of the service's user and password."""
log = logging.getLogger("evhub.csms.moer")


class ServiceDown(LiveError):
    """The service did not answer, or answered 429 or 5xx, at every try: the feed may fall back."""


class Refused(LiveError):
    """The service refused a call (an HTTP status that another try would not change); ``status`` is it."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServiceCredentials:
    """The service's user and password (the password is left out of ``repr``)."""

    username: str
    password: str = field(repr=False)


def service_credentials(
    path: str | Path | None = None, environ: dict | None = None, option: str = "--moer-credentials"
) -> ServiceCredentials:
    """The service's credentials: from the file ``path`` (lines ``WATTTIME_USERNAME=...`` and
    ``WATTTIME_PASSWORD=...``; blank lines and ``#`` comments skipped), else from the environment variables of those
    names (``environ``: default ``os.environ``). ``option``: the command-line option that gives the file, named in
    the errors.

    Raises:
        LiveError: no such file, a line that is not ``KEY=VALUE``, or a user or password missing (the message names
            the file or the variable, never a value).
    """
    if path is not None:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise LiveError(f"{option}: {path}: no such file") from None
        values = {}
        for k, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, eq, value = line.partition("=")
            if not eq or not key.strip():
                raise LiveError(f"{option}: {path} line {k}: give KEY=VALUE ({USER_VARIABLE}, "
                                f"{PASSWORD_VARIABLE})")  # fmt: skip
            values[key.strip()] = value.strip()
        where = f"{option}: {path}"
    else:
        values = os.environ if environ is None else environ
        where = "the environment"
    missing = [v for v in (USER_VARIABLE, PASSWORD_VARIABLE) if not values.get(v)]
    if missing:
        raise LiveError(
            f"{where} has no {' and no '.join(missing)}: set {USER_VARIABLE} and {PASSWORD_VARIABLE} in the "
            f"environment, or give {option} FILE with those two KEY=VALUE lines"
        )
    return ServiceCredentials(values[USER_VARIABLE], values[PASSWORD_VARIABLE])


def utc(value) -> pd.Timestamp:
    """``value`` (an ISO 8601 time or a Timestamp; naive: UTC) as a UTC Timestamp."""
    ts = pd.Timestamp(value)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def iso(ts: pd.Timestamp) -> str:
    """A time as the API writes it: ISO 8601 in UTC, ``2021-05-01T07:00:00+00:00``."""
    return utc(ts).isoformat()


@dataclass(frozen=True)
class Issued:
    """A forecast as issued: ``generated_at`` (UTC) and ``values``, ``(36,)`` float64 kg CO2/kWh for the 5-minute
    intervals from ``generated_at`` (NaN where the service gave none)."""

    generated_at: pd.Timestamp
    values: np.ndarray


# ------------------------------------------------------------------------------------------------ the client
class WattTimeClient:
    """A client of WattTime's data API v3 (module docstring): its token, time-outs, retries and units.

    Args:
        url: the service (``https://api.watttime.org``, or a stand-in's). credentials: its user and password.
        timeout_s: how long a call may take, s. retries: how many more tries a call gets when the service does not
            answer or answers 429 or 5xx. backoff_s: the wait before the first retry, s, doubled before each next one.
        token_life_s: a token is renewed when it is this old (a minute before WattTime's 30 minutes by default).

    Attributes:
        logins: how many times it logged in.
    """

    def __init__(
        self, url: str, credentials: ServiceCredentials, timeout_s: float = 5.0, retries: int = 2,
        backoff_s: float = 0.5, token_life_s: float = TOKEN_LIFE_S - 60.0,
    ):  # fmt: skip
        if not url.startswith(("http://", "https://")):
            raise LiveError(f"--moer-url: {url!r} is not an http:// or https:// address")
        self.url, self.credentials = url.rstrip("/"), credentials
        self.timeout_s, self.retries, self.backoff_s, self.token_life_s = timeout_s, retries, backoff_s, token_life_s
        self.token: str | None = None
        self.token_time = 0.0
        self.logins = 0

    def scrub(self, text: str) -> str:
        """``text`` with the password and the token taken out (an answer's text put in a message)."""
        for secret in (self.credentials.password, self.token):
            if secret:
                text = text.replace(secret, "***")
        return text

    def send(self, path: str, params: dict | None, authorization: str) -> dict:
        """``GET path?params`` with that ``Authorization`` header, tried again when the service does not answer or
        answers 429 or 5xx (after ``backoff_s``, doubled each time); returns the JSON answer.

        Raises:
            ServiceDown: no good answer at any try. Refused: another HTTP error (its status kept). LiveError: an
                answer that is not JSON.
        """
        url = self.url + path + ("?" + urlencode(params) if params else "")
        request = urllib.request.Request(url, headers={"Authorization": authorization, "Accept": "application/json"})
        t0, why = time.monotonic(), ""
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    body = answer.read()
                break
            except urllib.error.HTTPError as exc:
                detail = self.scrub(exc.read().decode("utf-8", "replace").strip())[:200]
                if exc.code not in RETRY_STATUS:
                    raise Refused(f"MOER service {self.url}: GET {path}: {exc.code} {exc.reason} {detail}".strip(),
                                  exc.code) from None  # fmt: skip
                why = f"{exc.code} {exc.reason}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                why = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
            if attempt < self.retries:
                wait = self.backoff_s * 2**attempt
                log.warning("MOER service %s: GET %s: %s (try %d of %d): again in %.3g s", self.url, path, why,
                            attempt + 1, self.retries + 1, wait)  # fmt: skip
                time.sleep(wait)
        else:
            raise ServiceDown(f"MOER service {self.url}: GET {path}: {why} at each of {self.retries + 1} tries over "
                              f"{time.monotonic() - t0:.1f} s")  # fmt: skip
        try:
            return json.loads(body)
        except ValueError:
            raise LiveError(f"MOER service {self.url}: GET {path}: the answer is not JSON") from None

    def login(self) -> None:
        """Log in (``GET /login``, HTTP Basic auth) and keep the token.

        Raises:
            LiveError: the credentials refused (401 or 403: the message says where they come from), no token in the
                answer. ServiceDown: no answer.
        """
        pair = f"{self.credentials.username}:{self.credentials.password}".encode()
        try:
            doc = self.send("/login", None, "Basic " + base64.b64encode(pair).decode())
        except Refused as exc:
            if exc.status in (401, 403):
                raise Refused(
                    f"MOER service {self.url}: login refused ({exc.status}) for user {self.credentials.username!r}: "
                    f"check {USER_VARIABLE} / {PASSWORD_VARIABLE} (or the file of --moer-credentials)",
                    exc.status,
                ) from None
            raise
        token = doc.get("token") if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token:
            raise LiveError(f"MOER service {self.url}: GET /login: no token in the answer")
        self.token, self.token_time = token, time.monotonic()
        self.logins += 1
        log.info("MOER service %s: logged in as %s", self.url, self.credentials.username)

    def get(self, path: str, params: dict) -> dict:
        """``GET path?params`` with the token (logged in first when there is none or it is old; once more after a
        401: the token expired); returns the JSON answer.

        Raises:
            ServiceDown, Refused, LiveError: as :meth:`send` and :meth:`login`.
        """
        if self.token is None or time.monotonic() - self.token_time > self.token_life_s:
            self.login()
        try:
            return self.send(path, params, f"Bearer {self.token}")
        except Refused as exc:
            if exc.status != 401:
                raise
        log.info("MOER service %s: the token was refused (expired): logging in again", self.url)
        self.login()
        return self.send(path, params, f"Bearer {self.token}")

    def historical(self, region: str, start: pd.Timestamp, end: pd.Timestamp) -> pd.Series:
        """The realised MOER from ``start`` to ``end`` (inclusive), kg CO2/kWh by ``point_time`` (UTC, sorted), 30 days
        a call."""
        out, lo, end = [], utc(start), utc(end)
        while lo <= end:
            hi = min(lo + pd.Timedelta(days=30) - INTERVAL, end)
            doc = self.get("/v3/historical", {"region": region, "start": iso(lo), "end": iso(hi),
                                              "signal_type": SIGNAL_TYPE})  # fmt: skip
            out += [(utc(p["point_time"]), float(p["value"])) for p in self.data(doc, "/v3/historical")]
            lo = hi + INTERVAL
        times = pd.DatetimeIndex([t for t, _ in out], dtype="datetime64[ns, UTC]")
        s = pd.Series([v for _, v in out], index=times, dtype=np.float64)
        s = s[~s.index.duplicated(keep="last")].sort_index()
        return s * KG_PER_KWH_PER_LBS_PER_MWH

    def forecast(self, region: str) -> Issued:
        """The forecast issued last (``/v3/forecast``), its first :data:`FORECAST_HOURS` hours."""
        doc = self.get("/v3/forecast", {"region": region, "signal_type": SIGNAL_TYPE,
                                        "horizon_hours": FORECAST_HOURS})  # fmt: skip
        meta = doc.get("meta") if isinstance(doc, dict) else None
        if not isinstance(meta, dict) or "generated_at" not in meta:
            raise LiveError(f"MOER service {self.url}: GET /v3/forecast: no meta.generated_at in the answer")
        return self.issued(meta["generated_at"], self.data(doc, "/v3/forecast"))

    def forecasts(self, region: str, start: pd.Timestamp, end: pd.Timestamp) -> list[Issued]:
        """The forecasts issued from ``start`` to ``end`` (inclusive; ``/v3/forecast/historical``, a day a call), in
        the order issued."""
        out, lo, end = {}, utc(start), utc(end)
        while lo <= end:
            hi = min(lo + pd.Timedelta(days=1) - INTERVAL, end)
            doc = self.get("/v3/forecast/historical", {"region": region, "start": iso(lo), "end": iso(hi),
                           "signal_type": SIGNAL_TYPE, "horizon_hours": FORECAST_HOURS})  # fmt: skip
            for f in self.data(doc, "/v3/forecast/historical"):
                got = self.issued(f.get("generated_at"), f.get("forecast") or [])
                out[got.generated_at] = got
            lo = hi + INTERVAL
        return [out[g] for g in sorted(out)]

    def signal_index(self, region: str) -> tuple[pd.Timestamp, float]:
        """Where the MOER stands now (``/v3/signal-index``): ``(point_time, percentile 0..100)``."""
        doc = self.get("/v3/signal-index", {"region": region, "signal_type": SIGNAL_TYPE})
        data = self.data(doc, "/v3/signal-index")
        if not data:
            raise LiveError(f"MOER service {self.url}: GET /v3/signal-index: no data")
        return utc(data[-1]["point_time"]), float(data[-1]["value"])

    def data(self, doc, path: str) -> list:
        """The ``data`` list of an answer.

        Raises:
            LiveError: none there.
        """
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            raise LiveError(f"MOER service {self.url}: GET {path}: no data list in the answer")
        return data

    def issued(self, generated_at, points: list) -> Issued:
        """A forecast from its ``generated_at`` and ``{point_time, value}`` points (lbs CO2/MWh), kg CO2/kWh."""
        if generated_at is None:
            raise LiveError(f"MOER service {self.url}: a forecast without generated_at")
        g, values = utc(generated_at), np.full(FORECAST_POINTS, np.nan)
        for p in points:
            k = (utc(p["point_time"]) - g) / INTERVAL
            if k == int(k) and 0 <= k < FORECAST_POINTS:
                values[int(k)] = float(p["value"]) * KG_PER_KWH_PER_LBS_PER_MWH
        return Issued(g, values)


# ------------------------------------------------------------------------------------------------ the feed
def service_source(site: Site) -> Sources:
    """The service as a carbon source of ``site`` for ingestion's :func:`pipeline.data.readers.carbon_at`: 5-minute
    MOER with its forecasts (``watttime-moer``), kg CO2/kWh; the other sources are not read."""
    return Sources(
        toml=Path(site.source.get("config", site.config.name)),
        config=site.config,
        root=Path("."),
        root_text=".",
        attribution="",
        notes="",
        sessions=SessionsSource("csv"),
        carbon=CarbonSource("watttime-moer"),
        weather=WeatherSource("clear-sky"),
        pv=PVParams.from_config(site.config.pv),
    )


class WattTimeFeed:
    """The MOER feed of a grid-carbon service speaking WattTime's API v3 (module docstring): the history of
    :class:`pipeline.live.sources.SiteDataFeed` with its MOER columns from the service.

    Args:
        site: the site. client: the service's client. region: the grid region asked for (e.g. ``CAISO_NORTH``).
        split: the split whose steps (and whose PV and sessions, from the site's files) the feed gives.

    Attributes:
        realised: the realised 5-minute MOER got so far, kg CO2/kWh by point time (UTC). issued: the forecast of
            each step got so far, by its ``generated_at``. last_error: why the service last failed (None: it did
            not). late: the steps given as they stood a step before. final: the MOER columns of the steps whose
            intervals had all come when laid, from the split's start (laid once).
    """

    def __init__(self, site: Site, client: WattTimeClient, region: str, split: str = "test"):
        if not region:
            raise LiveError("--moer-region: give the grid region of the site (e.g. CAISO_NORTH)")
        self.site, self.client, self.region, self.split = site, client, region, split
        self.files = SiteDataFeed(site, split)
        self.start, self.end = self.files.start, self.files.end
        self.dt = pd.Timedelta(timestep.step_timedelta(site.config.dt_h))
        self.source = service_source(site)
        self.realised = pd.Series([], index=pd.DatetimeIndex([], tz="UTC"), dtype=np.float64)
        self.realised_next = self.start - HISTORY_BEFORE
        self.issued: dict[pd.Timestamp, Issued] = {}
        self.issued_times: list[pd.Timestamp] = []
        self.issued_next = self.start
        self.last_error: str | None = None
        self.late: list[pd.Timestamp] = []
        self.final = pd.DataFrame(index=pd.DatetimeIndex([], tz="UTC", name="time"))
        self.last: tuple | None = None

    def check(self) -> None:
        """Log in and read the signal index, at start: refused credentials or region end the start in one clear
        error; a service that does not answer is only said (each step then falls back, or fails, until it does).

        Raises:
            LiveError: a refusal (400, 401, 403).
        """
        try:
            self.client.signal_index(self.region)
        except ServiceDown as exc:
            log.warning("%s: starting without it", exc)
        except Refused as exc:
            if exc.status in (400, 401, 403):
                raise
            log.warning("%s", exc)

    def span(self) -> tuple[pd.Timestamp, pd.Timestamp, str]:
        """The times the feed has data for, ``(start, end, what)`` (UTC, ``end`` excluded): its split, whose PV
        outlook and sessions come from the site's files (:func:`pipeline.live.sources.feed_span`)."""
        what = f"the {self.split} split of the site {self.site.config.name!r}, its MOER from {self.client.url}"
        return self.start, self.end, what

    def history(self, now: pd.Timestamp) -> FeedHistory:
        """What is known at step ``now``: :class:`pipeline.live.sources.SiteDataFeed`'s history with the service's
        MOER; as it stood a step before when the service is late (it then logs why).

        Raises:
            LiveError: a time that is not a step of the split; the service refused a call; the service late or down
                for more than an hour (the message says since when and why).
        """
        t = self.files.step(now)
        now = self.start + t * self.dt
        self.last_error = self.sync(now)
        known = self.known_at(now)
        key = (now, known, len(self.realised), len(self.issued))
        if self.last is None or self.last[0] != key:  # a step planned again with nothing new: the same history
            series, sessions = realised_history(self.site, self.split, t)
            self.last = (key, FeedHistory(self.with_service(series, known), sessions, self.end))
        got = self.last[1]
        return FeedHistory(got.series.copy(), got.sessions.copy(), got.window_end)

    # ------------------------------------------------------------------------------------------ what it knows
    def newest(self, time: pd.Timestamp) -> Issued | None:
        """The forecast held that was issued last at or before ``time``."""
        k = bisect.bisect_right(self.issued_times, time)
        return self.issued[self.issued_times[k - 1]] if k else None

    def fresh(self, step: pd.Timestamp) -> bool:
        """Whether the forecast of ``step`` is held: one issued after the step before it started."""
        got = self.newest(step)
        return got is not None and got.generated_at > step - self.dt

    def realised_before(self, step: pd.Timestamp) -> bool:
        """Whether the step before ``step`` has a realised point (always at the split's first step)."""
        if step <= self.start:
            return True
        idx = self.realised.index
        return bool(((idx >= step - self.dt) & (idx < step)).any())

    def hold(self, got: Issued) -> None:
        """Keep a forecast."""
        if got.generated_at not in self.issued:
            bisect.insort(self.issued_times, got.generated_at)
        self.issued[got.generated_at] = got

    def known_at(self, now: pd.Timestamp) -> pd.Timestamp:
        """The step the feed's history stands at: ``now``, or when the service is late (or down) at ``now`` the latest
        step before it whose forecast and realised MOER are held, at most
        :data:`pipeline.live.state.MAX_FORECAST_AGE_H` before ``now``.

        Raises:
            LiveError: none is held.
        """
        if self.fresh(now) and self.realised_before(now):
            return now
        newest = self.newest(now)
        since = f"the newest forecast got was issued at {newest.generated_at.isoformat()}" if newest else "no forecast"
        why = f"{self.last_error}; {since}" if self.last_error else since
        for k in range(1, late_steps(self.site.config.dt_h) + 1):
            prev = now - k * self.dt
            if prev < self.start:
                break
            if self.fresh(prev) and self.realised_before(prev):
                if self.late[-1:] != [now]:  # said once a step (a step may be planned more than once)
                    self.late.append(now)
                    log.warning(
                        "MOER service %s (%s): nothing new for the step %s (%s): the step falls back on the forecast "
                        "issued %d step(s) before", self.client.url, self.region, now.isoformat(), why, k,
                    )  # fmt: skip
                return prev
        raise LiveError(
            f"MOER service {self.client.url} ({self.region}): nothing for the step {now.isoformat()} nor for the "
            f"{MAX_FORECAST_AGE_H:g} h before it ({why}): the fall-back plans on a forecast at most "
            f"{MAX_FORECAST_AGE_H:g} h old"
        )

    # ------------------------------------------------------------------------------------------ asking the service
    def sync(self, now: pd.Timestamp) -> str | None:
        """Ask the service for what the feed lacks up to ``now``: the realised points since the last one got, the
        forecast of each step not held. Returns None, or why the service is down (said in the log).

        Raises:
            LiveError: the service refused a call.
        """
        try:
            self.fetch_realised(now)
            self.fetch_forecasts(now)
        except ServiceDown as exc:
            log.warning("%s", exc)
            return str(exc)
        return None

    def fetch_realised(self, now: pd.Timestamp) -> None:
        """The realised points from the last one got (or :data:`HISTORY_BEFORE` the split's start) to ``now``."""
        lo, hi = self.realised_next, now - INTERVAL
        if lo > hi:
            return
        got = self.client.historical(self.region, lo, hi)
        got = got[(got.index >= lo) & (got.index < now)]
        if len(got):
            merged = pd.concat([self.realised, got])
            self.realised = merged[~merged.index.duplicated(keep="last")].sort_index()
            self.realised_next = got.index.max() + INTERVAL

    def fetch_forecasts(self, now: pd.Timestamp) -> None:
        """The forecast of each step from the first not held to ``now``: the steps before ``now`` from the forecasts
        issued then (``/v3/forecast/historical``), ``now``'s the one issued last (``/v3/forecast``; from the issued
        ones too where the service's newest is later than ``now``: a replay of the past)."""
        steps = pd.date_range(self.issued_next, now, freq=self.dt) if self.issued_next <= now else []
        past = [s for s in steps if s < now and not self.fresh(s)]
        if past:
            got = self.client.forecasts(self.region, past[0] - self.dt + INTERVAL, past[-1])
            self.pick(got, past)
        if not self.fresh(now):
            current = self.client.forecast(self.region)
            if current.generated_at > now:
                self.pick(self.client.forecasts(self.region, now - self.dt + INTERVAL, now), [now])
            else:
                self.hold(current)
        self.issued_next = now + self.dt if self.fresh(now) else now

    def pick(self, got: list[Issued], steps) -> None:
        """Keep, for each of ``steps``, the forecast of ``got`` issued last at or before it, if issued after the step
        before it started."""
        times = [g.generated_at for g in got]
        for s in steps:
            k = bisect.bisect_right(times, s)
            if k and times[k - 1] > s - self.dt:
                self.hold(got[k - 1])

    # ------------------------------------------------------------------------------------------ the frame
    def step_columns(self, known: pd.Timestamp) -> pd.DataFrame:
        """The service's MOER columns of the split's steps up to ``known`` (inclusive), float64 kg CO2/kWh indexed by
        step time: the steps kept from before (:attr:`final`: those whose intervals had all come) and the others laid
        anew (:meth:`lay`); the newly complete ones are kept."""
        first = min(self.start + len(self.final) * self.dt, known)
        cols = self.lay(first, known)
        done = (cols.index < known) & (cols.index + self.dt <= self.realised_next)
        n = int(np.argmin(done)) if not done.all() else len(done)  # the complete steps from ``first`` on
        kept = self.final[self.final.index < first]
        self.final = pd.concat([kept, cols.iloc[:n]]) if len(kept) else cols.iloc[:n]
        return pd.concat([kept, cols]) if len(kept) else cols

    def lay(self, first: pd.Timestamp, known: pd.Timestamp) -> pd.DataFrame:
        """The MOER columns of the steps from ``first`` to ``known`` (inclusive) from the service's 5-minute points and
        forecasts, as ingestion lays 5-minute rows onto steps (:func:`pipeline.data.readers.carbon_at`: the points of
        the hour before ``first`` too, for its last 5 and 15 minutes). The step ``known``'s own MOER is not realised:
        its row gets the forecast's first interval, to be blanked.

        Raises:
            LiveError: a step before ``known`` without a realised point, or without any forecast.
        """
        steps = pd.date_range(first, known, freq=self.dt, name="time")
        lo = first - HISTORY_BEFORE
        idx = self.realised.index
        points = self.realised[(idx >= lo) & (idx < known)]
        issued = [g for g in self.issued_times if lo <= g <= known]
        times = points.index.union(pd.DatetimeIndex(issued)).union(pd.DatetimeIndex([known]))
        minutes = timestep.step_minutes(self.site.config.dt_h)
        count = np.bincount(step_bins(points.index[points.index >= first], first, minutes), minlength=len(steps))
        if (count[: len(steps) - 1] == 0).any():
            gap = steps[int(np.flatnonzero(count[: len(steps) - 1] == 0)[0])]
            raise LiveError(f"MOER service {self.client.url} ({self.region}): no realised MOER for the step starting "
                            f"{gap.isoformat()}")  # fmt: skip
        fc = np.full((len(times), FORECAST_POINTS), np.nan)
        before = self.newest(lo)  # the forecast in force at the first row (ingestion's nearest earlier row)
        if before is not None:
            fc[0] = before.values
        for g in issued:
            fc[times.get_loc(g)] = self.issued[g].values
        rows = pd.DataFrame(fc, index=times, columns=list(MOER_FORECAST_COLUMNS)).ffill()
        rows.insert(0, "moer", points.reindex(times).to_numpy())
        rows.loc[known, "moer"] = rows.loc[known, MOER_FORECAST_COLUMNS[0]]
        try:
            cols, _ = carbon_at(self.source, CarbonRows(rows, True, 5.0, [], [], self.client.url), steps)
        except SourceError as exc:
            raise LiveError(f"MOER service {self.client.url} ({self.region}): {exc}") from None
        return cols

    def with_service(self, series: pd.DataFrame, known: pd.Timestamp) -> pd.DataFrame:
        """``series`` (the split's rows, :func:`pipeline.live.realised_history`) with its MOER columns the service's
        (each in the column's dtype), as known at step ``known``."""
        cols = self.step_columns(known)
        times = pd.DatetimeIndex(series.time)
        n = len(cols)  # the split's first n steps, its rows from its start one a step
        if len(times) < n or not (times[:n].as_unit("ns").asi8 == cols.index.as_unit("ns").asi8).all():
            raise LiveError(f"MOER feed: the site's series of the {self.split} split lacks steps up to {known}")
        out = series.copy()
        for c in MOER_COLUMNS:
            if c not in out:
                continue
            dtype = out[c].dtype if out[c].dtype.kind == "f" else np.float64
            v = np.full(len(out), np.nan, dtype=dtype)
            v[:n] = cols[c].to_numpy().astype(dtype)
            out[c] = v
        return blank_unrealised(out, times, known)


def moer_feed(
    site: Site, feed: str = "files", split: str = "test", url: str = DEFAULT_URL, region: str | None = None,
    credentials: str | Path | None = None,
):  # fmt: skip
    """The central system's MOER feed (``evhub-csms --feed``): ``files``, the site's data files
    (:class:`pipeline.live.sources.SiteDataFeed`), or ``watttime``, a service speaking WattTime's API v3 at ``url``
    for ``region`` (:class:`WattTimeFeed`, its credentials from :func:`service_credentials`; checked at once:
    :meth:`WattTimeFeed.check`).

    Raises:
        LiveError: an unknown feed; ``--moer-region`` or ``--moer-credentials`` with ``files``; no region, no
            credentials or refused ones with ``watttime``.
    """
    if feed == "files":
        if region is not None or credentials is not None:
            raise LiveError("--moer-region / --moer-credentials: they go with --feed watttime (the feed is the files)")
        return SiteDataFeed(site, split)
    if feed != "watttime":
        raise LiveError(f"--feed: {feed!r} is neither files nor watttime")
    if not region:
        raise LiveError("--moer-region: give the grid region of the site with --feed watttime (e.g. CAISO_NORTH)")
    got = WattTimeFeed(site, WattTimeClient(url, service_credentials(credentials)), region, split)
    got.check()
    return got
