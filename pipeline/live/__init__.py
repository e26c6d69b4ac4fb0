"""Live planning: a controller of the study run at a site at its step, sent to its chargers over OCPP 1.6J.

:func:`make_plan` takes a site, a causal controller of the registry and the live state (:class:`LiveState`: the
time, the battery's SOC, the plugged EVs, and the history realised before that time: sessions, MOER, the current MOER
forecast) and returns a :class:`LivePlan`: the battery's set-points over the controller's window and one OCPP 1.6J
``SetChargingProfile.req`` payload per connector with a car (``TxProfile``, ``Absolute``, rate unit W, one period per
step of the site), each validated against the ``ocpp`` package's JSON schema. Given the last plan, it plans anew only
where the study's controller would (each hour's start, a car that came; every step at hourly steps: :func:`held_step`)
and otherwise holds the last plan (:func:`hold`). :func:`main` is the ``evhub-plan`` command (``docs/live.md``).

The live path is the simulated path. The controller is rebuilt from the history alone at every call, as the study's
runs build it over a split: the history becomes a site of its own whose ``test`` split starts at the history's first
local midnight (:func:`history`), everything after the state's time blanked (NaN MOER, no sessions), so a controller
that read the future would plan on NaN. What a controller learns as the hours pass is rebuilt the same way:

- the MOER regression (``mpc`` and the learned planners) refits at the start of every day of its split; it is refit
  day after day from the history's start up to the state's day (:func:`_catch_up`), the same sums in the same order;
- ``mpc_adaptive`` re-chooses its demand weight each week from backtests of the weeks before it; those of the history
  are run here (:func:`pipeline.control.backtest.run_window` on the history) and kept in a cache keyed by what they
  read (:class:`WeekCosts`);
- ``mpc_rl`` sets its parameters at each local midnight from the state then (SOC, the plugged cars' need): the state
  carries it (:attr:`LiveState.day_start`).

Each controller it runs is one entry of :data:`LIVE_CONTROLLERS` (:class:`LiveController`): how it finds the
parameters it starts from (their horizon is its window) and how it makes its plan step from the history.

The first step of a plan, applied through the env, is the step the study's run of that controller takes: the replay
test (``tests/test_plan.py``) steps a split step by step through :func:`make_plan`, each call given the last plan, and
reproduces the report's row.

``--at TIME`` rebuilds a state from the site's own data (:func:`state_at`): the sessions and MOER of the split
holding that step, up to it; the cars plugged in then, each still needing its session's energy (capped at what its
socket can deliver before it leaves: the data do not say how the hours before were charged); the battery at its
initial SOC; the window ends at the split's end, as in the study.
"""

from __future__ import annotations

from pipeline.live.cli import Args, main, quiet_stdout, run
from pipeline.live.controllers import LIVE_CONTROLLERS, REFUSED, LiveController, WeekCosts, answer, supported
from pipeline.live.history import History, history
from pipeline.live.profiles import LivePlan, charging_profile, held_step, hold, make_plan, validate_profile
from pipeline.live.state import (
    STATE_SCHEMA,
    DayStart,
    LiveError,
    LiveState,
    PluggedEV,
    read_state,
    realised_history,
    state_at,
    write_state,
)

__all__ = [
    "LIVE_CONTROLLERS",
    "REFUSED",
    "Args",
    "DayStart",
    "History",
    "LiveController",
    "LiveError",
    "LivePlan",
    "LiveState",
    "PluggedEV",
    "STATE_SCHEMA",
    "WeekCosts",
    "answer",
    "charging_profile",
    "held_step",
    "history",
    "hold",
    "main",
    "make_plan",
    "quiet_stdout",
    "read_state",
    "realised_history",
    "run",
    "state_at",
    "supported",
    "validate_profile",
    "write_state",
]
