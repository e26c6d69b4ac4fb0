"""What the site's recent past says about the hours ahead: the observation's context features, and the prior of the
DC fast-charger sessions that training may add where the training split has none.

Context features (per step ``t`` of a split, computed once as a table; every number is realised by ``t``):

* per socket group ``g`` (:meth:`~envs.config.EVConfig.groups`, the DC socket apart from the Level-2 ones), the EV
  energy expected to arrive over the next :data:`CONTEXT_WINDOWS_H` hours: for each step ``u`` of the window, the mean
  energy that arrived at ``g`` at the same time of day on the last :data:`CONTEXT_DAYS` days of ``u``'s day type
  (weekday or weekend, local time) in the split so far (the equal-weight past days ``mpc_scenario`` plans with), summed
  over the window and scaled by the group's power over the window's hours (``kWh / (sum kW * h) * 4``);
* the MOER at leads :data:`CONTEXT_MOER_LEADS_H` hours: the mean realised MOER of the same hour over the last 7 days of
  the split (the data's own forecast covers leads 0-2 h in the observation already), centred and scaled as the
  observation's other MOER features; the data's forecast for the step where no past day exists.

DC prior (training only, ``dc_prior=True`` in :class:`~envs.evhub.EVHubVectorEnv`): each training window gives each
DC socket (power above :data:`LEVEL2_MAX_KW`) a rate of sessions per day drawn uniformly from ``[0,``
:data:`DC_SESSIONS_PER_DAY_MAX` ``]``, spread over the day as the split's own arrivals are (all groups); a session asks
for an energy uniform in :data:`DC_SESSION_KWH` and stays ``ceil(energy / (kW * dt))`` steps (one hour at 50 kW), its
deadline floor then asking for all of it in that time. The ranges come from public DC fast-charging figures, not
from any split:

* 9.6 kWh a session (mean, 20.3 minutes at 30.5 kW average power on 50 kW chargers; Figenbaum, "Charging into the
  future - analysis of fast charger usage", TOI report, Norway, 2017) up to 40.7 kWh (mean at free-of-charge DC
  chargers, 78 minutes; 22 kWh at paid ones, 42 minutes; US DOE Vehicle Technologies Office, 2.3 million non-Tesla
  DC sessions, June 2020 - June 2023);
* about 4 sessions a day per public DC charger (US DOE EV Project, ECOtality, 2013): the rate's range is centred
  there, from none (a charger nobody uses) to twice that.

Exogenous prior (training only, ``exo_prior=True``): each training window plans on another year's MOER and PV, made
from its own by three factors drawn uniformly, per window, within the month-to-month spread of the training steps
(:func:`exo_spread`: each calendar month's ratio to the whole, over the steps training may read): the MOER level
``l`` and contrast ``c`` (``m' = max(0, l * mu + c * (m - mu))``, ``mu`` the training steps' mean MOER; the
observation's MOER features, the context's included, and the reward read ``m'``) and the PV scale ``s``
(``pv' = s * pv``, the PV features too). The later months of a year are its stand-in for a new regime: a window of May
then practises the level of August, and the reverse. A split of one month gives factors of 1.
"""

from __future__ import annotations

import numpy as np

from envs import timestep
from envs.site import SplitData

CONTEXT_WINDOWS_H = ((1, 6), (7, 24))
"""Hours ahead whose expected arrivals the context sums, inclusive: ``(1, 6)`` is steps ``t+1 .. t+6`` at 1-hour
steps (the leads where a plan's value lies), ``(7, 24)`` the rest of the next day."""
CONTEXT_DAYS = 21
"""Past days of the same type the expected arrivals average over: ``mpc_scenario``'s scenario count (K = 21, chosen on
the train split; docs/agents.md)."""
CONTEXT_MOER_LEADS_H = (3, 4, 5)
"""Leads, hours, of the context's MOER (same-hour mean of the last 7 days)."""
MOER_PROFILE_DAYS = 7

LEVEL2_MAX_KW = 19.2
"""Most power of an AC Level-2 socket, kW (SAE J1772: 80 A at 240 V); a socket above it is a DC fast charger."""
DC_SESSION_KWH = (9.6, 40.7)
"""Energy range of a prior DC session, kWh (module docstring: TOI 2017, US DOE VTO 2020-2023)."""
DC_SESSIONS_PER_DAY_MAX = 8.0
"""Top of the prior's sessions per day per DC socket (module docstring: twice the EV Project's mean of about 4)."""


def n_context(n_groups: int) -> int:
    """Number of context features of a site with ``n_groups`` socket groups: two windows per group plus the MOER
    leads."""
    return len(CONTEXT_WINDOWS_H) * n_groups + len(CONTEXT_MOER_LEADS_H)


def _day_steps(data: SplitData) -> int:
    return timestep.steps_per_day(data.config.dt_h)


def _group_kw(data: SplitData) -> np.ndarray:
    """Each socket group's total power, ``(G,)`` float64, kW."""
    return np.array([g.count * g.kw for g in data.config.ev.groups])


def _window_features(cum: np.ndarray, group_kw: float, data: SplitData, scale: float = 1.0) -> list[np.ndarray]:
    """The context's windows (:data:`CONTEXT_WINDOWS_H`) of one group at every step ``t``: the energy arriving over
    steps ``t + lo .. t + hi`` from its cumulative sum ``cum`` (``cum[k]`` = kWh over steps ``0 .. k-1``, at least
    ``T + day + 1`` long) times ``scale``, as ``kWh / (group kW * window hours) * 4``; one ``(T,)`` array a window."""
    dt, D, t = data.config.dt_h, _day_steps(data), np.arange(data.num_steps)
    out = []
    for lo_h, hi_h in CONTEXT_WINDOWS_H:
        lo, hi = max(1, round(lo_h / dt)), min(D, round(hi_h / dt))
        out.append(scale * (cum[t + hi + 1] - cum[t + lo]) / (group_kw * (hi - lo + 1) * dt) * 4.0)
    return out


def group_arrivals_kwh(data: SplitData) -> np.ndarray:
    """EV energy arriving at each socket group at each step, ``(T, G)`` float64, kWh (``arrival_need_kwh``)."""
    groups = data.config.ev.group_of_socket()
    onehot = np.zeros((len(groups), len(data.config.ev.groups)))
    onehot[np.arange(len(groups)), groups] = 1.0
    return data.arrival_need_kwh @ onehot


def expected_arrivals_kwh(data: SplitData, days: int = CONTEXT_DAYS) -> np.ndarray:
    """The expected energy arriving at each group at steps ``u = 0 .. T + day - 1``: ``(T + day, G)`` float64, kWh, the
    mean over the last ``days`` days ``j >= 1`` of ``u``'s day type with ``u - j * day >= 0`` (0 where none), so every
    number for step ``u`` is realised by ``u - day``."""
    D = _day_steps(data)
    arrived = group_arrivals_kwh(data)
    T, G = arrived.shape
    n = T + D
    weekend = data.weekend(n)
    u = np.arange(n)
    total = np.zeros((n, G))
    count = np.zeros(n)
    for j in range(1, n // D + 1):
        src = u - j * D
        ok = (src >= 0) & (count < days)
        ok[ok] &= weekend[src[ok]] == weekend[u[ok]]
        total[ok] += arrived[src[ok]]
        count[ok] += 1
        if not ok.any() and (src < 0).all():
            break
    return total / np.maximum(count, 1.0)[:, None]


def context_table(data: SplitData) -> np.ndarray:
    """The context features of every step of ``data`` (module docstring), ``(T, n_context(G))`` float64: per group the
    windows of :data:`CONTEXT_WINDOWS_H` (group after group, scaled), then the MOER leads in kg/kWh (the env centres
    and scales them as its other MOER features)."""
    dt, D, T = data.config.dt_h, _day_steps(data), data.num_steps
    expected = expected_arrivals_kwh(data)
    c = np.concatenate([np.zeros((1, expected.shape[1])), np.cumsum(expected, 0)])
    cols = []
    for g, kw in enumerate(_group_kw(data)):
        cols += _window_features(c[:, g], kw, data)
    t = np.arange(T)
    for lead_h in CONTEXT_MOER_LEADS_H:
        lead = round(lead_h / dt)
        total, count = np.zeros(T), np.zeros(T)
        for j in range(1, MOER_PROFILE_DAYS + 1):
            src = t + lead - j * D
            ok = (src >= 0) & (src < t)
            total[ok] += data.moer[src[ok]]
            count[ok] += 1
        moer = np.where(count > 0, total / np.maximum(count, 1.0), data.moer_fc[:, 0])
        cols.append(moer)
    return np.stack(cols, axis=1)


def dc_sockets(data: SplitData) -> np.ndarray:
    """The sockets the DC prior serves (power above :data:`LEVEL2_MAX_KW`): ``(n_dc,)`` int64 indices."""
    return np.flatnonzero(data.socket_kw > LEVEL2_MAX_KW)


def arrival_share(data: SplitData) -> np.ndarray:
    """Each step's share of a day's arrivals, ``(T,)`` float64: the fraction of the split's sessions (all groups) that
    arrive at that step's local time of day (summing to 1 over a day; uniform where the split has no session)."""
    D = _day_steps(data)
    local = data.time.tz_convert(data.config.timezone)
    slot = ((local.hour * 60 + local.minute) * D // 1440).to_numpy()
    counts = np.bincount(slot, weights=(data.arrival_stay_steps > 0).sum(1), minlength=D)[:D]
    share = counts / counts.sum() if counts.sum() > 0 else np.full(D, 1.0 / D)
    return share[slot]


def exo_spread(data: SplitData, end: int | None = None) -> dict[str, float | tuple[float, float]]:
    """The month-to-month spread of the MOER and PV over steps ``0 .. end-1`` of ``data`` (default: all), the ranges
    of the exogenous prior (module docstring). Each calendar month (local time) with steps there gives its mean MOER
    over the mean of all those steps (level), its MOER standard deviation over theirs (contrast) and its mean PV power
    over theirs (PV scale); a range is the lowest and highest month's ratio ((1, 1) where the steps' MOER or PV does
    not vary, or with a single month).

    Returns:
        ``{"moer_mean": mu (kg/kWh), "level": (lo, hi), "contrast": (lo, hi), "pv_scale": (lo, hi)}``.
    """
    end = data.num_steps if end is None else int(end)
    local = data.time[:end].tz_convert(data.config.timezone)
    month = np.asarray(local.year * 12 + local.month)
    moer, pv = np.asarray(data.moer[:end], np.float64), np.asarray(data.pv_kw[:end], np.float64)
    months = np.unique(month)

    def spread(values: np.ndarray, whole: float) -> tuple[float, float]:
        if whole <= 0 or len(values) < 2:
            return 1.0, 1.0
        ratios = values / whole
        return float(ratios.min()), float(ratios.max())

    return {
        "moer_mean": float(moer.mean()),
        "level": spread(np.array([moer[month == m].mean() for m in months]), moer.mean()),
        "contrast": spread(np.array([moer[month == m].std() for m in months]), moer.std()),
        "pv_scale": spread(np.array([pv[month == m].mean() for m in months]), pv.mean()),
    }


def dc_prior_context(data: SplitData) -> np.ndarray:
    """The context a DC socket's prior adds per session-per-day of its rate: ``(T, n_context(G))`` float64, non-zero
    in the windows of the DC sockets' groups only: the prior's expected energy (the mean of :data:`DC_SESSION_KWH`
    times the window's share of a day's arrivals), scaled as :func:`context_table` scales real arrivals."""
    cfg = data.config
    D = _day_steps(data)
    share = arrival_share(data)
    # the window looks past the split's end: the share continues day after day
    share = np.concatenate([share, share[-D:], share[-D:]])
    c = np.concatenate([[0.0], np.cumsum(share)])
    groups = cfg.ev.group_of_socket()
    n_dc = np.bincount(groups[dc_sockets(data)], minlength=len(cfg.ev.groups))
    group_kw = _group_kw(data)
    mean_kwh = 0.5 * (DC_SESSION_KWH[0] + DC_SESSION_KWH[1])
    out = np.zeros((data.num_steps, n_context(len(group_kw))))
    W = len(CONTEXT_WINDOWS_H)
    for g in np.flatnonzero(n_dc):
        out[:, g * W : (g + 1) * W] = np.stack(_window_features(c, group_kw[g], data, n_dc[g] * mean_kwh), axis=1)
    return out
