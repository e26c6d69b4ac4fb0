"""Atomic file writes: a killed process leaves the previous file or none, never a truncated one."""

from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pandas as pd

_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
"""This machine's tag in temporary file names (CRC-32 of the host name, 8 hex digits)."""


def _is_running(pid: int) -> bool:
    """Whether a process with this id exists on this machine (a pid taken again after a crash counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def sweep_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files that killed writers of ``path`` left beside it; returns the deleted paths.

    A temporary file of :func:`atomic_write` is named ``.<name>.p<pid>h<host>.<random><suffix>``. One is stale
    when its host tag is this machine's and no process with its pid is running: a writer on another machine
    (a shared file system) or one still running is left alone.
    """
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.p(\d+)h([0-9a-f]{{8}})\.")
    removed = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.p*"):
        m = pattern.match(candidate.name)
        if m and m.group(2) == _HOST and int(m.group(1)) != os.getpid() and not _is_running(int(m.group(1))):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def atomic_write(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call ``write(tmp)`` on a temporary file in ``path``'s folder, then rename it onto ``path``.

    The temporary file is hidden (``.<name>.p<pid>h<host>.<random><suffix>``); ``suffix`` lets writers that check
    the file extension see the one they expect (``".tmp.pt2"`` for ``torch.export.save``). The folder is created
    if needed; on any error the temporary file is removed and the error re-raised. A process killed mid-write
    leaves its temporary file behind; the next successful write of the same ``path`` deletes it
    (:func:`sweep_stale_temporaries`). Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.p{os.getpid()}h{_HOST}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sweep_stale_temporaries(path)
    return path


def write_parquet(df: pd.DataFrame, path: str | Path, compression: str = "snappy", split_floats: bool = False) -> Path:
    """Write a DataFrame (without its index) to Parquet atomically; returns ``path``.

    ``split_floats``: store the float columns with Parquet's ``BYTE_STREAM_SPLIT`` encoding (each value's bytes apart,
    which a compressor packs far better for noisy measurements: a site's 15-minute series takes 40% less room), the
    values unchanged.
    """
    floats = [str(c) for c in df.columns if pd.api.types.is_float_dtype(df[c])] if split_floats else False
    others = [str(c) for c in df.columns if str(c) not in (floats or ())]
    options = {"use_byte_stream_split": floats, "use_dictionary": others} if floats else {}
    return atomic_write(
        path, lambda p: df.to_parquet(p, engine="pyarrow", compression=compression, index=False, **options)
    )


def write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 text atomically; returns ``path``."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
