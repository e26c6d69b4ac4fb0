"""Causal MOER forecasts for the planner: what the MOER will be over the next hours, from what was realised before.

A forecaster for a split is a callable ``(t, H) -> (H,) kg/kWh`` for steps ``t .. t+H-1`` (or None while it warms up),
refit at the start of a day at most on pairs whose target was realised before that day:

- :class:`MOERRegression`: one linear least-squares model per lead on the data's forecasts, the last two hours'
  MOER, the same-hour profile and the hour of day, refit every day on the split's past (``mpc``'s forecast); with a
  half-life, the past pairs are weighted down exponentially with their age, and with ``five_minute`` it also reads
  what a 5-minute source says at the hour start (the learned planners' forecast: both, half-life
  :data:`LEARNED_HALF_LIFE_DAYS`);
- :func:`profile_outlook`: the warm-up forecast, while the regression has too few days of pairs: the data's own
  forecasts, then the same-hour profile of the last days.

Leads are in hours at every step: at steps below the hour the regression runs on the split's hourly view
(:func:`hourly_view`: each hour's mean MOER, the data's forecasts and 5-minute values as issued at the hour's start) and
forecasts hourly means, issued at each hour's start; the planner spreads them over its steps
(:meth:`pipeline.control.mpc.MPCController.moer_outlook`).

How well each forecasts, and what it does to the plan, is measured in ``docs/lab/moer-forecast.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd
from threadpoolctl import ThreadpoolController

from envs import timestep
from envs.config import SiteConfig
from envs.site import SplitData

PROFILE_DAYS = 7
"""Days of realised MOER averaged per hour of day in the causal forecast beyond the data's forecasts."""
LEVEL_DECAY_H = 6.0
"""e-folding time, hours, of the data's last forecast's deviation from that profile, carried beyond it."""
REGRESSION_WARMUP_DAYS = 7
"""Days of (features, realised MOER) pairs the regression forecast needs per lead before it replaces the profile."""
LEARNED_HALF_LIFE_DAYS = 21.0
"""Half-life, days, of the pairs' weight in the learned planners' MOER regression, chosen on the train split (by the
forecast's mean R^2 over leads 0-23 h, then re-checked on the planner's train CO2 once the 5-minute regressors were
added; ``docs/agents.md``, "How every value was chosen")."""
RIDGE = 1e-6
"""Ridge penalty of the MOER regression per pair (features are of order 0.1-1): only keeps the normal equations
well posed (e.g. a constant feature column on a synthetic site); no shrinkage worth the name on real data."""


@dataclass(frozen=True)
class HourlyView:
    """A split's hourly series, what the MOER forecasts read (:func:`hourly_view`): ``config`` (the split's, at
    ``dt_h = 1``), ``time`` (UTC hour starts, ``(T_h,)``), ``moer`` (each hour's mean, kg/kWh, ``(T_h,)``), ``moer_fc``
    (``(T_h, 3)``) and ``moer_5min`` (``(T_h, 14)`` or None), as issued at each hour's start."""

    config: SiteConfig
    time: pd.DatetimeIndex
    moer: np.ndarray
    moer_fc: np.ndarray
    moer_5min: np.ndarray | None

    @property
    def num_steps(self) -> int:
        """Hours ``T_h``."""
        return len(self.time)


def hourly_view(data: SplitData) -> SplitData | HourlyView:
    """The split as the forecasts read it, one row per hour: ``data`` itself at hourly steps; at steps below the hour
    (``n`` a hour) each hour's mean MOER over its ``n`` steps and the forecast columns of its first step (issued at the
    hour's start). The split starts on a local midnight (a whole hour in UTC); a last incomplete hour is left out."""
    n = timestep.steps_per_hour(data.dt_h)
    if n == 1:
        return data
    T = data.num_steps // n
    return HourlyView(
        config=data.config.replace(dt_h=1.0),
        time=data.time[: T * n : n],
        moer=np.asarray(data.moer[: T * n], np.float64).reshape(T, n).mean(1),
        moer_fc=np.asarray(data.moer_fc[: T * n : n], np.float64),
        moer_5min=None if data.moer_5min is None else np.asarray(data.moer_5min[: T * n : n], np.float64),
    )


@functools.cache
def _blas() -> ThreadpoolController:
    """The process's thread pools as found once (a fresh search of the loaded libraries costs about 3 ms)."""
    return ThreadpoolController()


def profile_outlook(data: SplitData, t: int, H: int) -> np.ndarray:
    """The warm-up MOER forecast over steps ``t .. t+H-1``, kg/kWh.

    The data's forecasts issued at ``t`` (``moer_fc``) for the steps they cover; beyond them the mean realised MOER at
    the same hour of day over the last :data:`PROFILE_DAYS` days before ``t`` (:func:`same_hour_mean`), shifted by the
    last data forecast's deviation from that profile, which decays with an e-folding time of :data:`LEVEL_DECAY_H`;
    before any past day exists, the last data forecast held flat.

    Returns:
        ``(H,)`` float64.
    """
    day = timestep.steps_per_day(data.config.dt_h)
    n_fc = min(H, data.moer_fc.shape[1])
    out = np.empty(H)
    out[:n_fc] = data.moer_fc[t, :n_fc]
    if H > n_fc:
        last = n_fc - 1
        k = np.arange(n_fc, H)
        profile = same_hour_mean(data.moer, np.array([t]), k, day)[0]
        level = data.moer_fc[t, last] - same_hour_mean(data.moer, np.array([t]), np.array([last]), day)[0, 0]
        fallback = data.moer_fc[t, last]
        out[n_fc:] = np.where(
            np.isnan(profile), fallback, profile + np.nan_to_num(level) * np.exp(-(k - last) / LEVEL_DECAY_H)
        )
    return out


def same_hour_mean(moer: np.ndarray, t: np.ndarray, k: np.ndarray, day: int, days: int = PROFILE_DAYS) -> np.ndarray:
    """Mean realised MOER at the hour of day of steps ``t + k`` over the last ``days`` days strictly before ``t``.

    Args:
        moer: ``(T,)`` realised MOER, kg/kWh. t: ``(n,)`` issue steps. k: ``(H,)`` leads, steps. day: steps per day.

    Returns:
        ``(n, H)`` kg/kWh; NaN where none of those days lies in the split.
    """
    j = np.arange(1, days + 1)
    lead = k[None, :, None]
    past = t[:, None, None] + lead - day * (lead // day + j[None, None, :])  # strictly before t
    vals = np.where(past >= 0, moer[np.maximum(past, 0)], 0.0)
    n = (past >= 0).sum(-1)
    return np.where(n > 0, vals.sum(-1) / np.maximum(n, 1), np.nan)


class MOERRegression:
    """Causal MOER forecast for leads ``0..H-1``: one linear least-squares model per lead, refit every day.

    The MOER at ``t + k`` is regressed on ``[moer_fc_h0, moer_fc_h1, moer_fc_h2]`` issued at ``t``, the realised
    MOER at ``t - 1`` and ``t - 2``, :func:`same_hour_mean` at ``t + k``, and a one-hot of the step of the local day
    of ``t + k`` (which holds the intercept). At step ``t`` the model of lead ``k`` has been fit on every pair
    ``(s, s + k)`` with ``s >= 1 day`` and ``s + k`` before the start of ``t``'s day (counted in steps from the
    split's start), so it only uses MOER realised before ``t``. The normal equations are accumulated as the days
    pass (a few ms per split). Forecasts are clipped at 0.

    With ``half_life_days`` > 0 the fit is exponentially weighted least squares (recursive least squares with
    forgetting): a pair enters the normal equations at the start of the day after its target step with weight 1, and
    every weight halves each ``half_life_days`` days after that, so the model follows the MOER's seasons. The weights
    depend only on the pairs' target days and the day forecast, so fitting a split's first days in one go (a backtest
    that starts mid-split) gives the same model as fitting them day after day.

    With ``five_minute`` and a split whose data come from a 5-minute source with forecasts
    (:attr:`~envs.site.SplitData.moer_5min`), the regressors also hold what that source says at ``t``'s start: the
    last realised 5 minutes, the mean of the last 15, and the forecasts for the twelve 5-minute intervals of step
    ``t`` (all issued or realised by then). Without such data it is the regression above.

    Args:
        data: the split. horizon: H, steps.
        half_life_days: days for a pair's weight to halve; 0: every pair counts alike (``mpc``'s forecast).
        five_minute: add the 5-minute regressors where the data have them (``mpc``: no).

    Raises:
        ValueError: a negative half-life.
    """

    def __init__(
        self, data: SplitData | HourlyView, horizon: int, half_life_days: float = 0.0, five_minute: bool = False
    ):
        if not half_life_days >= 0:
            raise ValueError(f"MOERRegression: half_life_days must be >= 0 (0: no forgetting), got {half_life_days}")
        self.day = timestep.steps_per_day(data.config.dt_h)
        self.H = horizon
        self.half_life_days = float(half_life_days)
        T = data.num_steps
        local = data.time.tz_convert(data.config.timezone)
        minutes = np.asarray(local.hour * 60 + local.minute)
        step_of_day = (minutes // max(1, int(round(data.config.dt_h * 60)))) % self.day
        m = np.asarray(data.moer, np.float64)
        prof = same_hour_mean(m, np.arange(T), np.arange(horizon), self.day)  # (T, H)
        fc = np.asarray(data.moer_fc, np.float64)
        prof = np.where(np.isnan(prof), fc[:, -1:], prof)
        m1 = np.r_[fc[0, 0], m[:-1]]
        m2 = np.r_[m1[0], m1[:-1]]
        base = np.column_stack([fc[:, :3] if fc.shape[1] >= 3 else np.repeat(fc[:, -1:], 3, 1), m1, m2])  # (T, 5)
        self.five_minute = bool(five_minute and data.moer_5min is not None)
        if self.five_minute:
            base = np.column_stack([base, data.moer_5min])  # (T, 19)
        self._base, self._prof, self._step_of_day, self.moer = base, prof, step_of_day, m
        F = base.shape[1] + 1 + self.day
        self._gram = np.zeros((horizon, F, F))
        self._rhs = np.zeros((horizon, F))
        self._pairs = np.zeros(horizon, np.int64)
        self._weight_sum = np.zeros(horizon)  # the pairs' weights summed (their number without forgetting)
        self._fitted_to = 0  # the pairs whose target step lies before this one are in the normal equations
        self._weights: np.ndarray | None = None

    def features(self, s: np.ndarray, k: int) -> np.ndarray:
        """Regressors of the MOER at ``s + k`` issued at steps ``s``, ``(len(s), F)``."""
        onehot = np.eye(self.day)[self._step_of_day[s + k]]
        return np.column_stack([self._base[s], self._prof[s, k], onehot])

    def _fit_to(self, end: int) -> None:
        """Add every pair with target step in ``[_fitted_to, end)`` and refit the leads' weights.

        On one BLAS thread: the products are small (``F`` of order 10-50 columns), and BLAS threads that wait on each
        other while the cores are busy (a study's other runs) made this fit 70 to 100 times slower (4.5 s against 0.06
        s for 140 days of caltech pairs on a loaded 2-core machine); it is also how the study's Dask workers run it, so
        a run on its own gives their numbers.
        """
        with _blas().limit(limits=1, user_api="blas"):
            self._fit_to_unlimited(end)

    def _fit_to_unlimited(self, end: int) -> None:
        # a pair that entered the normal equations n steps ago weighs 0.5 ** (n / halving) (1 without forgetting)
        halving = self.day * self.half_life_days if self.half_life_days > 0 else np.inf
        decay = 0.5 ** ((end - self._fitted_to) / halving)
        self._gram *= decay
        self._rhs *= decay
        self._weight_sum *= decay
        for k in range(self.H):
            s = np.arange(max(self.day, self._fitted_to - k), max(self.day, end - k))
            if len(s):
                A = self.features(s, k)
                entered = (s + k) // self.day * self.day + self.day  # the day start after the target step
                w = 0.5 ** ((end - entered) / halving)
                self._gram[k] += A.T @ (A * w[:, None])
                self._rhs[k] += A.T @ (self.moer[s + k] * w)
                self._pairs[k] += len(s)
                self._weight_sum[k] += w.sum()
        self._fitted_to = end
        if self._pairs.min() >= REGRESSION_WARMUP_DAYS * self.day:
            ridge = np.eye(self._gram.shape[-1])[None] * (RIDGE * self._weight_sum[:, None, None])
            self._weights = np.linalg.solve(self._gram + ridge, self._rhs[..., None])[..., 0]

    def __call__(self, t: int, H: int) -> np.ndarray | None:
        """Forecast for steps ``t .. t+H-1`` (``H <= horizon``), kg/kWh, or None while still warming up."""
        start = t - t % self.day
        if start < self._fitted_to:  # asked about an earlier day than the last: forget what came after it
            self._gram[:], self._rhs[:], self._pairs[:], self._weight_sum[:] = 0.0, 0.0, 0, 0.0
            self._fitted_to, self._weights = 0, None
        if start > self._fitted_to:
            self._fit_to(start)
        if self._weights is None:
            return None
        X = np.empty((H, self._weights.shape[1]))  # features(np.array([t]), k)[0] for k in 0..H-1, in one go
        nb = self._base.shape[1]
        X[:, :nb] = self._base[t]
        X[:, nb] = self._prof[t, :H]
        X[:, nb + 1 :] = np.eye(self.day)[self._step_of_day[t : t + H]]
        return np.maximum(np.einsum("hf,hf->h", X, self._weights[:H]), 0.0)
