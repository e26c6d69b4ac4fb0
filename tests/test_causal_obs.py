"""What an agent observes is causal: changing the future (MOER past its forecasts, sessions not yet arrived)
changes no observation up to then.

The observation may read the data's MOER forecasts issued at the current hour (``moer_fc_h0..h2``) and the
modelled PV series ahead (a typical year, known in advance, as the MPC's PV outlook); nothing else ahead.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from envs.evhub import EVHubVectorEnv
from envs.site import Site
from tests.conftest import make_site

CUT = 100
"""Step of the test split from which the future is changed."""


def _perturbed(site: Site, split: str, cut: int, seed: int = 1) -> Site:
    """``site`` with its future changed from step ``cut`` of ``split`` on: the realised MOER of hours >= cut and
    the forecast rows issued after it (the row issued at ``cut`` is known at ``cut``), sessions arriving after
    ``cut`` dropped, and new sessions arriving after it."""
    rng = np.random.default_rng(seed)
    start, _ = site.config.split_bounds(split)
    t_cut = start + pd.Timedelta(hours=cut)
    hourly = site.hourly.copy()
    realised = hourly.time >= t_cut
    issued_later = hourly.time > t_cut
    hourly.loc[realised, "moer_kg_per_kwh"] = rng.uniform(0.0, 1.0, realised.sum()).astype(np.float32)
    for c in ("moer_fc_h0", "moer_fc_h1", "moer_fc_h2"):
        hourly.loc[issued_later, c] = rng.uniform(0.0, 1.0, issued_later.sum()).astype(np.float32)
    sessions = site.sessions[site.sessions.arrival <= t_cut]
    stations = sorted(site.sessions.station_id.unique())
    new = pd.DataFrame(
        {
            "session_id": [f"new{i}" for i in range(20)],
            "station_id": [stations[i % len(stations)] for i in range(20)],
            "arrival": [t_cut + pd.Timedelta(hours=1.5 + 3 * i) for i in range(20)],
            "departure": [t_cut + pd.Timedelta(hours=6.5 + 3 * i) for i in range(20)],
            "energy_kwh": np.full(20, 25.0, np.float32),
            "requested_energy_kwh": np.full(20, 30.0, np.float32),
        }
    )
    for c in ("arrival", "departure"):
        new[c] = new[c].astype(sessions[c].dtype)
    sessions = (
        pd.concat([sessions, new], ignore_index=True).sort_values("arrival", kind="mergesort").reset_index(drop=True)
    )
    return Site(site.config, hourly, sessions, dict(site.source))


def _observations(site: Site, split: str, steps: int, **env_kwargs) -> torch.Tensor:
    """Observations of ``steps`` steps under a fixed, seeded action sequence, shape ``(steps + 1, B, obs_dim)``."""
    env = EVHubVectorEnv(site=site, split=split, dtype=torch.float64, **env_kwargs)
    g = torch.Generator().manual_seed(0)
    obs, _ = env.reset(seed=3, options={"start_steps": [0] * env.num_envs} if not env.full_split else None)
    out = [obs]
    for _ in range(steps):
        if env.action_mode == "discrete":
            a = torch.randint(0, env.single_action_space.n, (env.num_envs,), generator=g)
        else:
            a = torch.rand((env.num_envs, env.single_action_space.shape[0]), generator=g, dtype=torch.float64) * 2 - 1
        obs, *_ = env.step(a)
        out.append(obs)
    return torch.stack(out)


@pytest.mark.parametrize("action_mode", ["hub", "socket", "discrete"])
def test_future_changes_no_observation_up_to_then(action_mode):
    site = make_site(days=10)
    future = _perturbed(site, "test", CUT)
    kw = dict(num_envs=1, full_split=True, action_mode=action_mode, bess_action="surplus")
    a = _observations(site, "test", CUT + 24, **kw)
    b = _observations(future, "test", CUT + 24, **kw)
    torch.testing.assert_close(a[: CUT + 1], b[: CUT + 1], rtol=0, atol=0)
    assert not torch.equal(a[CUT + 1 :], b[CUT + 1 :]), "the perturbation must reach the observation afterwards"


def test_the_first_step_sees_no_realised_moer_of_its_own():
    """At a split's first step the last hour's MOER is not in the split: the observation reads the data's forecast
    for that step, not the MOER realised during it."""
    site = make_site(days=3)
    kw = dict(num_envs=1, full_split=True, action_mode="hub", bess_action="surplus")
    a = _observations(site, "test", 2, **kw)
    b = _observations(_perturbed(site, "test", 0), "test", 2, **kw)
    torch.testing.assert_close(a[:1], b[:1], rtol=0, atol=0)
    assert not torch.equal(a[1:], b[1:])


def test_training_windows_with_session_thinning_are_causal():
    """Training windows (random session thinning, pinned starts) see no more of the future than evaluation."""
    site = make_site(days=10, episode={"train_steps": CUT + 24, "session_keep_min": 0.5})
    future = _perturbed(site, "train", CUT)
    kw = dict(num_envs=4, action_mode="hub", bess_action="surplus")
    a = _observations(site, "train", CUT + 12, **kw)
    b = _observations(future, "train", CUT + 12, **kw)
    torch.testing.assert_close(a[: CUT + 1], b[: CUT + 1], rtol=0, atol=0)
    assert not torch.equal(a[CUT + 1 :], b[CUT + 1 :])
