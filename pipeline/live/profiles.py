"""A live plan (:func:`make_plan`): the battery's set-points and one OCPP 1.6J ``SetChargingProfile.req`` payload per
connector with a car (:func:`charging_profile`), each validated against the ``ocpp`` package's JSON schema
(:func:`validate_profile`), one period per step of the site.

Between plans the last plan holds, as the study's controller holds it
(:meth:`pipeline.control.mpc.MPCController.act`): given the last plan, :func:`make_plan` plans anew only when the
controller would (:func:`held_step`: every step with ``replan = "step"``; else at each hour's start, past the last
plan's window, and whenever a socket's car is not one the last plan saw), and otherwise returns the last plan held at
this step (:func:`hold`): its battery set-point and each car's power for this step, the profiles already sent."""

from __future__ import annotations

import decimal
import json
import math
import time as _time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from envs import timestep
from envs.site import Site, load_site
from pipeline.control import registry
from pipeline.control.mpc import PlannerParams, held_action, step_bounds
from pipeline.control.mpc import held_step as planned_step
from pipeline.live.controllers import (
    PlanInputs,
    WeekCosts,
    answer,
    check_controller,
    horizon_of,
    live_controller,
    results_root,
    tuned_seed,
)
from pipeline.live.history import History, history
from pipeline.live.state import LiveError, LiveState, as_timestamp


@dataclass
class LivePlan:
    """One plan (:func:`make_plan`).

    Attributes:
        issued_at: the state's time (site's local time).
        controller, seed: what planned it (seed None for an unseeded controller).
        dt_h: the step, hours. battery_kw: ``(H,)`` the battery's power per step, kW, + = charge.
        ev_kw: ``(N, H)`` each socket's planned EV power, kW (0 for a free socket).
        action: the env's socket action of the first step (``[a_bess, a_1..a_N]``, set-point battery): applying it
            in the env is applying the plan's first step.
        charging_profiles: one entry per socket with a car: ``socket``, ``station_id`` (the charge point),
            ``connector_id``, ``action`` ("SetChargingProfile") and ``payload`` (the OCPP 1.6J request, validated).
        params: the planner's parameters of this step (None for the baselines).
        wall_s: seconds the plan took.
        steps_left: ``(N,)`` each socket's steps to its car's departure at ``issued_at`` (0: free).
        replan: when its controller plans again (:attr:`pipeline.control.mpc.MPCController.replan`).
        holds: the plan this one holds (:func:`hold`): ``battery_kw`` and ``ev_kw`` are that plan's from this step on,
            ``charging_profiles`` the ones it sent; None: a new plan.
    """

    issued_at: pd.Timestamp
    controller: str
    seed: int | None
    dt_h: float
    battery_kw: np.ndarray
    ev_kw: np.ndarray
    action: np.ndarray
    charging_profiles: list[dict]
    params: PlannerParams | None = None
    wall_s: float = 0.0
    steps_left: np.ndarray | None = None
    replan: str = "hour"
    holds: LivePlan | None = field(default=None, repr=False)

    @property
    def horizon_h(self) -> float:
        """The window planned, hours."""
        return len(self.battery_kw) * self.dt_h

    def to_json(self) -> dict:
        """The plan as the command writes it (``docs/live.md``); a plan held (:attr:`holds`) also names when the plan
        it holds was made (``holds``)."""
        doc = {
            "issued_at": self.issued_at.isoformat(),
            "controller": self.controller,
            "seed": self.seed,
            "horizon_h": self.horizon_h,
            "step_h": self.dt_h,
            "battery_kw": [round(float(x), 4) + 0.0 for x in self.battery_kw],  # (+ 0.0: no -0.0)
            "charging_profiles": self.charging_profiles,
        }
        if self.holds is not None:
            doc["holds"] = self.holds.issued_at.isoformat()
        return doc


def _ocpp_validator():
    from ocpp.messages import MessageType, get_validator

    return get_validator(MessageType.Call, "SetChargingProfile", "1.6", parse_float=decimal.Decimal)


def validate_profile(payload: dict) -> None:
    """Check a ``SetChargingProfile.req`` payload against OCPP 1.6J's JSON schema (the ``ocpp`` package's), numbers
    read as decimals (the schema's ``multipleOf: 0.1``).

    Raises:
        ValueError: the first schema violation, with its path in the payload.
    """
    inst = json.loads(json.dumps(payload), parse_float=decimal.Decimal)
    errors = sorted(_ocpp_validator().iter_errors(inst), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ValueError(f"SetChargingProfile.req {'/'.join(map(str, e.absolute_path))}: {e.message}")


def charging_profile(
    issued_at: pd.Timestamp, socket: int, connector_id: int, kw: np.ndarray, socket_kw: float, dt_h: float,
    transaction_id: int | None = None,
) -> dict:  # fmt: skip
    """The OCPP 1.6J ``SetChargingProfile.req`` payload of one connector: a ``TxProfile`` (``Absolute``, from
    ``issued_at``), one period per step of ``kw`` (kW, the car's stay within the window; a step of ``dt_h`` hours:
    ``startPeriod`` every ``dt_h * 3600`` s) as a limit in W rounded to 0.1 W and never above the socket's power;
    ``chargingProfileId`` is ``1 + socket`` (a new plan replaces the connector's last one), ``stackLevel`` 0."""
    step_s = 60 * timestep.step_minutes(dt_h)
    cap_w = math.floor(socket_kw * 10000.0 + 1e-6) / 10.0
    limits = [round(float(p) * 1000.0, 1) for p in kw]
    periods = [
        {"startPeriod": k * step_s, "limit": min(w, cap_w) if w > 0 else 0.0} for k, w in enumerate(limits)
    ]  # (0.0, never -0.0)
    profile = {
        "chargingProfileId": 1 + int(socket),
        "stackLevel": 0,
        "chargingProfilePurpose": "TxProfile",
        "chargingProfileKind": "Absolute",
        "chargingSchedule": {
            "duration": step_s * len(periods),
            "startSchedule": issued_at.tz_convert("UTC").strftime("%Y-%m-%dT%H:%M:%SZ"),
            "chargingRateUnit": "W",
            "chargingSchedulePeriod": periods,
        },
    }
    if transaction_id is not None:
        profile = {
            "chargingProfileId": profile.pop("chargingProfileId"),
            "transactionId": int(transaction_id),
        } | profile
    return {"connectorId": int(connector_id), "csChargingProfiles": profile}


def held_step(last: LivePlan | None, hist: History, controller: str, seed: int | None) -> int | None:
    """The step of ``last``'s window that the state of ``hist`` holds, or None when a new plan is due: the rule of
    :meth:`pipeline.control.mpc.MPCController.act`. A new plan without a last one, for another controller or seed, at
    every step with ``replan = "step"``, at each hour's start (every step at hourly steps), at or past the end of the
    last plan's window, and when a socket's car is not one the last plan saw (its steps to departure are not the last
    plan's, counted down: a car came, left before its time, or changed its departure).

    Args:
        last: the last plan (a plan held: the plan it holds). hist: the state's history (:func:`history`).
        controller, seed: what plans now.
    """
    if last is None:
        return None
    last = last.holds or last
    cfg = hist.data.config
    if (last.controller, last.seed, last.replan, last.dt_h) != (controller, seed, "hour", cfg.dt_h):
        return None
    if last.steps_left is None:
        return None
    j = (hist.data.time[hist.t] - last.issued_at.tz_convert("UTC")) / pd.Timedelta(timestep.step_timedelta(cfg.dt_h))
    if j != int(j):
        return None
    hour = timestep.steps_per_hour(cfg.dt_h)
    return planned_step(hist.t, hist.ev_steps_left, hist.t - int(j), last.steps_left, len(last.battery_kw), hour)


def hold(last: LivePlan, j: int, hist: History, issued_at: pd.Timestamp) -> LivePlan:
    """``last`` held at step ``j`` of its window, the state's step (:func:`held_step`), as
    :meth:`pipeline.control.mpc.MPCController.act` holds a plan: the battery at the plan's set-point for the step, each
    plugged car at the plan's power for the step mapped to the env's action between this step's floor and cap (the
    env's least-laxity floor, :meth:`pipeline.control.mpc.MPCController.step0_bounds`); the window and profiles are the
    plan's (the chargers hold the profiles they were sent)."""
    last = last.holds or last
    cfg = hist.data.config
    left = hist.ev_steps_left
    cap, floor = step_bounds(hist.ev_need_kwh, left, hist.data.socket_kw, cfg.dt_h, cfg.ev.deadline_floor)
    action = held_action(last.battery_kw[j], last.ev_kw[:, j], cap, floor, cfg.bess.power_kw)
    return LivePlan(
        issued_at=issued_at,
        controller=last.controller,
        seed=last.seed,
        dt_h=last.dt_h,
        battery_kw=last.battery_kw[j:],
        ev_kw=last.ev_kw[:, j:],
        action=action,
        charging_profiles=last.charging_profiles,
        params=last.params,
        steps_left=np.asarray(left, np.int64).copy(),
        replan=last.replan,
        holds=last,
    )


def make_plan(
    site: Site | str | Path,
    state: LiveState,
    controller: str | None = None,
    *,
    seed: int | None = None,
    output_dir: str | Path = "outputs",
    experiment: str = "",
    week_costs: WeekCosts | None = None,
    last: LivePlan | None = None,
) -> LivePlan:
    """Plan from the live state: the function behind ``evhub-plan`` (module docstring).

    Args:
        site: a site or anything :func:`envs.site.load_site` accepts.
        state: the live state.
        controller: a causal controller of the registry (:func:`supported`); None: the report's answer for the site,
            read from its results (:func:`answer`).
        seed: the study's seed of a tuned controller (default: the lowest one tuned).
        output_dir, experiment: where the study's results and tuning are (``<output_dir>/<experiment>/``).
        week_costs: ``mpc_adaptive``'s cache of week backtests (default: ``<experiment>/live/``).
        last: the last plan made (or held) at the site: where the controller would hold it at the state's step
            (:func:`held_step`), it is held (:func:`hold`) and no new plan is made; None: a new plan.

    Returns:
        the :class:`LivePlan`, its profiles validated against OCPP 1.6J (a plan held: :attr:`LivePlan.holds` set).

    Raises:
        LiveError: a bad state or request (the message names the field and the value): an unknown or refused
            controller, no results to read the answer from, no tuning, a bad state (:func:`history`).
    """
    t0 = _time.perf_counter()
    site = load_site(site)
    name = controller or answer(site, output_dir, experiment)
    try:
        check_controller(name)
    except LiveError as exc:
        if controller:
            raise
        raise LiveError(f"{exc} (it is the report's answer for site {site.config.name!r}: pass --controller)") from None
    root = results_root(site, output_dir, experiment)
    tuned_dir = root / "tuned"
    seed = tuned_seed(name, tuned_dir, seed) if registry.CONTROLLERS[name].tuned else None
    params, H = horizon_of(site, name, tuned_dir, seed)
    hist = history(site, state, H)
    cfg = site.config
    issued = as_timestamp(state.time, "time").tz_convert(cfg.timezone)
    j = held_step(last, hist, name, seed)
    if j is not None:
        held = hold(last, j, hist, issued)
        held.wall_s = _time.perf_counter() - t0
        return held
    step = live_controller(name).plan(PlanInputs(hist, params, tuned_dir, seed, root / "live", week_costs))
    profiles = []
    for i in np.flatnonzero(hist.ev_steps_left > 0):
        n = min(int(hist.ev_steps_left[i]), len(step.bess_kw))
        payload = charging_profile(
            issued, int(i), hist.connectors[i], step.ev_kw[i, :n], float(hist.data.socket_kw[i]), cfg.dt_h,
            hist.transactions[i],
        )  # fmt: skip
        validate_profile(payload)
        profiles.append(
            {
                "socket": int(i),
                "station_id": hist.stations[i],
                "connector_id": hist.connectors[i],
                "action": "SetChargingProfile",
                "payload": payload,
            }
        )
    return LivePlan(
        issued_at=issued,
        controller=name,
        seed=seed,
        dt_h=cfg.dt_h,
        battery_kw=np.asarray(step.bess_kw, np.float64),
        ev_kw=np.asarray(step.ev_kw, np.float64),
        action=np.asarray(step.action, np.float64),
        charging_profiles=profiles,
        params=step.params,
        wall_s=_time.perf_counter() - t0,
        steps_left=hist.ev_steps_left.copy(),
        replan=step.replan,
    )
