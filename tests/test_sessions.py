"""The session model (pipeline/control/sessions.py): causal, its draws in ``ScenarioMPC.scenario_sessions``' format
within the window and the socket groups, energies a socket can deliver, a finite log-likelihood, and the rates of a
stationary process recovered."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from conftest import changed_future, make_site

from envs.site import Site
from pipeline.control.sessions import SessionModel

GROUPS = [{"count": 2, "kw": 6.6, "stations": "L2-*"}, {"count": 1, "kw": 50.0, "stations": "DC-*"}]


def group_site(days: int = 10, seed: int = 0) -> Site:
    """Two socket groups: 2 Level-2 sockets of 6.6 kW (``L2-*``, long stays) and one 50 kW DC socket (``DC-*``,
    short stays of 15-45 kWh)."""
    base = make_site(days=days, n_sockets=3, seed=seed)
    rng = np.random.default_rng(seed)
    tz = "America/Los_Angeles"
    rows = []
    for d in range(2 * days):
        day = pd.Timestamp("2019-05-01").tz_localize(tz) + pd.Timedelta(days=d)
        kinds = [("L2", 6, 12, 2.0, 9.0, 2.0, 25.0)] * 2 + [("DC", 8, 18, 0.6, 1.4, 15.0, 45.0)] * 2
        for k, (kind, a0, a1, s0, s1, e0, e1) in enumerate(kinds):
            arr = day + pd.Timedelta(hours=float(rng.uniform(a0, a1)))
            rows.append(
                {
                    "session_id": f"s{d}_{k}",
                    "station_id": f"L2-{k + 1}" if kind == "L2" else "DC-1",
                    "arrival": arr.tz_convert("UTC"),
                    "departure": (arr + pd.Timedelta(hours=float(rng.uniform(s0, s1)))).tz_convert("UTC"),
                    "energy_kwh": np.float32(rng.uniform(e0, e1)),
                    "requested_energy_kwh": np.float32(rng.uniform(e0, e1)),
                }
            )
    s = pd.DataFrame(rows).sort_values(["arrival", "session_id"]).reset_index(drop=True)
    for c in ("arrival", "departure"):
        s[c] = pd.to_datetime(s[c], utc=True).astype("datetime64[ns, UTC]")
    return Site(base.config.replace(ev={"sockets": GROUPS}), base.series, s, dict(base.source))


def test_the_fit_and_the_draws_at_t_do_not_read_what_comes_after_t():
    site = make_site(days=12, n_sockets=6)
    t = 9 * 24 + 10
    other = changed_future(site, "train", t + 1)
    a, b = SessionModel(site.split("train"), half_life_days=7.0), SessionModel(other.split("train"), half_life_days=7.0)
    assert not np.array_equal(a.arrivals, b.arrivals)  # the future did change
    a.fit_to(t)
    b.fit_to(t)
    np.testing.assert_array_equal(a.rates, b.rates)
    np.testing.assert_array_equal(a.dispersion_phi, b.dispersion_phi)
    for x, y in zip(a.draw(t, 24, 5, np.random.default_rng(3)), b.draw(t, 24, 5, np.random.default_rng(3))):
        for f in dataclasses.fields(x):
            np.testing.assert_array_equal(getattr(x, f.name), getattr(y, f.name))
    start = int(a.day_start[9])  # scored up to t, fit before t's day
    assert a.log_likelihood(start, t + 1 - start) == b.log_likelihood(start, t + 1 - start)


def test_draws_have_the_scenario_format_and_respect_window_groups_and_sockets():
    data = group_site().split("train")
    model = SessionModel(data, half_life_days=14.0, band_h=3)
    t, H, K = 7 * 24 + 9, 24, 8
    steps_left = np.array([5, 0, 2])  # socket 0 taken for 5 steps, the DC socket for 2
    scenarios = model.draw(t, H, K, np.random.default_rng(0), steps_left=steps_left)
    assert len(scenarios) == K
    past = {g: set() for g in range(2)}
    fit_n = int(np.searchsorted(model.s_step, model.day_start[model.day_of[t]]))
    for g, stay, need in zip(model.s_group[:fit_n], model.s_stay[:fit_n], model.s_need[:fit_n]):
        past[g].add((int(stay), float(need)))
    drawn = 0
    for x in scenarios:
        arr, end, need, i, weight = x.arrival, x.departure, x.energy_kwh, x.socket, x.weight
        assert arr.dtype == end.dtype == i.dtype == np.int64 and need.dtype == weight.dtype == np.float64
        assert len(arr) == len(end) == len(need) == len(i) == len(weight) == len(x.expected) == len(x.block)
        assert np.all((arr >= 1) & (arr <= H - 1)) and np.all(end > arr) and x.expected.all()
        np.testing.assert_array_equal(weight, 1.0)
        assert np.all(need <= data.socket_kw[i] * (end - arr) * data.config.dt_h + 1e-9) and np.all(need > 0)
        for a, e, n, s in zip(arr, end, need, i):  # each a past session of its socket's group, at a free socket
            assert (int(e - a), float(n)) in past[model.group_of_socket[s]]
            assert a >= steps_left[s]
        for s in range(3):  # no two arrivals on one socket at once
            on = np.flatnonzero(i == s)
            assert np.all(arr[on][1:] >= end[on][:-1])
        drawn += len(arr)
    assert drawn > 0 and any(np.any(x.socket == 2) for x in scenarios)  # the DC group draws too
    # the window stops at the split's end
    T = data.num_steps
    for x in model.draw(T - 3, 24, 4, np.random.default_rng(1)):
        assert np.all(x.arrival <= 2)


def test_log_likelihood_is_finite_from_the_first_day_on():
    for data in (make_site(days=9, n_sockets=4).split("train"), group_site().split("train")):
        for kw in ({"half_life_days": 3.0, "band_h": 3}, {"recent_days": 3, "dispersion": False}):
            model = SessionModel(data, **kw)
            for day in (0, 1, 5):
                ll = model.log_likelihood(int(model.day_start[day]), 48)
                assert all(np.isfinite(v) for v in ll.values()), (kw, day, ll)
                assert ll["arrivals"] > 0 and ll["steps"] == 48


def test_without_forgetting_the_rates_of_a_stationary_process_are_recovered():
    """Poisson arrivals at known rates per local hour (weekdays only) over 60 days: the fit at the end is close."""
    days = 60
    data = make_site(days=days, n_sockets=8, seed=1).split("train")
    local = data.time.tz_convert(data.config.timezone)
    hour, weekend = np.asarray(local.hour), np.asarray(local.day_of_week >= 5)
    true = np.where((hour >= 8) & (hour < 12), 1.5, 0.1) * ~weekend  # arrivals per step
    rng = np.random.default_rng(2)
    n = np.minimum(rng.poisson(true), 8)
    stay = np.zeros((data.num_steps, 8), np.int64)
    stay[np.arange(8)[None] < n[:, None]] = 3
    data = dataclasses.replace(data, arrival_stay_steps=stay, arrival_need_kwh=stay * 2.0)
    model = SessionModel(data, half_life_days=np.inf, dispersion=False)
    model.fit_to(data.num_steps - 1)
    lam = model.rates[0, :, 0]  # weekdays, the one group
    expected = np.where((np.arange(24) >= 8) & (np.arange(24) < 12), 1.5, 0.1)
    weekdays = int((~weekend).sum()) // 24
    empirical = np.array([n[(hour == h) & ~weekend].mean() for h in range(24)])
    np.testing.assert_allclose(lam, empirical, rtol=0.03, atol=0.02)  # the shrinkage to the day type's mean is small
    assert np.all(np.abs(lam - expected) < 5 * np.sqrt(expected / weekdays) + 0.02)  # within 5 Poisson sds
    assert abs(lam[8:12].mean() / 1.5 - 1) < 0.1
    assert np.all(model.rates[1, :, 0] < 0.05)  # no weekend arrivals
    assert model.dispersion_phi.max() == 0.0


def test_bad_settings_are_refused():
    data = make_site(days=3, n_sockets=2).split("train")
    for kw in ({"half_life_days": 0.0}, {"band_h": 0.5}, {"recent_days": -1}, {"prior_steps": 0.0}):
        with pytest.raises(ValueError):
            SessionModel(data, **kw)
    model = SessionModel(data)
    with pytest.raises(ValueError):
        model.draw(5, 0, 1, np.random.default_rng(0))
    with pytest.raises(IndexError):
        model.fit_to(data.num_steps)
    with pytest.raises(RuntimeError):
        _ = model.rates
