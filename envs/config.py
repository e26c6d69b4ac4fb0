"""The site config: the schema of a site TOML (one frozen dataclass per table), how it is read and checked.

A site TOML such as ``envs/sites/caltech.toml`` holds the site's sizes (``[pv]``, ``[bess]``, ``[ev]`` with its
``[[ev.sockets]]`` groups, ``[grid]``), its ``splits``, the training ``[episode]``, the ``[reward]`` weights and the
``[mpc]`` settings, plus two tables the pipeline reads (``[sources]``, ``[sizing]``). :func:`load_config` reads one
into a :class:`SiteConfig`: every table through :class:`envs.toml_table.TomlTable` (an unknown key is an error with
the closest known key; types, ranges (:data:`RULES`) and choices checked key by key), then :func:`check_config`
checks what spans several keys. Every message names the file and the dotted key.

The site's processed data and what is cut from it per split are :mod:`envs.site`.

Units: power kW, energy kWh, carbon intensity kg CO2/kWh, time steps of ``dt_h`` hours.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs import timestep
from envs.errors import InputError
from envs.toml_table import REQUIRED, Range, TomlTable

SITES_DIR = Path(__file__).resolve().parent / "sites"


class ConfigError(InputError):
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
    """The stationary battery (``[bess]``): its size, efficiencies and state-of-charge window."""

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

    def group_of_socket(self) -> np.ndarray:
        """Each socket's group, an index into :attr:`groups`: shape ``(n_sockets,)`` int64, groups in order."""
        return np.repeat(np.arange(len(self.groups), dtype=np.int64), [g.count for g in self.groups])


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
    """The train and test splits (``[splits]``): inclusive local dates in the site ``timezone``."""

    train: tuple[str, str] = ("2019-05-01", "2019-12-31")
    """Inclusive local dates of the training split."""
    test: tuple[str, str] = ("2021-05-01", "2021-08-31")
    """Inclusive local dates of the test split."""


@dataclass(frozen=True)
class EpisodeConfig:
    """Training episodes (``[episode]``): their length and the demand augmentation of training windows."""

    train_h: float = 168.0
    """Length of a training episode, hours (a week; :func:`envs.timestep.steps` turns it into steps)."""
    session_keep_min: float = 1.0
    """Demand augmentation for training windows: each window keeps every arriving EV session with a
    probability drawn uniformly from ``[session_keep_min, 1]`` (1.0: keep all). Full-split runs (evaluation,
    baselines, the oracle) always keep every session."""


@dataclass(frozen=True)
class RewardConfig:
    """The reward's weights (``[reward]``): ``-(w_co2 * CO2 + w_unserved * unserved + w_peak * peak) * scale``."""

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
    """The model-predictive controllers (``[mpc]``): whether they run, their horizon and expected demand."""

    enabled: bool = True
    """Run the model-predictive controllers (``mpc`` and ``mpc_perfect``, ``pipeline/control/mpc.py``) in the
    pipeline."""
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
    dt_h: float = 0.25
    """The step, hours: a whole-minute divisor of the hour (:data:`envs.timestep.STEP_MINUTES`; 0.25 is 15 minutes, 1
    the hourly study), read to any precision and kept as ``minutes / 60`` exactly (``0.0833333`` is 5 minutes)."""
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

    @property
    def episode_steps(self) -> int:
        """Steps of a training episode: ``episode.train_h`` hours at the site's step (:func:`envs.timestep.steps`)."""
        return timestep.steps(self.episode.train_h, self.dt_h)

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

    def replace(self, **sections: dict[str, Any] | Any) -> SiteConfig:
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


SAPM_MODELS = (
    "open_rack_glass_glass",
    "close_mount_glass_glass",
    "open_rack_glass_polymer",
    "insulated_back_glass_polymer",
)
"""Values of ``pv.temperature_model``: the SAPM parameter sets of ``pvlib.temperature.TEMPERATURE_MODEL_PARAMETERS``."""

_FRACTION = Range(ge=0, le=1, what="a fraction")
_EFFICIENCY = Range(gt=0, le=1)
_WEIGHT = Range(ge=0)

RULES: dict[str, Range | tuple[str, ...]] = {
    "dt_h": Range(gt=0, unit="hours"),
    "pv.kwp": Range(ge=0, unit="kWp"),
    "pv.tilt_deg": Range(ge=0, le=90, unit="degrees"),
    "pv.azimuth_deg": Range(ge=0, lt=360, unit="degrees east of north"),
    "pv.latitude": Range(ge=-90, le=90, unit="degrees"),
    "pv.longitude": Range(ge=-180, le=180, unit="degrees"),
    "pv.altitude_m": Range(ge=-500, le=9000, unit="m"),
    "pv.transposition": ("haydavies", "isotropic"),
    "pv.temperature_model": SAPM_MODELS,
    "pv.gamma_pdc": Range(ge=-0.1, le=0, unit="per K"),
    "pv.dc_ac_ratio": Range(gt=0),
    "pv.eta_inv_nom": _EFFICIENCY,
    "pv.system_losses_pct": Range(ge=0, lt=100, unit="percent"),
    "bess.capacity_kwh": Range(ge=0, unit="kWh"),
    "bess.power_kw": Range(ge=0, unit="kW"),
    "bess.eta_charge": _EFFICIENCY,
    "bess.eta_discharge": _EFFICIENCY,
    "bess.soc_min": _FRACTION,
    "bess.soc_max": _FRACTION,
    "bess.soc_initial": _FRACTION,
    "ev.n_sockets": Range(ge=1),
    "ev.socket_kw": Range(gt=0, unit="kW"),
    "ev.sockets.count": Range(ge=1),
    "ev.sockets.kw": Range(gt=0, unit="kW"),
    "grid.import_limit_kw": Range(gt=0, unit="kW"),
    "grid.export_credit": EXPORT_CREDITS,
    "grid.base_load_kw": Range(ge=0, unit="kW"),
    "episode.train_h": Range(gt=0, unit="hours"),
    "episode.session_keep_min": Range(gt=0, le=1, what="a probability"),
    "reward.w_co2": _WEIGHT,
    "reward.w_unserved": _WEIGHT,
    "reward.w_peak": _WEIGHT,
    "reward.scale": _WEIGHT,
    "mpc.horizon_h": Range(ge=1, unit="hour"),
    "mpc.expected_demand_days": Range(ge=0, unit="days"),
    "mpc.expected_demand_weight": Range(ge=0, le=1),
}
"""The range (:class:`envs.toml_table.Range`) or the allowed values of a key of the site TOML, by dotted key
(``ev.sockets.count``: of each ``[[ev.sockets]]`` group); checked while the TOML is read. Every number of the
config must also be finite."""

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

_DATES = 'two dates ["YYYY-MM-DD", "YYYY-MM-DD"]'
_STATIONS = 'a station-id pattern (a glob such as "CA-*") or a non-empty list of them'


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> SiteConfig:
    """Build and check a :class:`SiteConfig` from nested dicts (the TOML's structure).

    Raises:
        ConfigError: an unknown table or key (typos are not ignored; the message suggests the closest
            known key), a wrong type, a value outside its range (:data:`RULES`) or an unknown time zone, or an
            inconsistency between keys (see :func:`check_config`); the message names ``source`` and the
            dotted key.
    """
    top = TomlTable(raw, "", source, ConfigError)
    fields = {f.name: f for f in dataclasses.fields(SiteConfig)}
    top.check_keys(fields)
    kwargs: dict[str, Any] = {}
    for key in raw:
        if key in _RAW_TABLES:
            kwargs[key] = top.table(key).raw
        elif key in _SECTIONS:
            kwargs[key] = _read_section(top.table(key), _SECTIONS[key])
        else:
            kwargs[key] = _read_value(top, key, str(fields[key].type))
    cfg = SiteConfig(**kwargs)
    check_config(cfg, source)
    return dataclasses.replace(cfg, dt_h=timestep.exact_dt_h(cfg.dt_h))


RENAMED = {"episode.train_steps": "episode.train_h (the episode's length in hours: 168 is a week at every step)"}
"""Keys of earlier versions of the site TOML and what replaced them: an error names the new key."""


def _read_section(t: TomlTable, cls: type) -> Any:
    """One table of the config as its dataclass ``cls`` (keys left out keep their defaults)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in t.raw:
        if t.dotted(k) in RENAMED:
            raise t.err(k, f"was replaced by {RENAMED[t.dotted(k)]}")
    t.check_keys(fields)
    kwargs = {k: _read_value(t, k, str(fields[k].type)) for k in t.raw}
    if cls is EVConfig and kwargs.get("sockets"):  # with groups, the one-kind keys are derived
        kwargs.setdefault("n_sockets", sum(g.count for g in kwargs["sockets"]))
        kwargs.setdefault("socket_kw", max(g.kw for g in kwargs["sockets"]))
    return cls(**kwargs)


def _read_value(t: TomlTable, k: str, type_name: str) -> Any:
    """The key ``k`` of ``t`` as a field of type ``type_name`` (the dataclass annotation), with its rule."""
    rule = RULES.get(t.dotted(k))
    if t.dotted(k) == "ev.sockets":
        return _socket_groups(t)
    if t.dotted(k) == "timezone":
        return t.timezone(k)
    if type_name in ("float", "float | None"):
        return t.number(k, None if "None" in type_name else REQUIRED, rule)
    if type_name == "int":
        return t.integer(k, range=rule)
    if type_name == "bool":
        return t.boolean(k)
    if type_name == "str":
        return t.string(k, choices=rule)
    if type_name == "tuple[str, str]":
        return t.strings(k, length=2, expect=_DATES)
    raise TypeError(f"{t.where(k)}: no reader for a field of type {type_name}")  # pragma: no cover - schema bug


def _socket_groups(ev: TomlTable) -> tuple[SocketGroup, ...]:
    """Parse ``ev.sockets`` (a TOML array of tables ``[[ev.sockets]]``, or a list of dicts) into groups.

    Raises:
        ConfigError: not a list of tables, an unknown or missing key, a wrong type, ``count < 1``, ``kw <= 0``,
            or an empty or non-string ``stations`` pattern; the message names the file and the dotted key
            with the group's index, e.g. ``ev.sockets[1].kw``.
    """
    groups = []
    for g in ev.tables("sockets", expect="an array of tables ([[ev.sockets]] with count, kw and stations)"):
        g.check_keys(("count", "kw", "stations"))
        g.require("count", "kw", why=" (each [[ev.sockets]] needs count and kw)")
        count = g.integer("count", range=RULES["ev.sockets.count"])
        kw = g.number("kw", range=RULES["ev.sockets.kw"])
        groups.append(SocketGroup(count, kw, g.strings("stations", ("*",), scalar=True, expect=_STATIONS)))
    return tuple(groups)


def check_config(cfg: SiteConfig, source: str = "<config>") -> None:
    """Check what spans several keys of a config (each key's type and range are checked when it is read, by
    :func:`config_from_dict`: check a config built by hand with ``config_from_dict(dataclasses.asdict(cfg))``).

    Raises:
        ConfigError: naming ``source`` and the offending key: ``dt_h`` that is not a whole-minute divisor of the hour
            (:func:`envs.timestep.step_minutes`), a training episode shorter than one step, ``bess.soc_min >=
            bess.soc_max``, ``bess.soc_initial`` outside them, ``ev.n_sockets`` or ``ev.socket_kw`` contradicting the
            ``[[ev.sockets]]`` groups, a ``grid.export_credit`` without export, a base load above the import limit,
            unparsable or empty or overlapping split dates.
    """

    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{source}: key '{key}' {msg}")

    try:
        timestep.step_minutes(cfg.dt_h)
    except timestep.StepError as exc:
        raise bad("dt_h", f"= {cfg.dt_h!r}: {exc}") from None
    if cfg.episode.train_h < cfg.dt_h:
        raise bad("episode.train_h", f"({cfg.episode.train_h:g} h) is shorter than one step (dt_h = {cfg.dt_h:g} h)")
    b = cfg.bess
    if b.soc_min >= b.soc_max:
        raise bad("bess.soc_min", f"({b.soc_min}) must be below bess.soc_max ({b.soc_max})")
    if not b.soc_min <= b.soc_initial <= b.soc_max:
        raise bad("bess.soc_initial", f"({b.soc_initial}) must lie in [soc_min, soc_max]")
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
    if cfg.grid.export_credit != "none" and not cfg.grid.export_allowed:
        raise bad(
            "grid.export_credit",
            f"= {cfg.grid.export_credit!r} needs grid.export_allowed = true (nothing is exported to credit)",
        )
    if cfg.grid.base_load_kw > cfg.grid.import_limit_kw:
        raise bad(
            "grid.base_load_kw", f"({cfg.grid.base_load_kw}) exceeds grid.import_limit_kw ({cfg.grid.import_limit_kw})"
        )
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
