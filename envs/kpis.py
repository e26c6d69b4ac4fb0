"""Evaluate a policy over a whole split and turn its hourly traces into the study's KPIs.

Every controller of the study (baselines, agents, the oracle) ends as an hourly *traces* table with the
columns of :data:`TRACE_COLUMNS`; :func:`kpis_from_traces` computes the KPIs of one run from it, so they
are defined once for all.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from envs.errors import json_object
from envs.evhub import BESS_ACTIONS, DEFAULT_BESS_ACTION, INFO_KEYS, EVHubVectorEnv
from envs.files import write_parquet, write_text  # noqa: F401  (write_parquet re-exported for the algos)
from envs.site import Site, SplitData

TRACE_COLUMNS = ("time", *INFO_KEYS, "soc", "moer_kg_per_kwh")
"""Columns of a traces table: UTC step start, the flows of :data:`envs.evhub.INFO_KEYS` (kW over the
step, ``co2_kg`` kg: import x MOER, minus export x MOER with ``grid.export_credit = "moer"``;
``unserved_kwh`` kWh), the BESS SOC at the end of the step (fraction) and the carbon intensity of the step
(kg/kWh)."""

KPI_COLUMNS = (
    "co2_kg",
    "co2_export_credit_kg",
    "co2_reduction_pct",
    "gap_closed_vs_rule_pct",
    "saving_vs_oracle_pct",
    "grid_import_kwh",
    "grid_export_kwh",
    "pv_generation_kwh",
    "pv_self_consumption_pct",
    "ev_energy_requested_kwh",
    "ev_energy_delivered_kwh",
    "ev_energy_served_pct",
    "unserved_kwh",
    "sessions_rejected",
    "peak_import_kw",
    "co2_per_kwh_delivered",
    "train_wall_s",
    "env_steps",
    "steps_per_s",
)
"""KPI columns of ``co2_comparison.parquet`` (design notes). ``co2_reduction_pct``, ``gap_closed_vs_rule_pct`` and
``saving_vs_oracle_pct`` need the uncontrolled, rule-based and oracle rows: :func:`add_relative_kpis` fills them.
``co2_kg`` is the site's CO2 under its ``grid.export_credit`` accounting (import x MOER, minus export x MOER
with ``"moer"``); ``co2_export_credit_kg`` is the credit taken off it (0 without one), so the import-only
figure is ``co2_kg + co2_export_credit_kg``."""

BALANCE_TOL = 1e-4
"""Largest allowed energy-balance residual, relative to the step's largest flow (at least 1 kW)."""

Policy = Callable[[torch.Tensor, EVHubVectorEnv], torch.Tensor]
"""A controller: ``policy(obs (1, obs_dim), env) -> action (1, action_dim)``."""


def balance_residual(tr: pd.DataFrame | dict) -> np.ndarray:
    """Energy-balance residual per step, relative to the step's largest flow (dimensionless).

    ``pv - curtailed + import + discharge - (load + ev + charge + export)`` divided by
    ``max(1 kW, largest flow)``; shape ``(T,)``.
    """
    supply = tr["pv_kw"] - tr["pv_curtailed_kw"] + tr["grid_import_kw"] + tr["bess_discharge_kw"]
    demand = tr["load_kw"] + tr["ev_charge_kw"] + tr["bess_charge_kw"] + tr["grid_export_kw"]
    flows = np.maximum.reduce([np.abs(np.asarray(tr[k], dtype=np.float64)) for k in INFO_KEYS if k.endswith("_kw")])
    return np.abs(np.asarray(supply - demand, dtype=np.float64)) / np.maximum(flows, 1.0)


def rollout_traces(
    policy: Policy,
    site: Site,
    split: str,
    action_mode: str = "hub",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    bess_action: str = "setpoint",
    physics_dt_h: float | None = None,
) -> tuple[pd.DataFrame, float]:
    """Run ``policy`` once over the whole split, deterministically, and record its traces, one row per step.

    ``action_mode`` and ``bess_action`` are passed to :class:`~envs.evhub.EVHubVectorEnv`: they must be
    the ones the policy was trained with. With ``physics_dt_h`` the site is simulated at that finer step, the policy
    acting every step of the site (:class:`~envs.evhub.EVHubVectorEnv`'s ``physics_dt_h``); the traces stay one row per
    step (flows the sub-steps' means, CO2 and unserved energy their sums).

    Returns:
        ``(traces, wall_s)``: a DataFrame with :data:`TRACE_COLUMNS`, one row per step, and the
        simulation wall time in seconds.

    Raises:
        RuntimeError: the energy balance is violated by more than :data:`BALANCE_TOL` in some step
            (names the step's time).
    """
    env = EVHubVectorEnv(
        1,
        site=site,
        split=split,
        action_mode=action_mode,
        device=device,
        full_split=True,
        dtype=dtype,
        bess_action=bess_action,
        physics_dt_h=physics_dt_h,
    )
    obs, _ = env.reset(seed=0)
    T = env.data.num_steps
    rows: list[torch.Tensor] = []
    start = time.perf_counter()
    with torch.inference_mode():  # no autograd bookkeeping: 5-20% off a CPU run of one env
        for _ in range(T):
            action = policy(obs, env)
            obs, _, _, _, info = env.step(action)
            rows.append(torch.stack([info[k][0].to(torch.float64) for k in INFO_KEYS]))
    wall = time.perf_counter() - start
    traces = pd.DataFrame(torch.stack(rows).cpu().numpy(), columns=list(INFO_KEYS))
    # SOC from the flows (the env auto-resets after the last step, so its own SOC is gone by then)
    b = site.config.bess
    delta = (b.eta_charge * traces.bess_charge_kw - traces.bess_discharge_kw / b.eta_discharge) * site.config.dt_h
    traces["soc"] = (b.soc_initial * b.capacity_kwh + delta.cumsum()) / max(b.capacity_kwh, 1e-9)
    traces.insert(0, "time", env.data.time)
    traces["moer_kg_per_kwh"] = env.data.moer
    check_balance(traces, f"{split} split")
    return traces, wall


def check_balance(traces: pd.DataFrame, what: str) -> None:
    """Raise ``RuntimeError`` naming the first step whose balance residual exceeds :data:`BALANCE_TOL`."""
    res = balance_residual(traces)
    bad = np.flatnonzero(res > BALANCE_TOL)
    if len(bad):
        i = bad[0]
        raise RuntimeError(f"{what}: energy balance off by {res[i]:.2e} (relative) at {traces.time.iloc[i]}")


def kpis_from_traces(traces: pd.DataFrame, data: SplitData, sessions: SplitData | None = None) -> dict[str, float]:
    """KPIs of one run (see :data:`KPI_COLUMNS`), except the relative ones and the training columns.

    Args:
        traces: the run's traces, one row per step of ``data`` (:data:`TRACE_COLUMNS`).
        data: the split the run covered (its step; the EV energy asked and the rejected sessions).
        sessions: the split whose sessions the run served, where not ``data``'s (a run at a finer physics:
            :meth:`envs.site.Site.physics_split`).

    Returns:
        dict of floats: energies in kWh, CO2 in kg (``co2_kg`` as the traces count it, net of the export
        credit where ``grid.export_credit = "moer"``; ``co2_export_credit_kg`` the credit: export x MOER, or 0),
        percentages in %, peak in kW.
    """
    dt = data.config.dt_h
    sessions = data if sessions is None else sessions
    accepted = sessions.sessions[~sessions.sessions.rejected]
    requested = float(accepted.need_kwh.sum())
    unserved = float(traces.unserved_kwh.sum())
    delivered = float(traces.ev_charge_kw.sum() * dt)
    pv = float(traces.pv_kw.sum() * dt)
    pv_used = float((traces.pv_kw - traces.pv_curtailed_kw - traces.grid_export_kw).sum() * dt)
    co2 = float(traces.co2_kg.sum())
    credit = 0.0
    if data.config.grid.export_credit == "moer":
        credit = float((traces.grid_export_kw * traces.moer_kg_per_kwh).sum() * dt)
    return {
        "co2_kg": co2,
        "co2_export_credit_kg": credit,
        "grid_import_kwh": float(traces.grid_import_kw.sum() * dt),
        "grid_export_kwh": float(traces.grid_export_kw.sum() * dt),
        "pv_generation_kwh": pv,
        "pv_self_consumption_pct": 100.0 * pv_used / pv if pv > 0 else math.nan,
        "ev_energy_requested_kwh": requested,
        "ev_energy_delivered_kwh": delivered,
        "ev_energy_served_pct": 100.0 * delivered / requested if requested > 0 else math.nan,
        "unserved_kwh": unserved,
        "sessions_rejected": float(sessions.sessions.rejected.sum()),
        "peak_import_kw": float(traces.grid_import_kw.max()),
        "co2_per_kwh_delivered": co2 / delivered if delivered > 0 else math.nan,
    }


def add_relative_kpis(table: pd.DataFrame) -> pd.DataFrame:
    """Fill the relative KPIs per split: ``co2_reduction_pct``, ``gap_closed_vs_rule_pct`` and ``saving_vs_oracle_pct``.

    - ``co2_reduction_pct = 100 * (CO2_uncontrolled - CO2) / CO2_uncontrolled``: the CO2 cut against ``uncontrolled``.
    - ``gap_closed_vs_rule_pct = 100 * (CO2_rule_based - CO2) / (CO2_rule_based - CO2_oracle)``: the share of the CO2
      gap between the battery rule (``rule_based``, 0%) and the perfect-foresight ``oracle`` (100%) a controller
      closes; NaN where ``rule_based`` emits no more than the oracle.
    - ``saving_vs_oracle_pct = 100 * (CO2_uncontrolled - CO2) / (CO2_uncontrolled - CO2_oracle)``: the share of the
      oracle's CO2 saving over ``uncontrolled`` (0%) a controller achieves; NaN where the oracle saves nothing.

    Rows with ``controller`` and ``split`` columns; a KPI whose reference rows a split lacks is NaN on that split.
    """
    out = table.copy()
    for c in ("co2_reduction_pct", "gap_closed_vs_rule_pct", "saving_vs_oracle_pct"):
        out[c] = math.nan
    for _split, rows in out.groupby("split"):
        ref = {c: rows.loc[rows.controller == c, "co2_kg"] for c in ("uncontrolled", "rule_based", "oracle")}
        ref = {c: float(v.iloc[0]) for c, v in ref.items() if len(v)}
        oracle = ref.get("oracle", math.nan)
        if "uncontrolled" in ref:
            b = ref["uncontrolled"]
            out.loc[rows.index, "co2_reduction_pct"] = 100.0 * (b - rows.co2_kg) / b
            if b - oracle > 0:
                out.loc[rows.index, "saving_vs_oracle_pct"] = 100.0 * (b - rows.co2_kg) / (b - oracle)
        if ref.get("rule_based", math.nan) - oracle > 0:
            r = ref["rule_based"]
            out.loc[rows.index, "gap_closed_vs_rule_pct"] = 100.0 * (r - rows.co2_kg) / (r - oracle)
    return out


def kpi_row(
    controller: str,
    split: str,
    traces: pd.DataFrame,
    data: SplitData,
    sessions: SplitData | None = None,
    **extra: float,
) -> pd.DataFrame:
    """One-row KPI table for a run, with all :data:`KPI_COLUMNS` (missing ones NaN) plus ``extra``
    (``sessions``: as :func:`kpis_from_traces`)."""
    row = {"controller": controller, "split": split, **{k: math.nan for k in KPI_COLUMNS}}
    row.update(kpis_from_traces(traces, data, sessions))
    row.update(extra)
    return pd.DataFrame([row])


def evaluate_policy(
    policy: Policy,
    site: Site,
    split: str,
    controller: str,
    action_mode: str = "hub",
    device: str | torch.device = "cpu",
    bess_action: str = "setpoint",
    physics_dt_h: float | None = None,
    **extra: float,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run a policy over a whole split and return ``(kpi_row, traces)``; see :func:`rollout_traces` (``physics_dt_h``:
    the site simulated at that finer step; the row then counts the sessions as that physics discretises them).

    ``env_steps`` defaults to the split's step count; ``train_wall_s`` and ``steps_per_s`` stay NaN unless
    given in ``extra`` (a trained agent's figures): no wall-clock measurement goes into the row, so the same
    policy and data give the same row, byte for byte.
    """
    traces, _ = rollout_traces(
        policy, site, split, action_mode, device, bess_action=bess_action, physics_dt_h=physics_dt_h
    )
    data = site.split(split)
    physics = site.physics_split(split) if physics_dt_h is not None and physics_dt_h != data.dt_h else None
    extra = {"env_steps": float(data.num_steps), **extra}
    return kpi_row(controller, split, traces, data, physics, **extra), traces


POLICY_SPEC = "policy.json"
"""Name of the file beside an exported policy that records the env settings it acts in (JSON object with
``env_id``, ``action_mode`` and ``bess_action``)."""


def write_policy_spec(out_dir: str | Path, env_id: str, action_mode: str, bess_action: str) -> Path:
    """Record the env settings of an exported policy in ``out_dir/policy.json`` (written atomically)."""
    spec = {"env_id": env_id, "action_mode": action_mode, "bess_action": bess_action}
    return write_text(Path(out_dir) / POLICY_SPEC, json.dumps(spec, indent=2) + "\n")


def read_policy_spec(run_dir: str | Path) -> dict[str, str]:
    """The env settings an exported policy was trained in: ``{"action_mode", "bess_action"}``.

    Read from ``policy.json``; without it, from the copy embedded in ``policy.pt2`` (extra file ``policy.json``,
    written by every script); without either (a policy from an older version), the scripts' defaults: ``"hub"``
    and :data:`~envs.evhub.DEFAULT_BESS_ACTION`.

    Raises:
        ValueError: the spec is not a JSON object or names an unknown action or BESS action mode (the message names
            the file).
    """
    path = Path(run_dir) / POLICY_SPEC
    spec = {"action_mode": "hub", "bess_action": DEFAULT_BESS_ACTION}
    text = path.read_text() if path.is_file() else None
    program = Path(run_dir) / "policy.pt2"
    if text is None and program.is_file():
        extra = {POLICY_SPEC: ""}
        torch.export.load(str(program), extra_files=extra)
        text, path = extra[POLICY_SPEC] or None, program
    if text is not None:
        raw = json_object(text, str(path))
        spec |= {k: raw[k] for k in spec if k in raw}
    if spec["action_mode"] not in ("hub", "socket"):
        raise ValueError(f"{path}: action_mode must be 'hub' or 'socket', got {spec['action_mode']!r}")
    if spec["bess_action"] not in BESS_ACTIONS:
        raise ValueError(f"{path}: bess_action must be one of {BESS_ACTIONS}, got {spec['bess_action']!r}")
    return spec


def load_policy(path: str | Path, device: str | torch.device = "cpu") -> Policy:
    """Load a deterministic policy exported by an ``algos/*.py`` script.

    Args:
        path: ``policy.pt2`` (``torch.export.save`` of a module mapping float32 observations
            ``(B, obs_dim)`` to actions ``(B, action_dim)`` in the env's units, [-1, 1] for EVHub-v0; see
            ``algos/harness.py``'s ``export_policy``) or ``policy.pt`` (TorchScript).

    Returns:
        a :data:`Policy` usable with :func:`evaluate_policy`.

    Raises:
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy file not found: {path}")
    if path.suffix == ".pt2":
        module = torch.export.load(str(path)).module()
    else:
        module = torch.jit.load(str(path), map_location=device)
    module = module.to(device) if hasattr(module, "to") else module

    def policy(obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
        return module(obs.to(device=device, dtype=torch.float32)).clamp(-1.0, 1.0).to(obs.dtype)

    return policy
