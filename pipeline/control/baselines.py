"""Baseline controllers, run through the environment like any agent (hub action mode).

* ``uncontrolled``: every EV charges at full power from arrival until full; the BESS stays idle; PV serves
  the load first (the environment's dispatch), surplus is curtailed or exported.
* ``rule_based``: EVs as uncontrolled; the BESS charges from the PV surplus and discharges to cover the
  deficit (self-consumption rule, the usual default of home and site battery controllers).
"""

from __future__ import annotations

import pandas as pd
import torch

from envs.evhub import EVHubVectorEnv
from envs.kpis import evaluate_policy
from envs.site import Site


def uncontrolled(obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
    """Hub action ``[0, 1]`` per env: BESS idle, EV power at its cap. Shape ``(num_envs, 2)``."""
    a = torch.zeros(env.num_envs, 2, dtype=obs.dtype, device=obs.device)
    a[:, 1] = 1.0
    return a


def rule_based(obs: torch.Tensor, env: EVHubVectorEnv) -> torch.Tensor:
    """Hub action: EVs at full power, BESS set-point = (PV - load - EV) / BESS power, clipped to [-1, 1].

    A positive surplus charges the battery, a deficit discharges it; shape ``(num_envs, 2)``.
    """
    look = env.power_outlook()
    surplus = look["pv_kw"] - look["load_kw"] - look["ev_max_kw"]
    a_bess = (surplus / max(env.cfg.bess.power_kw, 1e-9)).clamp(-1.0, 1.0)
    return torch.stack([a_bess, torch.ones_like(a_bess)], dim=1).to(obs.dtype)


POLICIES = {"uncontrolled": uncontrolled, "rule_based": rule_based}
"""Baseline policies by name: ``policy(obs, env) -> hub action``."""


def simulate(site: Site, split: str, name: str, physics_dt_h: float | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the baseline ``name`` over a whole split through the env (hub actions); ``(kpi_row, traces)`` of
    :func:`envs.kpis.evaluate_policy` (``physics_dt_h``: the site simulated at that finer step), ``train_wall_s = 0``.

    Raises:
        KeyError: unknown baseline or split. RuntimeError: an energy-balance violation.
    """
    return evaluate_policy(POLICIES[name], site, split, name, train_wall_s=0.0, physics_dt_h=physics_dt_h)
