"""PV output per kWp from weather (pvlib's PVWatts chain on a typical year, or its clear-sky model) or from
measured PV: :func:`read_pv` for the ``[sources.weather]`` table (:mod:`pipeline.data.sources`).

:func:`read_pv` returns ``pv_kw_per_kwp`` (float64, kW AC per kWp DC, the mean over each step) on the period's
steps. An EPW year is hourly: each hour is modelled as a whole (:func:`tmy_pv_kw_per_kwp`), then split into its steps
in proportion to the clear-sky GHI at each step's middle (:func:`split_hours`), so that the mean of an hour's steps is
the hourly value. The clear-sky model is run at sub-steps within each step (:func:`clear_sky_pv_kw_per_kwp`); measured
PV is averaged over each step, at no step finer than its own resolution. The model is set up once (:func:`load_pv`)
and laid onto the steps of any index (:func:`pv_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from envs import timestep
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
    index_minutes,
    numbers,
    parse_times,
    read_csv,
    rel_path,
    resolution_minutes,
    step_bins,
    step_error,
    step_refusal,
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
    dt_h: float = 1.0,
) -> tuple[pd.Series, dict]:
    """Clear-sky AC output of 1 kWp DC of PV at a location, as means over steps of ``dt_h`` hours.

    For every sub-step of each step (:func:`substeps_per_step`: ``substeps_per_hour`` per hour, so 12 a hour, 3 a
    15-minute step and 1 a 5-minute step by default; at its middle): solar position
    (``pvlib.location.Location(latitude, longitude, tz, altitude)``), clear-sky GHI/DNI/DHI from
    ``Location.get_clearsky(model="ineichen")`` with the Linke turbidity of
    ``pvlib.clearsky.lookup_linke_turbidity`` (pvlib's monthly climatology file ``LinkeTurbidities.h5``,
    interpolated to the day), then :func:`pvwatts_chain` with constant ``albedo``, ``air_temp_c`` and
    ``wind_speed_m_s`` (clear-sky data carry no weather); then the mean over the step's sub-steps. Where the
    sub-steps of an hour divide into its steps, they are the same instants at every step, so the mean of an hour's
    steps equals the hourly value (up to float rounding).

    Args:
        index: UTC step starts every ``dt_h`` hours (tz-aware DatetimeIndex).
        latitude, longitude: degrees; altitude: m (None: pvlib's lookup).
        tz: time zone of the ``Location`` (does not change the result: times are tz-aware).
        params: PV model parameters.
        dt_h: the step of ``index``, hours (a whole-minute divisor of the hour).

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series on ``index``, kW AC per kWp DC (step mean); ``info`` has
        ``annual_kwh_per_kwp`` (the energy over ``index``), ``annual_ghi_kwh_per_m2``, ``annual_poa_kwh_per_m2``,
        ``linke_turbidity_range`` (min, max), ``peak_kw_per_kwp`` and ``substeps_per_step``.

    Raises:
        ValueError: ``index`` is not tz-aware.
    """
    import pvlib

    if index.tz is None:
        raise ValueError("index must be tz-aware (UTC step starts)")
    n = substeps_per_step(substeps_per_hour, dt_h)
    step_min = float(timestep.step_minutes(dt_h))
    offsets = pd.to_timedelta((np.arange(n) + 0.5) * step_min / n, unit="min")
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
    pv = pd.Series(pac.reshape(len(index), n).mean(axis=1), index=index)
    h = step_min / 60.0  # hours per step: the steps' means in kW add up to kWh
    info = {
        "annual_kwh_per_kwp": float(pv.sum()) * h,
        "annual_ghi_kwh_per_m2": float(np.asarray(cs["ghi"]).reshape(len(index), n).mean(axis=1).sum() / 1000.0) * h,
        "annual_poa_kwh_per_m2": float(poa_global.to_numpy().reshape(len(index), n).mean(axis=1).sum() / 1000.0) * h,
        "linke_turbidity_range": (float(linke.min()), float(linke.max())),
        "peak_kw_per_kwp": float(pv.max()),
        "altitude": float(loc.altitude),
        "substeps_per_step": n,
    }
    return pv, info


def substeps_per_step(substeps_per_hour: int, dt_h: float) -> int:
    """Sub-steps of the clear-sky model in a step of ``dt_h`` hours: ``substeps_per_hour`` spread over the hour's
    steps, rounded, at least 1 (12 a hour: 3 in a 15-minute step, 1 in a 5-minute step)."""
    return max(1, int(round(substeps_per_hour * timestep.step_minutes(dt_h) / 60)))


def split_hours(
    hourly: np.ndarray, index: pd.DatetimeIndex, latitude: float, longitude: float, altitude: float, cap: float
) -> tuple[np.ndarray, dict]:
    """Split hourly PV means into the steps of ``index`` in proportion to the clear-sky GHI at each step's middle.

    The weights are pvlib's Haurwitz clear-sky GHI (``pvlib.location.Location(latitude, longitude,
    altitude=altitude).get_clearsky(middles, model="haurwitz")``) at the middle of each step, as pvlib advises for
    interval-averaged data (solar position at the middle of the interval). An hour whose steps all have zero
    weight (the sun below the horizon at every middle) gets equal shares. A step's value above ``cap`` (the AC
    limit of the inverter: a clipped hour is clipped all through) is cut to it, and what it loses goes to the hour's
    other steps in proportion to their weights (in equal parts where they have none), none above ``cap``. So the mean
    of an hour's steps is the hourly value (up to float rounding), and the steps' shape within the hour follows the
    sun.

    Args:
        hourly: ``(H,)`` float64 PV of each hour, kW/kWp (mean over the hour), no hour above ``cap``.
        index: ``(H * n,)`` UTC step starts, ``n`` steps per hour, the hours in order.
        latitude, longitude: degrees; altitude: m (the weather file's location).
        cap: the most a step may hold, kW/kWp.

    Returns:
        ``(pv, info)``: ``(H * n,)`` float64 step means, kW/kWp, and ``info`` with ``hours_equal_shares`` (hours with
        PV but no clear-sky weight) and ``hours_capped`` (hours whose shares were cut at ``cap``).
    """
    import pvlib

    hourly = np.asarray(hourly, dtype=np.float64)
    minutes = index_minutes(index)
    n = 60 // minutes
    if n == 1:
        return hourly.copy(), {"hours_equal_shares": 0, "hours_capped": 0}
    middles = index + pd.Timedelta(minutes=minutes / 2)
    loc = pvlib.location.Location(latitude, longitude, altitude=altitude)
    ghi = loc.get_clearsky(middles, model="haurwitz")["ghi"].to_numpy(np.float64)
    w = np.clip(np.nan_to_num(ghi), 0.0, None).reshape(len(hourly), n)
    total = w.sum(axis=1, keepdims=True)
    dark = total[:, 0] <= 0
    w[dark] = 1.0
    share = w / w.sum(axis=1, keepdims=True)
    pv = hourly[:, None] * n * share
    capped = np.zeros(len(hourly), dtype=bool)
    for _ in range(n):  # water-filling: each pass fixes at least one more step at the cap
        over = pv > cap * (1 + 1e-12)
        if not over.any():
            break
        rows = over.any(axis=1)
        capped |= rows
        at_cap = pv[rows] >= cap * (1 - 1e-12)
        excess = np.where(at_cap, pv[rows] - cap, 0.0).sum(axis=1, keepdims=True)
        free = np.where(at_cap, 0.0, share[rows])
        room = free.sum(axis=1, keepdims=True)
        open_steps = (~at_cap).sum(axis=1, keepdims=True)  # where the steps left have no weight: equal parts
        equal = np.where(at_cap, 0.0, 1.0) / np.maximum(open_steps, 1)
        spread = np.where(room > 0, free / np.where(room > 0, room, 1.0), equal)
        pv[rows] = np.where(at_cap, cap, pv[rows] + excess * spread)
    info = {"hours_equal_shares": int((dark & (hourly > 0)).sum()), "hours_capped": int(capped.sum())}
    return pv.ravel(), info


def read_pv(src: Sources, index: pd.DatetimeIndex) -> tuple[np.ndarray, dict]:
    """PV output of 1 kWp DC in every step of ``index`` (the site's period at a step that divides the hour), kW AC per
    kWp DC (step mean): :func:`pv_at` on :func:`load_pv`.

    - ``epw``: :func:`tmy_pv_kw_per_kwp` on the file, laid onto the calendar's hours by
      :func:`map_tmy_to_calendar` in the file's own time zone (its header), whatever the site's ``timezone``; at a
      step finer than the hour, each hour split into its steps by :func:`split_hours` (in proportion to the clear-sky
      GHI at each step's middle at the header's location; the mean of an hour's steps is the hourly value).
    - ``clear-sky``: :func:`clear_sky_pv_kw_per_kwp` at ``[pv] latitude / longitude / altitude_m``, at the step.
    - ``pv-csv``: the mean of the measured values whose time falls in the step (kW per kWp, or W per kWp with
      ``unit = "W/kWp"``); no step finer than the files' resolution (the typical spacing of their timestamps).

    At hourly steps every value is the one of the hourly study.

    Returns:
        ``(pv, info)``: float64 array of shape ``(T,)`` and the model's diagnostics (``format`` included).

    Raises:
        SourceError: an EPW that is unreadable or not 8,760 records, a missing column, an unparsable timestamp,
            a value outside [0, 1.1] kW/kWp, a step finer than the measured PV's resolution (naming the TOML, the key
            ``dt_h``, the source and its resolution), or a step of the period without a value (first one named).
    """
    model = load_pv(src)
    refusal = pv_step_refusal(src, model, index_minutes(index))
    if refusal:
        raise step_error(src, index_minutes(index), refusal)
    return pv_at(src, model, index)


@dataclass(frozen=True)
class PVModel:
    """What :func:`load_pv` reads once: for ``epw`` the typical year's hourly PV (``tmy``) and its diagnostics, for
    ``pv-csv`` the measured rows (``rows``, indexed by UTC time) and their resolution (minutes); nothing for
    ``clear-sky`` (modelled at each step)."""

    format: str
    tmy: pd.Series | None = None
    info: dict | None = None
    rows: pd.DataFrame | None = None
    resolution_min: float | None = None
    label: str = ""


def load_pv(src: Sources) -> PVModel:
    """Model the EPW year or read the measured PV of the site's ``[sources.weather]`` once.

    Raises:
        SourceError: as :func:`read_pv`, but the steps' checks (:func:`pv_at`).
    """
    w = src.weather
    if w.format == "epw":
        files = files_of(src, "weather")
        if len(files) != 1:
            raise SourceError(f"{src.toml}: key 'sources.weather.file' must name one EPW file, matches {len(files)}")
        tmy, info = tmy_pv_kw_per_kwp(files[0], src.pv)
        return PVModel("epw", tmy=tmy, info={**info, "format": "epw", "file": rel_path(files[0], src.root)})
    if w.format == "clear-sky":
        return PVModel("clear-sky")
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
    label = ", ".join(rel_path(f, src.root) for f in files)
    return PVModel("pv-csv", rows=m, resolution_min=resolution_minutes(m.index), label=label)


def pv_step_refusal(src: Sources, model: PVModel, minutes: int) -> str | None:
    """Why the PV source cannot give a step of ``minutes`` (:func:`pipeline.data.sources.step_refusal`), or None: the
    EPW year and the clear-sky model give any step, measured PV no step finer than its rows."""
    if model.format != "pv-csv":
        return None
    return step_refusal(src, "weather", minutes, model.resolution_min)


def pv_at(src: Sources, model: PVModel, index: pd.DatetimeIndex) -> tuple[np.ndarray, dict]:
    """The PV of :func:`read_pv` at the steps of ``index`` from ``model`` (:func:`load_pv`). The step is not checked
    against the measured PV's resolution (:func:`pv_step_refusal` does).

    Raises:
        SourceError: a step of ``index`` without a measured value (the first named).
    """
    cfg = src.config
    minutes = index_minutes(index)
    dt_h = minutes / 60.0
    if model.format == "epw":
        n = 60 // minutes
        hours = index[::n]
        hourly = map_tmy_to_calendar(model.tmy, hours)
        meta = model.info["metadata"]
        cap = src.pv.eta_inv_nom * (1.0 / src.pv.dc_ac_ratio)  # pvlib.inverter.pvwatts: pac0 = eta_inv_nom * pdc0
        pv, split = split_hours(hourly, index, meta["latitude"], meta["longitude"], meta["altitude"], cap)
        return pv, {**model.info, **split, "step_min": minutes, "step_peak_kw_per_kwp": float(pv.max())}
    if model.format == "clear-sky":
        w, p = src.weather, cfg.pv
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
            dt_h=dt_h,
        )
        return pv.to_numpy(np.float64), {**info, "format": "clear-sky", "step_min": minutes}
    m = model.rows
    mean = m["pv"].groupby(step_bins(m.index, index[0], minutes)).mean().reindex(np.arange(len(index)))
    mean = pd.Series(mean.to_numpy(), index=index)
    check_coverage(mean, index, cfg, f"PV column '{src.weather.value_column}'", model.label)
    return mean.to_numpy(np.float64), {
        "format": "pv-csv",
        "rows": len(m),
        "resolution_min": model.resolution_min,
        "step_min": minutes,
        "annual_kwh_per_kwp": float(mean.sum()) * dt_h,
        "peak_kw_per_kwp": float(mean.max()),
    }
