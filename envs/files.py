"""Atomic file writes: a killed process leaves the previous file or none, never a truncated one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd


def atomic_write(path: str | Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call ``write(tmp)`` on a temporary file in ``path``'s folder, then rename it onto ``path``.

    The temporary file is hidden (``.<name>.<random><suffix>``); ``suffix`` lets writers that check the file
    extension see the one they expect (``".tmp.pt2"`` for ``torch.export.save``). The folder is created if
    needed; on any error the temporary file is removed and the error re-raised. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_parquet(df: pd.DataFrame, path: str | Path, compression: str = "snappy") -> Path:
    """Write a DataFrame (without its index) to Parquet atomically; returns ``path``."""
    return atomic_write(path, lambda p: df.to_parquet(p, engine="pyarrow", compression=compression, index=False))


def write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 text atomically; returns ``path``."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
