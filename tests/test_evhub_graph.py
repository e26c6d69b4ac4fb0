"""EVHub-v0's step as one graph: counter-based random streams per env, no host sync, state updated in place.

``torch.compile(env.step, fullgraph=True)`` must trace the whole step (a graph break fails the compile) and give the
trajectories of the eager step; the batched env must follow N single envs seeded like its members; both ways of
computing the earliest-deadline-first split agree; the energy balance holds in every compiled step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DC_SOCKETS, make_site

from envs.evhub import EVHubVectorEnv
from envs.kpis import balance_residual

THINNED = {"episode": {"train_h": 48, "session_keep_min": 0.5}}
"""Training windows of 48 steps whose sessions are thinned at random: both random draws of the env are in play."""


def random_actions(env: EVHubVectorEnv, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of random actions for ``env`` (hub and socket levels a little past [-1, 1])."""
    gen = torch.Generator().manual_seed(seed)
    if env.action_mode == "discrete":
        return [torch.randint(0, env.single_action_space.n, (env.num_envs,), generator=gen) for _ in range(steps)]
    dim = env.single_action_space.shape[0]
    return [torch.rand(env.num_envs, dim, generator=gen, dtype=torch.float64) * 2.4 - 1.2 for _ in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "action_mode, edf, priors", [("hub", "pairwise", False), ("socket", "sort", False), ("discrete", "sort", True)]
)
def test_the_step_compiles_as_one_graph_and_follows_the_eager_step(action_mode, edf, priors):
    """(The priors' case on a site with a DC socket and a train split over two months: the DC prior's draws and the
    exogenous prior's factors in the graph too.)"""
    site = make_site(days=35 if priors else 7, n_sockets=6, **THINNED, **(DC_SOCKETS if priors else {}))
    kwargs = dict(action_mode=action_mode, edf=edf, dtype=torch.float64, bess_action="surplus")
    kwargs.update(dc_prior=priors, exo_prior=priors)
    eager, graphed = (EVHubVectorEnv(8, site=site, **kwargs) for _ in range(2))
    eager.reset(seed=5)
    graphed.reset(seed=5)
    step = torch.compile(graphed.step, fullgraph=True)  # any graph break raises here
    resets = 0
    for action in random_actions(eager, 300, seed=1):
        expected, got = eager.step(action), step(action)
        for a, b in zip(expected[:4], got[:4]):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)  # float64: the same arithmetic up to fusion
        for key, value in expected[4].items():
            torch.testing.assert_close(got[4][key], value, rtol=1e-9, atol=1e-9, msg=key)
        assert balance_residual({k: v.numpy() for k, v in got[4].items()}).max() < 1e-9
        resets += int(got[3].sum())
    for key in EVHubVectorEnv.STATE_KEYS:  # the random streams and the integer state stay identical
        torch.testing.assert_close(getattr(graphed, key), getattr(eager, key), rtol=1e-9, atol=1e-9, msg=key)
    assert resets >= 8 * 5  # windows of 48 steps: every env started over at least 5 times


@pytest.mark.parametrize("action_mode", ["hub", "socket"])
def test_a_batch_follows_single_envs_seeded_like_its_members(action_mode):
    site = make_site(days=7, n_sockets=5, **THINNED)
    n = 4
    batch = EVHubVectorEnv(n, site=site, action_mode=action_mode, dtype=torch.float64)
    singles = [EVHubVectorEnv(1, site=site, action_mode=action_mode, dtype=torch.float64) for _ in range(n)]
    obs = [batch.reset(seed=11)[0]] + [s.reset(seed=11 + i)[0] for i, s in enumerate(singles)]
    for i in range(n):
        torch.testing.assert_close(obs[1 + i][0], obs[0][i], rtol=0, atol=0)
    for action in random_actions(batch, 200, seed=2):
        out = batch.step(action)
        for i, single in enumerate(singles):
            one = single.step(action[i : i + 1])
            for a, b in zip(out[:4], one[:4]):
                torch.testing.assert_close(b[0], a[i], rtol=0, atol=0)
            for key, value in out[4].items():
                torch.testing.assert_close(one[4][key][0], value[i], rtol=0, atol=0)
    # the windows differ between members: each has a stream of its own
    assert len({int(t) for t in batch.t}) > 1


def test_the_pairwise_earliest_deadline_split_equals_the_sorted_one():
    site = make_site(days=7, n_sockets=9, **THINNED)
    by_sort, pairwise = (EVHubVectorEnv(64, site=site, edf=edf, dtype=torch.float64) for edf in ("sort", "pairwise"))
    by_sort.reset(seed=0)
    pairwise.reset(seed=0)
    gen = torch.Generator().manual_seed(3)
    shared_deadlines = 0
    for _ in range(60):
        action = torch.rand(64, 2, generator=gen, dtype=torch.float64) * 2 - 1
        a, b = by_sort.step(action), pairwise.step(action)
        torch.testing.assert_close(b[0], a[0], rtol=0, atol=1e-9)
        torch.testing.assert_close(b[4]["ev_charge_kw"], a[4]["ev_charge_kw"], rtol=0, atol=1e-9)
        steps = by_sort.ev_steps_left
        shared_deadlines += int(sum(len(set(r[r > 0].tolist())) < int((r > 0).sum()) for r in steps))
    assert shared_deadlines > 0  # ties occurred and were broken alike (by socket index)
    # one state, both ways: the split is earliest-deadline-first and never more than the budget
    floor, cap = pairwise._ev_bounds()
    level = torch.full((64, 1), 0.5, dtype=torch.float64)
    power = pairwise._ev_power(level, floor, cap)
    assert np.allclose((power - floor).sum(1), 0.5 * (cap - floor).sum(1))
    torch.testing.assert_close(power, by_sort._ev_power(level, floor, cap), rtol=0, atol=1e-9)


def test_the_state_dict_holds_the_random_streams_and_loads_in_place():
    site = make_site(days=7, n_sockets=5, **THINNED)
    a, b = EVHubVectorEnv(3, site=site), EVHubVectorEnv(3, site=site)
    a.reset(seed=1)
    b.reset(seed=2)
    for action in random_actions(a, 30, seed=0):
        a.step(action)
    held = {key: getattr(b, key) for key in EVHubVectorEnv.STATE_KEYS}
    b.load_state_dict(a.state_dict())
    assert all(getattr(b, key) is tensor for key, tensor in held.items())  # the same tensors: graphs stay valid
    for action in random_actions(a, 100, seed=4):
        torch.testing.assert_close(b.step(action)[0], a.step(action)[0], rtol=0, atol=0)
    assert not any(isinstance(v, torch.Generator) for v in vars(a).values())
