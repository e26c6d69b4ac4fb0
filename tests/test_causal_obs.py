"""What an agent observes is causal: changing the future (MOER past its forecasts, sessions not yet arrived)
changes no observation up to then.

The observation may read the data's MOER forecasts issued at the current hour (``moer_fc_h0..h2``) and the
modelled PV series ahead (a typical year, known in advance, as the MPC's PV outlook); nothing else ahead.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_site
from conftest import observations as _observations
from conftest import perturbed_future as _perturbed

CUT = 100
"""Step of the test split from which the future is changed."""


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
    site = make_site(days=10, episode={"train_h": CUT + 24, "session_keep_min": 0.5})
    future = _perturbed(site, "train", CUT)
    kw = dict(num_envs=4, action_mode="hub", bess_action="surplus")
    a = _observations(site, "train", CUT + 12, **kw)
    b = _observations(future, "train", CUT + 12, **kw)
    torch.testing.assert_close(a[: CUT + 1], b[: CUT + 1], rtol=0, atol=0)
    assert not torch.equal(a[CUT + 1 :], b[CUT + 1 :])
