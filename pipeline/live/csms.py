"""``evhub-csms``: the central system (CSMS) of a site, OCPP 1.6J and 2.0.1 over WebSocket, one asyncio process.

Charge points connect to ``ws[s]://host:port/<id>`` with the ``ocpp2.0.1`` or ``ocpp1.6`` subprotocol and HTTP Basic
auth (OCPP security profile 1: the user is the id of the path, the password's salted hash is in the store); TLS
(profile 2) with ``--certfile``/``--keyfile``, the same handshake for both versions. Unknown ids get 404, missing or
wrong credentials 401, at the handshake; frames over ``max_frame_bytes`` close the connection (1009); a frame that is
not OCPP, or an action not supported, gets a CALLERROR. Everything learnt is written to the store
(:class:`pipeline.live.store.Store`) before it is acted on.

Its parts, each a module:

- :mod:`pipeline.live.ocpp16` and :mod:`pipeline.live.ocpp201`: the protocols, OCPP 1.6J's and 2.0.1's handlers and
  calls (a session per connection); the subprotocols served are those of :data:`SESSIONS`;
- :mod:`pipeline.live.planning`: the planning loop: at each step of its clock, and after each StartTransaction,
  StopTransaction or driver's message, it takes the step (the live state from the store, the history from the MOER
  feed, :func:`pipeline.live.make_plan` given its last plan) and, where the controller plans anew, sends each
  connector with a car its ``SetChargingProfile``; between plans the chargers hold the profiles they were sent;
- :mod:`pipeline.live.http_app`: the HTTP side: Basic auth, and with an HTTP port (``--http-port``) the site's app
  (``POST /drivers/<charge point>/<connector>``, ``GET /battery``) and the operator's page (``GET /``,
  :mod:`pipeline.live.operator`);
- here: the WebSocket server and its handshake, the connections, the delivery of profiles (retried when rejected,
  sent again when a charge point reconnects, cleared when a transaction ends), the command, and its console
  (:func:`console`: what happens, one line each on stderr with the site's time).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import ssl
import sys
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

import pandas as pd
from ocpp.exceptions import OCPPError

from envs import timestep
from envs.site import Site
from pipeline.live import ocpp16, ocpp201
from pipeline.live.http_app import Credentials, SiteApp, Verdict
from pipeline.live.planning import CsmsOptions, PlanningLoop
from pipeline.live.profiles import LivePlan
from pipeline.live.sources import Clock, MoerFeed, SiteClock
from pipeline.live.state import LiveError
from pipeline.live.store import Store

SUBPROTOCOL = ocpp16.SUBPROTOCOL
"""The WebSocket subprotocol a charge point speaks (OCPP 1.6J)."""
VENDOR = ocpp16.VENDOR
"""The ``vendorId`` of the central system's ``DataTransfer`` messages (:data:`pipeline.live.ocpp16.VENDOR`)."""
SESSIONS = {ocpp201.SUBPROTOCOL: ocpp201.Session, ocpp16.SUBPROTOCOL: ocpp16.Session}
"""The session class of each subprotocol served (a protocol module's: :class:`pipeline.live.ocpp201.Session`,
:class:`pipeline.live.ocpp16.Session`); the handshake takes the first of them that the charge point offers (2.0.1 before
1.6J)."""
MAX_FRAME_BYTES = 1 << 20
"""The largest frame taken (1 MiB); a larger one closes the connection with 1009."""
log = logging.getLogger("evhub.csms")


class CentralSystem:
    """The central system (module docstring): the WebSocket server, its connections and the delivery of profiles,
    with the planning loop (:attr:`planning`) and the site's app (:attr:`app`).

    Args:
        site: the site. store: its record. clock: the time it plans by. feed: the MOER feed.
        mapping: ``{(charge point id, connector): socket}`` (:func:`pipeline.live.sources.default_mapping`).
        options: :class:`pipeline.live.planning.CsmsOptions`.
    """

    def __init__(
        self, site: Site, store: Store, clock: Clock, feed: MoerFeed, mapping: dict, options: CsmsOptions | None = None
    ):
        self.site, self.store, self.clock, self.feed, self.mapping = site, store, clock, feed, mapping
        self.options = options or CsmsOptions()
        self.connected: dict[str, ocpp16.Session | ocpp201.Session] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.planning = PlanningLoop(site, store, clock, feed, mapping, self.options, self)
        self.credentials = Credentials(store)
        self.app = SiteApp(self.planning, self.credentials, connected=lambda: list(self.connected))
        self.http_server: asyncio.Server | None = None

    @property
    def plans(self) -> list[LivePlan]:
        """The plans made (not those held), in order."""
        return self.planning.plans

    @property
    def plan_latency_s(self) -> list[float]:
        """The wall time of each plan made, s."""
        return self.planning.plan_latency_s

    @property
    def held(self) -> int:
        """How many steps held the last plan."""
        return self.planning.held

    # ------------------------------------------------------------------------------------------ serving
    async def start(
        self, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None,
        http_port: int | None = None,
    ):  # fmt: skip
        """Start serving (and planning), the HTTP endpoint too on ``http_port`` (0: any free port; None: not served,
        ``self.http_server`` None); returns the WebSocket server (``server.sockets[0].getsockname()`` gives the
        port)."""
        from websockets.asyncio.server import serve

        self.http_server = None
        if http_port is not None:
            self.http_server = await asyncio.start_server(self.app.serve, host, http_port, ssl=ssl_context)
        self.planning.start()
        self.server = await serve(
            self.handler,
            host,
            port,
            subprotocols=list(SESSIONS),
            process_request=self.process_request,
            ssl=ssl_context,
            max_size=MAX_FRAME_BYTES,
            compression=None,
            logger=log,
        )
        return self.server

    async def stop(self) -> None:
        """Stop serving and planning."""
        self.planning.stop()
        self.server.close()
        await self.server.wait_closed()
        if self.http_server is not None:
            self.http_server.close()
            await self.http_server.wait_closed()

    async def authorised(self, request) -> Verdict:
        """The id a handshake's request authenticates as (Basic auth against the path's id; ``/battery``: the site
        controller): ``(id, None, "")``, or ``(None, status, why)``."""
        path = unquote(urlparse(request.path).path)
        header = request.headers.get("Authorization")
        if path == "/battery":
            return await self.credentials.site(header)
        return await self.credentials.charge_point(path.rstrip("/").rsplit("/", 1)[-1], header)

    async def process_request(self, connection, request):
        """The handshake's hook: refuse strangers (404 / 401), serve ``GET /battery``, else let the upgrade go on."""
        cp_id, status, why = await self.authorised(request)
        if status is not None:
            self.store.log(self.planning.time_or_now(), "refused", f"{request.path}: {int(status)} {why}")
            response = connection.respond(status, f"{why}\n")
            if status == HTTPStatus.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = 'Basic realm="evhub-csms"'
            return response
        if urlparse(request.path).path == "/battery":
            response = connection.respond(HTTPStatus.OK, json.dumps(self.planning.battery_doc or {}) + "\n")
            response.headers["Content-Type"] = "application/json"
            return response
        return None

    async def handler(self, connection) -> None:
        """One charge point's connection: its session (of its subprotocol's protocol module) until it closes; its open
        transactions' latest profiles are sent again when it (re)connects."""
        from websockets.exceptions import ConnectionClosed

        if connection.subprotocol not in SESSIONS:
            await connection.close(1002, f"subprotocol {' or '.join(SESSIONS)} required")
            return
        cp_id = unquote(urlparse(connection.request.path).path).rstrip("/").rsplit("/", 1)[-1]
        _, role = self.store.charge_point(cp_id)
        session = SESSIONS[connection.subprotocol](cp_id, connection, self.planning, role)
        old = self.connected.get(cp_id)
        self.connected[cp_id] = session
        if old is not None:
            await old.connection.close(1000, "replaced by a new connection")
        self.store.log(self.planning.time_or_now(), "connected", cp_id)
        resend = asyncio.create_task(self.resend(cp_id))
        try:
            await session.start()
        except ConnectionClosed:
            pass
        finally:
            resend.cancel()
            if self.connected.get(cp_id) is session:
                del self.connected[cp_id]

    # ------------------------------------------------------------------------------------------ the profiles
    async def send_profile(self, cp_id: str, row: int) -> str:
        """Send the profile of store row ``row`` (the connector's latest when it is sent, under the charge point's
        lock), retried when rejected or unanswered; returns its status (recorded): ``"accepted"``, ``"rejected"``,
        ``"timeout"`` or ``"offline"``."""
        from websockets.exceptions import ConnectionClosed

        lock = self.locks.setdefault(cp_id, asyncio.Lock())
        async with lock:
            status, tries = "offline", 0
            for tries in range(self.options.retries + 1):
                session = self.connected.get(cp_id)
                if session is None:
                    status = "offline"
                    break
                payload = json.loads(self.store.db.execute("SELECT payload FROM profiles WHERE id = ?", (row,))
                                     .fetchone()["payload"])  # fmt: skip
                try:
                    status = "accepted" if await session.set_charging_profile(payload) else "rejected"
                except TimeoutError:
                    status = "timeout"
                except ConnectionClosed:
                    status = "offline"
                    break
                except OCPPError as exc:
                    status = "rejected"
                    self.store.log(self.planning.time_or_now(), "profile_error", f"{cp_id}: {exc}")
                if status == "accepted":
                    break
                self.store.log(
                    self.planning.time_or_now(), f"profile_{status}", f"{cp_id} profile {row} try {tries + 1}"
                )
                await asyncio.sleep(self.options.retry_delay_s)
            self.store.profile_status(row, status, tries, self.planning.time_or_now())
            return status

    async def resend(self, cp_id: str) -> None:
        """Send a (re)connected charge point the latest profile of each of its open transactions."""
        for tx in self.store.open_transactions():
            if tx["charge_point"] != cp_id:
                continue
            latest = self.store.latest_profile(cp_id, tx["connector"])
            if latest is None or latest["transaction_id"] != tx["id"]:
                continue
            row = self.store.profile_planned(latest["plan_time"], cp_id, tx["connector"], tx["id"], latest["payload"])
            what = f"{cp_id} connector {tx['connector']} row {row}"
            self.store.log(self.planning.time_or_now(), "profile_resent", what)
            await self.send_profile(cp_id, row)

    async def clear_ended(self) -> None:
        """Clear the charging profile of each ended transaction at its charge point (when connected)."""
        for tx in self.store.stopped_not_cleared():
            session = self.connected.get(tx["charge_point"])
            if session is None:
                continue
            socket = self.mapping.get((tx["charge_point"], tx["connector"]))
            with contextlib.suppress(Exception):
                async with self.locks.setdefault(tx["charge_point"], asyncio.Lock()):
                    await session.clear_charging_profile(1 + socket if socket is not None else None, tx["connector"])
                self.store.mark_cleared(tx["id"])


# ------------------------------------------------------------------------------------------------ the console
LOG_LEVELS = ("debug", "info", "warning", "error")
"""The console's levels (``--log-level``): ``debug`` also says each step that holds the last plan and each OCPP
frame, ``info`` each plan and each charge point that connects, ``warning`` only what went wrong."""
CHARGE_POINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("charge_point", default=None)
"""The charge point whose frame the ``ocpp`` package handles in this task (set from its own log of each frame)."""
_WEBSOCKETS = f"{os.sep}websockets{os.sep}"


class SiteTimeFormatter(logging.Formatter):
    """A record in one line: the site's time (the record's ``site_time`` where it has one, else ``now()``) in the
    site's time zone, the level, the message (its line breaks made spaces); a record with a traceback (a bug) keeps it
    on the lines after.

    Args:
        now: the time when a record carries none (the planning loop's clock). tz: the site's time zone.
    """

    def __init__(self, now, tz: str):
        super().__init__()
        self.now, self.tz = now, tz

    def format(self, record: logging.LogRecord) -> str:
        try:
            when = pd.Timestamp(getattr(record, "site_time", None) or self.now())
        except (TypeError, ValueError):  # a time a charger wrote badly: the clock's
            when = pd.Timestamp(self.now())
        when = (when.tz_localize("UTC") if when.tz is None else when).tz_convert(self.tz)
        line = f"{when.isoformat(timespec='seconds')} {record.levelname} {' '.join(record.getMessage().split())}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class OcppOneLine(logging.Filter):
    """The ``ocpp`` package's log as lines of the central system's: its line per frame only at ``debug`` (each one
    names the charge point of the task, :data:`CHARGE_POINT`); a CALLERROR it sends or receives, and a frame it cannot
    parse, one WARNING line of :data:`log` (who, which action, the error's code and cause) in place of its tracebacks;
    a handler's exception that is not an OCPP error (a bug) keeps its traceback."""

    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None and record.levelno < logging.WARNING:
            if "receive message" in str(record.msg) and record.args:
                CHARGE_POINT.set(str(record.args[0]))
            return self.verbose
        if exc is not None and not isinstance(exc, OCPPError):
            return True
        who = CHARGE_POINT.get() or "a charge point"
        first = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if isinstance(exc, OCPPError):
            action = getattr(first, "action", None)
            cause = (exc.details or {}).get("cause") if isinstance(exc.details, dict) else None
            what = f"{action} answered with CALLERROR" if action else "a frame that is not OCPP:"
            log.warning("%s: %s %s: %s", who, what, exc.code, cause or exc.description)
        elif hasattr(first, "error_code"):
            log.warning("%s: a call answered with CALLERROR %s: %s", who, first.error_code, first.error_description)
        else:
            log.warning("%s: %s", who, record.getMessage())
        return False


class ConsoleHandler(logging.StreamHandler):
    """The central system's console: stderr, :class:`SiteTimeFormatter`'s lines (:func:`console`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop the ``websockets`` package's own notes (a connection opened, closed, refused: the central system says
        what matters) below WARNING unless the console says DEBUG."""
        if record.levelno < logging.WARNING and _WEBSOCKETS in record.pathname and self.level > logging.DEBUG:
            return False
        return super().filter(record)


def console(central: CentralSystem, level: str = "info") -> ConsoleHandler:
    """Say what the central system does on stderr, one line each with the site's time (the module's logger, the
    store's events, the ``ocpp`` package's log through :class:`OcppOneLine`) at ``level`` (:data:`LOG_LEVELS`);
    replaces a console set before. Returns its handler (``logging.getLogger().removeHandler`` ends it).

    Raises:
        LiveError: a level not in :data:`LOG_LEVELS`.
    """
    if level not in LOG_LEVELS:
        raise LiveError(f"--log-level: {level!r} is not one of {', '.join(LOG_LEVELS)}")
    root, value = logging.getLogger(), getattr(logging, level.upper())
    for old in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:
        root.removeHandler(old)
    handler = ConsoleHandler(sys.stderr)
    handler.setLevel(value)
    handler.setFormatter(SiteTimeFormatter(central.planning.time_or_now, central.site.config.timezone))
    root.addHandler(handler)  # the other packages' warnings too, in the same lines
    log.setLevel(value)
    ocpp_log = logging.getLogger("ocpp")
    ocpp_log.setLevel(logging.DEBUG if value <= logging.DEBUG else logging.INFO)  # its frames name the charge point
    for f in [f for f in ocpp_log.filters if isinstance(f, OcppOneLine)]:
        ocpp_log.removeFilter(f)
    ocpp_log.addFilter(OcppOneLine(verbose=value <= logging.DEBUG))
    return handler


# ------------------------------------------------------------------------------------------------ the command
@dataclass
class Args:
    """evhub-csms: the site's central system, OCPP 1.6J over WebSocket (docs/live.md): at each step of the site it
    plans with a controller of the study where the controller would (each hour's start, a car that comes) and sends
    each connector with a car its charging profile; between plans the last plan holds."""

    site: str = "caltech"
    """the site: a shipped name (caltech, iquitos) or the path of a site TOML"""
    controller: str | None = None
    """the causal planner of the registry that plans (docs/live.md); default: the report's answer for the site, read
    from its results (as evhub-plan's)"""
    db: Path = Path("outputs/csms/csms.sqlite")
    """the central system's record (SQLite): charge points, transactions, meter values, profiles, set-points"""
    host: str = "127.0.0.1"
    """the address to listen on"""
    port: int = 9000
    """the port to listen on"""
    http_port: int | None = None
    """the port of the HTTP endpoint for the site's app (POST /drivers/<charge point>/<connector>, GET /battery;
    the site controller's credentials; TLS as the WebSocket's); default: not served"""
    certfile: Path | None = None
    """TLS certificate (PEM; OCPP security profile 2: wss://); with --keyfile"""
    keyfile: Path | None = None
    """TLS private key (PEM)"""
    credentials: Path | None = None
    """a file of lines `id password [role]` (role charge_point or site): registered, salted and hashed, in the
    store at start (the file can then be removed)"""
    mapping: Path | None = None
    """a JSON list of {charge_point, connector, socket} (default: one charge point per socket, named after its
    first station in the site's data, connector 1)"""
    battery_file: Path | None = Path("outputs/csms/battery.json")
    """where the battery's set-point is written (JSON, atomically; also served at GET /battery)"""
    clock: str = "wall"
    """wall: plan at each step of the real time; site: the site controller sets the time (a simulated site)"""
    split: str = "test"
    """the split of the site's data the MOER feed reads (the site's data files stand for the grid's feed)"""
    feed: Literal["files", "watttime"] = "files"
    """where the MOER comes from: files, the site's data files (--split); watttime, a grid-carbon service speaking
    WattTime's API v3 (--moer-url, --moer-region; its user and password from WATTTIME_USERNAME and
    WATTTIME_PASSWORD, or --moer-credentials), the PV outlook and the sessions still the site's files (docs/live.md)"""
    moer_url: str = "https://api.watttime.org"
    """with --feed watttime: the service's address"""
    moer_region: str | None = None
    """with --feed watttime: the grid region of the site (e.g. CAISO_NORTH)"""
    moer_credentials: Path | None = None
    """with --feed watttime: a file of the lines WATTTIME_USERNAME=... and WATTTIME_PASSWORD=... (default: the
    environment)"""
    output_dir: str = "outputs"
    """the study's output folder (its results and tuning)"""
    experiment: str = ""
    """the study's experiment folder in it (default: the site's name)"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """what the console (stderr) says, one line each with the site's time: info each plan and each charge point that
    connects, and what went wrong; warning only what went wrong; debug also each step that holds the last plan and
    each OCPP frame (docs/live.md)"""


def read_credentials(path: Path) -> list[tuple[str, str, str]]:
    """The ``id password [role]`` lines of a credentials file (blank lines and ``#`` comments skipped).

    Raises:
        LiveError: no such file, or a line without an id and a password (the message names the line).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise LiveError(f"--credentials: {path}: no such file") from None
    out = []
    for k, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) not in (2, 3):
            raise LiveError(f"--credentials: {path} line {k}: give `id password [role]`")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else "charge_point"))
    return out


def server_tls(certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """The TLS context of ``--certfile``/``--keyfile`` (None without them).

    Raises:
        LiveError: only one of them, or files TLS cannot load (the message names them).
    """
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise LiveError("--certfile / --keyfile: give both (TLS needs the certificate and its key)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise LiveError(f"--certfile / --keyfile: {certfile}, {keyfile}: not a certificate and key ({exc})") from None
    return ctx


def build(args: Args) -> CentralSystem:
    """The central system of ``args`` (its store opened, the credentials registered).

    Raises:
        LiveError: a bad option (the message names it). ConfigError, FileNotFoundError: an unknown site.
    """
    from envs.site import load_site
    from pipeline.live.controllers import answer, check_controller
    from pipeline.live.sources import WallClock, default_mapping, read_mapping
    from pipeline.live.store import StoreError
    from pipeline.live.watttime import moer_feed

    if args.clock not in ("wall", "site"):
        raise LiveError(f"--clock: {args.clock!r} is neither wall nor site")
    site = load_site(args.site)
    controller = args.controller or answer(site, args.output_dir, args.experiment)
    check_controller(controller)
    if args.split not in ("train", "test"):
        raise LiveError(f"--split: {args.split!r} is neither train nor test")
    feed = moer_feed(site, args.feed, args.split, args.moer_url, args.moer_region, args.moer_credentials)
    store = Store(args.db)
    if args.credentials is not None:
        try:
            for cp_id, password, role in read_credentials(args.credentials):
                store.add_charge_point(cp_id, password, role)
        except StoreError as exc:
            raise LiveError(f"--credentials: {exc}") from None
    mapping = (
        read_mapping(args.mapping, site.config.ev.n_sockets) if args.mapping is not None else default_mapping(site)
    )
    options = CsmsOptions(
        controller=controller,
        plan_kwargs={"output_dir": args.output_dir, "experiment": args.experiment},
        battery_file=args.battery_file,
        step_timer=args.clock == "wall",
    )
    clock = SiteClock() if args.clock == "site" else WallClock()
    return CentralSystem(site, store, clock, feed, mapping, options)


async def serve_forever(
    central: CentralSystem, host: str, port: int, tls: ssl.SSLContext | None, http_port: int | None = None
) -> None:
    """Serve until cancelled, once the clock and the MOER feed can meet
    (:func:`pipeline.live.sources.check_clock_meets_feed`); the addresses served go to stdout.

    Raises:
        LiveError: a wall clock outside the feed's data (nothing is served).
    """
    from pipeline.live.sources import check_clock_meets_feed

    check_clock_meets_feed(central.clock, central.feed, central.site.config.dt_h)
    server = await central.start(host, port, tls, http_port)
    scheme = "wss" if tls else "ws"
    print(f"evhub-csms: listening on {scheme}://{host}:{server.sockets[0].getsockname()[1]}/<charge point id>",
          flush=True)  # fmt: skip
    every = f"{timestep.step_minutes(central.site.config.dt_h)} minutes"
    print(f"evhub-csms: a step every {every} with {central.options.controller}: a plan at each hour's start and when "
          "a car comes, the last plan held between", flush=True)  # fmt: skip
    if central.http_server is not None:
        got = central.http_server.sockets[0].getsockname()[1]
        scheme = "https" if tls else "http"
        print(f"evhub-csms: the site's app at {scheme}://{host}:{got}/drivers/<charge point>/<connector>", flush=True)
    try:
        await asyncio.Future()
    finally:
        await central.stop()


def main(argv: list[str] | None = None) -> int:
    """``evhub-csms`` (tyro): parse :class:`Args`, serve with its :func:`console` on stderr; an expected error
    (a bad option, a clock the feed cannot meet) prints one line and returns 1."""
    import tyro

    from envs.errors import exit_code

    args = tyro.cli(Args, args=argv)

    def run() -> None:
        tls = server_tls(args.certfile, args.keyfile)
        central = build(args)
        handler = console(central, args.log_level)
        try:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(serve_forever(central, args.host, args.port, tls, args.http_port))
        finally:
            logging.getLogger().removeHandler(handler)

    return exit_code(run)


if __name__ == "__main__":
    raise SystemExit(main())
