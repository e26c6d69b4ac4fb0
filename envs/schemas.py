"""Pandera schemas of a site's processed data, their validation, and the table reader.

A site's processed data are a time series at each step the site runs at and its sessions (written by ``python -m
pipeline.data.ingest``; columns, units and provenance in ``envs/sites/<site>/README.md``):

``series`` (:func:`series_schema`), ``series_<m>min.parquet``: one row per UTC step of ``m`` minutes, strictly every
``m`` minutes without gaps:
    ``time``             datetime64[ns, UTC]  step start
    ``pv_kw_per_kwp``    float32  AC PV output per kWp DC, mean over the step, kW/kWp, in [0, 1.1]
    ``moer_kg_per_kwh``  float32  marginal operating emissions rate, mean over the step, kg CO2/kWh, in [0, 2]
    ``moer_fc_h0..h2``   float32  MOER forecast issued at the step start for the hour from it / the next hour / the
                                  one after, kg CO2/kWh, in [0, 2] (leads in hours at every step)
    optional (:data:`MOER_5MIN_COLUMNS`, all or none; written where the carbon source is 5-minute with forecasts):
    ``moer_last_5min``   float32  realised MOER of the last 5-minute interval before the step start, kg CO2/kWh
    ``moer_last_15min``  float32  mean realised MOER of the last three 5-minute intervals before the step start
    ``moer_fc_5min_01..12``  float32  the 5-minute forecasts for the twelve intervals of the hour from the step
                                  start, issued at it

``physics`` (:func:`series_schema` with ``physics_only``): the same file at the step the site is also simulated at
(5 minutes), holding at least ``time``, ``pv_kw_per_kwp`` and ``moer_kg_per_kwh`` (what the physics reads).

``sessions`` (:data:`SESSIONS_SCHEMA`), one row per EV charging session, sorted by arrival:
    ``session_id``, ``station_id``  str  (session ids unique)
    ``arrival``, ``departure``      datetime64[ns, UTC], departure > arrival
    ``energy_kwh``                  float32  energy delivered, kWh, in [0, 200]
    ``requested_energy_kwh``        float32  energy the driver asked for, kWh, >= 0

No column may hold NaN/NaT. Extra columns are allowed. :func:`validate_site_data` runs both schemas and
turns pandera's failure cases into one :class:`DataValidationError` whose message names the file, the column,
the row and its timestamp or session id, for example::

    .../sessions.parquet: column 'energy_kwh' row 17 (session 2_39_...): -3.0 fails greater_than_or_equal_to(0)

This module imports nothing from the rest of the project.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError, SchemaErrors

from envs.errors import InputError
from envs.toml_table import closest

__all__ = [
    "DataValidationError",
    "series_schema",
    "SESSIONS_SCHEMA",
    "SERIES_COLUMNS",
    "PHYSICS_COLUMNS",
    "MOER_5MIN_COLUMNS",
    "SESSIONS_COLUMNS",
    "validate_site_data",
    "validate_table",
    "validate_columns",
    "read_table",
]

UTC_NS = pd.DatetimeTZDtype("ns", "UTC")
"""dtype of every timestamp column: nanoseconds, tz-aware UTC."""

MOER_COLUMNS = ("moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2")
MOER_5MIN_COLUMNS = ("moer_last_5min", "moer_last_15min", *(f"moer_fc_5min_{i:02d}" for i in range(1, 13)))
"""Optional series columns: what a 5-minute carbon source says at each step start beyond the hour means (module
docstring); a site has all of them or none."""
SERIES_COLUMNS = ("time", "pv_kw_per_kwp", *MOER_COLUMNS)
PHYSICS_COLUMNS = ("time", "pv_kw_per_kwp", "moer_kg_per_kwh")
"""The columns a site's simulation at a finer step reads (its PV and MOER; no forecast)."""
SESSIONS_COLUMNS = ("session_id", "station_id", "arrival", "departure", "energy_kwh", "requested_energy_kwh")
_TIME_COLUMNS = ("time", "arrival", "departure")
_FLOAT32_COLUMNS = ("pv_kw_per_kwp", *MOER_COLUMNS, *MOER_5MIN_COLUMNS, "energy_kwh", "requested_energy_kwh")
_STRING_COLUMNS = ("session_id", "station_id")

MOER_MAX_KG_PER_KWH = 2
"""Upper bound of plausible MOER, kg CO2/kWh (real values stay below ~1.1; a g/kWh file reads ~100s)."""
PV_MAX_KW_PER_KWP = 1.1
"""Upper bound of plausible AC PV output per kWp DC (irradiance above 1 kW/m2 on a cold module)."""
ENERGY_MAX_KWH = 200
"""Upper bound of plausible energy delivered in one session, kWh (largest EV batteries)."""


class DataValidationError(InputError):
    """Processed site data break a schema, or a table file cannot be read.

    The message names the file, the column and the row (0-based position in the table) with its
    timestamp or session id of the first offending value of each failed check, one line per check.
    """


# ---------------------------------------------------------------------------------------------- checks


def _regular(minutes: int):
    """Element-wise check: each timestamp is exactly ``minutes`` after the previous row's (first row passes)."""

    def check(s: pd.Series) -> pd.Series:
        if not pd.api.types.is_datetime64_any_dtype(s):
            return pd.Series(True, index=s.index)
        d = s.diff()
        return d.isna() | (d == pd.Timedelta(minutes=minutes))

    return check


def step_words(minutes: int) -> str:
    """How a step is said in messages: ``hourly`` for 60 minutes, else ``every 15 minutes``."""
    return "hourly" if minutes == 60 else f"every {minutes} minutes"


def _non_decreasing(s: pd.Series) -> pd.Series:
    """Element-wise: each value is >= the previous row's (first row passes)."""
    if not pd.api.types.is_datetime64_any_dtype(s):
        return pd.Series(True, index=s.index)
    d = s.diff()
    return d.isna() | (d >= pd.Timedelta(0))


def _departure_after_arrival(df: pd.DataFrame) -> pd.Series | bool:
    """Row-wise: departure strictly after arrival (rows with a missing value are left to not_nullable)."""
    if "arrival" not in df or "departure" not in df:
        return True  # the missing column is reported by its own check
    try:
        ok = df["departure"] > df["arrival"]
    except TypeError:
        return True  # a dtype failure is reported by the column's dtype check
    return ok | df["departure"].isna() | df["arrival"].isna()


def _float_column(lo: float, hi: float | None = None, required: bool = True) -> pa.Column:
    checks = [pa.Check.ge(lo)] if hi is None else [pa.Check.ge(lo), pa.Check.le(hi)]
    return pa.Column(np.float32, checks=checks, nullable=False, required=required)


@functools.cache
def series_schema(minutes: int = 60, physics_only: bool = False) -> pa.DataFrameSchema:
    """Schema of ``series_<minutes>min.parquet`` (see module docstring); with ``physics_only`` the forecast columns are
    optional (the series a finer simulation reads). Validate with ``lazy=True`` to get all failures."""
    return pa.DataFrameSchema(
        {
            "time": pa.Column(
                UTC_NS,
                checks=[pa.Check(_regular(int(minutes)), name=f"strictly_every_{int(minutes)}_minutes")],
                nullable=False,
                unique=True,
            ),
            "pv_kw_per_kwp": _float_column(0, PV_MAX_KW_PER_KWP),
            **{
                c: _float_column(0, MOER_MAX_KG_PER_KWH, required=c not in MOER_COLUMNS[1:] or not physics_only)
                for c in MOER_COLUMNS
            },
            **{c: _float_column(0, MOER_MAX_KG_PER_KWH, required=False) for c in MOER_5MIN_COLUMNS},
        },
        strict=False,
        name="physics" if physics_only else "series",
    )


SESSIONS_SCHEMA = pa.DataFrameSchema(
    {
        "session_id": pa.Column(str, nullable=False, unique=True),
        "station_id": pa.Column(str, nullable=False),
        "arrival": pa.Column(
            UTC_NS,
            checks=[pa.Check(_non_decreasing, name="sorted_by_arrival")],
            nullable=False,
        ),
        "departure": pa.Column(UTC_NS, nullable=False),
        "energy_kwh": _float_column(0, ENERGY_MAX_KWH),
        "requested_energy_kwh": _float_column(0),
    },
    checks=[pa.Check(_departure_after_arrival, name="departure_after_arrival")],
    strict=False,
    name="sessions",
)
"""Schema of ``sessions.parquet`` (see module docstring). Validate with ``lazy=True`` to get all failures."""


# ------------------------------------------------------------------------------------------ validation


def _normalise_time_units(df: pd.DataFrame) -> pd.DataFrame:
    """Copy with a RangeIndex and UTC timestamp columns in ns (a unit or a UTC alias is not a defect)."""
    df = df.reset_index(drop=True)
    for c in _TIME_COLUMNS:
        if c in df and isinstance(df[c].dtype, pd.DatetimeTZDtype):
            tz = df[c].dtype.tz
            if str(tz) in ("UTC", "utc", "Etc/UTC", "UTC+00:00") and df[c].dtype != UTC_NS:
                df[c] = df[c].astype(UTC_NS)
    return df


def _fmt_value(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return str(np.float32(v)) if np.isfinite(v) and abs(v) < 3e38 else str(v)
    return str(v)


def _row_label(kind: str, df: pd.DataFrame, row: int) -> str:
    """'(time ...)' for series rows, '(session ...)' for session rows, '' when unknown."""
    if not 0 <= row < len(df):
        return ""
    col = "session_id" if kind == "sessions" else "time"
    if col not in df:
        return ""
    return f" ({'session' if kind == 'sessions' else 'time'} {df[col].iloc[row]})"


def _value_has_type(v: Any, expected: str) -> bool:
    """Whether one cell holds a value of the schema's dtype (a missing value is left to not_nullable)."""
    if v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NaT:
        return True
    if expected.startswith("float"):
        return isinstance(v, (float, np.floating))
    if expected.startswith("datetime64"):
        return isinstance(v, pd.Timestamp) and v.tz is not None and str(v.tz) in ("UTC", "utc", "Etc/UTC")
    if expected in ("str", "string", "object"):
        return isinstance(v, str)
    return True


def _dtype_offender(kind: str, df: pd.DataFrame, column: str, expected: str) -> str:
    """Where a column with the wrong dtype goes wrong: its first cell of another type, else all rows."""
    if column not in df or len(df) == 0:
        return "all rows"
    values = df[column]
    if values.dtype == object or str(values.dtype) in ("str", "string"):
        bad = [i for i, v in enumerate(values.to_numpy(dtype=object)) if not _value_has_type(v, expected)]
        if bad:
            row, v = bad[0], values.iloc[bad[0]]
            more = f" [{len(bad)} rows in all]" if len(bad) > 1 else ""
            return f"row {row}{_row_label(kind, df, row)} holds {v!r} ({type(v).__name__}){more}"
    return f"all {len(df)} rows, from row 0{_row_label(kind, df, 0)}: {_fmt_value(values.iloc[0])}"


def _format_failures(
    kind: str, file: str, df: pd.DataFrame, fc: pd.DataFrame, schema_columns: tuple[str, ...] = ()
) -> list[str]:
    """One message line per (column, check), naming the first offending row."""
    lines: list[tuple[float, str]] = []
    fc = fc.copy()
    fc["column"] = fc["column"].astype(object).where(fc["column"].notna(), None)
    # table-level failures: missing columns, wrong dtypes (no row index); a check that crashed on a column
    # with a wrong dtype only repeats the dtype failure, so it is left out
    table = fc[fc["index"].isna()]
    bad_dtype = set(table.loc[table["check"].astype(str).str.startswith("dtype("), "column"])
    crashed = ~table["check"].astype(str).str.startswith("dtype(") & table["column"].isin(bad_dtype)
    for _, r in table[~crashed].iterrows():
        check = str(r["check"])
        if check == "column_in_dataframe":
            missing = str(r["failure_case"])
            present = ", ".join(map(str, df.columns))
            close = closest(missing, [str(c) for c in df.columns if c not in schema_columns])
            hint = f"; did you mean to rename '{close}'?" if close is not None else ""
            lines.append((-2, f"{file}: column '{missing}' is missing (all rows; columns present: {present}){hint}"))
        elif check.startswith("dtype("):
            expected = check[len("dtype(") : -1].strip("'")
            hint = ""
            if r["column"] in _TIME_COLUMNS:
                hint = " (timestamps must be tz-aware UTC)"
            where = _dtype_offender(kind, df, str(r["column"]), expected)
            got = f"has dtype {r['failure_case']}, expected {expected}{hint}"
            lines.append((-1, f"{file}: column '{r['column']}' {got}: {where}"))
        elif check == "departure_after_arrival" or r["column"] is None:
            lines.append((-1, f"{file}: check {check} failed: {r['failure_case']}"))
        else:
            lines.append((-1, f"{file}: column '{r['column']}' fails {check}: {r['failure_case']}"))
    rows = fc[fc["index"].notna()].copy()
    rows["index"] = rows["index"].astype(np.int64)
    # the wide departure/arrival check lists every column of a failing row: keep one per row
    wide = rows["check"] == "departure_after_arrival"
    rows.loc[wide, "column"] = "departure"
    rows = rows.drop_duplicates(["column", "check", "index"])
    for (column, check), g in rows.groupby(["column", "check"], sort=False):
        g = g.sort_values("index")
        row = int(g["index"].iloc[0])
        n = len(g)
        value = _fmt_value(g["failure_case"].iloc[0])
        detail = ""
        if check == "departure_after_arrival":
            value = f"departure {df['departure'].iloc[row]} <= arrival {df['arrival'].iloc[row]}"
            check_txt = "departure > arrival"
        elif str(check).startswith("strictly_every_"):
            minutes = int(str(check).split("_")[2])
            step = pd.Timedelta(minutes=minutes)
            unit = "hour(s)" if minutes == 60 else f"step(s) of {minutes} minutes"
            prev = df["time"].iloc[row - 1] if row >= 1 else None
            gap = df["time"].iloc[row] - prev if prev is not None else None
            if gap is not None and gap > step:
                n = gap / step
                missing = f"{int(n) - 1} {unit}" if n == int(n) else f"{(gap - step) / pd.Timedelta(hours=1):g} h"
                detail = f": {missing} missing after {prev} (first missing {prev + step})"
            elif gap is not None and gap == pd.Timedelta(0):
                detail = ": same as the previous row (duplicate timestamp)"
            elif gap is not None and gap < pd.Timedelta(0):
                detail = f": before the previous row's {prev} (out of order)"
            else:
                detail = f": {gap} after the previous row's {prev}, not {'1 h' if minutes == 60 else f'{minutes} min'}"
            check_txt = f"strictly {step_words(minutes)}"
        elif check == "field_uniqueness":
            check_txt = "unique (duplicate value)"
        elif check == "not_nullable":
            check_txt = "not_nullable (NaN/NaT)"
        elif check == "sorted_by_arrival":
            check_txt = f"sorted by arrival (previous row arrives {df['arrival'].iloc[row - 1]})"
        else:
            check_txt = str(check)
        if column in MOER_COLUMNS and str(check).startswith("less_than") and column in df:
            if float(np.nanmedian(df[column].to_numpy(np.float64))) > MOER_MAX_KG_PER_KWH:
                detail += "; looks like g/kWh: expected kg CO2/kWh (divide by 1000)"
        if column == "pv_kw_per_kwp" and str(check).startswith("less_than") and column in df:
            if float(np.nanmax(df[column].to_numpy(np.float64))) > 100:
                detail += "; looks like W per kWp: expected kW per kWp (divide by 1000)"
        more = f" [{n} rows in all]" if n > 1 else ""
        lines.append(
            (
                row,
                f"{file}: column '{column}' row {row}{_row_label(kind, df, row)}: {value} fails {check_txt}"
                f"{detail}{more}",
            )
        )
    lines.sort(key=lambda t: t[0])
    return [text for _, text in lines]


def _validate_one(kind: str, schema: pa.DataFrameSchema, df: pd.DataFrame, file: str) -> list[str]:
    if not isinstance(df, pd.DataFrame):
        return [f"{file}: expected a pandas DataFrame, got {type(df).__name__}"]
    if len(df) == 0:
        return [f"{file}: the table has no rows"]
    df = _normalise_time_units(df)
    try:
        schema.validate(df, lazy=True)
    except SchemaErrors as exc:
        return _format_failures(kind, file, df, exc.failure_cases, tuple(schema.columns))
    except SchemaError as exc:  # not expected with lazy=True, but keep the file name in any case
        return [f"{file}: {exc}"]
    return []


def _schema(kind: str, minutes: int) -> pa.DataFrameSchema:
    """The schema of a table ``kind``: ``"series"``, ``"physics"`` (both at a step of ``minutes``) or ``"sessions"``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "sessions":
        return SESSIONS_SCHEMA
    if kind in ("series", "physics"):
        return series_schema(int(minutes), kind == "physics")
    raise ValueError(f"unknown table kind {kind!r}: expected 'series', 'physics' or 'sessions'")


def validate_table(kind: str, df: pd.DataFrame, file: str, minutes: int = 60) -> None:
    """Validate one processed table (``kind`` ``"series"``, ``"physics"`` or ``"sessions"``; a series at a step of
    ``minutes``); see :func:`validate_site_data`.

    Raises:
        ValueError: unknown ``kind``.
        DataValidationError: one line per failed check, naming ``file``, the column and the row.
    """
    problems = _validate_one(kind, _schema(kind, minutes), df, str(file))
    if problems:
        raise DataValidationError("\n".join(problems))


def _columns_only(schema: pa.DataFrameSchema) -> pa.DataFrameSchema:
    """The schema's columns and dtypes without any value check (NaN allowed)."""
    columns = {name: pa.Column(col.dtype, nullable=True, required=col.required) for name, col in schema.columns.items()}
    return pa.DataFrameSchema(columns, strict=False, name=schema.name)


def validate_columns(kind: str, df: pd.DataFrame, file: str, minutes: int = 60) -> None:
    """Check only that a table (``kind`` as :func:`validate_table`'s) has its columns with their dtypes.

    This is the part of :func:`validate_table` that code reading the columns relies on (no value checks);
    the messages are the same as :func:`validate_table`'s for these failures.

    Raises:
        ValueError: unknown ``kind``.
        DataValidationError: a missing column (naming the file and the column, with a close match among the
            columns present) or a column of another dtype (naming its first cell of another type: row and
            timestamp or session id), or a table without rows.
    """
    problems = _validate_one(kind, _columns_only(_schema(kind, minutes)), df, str(file))
    if problems:
        raise DataValidationError("\n".join(problems))


def validate_site_data(
    series: pd.DataFrame, sessions: pd.DataFrame, source: dict[str, str], minutes: int = 60, kind: str = "series"
) -> None:
    """Validate a site's series and sessions against :func:`series_schema` and :data:`SESSIONS_SCHEMA`.

    Args:
        series: the series at a step of ``minutes``, shape ``(T, >=6)`` (``kind="physics"``: ``(T, >=3)``), columns
            as in the module docstring
            (``time`` datetime64[ns, UTC], float32 ``pv_kw_per_kwp`` kW/kWp and ``moer_*`` kg CO2/kWh).
            Timestamp columns in another unit (e.g. ``us``) of UTC are accepted.
        sessions: the session table, shape ``(S, >=6)``, columns as in the module docstring
            (str ids, datetime64[ns, UTC] ``arrival``/``departure``, float32 ``energy_kwh``,
            ``requested_energy_kwh`` in kWh).
        source: file paths used in messages, keys ``"series"`` and ``"sessions"`` (others are ignored;
            missing keys fall back to ``"series data"`` / ``"sessions data"``).
        minutes: the series' step. kind: ``"series"`` or ``"physics"`` (only the physics columns required).

    Checks: required columns present with their dtypes; no NaN/NaT; the series' ``time`` unique, UTC and
    strictly one step apart (no gap); ``pv_kw_per_kwp`` in [0, 1.1]; ``moer_*`` in [0, 2] kg/kWh (a column whose
    median exceeds 2 is reported as "looks like g/kWh"); ``energy_kwh`` in [0, 200]; ``requested_energy_kwh``
    >= 0; ``session_id`` unique; sessions sorted by arrival; ``departure > arrival``. Neither frame is modified.

    Raises:
        DataValidationError: one line per failed check (both tables are checked before raising), each
            naming the file, the column and the first offending row (0-based position) with its timestamp
            (series) or session id (sessions), the value, the check and the count of offending rows.
    """
    problems = _validate_one(kind, _schema(kind, minutes), series, str(source.get("series", "series data")))
    problems += _validate_one("sessions", SESSIONS_SCHEMA, sessions, str(source.get("sessions", "sessions data")))
    if problems:
        raise DataValidationError("\n".join(problems))


# ------------------------------------------------------------------------------------------------ read


_PARQUET_MAGIC = b"PAR1"


def _sniff_wrong_format(path: Path, fmt: str) -> str:
    """Why the file's first bytes do not fit ``fmt`` ("" when they might): a text file under a Parquet name,
    a Parquet file under a CSV name, or a known other format (JSON, Excel, pickle)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        return "the file is empty (0 bytes)"
    kinds = (
        (b"PK\x03\x04", "a ZIP archive (an Excel .xlsx workbook?)"),
        (b"\xd0\xcf\x11\xe0", "an Excel .xls workbook"),
        (b"\x80", "a Python pickle"),
        (b"\x1f\x8b", "gzip-compressed data"),
    )
    if fmt == "parquet":
        if head.startswith(_PARQUET_MAGIC):
            return ""
        text = head.lstrip()
        if text[:1] in (b"{", b"["):
            found = "JSON text"
        else:
            found = next((name for magic, name in kinds if head.startswith(magic)), "")
            if not found:
                try:
                    head.decode("utf-8")
                    found = "plain text (CSV?)"
                except UnicodeDecodeError:
                    found = "binary data of an unknown format"
        first = head[:24].decode("utf-8", "replace")
        return (
            f"the file holds {found}, starting {first!r}, not Parquet (a Parquet file starts with 'PAR1'); "
            "expected a Parquet file (DataFrame.to_parquet) or a .csv file"
        )
    if fmt == "csv" and path.suffix.lower() == ".csv":
        if head.startswith(_PARQUET_MAGIC):
            return "the file is Parquet, not CSV text: name it .parquet"
        found = next((name for magic, name in kinds if head.startswith(magic)), "")
        if found:
            return f"the file holds {found}, not CSV text; expected a .parquet or .csv file"
    return ""


def read_table(path: str | Path) -> pd.DataFrame:
    """Read one processed table from a ``.parquet`` or ``.csv`` file.

    Parquet files are read as stored. CSV carries no dtypes, so the known columns are converted to the
    processed format: ``time``/``arrival``/``departure`` parsed as datetime64[ns, UTC] (strings must carry
    a UTC offset or be UTC), the float columns of the module docstring to float32, ``session_id`` and
    ``station_id`` to str. UTC timestamp columns in another unit are converted to ns in both cases. The
    result is not validated: call :func:`validate_site_data`.

    Args:
        path: file path; the suffix decides the format (``.parquet``/``.pq`` or ``.csv``/``.csv.gz``).

    Returns:
        The table as a DataFrame with a RangeIndex.

    Raises:
        FileNotFoundError: no such file (message names it).
        DataValidationError: an unsupported suffix (e.g. ``.json``, ``.xlsx``), a file whose content is not
            its suffix's format (e.g. JSON or CSV text under a ``.parquet`` name: the message says what the
            first bytes look like), an empty file, a file the reader fails on, or a CSV column that cannot be
            converted (message names the file, and the column where known).
    """
    path = Path(path)
    suffixes = "".join(path.suffixes[-2:]).lower()
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        fmt = "parquet"
    elif suffix == ".csv" or suffixes == ".csv.gz":
        fmt = "csv"
    else:
        raise DataValidationError(
            f"{path}: unsupported file type {suffix or '(no suffix)'!r}: expected .parquet or .csv"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    wrong = _sniff_wrong_format(path, fmt)
    if wrong:
        raise DataValidationError(f"{path}: not readable as {fmt}: {wrong}")
    try:
        if fmt == "parquet":
            df = pd.read_parquet(path)
        else:
            df = pd.read_csv(path, dtype={c: str for c in _STRING_COLUMNS})
    except Exception as exc:  # noqa: BLE001 - any reader failure means the file is not that format
        raise DataValidationError(f"{path}: not readable as {fmt}: {type(exc).__name__}: {exc}") from exc
    df = df.reset_index(drop=True)
    if fmt == "csv":
        for c in _TIME_COLUMNS:
            if c in df:
                try:
                    df[c] = pd.to_datetime(df[c], utc=True, format="ISO8601").astype(UTC_NS)
                except (ValueError, TypeError) as exc:
                    raise DataValidationError(f"{path}: column '{c}' is not parsable as timestamps: {exc}") from exc
        for c in _FLOAT32_COLUMNS:
            if c in df:
                try:
                    df[c] = pd.to_numeric(df[c]).astype(np.float32)
                except (ValueError, TypeError) as exc:
                    raise DataValidationError(f"{path}: column '{c}' is not numeric: {exc}") from exc
    return _normalise_time_units(df)
