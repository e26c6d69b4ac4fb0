"""A session model of the site's EV arrivals, learned from its realised past and refit each day with forgetting.

What it models, per socket group ``g`` (:attr:`envs.config.EVConfig.groups`; a session's group is its socket's):

- Arrivals. Each step ``s`` of a local day of type ``y`` (weekday or weekend, local time) and step of the local day
  ``b`` (its local hour with hourly steps) sees ``N`` arrivals at group ``g``, Poisson with rate ``f * lam[y, b, g]``
  per step, where ``f`` is a day factor shared by every step of one local day (one per group), Gamma-distributed
  with mean 1 and variance ``phi[y, g]`` (busy and quiet days: the day's count is negative binomial, its
  distribution over the day's steps multinomial). With ``dispersion=False`` ``f = 1`` (plain Poisson).
- Marks. Each arrival's stay (steps, >= 1) and energy (kWh) come from the past sessions of the same group and day
  type that arrived within ``band_h // 2`` hours of the same step of the day (circularly), each weighted as its day
  is (below); drawing resamples one of them; scoring smooths them with a product kernel: the stay log-normal around
  the session's, discretised to whole steps (``P(s) = Phi(log(s + 1/2)) - Phi(log(s - 1/2))``, the first step
  taking everything below 1.5), the energy log-normal around the session's and capped at what the socket delivers
  over the stay (``kw * stay * dt_h``; the capped mass is an atom at the cap); each bandwidth Silverman's rule on
  the weighted logs of the pool (``1.06 * sd * n_eff ** -0.2``, at least 0.05, 0.5 with fewer than 2 effective
  sessions). A pool of fewer than :data:`MIN_POOL` effective sessions falls back to every past session of the group
  and type, then of the group; a group without any past session draws no arrivals. The scored distribution mixes
  in :data:`DEFENSIVE` of a broad component (one log-normal kernel at the group's mean log stay and energy, its
  sd; :data:`DEFAULT_MARK` without past sessions) so that one odd session does not weigh like hundreds; draws
  resample the pool (the kernels' centres, without the broad part).

The fit (:meth:`SessionModel.fit_to`) at a step of local day ``D`` reads only the steps before ``D``'s first step
(causal, refit at most once a day). Each past day ``d`` weighs ``0.5 ** ((D - d - 1) / half_life_days)`` (1 the day
after it, halving every half-life; ``half_life_days = inf``: no forgetting), or, with ``recent_days = K``, 1 for the
last ``K`` days of its own type before ``D`` and 0 for the others (the past-days replay of ``mpc_scenario`` as a
distribution). With ``E[y, b]`` the weighted number of past steps of type ``y`` at step of the day ``b`` and
``C[y, b, g]`` their weighted arrivals:

- ``lam[y, b, g] = (C[y, b, g] + a * lam_y[y, g]) / (E[y, b] + a)``: shrunk towards the day type's mean rate per
  step ``lam_y[y, g] = (sum_b C[y, b, g] + day * lam_0[g]) / (sum_b E[y, b] + day)`` (``a = prior_steps``
  pseudo-steps at the type's rate, one pseudo-day at the group's), ``lam_0[g] = (sum C[., ., g] + 0.01) / (sum E +
  1)``; no rate is 0;
- ``phi[y, g]``: the method of moments on the past days of the type, ``Var(N_day) = Lam + phi * Lam ** 2``:
  ``phi = sum_d w_d ((N_d - Lam_d) ** 2 - Lam_d) / sum_d w_d Lam_d ** 2``, clipped to ``[0, 4]`` (0 with fewer than
  3 effective days), ``Lam_d`` the day's expected count under ``lam``.

Drawing (:meth:`SessionModel.draw`) at step ``t``: each scenario draws a factor per local day of the window and
group, the current day's from its posterior given the day's arrivals at steps up to ``t`` (shape ``1 / phi + n``
and rate ``1 / phi + Lam`` for ``n`` arrivals against ``Lam`` expected), later days' from the prior; then the
arrivals at steps ``t + 1 .. t + H - 1`` and their marks. Each arrival takes the lowest-numbered socket of its
group that is free at its step (given the plugged EVs' steps left, when passed, and the arrivals placed before it);
an arrival that finds every socket of its group taken is dropped, as the env rejects a session at a taken socket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from envs import timestep
from envs.site import SplitData
from pipeline.control.mpc import WindowSessions

MAX_DISPERSION = 4.0
"""Upper clip of the day factor's variance ``phi``."""
MIN_BANDWIDTH = 0.05
"""Smallest kernel bandwidth, in log units."""
DEFAULT_BANDWIDTH = 0.5
"""Kernel bandwidth (log units) of a pool of fewer than 2 effective sessions."""
MIN_POOL = 20.0
"""Fewest effective sessions (``(sum w) ** 2 / sum w ** 2``) of a pool before it falls back to a wider one."""
DEFENSIVE = 0.02
"""Share of the broad component in the scored mark distribution."""
DEFAULT_MARK = (4.0, 10.0, 1.5)
"""Broad default kernel of a group without past sessions (scoring only): stay median (h), energy median (kWh),
bandwidth (log units)."""


@dataclass
class _Fit:
    """The model as fit at the start of local day ``day`` (module docstring)."""

    day: int  # local day index whose start the fit stands at
    lam: np.ndarray  # (2, B, G) arrivals per step
    phi: np.ndarray  # (2, G) day factor variance
    w_session: np.ndarray  # (S_past,) weight of each past session
    n_past: int  # sessions arriving before the fit (the first n_past of the model's session arrays)


class SessionModel:
    """Arrivals and their stays and energies per socket group, refit each local day on the realised past.

    Args:
        data: the split whose realised past the model reads (its per-step arrival tables
            ``arrival_stay_steps``, ``arrival_need_kwh``, ``(T, N)``, and ``socket_kw``).
        half_life_days: days for a past day's weight to halve (> 0; ``np.inf``: no forgetting).
        band_h: width of the band of arrival hours whose past sessions give a session's stay and energy, hours
            (rounded to whole steps, odd: the step itself and ``band_h // 2`` each side).
        dispersion: draw a day factor per local day and group (negative binomial day counts); False: Poisson.
        recent_days: if > 0, weigh the last ``recent_days`` days of each type 1 and every other day 0 instead of the
            half-life (the past-days replay as a distribution).
        prior_steps: weight of the day type's mean rate in each step of the day's rate, in (weighted) past steps.

    Raises:
        ValueError: a half-life not > 0, ``band_h < 1``, ``recent_days < 0`` or ``prior_steps`` not > 0.
    """

    def __init__(
        self,
        data: SplitData,
        half_life_days: float = np.inf,
        band_h: float = 1.0,
        dispersion: bool = True,
        recent_days: int = 0,
        prior_steps: float = 1.0,
    ):
        if not half_life_days > 0 or band_h < 1 or recent_days < 0 or not prior_steps > 0:
            raise ValueError(
                f"SessionModel: half_life_days > 0, band_h >= 1, recent_days >= 0 and prior_steps > 0 required, got "
                f"{half_life_days}, {band_h}, {recent_days}, {prior_steps}"
            )
        cfg = data.config
        self.data = data
        self.half_life_days = float(half_life_days)
        self.dispersion = bool(dispersion)
        self.recent_days = int(recent_days)
        self.prior_steps = float(prior_steps)
        self.dt = cfg.dt_h
        self.steps_per_day = timestep.steps_per_day(cfg.dt_h)  # B, steps of the day
        self.band = timestep.steps(band_h, cfg.dt_h, at_least=0) // 2  # steps each side
        local = data.time.tz_convert(cfg.timezone)
        minutes = np.asarray(local.hour * 60 + local.minute)
        self.step_of_day = (minutes // max(1, int(round(cfg.dt_h * 60)))) % self.steps_per_day  # (T,)
        dates = np.asarray(local.normalize().tz_localize(None), dtype="datetime64[D]")
        self.day_of = (dates - dates[0]).astype(np.int64)  # (T,) local day index
        n_days = int(self.day_of[-1]) + 1
        self.day_start = np.searchsorted(self.day_of, np.arange(n_days + 1))  # (n_days + 1,) first step of each day
        self.day_type = np.zeros(n_days, np.int64)  # 1: weekend
        self.day_type[self.day_of] = np.asarray(local.day_of_week >= 5, np.int64)
        self.socket_kw = np.asarray(data.socket_kw, np.float64)
        self.group_of_socket = cfg.ev.group_of_socket()  # (N,)
        self.n_groups = len(cfg.ev.groups)
        self.group_sockets = [np.flatnonzero(self.group_of_socket == g) for g in range(self.n_groups)]
        self.group_kw = np.array([self.socket_kw[s[0]] for s in self.group_sockets])
        # every arrival of the split, in step order (the fit reads only those before its day)
        step, sock = np.nonzero(data.arrival_stay_steps > 0)
        self.s_step, self.s_group = step, self.group_of_socket[sock]
        self.s_stay = data.arrival_stay_steps[step, sock].astype(np.int64)
        self.s_need = data.arrival_need_kwh[step, sock].astype(np.float64)
        self.s_day = self.day_of[step]
        self.s_type = self.day_type[self.s_day]
        self.s_bin = self.step_of_day[step]
        # arrivals per step and group, (T, G)
        self.arrivals = np.zeros((data.num_steps, self.n_groups), np.int64)
        np.add.at(self.arrivals, (step, self.s_group), 1)
        self._fit: _Fit | None = None
        self._pools: dict = {}

    # ---------------------------------------------------------------- the fit
    def day_weights(self, day: int) -> np.ndarray:
        """Weight of each local day before ``day`` in the fit at its start, ``(day,)`` float64 (module docstring)."""
        d = np.arange(day)
        if self.recent_days:
            w = np.zeros(day)
            for y in (0, 1):
                of_type = d[self.day_type[:day] == y]
                w[of_type[-self.recent_days :]] = 1.0
            return w
        return 0.5 ** ((day - d - 1) / self.half_life_days)

    def fit_to(self, t: int) -> None:
        """Fit the model on the steps before the start of step ``t``'s local day (nothing if already fit there).

        Raises:
            IndexError: ``t`` outside ``[0, T)``.
        """
        if not 0 <= t < self.data.num_steps:
            raise IndexError(f"SessionModel.fit_to: step {t} outside [0, {self.data.num_steps})")
        day = int(self.day_of[t])
        if self._fit is not None and self._fit.day == day:
            return
        B, G = self.steps_per_day, self.n_groups
        end = int(self.day_start[day])  # first step not read
        w_day = self.day_weights(day)
        w_step = w_day[self.day_of[:end]]
        ty = self.day_type[self.day_of[:end]]
        cell = ty * B + self.step_of_day[:end]
        E = np.bincount(cell, w_step, 2 * B).reshape(2, B)
        C = np.stack([np.bincount(cell, w_step * self.arrivals[:end, g], 2 * B) for g in range(G)], -1)
        C = C.reshape(2, B, G)
        lam0 = (C.sum((0, 1)) + 0.01) / (E.sum() + 1.0)  # (G,)
        lam_y = (C.sum(1) + B * lam0) / (E.sum(1)[:, None] + B)  # (2, G)
        a = self.prior_steps
        lam = (C + a * lam_y[:, None, :]) / (E[..., None] + a)  # (2, B, G)
        phi = np.zeros((2, G))
        if self.dispersion and day > 0:
            steps_in = np.bincount(self.day_of[:end], minlength=day)
            full = steps_in >= B - 1  # whole local days (a 23-step spring-forward day counts)
            Lam = np.zeros((day, G))
            np.add.at(Lam, self.day_of[:end], lam[ty, self.step_of_day[:end]])
            N = np.zeros((day, G))
            np.add.at(N, self.day_of[:end], self.arrivals[:end])
            for y in (0, 1):
                m = full & (self.day_type[:day] == y) & (w_day > 0)
                w = w_day[m]
                if w.sum() ** 2 / max((w**2).sum(), 1e-300) < 3:
                    continue
                num = (w[:, None] * ((N[m] - Lam[m]) ** 2 - Lam[m])).sum(0)
                den = (w[:, None] * Lam[m] ** 2).sum(0)
                phi[y] = np.clip(num / np.maximum(den, 1e-12), 0.0, MAX_DISPERSION)
        n_past = int(np.searchsorted(self.s_step, end))
        self._fit = _Fit(day, lam, phi, w_day[self.s_day[:n_past]], n_past)
        self._pools = {}

    @property
    def rates(self) -> np.ndarray:
        """The fitted arrival rates, ``(2, B, G)`` arrivals per step (day type: 0 weekday, 1 weekend; step of the local
        day; socket group).

        Raises:
            RuntimeError: before :meth:`fit_to`.
        """
        if self._fit is None:
            raise RuntimeError("SessionModel.rates: call fit_to first")
        return self._fit.lam

    @property
    def dispersion_phi(self) -> np.ndarray:
        """The fitted variance of the day factor, ``(2, G)`` (0 without dispersion)."""
        if self._fit is None:
            raise RuntimeError("SessionModel.dispersion_phi: call fit_to first")
        return self._fit.phi

    def pool(self, day_type: int, step_of_day: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """The past sessions a session of that type, step of the day and group draws its stay and energy from:
        ``(index, p)``, indices into the model's session arrays and their probabilities (summing to 1); both empty
        when the group has no past session (module docstring's fallbacks)."""
        key = (day_type, step_of_day, group)
        if key in self._pools:
            return self._pools[key]
        f = self._fit
        n = f.n_past
        w = f.w_session
        grp = (self.s_group[:n] == group) & (w > 0)
        gap = np.abs(self.s_bin[:n] - step_of_day)
        gap = np.minimum(gap, self.steps_per_day - gap)
        out = (np.zeros(0, np.int64), np.zeros(0))
        for m in (grp & (self.s_type[:n] == day_type) & (gap <= self.band), grp & (self.s_type[:n] == day_type), grp):
            idx = np.flatnonzero(m)
            if len(idx):
                out = (idx, w[idx] / w[idx].sum())
                if 1.0 / (out[1] ** 2).sum() >= MIN_POOL:
                    break
        self._pools[key] = out
        return out

    # ---------------------------------------------------------------- drawing
    def draw(
        self, t: int, H: int, K: int, rng: np.random.Generator, steps_left: np.ndarray | None = None
    ) -> list[WindowSessions]:
        """``K`` scenarios of the arrivals at steps ``t + 1 .. t + H - 1`` (fit at ``t``'s day; module docstring).

        Args:
            t: the step planned at. H: the window, steps (the last step drawn is ``min(t + H, T) - 1``).
            K: scenarios. rng: the generator drawn from.
            steps_left: ``(N,)`` int, each socket's plugged EV's steps to departure (0: free); None: all free.

        Returns:
            ``K`` :class:`~pipeline.control.mpc.WindowSessions` of expected arrivals (weight 1, block 0), each in
            arrival order: the step in the window (>= 1), the departure (``arrival + stay``), both from ``t``, the
            energy (kWh, at most ``kw * stay * dt_h`` of its socket) and the socket, one of the session's group.

        Raises:
            IndexError: ``t`` outside the split. ValueError: ``H < 1`` or ``K < 1``.
        """
        if H < 1 or K < 1:
            raise ValueError(f"SessionModel.draw: H >= 1 and K >= 1 required, got {H}, {K}")
        self.fit_to(t)
        f = self._fit
        T = self.data.num_steps
        u = np.arange(t + 1, min(t + H, T))  # (n,) steps drawn
        G = self.n_groups
        ty = self.day_type[self.day_of[u]]
        lam = f.lam[ty, self.step_of_day[u]]  # (n, G)
        # the day factor of each scenario, day of the window and group
        days = np.unique(self.day_of[u]) if len(u) else np.zeros(0, np.int64)
        factor = np.ones((K, len(days), G))
        today = int(self.day_of[t])
        for j, d in enumerate(days):
            phi = f.phi[self.day_type[d]]  # (G,)
            shape, rate = 1.0 / np.maximum(phi, 1e-12), 1.0 / np.maximum(phi, 1e-12)
            if d == today:  # the day's arrivals up to t are seen
                seen = slice(int(self.day_start[d]), t + 1)
                shape = shape + self.arrivals[seen].sum(0)
                rate = rate + f.lam[self.day_type[d], self.step_of_day[seen]].sum(0)
            on = phi > 0
            factor[:, j, on] = rng.gamma(shape[on], 1.0 / rate[on], size=(K, int(on.sum())))
        day_idx = np.searchsorted(days, self.day_of[u])  # (n,)
        counts = rng.poisson(factor[:, day_idx, :] * lam[None])  # (K, n, G)
        # one row per arrival of every scenario, in scenario then step order; its stay and energy resampled
        kk, r, g = np.nonzero(counts)
        rep = counts[kk, r, g]
        kk, r, g = np.repeat(kk, rep), np.repeat(r, rep), np.repeat(g, rep)
        src = np.full(len(r), -1, np.int64)
        keys = (ty[r] * self.steps_per_day + self.step_of_day[u[r]]) * G + g
        for key in np.unique(keys):
            at = np.flatnonzero(keys == key)
            idx, p = self.pool(
                *(int(x) for x in (key // G // self.steps_per_day, key // G % self.steps_per_day, key % G))
            )
            if len(idx):
                src[at] = idx[rng.choice(len(idx), size=len(at), p=p)]
        arr_all = u[r] - t
        stay_all = np.where(src >= 0, self.s_stay[src], 0)
        need_all = np.where(src >= 0, self.s_need[src], 0.0)
        left0 = np.zeros(len(self.socket_kw), np.int64) if steps_left is None else np.asarray(steps_left, np.int64)
        sockets = [list(c) for c in self.group_sockets]
        out = []
        bounds = np.searchsorted(kk, np.arange(K + 1))
        for k in range(K):
            rows = np.arange(bounds[k], bounds[k + 1])
            rows = rows[src[rows] >= 0]  # a group without past sessions draws none
            free_at = left0.tolist()  # the window step from which each socket is free
            sock = np.full(len(rows), -1, np.int64)
            for j, (a, s, gg) in enumerate(zip(arr_all[rows].tolist(), stay_all[rows].tolist(), g[rows].tolist())):
                for i in sockets[gg]:
                    if free_at[i] <= a:
                        sock[j], free_at[i] = i, a + s
                        break
            rows, sock = rows[sock >= 0], sock[sock >= 0]
            arr, stay = arr_all[rows], stay_all[rows]
            need = np.minimum(need_all[rows], self.socket_kw[sock] * stay * self.dt)
            out.append(WindowSessions.arrivals(arr, arr + stay, need, sock))
        return out

    # ---------------------------------------------------------------- scoring
    def log_likelihood(self, start: int, steps: int | None = None) -> dict[str, float]:
        """Log-likelihood (nats) of the realised arrivals at steps ``[start, start + steps)`` and of their stays and
        energies under the model fit at ``start``'s day (days of the span after it are not refit: a week ahead).

        Args:
            start: first step scored. steps: steps scored (default a week, ``7 * B``), cut at the split's end.

        Returns:
            ``{"counts": ..., "marks": ..., "total": ..., "arrivals": n, "steps": n}``: the arrival counts'
            log-probability (per local day and group: negative binomial day total times the multinomial over its
            steps, or Poisson per step without dispersion), the marks' log-density (the stay's log-probability plus
            the energy's log-density in kWh, or the log-probability of the cap's atom), their sum, and how many
            arrivals and steps were scored.

        Raises:
            IndexError: ``start`` outside the split.
        """
        self.fit_to(start)
        f = self._fit
        T = self.data.num_steps
        stop = min(T, start + (7 * self.steps_per_day if steps is None else steps))
        u = np.arange(start, stop)
        ty = self.day_type[self.day_of[u]]
        lam = f.lam[ty, self.step_of_day[u]]  # (n, G)
        n = self.arrivals[u]  # (n, G)
        ll_counts = 0.0
        for d in np.unique(self.day_of[u]):
            m = self.day_of[u] == d
            lam_d, n_d = lam[m], n[m]
            phi = f.phi[self.day_type[d]]
            for g in range(self.n_groups):
                if phi[g] > 0:
                    r, Lam, N = 1.0 / phi[g], lam_d[:, g].sum(), n_d[:, g].sum()
                    ll_counts += float(stats.nbinom.logpmf(N, r, r / (r + Lam)))
                    ll_counts += float(
                        special.gammaln(N + 1)
                        - special.gammaln(n_d[:, g] + 1).sum()
                        + (n_d[:, g] * np.log(lam_d[:, g] / Lam)).sum()
                    )
                else:
                    ll_counts += float(stats.poisson.logpmf(n_d[:, g], lam_d[:, g]).sum())
        ll_marks = 0.0
        scored = np.flatnonzero((self.s_step >= start) & (self.s_step < stop))
        for s in scored:
            kernel = self._kernel(int(self.s_type[s]), int(self.s_bin[s]), int(self.s_group[s]))
            ll_marks += self._mark_logpdf(kernel, int(self.s_stay[s]), float(self.s_need[s]), int(self.s_group[s]))
        return {
            "counts": ll_counts,
            "marks": ll_marks,
            "total": ll_counts + ll_marks,
            "arrivals": float(len(scored)),
            "steps": float(len(u)),
        }

    def _kernel(self, day_type: int, step_of_day: int, group: int) -> tuple:
        """The pool's kernel mixture and the group's broad component (:meth:`_broad`), each ``(p, log stays, log
        energies, stay bandwidth, energy bandwidth)`` (module docstring); cached until the next refit."""
        key = ("kernel", day_type, step_of_day, group)
        if key not in self._pools:
            idx, p = self.pool(day_type, step_of_day, group)
            broad = self._broad(group)
            if len(idx):
                ls, le = np.log(self.s_stay[idx]), np.log(np.maximum(self.s_need[idx], 1e-6))
                self._pools[key] = ((p, ls, le, _silverman(ls, p), _silverman(le, p)), broad)
            else:
                self._pools[key] = (broad, broad)
        return self._pools[key]

    def _broad(self, group: int) -> tuple:
        """The group's broad mark component: one log-normal kernel at the weighted mean of the logs of its past
        sessions' stays and energies, each bandwidth their weighted sd (at least :data:`DEFAULT_BANDWIDTH`); a
        group without past sessions: :data:`DEFAULT_MARK`."""
        f = self._fit
        n = f.n_past
        m = (self.s_group[:n] == group) & (f.w_session > 0)
        if not m.any():
            stay_h, need_kwh, h = DEFAULT_MARK
            return np.ones(1), np.array([np.log(stay_h / self.dt)]), np.array([np.log(need_kwh)]), h, h
        w = f.w_session[m] / f.w_session[m].sum()
        ls, le = np.log(self.s_stay[:n][m]), np.log(np.maximum(self.s_need[:n][m], 1e-6))
        mu_s, mu_e = float(w @ ls), float(w @ le)
        sd_s = max(DEFAULT_BANDWIDTH, float(np.sqrt(w @ (ls - mu_s) ** 2)))
        sd_e = max(DEFAULT_BANDWIDTH, float(np.sqrt(w @ (le - mu_e) ** 2)))
        return np.ones(1), np.array([mu_s]), np.array([mu_e]), sd_s, sd_e

    def _mark_logpdf(self, kernel: tuple, stay: int, need: float, group: int) -> float:
        """Log of the scored mark distribution's probability of ``stay`` (steps) times its density of ``need`` (kWh;
        or the probability of the cap's atom): ``1 - DEFENSIVE`` of the pool's kernel mixture and ``DEFENSIVE`` of
        the group's broad kernel, ``kernel`` from :meth:`_kernel` (module docstring)."""
        cap = self.group_kw[group] * stay * self.dt
        parts = [_log_mark(k, stay, need, cap) + np.log(share) for k, share in zip(kernel, (1 - DEFENSIVE, DEFENSIVE))]
        return float(np.logaddexp(*parts))


def _log_mark(kernel: tuple, stay: int, need: float, cap: float) -> float:
    """Log-probability of ``stay`` times the log-density of ``need`` (or the cap's atom) under one kernel mixture
    ``(p, log stays, log energies, stay bandwidth, energy bandwidth)``."""
    p, ls, le, h_s, h_e = kernel
    lo = -np.inf if stay <= 1 else (np.log(stay - 0.5) - ls) / h_s
    hi = (np.log(stay + 0.5) - ls) / h_s
    log_ps = _log_diff_ndtr(hi, lo)  # (n,) log P(stay)
    if need >= cap * (1 - 1e-6):  # the cap's atom
        log_pe = special.log_ndtr(-(np.log(cap) - le) / h_e)
    else:
        z = (np.log(max(need, 1e-6)) - le) / h_e
        log_pe = -0.5 * z**2 - np.log(h_e * max(need, 1e-6) * np.sqrt(2 * np.pi))
    return float(special.logsumexp(log_ps + log_pe, b=p))


def _silverman(x: np.ndarray, p: np.ndarray) -> float:
    """Silverman's bandwidth of the values ``x`` with probabilities ``p`` (module docstring)."""
    n_eff = 1.0 / float((p**2).sum())
    if n_eff < 2:
        return DEFAULT_BANDWIDTH
    mean = float((p * x).sum())
    sd = float(np.sqrt((p * (x - mean) ** 2).sum()))
    return max(MIN_BANDWIDTH, 1.06 * sd * n_eff**-0.2)


def _log_diff_ndtr(hi: np.ndarray, lo: np.ndarray | float) -> np.ndarray:
    """``log(Phi(hi) - Phi(lo))`` elementwise, stable in both tails."""
    hi, lo = np.broadcast_arrays(np.asarray(hi, np.float64), np.asarray(lo, np.float64))
    upper = lo > 0  # both in the upper tail: use the survival functions
    a = np.where(upper, special.log_ndtr(-lo), special.log_ndtr(hi))
    b = np.where(upper, special.log_ndtr(-hi), special.log_ndtr(lo))
    with np.errstate(divide="ignore"):
        return a + np.log1p(-np.exp(np.minimum(b - a, 0.0)))
