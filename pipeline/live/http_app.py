"""The central system's HTTP side: HTTP Basic auth against the store (:class:`Credentials`, the WebSocket handshake's
and the site's app's) and the site's app (:class:`SiteApp`).

With an HTTP port (``evhub-csms --http-port``) the central system serves the site's app, with the site controller's
credentials (Basic auth): ``POST /drivers/<charge point>/<connector>`` with ``{"departure": ISO 8601, "need_kwh":
kWh}`` sets the needs of the connector's open transaction (as ``DriverNeeds`` does), ``GET /battery`` gives the
battery's set-point for the step, and ``GET /`` is the operator's page, its data at ``GET /status.json``
(:mod:`pipeline.live.operator`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote, urlparse

from pipeline.live.operator import ConnectedIds, OperatorPage
from pipeline.live.planning import PlanningLoop
from pipeline.live.state import LiveError
from pipeline.live.store import Store, check_password

HTTP_MAX_BODY = 1 << 16
"""The largest request body of the HTTP endpoint (64 KiB); a larger one gets 413."""
HTTP_TIMEOUT_S = 10.0
"""How long the HTTP endpoint waits for a whole request, s (then 408)."""

Verdict = tuple[str | None, HTTPStatus | None, str]
"""What a request's credentials say: ``(id, None, "")`` for the id they authenticate, or ``(None, status, why)``."""
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:"
)
"""The operator's page's Content-Security-Policy: its own inline script and style, ``status.json``, nothing else."""


@dataclass(frozen=True)
class Reply:
    """An answer that is not JSON: its body and content type."""

    body: bytes
    content_type: str


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """``(user, password)`` of an HTTP Basic ``Authorization`` header value; None: none, or not Basic."""
    if not header or not header.startswith("Basic "):
        return None
    try:
        user, sep, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class Credentials:
    """HTTP Basic auth against the ids and salted password hashes of ``store`` (OCPP security profile 1)."""

    def __init__(self, store: Store):
        self.store = store
        self.verified: set[tuple[str, bytes]] = set()

    async def verify(self, cp_id: str, stored: str, password: str) -> bool:
        """Whether ``password`` is ``cp_id``'s (its stored hash ``stored``): scrypt in a worker thread (the event loop
        goes on serving meanwhile); a pair once verified is remembered by an HMAC of it (reconnections skip scrypt)."""
        key = (cp_id, hmac.new(stored.encode(), password.encode(), hashlib.sha256).digest())
        if key in self.verified:
            return True
        if not await asyncio.to_thread(check_password, stored, password):
            return False
        self.verified.add(key)
        return True

    async def site(self, header: str | None) -> Verdict:
        """The site controller a request's ``Authorization`` header authenticates, or 401 and why."""
        creds = basic_credentials(header)
        if creds is None:
            return None, HTTPStatus.UNAUTHORIZED, "no Basic credentials"
        user, password = creds
        known = self.store.charge_point(user)
        if known is None or known[1] != "site":
            return None, HTTPStatus.UNAUTHORIZED, f"{user!r} is not the site controller"
        if not await self.verify(user, known[0], password):
            return None, HTTPStatus.UNAUTHORIZED, f"wrong password for {user!r}"
        return user, None, ""

    async def charge_point(self, cp_id: str, header: str | None) -> Verdict:
        """Whether a request's ``Authorization`` header authenticates the charge point ``cp_id`` (the user must be
        it): its id, or 404 (an unknown id, "" included) or 401, and why."""
        known = self.store.charge_point(cp_id) if cp_id else None
        if known is None:
            return None, HTTPStatus.NOT_FOUND, f"unknown charge point {cp_id!r}"
        creds = basic_credentials(header)
        if creds is None:
            return None, HTTPStatus.UNAUTHORIZED, "no Basic credentials"
        user, password = creds
        if user != cp_id:
            return None, HTTPStatus.UNAUTHORIZED, f"user {user!r} is not the charge point of the path {cp_id!r}"
        if not await self.verify(cp_id, known[0], password):
            return None, HTTPStatus.UNAUTHORIZED, f"wrong password for {cp_id!r}"
        return cp_id, None, ""


class SiteApp:
    """The HTTP endpoint of the site's app (module docstring): one request a connection, answered with JSON (the
    operator's page with HTML).

    Args:
        planning: the central system's planning loop (its store, the battery's set-point, a driver's needs).
        credentials: the site controller's check.
        connected: the ids connected now, for the operator's page (:data:`pipeline.live.operator.ConnectedIds`;
            default: none known).
    """

    def __init__(self, planning: PlanningLoop, credentials: Credentials, connected: ConnectedIds | None = None):
        self.planning, self.credentials = planning, credentials
        self.operator = OperatorPage(planning, connected)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request (an ``asyncio.start_server`` callback), answered with JSON (or the operator's page) and the
        connection closed: 200, or 400 (a bad request or body), 401, 404 (no such endpoint, or no open transaction at
        the connector), 408, 411 (no ``Content-Length``), 413 (a body over :data:`HTTP_MAX_BODY`); never cached."""
        try:
            status, doc = await asyncio.wait_for(self.answer(reader), HTTP_TIMEOUT_S)
        except TimeoutError:
            status, doc = HTTPStatus.REQUEST_TIMEOUT, {"error": "the request did not come whole in time"}
        except (ValueError, UnicodeDecodeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, doc = HTTPStatus.BAD_REQUEST, {"error": "not an HTTP/1.1 request"}
        if status != HTTPStatus.OK:
            self.planning.store.log(self.planning.time_or_now(), "http_refused", f"{int(status)}: {doc.get('error')}")
        if isinstance(doc, Reply):
            body, kind = doc.body, doc.content_type
        else:
            body, kind = (json.dumps(doc) + "\n").encode(), "application/json"
        head = f"HTTP/1.1 {int(status)} {status.phrase}\r\nContent-Type: {kind}\r\n"
        head += f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
        head += "Connection: close\r\n"
        if kind.startswith("text/html"):
            head += f"Content-Security-Policy: {PAGE_POLICY}\r\n"
        if status == HTTPStatus.UNAUTHORIZED:
            head += 'WWW-Authenticate: Basic realm="evhub-csms"\r\n'
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + b"\r\n" + body)
            await writer.drain()
            writer.close()

    async def answer(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, dict | Reply]:
        """Read one request and act on it: ``(status, JSON document)``, or the operator's page (``GET /``, a
        :class:`Reply`; its data: ``GET /status.json``).

        Raises:
            ValueError, UnicodeDecodeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError: not HTTP.
        """
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, target, _ = head[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        _, status, why = await self.credentials.site(headers.get("authorization"))
        if status is not None:
            return status, {"error": why}
        path = unquote(urlparse(target).path)
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/battery":
            return HTTPStatus.OK, self.planning.battery_doc or {}
        if method == "GET" and path == "/":
            return HTTPStatus.OK, Reply(self.operator.html(), "text/html; charset=utf-8")
        if method == "GET" and path == "/status.json":
            return HTTPStatus.OK, await self.operator.status()
        if method != "POST" or len(parts) != 3 or parts[0] != "drivers" or not parts[2].isdigit():
            return HTTPStatus.NOT_FOUND, {
                "error": f"{method} {path}: give POST /drivers/<charge point>/<connector>, GET /battery, GET / (the "
                "operator's page) or GET /status.json"
            }
        length = headers.get("content-length", "")
        if not length.isdigit():
            return HTTPStatus.LENGTH_REQUIRED, {"error": "no Content-Length"}
        if int(length) > HTTP_MAX_BODY:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"a body over {HTTP_MAX_BODY} bytes"}
        cp_id, connector = parts[1], int(parts[2])
        open_tx = [
            t
            for t in self.planning.store.open_transactions()
            if (t["charge_point"], t["connector"]) == (cp_id, connector)
        ]
        if not open_tx:
            return HTTPStatus.NOT_FOUND, {"error": f"no open transaction at {cp_id!r} connector {connector}"}
        try:
            body = json.loads(await reader.readexactly(int(length)))
            if not isinstance(body, dict):
                raise LiveError("the body is not a JSON object")
            self.planning.driver_needs(open_tx[-1]["id"], body["departure"], body["need_kwh"], body.get("session_id"))
        except KeyError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": f"the body has no {exc.args[0]!r}"}
        except (LiveError, TypeError, ValueError) as exc:
            return HTTPStatus.BAD_REQUEST, {"error": str(exc)[:500]}
        return HTTPStatus.OK, {"transactionId": open_tx[-1]["id"]}
