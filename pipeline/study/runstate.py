"""Each experiment's own doit state, and the lock that lets only one run at a time work in an experiment folder.

doit's state (what is up to date) lives in ``<output_dir>/<experiment>/.doit.sqlite3`` (doit's ``sqlite3``
backend), so runs of different experiments never share a database. ``dodo.py`` gets its ``dep_file`` and
``backend`` from :func:`doit_config`, which also, when doit loads ``dodo.py``:

- takes ``<output_dir>/<experiment>/.doit.lock`` for commands that run tasks or change the state (``run``,
  plain ``doit``, ``clean``, ``forget``, ``ignore``, ``reset-dep``, ``strace``), not for ``list``, ``info``,
  ``help`` or ``dumpdb``. It is an OS lock (``flock``) held by the doit process until it exits, so a crash
  or SIGKILL releases it too; the file names the holder (pid, host, command, start time) for the refusal
  message of a second run, which stops at once (:class:`ExperimentBusy`);
- checks the state database doit is about to open (the experiment's own, or the one ``--db-file`` names)
  and stops with :class:`DamagedState`, naming the file and how to get out, where it cannot be read.

Both are raised while doit loads ``dodo.py``; ``dodo.py`` turns them into doit's one-line ``ERROR: ...``
(exit 3, no traceback).

The command's stage clock (:func:`timed`, :func:`stage_table`) records when each of its tasks ran, from the moment
doit loaded ``dodo.py``; ``doit run pipeline`` ends with the table.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from envs.errors import ExpectedError

STATE_FILE = ".doit.sqlite3"
"""doit's state database in each experiment folder (doit's ``sqlite3`` backend)."""
LOCK_FILE = ".doit.lock"
"""Lock file in each experiment folder, held by the doit process working there."""
BACKEND = "sqlite3"

LOCKING_COMMANDS = frozenset({"run", "clean", "forget", "ignore", "reset-dep", "strace"})
"""doit commands that run tasks, delete outputs or write the state: one at a time per experiment."""


class ExperimentBusy(ExpectedError, RuntimeError):
    """Another process holds the experiment folder's lock (the message names the folder, that process and what
    to do)."""


class DamagedState(ExpectedError, RuntimeError):
    """doit's state database cannot be read (the message names the file and the way out)."""


# ----------------------------------------------------------------------------------------------- the doit command


@dataclass
class DoitCommand:
    """The doit command that is loading ``dodo.py``.

    Attributes:
        name: doit's command (``run``, ``list``, ...; plain ``doit`` is ``run``).
        tasks: the task names given on the command line ([] for the default tasks).
        options: the command's options as given on the command line (``dep_file`` for ``--db-file``,
            ``backend`` for ``--backend``); options left out are not in it.
    """

    name: str
    tasks: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)

    @property
    def locks(self) -> bool:
        return self.name in LOCKING_COMMANDS


def current_doit_command() -> DoitCommand | None:
    """The doit command whose loading of ``dodo.py`` is under way, or None (``dodo.py`` imported otherwise).

    doit loads ``dodo.py`` from ``DoitCmdBase.execute(self, params, args)``, with the command line parsed
    into ``params`` (options given on it are its non-default keys) and the task names in ``args``.
    """
    try:
        from doit.cmd_base import DoitCmdBase
    except ImportError:  # pragma: no cover - doit is a dependency
        return None
    frame = sys._getframe(1)
    while frame is not None:
        cmd = frame.f_locals.get("self")
        if frame.f_code.co_name == "execute" and isinstance(cmd, DoitCmdBase):
            params = frame.f_locals.get("params") or {}
            given = getattr(params, "_non_default_keys", set())
            options = {k: params[k] for k in given if k in params}
            args = frame.f_locals.get("args") or []
            return DoitCommand(name=cmd.get_name(), tasks=[str(a) for a in args], options=options)
        frame = frame.f_back
    return None


def doit_config(folder: Path, command: DoitCommand | None = None) -> dict:
    """``DOIT_CONFIG`` entries of the experiment in ``folder``: its own state database, doit's sqlite3 backend.

    Under doit (``command``, default :func:`current_doit_command`), also creates ``folder``, takes its lock
    when the command runs tasks (held until the process exits) and checks the state database doit will open.

    Raises:
        ExperimentBusy: another process works in ``folder`` (the message names the folder and that process).
        DamagedState: the state database cannot be read (the message names the file and the way out).
    """
    folder = Path(folder)
    config = {"dep_file": str(folder / STATE_FILE), "backend": BACKEND}
    command = command or current_doit_command()
    if command is None:
        return config
    folder.mkdir(parents=True, exist_ok=True)  # doit creates its database there, even for `doit list`
    if command.locks:
        hold(ExperimentLock(folder, describe=_command_line()))
    dep_file = command.options.get("dep_file", config["dep_file"])
    check_state(dep_file, command.options.get("backend", config["backend"]))
    return config


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py":  # python -m doit ...
        argv[0] = "doit"
    elif argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


# ----------------------------------------------------------------------------------------------------------- lock


class ExperimentLock:
    """An exclusive ``flock`` on ``<folder>/.doit.lock``, taken at once or not at all.

    The lock belongs to the open file, which is not inherited by child processes (Python opens files
    non-inheritable, and Dask starts its workers with ``spawn``), so it lasts exactly as long as this
    process holds it: :meth:`release`, a normal exit or a crash (SIGKILL included) frees it. The file holds
    the holder's pid, host, command and start time; :meth:`release` deletes it. A file left by a crashed
    holder is not locked, so the next run simply takes it.

    Raises:
        ExperimentBusy: another process holds the lock (message: folder, pid, host, command, start time).
    """

    def __init__(self, folder: Path, describe: str = ""):
        import fcntl

        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ExperimentBusy(_busy_message(self.folder, holder)) from None
            # a holder that exits deletes the file after we opened it: then we hold a lock on a file that is
            # gone, and must lock the one now at this path instead
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": describe or _command_line(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self.holder) + "\n").encode(), 0)

    def release(self) -> None:
        """Delete the lock file and free the lock (only this process's own, once)."""
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)  # frees the flock
        self.fd = None


_HELD: list[ExperimentLock] = []


def hold(lock: ExperimentLock) -> ExperimentLock:
    """Keep ``lock`` until the process exits (released at exit; a crash frees it with the process)."""
    if not _HELD:
        atexit.register(_release_all)
    _HELD.append(lock)
    return lock


def _release_all() -> None:
    pid = os.getpid()
    while _HELD:
        lock = _HELD.pop()
        if lock.holder["pid"] == pid:  # a forked child never deletes its parent's lock file
            lock.release()


def _read_holder(fd: int) -> dict:
    """What a lock file says about its holder ({} while the holder has not written it yet)."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        holder = {}
    return holder if isinstance(holder, dict) else {}


def _busy_message(folder: Path, holder: dict) -> str:
    if holder.get("pid"):
        who = f"process {holder['pid']}"
        if holder.get("host") and holder["host"] != socket.gethostname():
            who += f" on host {holder['host']}"
        if holder.get("command"):
            who += f" ({holder['command']})"
        if holder.get("started"):
            who += f", started {holder['started']}"
        stop = f"wait for it to finish or stop it (kill {holder['pid']})"
    else:
        who = "another process (it is starting and has not written its pid yet)"
        stop = "wait for it to finish or stop it"
    return (
        f"experiment folder {folder} is in use by {who}: only one run at a time may work in an experiment "
        f"folder (lock file {folder / LOCK_FILE}). {stop[0].upper()}{stop[1:]}, or run this one as another "
        f"experiment (experiment=<name> or EVHUB_EXPERIMENT) or under another output folder (output_dir=...)."
    )


# ---------------------------------------------------------------------------------------------- state database


def check_state(dep_file: str | Path, backend: str = BACKEND) -> None:
    """Check that doit can read its state database ``dep_file`` (a missing one is fine: doit creates it).

    Reads every record the way doit will (sqlite3: an integrity check and each task's JSON; dbm: each
    value's JSON; json: the whole file), so a truncated file, garbage bytes or a half-written record stop
    the run here instead of inside doit.

    Raises:
        DamagedState: naming the file, what is wrong and the way out (delete it and run again).
    """
    dep_file = Path(dep_file)
    try:
        if backend == "sqlite3":
            _check_sqlite(dep_file)
        elif backend == "dbm":
            try:
                _check_dbm(dep_file)
            except DamagedState:
                raise
            except Exception as exc:
                raise DamagedState(_damaged_message(dep_file, f"{type(exc).__name__}: {exc}", f"{dep_file}*")) from None
        elif backend == "json":
            if dep_file.exists():
                json.loads(dep_file.read_text())
    except DamagedState:
        raise
    except Exception as exc:  # whatever the file makes the readers raise
        raise DamagedState(_damaged_message(dep_file, f"{type(exc).__name__}: {exc}")) from None


def _check_sqlite(path: Path) -> None:
    import sqlite3

    if not path.exists():
        return
    if path.stat().st_size == 0:
        return  # sqlite treats an empty file as a new database
    # read-write (never creating): a journal left by a process killed while committing is rolled back, as doit would
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, timeout=30)
    try:
        status = [row[0] for row in conn.execute("PRAGMA quick_check")]
        if status != ["ok"]:
            raise DamagedState(_damaged_message(path, "sqlite integrity check: " + "; ".join(status[:3])))
        tables = {row[0] for row in conn.execute("select name from sqlite_master where type='table'")}
        if "doit" not in tables:
            return
        for task_id, data in conn.execute("select task_id, task_data from doit"):
            try:
                json.loads(data.decode() if isinstance(data, bytes) else data)
            except (ValueError, TypeError, AttributeError) as exc:
                raise DamagedState(_damaged_message(path, f"the record of task {task_id!r}: {exc}")) from None
    finally:
        conn.close()


def _check_dbm(path: Path) -> None:
    import dbm

    files = [p for p in (path, *(path.with_name(path.name + x) for x in (".db", ".dat", ".dir", ".pag"))) if p.exists()]
    if not files:
        return
    kind = dbm.whichdb(str(path))
    if not kind:
        raise DamagedState(_damaged_message(path, "not a dbm database doit can open", f"{path}*"))
    db = dbm.open(str(path), "r")
    try:
        for key in db.keys():
            try:
                json.loads(db[key].decode())
            except ValueError as exc:
                detail = f"the record of task {key.decode(errors='replace')!r}: {exc}"
                raise DamagedState(_damaged_message(path, detail, f"{path}*")) from None
    finally:
        db.close()


def _damaged_message(path: Path, detail: str, files: str = "") -> str:
    return (
        f"doit's state database {path} is damaged and cannot be read ({detail}). It only records which tasks "
        f"are up to date, so nothing of the study is lost: delete it (rm {files or path}) and run again; "
        f"the next run redoes the tasks (training resumes from its checkpoints) and writes a new one."
    )


# ---------------------------------------------------------------------------------------------------- stage clock

_STARTED = time.monotonic()  # this module is imported while doit loads dodo.py: the command's start
STARTED_AT = time.time()
"""The command's start (when doit loaded ``dodo.py``), seconds since the epoch: where the Dask work it reports
begins (:func:`pipeline.study.cluster.work_table`)."""
_CLOCK: list[tuple[str, float, float]] = []  # (task, start s, end s) after _STARTED, as the tasks end
_CLOCK_LOCK = threading.Lock()


def timed(task: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` (a doit python-action) recording its start and end under ``task`` in this command's stage clock
    (doit's tasks run in threads of this process, so every task's entry reaches :func:`stage_table`)."""

    def action():
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            with _CLOCK_LOCK:
                _CLOCK.append((task, t0 - _STARTED, time.monotonic() - _STARTED))

    action.__name__ = action.__qualname__ = getattr(fn, "__name__", "action")
    return action


def stage_table() -> str:
    """The tasks this command ran so far, in the order they started: start and end (minutes after doit loaded
    ``dodo.py``) and wall time (minutes), then the whole command; tasks that were up to date are not in it."""
    with _CLOCK_LOCK:
        rows = sorted(_CLOCK, key=lambda r: r[1])
    now = time.monotonic() - _STARTED
    width = max([len(r[0]) for r in rows] + [len("whole command")])
    lines = [f"{'task':<{width}}  start min    end min   wall min"]
    lines += [f"{task:<{width}}  {t0 / 60:9.1f}  {t1 / 60:9.1f}  {(t1 - t0) / 60:9.1f}" for task, t0, t1 in rows]
    lines.append(f"{'whole command':<{width}}  {0:9.1f}  {now / 60:9.1f}  {now / 60:9.1f}")
    return "\n".join(lines)
