"""Synthetic EV sessions drawn from stated fleet parameters: the ``fleet`` sessions source of a site TOML.

A site without a session log states its fleets in its TOML (a shipped example: ``envs/sites/iquitos.toml``)::

    [sources.sessions]
    format = "fleet"
    seed = 12345                    # one numpy Generator, drawn in a fixed order: same seed, same sessions
    session_id_prefix = "EV"        # session ids EV-000001, EV-000002, ... in arrival order

    [[sources.sessions.fleet]]      # one table per vehicle kind (keys: the fields of FleetParams)
    kind = "scooter"
    station_prefix = "SC"
    ...

:mod:`pipeline.data.sources` parses those tables into :class:`FleetParams` (every key is required except
``turnaround_h``; a missing or unknown key is an error naming the TOML and the dotted key) and
:func:`generate_sessions` draws the sessions over the site's period (see :func:`pipeline.data.sources.period`).
Nothing here knows a site: every number comes from the TOML.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from envs.schemas import UTC_NS


@dataclass(frozen=True)
class FleetParams:
    """Fleet parameters of one vehicle kind, from which its sessions are drawn.

    Per local day the number of sessions is Poisson with mean ``sessions_per_socket_day * n_sockets``.
    Each session: arrival local hour from a mixture of normals ``arrival_mix`` (weight, mean h, sd h; wrapped
    into [0, 24)), to the minute; energy ``battery_kwh * f`` with ``f ~ Beta(*energy_beta)`` clipped to
    ``energy_frac``, to the Wh; dwell (plugged-in time) log-normal with median ``dwell_median_h`` and log-sd
    ``dwell_sigma``, clipped to ``dwell_h``, to the minute. A session goes to a random socket of its kind that
    is free ``turnaround_h`` before its arrival; when none is, it is not generated (counted as dropped).
    """

    kind: str
    """Vehicle kind, written to the sessions' ``kind`` column (e.g. "scooter")."""
    station_prefix: str
    """Socket ids are ``<station_prefix>-<number>``, numbered from 1."""
    n_sockets: int
    """Sockets of this kind, >= 1."""
    station_id_digits: int
    """Digits of the socket number, zero-padded (``SC-001``: 3)."""
    sessions_per_socket_day: float
    """Mean sessions per socket and local day (Poisson), > 0."""
    arrival_mix: tuple[tuple[float, float, float], ...]
    """Arrival local hour: ``(weight, mean_h, sd_h)`` normals; weights are normalised."""
    battery_kwh: float
    """Usable battery energy, kWh."""
    energy_beta: tuple[float, float]
    """Beta(a, b) of the fraction of the battery charged per session."""
    energy_frac: tuple[float, float]
    """Clip of that fraction, (low, high) in [0, 1]."""
    dwell_median_h: float
    """Median plugged-in time, hours."""
    dwell_sigma: float
    """Log-sd of the plugged-in time."""
    dwell_h: tuple[float, float]
    """Clip of the plugged-in time, hours (low, high)."""
    turnaround_h: float = 1.0
    """Minimum time between a departure and the next arrival on a socket, hours."""

    def station_ids(self) -> list[str]:
        """Socket ids of this kind, e.g. ``SC-001`` .. ``SC-040``."""
        return [f"{self.station_prefix}-{i:0{self.station_id_digits}d}" for i in range(1, self.n_sockets + 1)]

    @property
    def energy_kwh(self) -> tuple[float, float]:
        """Bounds of the energy per session, kWh."""
        return (self.battery_kwh * self.energy_frac[0], self.battery_kwh * self.energy_frac[1])


def generate_sessions(
    fleets: tuple[FleetParams, ...],
    seed: int,
    start_local: str,
    end_local: str,
    tz: str,
    session_id_prefix: str = "S",
) -> tuple[pd.DataFrame, dict]:
    """Draw the synthetic EV sessions of every local day in ``[start_local, end_local)``.

    Reproducible: the same arguments give identical frames (one ``numpy.random.default_rng(seed)`` drawn in a
    fixed order: per fleet, per day). Times are drawn as local wall-clock times of ``tz`` and converted to UTC
    (on a day when clocks go back, a repeated local time is read as its first occurrence; a local time that
    does not exist when clocks go forward moves forward to the first that does). See :class:`FleetParams`
    for the distributions.

    Args:
        fleets: one :class:`FleetParams` per vehicle kind.
        seed: seed of the generator.
        start_local, end_local: first local date (inclusive) and local midnight ending the period (exclusive),
            ``YYYY-MM-DD``.
        tz: IANA time zone of the local times.
        session_id_prefix: session ids are ``<prefix>-000001``... in arrival order.

    Returns:
        ``(sessions, stats)``. ``sessions`` follows :data:`envs.schemas.SESSIONS_SCHEMA`, sorted by arrival
        then station: ``session_id`` (str), ``station_id`` (str socket id of the vehicle's kind),
        ``arrival``/``departure`` (datetime64[ns, UTC], whole minutes), ``energy_kwh`` and
        ``requested_energy_kwh`` (float32, kWh, equal: a synthetic session's need is its delivered energy),
        plus ``kind`` (str). On each socket a session arrives at least ``turnaround_h`` after the previous one
        left. ``stats`` per kind: ``drawn``, ``dropped`` (no free socket), ``kept``, ``energy_kwh``.

    Raises:
        ValueError: an empty period, no fleet, or a fleet with no socket.
    """
    rng = np.random.default_rng(seed)
    days = pd.date_range(start_local, end_local, freq="D", inclusive="left")
    if len(days) == 0:
        raise ValueError(f"empty period {start_local}..{end_local}")
    if not fleets:
        raise ValueError("no fleet to draw sessions from")
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
        wall = pd.DatetimeIndex(pd.Timestamp(start_local) + pd.to_timedelta(arrival_min[ok], unit="min"))
        arr = wall.tz_localize(tz, ambiguous=np.ones(len(wall), dtype=bool), nonexistent="shift_forward")
        frames.append(
            pd.DataFrame(
                {
                    "station_id": ids[socket[ok]],
                    "arrival": arr.tz_convert("UTC"),
                    "departure": (arr + pd.to_timedelta(dwell_min[ok], unit="min")).tz_convert("UTC"),
                    "energy_kwh": energy[ok].astype(np.float32),
                    "kind": fleet.kind,
                }
            )
        )
        stats[fleet.kind] = {
            "drawn": n,
            "dropped": int((~ok).sum()),
            "kept": int(ok.sum()),
            "energy_kwh": float(energy[ok].sum()),
        }
    s = pd.concat(frames, ignore_index=True)
    s = s.sort_values(["arrival", "station_id"], kind="stable").reset_index(drop=True)
    s.insert(0, "session_id", [f"{session_id_prefix}-{i:06d}" for i in range(1, len(s) + 1)])
    s["requested_energy_kwh"] = s["energy_kwh"]
    s["arrival"] = s["arrival"].astype(UTC_NS)
    s["departure"] = s["departure"].astype(UTC_NS)
    cols = ["session_id", "station_id", "arrival", "departure", "energy_kwh", "requested_energy_kwh", "kind"]
    return s[cols], stats
