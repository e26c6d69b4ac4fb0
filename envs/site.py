"""The site model: a site config (TOML) plus its processed data, turned into per-split arrays.

A *site* is a config file such as ``envs/sites/caltech.toml`` and a data folder beside it holding
``hourly.parquet`` (one row per UTC hour) and ``sessions.parquet`` (one row per EV session); see
``envs/sites/caltech/README.md`` for the columns and their sources. :func:`load_site` reads both;
:meth:`Site.split` cuts one split out of it and precomputes everything the environment, the KPIs and the
oracle need, as NumPy arrays, so that they all see exactly the same hourly discretisation.

Units: power kW, energy kWh, carbon intensity kg CO2/kWh, time steps of ``dt_h`` hours.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SITES_DIR = Path(__file__).resolve().parent / "sites"


class ConfigError(ValueError):
    """A site config is malformed or inconsistent; the message names the file and the key."""


@dataclass(frozen=True)
class PVConfig:
    """The PV array. The env uses only ``kwp``; the other keys describe the array for ingestion
    (``pipeline.data.sources``), which models its output per kWp with pvlib's PVWatts chain."""

    kwp: float = 20.0
    """DC nameplate of the PV array, kWp."""
    tilt_deg: float = 20.0
    """Module tilt from horizontal, degrees, in [0, 90]."""
    azimuth_deg: float = 180.0
    """Module azimuth, degrees east of north, in [0, 360) (180 = south; 0 = north, the equator side south of it)."""
    latitude: float | None = None
    """Site latitude, degrees north, in [-90, 90]: needed by the clear-sky weather source (an EPW file carries
    its own location)."""
    longitude: float | None = None
    """Site longitude, degrees east, in [-180, 180]: needed by the clear-sky weather source."""
    altitude_m: float | None = None
    """Site altitude above sea level, m (clear-sky model; None: pvlib looks it up from its elevation map)."""
    transposition: str = "haydavies"
    """Sky-diffuse model of ``pvlib.irradiance.get_total_irradiance``: "haydavies" or "isotropic"."""
    temperature_model: str = "open_rack_glass_polymer"
    """SAPM cell-temperature parameter set (``pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS['sapm']``)."""
    gamma_pdc: float = -0.0035
    """DC power temperature coefficient, 1/K."""
    dc_ac_ratio: float = 1.2
    """DC nameplate over inverter DC input rating, > 0."""
    eta_inv_nom: float = 0.96
    """Nominal inverter efficiency (PVWatts), in (0, 1]."""
    system_losses_pct: float | None = None
    """DC system losses, percent, in [0, 100) (None: ``pvlib.pvsystem.pvwatts_losses()`` defaults, 14.08%)."""


@dataclass(frozen=True)
class BESSConfig:
    capacity_kwh: float = 40.0
    """Nameplate energy of the battery, kWh."""
    power_kw: float = 20.0
    """Charge and discharge power limit, kW."""
    eta_charge: float = 0.95
    """One-way charge efficiency, fraction."""
    eta_discharge: float = 0.95
    """One-way discharge efficiency, fraction."""
    soc_min: float = 0.1
    """Lowest allowed state of charge, fraction of capacity."""
    soc_max: float = 0.9
    """Highest allowed state of charge, fraction of capacity."""
    soc_initial: float = 0.5
    """State of charge at the start of every episode, fraction of capacity."""


@dataclass(frozen=True)
class SocketGroup:
    """One group of identical charging sockets: a ``[[ev.sockets]]`` table of the site TOML.

    A session goes to a socket of the first group (in the file's order) one of whose ``stations`` patterns
    matches its ``station_id`` (:func:`fnmatch.fnmatchcase` globs: ``*``, ``?``, ``[seq]``; case-sensitive).
    """

    count: int
    """Number of sockets in the group, >= 1."""
    kw: float
    """Maximum charging power of each socket of the group, kW, > 0."""
    stations: tuple[str, ...] = ("*",)
    """Station-id patterns of the sessions the group serves (TOML: one string or a list of strings; default
    ``"*"``, every station)."""

    def matches(self, station_id: str) -> bool:
        """Whether ``station_id`` matches one of the group's ``stations`` patterns."""
        return any(fnmatch.fnmatchcase(station_id, p) for p in self.stations)


@dataclass(frozen=True)
class EVConfig:
    """The EV sockets and how the env dispatches them.

    Sockets are given either as one kind, ``n_sockets`` x ``socket_kw`` (every station's sessions go to
    them), or as groups, ``[[ev.sockets]]`` tables (:class:`SocketGroup`: ``count``, ``kw``, ``stations``),
    e.g. 54 Level-2 sockets of 6.6 kW for ``CA-*`` and one 50 kW DC socket for another station. Sockets are
    numbered group after group in the file's order. With groups, ``n_sockets`` and ``socket_kw`` are derived
    (the sum of the counts and the largest ``kw``): leave them out of the TOML, or give the same values.
    """

    n_sockets: int = 55
    """Number of charging sockets (with ``[[ev.sockets]]``: the sum of the groups' counts)."""
    socket_kw: float = 6.6
    """Maximum charging power of one socket, kW (with ``[[ev.sockets]]``: the largest group's ``kw``; the env,
    the oracle and the MPC use each socket's own power, :meth:`socket_kw_array`)."""
    sockets: tuple[SocketGroup, ...] = ()
    """The ``[[ev.sockets]]`` groups as written; empty for the one-kind form."""
    deadline_floor: bool = True
    """Raise each socket to the least-laxity power that still meets its departure."""
    surplus_to_ev: bool = True
    """Send PV that neither the load nor the BESS takes to the plugged EVs (up to their caps) before it is
    curtailed or exported: such energy is free of CO2, so using it never costs the drivers or the grid."""

    @property
    def groups(self) -> tuple[SocketGroup, ...]:
        """The socket groups in effect: ``sockets``, or one group of ``n_sockets`` x ``socket_kw`` for every
        station."""
        return self.sockets or (SocketGroup(self.n_sockets, self.socket_kw, ("*",)),)

    def socket_kw_array(self) -> np.ndarray:
        """Maximum charging power of each socket, kW: shape ``(n_sockets,)`` float64, groups in order."""
        return np.concatenate([np.full(g.count, g.kw, dtype=np.float64) for g in self.groups])


EXPORT_CREDITS = ("none", "moer")
"""Values of ``grid.export_credit``."""


@dataclass(frozen=True)
class GridConfig:
    """The grid connection and how its emissions are counted.

    CO2 of a step (kg): ``G_imp * MOER * dt`` with ``export_credit = "none"``; with ``"moer"`` (only with
    ``export_allowed``) ``(G_imp - G_exp) * MOER * dt``: exported energy displaces marginal generation of its
    hour, so it is credited at that hour's MOER (avoided emissions, the usual marginal accounting). The
    credit is applied alike by the env (emissions and reward), the KPIs, the oracle and the MPC.
    """

    import_limit_kw: float = 300.0
    """Grid import limit of the service connection, kW."""
    export_allowed: bool = False
    """Whether surplus PV may be exported; curtailed otherwise."""
    export_credit: str = "none"
    """How exported energy counts in CO2: ``"none"`` (not at all: CO2 is import x MOER) or ``"moer"`` (credited
    at the MOER of its hour: CO2 is (import - export) x MOER, which may be negative). ``"moer"`` requires
    ``export_allowed = true`` (a ConfigError otherwise: there is nothing to credit)."""
    base_load_kw: float = 0.0
    """Constant non-EV site load, kW."""


@dataclass(frozen=True)
class SplitsConfig:
    train: tuple[str, str] = ("2019-05-01", "2019-12-31")
    """Inclusive local dates of the training split."""
    test: tuple[str, str] = ("2021-05-01", "2021-08-31")
    """Inclusive local dates of the test split."""


@dataclass(frozen=True)
class EpisodeConfig:
    train_steps: int = 168
    """Length of a training episode, steps."""
    session_keep_min: float = 1.0
    """Demand augmentation for training windows: each window keeps every arriving EV session with a
    probability drawn uniformly from ``[session_keep_min, 1]`` (1.0: keep all). Full-split runs (evaluation,
    baselines, the oracle) always keep every session."""


@dataclass(frozen=True)
class RewardConfig:
    w_co2: float = 1.0
    """Weight per kg CO2."""
    w_unserved: float = 2.0
    """Weight per kWh of EV energy still needed at departure."""
    w_peak: float = 0.0
    """Weight per kW of grid import above ``peak_threshold_kw``."""
    peak_threshold_kw: float = 150.0
    """Import above which the peak term applies, kW."""
    scale: float = 0.1
    """Overall reward scale."""


@dataclass(frozen=True)
class MPCConfig:
    enabled: bool = True
    """Run the model-predictive controllers (``mpc`` and ``mpc_perfect``, ``pipeline/control/mpc.py``) in the pipeline."""
    horizon_h: int = 24
    """Look-ahead of each MPC solve, hours (clipped at the split's end)."""
    expected_demand_days: int = 7
    """``mpc``'s demand forecast: the sessions that arrived at the same hours of the last this many days (0: plan
    for the plugged EVs only)."""
    expected_demand_weight: float = 0.75
    """Share of that mean demand the plan counts on, in [0, 1] (``pipeline.control.mpc``: the expected-value plan
    overrates how much PV uncertain cars will absorb; 0.75 is the best of 0.25/0.5/0.75/1 on caltech's train
    split)."""


@dataclass(frozen=True)
class SiteConfig:
    """A site's configuration, as read from its TOML file (one table per nested dataclass)."""

    name: str = "site"
    timezone: str = "UTC"
    data_dir: str = "."
    dt_h: float = 1.0
    synthetic_sessions: bool = False
    """Whether the site's EV sessions are generated rather than measured (the report then says so)."""
    data_note: str = ""
    """One line on where the site's data come from, shown in the report when not empty."""
    pv: PVConfig = field(default_factory=PVConfig)
    bess: BESSConfig = field(default_factory=BESSConfig)
    ev: EVConfig = field(default_factory=EVConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    splits: SplitsConfig = field(default_factory=SplitsConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    mpc: MPCConfig = field(default_factory=MPCConfig)
    sources: dict[str, Any] = field(default_factory=dict)
    """The ``[sources]`` table as written (raw files the processed data are ingested from); read and checked by
    ``pipeline.data.sources``, not by the env."""
    sizing: dict[str, Any] = field(default_factory=dict)
    """The ``[sizing]`` table as written (grid and unit costs of ``doit run sizing``); read and checked by
    ``pipeline.study.sizing``, not by the env."""

    def split_bounds(self, split: str) -> tuple[pd.Timestamp, pd.Timestamp]:
        """UTC ``[start, end)`` of a split: local midnight of its first date to local midnight after its last, in
        ``timezone``.

        Raises:
            KeyError: unknown split name.
        """
        if split not in ("train", "test"):
            raise KeyError(f"unknown split {split!r}: expected 'train' or 'test'")
        first, last = getattr(self.splits, split)
        start = pd.Timestamp(first).tz_localize(self.timezone).tz_convert("UTC")
        end = (pd.Timestamp(last) + pd.Timedelta(days=1)).tz_localize(self.timezone).tz_convert("UTC")
        return start, end

    def replace(self, **sections: dict[str, Any] | Any) -> "SiteConfig":
        """Return a copy with some values changed, e.g. ``cfg.replace(pv={"kwp": 0.0}, dt_h=1.0)``.

        ``ev={"sockets": [...]}`` (a non-empty list of groups) replaces the sockets; ``ev.n_sockets`` and
        ``ev.socket_kw`` then follow from the new groups unless given too.

        Raises:
            ConfigError: unknown key or inconsistent values (see :func:`check_config`).
        """
        raw = dataclasses.asdict(self)
        ev = sections.get("ev")
        if isinstance(ev, dict) and ev.get("sockets"):  # new groups: the one-kind keys are derived from them again
            for k in ("n_sockets", "socket_kw"):
                if k not in ev:
                    raw["ev"].pop(k)
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return config_from_dict(raw, source="<replace>")


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> SiteConfig:
    """Build and check a :class:`SiteConfig` from nested dicts (the TOML's structure).

    Raises:
        ConfigError: an unknown table or key (typos are not ignored; the message suggests the closest
            known key), a wrong type, or an inconsistent value (see :func:`check_config`); the message
            names ``source`` and the dotted key.
    """
    kwargs: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(SiteConfig)}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{key}'{_did_you_mean(key, fields)} (known: {', '.join(fields)})"
            )
        sub = _SECTIONS.get(key)
        if key in _RAW_TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{key}' must be a table, got {value!r}")
            kwargs[key] = value
            continue
        if sub is None:
            kwargs[key] = _coerce(value, fields[key].type, f"{source}: key '{key}'")
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' must be a table, got {value!r}")
        sub_fields = {f.name: f for f in dataclasses.fields(sub)}
        sub_kwargs = {}
        for k, v in value.items():
            if k not in sub_fields:
                raise ConfigError(
                    f"{source}: unknown key '{key}.{k}'{_did_you_mean(k, sub_fields, prefix=f'{key}.')}"
                    f" (known in [{key}]: {', '.join(sub_fields)})"
                )
            if (key, k) == ("ev", "sockets"):
                sub_kwargs[k] = _socket_groups(v, source)
                continue
            sub_kwargs[k] = _coerce(v, sub_fields[k].type, f"{source}: key '{key}.{k}'")
        if key == "ev" and sub_kwargs.get("sockets"):  # with groups, the one-kind keys are derived
            sub_kwargs.setdefault("n_sockets", sum(g.count for g in sub_kwargs["sockets"]))
            sub_kwargs.setdefault("socket_kw", max(g.kw for g in sub_kwargs["sockets"]))
        kwargs[key] = sub(**sub_kwargs)
    cfg = SiteConfig(**kwargs)
    check_config(cfg, source)
    return cfg


def _socket_groups(value: Any, source: str) -> tuple[SocketGroup, ...]:
    """Parse ``ev.sockets`` (a TOML array of tables ``[[ev.sockets]]``, or a list of dicts) into groups.

    Raises:
        ConfigError: not a list of tables, an unknown or missing key, a wrong type, ``count < 1``, ``kw <= 0``,
            or an empty or non-string ``stations`` pattern; the message names ``source`` and the dotted key
            with the group's index, e.g. ``ev.sockets[1].kw``.
    """
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(
            f"{source}: key 'ev.sockets' must be an array of tables ([[ev.sockets]] with count, kw and stations), "
            f"got {value!r}"
        )
    known = ("count", "kw", "stations")
    groups = []
    for i, table in enumerate(value):
        where = f"ev.sockets[{i}]"
        for k in table:
            if k not in known:
                raise ConfigError(
                    f"{source}: unknown key '{where}.{k}'{_did_you_mean(k, known, prefix=f'{where}.')}"
                    f" (known in [[ev.sockets]]: {', '.join(known)})"
                )
        for k in ("count", "kw"):
            if k not in table:
                raise ConfigError(f"{source}: key '{where}.{k}' is missing (each [[ev.sockets]] needs count and kw)")
        count = _coerce(table["count"], "int", f"{source}: key '{where}.count'")
        kw = _coerce(table["kw"], "float", f"{source}: key '{where}.kw'")
        if count < 1:
            raise ConfigError(f"{source}: key '{where}.count' must be >= 1, got {count}")
        if not kw > 0:
            raise ConfigError(f"{source}: key '{where}.kw' must be > 0 kW, got {kw}")
        pats = table.get("stations", "*")
        pats = [pats] if isinstance(pats, str) else pats
        if not isinstance(pats, (list, tuple)) or not pats or not all(isinstance(x, str) and x for x in pats):
            raise ConfigError(
                f"{source}: key '{where}.stations' must be a station-id pattern (a glob such as \"CA-*\") or a "
                f"non-empty list of them, got {table.get('stations')!r}"
            )
        groups.append(SocketGroup(count, kw, tuple(pats)))
    return tuple(groups)


def _did_you_mean(key: str, known, prefix: str = "") -> str:
    """``": did you mean 'x'?"`` for the closest known key, or "" when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f": did you mean '{prefix}{close[0]}'?" if close else ""


def _coerce(value: Any, type_name: str, where: str) -> Any:
    t = str(type_name)
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if t.startswith("tuple"):
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{where} must be two dates [\"YYYY-MM-DD\", \"YYYY-MM-DD\"], got {value!r}")
        return tuple(value)
    return value


_RAW_TABLES = ("sources", "sizing")
"""Tables kept as written: the pipeline reads them (``pipeline.data.sources``, ``pipeline.study.sizing``)."""

_SECTIONS = {
    "pv": PVConfig,
    "bess": BESSConfig,
    "ev": EVConfig,
    "grid": GridConfig,
    "splits": SplitsConfig,
    "episode": EpisodeConfig,
    "reward": RewardConfig,
    "mpc": MPCConfig,
}


def check_config(cfg: SiteConfig, source: str = "<config>") -> None:
    """Check physical consistency of a config.

    Raises:
        ConfigError: naming ``source`` and the offending key, e.g. ``bess.soc_min >= bess.soc_max``,
            a negative size, zero sockets, an efficiency outside (0, 1], ``ev.n_sockets`` or ``ev.socket_kw``
            contradicting the ``[[ev.sockets]]`` groups, an unknown ``grid.export_credit`` or a credit without
            export, unparsable or empty or overlapping split dates, an unknown time zone.
    """

    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{source}: key '{key}' {msg}")

    if cfg.dt_h <= 0:
        raise bad("dt_h", f"must be > 0 hours, got {cfg.dt_h}")
    if cfg.dt_h != 1.0:
        raise bad("dt_h", f"must be 1.0: the processed data is hourly, got {cfg.dt_h}")
    if cfg.pv.kwp < 0:
        raise bad("pv.kwp", f"must be >= 0 kWp, got {cfg.pv.kwp}")
    pv_checks = {  # key: (test, the allowed values as the message states them); optional keys left None are skipped
        "tilt_deg": (lambda v: 0 <= v <= 90, "[0, 90] degrees"),
        "azimuth_deg": (lambda v: 0 <= v < 360, "[0, 360) degrees east of north"),
        "latitude": (lambda v: -90 <= v <= 90, "[-90, 90] degrees"),
        "longitude": (lambda v: -180 <= v <= 180, "[-180, 180] degrees"),
        "altitude_m": (lambda v: -500 <= v <= 9000, "[-500, 9000] m"),
        "dc_ac_ratio": (lambda v: v > 0, "> 0"),
        "eta_inv_nom": (lambda v: 0 < v <= 1, "(0, 1]"),
        "system_losses_pct": (lambda v: 0 <= v < 100, "[0, 100) percent"),
        "gamma_pdc": (lambda v: -0.1 <= v <= 0, "[-0.1, 0] per K"),
    }
    for k, (ok, allowed) in pv_checks.items():
        v = getattr(cfg.pv, k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(f"pv.{k}", f"must be a number, got {v!r}")
        if not ok(v):
            raise bad(f"pv.{k}", f"must be in {allowed}, got {v}")
    if cfg.pv.transposition not in ("haydavies", "isotropic"):
        raise bad("pv.transposition", f"must be 'haydavies' or 'isotropic', got {cfg.pv.transposition!r}")
    sapm = ("open_rack_glass_glass", "close_mount_glass_glass", "open_rack_glass_polymer", "insulated_back_glass_polymer")
    if cfg.pv.temperature_model not in sapm:
        raise bad("pv.temperature_model", f"must be one of {', '.join(sapm)}, got {cfg.pv.temperature_model!r}")
    b = cfg.bess
    for k in ("capacity_kwh", "power_kw"):
        if getattr(b, k) < 0:
            raise bad(f"bess.{k}", f"must be >= 0, got {getattr(b, k)}")
    for k in ("eta_charge", "eta_discharge"):
        if not 0 < getattr(b, k) <= 1:
            raise bad(f"bess.{k}", f"must be in (0, 1], got {getattr(b, k)}")
    for k in ("soc_min", "soc_max", "soc_initial"):
        if not 0 <= getattr(b, k) <= 1:
            raise bad(f"bess.{k}", f"must be a fraction in [0, 1], got {getattr(b, k)}")
    if b.soc_min >= b.soc_max:
        raise bad("bess.soc_min", f"({b.soc_min}) must be below bess.soc_max ({b.soc_max})")
    if not b.soc_min <= b.soc_initial <= b.soc_max:
        raise bad("bess.soc_initial", f"({b.soc_initial}) must lie in [soc_min, soc_max]")
    if cfg.ev.n_sockets < 1:
        raise bad("ev.n_sockets", f"must be >= 1, got {cfg.ev.n_sockets}")
    if cfg.ev.socket_kw <= 0:
        raise bad("ev.socket_kw", f"must be > 0 kW, got {cfg.ev.socket_kw}")
    if cfg.ev.sockets:
        total = sum(g.count for g in cfg.ev.sockets)
        largest = max(g.kw for g in cfg.ev.sockets)
        if cfg.ev.n_sockets != total:
            raise bad(
                "ev.n_sockets",
                f"({cfg.ev.n_sockets}) must equal the sum of the ev.sockets counts ({total}); leave it out "
                "when [[ev.sockets]] groups are given",
            )
        if cfg.ev.socket_kw != largest:
            raise bad(
                "ev.socket_kw",
                f"({cfg.ev.socket_kw:g}) must equal the largest ev.sockets kw ({largest:g}); leave it out when "
                "[[ev.sockets]] groups are given (each group sets its own kw)",
            )
    if cfg.grid.export_credit not in EXPORT_CREDITS:
        raise bad("grid.export_credit", f"must be one of {', '.join(map(repr, EXPORT_CREDITS))}, got {cfg.grid.export_credit!r}")
    if cfg.grid.export_credit != "none" and not cfg.grid.export_allowed:
        raise bad(
            "grid.export_credit",
            f"= {cfg.grid.export_credit!r} needs grid.export_allowed = true (nothing is exported to credit)",
        )
    if cfg.grid.import_limit_kw <= 0:
        raise bad("grid.import_limit_kw", f"must be > 0 kW, got {cfg.grid.import_limit_kw}")
    if cfg.grid.base_load_kw < 0:
        raise bad("grid.base_load_kw", f"must be >= 0 kW, got {cfg.grid.base_load_kw}")
    if cfg.grid.base_load_kw > cfg.grid.import_limit_kw:
        raise bad("grid.base_load_kw", f"({cfg.grid.base_load_kw}) exceeds grid.import_limit_kw ({cfg.grid.import_limit_kw})")
    if cfg.episode.train_steps < 1:
        raise bad("episode.train_steps", f"must be >= 1, got {cfg.episode.train_steps}")
    if not 0.0 < cfg.episode.session_keep_min <= 1.0:
        raise bad("episode.session_keep_min", f"must be a probability in (0, 1], got {cfg.episode.session_keep_min}")
    for k in ("w_co2", "w_unserved", "w_peak", "scale"):
        if getattr(cfg.reward, k) < 0:
            raise bad(f"reward.{k}", f"must be >= 0, got {getattr(cfg.reward, k)}")
    if cfg.mpc.horizon_h < 1:
        raise bad("mpc.horizon_h", f"must be >= 1 hour, got {cfg.mpc.horizon_h}")
    if cfg.mpc.expected_demand_days < 0:
        raise bad("mpc.expected_demand_days", f"must be >= 0 days, got {cfg.mpc.expected_demand_days}")
    if not 0.0 <= cfg.mpc.expected_demand_weight <= 1.0:
        raise bad("mpc.expected_demand_weight", f"must be in [0, 1], got {cfg.mpc.expected_demand_weight}")
    try:
        import zoneinfo

        zoneinfo.ZoneInfo(cfg.timezone)
    except Exception as exc:  # noqa: BLE001 - any failure means the name is unusable
        raise bad("timezone", f"is not a known IANA time zone: {cfg.timezone!r}") from exc
    ranges = {}
    for split in ("train", "test"):
        start, end = getattr(cfg.splits, split)
        try:
            s, e = pd.Timestamp(start), pd.Timestamp(end)
        except ValueError as exc:
            raise bad(f"splits.{split}", f"has an unparsable date: {start!r}..{end!r}") from exc
        if e < s:
            raise bad(f"splits.{split}", f"is empty: end {end} before start {start}")
        ranges[split] = (s, e)
    (s1, e1), (s2, e2) = ranges["train"], ranges["test"]
    if s1 <= e2 and s2 <= e1:
        raise bad("splits.test", f"overlaps splits.train ({s1.date()}..{e1.date()} vs {s2.date()}..{e2.date()})")


def load_config(site: str | Path) -> tuple[SiteConfig, Path]:
    """Read a site config.

    Args:
        site: a site name shipped with the package (``"caltech"`` -> ``envs/sites/caltech.toml``) or a
            path to a TOML file.

    Returns:
        ``(config, path)``: the checked config and the resolved TOML path.

    Raises:
        FileNotFoundError: no such site or file.
        ConfigError: invalid TOML, unknown keys or inconsistent values (message names file and key).
    """
    path = Path(site)
    if path.suffix != ".toml":
        path = SITES_DIR / f"{site}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in SITES_DIR.glob("*.toml"))
        raise FileNotFoundError(f"site config not found: {path} (sites shipped: {', '.join(known)})")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return config_from_dict(raw, source=str(path)), path.resolve()


@dataclass
class SplitData:
    """One split of a site, discretised into ``T`` steps of ``dt_h`` hours (all arrays NumPy).

    Exogenous series, shape ``(T,)`` float64 unless noted:
        time: ``pd.DatetimeIndex`` (UTC) of step starts.
        pv_kw: available AC PV power, kW (``pv_kw_per_kwp * pv.kwp``).
        load_kw: non-EV site load, kW.
        moer: carbon intensity of grid import during the step, kg CO2/kWh (hourly mean MOER).
        moer_fc: ``(T, 3)`` MOER forecasts issued at the step start for steps t, t+1, t+2, kg/kWh.
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

    @property
    def num_steps(self) -> int:
        """Number of steps ``T`` in the split."""
        return len(self.time)

    @property
    def capped_kwh(self) -> float:
        """EV energy in the data above what the sockets could deliver in the stays, kWh (accepted sessions)."""
        s = self.sessions[~self.sessions.rejected]
        return float((s.energy_kwh - s.need_kwh).sum())


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
        )

    def _discretise_sessions(self, split: str, start: pd.Timestamp, end: pd.Timestamp, T: int) -> pd.DataFrame:
        cfg = self.config
        dt = pd.Timedelta(hours=cfg.dt_h)
        s = self.sessions
        s = s[(s.arrival >= start) & (s.arrival < end)].sort_values(["arrival", "session_id"])
        arr = np.rint((s.arrival - start) / dt).to_numpy().astype(np.int64)
        dep = np.rint((s.departure - start) / dt).to_numpy().astype(np.int64)
        arr = np.minimum(arr, T - 1)
        dep = np.clip(np.maximum(dep, arr + 1), None, T)
        # sockets: each station belongs to the first socket group whose pattern matches it; within its group
        # one socket per station (the group's sorted station ids over the whole dataset, so a station keeps
        # its socket in every split), wrapped if the group has fewer sockets than stations. A session whose
        # socket is taken goes to the group's first free socket, else it is rejected.
        groups = cfg.ev.groups
        first = np.cumsum([0] + [g.count for g in groups])  # first socket of each group
        group_of = self.station_groups()
        seen = [0] * len(groups)
        station_socket = {}
        for st, gi in group_of.items():  # sorted by station id
            station_socket[st] = first[gi] + seen[gi] % groups[gi].count
            seen[gi] += 1
        preferred = s.station_id.map(station_socket).to_numpy(np.int64)
        group = s.station_id.map(group_of).to_numpy(np.int64)
        socket = np.full(len(s), -1, dtype=np.int64)
        free_at = np.zeros(cfg.ev.n_sockets, dtype=np.int64)  # first step each socket is free again
        for j in range(len(s)):  # once per split, not per env step
            p = preferred[j]
            if free_at[p] <= arr[j]:
                k = p
            else:
                lo = first[group[j]]
                free = np.flatnonzero(free_at[lo : first[group[j] + 1]] <= arr[j])
                if len(free) == 0:
                    continue
                k = lo + free[0]
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


def _arrival_tables(sessions: pd.DataFrame, T: int, n_sockets: int) -> tuple[np.ndarray, np.ndarray]:
    need = np.zeros((T, n_sockets), dtype=np.float64)
    stay = np.zeros((T, n_sockets), dtype=np.int64)
    ok = sessions[~sessions.rejected]
    t = ok.arrival_step.to_numpy()
    k = ok.socket.to_numpy()
    need[t, k] = ok.need_kwh.to_numpy()
    stay[t, k] = (ok.departure_step - ok.arrival_step).to_numpy()
    return need, stay


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
    files = {name: data_dir / f"{name}.parquet" for name in ("hourly", "sessions")}
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
