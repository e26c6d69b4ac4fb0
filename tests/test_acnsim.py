"""The uncontrolled caltech site at 5-minute steps, checked against ACN-Sim (``acnportal.acnsim``), a peer simulator.

Both simulators get the test split's sessions (2021-05-01..2021-08-31) as :mod:`envs.site` discretises them at
5 minutes: each session's arrival and departure period, its socket (one ACN-Sim EVSE per socket, whose maximum rate
is the socket's kW expressed in amps at a voltage: 208 V for the Level-2 sockets as in ACN-Sim's own Caltech network,
480 V for the 50 kW DC socket) and its capped need (an ACN-Sim battery of that capacity, empty at arrival: ACN-Sim's
own ACN-Data loader builds its EVs the same way). ACN-Sim charges them with its ``UncontrolledCharging`` algorithm at
5-minute periods; our env runs the ``uncontrolled`` policy (every socket at full power, battery idle) at
``dt_h = 5 / 60``. The two must deliver the same energy in total, per session and per socket and period; and, fed the
energy in the data instead of the capped need, ACN-Sim must deliver our capped need (its physics caps it the same way).

The site's grid import limit (300 kW) never binds here: the EVs of the split draw at most about 90 kW at once. Our run
checks that no EV power was cut; ACN-Sim carries the limit as a network constraint on the EVs' aggregate power (each
EVSE's current weighted by its voltage / 1000, so the constraint reads kW; stricter than ours, which nets the PV) and
warns on any period above it, which the test forbids. ``UncontrolledCharging`` ignores constraints by design, so a
binding limit would show as that warning, not as a cut.

ACN-Sim's conventions met on the way: it floors both the arrival and the departure to periods where it reads ACN-Data
itself (we round both to the nearest step), charges an EV in the periods ``[arrival, departure)`` as our env does, stops
sending a pilot to an EV once less than 1e-3 kWh of its request is left (no session of the split asks for so little)
and caps each period's energy at what fills the battery. It needs at least one network constraint to run at all (its
scheduler interface reads the constraint matrix).

acnportal 0.3.3 imports ``pkg_resources`` (only to write its own version into serialised simulations), which setuptools
82 removed; where it is missing, the import is given a stand-in with that one function.
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
import types
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from envs.evhub import EVHubVectorEnv
from envs.site import Site, load_site, physics_file

pytest.importorskip("acnportal")

DT_H = 5 / 60  # hours: the step of both runs
PERIOD_MIN = 5  # minutes: ACN-Sim's period
SPLIT = "test"
L2_VOLTS, DC_VOLTS = 208.0, 480.0
SESSION_TOL_KWH = 1e-6  # per session; both compute min(kW, need / dt) * dt per period in float64, ~1e-13 kWh apart
PERIOD_TOL_KWH = 1e-9  # per socket and period


def _acnsim():
    """``(acnsim, UncontrolledCharging)``, imported with a ``pkg_resources`` stand-in where setuptools has none."""
    stand_in = None
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("pkg_resources")
        stand_in.require = lambda name: [importlib.metadata.distribution(name)]  # what acnportal reads: .version
        sys.modules["pkg_resources"] = stand_in
    try:
        from acnportal import acnsim
        from acnportal.algorithms import UncontrolledCharging
    finally:
        if stand_in is not None and sys.modules.get("pkg_resources") is stand_in:
            del sys.modules["pkg_resources"]  # acnportal keeps its reference; nothing else sees the stand-in
    return acnsim, UncontrolledCharging


class _MeteredEnv(EVHubVectorEnv):
    """The env, keeping what each socket delivered in the last step, kWh ``(num_envs, n_sockets)``: the drop of the
    cars' need over the dispatch (which updates ``ev_need_kwh`` in place), before departures clear it."""

    def _dispatch(self, *args, **kwargs):
        before = self.ev_need_kwh.clone()
        flows = super()._dispatch(*args, **kwargs)
        self.step_kwh = before - self.ev_need_kwh
        return flows


def site_at_5min() -> Site:
    """The caltech site at 5-minute steps: its physics series, with the MOER as its own forecast (the uncontrolled
    policy reads no observation; the shipped data carry forecasts at 60 and 15 minutes only)."""
    site = load_site("caltech", validate=False)
    physics = pd.read_parquet(physics_file("caltech"))
    series = physics.assign(**{f"moer_fc_h{i}": physics["moer_kg_per_kwh"] for i in range(3)})
    return Site(site.config.replace(dt_h=DT_H), series, site.sessions, {})


def run_ours(site: Site) -> dict:
    """Our uncontrolled run at 5 minutes: per period and socket the energy delivered (kWh, ``(T, N)``), the grid
    import and the EV power asked for and given per period (kW), and the split's data."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one env of 55 sockets: the pool only adds overhead
    try:
        env = _MeteredEnv(1, site, SPLIT, action_mode="socket", dtype=torch.float64, full_split=True)
        T, N = env.data.num_steps, env.n_sockets
        action = torch.ones(1, 1 + N, dtype=torch.float64)
        action[:, 0] = 0.0  # battery idle, every socket at full power: the `uncontrolled` policy in socket mode
        socket_kw = torch.as_tensor(env.data.socket_kw, dtype=torch.float64)
        kwh = torch.zeros(T, N, dtype=torch.float64)
        flows = torch.zeros(T, 3, dtype=torch.float64)  # grid import, EV power asked for (sum of caps), EV power
        with torch.inference_mode():
            env.reset(seed=0)
            for t in range(T):
                asked = torch.minimum(env.ev_need_kwh / DT_H, socket_kw).where(env.ev_steps_left > 0, 0.0).sum()
                _, _, _, _, info = env.step(action)
                kwh[t] = env.step_kwh[0]
                flows[t, 0], flows[t, 1], flows[t, 2] = info["grid_import_kw"][0], asked, info["ev_charge_kw"][0]
    finally:
        torch.set_num_threads(threads)
    return {"kwh": kwh.numpy(), "flows": flows.numpy(), "data": env.data, "limit_kw": env.cfg.grid.import_limit_kw}


def run_acnsim(sessions: pd.DataFrame, energy: np.ndarray, socket_kw: np.ndarray, start: pd.Timestamp, limit_kw: float):
    """ACN-Sim's uncontrolled charging of ``sessions`` (our periods and sockets) asking for ``energy`` kWh each.

    Returns:
        ``(delivered kWh per session, kWh per period and socket (periods, N), warnings it raised)``.
    """
    acnsim, UncontrolledCharging = _acnsim()
    volts = np.where(socket_kw > 20.0, DC_VOLTS, L2_VOLTS)
    amps = socket_kw * 1000.0 / volts
    assert np.array_equal(amps * volts / 1000.0, socket_kw), "the EVSEs' max rates must be the sockets' kW exactly"
    network = acnsim.ChargingNetwork()
    for k in range(len(socket_kw)):
        network.register_evse(acnsim.EVSE(str(k), max_rate=float(amps[k])), float(volts[k]), 0.0)
    ev_kw = acnsim.Current({str(k): float(volts[k]) / 1000.0 for k in range(len(socket_kw))})
    network.add_constraint(ev_kw, limit_kw, name="ev_kw")
    events = []
    for s, e in zip(sessions.itertuples(), energy):
        battery = acnsim.Battery(capacity=float(e), init_charge=0.0, max_power=float(socket_kw[s.socket]))
        ev = acnsim.EV(int(s.arrival_step), int(s.departure_step), float(e), str(s.socket), s.session_id, battery)
        events.append(acnsim.PluginEvent(int(s.arrival_step), ev))
    sim = acnsim.Simulator(
        network, UncontrolledCharging(), acnsim.EventQueue(events), start.to_pydatetime(), PERIOD_MIN, verbose=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim.run()
    delivered = np.array([sim.ev_history[sid].energy_delivered for sid in sessions.session_id])
    per_period = (sim.charging_rates * volts[:, None] / 1000.0 * (PERIOD_MIN / 60)).T
    return delivered, per_period, [str(w.message) for w in caught]


def per_session(kwh: np.ndarray, sessions: pd.DataFrame) -> np.ndarray:
    """Each session's energy, kWh: its socket's column of ``kwh`` over its periods ``[arrival, departure)``."""
    return np.array([kwh[s.arrival_step : s.departure_step, s.socket].sum() for s in sessions.itertuples()])


def worst(diff: np.ndarray, sessions: pd.DataFrame, tol: float) -> str:
    off = np.flatnonzero(np.abs(diff) > tol)
    top = off[np.argsort(-np.abs(diff[off]))][:5]
    shown = sessions.iloc[top].assign(diff_kwh=diff[top])
    return (
        f"{len(off)} of {len(diff)} sessions differ by more than {tol} kWh (largest {np.abs(diff).max():.3g}):\n{shown}"
    )


def simulate_both() -> dict:
    """Our run and ACN-Sim's on the split (and ACN-Sim's on the capped sessions with their energy in the data)."""
    t0 = time.perf_counter()
    ours = run_ours(site_at_5min())
    data = ours["data"]
    sessions = data.sessions[~data.sessions.rejected].reset_index(drop=True)
    start = data.time[0]
    t1 = time.perf_counter()
    acn = run_acnsim(sessions, sessions.need_kwh.to_numpy(), data.socket_kw, start, ours["limit_kw"])
    # the sessions whose need was capped, asking ACN-Sim for their energy in the data: its physics caps them
    capped = sessions[sessions.energy_kwh > sessions.need_kwh].reset_index(drop=True)
    uncapped = run_acnsim(capped, capped.energy_kwh.to_numpy(), data.socket_kw, start, ours["limit_kw"])
    t2 = time.perf_counter()
    print(f"\nours {t1 - t0:.1f} s, ACN-Sim {t2 - t1:.1f} s")
    return {"ours": ours, "sessions": sessions, "capped": capped, "acn": acn, "acn_uncapped": uncapped}


def check_the_import_limit_does_not_bind(runs: dict) -> None:
    ours, sessions = runs["ours"], runs["sessions"]
    grid, asked, given = ours["flows"].T
    assert grid.max() < ours["limit_kw"], f"peak import {grid.max():.2f} kW reaches the limit"
    np.testing.assert_allclose(given, asked, rtol=0, atol=1e-9, err_msg="EV power was cut")
    # our meter agrees with the env's own EV power, and every capped need is served
    np.testing.assert_allclose(ours["kwh"].sum(1), given * DT_H, rtol=0, atol=1e-9)
    assert abs(ours["kwh"].sum() - sessions.need_kwh.sum()) < 1e-6
    *_, messages = runs["acn"]
    assert not [m for m in messages if "Invalid schedule" in m], messages[:3]


def check_total_energy(runs: dict) -> None:
    ours, sessions = runs["ours"], runs["sessions"]
    acn_kwh, *_ = runs["acn"]
    total, peer = ours["kwh"].sum(), acn_kwh.sum()
    print(f"\nEV energy: ours {total:.6f} kWh, ACN-Sim {peer:.6f} kWh, relative difference {(total - peer) / peer:.3g}")
    assert abs(total - peer) <= 1e-3 * peer
    # what it is worth in CO2 too: the EV energy of each period at its MOER
    moer = ours["data"].moer
    _, acn_period, _ = runs["acn"]
    ev_co2, peer_co2 = ours["kwh"].sum(1) @ moer, acn_period.sum(1) @ moer[: len(acn_period)]
    assert abs(ev_co2 - peer_co2) <= 1e-9 * peer_co2
    assert len(sessions) > 1500  # the whole split, not an empty comparison


def check_each_session_and_period(runs: dict) -> None:
    ours, sessions = runs["ours"], runs["sessions"]
    acn_kwh, acn_period, _ = runs["acn"]
    # ACN-Sim sends no pilot to an EV needing 1e-3 kWh or less; ours charges it: none of the split is that small
    assert sessions.need_kwh.min() > 1e-3
    diff = per_session(ours["kwh"], sessions) - acn_kwh
    assert np.all(np.abs(diff) <= SESSION_TOL_KWH), worst(diff, sessions, SESSION_TOL_KWH)
    # the same energy in the same periods at the same socket (ACN-Sim stops at its last event)
    n = len(acn_period)
    assert np.abs(ours["kwh"][n:]).max(initial=0.0) == 0.0
    gap = np.abs(ours["kwh"][:n] - acn_period)
    assert gap.max() <= PERIOD_TOL_KWH, f"{(gap > PERIOD_TOL_KWH).sum()} socket-periods differ, largest {gap.max():.3g}"


def check_acnsim_caps_the_data_energy_as_our_need(runs: dict) -> None:
    # fed the energy in the data, ACN-Sim's battery and EVSE physics deliver what our discretisation caps the need at
    capped = runs["capped"]
    acn_kwh, *_ = runs["acn_uncapped"]
    assert len(capped) > 0
    diff = capped.need_kwh.to_numpy() - acn_kwh
    assert np.all(np.abs(diff) <= SESSION_TOL_KWH), worst(diff, capped, SESSION_TOL_KWH)


@pytest.mark.slow  # two runs of 35,424 periods: about a minute on two busy cores
def test_uncontrolled_at_5min_matches_acnsim():
    # one test, so that pytest-xdist never splits the two simulations over workers and runs them twice
    runs = simulate_both()
    check_the_import_limit_does_not_bind(runs)
    check_total_energy(runs)
    check_each_session_and_period(runs)
    check_acnsim_caps_the_data_energy_as_our_need(runs)
