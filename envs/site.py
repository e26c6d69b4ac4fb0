"""The site model: a site config plus its processed data, turned into per-split arrays.

A *site* is a config file such as ``envs/sites/caltech.toml`` (its schema, reading and checks: :mod:`envs.config`)
and a data folder beside it holding ``hourly.parquet`` (one row per UTC hour) and ``sessions.parquet`` (one row
per EV session); see ``envs/sites/caltech/README.md`` for the columns and their sources. :func:`load_site` reads
both; :meth:`Site.split` cuts one split out of it and precomputes everything the environment, the KPIs and the
oracle need, as NumPy arrays, so that they all see exactly the same hourly discretisation.

Units: power kW, energy kWh, carbon intensity kg CO2/kWh, time steps of ``dt_h`` hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from envs.config import ConfigError, SiteConfig, load_config


@dataclass
class SplitData:
    """One split of a site, discretised into ``T`` steps of ``dt_h`` hours (all arrays NumPy).

    Exogenous series, shape ``(T,)`` float64 unless noted:
        time: ``pd.DatetimeIndex`` (UTC) of step starts.
        pv_kw: available AC PV power, kW (``pv_kw_per_kwp * pv.kwp``).
        load_kw: non-EV site load, kW.
        moer: carbon intensity of grid import during the step, kg CO2/kWh (hourly mean MOER).
        moer_fc: ``(T, 3)`` MOER forecasts issued at the step start for steps t, t+1, t+2, kg/kWh.
        moer_5min: ``(T, 14)`` what a 5-minute carbon source says at the step start (the hourly columns
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
    moer_fc: np.ndarray
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
        step = pd.Timedelta(hours=self.config.dt_h)
        extra = self.time[-1] + step * np.arange(1, max(n - self.num_steps, 0) + 1)
        local = self.time.append(pd.DatetimeIndex(extra))[:n].tz_convert(self.config.timezone)
        return np.asarray(local.day_of_week >= 5)


@dataclass
class Site:
    """A site config with its processed data frames (see module docstring).

    Attributes:
        config: the checked :class:`SiteConfig`.
        hourly: DataFrame, one row per UTC hour: ``time`` (UTC), ``pv_kw_per_kwp``,
            ``moer_kg_per_kwh``, ``moer_fc_h0``, ``moer_fc_h1``, ``moer_fc_h2``.
        sessions: DataFrame, one row per EV session: ``session_id``, ``station_id``, ``arrival`` and
            ``departure`` (UTC), ``energy_kwh``.
        source: where each piece came from (``{"config": path, "hourly": path, "sessions": path}``).

    Raises:
        ConfigError: on construction, a session's station matches no ``[[ev.sockets]]`` group (see
            :meth:`station_groups`).
    """

    config: SiteConfig
    hourly: pd.DataFrame
    sessions: pd.DataFrame
    source: dict[str, str] = field(default_factory=dict)
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
        """Cut and discretise one split (cached).

        Raises:
            KeyError: unknown split name.
            ValueError: the split holds no hourly data (an empty split: message names the data file, the
                column ``time``, the split's key in the config file and its UTC range), or the hourly data
                does not cover it completely (message names the data file and the first missing hour).
        """
        if split not in self._splits:
            self._splits[split] = self._make_split(split)
        return self._splits[split]

    def _make_split(self, split: str) -> SplitData:
        cfg = self.config
        start, end = cfg.split_bounds(split)
        expected = pd.date_range(start, end, freq="h", inclusive="left")
        hourly = self.hourly.set_index("time")
        hourly = hourly[(hourly.index >= start) & (hourly.index < end)]
        src = self.source.get("hourly", "hourly data")
        key = f"key 'splits.{split}' of {self.source.get('config', 'the site config')}"
        if len(hourly) == 0:
            times = self.hourly["time"]
            cover = f"{times.min()}..{times.max()}" if len(times) else "nothing"
            raise ValueError(
                f"{src}: column 'time' has no row in split '{split}' ({start}..{end} UTC, {key}); "
                f"the data cover {cover}"
            )
        missing = expected.difference(hourly.index)
        if len(missing):
            raise ValueError(
                f"{src}: column 'time' misses {len(missing)} hour(s) of split '{split}' ({key}), "
                f"first missing {missing[0]}"
            )
        hourly = hourly.loc[expected]
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
        sessions = self._discretise_sessions(split, start, end, T)
        need, stay = _arrival_tables(sessions, T, cfg.ev.n_sockets)
        socket_kw = cfg.ev.socket_kw_array()
        return SplitData(
            config=cfg,
            split=split,
            time=expected,
            pv_kw=hourly["pv_kw_per_kwp"].to_numpy(np.float64) * cfg.pv.kwp,
            load_kw=np.full(T, cfg.grid.base_load_kw, dtype=np.float64),
            moer=hourly["moer_kg_per_kwh"].to_numpy(np.float64),
            moer_fc=hourly[["moer_fc_h0", "moer_fc_h1", "moer_fc_h2"]].to_numpy(np.float64),
            time_features=time_features,
            sessions=sessions,
            arrival_need_kwh=need,
            arrival_stay_steps=stay,
            socket_kw=socket_kw,
            moer_5min=self._moer_5min(hourly, src),
        )

    @staticmethod
    def _moer_5min(hourly: pd.DataFrame, src: str) -> np.ndarray | None:
        """The split's :data:`~envs.schemas.MOER_5MIN_COLUMNS` as ``(T, 14)`` float64, or None without them.

        Raises:
            ValueError: some of them but not all (the message names the data file and the missing columns).
        """
        from envs.schemas import MOER_5MIN_COLUMNS

        present = [c for c in MOER_5MIN_COLUMNS if c in hourly.columns]
        if not present:
            return None
        if len(present) < len(MOER_5MIN_COLUMNS):
            lack = [c for c in MOER_5MIN_COLUMNS if c not in hourly.columns]
            raise ValueError(f"{src}: column(s) {', '.join(lack)} missing beside {present[0]}: give all or none")
        return hourly[list(MOER_5MIN_COLUMNS)].to_numpy(np.float64)

    def _discretise_sessions(self, split: str, start: pd.Timestamp, end: pd.Timestamp, T: int) -> pd.DataFrame:
        cfg = self.config
        dt = pd.Timedelta(hours=cfg.dt_h)
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


def site_files(site: str | Path) -> dict[str, Path]:
    """The files a site is loaded from: ``{"config": its TOML, "hourly": ..., "sessions": ...}`` (the processed
    Parquet data in the TOML's ``data_dir``, which need not exist yet).

    Args:
        site: a shipped site name or a path to a site TOML.

    Raises:
        FileNotFoundError, ConfigError: as :func:`envs.config.load_config`.
    """
    cfg, path = load_config(site)
    return {"config": path, **_data_files(cfg, path)}


def _data_files(cfg: SiteConfig, toml: Path) -> dict[str, Path]:
    """``{"hourly": ..., "sessions": ...}``: the processed Parquet files of the config ``cfg`` read from ``toml``."""
    return {name: toml.parent / cfg.data_dir / f"{name}.parquet" for name in ("hourly", "sessions")}


def load_site(site: str | Path | Site, validate: bool = True) -> Site:
    """Load a site: its config and the processed Parquet data beside it.

    Args:
        site: a shipped site name (``"caltech"``), a path to a site TOML, or an already loaded
            :class:`Site` (returned as is).
        validate: run the pandera schemas of :mod:`envs.schemas` over the data; when False, only the
            columns and their dtypes are checked (what cutting splits relies on).

    Raises:
        FileNotFoundError: missing config or data file (the message names it, and a file of the same
            name in another format where there is one).
        ConfigError: invalid config (message names file and key).
        envs.schemas.DataValidationError: a data file that is not Parquet, or data breaking a schema
            (message names file, column, row); with ``validate=False`` only a missing column, a column of
            another dtype or an empty table.
    """
    if isinstance(site, Site):
        return site
    from envs.schemas import read_table, validate_columns, validate_site_data

    cfg, path = load_config(site)
    data_dir = path.parent / cfg.data_dir
    files = _data_files(cfg, path)
    for f in files.values():
        if not f.is_file():
            others = sorted(p.name for p in data_dir.glob(f"{f.stem}.*")) if data_dir.is_dir() else []
            found = f" (found {', '.join(others)}: the data must be Parquet)" if others else ""
            raise FileNotFoundError(f"{path}: data file {f} is missing{found} (run `python -m pipeline.data.ingest`)")
    hourly = read_table(files["hourly"])
    sessions = read_table(files["sessions"])
    source = {"config": str(path), **{k: str(v) for k, v in files.items()}}
    if validate:
        validate_site_data(hourly, sessions, source)
    else:
        for kind, df in (("hourly", hourly), ("sessions", sessions)):
            validate_columns(kind, df, source[kind])
    return Site(cfg, hourly, sessions, source)
