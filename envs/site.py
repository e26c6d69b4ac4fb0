"""The site model: a site config plus its processed data, turned into per-split arrays.

A *site* is a config file such as ``envs/sites/caltech.toml`` (its schema, reading and checks: :mod:`envs.config`)
and a data folder beside it holding ``series_<m>min.parquet`` (one row per UTC step of ``m`` minutes, the site's
``dt_h``; :func:`series_file`) and ``sessions.parquet`` (one row per EV session at its minute timestamps); see
``envs/sites/caltech/README.md`` for the columns and their sources. :func:`load_site` reads both; :meth:`Site.split`
cuts one split out of it and precomputes everything the environment, the KPIs and the oracle need, as NumPy arrays, so
that they all see exactly the same discretisation. :meth:`Site.physics_split` cuts the same split at the finer step of
the site simulation every controller is also scored on (:data:`envs.timestep.PHYSICS_DT_H`, 5 minutes) from the
series at that step (``series_5min.parquet``, its physics columns at least).

Sessions at a step of ``dt`` hours: arrival and departure each go to the nearest step boundary (``rint`` of the time
since the split's start over ``dt``; half-way rounds to the even step), the departure at least one step after the
arrival; a session arriving in the split's last step keeps that step, a departure past the split's end moves to it.
Each session's need is its delivered energy capped at what its socket delivers at full power over its stay in steps
(``kw * dt * (departure_step - arrival_step)``).

Units: power kW, energy kWh, carbon intensity kg CO2/kWh, time steps of ``dt_h`` hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from envs import timestep
from envs.config import ConfigError, SiteConfig, load_config


@dataclass
class SplitData:
    """One split of a site, discretised into ``T`` steps of ``dt_h`` hours (all arrays NumPy).

    Exogenous series, shape ``(T,)`` float64 unless noted:
        time: ``pd.DatetimeIndex`` (UTC) of step starts.
        pv_kw: available AC PV power, kW (``pv_kw_per_kwp * pv.kwp``), mean over the step.
        load_kw: non-EV site load, kW.
        moer: carbon intensity of grid import during the step, kg CO2/kWh (the MOER's mean over the step).
        moer_fc: ``(T, 3)`` MOER forecasts issued at the step start for the hour from it, the next hour and the one
            after (leads in hours at every step; at hourly steps: steps t, t+1, t+2), kg/kWh; None in a physics split
            (:meth:`Site.physics_split`), which carries no forecast.
        moer_5min: ``(T, 14)`` what a 5-minute carbon source says at the step start (the series columns
            :data:`envs.schemas.MOER_5MIN_COLUMNS`, in order), kg/kWh; None where the site's data lack them.
        time_features: ``(T, 4)`` sin/cos of local hour of day and of local day of week.

    Sessions (one row per session arriving in the split, length ``S``):
        sessions: DataFrame with ``session_id, station_id, arrival_step, departure_step, socket,
            energy_kwh`` (delivered energy in the data), ``need_kwh`` (what the env asks to deliver: the
            data's energy capped at what the socket can deliver between arrival and departure step),
            ``rejected`` (bool: no free socket at arrival).
        Departures after the split's end are moved to ``T`` (the end).

    Per-step arrival tables, shape ``(T, n_sockets)``:
        arrival_need_kwh: energy need of the session plugging into socket i at step t (0 if none).
        arrival_stay_steps: its number of steps until departure (int64; 0 if none).

    Sockets:
        socket_kw: ``(n_sockets,)`` float64, each socket's maximum charging power, kW
            (:meth:`EVConfig.socket_kw_array`): what the env, the oracle and the MPC cap each socket at.
    """

    config: SiteConfig
    split: str
    time: pd.DatetimeIndex
    pv_kw: np.ndarray
    load_kw: np.ndarray
    moer: np.ndarray
    moer_fc: np.ndarray | None
    time_features: np.ndarray
    sessions: pd.DataFrame
    arrival_need_kwh: np.ndarray
    arrival_stay_steps: np.ndarray
    socket_kw: np.ndarray
    moer_5min: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        """Number of steps ``T`` in the split."""
        return len(self.time)

    @property
    def dt_h(self) -> float:
        """The step, hours (the config's ``dt_h``)."""
        return self.config.dt_h

    @property
    def capped_kwh(self) -> float:
        """EV energy in the data above what the sockets could deliver in the stays, kWh (accepted sessions)."""
        s = self.sessions[~self.sessions.rejected]
        return float((s.energy_kwh - s.need_kwh).sum())

    def local_midnights(self) -> np.ndarray:
        """The steps that start a local day (00:00 in the config's ``timezone``): ``(M,)`` int64, ascending."""
        local = self.time.tz_convert(self.config.timezone)
        return np.flatnonzero((local.hour == 0) & (local.minute == 0))

    def last_midnight(self, t: int) -> int:
        """The step of the last local midnight at or before step ``t`` (:meth:`local_midnights`); 0, the split's
        first step, when there is none."""
        m = self.local_midnights()
        m = m[m <= t]
        return int(m[-1]) if len(m) else 0

    def weekend(self, n: int | None = None) -> np.ndarray:
        """Whether each of steps ``0 .. n-1`` starts on a local Saturday or Sunday (the config's ``timezone``): ``(n,)``
        bool; ``n`` defaults to the split's ``T`` and may run past its end (the clock continues in steps of
        ``dt_h``)."""
        n = self.num_steps if n is None else int(n)
        step = pd.Timedelta(timestep.step_timedelta(self.config.dt_h))
        extra = self.time[-1] + step * np.arange(1, max(n - self.num_steps, 0) + 1)
        local = self.time.append(pd.DatetimeIndex(extra))[:n].tz_convert(self.config.timezone)
        return np.asarray(local.day_of_week >= 5)


@dataclass
class Site:
    """A site config with its processed data frames (see module docstring).

    Attributes:
        config: the checked :class:`SiteConfig`.
        series: DataFrame, one row per UTC step of ``config.dt_h``: ``time`` (UTC), ``pv_kw_per_kwp``,
            ``moer_kg_per_kwh``, ``moer_fc_h0``, ``moer_fc_h1``, ``moer_fc_h2``
            [, :data:`envs.schemas.MOER_5MIN_COLUMNS`].
        sessions: DataFrame, one row per EV session: ``session_id``, ``station_id``, ``arrival`` and
            ``departure`` (UTC), ``energy_kwh``.
        source: where each piece came from (``{"config": path, "series": path, "sessions": path}``, and
            ``"physics"``: the series at :data:`envs.timestep.PHYSICS_DT_H` where :func:`load_site` found one).

    Raises:
        ConfigError: on construction, a session's station matches no ``[[ev.sockets]]`` group (see
            :meth:`station_groups`).
    """

    config: SiteConfig
    series: pd.DataFrame
    sessions: pd.DataFrame
    source: dict[str, str] = field(default_factory=dict)
    physics_series: pd.DataFrame | None = field(default=None, repr=False)
    """The series at :data:`envs.timestep.PHYSICS_DT_H` (its physics columns at least), read on first use from
    ``source["physics"]`` when not given; the series itself when the site steps at that step."""
    _splits: dict[str, SplitData] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.station_groups()  # a station without a socket group is an error before anything runs

    def station_groups(self) -> dict[str, int]:
        """Index into ``config.ev.groups`` of the group serving each station of the sessions (the first group,
        in the file's order, with a matching ``stations`` pattern).

        Returns:
            ``{station_id: group index}`` over the stations of ``sessions``, sorted by station id.

        Raises:
            ConfigError: a station matches no group; the message names the site TOML, the key ``ev.sockets``,
                the station id, the sessions file, the first row (0-based) and session id with that station, and
                how many sessions it has.
        """
        groups = self.config.ev.groups
        out = {}
        for st in sorted(self.sessions.station_id.unique()):
            k = next((i for i, g in enumerate(groups) if g.matches(st)), None)
            if k is None:
                rows = np.flatnonzero((self.sessions.station_id == st).to_numpy())
                patterns = ", ".join(repr(p) for g in groups for p in g.stations)
                raise ConfigError(
                    f"{self.source.get('config', 'the site config')}: key 'ev.sockets': station {st!r} of "
                    f"{self.source.get('sessions', 'the sessions data')} matches no group's stations pattern "
                    f"({patterns}): first at row {rows[0]} (session {self.sessions.session_id.iloc[rows[0]]}), "
                    f"{len(rows)} session(s) in all; add a [[ev.sockets]] group for it or widen a pattern"
                )
            out[st] = k
        return out

    def split(self, split: str) -> SplitData:
        """Cut and discretise one split at the site's step (cached).

        Raises:
            KeyError: unknown split name.
            ValueError: the split holds no data (an empty split: message names the data file, the column ``time``,
                the split's key in the config file and its UTC range), or the series does not cover it completely
                (message names the data file and the first missing step).
        """
        if split not in self._splits:
            self._splits[split] = self._make_split(split, self.config, self.series, self.source.get("series"))
        return self._splits[split]

    def physics_split(self, split: str) -> SplitData:
        """The split at :data:`envs.timestep.PHYSICS_DT_H` (5 minutes), the site simulation every controller is also
        scored on (:class:`envs.evhub.EVHubVectorEnv`'s ``physics_dt_h``): PV, base load, MOER and the sessions
        discretised at that step, no forecast (``moer_fc`` None). Cached.

        Raises:
            KeyError: unknown split name.
            FileNotFoundError: the site has no series at that step (the message names the file and how to make it).
            ValueError: as :meth:`split`.
        """
        key = f"physics:{split}"
        if key not in self._splits:
            cfg = self.config.replace(dt_h=timestep.PHYSICS_DT_H)
            if self.physics_series is None:
                self.physics_series = self._read_physics(cfg)
            file = self.source.get("physics", "physics series")
            self._splits[key] = self._make_split(split, cfg, self.physics_series, file, physics=True)
        return self._splits[key]

    def _read_physics(self, cfg: SiteConfig) -> pd.DataFrame:
        if cfg.dt_h == self.config.dt_h:
            return self.series
        from envs.schemas import validate_columns

        path = self.source.get("physics") or (
            str(_data_files(cfg, Path(self.source["config"]))["series"]) if "config" in self.source else None
        )
        if path is None or not Path(path).is_file():
            raise FileNotFoundError(
                f"{self.source.get('config', 'the site')}: no series at the physics step of "
                f"{timestep.step_minutes(cfg.dt_h)} minutes ({path or 'series_5min.parquet'} is missing): run "
                "`python -m pipeline.data.ingest --site ...` with the raw sources at hand"
            )
        from envs.schemas import read_table

        self.source["physics"] = str(path)
        series = read_table(path)
        validate_columns("physics", series, str(path), timestep.step_minutes(cfg.dt_h))
        return series

    def _make_split(
        self, split: str, cfg: SiteConfig, series: pd.DataFrame, src: str | None, physics: bool = False
    ) -> SplitData:
        start, end = cfg.split_bounds(split)
        step = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
        expected = pd.date_range(start, end, freq=step, inclusive="left")
        table = series.set_index("time")
        table = table[(table.index >= start) & (table.index < end)]
        src = src or "series data"
        key = f"key 'splits.{split}' of {self.source.get('config', 'the site config')}"
        if len(table) == 0:
            times = series["time"]
            cover = f"{times.min()}..{times.max()}" if len(times) else "nothing"
            raise ValueError(
                f"{src}: column 'time' has no row in split '{split}' ({start}..{end} UTC, {key}); "
                f"the data cover {cover}"
            )
        missing = expected.difference(table.index)
        if len(missing):
            what = "hour(s)" if cfg.dt_h == 1 else f"step(s) of {timestep.step_minutes(cfg.dt_h)} minutes"
            raise ValueError(
                f"{src}: column 'time' misses {len(missing)} {what} of split '{split}' ({key}), "
                f"first missing {missing[0]}"
            )
        table = table.loc[expected]
        T = len(expected)
        local = expected.tz_convert(cfg.timezone)
        hour = local.hour.to_numpy() + local.minute.to_numpy() / 60.0
        dow = local.day_of_week.to_numpy() + hour / 24.0
        time_features = np.stack(
            [
                np.sin(2 * math.pi * hour / 24),
                np.cos(2 * math.pi * hour / 24),
                np.sin(2 * math.pi * dow / 7),
                np.cos(2 * math.pi * dow / 7),
            ],
            axis=1,
        )
        sessions = self._discretise_sessions(cfg, start, end, T)
        need, stay = _arrival_tables(sessions, T, cfg.ev.n_sockets)
        fc = ["moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]
        return SplitData(
            config=cfg,
            split=split,
            time=expected,
            pv_kw=table["pv_kw_per_kwp"].to_numpy(np.float64) * cfg.pv.kwp,
            load_kw=np.full(T, cfg.grid.base_load_kw, dtype=np.float64),
            moer=table["moer_kg_per_kwh"].to_numpy(np.float64),
            moer_fc=None if physics else table[fc].to_numpy(np.float64),
            time_features=time_features,
            sessions=sessions,
            arrival_need_kwh=need,
            arrival_stay_steps=stay,
            socket_kw=cfg.ev.socket_kw_array(),
            moer_5min=None if physics else self._moer_5min(table, src),
        )

    @staticmethod
    def _moer_5min(table: pd.DataFrame, src: str) -> np.ndarray | None:
        """The split's :data:`~envs.schemas.MOER_5MIN_COLUMNS` as ``(T, 14)`` float64, or None without them.

        Raises:
            ValueError: some of them but not all (the message names the data file and the missing columns).
        """
        from envs.schemas import MOER_5MIN_COLUMNS

        present = [c for c in MOER_5MIN_COLUMNS if c in table.columns]
        if not present:
            return None
        if len(present) < len(MOER_5MIN_COLUMNS):
            lack = [c for c in MOER_5MIN_COLUMNS if c not in table.columns]
            raise ValueError(f"{src}: column(s) {', '.join(lack)} missing beside {present[0]}: give all or none")
        return table[list(MOER_5MIN_COLUMNS)].to_numpy(np.float64)

    def _discretise_sessions(self, cfg: SiteConfig, start: pd.Timestamp, end: pd.Timestamp, T: int) -> pd.DataFrame:
        """The sessions arriving in ``[start, end)`` at the step of ``cfg`` (the module docstring's rounding and cap),
        each on its socket or rejected."""
        dt = pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
        s = self.sessions
        s = s[(s.arrival >= start) & (s.arrival < end)].sort_values(["arrival", "session_id"])
        arr = np.rint((s.arrival - start) / dt).to_numpy().astype(np.int64)
        dep = np.rint((s.departure - start) / dt).to_numpy().astype(np.int64)
        arr = np.minimum(arr, T - 1)
        dep = np.clip(np.maximum(dep, arr + 1), None, T)
        # sockets: each station's own (station_sockets, over the whole dataset, so a station keeps its socket in
        # every split); a session whose socket is taken goes to its group's first free one, else it is rejected
        # (plug_socket)
        groups = cfg.ev.groups
        group_of = self.station_groups()
        preferred = s.station_id.map(station_sockets(cfg, group_of)).to_numpy(np.int64)
        group = s.station_id.map(group_of).to_numpy(np.int64)
        socket = np.full(len(s), -1, dtype=np.int64)
        free_at = np.zeros(cfg.ev.n_sockets, dtype=np.int64)  # first step each socket is free again
        for j in range(len(s)):  # once per split, not per env step
            k = plug_socket(cfg, preferred[j], free_at <= arr[j])
            if k >= 0:
                socket[j] = k
                free_at[k] = dep[j]
        energy = s.energy_kwh.to_numpy(np.float64)
        # each session's need is capped at what a socket of its group (its own socket) delivers over the stay
        group_kw = np.array([g.kw for g in groups], dtype=np.float64)
        need = np.minimum(energy, group_kw[group] * cfg.dt_h * (dep - arr))
        return pd.DataFrame(
            {
                "session_id": s.session_id.to_numpy(),
                "station_id": s.station_id.to_numpy(),
                "arrival_step": arr,
                "departure_step": dep,
                "socket": socket,
                "energy_kwh": energy,
                "need_kwh": need,
                "rejected": socket < 0,
            }
        )

    def at_step(self, dt_h: float) -> Site:
        """This site at another step: its config with ``dt_h`` replaced and the series at that step read from the
        site's data folder (:func:`series_file`); ``self`` when the step is the same.

        Raises:
            ConfigError: a step that is not a whole-minute divisor of the hour.
            FileNotFoundError: no series at that step in the data folder (the message says how to make one).
        """
        cfg = self.config.replace(dt_h=dt_h)
        if cfg.dt_h == self.config.dt_h:
            return self
        if "config" not in self.source:
            raise FileNotFoundError("Site.at_step: a site built in memory has no data folder to read another step from")
        return load_site(Path(self.source["config"]), dt_h=cfg.dt_h)


def _group_starts(config: SiteConfig) -> np.ndarray:
    """``(G + 1,)`` int64: the first socket of each ``[[ev.sockets]]`` group, then ``n_sockets``."""
    return np.cumsum([0] + [g.count for g in config.ev.groups])


def station_sockets(config: SiteConfig, station_ids) -> dict[str, int]:
    """The socket each station's sessions go to, the site model's rule: a station belongs to the first
    ``[[ev.sockets]]`` group whose pattern it matches; within its group, one socket per station in sorted order of
    the station ids, wrapping when the group has fewer sockets than stations.

    Args:
        config: the site's config.
        station_ids: every station of the site (an iterable of ids, repeats ignored): a station's socket depends
            on the others of its group.

    Returns:
        ``{station_id: socket index}``, sorted by station id; stations matching no group are left out.
    """
    groups = config.ev.groups
    first = _group_starts(config)
    seen = [0] * len(groups)
    out = {}
    for st in sorted(set(map(str, station_ids))):
        k = next((i for i, g in enumerate(groups) if g.matches(st)), None)
        if k is not None:
            out[st] = int(first[k] + seen[k] % groups[k].count)
            seen[k] += 1
    return out


def plug_socket(config: SiteConfig, preferred: int, free: np.ndarray) -> int:
    """The socket a car plugs into, the site model's rule: its station's socket ``preferred``
    (:func:`station_sockets`) when free, else the first free socket of that socket's group.

    Args:
        config: the site's config. preferred: a socket index.
        free: ``(n_sockets,)`` bool, which sockets are free.

    Returns:
        the socket index; -1 when every socket of the group is taken (the car is turned away).
    """
    if free[preferred]:
        return int(preferred)
    first = _group_starts(config)
    g = int(np.searchsorted(first, preferred, side="right")) - 1
    k = np.flatnonzero(free[first[g] : first[g + 1]])
    return int(first[g] + k[0]) if len(k) else -1


def _arrival_tables(sessions: pd.DataFrame, T: int, n_sockets: int) -> tuple[np.ndarray, np.ndarray]:
    need = np.zeros((T, n_sockets), dtype=np.float64)
    stay = np.zeros((T, n_sockets), dtype=np.int64)
    ok = sessions[~sessions.rejected]
    t = ok.arrival_step.to_numpy()
    k = ok.socket.to_numpy()
    need[t, k] = ok.need_kwh.to_numpy()
    stay[t, k] = (ok.departure_step - ok.arrival_step).to_numpy()
    return need, stay


def series_file(data_dir: str | Path, dt_h: float) -> Path:
    """The file of a site's series at a step of ``dt_h`` hours in its data folder: ``series_<minutes>min.parquet``."""
    return Path(data_dir) / f"series_{timestep.step_minutes(dt_h)}min.parquet"


def site_files(site: str | Path) -> dict[str, Path]:
    """The files a site is loaded from: ``{"config": its TOML, "series": ..., "sessions": ...}`` (the processed
    Parquet data in the TOML's ``data_dir``, which need not exist yet).

    Args:
        site: a shipped site name or a path to a site TOML.

    Raises:
        FileNotFoundError, ConfigError: as :func:`envs.config.load_config`.
    """
    cfg, path = load_config(site)
    return {"config": path, **_data_files(cfg, path)}


def _data_files(cfg: SiteConfig, toml: Path) -> dict[str, Path]:
    """``{"series": ..., "sessions": ...}``: the processed Parquet files of the config ``cfg`` read from ``toml``."""
    data_dir = toml.parent / cfg.data_dir
    return {"series": series_file(data_dir, cfg.dt_h), "sessions": data_dir / "sessions.parquet"}


def physics_file(site: str | Path) -> Path:
    """The series a site's simulation at :data:`envs.timestep.PHYSICS_DT_H` reads (:meth:`Site.physics_split`)."""
    cfg, path = load_config(site)
    return series_file(path.parent / cfg.data_dir, timestep.PHYSICS_DT_H)


def load_site(site: str | Path | Site, validate: bool = True, dt_h: float | None = None) -> Site:
    """Load a site: its config and the processed Parquet data beside it.

    Args:
        site: a shipped site name (``"caltech"``), a path to a site TOML, or an already loaded
            :class:`Site` (returned as is, or :meth:`Site.at_step` with ``dt_h``).
        validate: run the pandera schemas of :mod:`envs.schemas` over the data; when False, only the
            columns and their dtypes are checked (what cutting splits relies on).
        dt_h: the step to load the site at, hours, in place of its TOML's ``dt_h`` (None: the TOML's).

    Raises:
        FileNotFoundError: missing config or data file (the message names it, and a file of the same
            name in another format, or the series at the steps the folder holds, where there are some).
        ConfigError: invalid config (message names file and key).
        envs.schemas.DataValidationError: a data file that is not Parquet, or data breaking a schema
            (message names file, column, row); with ``validate=False`` only a missing column, a column of
            another dtype or an empty table.
    """
    if isinstance(site, Site):
        return site if dt_h is None else site.at_step(dt_h)
    from envs.schemas import read_table, validate_columns, validate_site_data

    cfg, path = load_config(site)
    if dt_h is not None:
        cfg = cfg.replace(dt_h=dt_h)
    data_dir = path.parent / cfg.data_dir
    files = _data_files(cfg, path)
    for f in files.values():
        if not f.is_file():
            others = sorted(p.name for p in data_dir.glob(f"{f.stem}.*")) if data_dir.is_dir() else []
            found = f" (found {', '.join(others)}: the data must be Parquet)" if others else ""
            if not others and f.name.startswith("series_") and data_dir.is_dir():
                steps = sorted(p.name for p in data_dir.glob("series_*min.parquet"))
                found = f" (the folder holds {', '.join(steps)})" if steps else ""
            raise FileNotFoundError(
                f"{path}: data file {f} is missing{found} (run `python -m pipeline.data.ingest --site {path}`"
                + (f" for dt_h = {cfg.dt_h:.6g}" if dt_h is not None else "")
                + ")"
            )
    minutes = timestep.step_minutes(cfg.dt_h)
    series = read_table(files["series"])
    sessions = read_table(files["sessions"])
    source = {"config": str(path), **{k: str(v) for k, v in files.items()}}
    physics = series_file(data_dir, timestep.PHYSICS_DT_H)
    if physics.is_file():
        source["physics"] = str(physics)
    if validate:
        validate_site_data(series, sessions, source, minutes)
    else:
        validate_columns("series", series, source["series"], minutes)
        validate_columns("sessions", sessions, source["sessions"])
    return Site(cfg, series, sessions, source)
