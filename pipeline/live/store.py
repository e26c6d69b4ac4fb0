"""The central system's record (:class:`Store`): one SQLite file in WAL mode, one commit per event, written before the
central system acts on it: the charge points and their password hashes, the transactions (with the driver's departure
and need; one table whatever the version of OCPP: each has the central system's integer id, and a 2.0.1 transaction
the charger's own id as well), the meter values, the plans made (their wall time), every charging profile sent and
what became of it, the battery's SOC reports and set-points, and a log of what went wrong. A central system killed at
any instant restarts from it.

Times are stored as ISO 8601 strings in UTC; energy in Wh (meters) or kWh (needs); power in kW.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
from pathlib import Path

import pandas as pd

console = logging.getLogger("evhub.csms")
"""Where :meth:`Store.log` says each event in one line (the central system's console:
:func:`pipeline.live.csms.console`)."""
NOTICE_EVENTS = frozenset({"connected", "profile_resent"})
"""The events of :meth:`Store.log` that say things go as they should: said at INFO, every other kind at WARNING."""
ROLES = ("charge_point", "site")
"""Who may connect: a ``charge_point`` (its connectors get charging profiles) or the ``site`` controller (the
battery's management system: it reports the SOC, reads the set-point; with the site clock, it sets the time)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS charge_points (
    id TEXT PRIMARY KEY, password_hash TEXT NOT NULL, role TEXT NOT NULL DEFAULT 'charge_point'
);
CREATE TABLE IF NOT EXISTS transactions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, charge_point TEXT NOT NULL, connector INTEGER NOT NULL,
    id_tag TEXT NOT NULL, start_time TEXT NOT NULL, meter_start_wh REAL NOT NULL,
    stop_time TEXT, meter_stop_wh REAL, stop_reason TEXT,
    departure TEXT, need_kwh REAL, session_id TEXT, needs_source TEXT NOT NULL DEFAULT 'expected',
    cleared INTEGER NOT NULL DEFAULT 0, charger_tx_id TEXT
);
CREATE TABLE IF NOT EXISTS meter_values (
    transaction_id INTEGER NOT NULL, time TEXT NOT NULL, energy_wh REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS meter_by_tx ON meter_values (transaction_id, time);
CREATE TABLE IF NOT EXISTS profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT, plan_time TEXT NOT NULL, charge_point TEXT NOT NULL,
    connector INTEGER NOT NULL, transaction_id INTEGER, payload TEXT NOT NULL, sent_at TEXT,
    status TEXT NOT NULL DEFAULT 'pending', retries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS profile_by_connector ON profiles (charge_point, connector, id);
CREATE TABLE IF NOT EXISTS battery (
    time TEXT NOT NULL, kind TEXT NOT NULL, value REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS plans (
    time TEXT NOT NULL, controller TEXT NOT NULL, wall_s REAL NOT NULL, profiles INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    time TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS connector_status (
    charge_point TEXT NOT NULL, connector INTEGER NOT NULL, status TEXT NOT NULL, time TEXT NOT NULL,
    error_code TEXT, PRIMARY KEY (charge_point, connector)
);
"""


class StoreError(ValueError):
    """A request the store refuses (an unknown transaction, a bad role): the message names it."""


SCRYPT_N = 2**14
"""scrypt's cost (its ``n``; ``r`` = 8, ``p`` = 1: 16 MiB and some 50 ms a hash): the strength of the stored hashes."""


def hash_password(password: str, n: int = SCRYPT_N) -> str:
    """A salted scrypt hash of ``password`` (``scrypt$n$r$p$salt$hash``, hex) at cost ``n``; the password itself is
    never stored.

    Raises:
        StoreError: ``n`` is not a power of 2 above 1.
    """
    if n < 2 or n & (n - 1):
        raise StoreError(f"scrypt cost n = {n}: give a power of 2 above 1")
    salt = secrets.token_bytes(16)
    r, p = 8, 1
    digest = hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, dklen=32)
    return f"scrypt${n}${r}${p}${salt.hex()}${digest.hex()}"


def check_password(stored: str, password: str) -> bool:
    """Whether ``password`` matches ``stored`` (:func:`hash_password`'s form), compared in constant time."""
    try:
        kind, n, r, p, salt, digest = stored.split("$")
    except ValueError:
        return False
    if kind != "scrypt":
        return False
    got = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p), dklen=32)
    return hmac.compare_digest(got.hex(), digest)


def utc_text(ts) -> str:
    """A time as the store keeps it: ISO 8601, UTC."""
    return pd.Timestamp(ts).tz_convert("UTC").isoformat()


class Store:
    """The central system's SQLite record (module docstring). Every method that records commits before returning.

    Args:
        path: the database file (created with its folder when missing).
        scrypt_n: the cost of the password hashes it writes (:func:`hash_password`; a stored hash keeps its own
            cost, so a store may hold hashes of several).
    """

    def __init__(self, path: str | Path, scrypt_n: int = SCRYPT_N):
        self.path = Path(path)
        self.scrypt_n = int(scrypt_n)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self.upgrade_transactions()

    def close(self) -> None:
        """Close the database."""
        self.db.close()

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self.db:
            return self.db.execute(sql, args)

    # ------------------------------------------------------------------------------------------ charge points
    def add_charge_point(self, cp_id: str, password: str, role: str = "charge_point") -> None:
        """Register ``cp_id`` (or replace its password) with a salted hash of ``password``.

        Raises:
            StoreError: an empty id or password, or a role not in :data:`ROLES`.
        """
        if not cp_id or "/" in cp_id:
            raise StoreError(f"charge point id {cp_id!r}: give a non-empty id without '/'")
        if not password:
            raise StoreError(f"charge point {cp_id!r}: empty password")
        if role not in ROLES:
            raise StoreError(f"charge point {cp_id!r}: role {role!r} is not one of {', '.join(ROLES)}")
        self._write(
            "INSERT INTO charge_points (id, password_hash, role) VALUES (?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET password_hash = excluded.password_hash, role = excluded.role",
            (cp_id, hash_password(password, self.scrypt_n), role),
        )

    def charge_point(self, cp_id: str) -> tuple[str, str] | None:
        """``(password_hash, role)`` of a registered id, else None."""
        row = self.db.execute("SELECT password_hash, role FROM charge_points WHERE id = ?", (cp_id,)).fetchone()
        return (row["password_hash"], row["role"]) if row else None

    # ------------------------------------------------------------------------------------------ transactions
    def upgrade_transactions(self) -> None:
        """Bring a store file written before 2.0.1 up to date: add the column ``charger_tx_id`` (the charger's own
        transaction id) when missing, and its index; a file already up to date is left as it is."""
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(transactions)").fetchall()}
        with self.db:
            if "charger_tx_id" not in columns:
                self.db.execute("ALTER TABLE transactions ADD COLUMN charger_tx_id TEXT")
            self.db.execute(
                "CREATE INDEX IF NOT EXISTS tx_by_charger_id ON transactions (charge_point, charger_tx_id) "
                "WHERE charger_tx_id IS NOT NULL"
            )

    def start_transaction(
        self, cp_id: str, connector: int, id_tag: str, time, meter_start_wh: float | None,
        charger_tx_id: str | None = None,
    ) -> int:  # fmt: skip
        """Record a transaction's start (1.6's StartTransaction, 2.0.1's TransactionEvent ``Started``); returns its
        id (> 0): the central system's, whatever the version.

        Args:
            meter_start_wh: the energy register at the start, Wh; None: not given (a 2.0.1 ``Started`` without it):
                the transaction's first meter reading (:meth:`meter_value`) becomes its start.
            charger_tx_id: the charger's own id of the transaction (2.0.1's ``transactionId``, a string); None for
                1.6, whose transaction id is the central system's.
        """
        cur = self._write(
            "INSERT INTO transactions (charge_point, connector, id_tag, start_time, meter_start_wh, charger_tx_id) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (cp_id, int(connector), id_tag, utc_text(time), float(meter_start_wh or 0.0), charger_tx_id),
        )
        if meter_start_wh is not None:
            self.meter_value(cur.lastrowid, time, meter_start_wh)
        return int(cur.lastrowid)

    def transaction(self, tx_id: int) -> dict | None:
        """One transaction's row as a dict (None: unknown id)."""
        row = self.db.execute("SELECT * FROM transactions WHERE id = ?", (int(tx_id),)).fetchone()
        return dict(row) if row else None

    def charger_transaction(self, cp_id: str, charger_tx_id: str) -> dict | None:
        """The transaction a charge point knows by its own id (2.0.1's ``transactionId``): its row as a dict, the
        latest one where a charger used the id twice; None: unknown there."""
        row = self.db.execute(
            "SELECT * FROM transactions WHERE charge_point = ? AND charger_tx_id = ? ORDER BY id DESC LIMIT 1",
            (cp_id, str(charger_tx_id)),
        ).fetchone()
        return dict(row) if row else None

    def stop_transaction(self, tx_id: int, time, meter_stop_wh: float | None, reason: str | None = None) -> None:
        """Record a transaction's end (1.6's StopTransaction, 2.0.1's TransactionEvent ``Ended``) and its meter
        reading (None: not given; the stop is then the latest reading, or the start without one).

        Raises:
            StoreError: an unknown transaction id.
        """
        if self.transaction(tx_id) is None:
            raise StoreError(f"transaction {tx_id}: unknown transaction id")
        if meter_stop_wh is None:
            latest = self.db.execute(
                "SELECT m.energy_wh FROM meter_values m WHERE m.transaction_id = ? ORDER BY m.time DESC, m.rowid DESC "
                "LIMIT 1",
                (int(tx_id),),
            ).fetchone()
            meter_stop_wh = latest["energy_wh"] if latest else self.transaction(tx_id)["meter_start_wh"]
        else:
            self.meter_value(tx_id, time, meter_stop_wh)
        self._write(
            "UPDATE transactions SET stop_time = ?, meter_stop_wh = ?, stop_reason = ? WHERE id = ?",
            (utc_text(time), float(meter_stop_wh), reason, int(tx_id)),
        )

    def set_needs(self, tx_id: int, departure, need_kwh: float, session_id: str | None, source: str) -> None:
        """Record the driver's departure and energy need of a transaction (``source``: ``driver`` or ``expected``).

        Raises:
            StoreError: an unknown transaction id.
        """
        if self.transaction(tx_id) is None:
            raise StoreError(f"transaction {tx_id}: unknown transaction id")
        self._write(
            "UPDATE transactions SET departure = ?, need_kwh = ?, session_id = ?, needs_source = ? WHERE id = ?",
            (utc_text(departure), float(need_kwh), session_id, source, int(tx_id)),
        )

    def open_transactions(self) -> list[dict]:
        """The transactions not stopped, each with ``energy_wh``: its latest meter reading (Wh)."""
        rows = self.db.execute(
            "SELECT t.*, (SELECT energy_wh FROM meter_values m WHERE m.transaction_id = t.id "
            "ORDER BY m.time DESC, m.rowid DESC LIMIT 1) AS energy_wh FROM transactions t WHERE stop_time IS NULL "
            "ORDER BY t.id"
        ).fetchall()
        return [dict(r) for r in rows]

    def open_transaction_at(self, charge_point: str, connector: int) -> dict | None:
        """The open transaction at ``connector`` of ``charge_point`` (the latest, where a stale one was never
        stopped), with ``energy_wh`` as in :meth:`open_transactions`; None where there is none."""
        row = self.db.execute(
            "SELECT t.*, (SELECT energy_wh FROM meter_values m WHERE m.transaction_id = t.id "
            "ORDER BY m.time DESC, m.rowid DESC LIMIT 1) AS energy_wh FROM transactions t WHERE stop_time IS NULL "
            "AND charge_point = ? AND connector = ? ORDER BY t.id DESC LIMIT 1",
            (charge_point, int(connector)),
        ).fetchone()
        return None if row is None else dict(row)

    def transactions(self) -> list[dict]:
        """Every transaction, in order."""
        return [dict(r) for r in self.db.execute("SELECT * FROM transactions ORDER BY id").fetchall()]

    def stopped_not_cleared(self) -> list[dict]:
        """The stopped transactions whose charging profile has not been cleared yet."""
        rows = self.db.execute("SELECT * FROM transactions WHERE stop_time IS NOT NULL AND cleared = 0").fetchall()
        return [dict(r) for r in rows]

    def mark_cleared(self, tx_id: int) -> None:
        """Record that the profile of a stopped transaction was cleared at its charge point."""
        self._write("UPDATE transactions SET cleared = 1 WHERE id = ?", (int(tx_id),))

    def meter_value(self, tx_id: int, time, energy_wh: float) -> None:
        """Record a meter reading of a transaction's connector (Wh, the register); a transaction's first reading is
        its start where its start gave none (:meth:`start_transaction`)."""
        args = (int(tx_id), utc_text(time), float(energy_wh))
        with self.db:
            self.db.execute(
                "UPDATE transactions SET meter_start_wh = ? WHERE id = ? "
                "AND NOT EXISTS (SELECT 1 FROM meter_values WHERE transaction_id = ?)",
                (args[2], args[0], args[0]),
            )
            self.db.execute("INSERT INTO meter_values (transaction_id, time, energy_wh) VALUES (?, ?, ?)", args)

    # ------------------------------------------------------------------------------------------ profiles
    def profile_planned(self, plan_time, cp_id: str, connector: int, tx_id: int | None, payload: dict) -> int:
        """Record a charging profile before it is sent (status ``pending``); returns its row id."""
        cur = self._write(
            "INSERT INTO profiles (plan_time, charge_point, connector, transaction_id, payload) VALUES (?, ?, ?, ?, ?)",
            (utc_text(plan_time), cp_id, int(connector), tx_id, json.dumps(payload)),
        )
        return int(cur.lastrowid)

    def profile_status(self, row: int, status: str, retries: int, sent_at) -> None:
        """Record what became of a profile: ``accepted``, ``rejected``, ``timeout`` or ``offline``."""
        self._write(
            "UPDATE profiles SET status = ?, retries = ?, sent_at = ? WHERE id = ?",
            (status, int(retries), utc_text(sent_at), int(row)),
        )

    def latest_profile(self, cp_id: str, connector: int) -> dict | None:
        """The last profile planned for a connector (its row, ``payload`` parsed), else None."""
        row = self.db.execute(
            "SELECT * FROM profiles WHERE charge_point = ? AND connector = ? ORDER BY id DESC LIMIT 1",
            (cp_id, int(connector)),
        ).fetchone()
        if row is None:
            return None
        out = dict(row)
        out["payload"] = json.loads(out["payload"])
        return out

    def profiles(self) -> list[dict]:
        """Every profile row, in order (``payload`` as JSON text)."""
        return [dict(r) for r in self.db.execute("SELECT * FROM profiles ORDER BY id").fetchall()]

    def plan_made(self, time, controller: str, wall_s: float, profiles: int) -> None:
        """Record a plan: its step, controller, wall time (s) and how many profiles it sends."""
        self._write(
            "INSERT INTO plans (time, controller, wall_s, profiles) VALUES (?, ?, ?, ?)",
            (utc_text(time), controller, float(wall_s), int(profiles)),
        )

    def plans(self) -> list[dict]:
        """Every plan recorded, in order."""
        return [dict(r) for r in self.db.execute("SELECT * FROM plans ORDER BY rowid").fetchall()]

    # ------------------------------------------------------------------------------------------ battery, log
    def battery(self, time, kind: str, value: float) -> None:
        """Record a battery value at ``time``: ``soc`` (a report, fraction), ``setpoint_kw`` (sent, kW, + = charge),
        ``day_start_soc`` / ``day_start_need_kwh`` (the site at a local midnight)."""
        self._write("INSERT INTO battery (time, kind, value) VALUES (?, ?, ?)", (utc_text(time), kind, float(value)))

    def latest_battery(self, kind: str) -> tuple[pd.Timestamp, float] | None:
        """The last ``(time, value)`` of a battery value's kind, else None."""
        row = self.db.execute(
            "SELECT time, value FROM battery WHERE kind = ? ORDER BY rowid DESC LIMIT 1", (kind,)
        ).fetchone()
        return (pd.Timestamp(row["time"]), float(row["value"])) if row else None

    def log(self, time, kind: str, detail: str) -> None:
        """Record an event worth a look (a rejected profile, a late MOER feed, an unknown transaction) and say it in
        one line, ``kind: detail`` at ``time``, on :data:`console` (INFO for :data:`NOTICE_EVENTS`, else WARNING)."""
        self._write("INSERT INTO events (time, kind, detail) VALUES (?, ?, ?)", (utc_text(time), kind, detail))
        level = logging.INFO if kind in NOTICE_EVENTS else logging.WARNING
        console.log(level, "%s: %s", kind, detail, extra={"site_time": time})

    def events(self, kind: str | None = None) -> list[dict]:
        """The log, in order (only ``kind``'s when given)."""
        sql, args = "SELECT * FROM events ORDER BY rowid", ()
        if kind is not None:
            sql, args = "SELECT * FROM events WHERE kind = ? ORDER BY rowid", (kind,)
        return [dict(r) for r in self.db.execute(sql, args).fetchall()]

    # ------------------------------------------------------------------------------------------ connectors' status
    def set_connector_status(
        self, cp_id: str, connector: int, status: str, time, error_code: str | None = None
    ) -> None:
        """Record a connector's status as its charge point last told it (a StatusNotification: ``Available``,
        ``Charging``, ``Faulted``...; connector 0 is the charge point as a whole), with its ``error_code`` where the
        protocol gives one (OCPP 1.6's; ``NoError`` when all is well). A status older than the one recorded (a late
        notification) is kept out.

        Raises:
            StoreError: an empty status or a negative connector.
        """
        if not status:
            raise StoreError(f"charge point {cp_id!r} connector {connector}: empty status")
        if int(connector) < 0:
            raise StoreError(f"charge point {cp_id!r}: connector {connector} is negative")
        self._write(
            "INSERT INTO connector_status (charge_point, connector, status, time, error_code) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(charge_point, connector) DO UPDATE SET status = excluded.status, time = excluded.time, "
            "error_code = excluded.error_code WHERE excluded.time >= connector_status.time",
            (cp_id, int(connector), str(status), utc_text(time), error_code),
        )

    def connector_statuses(self) -> list[dict]:
        """Each connector's last status: ``{"charge_point", "connector", "status", "time", "error_code"}``, by charge
        point and connector."""
        rows = self.db.execute("SELECT * FROM connector_status ORDER BY charge_point, connector").fetchall()
        return [dict(r) for r in rows]
