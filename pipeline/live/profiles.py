"""A live plan (:func:`make_plan`): the battery's set-points and one OCPP 1.6J ``SetChargingProfile.req`` payload per
connector with a car (:func:`charging_profile`), each validated against the ``ocpp`` package's JSON schema
(:func:`validate_profile`)."""

from __future__ import annotations

import decimal
import json
import math
import time as _time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from envs.site import Site, load_site
from pipeline.control import registry
from pipeline.control.mpc import PlannerParams
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
from pipeline.live.history import history
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

    @property
    def horizon_h(self) -> float:
        """The window planned, hours."""
        return len(self.battery_kw) * self.dt_h

    def to_json(self) -> dict:
        """The plan as the command writes it (``docs/live.md``)."""
        return {
            "issued_at": self.issued_at.isoformat(),
            "controller": self.controller,
            "seed": self.seed,
            "horizon_h": self.horizon_h,
            "step_h": self.dt_h,
            "battery_kw": [round(float(x), 4) + 0.0 for x in self.battery_kw],  # (+ 0.0: no -0.0)
            "charging_profiles": self.charging_profiles,
        }


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
    ``issued_at``), one period per step of ``kw`` (kW, the car's stay within the window) as a limit in W rounded to
    0.1 W and never above the socket's power; ``chargingProfileId`` is ``1 + socket`` (a new plan replaces the
    connector's last one), ``stackLevel`` 0."""
    step_s = int(round(dt_h * 3600))
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


def make_plan(
    site: Site | str | Path,
    state: LiveState,
    controller: str | None = None,
    *,
    seed: int | None = None,
    output_dir: str | Path = "outputs",
    experiment: str = "",
    week_costs: WeekCosts | None = None,
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

    Returns:
        the :class:`LivePlan`, its profiles validated against OCPP 1.6J.

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
    step = live_controller(name).plan(PlanInputs(hist, params, tuned_dir, seed, root / "live", week_costs))
    cfg = site.config
    issued = as_timestamp(state.time, "time").tz_convert(cfg.timezone)
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
    )
