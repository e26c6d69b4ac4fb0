"""PV output per kWp from weather (pvlib's PVWatts chain on a typical year, or its clear-sky model) or from
measured PV: :func:`read_pv` for the ``[sources.weather]`` table (:mod:`pipeline.data.sources`).

:func:`read_pv` returns ``pv_kw_per_kwp`` (float64, kW AC per kWp DC) on the period's hours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from envs.schemas import PV_MAX_KW_PER_KWP
from pipeline.data.sources import (
    PV_UNITS,
    PVParams,
    SourceError,
    Sources,
    check_coverage,
    check_range,
    column,
    files_of,
    numbers,
    parse_times,
    read_csv,
    rel_path,
)

# -------------------------------------------------------------------------------------------------- PV


def pvwatts_chain(params, solpos, dni, ghi, dhi, dni_extra, albedo, temp_air, wind_speed):
    """PV output of 1 kWp DC from irradiance and weather, per time step: plane-of-array irradiance (pvlib
    ``get_total_irradiance`` with ``params.transposition``), SAPM cell temperature, PVWatts DC with
    ``params.gamma_pdc`` less ``params.losses_pct`` of losses, then the PVWatts inverter at
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
    import pvlib

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
    pdc = pdc * (1.0 - params.losses_pct / 100.0)
    pac = pvlib.inverter.pvwatts(pdc, pdc0=1.0 / params.dc_ac_ratio, eta_inv_nom=params.eta_inv_nom)
    return poa_global, pdc, np.clip(np.nan_to_num(np.asarray(pac, dtype=np.float64)), 0.0, None)


def tmy_pv_kw_per_kwp(
    epw_path: str | Path,
    params: PVParams = PVParams(),  # noqa: B008 - a frozen dataclass: one shared default is safe
) -> tuple[pd.Series, dict]:
    """Model the AC output of 1 kWp DC of PV over the typical year of an EPW file, hour by hour.

    EPW records are hour-ending in the file's local standard time (its header's ``TZ``, a fixed UTC offset);
    ``pvlib.iotools.read_epw`` labels each record with its hour *start*. Solar position is computed at the
    middle of each hour (start + 30 min) with ``pvlib.solarposition.get_solarposition`` (latitude, longitude and
    altitude from the EPW header, the hour's air temperature and pressure). Then: plane-of-array irradiance with
    ``pvlib.irradiance.get_total_irradiance`` (``params`` tilt, azimuth and sky-diffuse model, the EPW's
    ``dni/ghi/dhi`` and ``albedo`` (0.2 where missing or outside (0, 1)), extraterrestrial DNI from
    ``pvlib.irradiance.get_extra_radiation``; no incidence-angle modifier), cell temperature with
    ``pvlib.temperature.sapm_cell`` (EPW air temperature and wind speed), DC power with
    ``pvlib.pvsystem.pvwatts_dc`` (pdc0 = 1 kW, ``gamma_pdc``), DC losses ``losses_pct``, AC power with
    ``pvlib.inverter.pvwatts`` (inverter ``pdc0 = 1 / dc_ac_ratio`` kW, ``eta_inv_nom``), floored at 0.

    Args:
        epw_path: EnergyPlus weather file (8,760 hourly records).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series of 8,760 values, kW AC per kWp DC (the hour's mean), indexed
        by the hour start in the file's local standard time (tz-aware, fixed offset); ``info`` has the EPW
        ``metadata``, ``annual_kwh_per_kwp`` (the sum over the year, kWh/kWp) and the albedo range.

    Raises:
        FileNotFoundError: the EPW file is missing.
        SourceError: the file is not readable as EPW, or does not hold 8,760 distinct (month, day, hour) records.
    """
    import pvlib

    epw_path = Path(epw_path)
    if not epw_path.is_file():
        raise FileNotFoundError(f"{epw_path}: EPW weather file not found")
    try:
        data, meta = pvlib.iotools.read_epw(str(epw_path))
    except Exception as exc:  # noqa: BLE001 - pvlib raises many kinds on a malformed file
        raise SourceError(f"{epw_path}: not readable as an EPW weather file (pvlib.iotools.read_epw): {exc}") from exc
    keys = data.index.month * 10000 + data.index.day * 100 + data.index.hour
    if len(data) != 8760 or pd.Index(keys).has_duplicates:
        raise SourceError(
            f"{epw_path}: expected 8,760 distinct hourly records (one non-leap year), got {len(data):,}"
            + (
                f" ({len(data) - pd.Index(keys).nunique():,} repeated month/day/hour)"
                if pd.Index(keys).has_duplicates
                else ""
            )
        )
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
        "annual_dc_before_losses_kwh_per_kwp": float(pdc.sum() / (1.0 - params.losses_pct / 100.0)),
        "albedo_range": (float(albedo.min()), float(albedo.max())),
        "peak_kw_per_kwp": float(pac.max()),
    }
    return pac, info


def map_tmy_to_calendar(tmy: pd.Series, index: pd.DatetimeIndex) -> np.ndarray:
    """Lay a typical-year hourly series onto real calendar hours.

    Each hour of ``index`` is converted to the typical year's own local standard time (the time zone of
    ``tmy``'s index: the EPW header's fixed UTC offset, never DST) and takes the value with the same
    (month, day, hour of the hour start); Feb 29 takes Feb 28's values.

    Args:
        tmy: 8,760 values indexed by tz-aware hour starts (as from :func:`tmy_pv_kw_per_kwp`).
        index: tz-aware hour starts, shape ``(T,)``.

    Returns:
        float64 array of shape ``(T,)``.

    Raises:
        ValueError: a calendar hour has no record.
    """
    src = tmy.index
    src_keys = pd.Index(src.month * 10000 + src.day * 100 + src.hour)
    lst = index.tz_convert(src.tz)
    day = np.where((lst.month == 2) & (lst.day == 29), 28, lst.day)
    keys = lst.month * 10000 + day * 100 + lst.hour
    pos = src_keys.get_indexer(keys)
    if (pos < 0).any():
        raise ValueError(f"no typical-year record for {index[np.flatnonzero(pos < 0)[0]]}")
    return tmy.to_numpy(np.float64)[pos]


def clear_sky_pv_kw_per_kwp(
    index: pd.DatetimeIndex,
    latitude: float,
    longitude: float,
    altitude: float | None,
    tz: str,
    params: PVParams = PVParams(),  # noqa: B008 - a frozen dataclass: one shared default is safe
    *,
    air_temp_c: float = 20.0,
    wind_speed_m_s: float = 1.0,
    albedo: float = 0.2,
    substeps_per_hour: int = 12,
    name: str | None = None,
) -> tuple[pd.Series, dict]:
    """Clear-sky AC output of 1 kWp DC of PV at a location, as hourly means.

    For every sub-step of each hour (``substeps_per_hour``, at its middle): solar position
    (``pvlib.location.Location(latitude, longitude, tz, altitude)``), clear-sky GHI/DNI/DHI from
    ``Location.get_clearsky(model="ineichen")`` with the Linke turbidity of
    ``pvlib.clearsky.lookup_linke_turbidity`` (pvlib's monthly climatology file ``LinkeTurbidities.h5``,
    interpolated to the day), then :func:`pvwatts_chain` with constant ``albedo``, ``air_temp_c`` and
    ``wind_speed_m_s`` (clear-sky data carry no weather); then the mean over the hour's sub-steps.

    Args:
        index: UTC hour starts (tz-aware DatetimeIndex).
        latitude, longitude: degrees; altitude: m (None: pvlib's lookup).
        tz: time zone of the ``Location`` (does not change the result: times are tz-aware).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series on ``index``, kW AC per kWp DC (hour mean); ``info`` has
        ``annual_kwh_per_kwp`` (sum over ``index``), ``annual_ghi_kwh_per_m2``, ``annual_poa_kwh_per_m2``,
        ``linke_turbidity_range`` (min, max) and ``peak_kw_per_kwp``.

    Raises:
        ValueError: ``index`` is not tz-aware.
    """
    import pvlib

    if index.tz is None:
        raise ValueError("index must be tz-aware (UTC hour starts)")
    n = substeps_per_hour
    offsets = pd.to_timedelta((np.arange(n) + 0.5) * 60.0 / n, unit="min")
    fine = pd.DatetimeIndex(
        (index.tz_convert(None).to_numpy()[:, None] + offsets.to_numpy()[None, :]).ravel()
    ).tz_localize("UTC")
    loc = pvlib.location.Location(latitude, longitude, tz=tz, altitude=altitude, name=name)
    solpos = loc.get_solarposition(fine)
    linke = pvlib.clearsky.lookup_linke_turbidity(fine, latitude, longitude)
    cs = loc.get_clearsky(fine, model="ineichen", solar_position=solpos, linke_turbidity=linke)
    dni_extra = pvlib.irradiance.get_extra_radiation(fine)
    poa_global, _, pac = pvwatts_chain(
        params, solpos, cs["dni"], cs["ghi"], cs["dhi"], dni_extra, albedo, air_temp_c, wind_speed_m_s
    )
    hourly = pd.Series(pac.reshape(len(index), n).mean(axis=1), index=index)
    info = {
        "annual_kwh_per_kwp": float(hourly.sum()),
        "annual_ghi_kwh_per_m2": float(np.asarray(cs["ghi"]).reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "annual_poa_kwh_per_m2": float(poa_global.to_numpy().reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "linke_turbidity_range": (float(linke.min()), float(linke.max())),
        "peak_kw_per_kwp": float(hourly.max()),
        "altitude": float(loc.altitude),
    }
    return hourly, info


def read_pv(src: Sources, index: pd.DatetimeIndex) -> tuple[np.ndarray, dict]:
    """PV output of 1 kWp DC in every hour of ``index``, kW AC per kWp DC (hour mean).

    - ``epw``: :func:`tmy_pv_kw_per_kwp` on the file, laid onto the calendar by :func:`map_tmy_to_calendar`
      in the file's own time zone (its header), whatever the site's ``timezone``.
    - ``clear-sky``: :func:`clear_sky_pv_kw_per_kwp` at ``[pv] latitude / longitude / altitude_m``.
    - ``pv-csv``: the mean of the measured values whose time falls in the hour (kW per kWp, or W per kWp with
      ``unit = "W/kWp"``).

    Returns:
        ``(pv, info)``: float64 array of shape ``(T,)`` and the model's diagnostics (``format`` included).

    Raises:
        SourceError: an EPW that is unreadable or not 8,760 records, a missing column, an unparsable timestamp,
            a value outside [0, 1.1] kW/kWp, or an hour of the period without a value (first one named).
    """
    w, cfg = src.weather, src.config
    if w.format == "epw":
        files = files_of(src, "weather")
        if len(files) != 1:
            raise SourceError(f"{src.toml}: key 'sources.weather.file' must name one EPW file, matches {len(files)}")
        tmy, info = tmy_pv_kw_per_kwp(files[0], src.pv)
        return map_tmy_to_calendar(tmy, index), {**info, "format": "epw", "file": rel_path(files[0], src.root)}
    if w.format == "clear-sky":
        p = cfg.pv
        pv, info = clear_sky_pv_kw_per_kwp(
            index,
            p.latitude,
            p.longitude,
            p.altitude_m,
            cfg.timezone,
            src.pv,
            air_temp_c=w.air_temp_c,
            wind_speed_m_s=w.wind_speed_m_s,
            albedo=w.albedo,
            substeps_per_hour=w.substeps_per_hour,
            name=cfg.name,
        )
        return pv.to_numpy(np.float64), {**info, "format": "clear-sky"}
    files = files_of(src, "weather")
    frames = []
    for f in files:
        d = read_csv(f)
        tcol = column(d, w.time_column, str(f), "sources.weather.time_column", src.toml)
        vcol = column(d, w.value_column, str(f), "sources.weather.value_column", src.toml)
        t = parse_times(
            tcol,
            file=str(f),
            column_name=w.time_column,
            key="sources.weather",
            toml=src.toml,
            tz=w.timezone,
            fmt=w.time_format,
        )
        v = numbers(vcol, file=str(f), column_name=w.value_column) * PV_UNITS[w.unit]
        check_range(
            v.to_numpy(),
            PV_MAX_KW_PER_KWP,
            file=str(f),
            column_name=w.value_column,
            unit_key="sources.weather.unit",
            unit=w.unit,
            what="kW per kWp",
            hint_hi=': looks like W per kWp (set unit = "W/kWp") or the whole array\'s kW (divide by its kWp)',
        )
        frames.append(pd.DataFrame({"time": t, "pv": v}))
    m = pd.concat(frames, ignore_index=True).drop_duplicates("time").set_index("time").sort_index()
    mean = m["pv"].groupby(m.index.floor("h")).mean().reindex(index)
    label = ", ".join(rel_path(f, src.root) for f in files)
    check_coverage(mean, index, cfg, f"PV column '{w.value_column}'", label)
    return mean.to_numpy(np.float64), {
        "format": "pv-csv",
        "rows": len(m),
        "annual_kwh_per_kwp": float(mean.sum()),
        "peak_kw_per_kwp": float(mean.max()),
    }
