"""Readers of a site's raw EV sessions and grid carbon (the files its ``[sources]`` table names,
:mod:`pipeline.data.sources`).

Each returns a table plus an ``info`` dict for the data README:

- :func:`read_sessions`: columns ``session_id, station_id`` (str), ``arrival, departure`` (datetime64[ns, UTC]),
  ``energy_kwh``, ``requested_energy_kwh`` (float32, kWh) [, ``kind`` (str) for generated sessions].
- :func:`read_carbon`: ``moer_kg_per_kwh``, ``moer_fc_h0..h2`` (float64, kg CO2/kWh) on the period's steps, and
  from 5-minute files with forecasts :data:`envs.schemas.MOER_5MIN_COLUMNS`. The raw rows are read once
  (:func:`load_carbon`) and laid onto the steps of any index (:func:`carbon_at`): ingestion writes the site's step,
  the hour and 5 minutes from one reading.

Every check raises :class:`pipeline.data.sources.SourceError` naming the raw file, the column and the row. A raw
file that cannot be decoded (a compressed file cut short by a download broken off, a file that is not what the
source's ``format`` says) is one too, naming the file.

A download folder may hold files of other years: a sessions or carbon file none of whose rows lies in the site's
period (:func:`pipeline.data.sources.period`) is skipped, with one line through ``log`` naming it and why, and
listed in ``info["skipped"]`` (the data README counts it). Only a split that no file of a source covers is an
error; its message names the source, the split and what each file covers.
"""

from __future__ import annotations

import json
import lzma
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from envs.config import SiteConfig
from envs.schemas import MOER_MAX_KG_PER_KWH
from pipeline.data.sources import (
    CARBON_UNITS,
    ENERGY_UNITS,
    MOER_FORECAST_COLUMNS,
    SourceError,
    Sources,
    check_coverage,
    check_range,
    column,
    files_of,
    index_minutes,
    numbers,
    parse_times,
    period,
    period_bounds,
    rel_path,
    resolution_minutes,
    row_label,
    step_bins,
    step_error,
    step_phrase,
    step_refusal,
)
from pipeline.data.synthetic import generate_sessions

Log = Callable[[str], None] | None
"""Where the readers say which raw files they skip (one line each); None: silently."""
COVER_SHOWN = 8
"""Raw files a coverage message lists one by one (then how many more, and the span of all)."""


# ------------------------------------------------------------------------------------------- sessions


def read_sessions(src: Sources, log: Log = None) -> tuple[pd.DataFrame, dict]:
    """Read (or generate) the site's EV sessions over its :func:`period`.

    Measured sessions (``acn-csv``, ``acn-json``, ``csv``) are read file by file. A file none of whose sessions
    arrives in the period is skipped (one line through ``log``; listed in ``info["skipped"]``). In each other file,
    sessions with ``departure <= arrival``, with zero (or missing) energy, arriving outside the period, or
    repeating an earlier ``session_id`` (first kept) are dropped and counted. A missing requested energy is taken
    to be the delivered energy (counted). Generated sessions (``fleet``):
    :func:`pipeline.data.synthetic.generate_sessions` over the period.

    Returns:
        ``(sessions, info)``: ``sessions`` of shape ``(S, 6)`` (``(S, 7)`` with ``kind`` for generated ones),
        columns ``session_id, station_id`` (str), ``arrival, departure`` (datetime64[ns, UTC]), ``energy_kwh``,
        ``requested_energy_kwh`` (float32, kWh), sorted by arrival then session id (generated: then station),
        RangeIndex; ``info`` has ``report`` (one dict per file read, with its counts) and ``skipped`` (one dict
        per skipped file: ``file``, ``rows``, ``first``, ``last`` (local dates of its arrivals), ``why``), or the
        generator's ``stats``.

    Raises:
        SourceError: a file that cannot be decoded (cut short, or not what ``format`` says), a missing column
            (with the closest name), an unparsable or offset-less timestamp, a non-numeric energy (file, column
            and row named), or a split that no session arrives in (naming the source, the split, what each file
            covers, and how many sessions of each file lie outside every split and the first such row).
    """
    cfg, s = src.config, src.sessions
    first, end = period(cfg)
    if s.format == "fleet":
        sessions, stats = generate_sessions(s.fleets, s.seed, first, end, cfg.timezone, s.session_id_prefix)
        return sessions, {"stats": stats}
    t0, t1 = period_bounds(cfg)
    frames, report, outside, skipped, cover = [], [], [], [], []
    seen: set[str] = set()
    for f in files_of(src, "sessions"):
        d, kind = _session_table(f, src)
        label = rel_path(f, src.root)
        col, arr, dep = _session_columns(d, f, src, kind)
        span = _local_span(arr, cfg.timezone)
        inside = ((arr >= t0) & (arr < t1)).to_numpy()
        if len(d) and not inside.any():
            why = (
                f"all {len(d):,} sessions arrive outside the site's period {first}..{end} ({cfg.timezone}, from the "
                f"splits): they arrive {span[0]}..{span[1]}"
            )
            skipped.append({"file": label, "rows": len(d), "first": span[0], "last": span[1], "why": why})
            cover.append((label, len(d), span, "sessions", True))
            if log is not None:
                log(f"ingest: skipped {label}: {why}")
            continue
        cover.append((label, len(d), span, "sessions", False))
        ids, energy, req = _session_values(col, len(d), d.index, f, src, kind, label)
        frame, counts, keep = _kept_sessions(ids, col["station_id"], arr, dep, energy, req, inside, seen)
        report.append({"file": label, "read": len(d), **counts})
        frames.append(frame)
        out_rows = np.flatnonzero(keep)[~_in_any_split(arr[keep], cfg)]  # kept, but in no split
        if len(out_rows):
            outside.append((str(f), kind, len(out_rows), int(out_rows[0]), arr.iloc[out_rows[0]]))
        report[-1]["outside_splits"] = len(out_rows)
    if frames:
        sessions = pd.concat(frames, ignore_index=True)
        sessions = sessions.sort_values(["arrival", "session_id"], kind="mergesort").reset_index(drop=True)
    else:  # every file skipped: no split is covered (raised below)
        sessions = pd.DataFrame({"arrival": pd.Series([], dtype="datetime64[ns, UTC]")})
    _check_session_splits(src, sessions, outside, cover)
    return sessions, {"report": report, "skipped": skipped}


def _session_values(
    col: dict, n: int, index: pd.Index, f: Path, src: Sources, kind: str, label: str
) -> tuple[pd.Series, pd.Series, pd.Series]:
    """``(ids, energy, requested)`` of the ``n`` raw sessions of file ``f`` (its rows ``index``; ``col``:
    :func:`_session_columns`'s): the session ids (str; without a column, ``<label>:<row>``), the delivered and the
    requested energy (float, kWh, NaN where missing; without a requested column, the delivered).

    Raises:
        SourceError: a non-numeric energy (file, column and row named).
    """
    s = src.sessions
    energy = numbers(col["energy_kwh"], file=str(f), column_name=s.columns["energy_kwh"], kind=kind, allow_nan=True)
    if ENERGY_UNITS[s.energy_unit] != 1.0:
        energy = energy * ENERGY_UNITS[s.energy_unit]
    if "session_id" in col:
        ids = col["session_id"].astype(str)
    else:
        ids = pd.Series([f"{label}:{i}" for i in range(n)], index=index)
    if "requested_energy_kwh" in col:
        req = numbers(
            col["requested_energy_kwh"],
            file=str(f),
            column_name=s.columns["requested_energy_kwh"],
            kind=kind,
            allow_nan=True,
        )
        if ENERGY_UNITS[s.energy_unit] != 1.0:
            req = req * ENERGY_UNITS[s.energy_unit]
    else:
        req = energy
    return ids, energy, req


def _kept_sessions(
    ids: pd.Series,
    stations: pd.Series,
    arr: pd.Series,
    dep: pd.Series,
    energy: pd.Series,
    req: pd.Series,
    inside: np.ndarray,
    seen: set[str],
) -> tuple[pd.DataFrame, dict, np.ndarray]:
    """The sessions of one file that are kept (:func:`read_sessions`), ``seen`` updated with their ids.

    Args:
        ids, stations, arr, dep, energy, req: the file's ``(R,)`` columns (arrival and departure datetime64[ns, UTC],
            energies kWh). inside: ``(R,)`` bool, arriving in the period. seen: the ids kept from earlier files.

    Returns:
        ``(frame, counts, keep)``: the kept rows in :func:`read_sessions`'s columns (a missing requested energy
        filled with the delivered), the counts of the file's report (each reason to drop, ``kept``,
        ``requested_filled``), and ``(R,)`` bool, which rows are kept.
    """
    bad_time = (dep <= arr).to_numpy()
    bad_energy = ~(energy > 0).to_numpy() & ~bad_time
    out_period = ~inside & ~bad_time & ~bad_energy
    dup = ids.isin(seen).to_numpy() & ~bad_time & ~bad_energy & ~out_period
    keep = ~(bad_time | bad_energy | out_period | dup)
    seen.update(ids[keep])
    req_filled = int((req.isna().to_numpy() & keep).sum())
    req = req.where(req.notna(), energy)
    counts = {
        "dropped_departure_not_after_arrival": int(bad_time.sum()),
        "dropped_zero_energy": int(bad_energy.sum()),
        "dropped_outside_period": int(out_period.sum()),
        "dropped_duplicate_id": int(dup.sum()),
        "kept": int(keep.sum()),
        "requested_filled": req_filled,
    }
    frame = pd.DataFrame(
        {
            "session_id": ids[keep].astype(str),
            "station_id": stations[keep].astype(str),
            "arrival": arr[keep],
            "departure": dep[keep],
            "energy_kwh": energy[keep].astype(np.float32),
            "requested_energy_kwh": req[keep].astype(np.float32),
        }
    )
    return frame, counts, keep


def _session_columns(d: pd.DataFrame, f: Path, src: Sources, kind: str) -> tuple[dict, pd.Series, pd.Series]:
    """The columns of the raw sessions table ``d`` of file ``f`` (of ``kind``), by their key in
    ``[sources.sessions.columns]``, and the arrival and departure times parsed (UTC).

    Raises:
        SourceError: a missing column (with the closest name), or an unparsable or offset-less timestamp.
    """
    s = src.sessions
    col = {
        k: column(
            d,
            name,
            str(f),
            f"sources.sessions.columns.{k}" if s.format == "csv" else "sources.sessions.format",
            src.toml,
        )
        for k, name in s.columns.items()
    }
    times = {
        k: parse_times(
            col[k],
            file=str(f),
            column_name=s.columns[k],
            key="sources.sessions",
            toml=src.toml,
            tz=s.timezone,
            fmt=s.time_format,
            kind=kind,
        )
        for k in ("arrival", "departure")
    }
    return col, times["arrival"], times["departure"]


def _check_session_splits(src: Sources, sessions: pd.DataFrame, outside: list, cover: list) -> None:
    """Check that some of the ``sessions`` kept arrive in each split.

    Raises:
        SourceError: a split that no session arrives in, naming the source, the split, what each file covers
            (``cover``) and, from ``outside``, how many sessions of each file lie outside every split and the first.
    """
    cfg, s = src.config, src.sessions
    for split in ("train", "test"):
        a, b = cfg.split_bounds(split)
        if not ((sessions.arrival >= a) & (sessions.arrival < b)).any():
            lines = "; ".join(
                f"{f}: {n:,} session(s) outside every split, first {row_label(r, k)} arriving {t}"
                for f, k, n, r, t in outside
            )
            dates = getattr(cfg.splits, split)
            raise SourceError(
                f"{src.toml}: key 'splits.{split}' ({dates[0]}..{dates[1]}, {cfg.timezone}) selects none of the "
                f"{len(sessions):,} sessions read from [sources.sessions]"
                + (f" ({lines})" if lines else "")
                + f": no file of [sources.sessions] (files = {_patterns(s.files)}) covers split '{split}'. The files "
                f"cover (arrivals, local dates): {_cover_text(cover)}. Point key 'sources.sessions.files' at files "
                f"with sessions from {dates[0]} to {dates[1]}, or move key 'splits.{split}' into the dates the files "
                "cover"
            )


def _session_table(f: Path, src: Sources) -> tuple[pd.DataFrame, str]:
    """The raw table of one sessions file and its kind (``csv`` or ``json``)."""
    s = src.sessions
    if s.format == "acn-json":
        try:
            doc = json.loads(Path(f).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise SourceError(
                f"{f}: not readable as ACN-Data JSON ({type(exc).__name__}: {exc}): it looks cut short (a download "
                f"broken off?) or is not what key 'sources.sessions.format' = 'acn-json' of {src.toml} says; download "
                "it again, or fix the format"
            ) from exc
        items = doc.get("_items") if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise SourceError(f"{f}: not ACN-Data JSON: expected an object with an '_items' list of sessions")
        rows = []
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                raise SourceError(f"{f}: item {i} of '_items' is not an object")
            ui = it.get("userInputs")
            req = ui[-1].get("kWhRequested") if isinstance(ui, list) and ui and isinstance(ui[-1], dict) else None
            rows.append({**{k: v for k, v in it.items() if k != "userInputs"}, "kWhRequested": req})
        d = pd.DataFrame(rows)
        for k in ("sessionID", "stationID"):
            if k in d:
                d[k] = d[k].astype(str)
        if "kWhRequested" in d:
            d["kWhRequested"] = pd.to_numeric(d["kWhRequested"], errors="coerce")
        return d, "json"
    dtype = {s.columns["station_id"]: str}
    if "session_id" in s.columns:
        dtype[s.columns["session_id"]] = str
    return read_raw_csv(f, src, "sessions", dtype=dtype), "csv"


def read_raw_csv(path: Path, src: Sources, name: str, dtype: dict | None = None) -> pd.DataFrame:
    """``pandas.read_csv`` of one raw file of the source ``name`` (``sessions`` or ``carbon``), compression
    inferred from the file name (``.gz``, ``.bz2``, ``.zip``, ``.xz``, ``.zst``).

    Raises:
        SourceError: the file cannot be read or decoded (a compressed file cut short, e.g. by a download broken
            off; not CSV; not the compression its name says); the message names the file, the decoder's error and
            the TOML key ``sources.<name>.format``, and says what to do.
    """
    try:
        return pd.read_csv(path, dtype=dtype)
    except (
        EOFError,
        zlib.error,
        lzma.LZMAError,
        zipfile.BadZipFile,
        OSError,
        UnicodeDecodeError,
        pd.errors.ParserError,
        pd.errors.EmptyDataError,
    ) as exc:
        ext = Path(path).suffix.lower()
        packed = {".gz": "gzip", ".bz2": "bzip2", ".zip": "zip", ".xz": "xz", ".zst": "zstd"}.get(ext)
        what = f"{packed}-compressed CSV" if packed else "CSV"
        fmt = getattr(src, name).format
        raise SourceError(
            f"{path}: cannot be read as {what} ({type(exc).__name__}: {exc}): the file looks cut short (a download"
            f" broken off?) or is not what key 'sources.{name}.format' = {fmt!r} of {src.toml} says; download it"
            " again, or fix the format"
        ) from exc


def _local_span(times: pd.Series, tz: str) -> tuple[str, str] | None:
    """First and last local date (``YYYY-MM-DD`` in ``tz``) of UTC ``times``; None when there are none."""
    if not len(times):
        return None
    return times.min().tz_convert(tz).date().isoformat(), times.max().tz_convert(tz).date().isoformat()


def _patterns(patterns: tuple[str, ...]) -> str:
    return repr(patterns[0]) if len(patterns) == 1 else "[" + ", ".join(map(repr, patterns)) + "]"


def _cover_text(cover: list[tuple[str, int, tuple[str, str] | None, str, bool]]) -> str:
    """What each raw file covers, for an error message: ``a.csv 2019-05-01..2019-08-31 (6,703 sessions)``, skipped
    files marked, at most :data:`COVER_SHOWN` files then how many more and the span of all."""

    def one(label, n, span, what, skipped):
        if span is None:
            return f"{label} (no rows)"
        return f"{label} {span[0]}..{span[1]} ({n:,} {what}" + (", skipped: outside the period)" if skipped else ")")

    text = ", ".join(one(*c) for c in cover[:COVER_SHOWN])
    if len(cover) > COVER_SHOWN:
        spans = [c[2] for c in cover if c[2] is not None]
        text += f" and {len(cover) - COVER_SHOWN} more file(s)" + (
            f" (all files together: {min(a for a, _ in spans)}..{max(b for _, b in spans)})" if spans else ""
        )
    return text


def _in_any_split(arrival: pd.Series, cfg: SiteConfig) -> np.ndarray:
    ok = np.zeros(len(arrival), dtype=bool)
    for split in ("train", "test"):
        a, b = cfg.split_bounds(split)
        ok |= ((arrival >= a) & (arrival < b)).to_numpy()
    return ok


# --------------------------------------------------------------------------------------------- carbon


def read_carbon(src: Sources, index: pd.DatetimeIndex, log: Log = None) -> tuple[pd.DataFrame, dict]:
    """Carbon intensity of every step of ``index`` (the site's period at a step of 5 to 60 minutes that divides the
    hour) and its forecasts, kg CO2/kWh: :func:`carbon_at` on the rows of :func:`load_carbon`.

    - ``constant``: ``kg_per_kwh`` in every step and every forecast (a constant is its own perfect forecast); any
      step.
    - ``watttime-moer`` (5-minute rows: ``time`` in UTC, ``moer``, optionally ``f1..f36``; files may overlap,
      repeated rows must agree and are kept once; steps of multiples of 5 minutes): ``moer_kg_per_kwh`` is the mean
      of the rows whose ``time`` falls in the step. With forecast columns, the forecasts are issued at the step start,
      with leads in hours whatever the step: from the row at the step start (if missing, the nearest earlier row),
      ``moer_fc_h0/h1/h2`` are the means of ``f1..f12``, ``f13..f24``, ``f25..f36`` (the hour from the step start,
      the next hour, the one after); from the same row ``moer_fc_5min_01..12`` are ``f1..f12`` themselves, and
      ``moer_last_5min`` / ``moer_last_15min`` the last one / the mean of the last three rows' ``moer`` strictly
      before the step start (``moer_fc_h0`` where the files hold no earlier row).
    - ``csv`` (any resolution, e.g. hourly average intensity): ``moer_kg_per_kwh`` is the mean of the values
      whose time falls in the step; no step finer than the file's resolution (the typical spacing of its
      timestamps).
    - Without forecast columns (``csv``, or MOER files without ``f1..f36``) the forecasts are persistence, a
      causal rule: at each step start the three forecasts are the mean of the raw values in the hour before it
      (the latest hour known then; at hourly steps the previous hour's mean); the first step of the period takes
      the hour before it when the files have it, else its own value.
    - A file none of whose rows lies in the period or the hour before it (read for the first hour's persistence
      forecast) is skipped: one line through ``log``, listed in ``info["skipped"]``.

    At hourly steps every value is the one of the hourly study.

    Returns:
        ``(frame, info)``: DataFrame indexed like ``index``, columns ``moer_kg_per_kwh, moer_fc_h0..h2`` (and
        :data:`envs.schemas.MOER_5MIN_COLUMNS` from ``watttime-moer`` files with forecasts)
        (float64, kg CO2/kWh); ``info`` with ``format``, counts, ``forecast`` ("file", "persistence",
        "constant") and, for files, ``resolution_min``, ``skipped`` (one dict per skipped file: ``file``, ``rows``,
        ``first``, ``last`` (local dates of its rows), ``why``).

    Raises:
        SourceError: a file that cannot be decoded (cut short, or not what ``format`` says), a missing column
            (closest name suggested), an unparsable timestamp (row named), values out of [0, 2] kg/kWh after the
            declared unit (e.g. g/kWh declared as kg/kWh: "looks like g/kWh"), files that disagree on a repeated
            row, some forecast columns without the others, a split that no file covers (naming the source, the
            split and what each file covers), a step of ``index`` finer than the source's resolution (naming the
            TOML, the key ``dt_h``, the source and its resolution) or a step of the period without any value (the
            first one named, and what each file covers).
    """
    raw = load_carbon(src, log)
    refusal = carbon_step_refusal(src, raw, index_minutes(index))
    if refusal:
        raise step_error(src, index_minutes(index), refusal)
    return carbon_at(src, raw, index)


@dataclass(frozen=True)
class CarbonRows:
    """The raw rows of a carbon source read from its files (:func:`load_carbon`), to be laid onto steps
    (:func:`carbon_at`).

    Attributes:
        rows: the distinct rows by ``time`` (UTC, sorted): ``moer`` and, with forecasts, ``f1..f36``, kg CO2/kWh.
        forecasts: whether the files carry ``f1..f36``.
        resolution_min: the typical spacing of the rows' timestamps, minutes (None with fewer than two rows).
        skipped: one dict per file skipped (none of its rows in the period). cover: what each file covers.
        label: the files, for messages.
    """

    rows: pd.DataFrame
    forecasts: bool
    resolution_min: float | None
    skipped: list
    cover: list
    label: str


def load_carbon(src: Sources, log: Log = None) -> CarbonRows | None:
    """Read the raw rows of the site's carbon files once (None for a ``constant`` source).

    Raises:
        SourceError: as :func:`read_carbon`, but the steps' checks (:func:`carbon_at`).
    """
    if src.carbon.format == "constant":
        return None
    read, skipped, cover = _read_carbon_files(src, log)
    if not read:
        _carbon_split_uncovered(src, "train", cover)
    files = [f for f, _, _ in read]
    m, fc = _merge_carbon(src, read)
    label = ", ".join(rel_path(f, src.root) for f in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    return CarbonRows(m, fc, resolution_minutes(m.index), skipped, cover, label)


MOER_MINUTES = 5
"""The resolution of a ``watttime-moer`` source, minutes: a step must be a multiple of it."""


def carbon_step_refusal(src: Sources, raw: CarbonRows | None, minutes: int) -> str | None:
    """Why the carbon source cannot give a step of ``minutes`` (:func:`pipeline.data.sources.step_refusal`), or None:
    a constant gives any step, a ``watttime-moer`` source multiples of 5 minutes no finer than its rows, a ``csv``
    source no step finer than its rows."""
    if raw is None:
        return None
    multiple = MOER_MINUTES if src.carbon.format == "watttime-moer" else None
    return step_refusal(src, "carbon", minutes, raw.resolution_min, multiple_of=multiple)


def carbon_at(src: Sources, raw: CarbonRows | None, index: pd.DatetimeIndex) -> tuple[pd.DataFrame, dict]:
    """The carbon columns of :func:`read_carbon` at the steps of ``index`` from the rows ``raw`` (None: the constant of
    ``src``). The step (``index``'s spacing) is not checked against the source's resolution
    (:func:`carbon_step_refusal` does).

    Raises:
        SourceError: a split without any value, or a step of ``index`` without one (the first named).
    """
    c = src.carbon
    cols = ["moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]
    if raw is None:
        out = pd.DataFrame({k: np.full(len(index), c.kg_per_kwh) for k in cols}, index=index)
        return out, {"format": "constant", "forecast": "constant", "kg_per_kwh": c.kg_per_kwh}
    m, minutes = raw.rows, index_minutes(index)
    bins = step_bins(m.index, index[0], minutes)
    grp = m["moer"].groupby(bins)
    steps = np.arange(len(index))
    mean = pd.Series(grp.mean().reindex(steps).to_numpy(), index=index)
    count = grp.size().reindex(steps).fillna(0).to_numpy()
    _check_carbon_coverage(src, index, mean, raw.cover, raw.label)
    out = pd.DataFrame(index=index)
    out["moer_kg_per_kwh"] = mean.to_numpy()
    expected = max(1, int(round(minutes / raw.resolution_min))) if raw.resolution_min else 1
    info = {
        "format": c.format,
        "rows": len(m),
        "resolution_min": raw.resolution_min,
        "step_min": minutes,
        "samples_per_step": expected,
        "steps_below_samples": int((count < expected).sum()),
        "samples_per_step_max": int(count.max()),
        "unit": c.unit,
        "skipped": raw.skipped,
    }
    if raw.forecasts:
        info.update(_file_forecasts(out, m, index, raw.label))
    else:
        info.update(_persistence_forecasts(out, m["moer"], mean, index))
    return out, info


def _read_carbon_files(src: Sources, log: Log) -> tuple[list[tuple[Path, pd.DataFrame, bool]], list[dict], list]:
    """Read every carbon file of ``src`` that has a row in the site's period or the hour before it.

    Returns:
        ``(read, skipped, cover)``: ``read`` one ``(file, rows, has_forecasts)`` per file kept (rows as
        :func:`_carbon_rows` gives them); ``skipped`` one dict per file skipped (said through ``log``); ``cover``
        what each file covers, for :func:`_cover_text`.
    """
    c, cfg = src.carbon, src.config
    first, end = period(cfg)
    lo, hi = period_bounds(cfg)
    lo = lo - pd.Timedelta(hours=1)
    factor = CARBON_UNITS[c.unit]
    read, skipped, cover = [], [], []
    for f in files_of(src, "carbon"):
        d = read_raw_csv(f, src, "carbon")
        name = rel_path(f, src.root)
        tcol = column(d, c.time_column, str(f), "sources.carbon.time_column", src.toml)
        vcol = column(d, c.value_column, str(f), "sources.carbon.value_column", src.toml)
        t = parse_times(
            tcol,
            file=str(f),
            column_name=c.time_column,
            key="sources.carbon",
            toml=src.toml,
            tz=c.timezone,
            fmt=c.time_format,
        )
        span = _local_span(t, cfg.timezone)
        if len(d) and not ((t >= lo) & (t < hi)).any():
            why = (
                f"all {len(d):,} rows lie outside the site's period {first}..{end} ({cfg.timezone}, from the "
                f"splits): they cover {span[0]}..{span[1]}"
            )
            skipped.append({"file": name, "rows": len(d), "first": span[0], "last": span[1], "why": why})
            cover.append((name, len(d), span, "rows", True))
            if log is not None:
                log(f"ingest: skipped {name}: {why}")
            continue
        cover.append((name, len(d), span, "rows", False))
        frame, has_fc = _carbon_rows(f, d, t, vcol, factor, src)
        read.append((f, frame, has_fc))
    return read, skipped, cover


def _carbon_rows(
    f: Path, d: pd.DataFrame, t: pd.Series, vcol: pd.Series, factor: float, src: Sources
) -> tuple[pd.DataFrame, bool]:
    """The rows of one carbon file ``f`` (raw table ``d``, parsed times ``t``, value column ``vcol``, values times
    ``factor`` to kg CO2/kWh): ``time``, ``moer`` and, from a ``watttime-moer`` file with forecasts, ``f1..f36``; and
    whether it has them.

    Raises:
        SourceError: some forecast columns without the others, a non-numeric value or one out of range.
    """
    c = src.carbon
    present = [x for x in MOER_FORECAST_COLUMNS if x in d.columns] if c.format == "watttime-moer" else []
    if present and len(present) != len(MOER_FORECAST_COLUMNS):
        lack = [x for x in MOER_FORECAST_COLUMNS if x not in d.columns]
        raise SourceError(
            f"{f}: forecast column(s) {', '.join(lack)} missing beside {', '.join(present[:3])}...: give all of "
            "f1..f36 or none"
        )
    frame = pd.DataFrame({"time": t, "moer": numbers(vcol, file=str(f), column_name=c.value_column)})
    for x in present:
        frame[x] = numbers(d[x], file=str(f), column_name=x)
    if factor != 1.0:
        for x in ["moer", *present]:
            frame[x] = frame[x] * factor
    for x in ["moer", *present]:
        check_range(
            frame[x].to_numpy(),
            MOER_MAX_KG_PER_KWH,
            file=str(f),
            column_name=c.value_column if x == "moer" else x,
            unit_key="sources.carbon.unit",
            unit=c.unit,
            what="kg CO2/kWh",
            hint_hi=': looks like g/kWh (set unit = "g/kWh" in [sources.carbon])' if c.unit == "kg/kWh" else "",
        )
    return frame, bool(present)


def _merge_carbon(src: Sources, read: list[tuple[Path, pd.DataFrame, bool]]) -> tuple[pd.DataFrame, bool]:
    """The rows of every file read, repeated rows once, indexed by time and sorted; and whether they have forecasts.

    Raises:
        SourceError: some files with forecast columns and others without, or files that disagree on a repeated row.
    """
    has_fc = [h for _, _, h in read]
    if len(set(has_fc)) > 1:
        raise SourceError(
            f"{src.toml}: key 'sources.carbon.files': some files have forecast columns f1..f36, others not"
        )
    fc = has_fc[0]
    vals = ["moer", *(MOER_FORECAST_COLUMNS if fc else ())]
    m = pd.concat([frame for _, frame, _ in read], ignore_index=True)
    dup = m[m.duplicated("time", keep=False)]
    if len(dup):
        spread = dup.groupby("time")[vals].agg(lambda s: s.max() - s.min()).to_numpy()
        if np.nanmax(spread) > 1e-9:
            where = ", ".join(rel_path(f, src.root) for f, _, _ in read)
            raise SourceError(
                f"{where}: files disagree on repeated rows of column '{src.carbon.value_column}' (max difference "
                f"{np.nanmax(spread):g})"
            )
    return m.drop_duplicates("time").set_index("time").sort_index(), fc


def _check_carbon_coverage(src: Sources, index: pd.DatetimeIndex, mean: pd.Series, cover: list, label: str) -> None:
    """Check that the step means ``mean`` cover every split and every step of ``index``.

    Raises:
        SourceError: a split without any value, or the first step of the period without one (naming what each file
            covers).
    """
    cfg = src.config
    for split in ("train", "test"):
        a, b = cfg.split_bounds(split)
        hours = (index >= a) & (index < b)
        if hours.any() and mean[hours].isna().all():
            _carbon_split_uncovered(src, split, cover)
    try:
        check_coverage(mean, index, cfg, f"carbon column '{src.carbon.value_column}'", label)
    except SourceError as exc:
        raise SourceError(
            f"{exc}. The files of [sources.carbon] cover ({cfg.timezone} dates): {_cover_text(cover)}; point key"
            f" 'sources.carbon.files' at files that cover every {step_phrase(index_minutes(index))} of the period"
        ) from None


def _file_forecasts(out: pd.DataFrame, m: pd.DataFrame, index: pd.DatetimeIndex, label: str) -> dict:
    """Add to ``out`` the forecasts of the 5-minute rows ``m`` issued at each step start of ``index``
    (``moer_fc_h0..h2`` and :data:`envs.schemas.MOER_5MIN_COLUMNS`, :func:`read_carbon`); returns what ``info`` says
    of them.

    Raises:
        SourceError: a step of ``index`` with no row at or before its start (``label`` names the files).
    """
    exact = index.isin(m.index)
    fc_rows = m.reindex(index, method="ffill")
    if fc_rows["f1"].isna().any():
        raise SourceError(f"{label}: no forecast row at or before {index[fc_rows['f1'].isna()][0]}")
    for h in range(3):
        out[f"moer_fc_h{h}"] = fc_rows[[f"f{i}" for i in range(12 * h + 1, 12 * h + 13)]].mean(axis=1).to_numpy()
    # what the 5-minute rows say at the step start beyond the hour means: the last realised intervals before it
    # (the hour's own forecast where the files hold none earlier) and the forecasts for the next twelve intervals
    before = np.searchsorted(m.index.to_numpy(), index.to_numpy(), side="left") - 1  # last row strictly before
    at, fallback = np.maximum(before, 0), out["moer_fc_h0"].to_numpy()
    last3 = m["moer"].rolling(3, min_periods=1).mean().to_numpy()
    out["moer_last_5min"] = np.where(before >= 0, m["moer"].to_numpy()[at], fallback)
    out["moer_last_15min"] = np.where(before >= 0, last3[at], fallback)
    for i in range(1, 13):
        out[f"moer_fc_5min_{i:02d}"] = fc_rows[f"f{i}"].to_numpy()
    return {"forecast": "file", "forecast_rows_from_earlier": int((~exact).sum())}


def _persistence_forecasts(out: pd.DataFrame, moer: pd.Series, mean: pd.Series, index: pd.DatetimeIndex) -> dict:
    """Add to ``out`` the persistence forecasts ``moer_fc_h0..h2``: at each step start of ``index``, the mean of the
    raw values ``moer`` (indexed by time) in the hour before it; where that hour holds none (the first step, when the
    files start with the period), the step's own mean ``mean``. Returns what ``info`` says of them.

    Each hour-long window ``[s - 1 h, s)`` is a group of a groupby on hours counted from ``s``'s offset in the hour,
    so at hourly steps the forecasts are exactly the previous hour's mean of :func:`carbon_at`.
    """
    minutes = index_minutes(index)
    n = 60 // minutes  # steps per hour
    prev = np.full(len(index), np.nan)
    steps = np.arange(len(index))
    for j in range(n):  # the steps i = j (mod n): their windows start at index[0] + (i - n) steps, hours apart
        start = index[0] + pd.Timedelta(minutes=j * minutes)
        hour_means = moer.groupby(step_bins(moer.index, start, 60)).mean()
        mine = steps[j::n]
        prev[mine] = hour_means.reindex((mine - j) // n - 1).to_numpy()
    prev = pd.Series(prev, index=index)
    own = prev.isna().to_numpy()
    first_own = bool(own[0])
    prev[own] = mean[own]
    for h in range(3):
        out[f"moer_fc_h{h}"] = prev.to_numpy()
    return {"forecast": "persistence", "first_hour_own_value": first_own}


def _carbon_split_uncovered(src: Sources, split: str, cover: list) -> None:
    """Raise the :class:`SourceError` of a split that no carbon file covers, naming what each file covers."""
    cfg = src.config
    dates = getattr(cfg.splits, split)
    first, end = period(cfg)
    raise SourceError(
        f"{src.toml}: no file of [sources.carbon] (files = {_patterns(src.carbon.files)}) covers split '{split}' (key"
        f" 'splits.{split}' = {dates[0]}..{dates[1]}, {cfg.timezone}). The files cover ({cfg.timezone} dates):"
        f" {_cover_text(cover)}. Point key 'sources.carbon.files' at files covering the site's period {first}..{end}"
        " (every hour from the first split's first day to the last split's last day), or change the splits"
    )
