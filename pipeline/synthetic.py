"""Generate the processed data of the ``iquitos`` site: clear-sky PV, a constant grid factor, synthetic EV sessions.

The Iquitos (Peru) study this project grew from has no public session log, so its EV sessions are drawn,
with a seeded :class:`numpy.random.Generator`, from the fleet parameters stated in :data:`FLEETS` (every
figure there is an assumption, see ``envs/sites/iquitos/README.md``). The hourly table holds:

- ``pv_kw_per_kwp``: AC output of 1 kWp DC under pvlib's clear-sky model (Ineichen with pvlib's Linke
  turbidity climatology, ``pvlib.clearsky.lookup_linke_turbidity``) at lat -3.75, lon -73.25, altitude
  100 m, through the same PVWatts chain as the ``caltech`` site (:class:`pipeline.ingest.PVParams`), with
  the array tilted 10 degrees towards the equator (north);
- ``moer_kg_per_kwh`` and the forecasts ``moer_fc_h0..h2``: the constant grid factor 0.4521 kg CO2/kWh.

Written atomically (:mod:`envs.files`) into ``envs/sites/iquitos/``: ``hourly.parquet``,
``sessions.parquet`` and ``README.md``, after both tables pass :func:`envs.schemas.validate_site_data`.

Run ``python -m pipeline.synthetic --help``; ``python -m pipeline.synthetic`` rewrites the shipped files
(same seed, same bytes of data).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pvlib

from envs import files
from envs.schemas import UTC_NS, validate_site_data
from pipeline.ingest import PVParams, pvwatts_chain

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "envs" / "sites" / "iquitos"

LATITUDE = -3.75
"""Site latitude, degrees north (Iquitos, Loreto, Peru)."""
LONGITUDE = -73.25
"""Site longitude, degrees east."""
ALTITUDE_M = 100.0
"""Site altitude above sea level, m (Iquitos lies at about 100 m on the Amazon)."""
SITE_TZ = "America/Lima"
"""Local time zone (UTC-5, no daylight saving time)."""
START_LOCAL = "2023-01-01"
"""First local day of the generated year (inclusive)."""
END_LOCAL = "2024-01-01"
"""Local midnight ending the generated year (exclusive): 8,760 hours."""
SPLITS = {"train": ("2023-01-01", "2023-09-30"), "test": ("2023-10-01", "2023-12-31")}
"""Splits of the site config (inclusive local dates); only used for the summary written here."""
GRID_FACTOR_KG_PER_KWH = 0.4521
"""Constant grid emission factor of the study, kg CO2/kWh."""
SOCKET_KW = 3.3
"""Power of every socket, kW (the site config's ``ev.socket_kw``; used to count undeliverable requests)."""
SEED = 20230101
"""Seed of the shipped sessions."""

PV_PARAMS = PVParams(surface_tilt=10.0, surface_azimuth=0.0)
"""PVWatts chain of the caltech site, tilted 10 degrees to the north (the equator side at lat -3.75)."""
AIR_TEMP_C = 27.0
"""Constant air temperature for the cell-temperature model, deg C (assumption: Iquitos' annual mean is ~26-27 C)."""
WIND_SPEED_M_S = 1.0
"""Constant wind speed for the cell-temperature model, m/s (assumption)."""
ALBEDO = 0.2
"""Ground albedo (assumption: pvlib's default)."""
SUBSTEPS_PER_HOUR = 12
"""Clear-sky irradiance is computed every 5 minutes (at the middle of each) and averaged per hour."""


@dataclass(frozen=True)
class FleetParams:
    """Fleet parameters of one vehicle kind, from which its sessions are drawn (all figures assumptions).

    Per local day the number of sessions is Poisson with mean ``sessions_per_socket_day * n_sockets``.
    Each session: arrival local hour from a mixture of normals ``arrival_mix`` (weight, mean h, sd h; wrapped
    into [0, 24)), to the minute; energy ``battery_kwh * f`` with ``f ~ Beta(*energy_beta)`` clipped to
    ``energy_frac``; dwell (plugged-in time) log-normal with median ``dwell_median_h`` and log-sd
    ``dwell_sigma``, clipped to ``dwell_h``, to the minute. A session goes to a random socket of its kind that
    is free ``turnaround_h`` before its arrival; when none is, it is not generated (counted as dropped).
    """

    kind: str
    prefix: str
    n_sockets: int
    id_digits: int
    sessions_per_socket_day: float
    arrival_mix: tuple[tuple[float, float, float], ...]
    battery_kwh: float
    energy_beta: tuple[float, float]
    energy_frac: tuple[float, float]
    dwell_median_h: float
    dwell_sigma: float
    dwell_h: tuple[float, float]
    turnaround_h: float = 1.0

    def station_ids(self) -> list[str]:
        """Socket ids of this kind, e.g. ``MB-001`` .. ``MB-112``."""
        return [f"{self.prefix}-{i:0{self.id_digits}d}" for i in range(1, self.n_sockets + 1)]

    @property
    def energy_kwh(self) -> tuple[float, float]:
        """Bounds of the energy per session, kWh."""
        return (self.battery_kwh * self.energy_frac[0], self.battery_kwh * self.energy_frac[1])


FLEETS: tuple[FleetParams, ...] = (
    FleetParams(
        kind="motorbike",
        prefix="MB",
        n_sockets=112,
        id_digits=3,
        sessions_per_socket_day=1.5,
        arrival_mix=((0.35, 8.0, 1.0), (0.40, 13.0, 1.5), (0.25, 18.5, 1.5)),
        battery_kwh=2.9,
        energy_beta=(2.5, 2.0),
        energy_frac=(0.10, 0.95),
        dwell_median_h=3.0,
        dwell_sigma=0.5,
        dwell_h=(1.0, 10.0),
    ),
    FleetParams(
        kind="moto-taxi",
        prefix="MT",
        n_sockets=16,
        id_digits=2,
        sessions_per_socket_day=2.0,
        arrival_mix=((0.5, 13.0, 1.5), (0.5, 21.0, 1.5)),
        battery_kwh=7.2,
        energy_beta=(2.5, 2.0),
        energy_frac=(0.10, 0.95),
        dwell_median_h=2.5,
        dwell_sigma=0.4,
        dwell_h=(1.0, 8.0),
    ),
)
"""The Iquitos fleet: 112 motorbike and 16 moto-taxi sockets (the study's counts); the rest are assumptions."""


# ------------------------------------------------------------------------------------------------- PV


def hourly_index(start_local: str = START_LOCAL, end_local: str = END_LOCAL, tz: str = SITE_TZ) -> pd.DatetimeIndex:
    """UTC hour starts from local midnight ``start_local`` (inclusive) to ``end_local`` (exclusive)."""
    start = pd.Timestamp(start_local).tz_localize(tz).tz_convert("UTC")
    end = pd.Timestamp(end_local).tz_localize(tz).tz_convert("UTC")
    return pd.date_range(start, end, freq="h", inclusive="left")


def clear_sky_pv_kw_per_kwp(index: pd.DatetimeIndex, params: PVParams = PV_PARAMS) -> tuple[pd.Series, dict]:
    """Clear-sky AC output of 1 kWp DC of PV at Iquitos, as hourly means.

    For every 5-minute sub-step (at its middle): solar position (``pvlib.location.Location(LATITUDE,
    LONGITUDE, SITE_TZ, ALTITUDE_M)``), clear-sky GHI/DNI/DHI from ``Location.get_clearsky(model="ineichen")``
    with the Linke turbidity of ``pvlib.clearsky.lookup_linke_turbidity`` (pvlib's monthly climatology file
    ``LinkeTurbidities.h5``, interpolated to the day), plane-of-array irradiance
    (``pvlib.irradiance.get_total_irradiance``, ``params`` tilt/azimuth/sky-diffuse model, albedo
    :data:`ALBEDO`), SAPM cell temperature at :data:`AIR_TEMP_C` and :data:`WIND_SPEED_M_S`, PVWatts DC
    (pdc0 = 1 kW, ``gamma_pdc``), DC losses ``system_losses_pct``, PVWatts inverter (``pdc0 = 1 /
    dc_ac_ratio`` kW, ``eta_inv_nom``), floored at 0; then the mean over the hour's sub-steps.

    Args:
        index: UTC hour starts (tz-aware DatetimeIndex).
        params: PV model parameters.

    Returns:
        ``(pv, info)``: ``pv`` is a float64 Series on ``index``, kW AC per kWp DC (hour mean); ``info`` has
        ``annual_kwh_per_kwp`` (sum over ``index``, kWh/kWp), ``annual_ghi_kwh_per_m2``,
        ``annual_poa_kwh_per_m2`` and ``linke_turbidity_range`` (min, max).

    Raises:
        ValueError: ``index`` is not tz-aware.
    """
    if index.tz is None:
        raise ValueError("index must be tz-aware (UTC hour starts)")
    n = SUBSTEPS_PER_HOUR
    offsets = pd.to_timedelta((np.arange(n) + 0.5) * 60.0 / n, unit="min")
    fine = pd.DatetimeIndex((index.tz_convert(None).to_numpy()[:, None] + offsets.to_numpy()[None, :]).ravel()).tz_localize("UTC")
    loc = pvlib.location.Location(LATITUDE, LONGITUDE, tz=SITE_TZ, altitude=ALTITUDE_M, name="Iquitos")
    solpos = loc.get_solarposition(fine)
    linke = pvlib.clearsky.lookup_linke_turbidity(fine, LATITUDE, LONGITUDE)
    cs = loc.get_clearsky(fine, model="ineichen", solar_position=solpos, linke_turbidity=linke)
    dni_extra = pvlib.irradiance.get_extra_radiation(fine)
    poa_global, _, pac = pvwatts_chain(
        params, solpos, cs["dni"], cs["ghi"], cs["dhi"], dni_extra, ALBEDO, AIR_TEMP_C, WIND_SPEED_M_S
    )
    hourly = pd.Series(pac.reshape(len(index), n).mean(axis=1), index=index)
    info = {
        "annual_kwh_per_kwp": float(hourly.sum()),
        "annual_ghi_kwh_per_m2": float(np.asarray(cs["ghi"]).reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "annual_poa_kwh_per_m2": float(poa_global.to_numpy().reshape(len(index), n).mean(axis=1).sum() / 1000.0),
        "linke_turbidity_range": (float(linke.min()), float(linke.max())),
    }
    return hourly, info


def build_hourly(index: pd.DatetimeIndex | None = None) -> tuple[pd.DataFrame, dict]:
    """The ``hourly`` table (schema :data:`envs.schemas.HOURLY_SCHEMA`) of the Iquitos year and the PV info.

    Columns: ``time`` (datetime64[ns, UTC]), ``pv_kw_per_kwp`` (float32, :func:`clear_sky_pv_kw_per_kwp`),
    ``moer_kg_per_kwh`` and ``moer_fc_h0..h2`` (float32, all :data:`GRID_FACTOR_KG_PER_KWH`).
    """
    index = hourly_index() if index is None else index
    pv, info = clear_sky_pv_kw_per_kwp(index)
    df = pd.DataFrame({"time": pd.Series(index, dtype=UTC_NS), "pv_kw_per_kwp": pv.to_numpy(np.float32)})
    for c in ("moer_kg_per_kwh", "moer_fc_h0", "moer_fc_h1", "moer_fc_h2"):
        df[c] = np.full(len(df), GRID_FACTOR_KG_PER_KWH, dtype=np.float32)
    return df, info


# -------------------------------------------------------------------------------------------- sessions


def generate_sessions(
    seed: int = SEED,
    start_local: str = START_LOCAL,
    end_local: str = END_LOCAL,
    fleets: tuple[FleetParams, ...] = FLEETS,
    tz: str = SITE_TZ,
) -> tuple[pd.DataFrame, dict]:
    """Draw the synthetic EV sessions of every local day in ``[start_local, end_local)``.

    Reproducible: the same arguments give identical frames (one ``numpy.random.default_rng(seed)`` drawn in a
    fixed order: per fleet, per day). See :class:`FleetParams` for the distributions.

    Returns:
        ``(sessions, stats)``. ``sessions`` follows :data:`envs.schemas.SESSIONS_SCHEMA`, sorted by arrival
        then id: ``session_id`` (str ``IQ-000001``...), ``station_id`` (str socket id of the vehicle's kind),
        ``arrival``/``departure`` (datetime64[ns, UTC], whole minutes), ``energy_kwh`` and
        ``requested_energy_kwh`` (float32, kWh, equal: a synthetic session's need is its delivered energy),
        plus ``kind`` (str, ``motorbike``/``moto-taxi``). On each socket a session arrives at least
        ``turnaround_h`` after the previous one left. ``stats`` per kind: ``drawn``, ``dropped`` (no free
        socket), ``kept``, ``energy_kwh``, ``over_socket_kwh`` (sessions whose energy exceeds
        ``dwell * SOCKET_KW``).

    Raises:
        ValueError: an empty period or a fleet with no socket.
    """
    rng = np.random.default_rng(seed)
    days = pd.date_range(start_local, end_local, freq="D", inclusive="left")
    if len(days) == 0:
        raise ValueError(f"empty period {start_local}..{end_local}")
    frames = []
    stats: dict[str, dict] = {}
    for fleet in fleets:
        if fleet.n_sockets < 1:
            raise ValueError(f"fleet {fleet.kind!r} has no socket")
        counts = rng.poisson(fleet.sessions_per_socket_day * fleet.n_sockets, size=len(days))
        n = int(counts.sum())
        day = np.repeat(np.arange(len(days)), counts)
        w = np.array([m[0] for m in fleet.arrival_mix])
        comp = rng.choice(len(w), size=n, p=w / w.sum())
        mu = np.array([m[1] for m in fleet.arrival_mix])[comp]
        sd = np.array([m[2] for m in fleet.arrival_mix])[comp]
        hour = np.mod(rng.normal(mu, sd), 24.0)
        arrival_min = day * 1440 + np.floor(hour * 60.0).astype(np.int64)
        dwell_h = np.clip(rng.lognormal(np.log(fleet.dwell_median_h), fleet.dwell_sigma, size=n), *fleet.dwell_h)
        dwell_min = np.round(dwell_h * 60.0).astype(np.int64)
        frac = np.clip(rng.beta(*fleet.energy_beta, size=n), *fleet.energy_frac)
        energy = np.round(fleet.battery_kwh * frac, 3)
        socket_pick = rng.random(n)
        order = np.argsort(arrival_min, kind="stable")
        free_at = np.full(fleet.n_sockets, np.iinfo(np.int64).min // 2)  # minute each socket may take a car again
        gap = int(round(fleet.turnaround_h * 60))
        socket = np.full(n, -1, dtype=np.int64)
        for j in order:  # one pass over the sessions at generation time
            free = np.flatnonzero(free_at <= arrival_min[j])
            if len(free) == 0:
                continue
            k = free[min(int(socket_pick[j] * len(free)), len(free) - 1)]
            socket[j] = k
            free_at[k] = arrival_min[j] + dwell_min[j] + gap
        ok = socket >= 0
        ids = np.array(fleet.station_ids())
        t0 = pd.Timestamp(start_local).tz_localize(tz)
        arr = t0 + pd.to_timedelta(arrival_min[ok], unit="min")
        frames.append(
            pd.DataFrame(
                {
                    "station_id": ids[socket[ok]],
                    "arrival": arr.tz_convert("UTC"),
                    "departure": (arr + pd.to_timedelta(dwell_min[ok], unit="min")).tz_convert("UTC"),
                    "energy_kwh": energy[ok].astype(np.float32),
                    "kind": fleet.kind,
                    "_dwell_h": dwell_min[ok] / 60.0,
                }
            )
        )
        stats[fleet.kind] = {
            "drawn": n,
            "dropped": int((~ok).sum()),
            "kept": int(ok.sum()),
            "energy_kwh": float(energy[ok].sum()),
            "over_socket": int((energy[ok] > dwell_min[ok] / 60.0 * SOCKET_KW).sum()),
        }
    s = pd.concat(frames, ignore_index=True)
    s = s.sort_values(["arrival", "station_id"], kind="stable").reset_index(drop=True)
    s.insert(0, "session_id", [f"IQ-{i:06d}" for i in range(1, len(s) + 1)])
    s["requested_energy_kwh"] = s["energy_kwh"]
    s["arrival"] = s["arrival"].astype(UTC_NS)
    s["departure"] = s["departure"].astype(UTC_NS)
    s = s.drop(columns="_dwell_h")
    cols = ["session_id", "station_id", "arrival", "departure", "energy_kwh", "requested_energy_kwh", "kind"]
    return s[cols], stats


# ---------------------------------------------------------------------------------------------- output


def split_summary(hourly: pd.DataFrame, sessions: pd.DataFrame, tz: str = SITE_TZ) -> list[dict]:
    """Per split of :data:`SPLITS`: :func:`pipeline.ingest.split_summary` with this site's splits (hours,
    sessions by arrival, energy kWh, PV kWh/kWp, mean MOER, sessions per kind)."""
    from pipeline import ingest

    return ingest.split_summary(hourly, sessions, tz, SPLITS)


def _fleet_rows() -> str:
    rows = ["| parameter | motorbike | moto-taxi |", "| --- | --- | --- |"]
    mb, mt = FLEETS

    def mix(f: FleetParams) -> str:
        return "; ".join(f"{w:.0%} at {m:g} h (sd {s:g} h)" for w, m, s in f.arrival_mix)

    def beta(f: FleetParams) -> str:
        lo, hi = f.energy_kwh
        return f"{f.battery_kwh:g} kWh x Beta{f.energy_beta} clipped to [{f.energy_frac[0]:g}, {f.energy_frac[1]:g}] = {lo:.2f}..{hi:.2f} kWh"

    for label, get in (
        ("sockets (ids)", lambda f: f"{f.n_sockets} (`{f.station_ids()[0]}`..`{f.station_ids()[-1]}`)"),
        ("sessions per socket per day (Poisson mean)", lambda f: f"{f.sessions_per_socket_day:g}"),
        ("arrival, local hour (mixture of normals, wrapped to 0..24 h)", mix),
        ("battery (usable), kWh", lambda f: f"{f.battery_kwh:g}"),
        ("energy per session", beta),
        ("dwell (log-normal)", lambda f: f"median {f.dwell_median_h:g} h, log-sd {f.dwell_sigma:g}, clipped to {f.dwell_h[0]:g}..{f.dwell_h[1]:g} h"),
        ("turnaround on a socket", lambda f: f"{f.turnaround_h:g} h"),
    ):
        rows.append(f"| {label} | {get(mb)} | {get(mt)} |")
    return "\n".join(rows)


def render_readme(hourly: pd.DataFrame, sessions: pd.DataFrame, pv_info: dict, stats: dict, seed: int) -> str:
    """The provenance README of ``envs/sites/iquitos/`` (Markdown)."""
    p = PV_PARAMS
    lt = pv_info["linke_turbidity_range"]
    days = (hourly.time.iloc[-1] - hourly.time.iloc[0]).days + 1
    kinds = "\n".join(
        f"| {k} | {v['drawn']:,} | {v['dropped']:,} | {v['kept']:,} | {v['energy_kwh']:,.0f} | {v['energy_kwh'] / days:,.1f} | {v['over_socket']:,} |"
        for k, v in stats.items()
    )
    splits = "\n".join(
        f"| {s['split']} | {s['dates']} | {s['hours']:,} | {s['sessions']:,} | "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_kind"].items()))
        + f" | {s['energy_kwh']:,.0f} | {s['pv_kwh_per_kwp']:,.0f} |"
        for s in split_summary(hourly, sessions)
    )
    ev_day = sum(v["energy_kwh"] for v in stats.values()) / days
    pv_day = pv_info["annual_kwh_per_kwp"] * 4050.0 / days
    return f"""# Processed data of the `iquitos` site (synthetic EV sessions)

Written by `python -m pipeline.synthetic` (seed {seed}); do not edit by hand. Rerunning it rewrites the same data.

**The EV sessions are synthetic.** No session log of the Iquitos study is public; the sessions are drawn from the
fleet parameters below, every one of which is an assumption of this project (the socket counts, 112 motorbike and
16 moto-taxi, are the study's). The PV profile is a clear-sky model (every day cloudless), and the grid factor is a
constant. Results on this site show what the controllers do with the study's sizing, not measured behaviour.

## Running the study on this site

`doit run pipeline site=iquitos` (or `EVHUB_SITE=iquitos doit run pipeline`) runs the whole study on this site
and writes its own report to `outputs/iquitos/report/report.md` (`experiment=NAME` and `output_dir=DIR` change
the folder; see `pipeline/config.py`). The report's title and a note under it say that the EV sessions are
synthetic, and a second note that with the constant grid factor CO2 follows grid import.

## Sources

- Site sizing (128 sockets: 112 motorbike, 16 moto-taxi; 4,050 kWp PV; 4,520 kWh BESS; grid factor
  0.4521 kg CO2/kWh): the Iquitos study this project grew from (see `../iquitos.toml`).
- Clear-sky irradiance: pvlib python (Holmgren, Hansen, Mikofski, *J. Open Source Software* 3(29), 884, 2018),
  version {pvlib.__version__}: `pvlib.clearsky.ineichen` (P. Ineichen, R. Perez, "A new airmass independent
  formulation for the Linke turbidity coefficient", *Solar Energy* 73(3), 151-157, 2002) with the Linke
  turbidity from `pvlib.clearsky.lookup_linke_turbidity`, pvlib's monthly climatology file `LinkeTurbidities.h5`
  (SoDa service, Remund et al. 2003), interpolated to the day: {lt[0]:.2f}..{lt[1]:.2f} at this site.

## `hourly.parquet`

One row per UTC hour, {len(hourly):,} rows, from {hourly.time.iloc[0]} ({START_LOCAL} 00:00 {SITE_TZ}) to
{hourly.time.iloc[-1]} inclusive; {SITE_TZ} is UTC-5 all year (no daylight saving time). zstd-compressed Parquet.

| column | dtype | unit | derivation |
| --- | --- | --- | --- |
| `time` | datetime64[ns, UTC] | - | start of the hour |
| `pv_kw_per_kwp` | float32 | kW AC per kWp DC | clear-sky AC output of 1 kWp, mean over the hour (below) |
| `moer_kg_per_kwh` | float32 | kg CO2/kWh | constant grid factor {GRID_FACTOR_KG_PER_KWH} |
| `moer_fc_h0`, `moer_fc_h1`, `moer_fc_h2` | float32 | kg CO2/kWh | the same constant (a constant is its own perfect forecast) |

With a constant grid factor, CO2 is proportional to grid import (0.4521 kg per kWh imported): the only way to cut
it is to import less, so the report's unserved energy must be read beside it.

PV (per kWp DC; pvlib functions):

1. `pvlib.location.Location({LATITUDE}, {LONGITUDE}, tz="{SITE_TZ}", altitude={ALTITUDE_M:g})`; every 5-minute
   sub-step (at its middle) gets solar position and Ineichen clear-sky GHI/DNI/DHI
   (`Location.get_clearsky(model="ineichen")`, Linke turbidity from `lookup_linke_turbidity`).
2. Plane of array: `pvlib.irradiance.get_total_irradiance`, tilt {p.surface_tilt:g} deg, azimuth {p.surface_azimuth:g} deg
   (north: the equator side at lat {LATITUDE}; 10 deg rather than |lat| = 3.75 deg so that rain washes the
   modules, at a yield cost below 1%), sky diffuse `{p.transposition}`, albedo {ALBEDO:g} (assumption).
3. Cell temperature: `pvlib.temperature.sapm_cell`, SAPM `{p.temperature_model}`, constant air temperature
   {AIR_TEMP_C:g} C and wind {WIND_SPEED_M_S:g} m/s (assumptions: clear-sky data carry no weather).
4. DC: `pvlib.pvsystem.pvwatts_dc`, pdc0 = 1 kW, gamma_pdc = {p.gamma_pdc}/K; DC losses {p.system_losses_pct:.2f}%
   (`pvlib.pvsystem.pvwatts_losses()` defaults).
5. AC: `pvlib.inverter.pvwatts`, eta_inv_nom = {p.eta_inv_nom}, DC/AC ratio {p.dc_ac_ratio} (AC capped at
   {p.eta_inv_nom / p.dc_ac_ratio:.3f} kW/kWp), floored at 0; then the mean of the hour's 12 sub-steps.

Clear-sky annual yield: **{pv_info['annual_kwh_per_kwp']:,.0f} kWh AC per kWp** (clear-sky GHI
{pv_info['annual_ghi_kwh_per_m2']:,.0f} kWh/m2, plane of array {pv_info['annual_poa_kwh_per_m2']:,.0f} kWh/m2). Real
years are cloudier; this is an upper bound of what the array can give. At 4,050 kWp it is about
{pv_day:,.0f} kWh per day, against about {ev_day:,.0f} kWh per day of EV energy below.

## `sessions.parquet`

One row per session, {len(sessions):,} rows, sorted by arrival (then socket id); columns of the sessions schema plus
`kind`:

| column | dtype | unit | derivation |
| --- | --- | --- | --- |
| `session_id` | str | - | `IQ-000001`... in arrival order |
| `station_id` | str | - | socket id: `MB-001`..`MB-112` (motorbike), `MT-01`..`MT-16` (moto-taxi) |
| `arrival` | datetime64[ns, UTC] | - | drawn local arrival (to the minute), converted to UTC |
| `departure` | datetime64[ns, UTC] | - | arrival + drawn dwell (to the minute) |
| `energy_kwh` | float32 | kWh | drawn energy need of the session (to the Wh) |
| `requested_energy_kwh` | float32 | kWh | equal to `energy_kwh` |
| `kind` | str | - | `motorbike` or `moto-taxi` |

Fleet parameters (`pipeline.synthetic.FLEETS`; all assumptions except the socket counts: typical pack sizes of
72 V electric motorbikes, about 40 Ah, and of electric three-wheel moto-taxis, about 100 Ah; drivers charging in the
morning, at midday and in the evening, moto-taxis at midday and at night after their shift):

{_fleet_rows()}

Per local day and kind the number of sessions is Poisson; each session goes to a random socket of its kind that is
free one turnaround before its arrival, so no socket ever holds two sessions (also after the environment rounds
times to whole hours: a socket's next arrival is at least 2 h after its previous arrival and 1 h after its
departure). A session that finds every socket of its kind busy is not generated (dropped below).
Every socket is {SOCKET_KW:g} kW (the config's `ev.socket_kw`): one power for both kinds, because the environment has
a single socket power; 220 V x 15 A single-phase on Peru's 220 V / 60 Hz supply (assumption). It suits a moto-taxi;
a motorbike's on-board charger often draws only 1-2 kW, so for motorbikes it overstates the charging power a
controller can use (an assumption to revisit if per-kind socket power is added to the environment). The last column counts sessions whose energy exceeds
dwell x {SOCKET_KW:g} kW, i.e. that no controller could serve in full.

| kind | drawn | dropped (no free socket) | kept | energy kWh | kWh per day | energy > dwell x {SOCKET_KW:g} kW |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
{kinds}

## Default splits (inclusive local dates, {SITE_TZ})

| split | dates | hours | sessions (by arrival) | by kind | energy kWh | PV kWh/kWp |
| --- | --- | ---: | ---: | --- | ---: | ---: |
{splits}
"""


def generate(out_dir: str | Path = DEFAULT_OUT_DIR, seed: int = SEED) -> dict:
    """Build, validate and write ``hourly.parquet``, ``sessions.parquet`` and ``README.md`` into ``out_dir``.

    Returns:
        Summary dict: ``paths``, ``annual_kwh_per_kwp``, per-kind session ``stats`` and the ``splits`` summary.

    Raises:
        envs.schemas.DataValidationError: a generated table breaks the schemas (nothing is written then).
    """
    out_dir = Path(out_dir)
    hourly, pv_info = build_hourly()
    sessions, stats = generate_sessions(seed)
    paths = {"hourly": out_dir / "hourly.parquet", "sessions": out_dir / "sessions.parquet", "readme": out_dir / "README.md"}
    validate_site_data(hourly, sessions, {k: str(v) for k, v in paths.items()})
    readme = render_readme(hourly, sessions, pv_info, stats, seed)
    files.write_parquet(hourly, paths["hourly"], compression="zstd")
    files.write_parquet(sessions, paths["sessions"], compression="zstd")
    files.write_text(paths["readme"], readme)
    return {"paths": paths, "annual_kwh_per_kwp": pv_info["annual_kwh_per_kwp"], "stats": stats, "splits": split_summary(hourly, sessions)}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m pipeline.synthetic [--out-dir DIR] [--seed N]``."""
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.synthetic",
        description="Generate the iquitos site data: clear-sky PV, constant grid factor, synthetic EV sessions.",
    )
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="output folder (default: envs/sites/iquitos)")
    ap.add_argument("--seed", type=int, default=SEED, help="seed of the sessions (default: %(default)s)")
    a = ap.parse_args(argv)
    summary = generate(a.out_dir, a.seed)
    print(f"PV clear-sky yield {summary['annual_kwh_per_kwp']:,.0f} kWh/kWp/yr")
    for kind, st in summary["stats"].items():
        print(f"  {kind}: {st}")
    for s in summary["splits"]:
        print(f"  split {s['split']} {s['dates']}: {s['hours']:,} h, {s['sessions']:,} sessions, {s['energy_kwh']:,.0f} kWh")
    for k, p in summary["paths"].items():
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
